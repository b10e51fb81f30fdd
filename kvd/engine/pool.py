"""The block pool: every block, the free stack and the eviction queue."""

from __future__ import annotations

from collections.abc import Iterable

from kvd.engine.block import Block
from kvd.engine.free_list import BlockQueue
from kvd.engine.prefix_index import PrefixIndex

__all__ = ["BlockPool"]


class BlockPool:
    """Owns the blocks of one pool and moves them between three states.

    - *free*: ``ref == 0`` and no key, on the ``free`` stack (taken first,
      most recently freed first: its memory is likely still warm);
    - *evictable*: ``ref == 0`` with a key, in the ``lru`` queue, least
      recently released at the head (still matchable until taken);
    - *in use*: ``ref > 0``.

    Every method is O(1) per block touched. Callers check capacity first
    (`available`), so nothing here can fail halfway.
    """

    __slots__ = ("blocks", "emptied", "evictions", "free", "lru", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Reversed so that the first allocations get blocks 0, 1, 2, ...
        self.free: list[Block] = self.blocks[::-1]
        self.lru = BlockQueue()
        self.evictions = 0
        #: Indexes that evictions in `take` left empty, for the owner to collect.
        self.emptied: list[PrefixIndex] = []

    def available(self) -> int:
        """Blocks that can be taken now: free plus evictable."""
        return len(self.free) + self.lru.size

    def take(self, n: int, removed: list[bytes]) -> list[Block]:
        """``n`` blocks with ``ref == 1``: free ones first, then the least
        recently released evictable ones, whose keys leave their index at
        once and are appended to ``removed`` (an index they leave empty is
        appended to ``emptied``). Requires ``n <= available()``."""
        free = self.free
        k = len(free)
        if n <= k:
            # Reversed slice: the top of the stack first.
            taken = free[-1 : -n - 1 : -1]
            del free[k - n :]
        else:
            taken = free[::-1]
            free.clear()
            victims = self.lru.popleft(n - k)
            note = removed.append
            for block in victims:
                # Evictable blocks are keyed and indexed (check_invariants).
                index = block.index
                del index[block.key]  # type: ignore[union-attr,arg-type]
                if not index and isinstance(index, PrefixIndex):
                    self.emptied.append(index)
                note(block.key)  # type: ignore[arg-type]
                block.key = None
                block.index = None
            taken += victims
            self.evictions += n - k
        for block in taken:
            block.ref = 1
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a holder to each block, pulling evictable ones off the queue."""
        lru = self.lru
        for block in blocks:
            if block.ref == 0:
                lru.remove(block)
            block.ref += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop a holder from each block; blocks reaching ``ref == 0`` become
        evictable (keyed: queued in the given order) or free (unkeyed)."""
        lru = self.lru
        tail = lru.tail
        last = tail.prev
        assert last is not None
        free_push = self.free.append
        queued = 0
        for block in blocks:
            ref = block.ref - 1
            block.ref = ref
            if ref == 0:
                if block.key is None:
                    free_push(block)
                else:
                    last.next = block
                    block.prev = last
                    last = block
                    queued += 1
        if queued:
            last.next = tail
            tail.prev = last
            lru.size += queued

    def drop_key(self, block: Block) -> None:
        """Take ``block`` out of the prefix cache (its index entry is the
        caller's business); an evictable block becomes free at once."""
        block.key = None
        block.index = None
        if block.ref == 0:
            self.lru.remove(block)
            self.free.append(block)
