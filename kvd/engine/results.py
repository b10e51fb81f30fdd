"""What the engine's operations return: plain records, refusals included."""

from __future__ import annotations

from dataclasses import dataclass

from kvd.engine.errors import Code

__all__ = [
    "Allocation",
    "Appended",
    "Committed",
    "Forked",
    "Granted",
    "Looked",
    "Pinned",
    "Refusal",
    "Truncated",
]


@dataclass(slots=True)
class Refusal:
    """The pool or a quota cannot serve the request now; nothing changed."""

    code: Code
    message: str


@dataclass(slots=True)
class Allocation:
    """A new sequence: its block table, the tokens served from the prefix
    cache, and the blocks still held in reserve for its growth."""

    table: list[int]
    num_cached_tokens: int
    reserved_blocks: int


@dataclass(slots=True)
class Committed:
    """The sequence's committed tokens now, and how many blocks this call
    made matchable through the prefix cache."""

    committed: int
    cached_blocks: int


@dataclass(slots=True)
class Appended:
    """``table[start:] = blocks``; copy each ``(src, dst)`` in ``copies``
    before writing; ``length`` is the sequence's new token count."""

    start: int
    blocks: list[int]
    copies: list[tuple[int, int]]
    length: int


@dataclass(slots=True)
class Forked:
    """The child's block table (every block shared with the parent)."""

    table: list[int]


@dataclass(slots=True)
class Truncated:
    """The sequence's new length; ``table[:num_blocks]`` remains."""

    length: int
    num_blocks: int


@dataclass(slots=True)
class Pinned:
    """A pin's id and how many blocks it holds."""

    pin_id: int
    blocks: int


@dataclass(slots=True)
class Looked:
    """A lookup: how many leading keys are cached, and (held) their blocks and hold."""

    cached: int
    blocks: list[int]
    #: The hold keeping ``blocks`` (0: nothing held).
    hold_id: int


@dataclass(slots=True)
class Granted:
    """Fresh blocks held for the caller to write, and the hold keeping them."""

    hold_id: int
    blocks: list[int]
