"""kvd_client.errors: one class per wire code, one table."""

from __future__ import annotations

import pytest
from kvd_client import errors as E
from kvd_client.wire import Code


def test_every_wire_code_has_its_own_class() -> None:
    assert set(E.ERRORS) == {str(c) for c in Code}
    assert len(set(E.ERRORS.values())) == len(Code)


@pytest.mark.parametrize("code", list(Code))
def test_error_from_reply_builds_the_class_of_the_code(code: Code) -> None:
    exc = E.error_from_reply(str(code), "because")
    assert type(exc) is E.ERRORS[code]
    assert exc.code == code
    assert exc.message == "because"
    assert str(exc) == f"{code}: because"


def test_unknown_code_keeps_its_text_on_the_base_class() -> None:
    exc = E.error_from_reply("NEW_CODE", "from a newer daemon")
    assert type(exc) is E.KvdError
    assert exc.code == "NEW_CODE"


def test_capacity_refusals_share_the_refused_base() -> None:
    assert issubclass(E.OutOfBlocks, E.RefusalError)
    assert issubclass(E.QuotaExceeded, E.RefusalError)
    assert not issubclass(E.NotFound, E.RefusalError)


def test_pythonic_bases_for_invalid_input_lookup_and_connection() -> None:
    assert issubclass(E.InvalidRequest, ValueError)
    assert issubclass(E.NotFound, LookupError)
    assert issubclass(E.DaemonUnavailable, ConnectionError)


def test_daemon_unavailable_names_the_address_and_timeout() -> None:
    exc = E.DaemonUnavailable("ipc:///run/kvd/kvd.sock", 1.5)
    assert exc.code == E.UNAVAILABLE
    assert exc.address == "ipc:///run/kvd/kvd.sock"
    assert "ipc:///run/kvd/kvd.sock" in str(exc)
    assert "1.5 s" in str(exc)
