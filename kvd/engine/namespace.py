"""A namespace: one isolation domain of the prefix cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.engine.admission import Account
from kvd.engine.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from kvd.engine.session import Session

__all__ = ["Namespace"]


class Namespace(Account):
    """A tenant, adapter family or model revision: blocks of different
    namespaces never match (the name salts block 0's hash *and* each
    namespace has its own index). ``epoch`` is bumped by a flush; sequences
    of an older epoch never publish. Also counts its prefix queries."""

    __slots__ = ("epoch", "hit_tokens", "index", "name", "queries", "query_tokens", "sessions")

    def __init__(self, name: str, quota: int | None = None, minimum: int = 0) -> None:
        super().__init__(quota, minimum)
        self.name = name
        self.index = PrefixIndex(name)
        self.epoch = 0
        self.sessions: set[Session] = set()
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    def __repr__(self) -> str:
        return f"Namespace({self.name!r}, cached={len(self.index)}, epoch={self.epoch})"
