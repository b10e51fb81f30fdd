"""The block pool: every block, the free stack and the eviction order.

`BlockPool` evicts in vLLM's order (one LRU queue); `FrequencyPool`
(`kvd.engine.frequency`) keeps the same states and contracts and orders
evictions by use counts as well as recency.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from kvd.engine.block import Block
from kvd.engine.block_queue import BlockQueue
from kvd.engine.prefix_index import PrefixIndex

__all__ = ["BlockPool"]


class BlockPool:
    """Owns the blocks of one pool and moves them between three states.

    - *free*: ``ref == 0`` and no key, on the ``free`` stack (taken first,
      most recently freed first: its memory is likely still warm), or not
      yet created: the ``unborn`` blocks past ``len(blocks)`` are created on
      first use, in id order, after the stack runs out (a 1M-block pool is
      ready in milliseconds, not the second a million records take; the
      order is the one a stack of every block, 0 on top, would give);
    - *evictable*: ``ref == 0`` with a key, in an eviction queue (here the
      one ``lru`` queue, least recently released at the head), still
      matchable until taken; ``evictable`` counts them;
    - *in use*: ``ref > 0``.

    Every method is O(1) per block touched. Callers check capacity first
    (`available`), so nothing here can fail halfway.
    """

    __slots__ = (
        "blocks",
        "emptied",
        "evictable",
        "evictions",
        "free",
        "lru",
        "num_blocks",
        "unborn",
    )

    #: The ``eviction`` setting that selects this class.
    policy: ClassVar[str] = "lru"

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        #: Every block created so far; ``blocks[i].block_id == i``.
        self.blocks: list[Block] = []
        self.unborn = num_blocks
        self.free: list[Block] = []
        self.lru = BlockQueue()
        self.evictable = 0
        self.evictions = 0
        #: Indexes that evictions in `take` left empty, for the owner to collect.
        self.emptied: list[PrefixIndex] = []

    def num_free(self) -> int:
        """Free blocks: on the stack or unborn."""
        return len(self.free) + self.unborn

    def available(self) -> int:
        """Blocks that can be taken now: free plus evictable."""
        return len(self.free) + self.unborn + self.evictable

    def queues(self) -> list[BlockQueue]:
        """The eviction queues (for `check_invariants` and tests)."""
        return [self.lru]

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
            if self.unborn:
                taken += self._create(min(n - k, self.unborn))
            if len(taken) < n:
                victims = self._victims(n - len(taken))
                self._unkey(victims, removed)
                taken += victims
        for block in taken:
            block.ref = 1
        return taken

    def _create(self, n: int) -> list[Block]:
        """The next ``n`` unborn blocks, in id order (``n <= unborn``)."""
        start = len(self.blocks)
        born = [Block(i) for i in range(start, start + n)]
        self.blocks += born
        self.unborn -= n
        return born

    def _victims(self, n: int) -> list[Block]:
        """Unlink the next ``n`` blocks to evict (at least ``n`` are evictable)."""
        return self.lru.popleft(n)

    def _unkey(self, victims: list[Block], removed: list[bytes]) -> None:
        """Take evicted ``victims`` out of their indexes (see `take`)."""
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
        self.evictable -= len(victims)
        self.evictions += len(victims)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a holder to each block, pulling evictable ones off their queue."""
        remove = BlockQueue.remove
        pulled = 0
        for block in blocks:
            if block.ref == 0:
                remove(block)
                pulled += 1
            block.ref += 1
        self.evictable -= pulled

    def match(self, hits: list[Block]) -> None:
        """`touch` the prefix hits of a new allocation (a use of each)."""
        self.touch(hits)

    def publish(self, blocks: Sequence[Block]) -> None:
        """``blocks`` (in chain order) just got their keys. LRU keeps no counts."""

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
            self.evictable += queued

    def drop_key(self, block: Block) -> None:
        """Take ``block`` out of the prefix cache (its index entry is the
        caller's business); an evictable block becomes free at once."""
        block.key = None
        block.index = None
        if block.ref == 0:
            BlockQueue.remove(block)
            self.evictable -= 1
            self.free.append(block)

    def check(self, problems: list[str]) -> None:
        """Append what is wrong with the policy's own state to ``problems``."""
