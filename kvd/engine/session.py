"""A session: one connected client process and what it holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.engine.admission import Account
from kvd.engine.block import Block

if TYPE_CHECKING:
    from kvd.engine.namespace import Namespace
    from kvd.engine.sequence import Sequence

__all__ = ["Session"]


class Session(Account):
    """A client's sequences (ids scoped to the session) and pins, in one
    namespace and with one adapter identity, fixed at open.

    ``pending`` holds the sources of copies named in the session's last
    reply: each keeps one ref (and one block of usage) until the session's
    next engine call, by which time the client has copied from it."""

    __slots__ = ("adapter", "namespace", "pending", "pins", "seqs", "sid")

    def __init__(
        self, sid: int, namespace: Namespace, adapter: str | None, quota: int | None, minimum: int
    ) -> None:
        super().__init__(quota, minimum)
        self.sid = sid
        self.namespace = namespace
        self.adapter = adapter
        self.seqs: dict[str, Sequence] = {}
        self.pins: dict[int, list[Block]] = {}
        self.pending: list[Block] = []

    def __repr__(self) -> str:
        return f"Session({self.sid}, namespace={self.namespace.name!r}, seqs={len(self.seqs)})"
