"""The daemon shell: anyio + zmq around the engine and the pools' memory.

Only `kvd.cli` imports this package (an import-linter contract).

The daemon is `kvd.server.daemon.Daemon`; this package imports nothing, so
its modules import each other without a cycle through it.
"""
