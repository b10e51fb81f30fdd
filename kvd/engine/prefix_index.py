"""The prefix index of one namespace: block key -> cached block."""

from __future__ import annotations

from collections.abc import Sequence

from kvd.engine.block import Block

__all__ = ["PrefixIndex"]


class PrefixIndex(dict[bytes, Block]):
    """Maps each cached block's key to the one block that holds it.

    A plain dict underneath (lookups and inserts stay C calls). One block
    per key: a block whose key is already present stays private. ``owner``
    names the namespace it belongs to (so an index emptied by eviction can
    be traced back to its namespace).
    """

    __slots__ = ("owner",)

    def __init__(self, owner: str = "") -> None:
        super().__init__()
        self.owner = owner

    def match(self, keys: Sequence[bytes]) -> list[Block]:
        """The blocks of the longest run of leading ``keys`` present."""
        found = list(map(self.get, keys))
        try:  # noqa: SIM105 - one scan; a context manager costs more than the match
            del found[found.index(None) :]
        except ValueError:  # every key matched
            pass
        return found  # type: ignore[return-value]
