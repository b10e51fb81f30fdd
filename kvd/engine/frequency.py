"""The ``eviction = "frequency"`` policy: LRU queues by use count.

bench/README.md, "Trace replay and eviction", has the measurements behind it,
and "Eviction policies against adversarial workloads" why it is no longer the
default: it keeps many-use prefixes long after they stop coming back.

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
from typing import ClassVar

from kvd.engine.block import Block
from kvd.engine.block_queue import BlockQueue
from kvd.engine.pool import BlockPool
from kvd.engine.prefix_index import PrefixIndex

__all__ = ["CLASSES", "WEIGHT", "FrequencyPool", "UseTable"]

#: Use counts saturate here; one queue per count 1..CLASSES.
CLASSES = 8
#: Queue heads are compared by age / uses**2 as the integer age * WEIGHT[uses]
#: (840 = lcm(1..8), so every weight is exact).
WEIGHT = [0] + [(840 // c) ** 2 for c in range(1, CLASSES + 1)]
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

    #: A power of two: the hot paths test ``key[0] & (SAMPLE - 1)``.
    SAMPLE: ClassVar[int] = 64
    #: Counters per sampled key (`_slots`).
    PROBES: ClassVar[int] = 2
    BYTES_PER_BLOCK: ClassVar[int] = 4

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


def _unlink_run(head: Block, n: int) -> list[Block]:
    """Unlink and return the ``n`` blocks after ``head`` (at least ``n`` queued)."""
    out: list[Block] = []
    push = out.append
    block: Block = head.next  # type: ignore[assignment]
    for _ in range(n):
        push(block)
        block = block.next  # type: ignore[assignment]
    head.next = block
    block.prev = head
    return out


class FrequencyPool(BlockPool):
    """`BlockPool` with one LRU queue per use count (module docstring).

    Same states, contracts and costs except eviction, which compares the
    heads of the `CLASSES` queues: O(CLASSES) per run of blocks evicted from
    one queue. Per block: ``uses`` (1 byte, meaningful while the block is
    keyed: set when it is published) and ``stamps`` (4 bytes, the clock at its
    last release), indexed by block id; plus the `UseTable`.
    """

    __slots__ = ("classes", "clock", "ends", "stamps", "table", "tails", "uses")

    policy: ClassVar[str] = "frequency"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        #: classes[c - 1] queues the evictable blocks used c times; lru is classes[0].
        self.classes = [self.lru] + [BlockQueue() for _ in range(CLASSES - 1)]
        #: (head, tail, weight) of each class, in class order, for `_victims`.
        self.ends: list[tuple[Block, Block, int]] = []
        self._weigh(WEIGHT)
        #: tails[c]: class c's tail sentinel (tails[0] unused), for `release`.
        self.tails: list[Block] = [self.lru.tail] + [q.tail for q in self.classes]
        self.uses = bytearray(num_blocks)
        self.stamps = array("I", bytes(4 * num_blocks))
        self.clock = 0
        self.table = UseTable(num_blocks)

    def queues(self) -> list[BlockQueue]:
        return list(self.classes)

    def _weigh(self, weights: list[int]) -> None:
        """Compare the queue heads by age * ``weights[uses]`` from now on."""
        self.ends = [(q.head, q.tail, weights[c]) for c, q in enumerate(self.classes, 1)]

    def _victims(self, n: int) -> list[Block]:
        """Each victim is the queue head oldest in units of uses² (the lowest
        class on a tie). Nothing ages during one call, so only the popped
        queue's score moves: a queue gives up a whole run of blocks while its
        head still beats the others' heads."""
        clock = self.clock + 1
        stamps = self.stamps
        ends = self.ends
        # Within the pool's queues every link is a block (sentinels included).
        scores = [
            -1 if (h := head.next) is tail else ((clock - stamps[h.block_id]) & _STAMP_MASK) * w  # type: ignore[union-attr]
            for head, tail, w in ends
        ]
        if scores.count(-1) == CLASSES - 1:
            # One queue holds every evictable block: the run is its first n.
            head, tail, _ = ends[scores.index(max(scores))]
            return _unlink_run(head, n)
        victims: list[Block] = []
        push = victims.append
        while n:
            c = scores.index(max(scores))
            head, tail, weight = ends[c]
            # The head keeps winning while its age reaches `least`: it must beat
            # the runner-up (the best other head, the lowest class on a tie) if
            # that is of a lower class, and at least tie it if of a higher one.
            # A queue's stamps never decrease from head to tail.
            top = scores[c]
            scores[c] = -1
            second = max(scores)
            least = second // weight + 1 if scores.index(second) < c else -(-second // weight)
            scores[c] = top
            block: Block = head.next  # type: ignore[assignment]
            start = len(victims)
            while n and block is not tail:
                push(block)
                n -= 1
                block = block.next  # type: ignore[assignment]
            if least > 1 and (clock - stamps[victims[-1].block_id]) & _STAMP_MASK < least:
                # Stamps grow towards the tail: the last block taken is too
                # young, so give back from the first too young.
                for i in range(start, len(victims)):
                    if (clock - stamps[victims[i].block_id]) & _STAMP_MASK < least:
                        break
                block = victims[i]
                n += len(victims) - i
                del victims[i:]
            head.next = block
            block.prev = head
            scores[c] = (
                -1 if block is tail else ((clock - stamps[block.block_id]) & _STAMP_MASK) * weight
            )
        return victims

    def _unkey(self, victims: list[Block], removed: list[bytes]) -> None:
        """As `BlockPool._unkey` (one pass, for speed); the counts of sampled
        keys go to the `UseTable`."""
        uses = self.uses
        table = self.table
        mask = table.SAMPLE - 1
        note = removed.append
        emptied = self.emptied
        for block in victims:
            # Evictable blocks are keyed and indexed (check_invariants).
            key: bytes = block.key  # type: ignore[assignment]
            index: dict[bytes, Block] = block.index  # type: ignore[assignment]
            del index[key]
            if not index and isinstance(index, PrefixIndex):
                emptied.append(index)
            note(key)
            if not key[0] & mask:
                table.remember(key, uses[block.block_id])
            block.key = None
            block.index = None
        self.evictable -= len(victims)
        self.evictions += len(victims)

    def match(self, hits: list[Block]) -> None:
        """Touch the hits of a new allocation, one more use each; the clock ticks."""
        self.clock += 1
        uses = self.uses
        pulled = 0
        for block in hits:
            ref = block.ref
            if ref == 0:
                # BlockQueue.remove inline (links of a held block are meaningless).
                prev: Block = block.prev  # type: ignore[assignment]
                nxt: Block = block.next  # type: ignore[assignment]
                prev.next = nxt
                nxt.prev = prev
                pulled += 1
            block.ref = ref + 1
            bid = block.block_id
            u = uses[bid]
            if u < CLASSES:
                uses[bid] = u + 1
        self.evictable -= pulled

    def publish(self, blocks: Sequence[Block]) -> None:
        """One use each for blocks just keyed (in chain order), on top of the
        count remembered for their key or, unsampled, for the nearest sampled
        block after them in ``blocks`` (a lower bound: see `UseTable`)."""
        uses = self.uses
        table = self.table
        mask = table.SAMPLE - 1
        below = 1
        for block in reversed(blocks):
            key: bytes = block.key  # type: ignore[assignment]
            if not key[0] & mask:
                below = min(table.recall(key) + 1, CLASSES)
            uses[block.block_id] = below

    def release(self, blocks: Iterable[Block]) -> None:
        """As `BlockPool.release`, each keyed block queued by its use count
        and stamped with the clock."""
        uses = self.uses
        stamps = self.stamps
        clock = self.clock & _STAMP_MASK
        free_push = self.free.append
        tails = self.tails
        # Released blocks come in runs of one class: `last` is the last block
        # of class `cur`'s queue, linked forward as we go; a run is closed
        # (linked to its tail) when the class changes.
        cur = 0
        last: Block = tails[0]
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
                    c = uses[bid]
                    if c != cur:
                        if cur:
                            tail = tails[cur]
                            last.next = tail
                            tail.prev = last
                        cur = c
                        last = tails[c].prev  # type: ignore[assignment]
                    last.next = block
                    block.prev = last
                    last = block
                    queued += 1
        if queued:
            tail = tails[cur]
            last.next = tail
            tail.prev = last
            self.evictable += queued

    def check(self, problems: list[str]) -> None:
        uses = self.uses
        for c, queue in enumerate(self.classes, 1):
            for block in queue:
                u = uses[block.block_id]
                if u != c:
                    problems.append(f"block {block.block_id}: {u} uses but queued in class {c}")
        for block in self.blocks:
            u = uses[block.block_id]
            if block.key is not None and not 1 <= u <= CLASSES:
                problems.append(f"block {block.block_id}: keyed with {u} uses")
        if max(self.table.counters, default=0) > CLASSES:
            problems.append("use table holds a count above the saturation")
