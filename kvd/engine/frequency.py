"""The default eviction policy: LRU queues by use count (see bench/README.md, "Eviction").

A cached block's *uses* count the times its key was matched by an allocation
or published by a commit, over the key's whole life (evictions included),
saturating at `CLASSES`. Evictable blocks wait in one LRU queue per use count,
each in release order; to evict, the queue heads are compared by age (clock
ticks since release, the clock counting allocations) divided by uses², and the
oldest so scaled goes. At equal recency a prefix used twice outlives a
one-use tail four times as long, and prefixes that keep coming back climb.

Use counts outlive eviction in `UseTable`, a fixed table of saturating byte
counters sized by the pool, not by the keys ever seen: a dict entry per key
would cost more than the block itself.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from kvd.engine.block import Block
from kvd.engine.free_list import BlockQueue
from kvd.engine.pool import BlockPool

__all__ = ["CLASSES", "FrequencyPool", "UseTable"]

#: Use counts saturate here; one queue per count 1..CLASSES.
CLASSES = 8
#: Queue heads are compared by age / uses**2 as the integer age * _WEIGHT[uses]
#: (840 = lcm(1..8), so every weight is exact).
_WEIGHT = [0] + [(840 // c) ** 2 for c in range(1, CLASSES + 1)]
#: Release stamps are the clock modulo 2**32 (4 bytes per block): an age is
#: exact while below 2**32 allocations.
_STAMP_MASK = 0xFFFFFFFF
#: Halving every counter of a `UseTable`: a byte -> byte translation.
_HALVE = bytes(i >> 1 for i in range(256))


class UseTable:
    """Use counts of evicted keys: a fixed table of saturating byte counters.

    Only *sampled* keys (``1/SAMPLE`` of them, by their first byte; keys are
    SHA-256 digests) are remembered, each at ``PROBES`` counters that are
    raised to its count, never lowered; a key's remembered count is the
    smallest of its counters (an overestimate only where every one of them
    collides). An unsampled block takes its count from the nearest sampled
    block after it in the run published with it (`FrequencyPool.publish`):
    every use of a block's descendant uses the block too, so that is a lower
    bound. Sampling keeps the table's load low with ``BYTES_PER_BLOCK`` bytes
    per pool block, where remembering every key would need tens.

    Every ``len(table)`` remembered keys the counters are halved, so counts
    fade over a window of about ``BYTES_PER_BLOCK * SAMPLE / PROBES`` pool
    turnovers and the table never fills with stale counts.
    """

    __slots__ = ("counters", "size", "writes")

    SAMPLE = 64
    PROBES = 2
    BYTES_PER_BLOCK = 4

    def __init__(self, num_blocks: int) -> None:
        self.size = max(64, self.BYTES_PER_BLOCK * num_blocks)
        self.counters = bytearray(self.size)
        #: Keys remembered since the last halving.
        self.writes = 0

    @classmethod
    def sampled(cls, key: bytes) -> bool:
        """Whether ``key``'s count is remembered (a fixed 1/SAMPLE of keys)."""
        return key[0] % cls.SAMPLE == 0

    def _slots(self, key: bytes) -> tuple[int, int]:
        # Double hashing on 8 digest bytes other than the sampling byte.
        h = int.from_bytes(key[1:9], "little")
        h2 = (h >> 32) | 1
        return h % self.size, (h + h2) % self.size

    def recall(self, key: bytes) -> int:
        """The remembered count of sampled ``key`` (0: none)."""
        counters = self.counters
        a, b = self._slots(key)
        return min(counters[a], counters[b])

    def remember(self, key: bytes, uses: int) -> None:
        """Raise sampled ``key``'s counters to ``uses``; halve all now and then."""
        counters = self.counters
        for i in self._slots(key):
            counters[i] = max(counters[i], uses)
        self.writes += 1
        if self.writes >= self.size:
            self.counters = bytearray(counters.translate(_HALVE))
            self.writes = 0


class FrequencyPool(BlockPool):
    """`BlockPool` with one LRU queue per use count (module docstring).

    Same states, contracts and costs except eviction, which compares the
    heads of the `CLASSES` queues: O(CLASSES) per evicted block. Per block:
    ``uses`` (1 byte, 0 for an unkeyed block) and ``stamps`` (4 bytes, the
    clock at its last release), indexed by block id; plus the `UseTable`.
    """

    __slots__ = ("classes", "clock", "stamps", "table", "uses")

    policy = "frequency"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        #: classes[c - 1] queues the evictable blocks used c times; lru is classes[0].
        self.classes = [self.lru] + [BlockQueue() for _ in range(CLASSES - 1)]
        self.uses = bytearray(num_blocks)
        self.stamps = array("I", bytes(4 * num_blocks))
        self.clock = 0
        self.table = UseTable(num_blocks)

    def queues(self) -> list[BlockQueue]:
        return list(self.classes)

    def take(self, n: int, removed: list[bytes]) -> list[Block]:
        free = self.free
        k = len(free)
        if n <= k:
            taken = free[-1 : -n - 1 : -1]
            del free[k - n :]
        else:
            taken = free[::-1]
            free.clear()
            victims = self._evict(n - k)
            self._unkey(victims, removed)
            taken += victims
        for block in taken:
            block.ref = 1
        return taken

    def _evict(self, n: int) -> list[Block]:
        """Unlink ``n`` victims: each the queue head oldest in units of uses²
        (the lowest class on a tie). Their counts go to the `UseTable`."""
        clock = self.clock
        stamps = self.stamps
        uses = self.uses
        table = self.table
        sampled = table.sampled
        classes = self.classes
        # Nothing ages while one call evicts: only the popped queue's score moves.
        scores = [
            ((clock - stamps[q.head.next.block_id] + 1) & _STAMP_MASK) * _WEIGHT[c]  # type: ignore[union-attr]
            if q
            else -1
            for c, q in enumerate(classes, 1)
        ]
        victims: list[Block] = []
        for _ in range(n):
            best = scores.index(max(scores))
            queue = classes[best]
            block = queue.head.next
            assert block is not None
            BlockQueue.remove(block)
            victims.append(block)
            bid = block.block_id
            key = block.key
            assert key is not None
            if sampled(key):
                table.remember(key, uses[bid])
            uses[bid] = 0
            head = queue.head.next
            assert head is not None
            scores[best] = (
                ((clock - stamps[head.block_id] + 1) & _STAMP_MASK) * _WEIGHT[best + 1]
                if head is not queue.tail
                else -1
            )
        return victims

    def match(self, hits: list[Block]) -> None:
        """Touch the hits of a new allocation, one more use each; the clock ticks."""
        self.clock += 1
        uses = self.uses
        remove = BlockQueue.remove
        pulled = 0
        for block in hits:
            if block.ref == 0:
                remove(block)
                pulled += 1
            block.ref += 1
            bid = block.block_id
            if uses[bid] < CLASSES:
                uses[bid] += 1
        self.evictable -= pulled

    def publish(self, blocks: Sequence[Block]) -> None:
        """One use each for blocks just keyed (in chain order), on top of the
        count remembered for their key or, unsampled, for the nearest sampled
        block after them in ``blocks`` (a lower bound: see `UseTable`)."""
        uses = self.uses
        table = self.table
        sampled = table.sampled
        below = 0
        for block in reversed(blocks):
            key = block.key
            assert key is not None
            if sampled(key):
                below = table.recall(key)
            uses[block.block_id] = below + 1 if below < CLASSES else CLASSES

    def release(self, blocks: Iterable[Block]) -> None:
        """As `BlockPool.release`, each keyed block queued by its use count
        and stamped with the clock."""
        classes = self.classes
        uses = self.uses
        stamps = self.stamps
        clock = self.clock & _STAMP_MASK
        free_push = self.free.append
        queued = 0
        for block in blocks:
            ref = block.ref - 1
            block.ref = ref
            if ref == 0:
                if block.key is None:
                    free_push(block)
                else:
                    bid = block.block_id
                    stamps[bid] = clock
                    tail = classes[uses[bid] - 1].tail
                    last = tail.prev
                    assert last is not None
                    last.next = block
                    block.prev = last
                    block.next = tail
                    tail.prev = block
                    queued += 1
        self.evictable += queued

    def drop_key(self, block: Block) -> None:
        """As `BlockPool.drop_key`; a flushed key's count is forgotten."""
        super().drop_key(block)
        self.uses[block.block_id] = 0

    def check(self, problems: list[str]) -> None:
        uses = self.uses
        for c, queue in enumerate(self.classes, 1):
            for block in queue:
                u = uses[block.block_id]
                if u != c:
                    problems.append(f"block {block.block_id}: {u} uses but queued in class {c}")
        for block in self.blocks:
            u = uses[block.block_id]
            if block.key is None and u:
                problems.append(f"block {block.block_id}: unkeyed with {u} uses")
            if block.key is not None and not 1 <= u <= CLASSES:
                problems.append(f"block {block.block_id}: keyed with {u} uses")
        if max(self.table.counters, default=0) > CLASSES:
            problems.append("use table holds a count above the saturation")
