"""Error codes and exceptions."""

from __future__ import annotations

import pytest
from kvd_client.wire import Code as WireCode

from kvd.engine import Code, EngineError, ExistsError, InvalidError, InvariantError, NotFoundError


def test_engine_codes_are_wire_codes() -> None:
    assert {c.value for c in Code} <= {c.value for c in WireCode}


@pytest.mark.parametrize(
    ("cls", "code"),
    [(NotFoundError, "NOT_FOUND"), (ExistsError, "EXISTS"), (InvalidError, "INVALID")],
)
def test_each_error_carries_its_code(cls: type[EngineError], code: str) -> None:
    err = cls("what went wrong")
    assert err.code == code
    assert err.message == "what went wrong"
    assert str(err) == f"{code}: what went wrong"


def test_invariant_error_lists_every_problem() -> None:
    err = InvariantError(["one", "two"])
    assert err.problems == ["one", "two"]
    assert "- one" in str(err) and "- two" in str(err)
