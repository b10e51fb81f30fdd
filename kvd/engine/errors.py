"""Error codes and exceptions of the engine.

Caller mistakes raise an `EngineError` subclass carrying a stable `code`,
always before any state changes. Capacity outcomes are not exceptions: they
are `kvd.engine.results.Refusal` values. The code strings equal the wire's
``kvd_client.wire.Code`` values (a test checks); they are defined here
because the engine must not import the wire contract.
"""

from __future__ import annotations

import enum
from typing import ClassVar

__all__ = [
    "Code",
    "EngineError",
    "ExistsError",
    "InvalidError",
    "InvariantError",
    "NotFoundError",
]


class Code(enum.StrEnum):
    """The engine's stable outcome codes (a subset of the wire's ``Code``)."""

    #: The pool cannot serve the blocks (or the reservation) now.
    OUT_OF_BLOCKS = "OUT_OF_BLOCKS"
    #: A session's or namespace's hard quota would be exceeded.
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    #: A session would hold more block references (holds and pins) than allowed.
    TOO_LARGE = "TOO_LARGE"
    #: No such session, sequence or pin (or it belongs to another session).
    NOT_FOUND = "NOT_FOUND"
    #: A session or sequence with that id already exists.
    EXISTS = "EXISTS"
    #: An argument is of the wrong type or out of range.
    INVALID = "INVALID"


class EngineError(Exception):
    """A caller mistake; raised before anything changed."""

    code: ClassVar[Code]

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.code}: {message}")
        self.message = message


class NotFoundError(EngineError):
    """The session, sequence or pin does not exist."""

    code = Code.NOT_FOUND


class ExistsError(EngineError):
    """A session or sequence with that id already exists."""

    code = Code.EXISTS


class InvalidError(EngineError):
    """An argument is of the wrong type or out of range."""

    code = Code.INVALID


class InvariantError(AssertionError):
    """`Engine.check_invariants` found the state inconsistent (a bug)."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(
            f"{len(problems)} invariant violation(s):\n" + "\n".join(f"- {p}" for p in problems)
        )
        self.problems = problems
