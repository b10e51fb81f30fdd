"""Tests of the client library (kvd_client) and kvd-ctl."""
