"""The prefix index of one namespace: block key -> cached block."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvd.engine.block import Block

__all__ = ["PrefixIndex"]


#: Keys looked up in the first chunk of a match (then twice as many each time).
_FIRST_CHUNK: Final = 16


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

    def match(self, keys: Sequence[bytes], stop: int | None = None) -> list[Block]:
        """The blocks of the longest run of leading ``keys`` present, among
        the first ``stop`` (all when None; a bound, not a copy of the keys).

        Looked up in doubling chunks (C-level ``map`` over each), so a miss
        stops the scan within twice the hit's length: a 4,096-block prompt
        that misses at once costs one chunk, not 4,096 lookups."""
        get = self.get
        found: list[Block] = []
        n = len(keys) if stop is None else min(stop, len(keys))
        start, step = 0, _FIRST_CHUNK
        while start < n:
            chunk = list(map(get, keys[start : min(start + step, n)]))
            try:
                del chunk[chunk.index(None) :]
            except ValueError:  # every key of the chunk matched
                found += chunk  # type: ignore[arg-type]
                start += step
                step *= 2
                continue
            found += chunk  # type: ignore[arg-type]
            break
        return found

    def insert(
        self, blocks: Sequence[Block], keys: Sequence[bytes], first: int = 0
    ) -> tuple[list[Block], list[tuple[int, int]]]:
        """Index each unkeyed block of ``blocks`` under its key unless the key is
        taken (that block stays private: one block per key).

        Returns the blocks indexed and the runs ``[start, end)`` of consecutive
        indexed positions, counted from ``first`` (one stored event per run).
        """
        stored: list[Block] = []
        runs: list[tuple[int, int]] = []
        run = -1
        for i, (block, key) in enumerate(zip(blocks, keys, strict=True), first):
            if block.key is None and key not in self:
                self[key] = block
                block.key = key
                block.index = self
                stored.append(block)
                if run < 0:
                    run = i
                continue
            if run >= 0:
                runs.append((run, i))
                run = -1
        if run >= 0:
            runs.append((run, first + len(blocks)))
        return stored, runs
