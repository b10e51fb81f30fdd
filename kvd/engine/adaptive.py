"""The default eviction policy: LRU's order, or a use-count order while that hits more.

bench/README.md, "Eviction policies against adversarial workloads", has the
measurements behind it.

Counting uses (`kvd.engine.frequency`) gains where shared prefixes keep coming
back and loses badly where prefixes with many uses stop (a finished
conversation's prefix outlives the newest turn 64 times over). `AdaptivePool`
keeps `FrequencyPool`'s queues, stamps and counts, which do not depend on the
order they are evicted in, and evicts by age * ``ORDERS[order][uses]``: age
alone (every weight equal: the heads compare by release stamp, the lowest
class on a tie, which is LRU's order), age / uses² (`frequency`'s) or age /
uses³ (a small pool against long reuse distances keeps only proven reuse).
Three small caches (`Shadows`), one per order, are fed the same sample of the
keys' uses (SHARDS-style spatial sampling: 1 key in `SAMPLE`, between
`MIN_KEYS` and `MAX_KEYS` keys, each shadow the pool's size scaled by the
sample); the pool follows the one that hit most lately (`Shadows.choose`).

Counts never rise towards a chain's tail: every use of a block is a use of
its ancestors, so a higher count below an ancestor's is the sampled
`UseTable`'s noise, and `AdaptivePool.release` lowers it to the ancestor's.
That keeps equal weights LRU's order exactly (a chain is released tail first
at one stamp, and the lowest class goes first on a tie) and helps the
use-count orders: raising the ancestors instead spread one sampled count over
a whole chain and cost `frequency`'s gain at the synthetic trace's smallest
pool.

The shadows see a use when the pool queues it: each keyed block as its holder
releases it, in the pool's release order (a chain's tail first), so that the
LRU shadow's order is the pool's LRU order.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import ClassVar, Final

import numpy as np

from kvd.engine.block import Block
from kvd.engine.frequency import _STAMP_MASK, CLASSES, WEIGHT, FrequencyPool

__all__ = [
    "LEAVE",
    "MAX_KEYS",
    "MIN_KEYS",
    "ORDERS",
    "RETURN",
    "SAMPLE",
    "WINDOW",
    "AdaptivePool",
    "Shadows",
]

#: Keys per shadow: ``num_blocks // SAMPLE`` within [MIN_KEYS, MAX_KEYS] (the
#: whole pool below MIN_KEYS blocks). More keys see more of the reuses that
#: tell the orders apart; the bounds keep a small pool's shadows meaningful
#: and a large one's near 1 MB, and at most 1 key in SAMPLE sampled from
#: MIN_KEYS * SAMPLE blocks up keeps the shadows' cost per block.
SAMPLE = 16
MIN_KEYS = 512
MAX_KEYS = 2048
#: Each sampled use scales every hit average by 1 - 1/WINDOW: a window of about
#: WINDOW sampled uses. Halving the counts every 65,536 uses instead made the
#: choice hinge on where the halvings fell.
WINDOW = 32768
#: Leaving LRU's order takes a lead over LRU's shadow of more than LEAVE
#: standard deviations of the uses that only one of the two hit (a sign test):
#: a lead of a few hits is noise that would cost LRU's exact order.
LEAVE = 2.0
#: Going back to LRU's order takes LRU's shadow ahead by more than RETURN hits.
RETURN = 8.0
#: `Shadows.unit` past this is brought back to 1 (after ~10^6 sampled uses).
_RESCALE = 1e12
#: Every weight equal: the heads compare by age alone, LRU's order.
_FLAT = [0] + [1] * CLASSES
#: Age / uses³ as integers (840 = lcm(1..8)).
_CUBED = [0] + [(840 // c) ** 3 for c in range(1, CLASSES + 1)]
#: The orders by index: LRU's, age / uses², age / uses³.
ORDERS = (_FLAT, WEIGHT, _CUBED)
#: 4 digest bytes as a little-endian integer: the sampling test's number.
_SAMPLE_BYTES = struct.Struct("<I").unpack_from
#: From this many blocks a publish takes the sampling test in one numpy pass (2x
#: a loop's speed at 4,096 blocks; the loop is cheaper below ~100).
_VECTOR_MIN: Final = 128
#: The classes a weighted shadow's eviction scans, in order.
_CLASS_RANGE = range(1, CLASSES + 1)
#: Among shadows with equal hits: LRU's order, then uses³, then uses².
_PREFER = (0, 2, 1)


class _Weighted:
    """A cache of sampled keys evicting like `FrequencyPool` by age * ``weights[uses]``
    (`Shadows.refer_run` works on it)."""

    __slots__ = ("classes", "heads", "weights", "where")

    def __init__(self, weights: list[int]) -> None:
        self.weights = weights
        #: classes[c]: the keys used c times -> their stamp (never decreasing).
        self.classes: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(CLASSES + 1)]
        #: heads[c]: the stamp at the head of classes[c] (-1: empty). Kept, not
        #: looked up per eviction: an OrderedDict's first item takes an iterator.
        self.heads = [-1] * (CLASSES + 1)
        #: The keys -> their class.
        self.where: dict[bytes, int] = {}

    def check(self, size: int, problems: list[str]) -> None:
        """Append what is wrong with this shadow of ``size`` keys to ``problems``."""
        if len(self.where) > size:
            problems.append("a shadow cache holds more keys than its size")
        if sum(map(len, self.classes)) != len(self.where) or any(
            key not in self.classes[c] for key, c in self.where.items()
        ):
            problems.append("a weighted shadow's classes and queues disagree")
        if self.heads != [next(iter(q.values())) if q else -1 for q in self.classes]:
            problems.append("a weighted shadow's head stamps are stale")


class Shadows:
    """One cache of ``size`` sampled keys per order of `ORDERS`, and their hits.

    `refer` records one use of a sampled key (a holder's release of it) with
    its use count in the pool: ``hits[i] / unit`` averages the uses that hit
    in shadow ``i`` (LRU's, then the weighted ones, which evict like
    `FrequencyPool` stamped with the pool's clock), ``apart[p] / unit`` those
    that hit in just one of pair ``p`` (0-1, 0-2, 1-2), both over about
    `WINDOW` uses. (Each use grows ``unit`` by 1 / (1 - 1/`WINDOW`) instead
    of scaling six averages down: the same ratios, one multiplication.)
    O(CLASSES) per sampled use at most.
    """

    __slots__ = ("apart", "every", "grow", "hits", "lru", "offset", "size", "unit", "weighted")

    def __init__(self, num_blocks: int, offset: int = 8) -> None:
        #: Where in a digest the sampling test reads its 4 bytes (8: bytes 8..11,
        #: which no other sample of the engine reads; others for measuring).
        self.offset = offset
        keys = min(MAX_KEYS, max(MIN_KEYS, num_blocks // SAMPLE))
        self.every = max(1, num_blocks // keys)
        self.size = max(1, num_blocks // self.every)
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.weighted = [_Weighted(weights) for weights in ORDERS[1:]]
        self.hits = [0.0] * len(ORDERS)
        self.apart = [0.0] * 3
        self.unit = 1.0
        self.grow = 1 / (1 - 1 / WINDOW)

    def sampled(self, key: bytes) -> bool:
        """Whether ``key`` is in the sample (a fixed 1/``every`` of the keys, by
        digest bytes ``offset``..``offset + 3``)."""
        number: int = _SAMPLE_BYTES(key, self.offset)[0]
        return number % self.every == 0

    def sampled_all(self, keys: Sequence[bytes]) -> list[bool]:
        """`sampled` of each of ``keys`` (digests of one size), in one numpy pass."""
        digests = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)
        at = self.offset
        number = np.ascontiguousarray(digests[:, at : at + 4]).view("<u4").ravel()
        flags: list[bool] = (number % self.every == 0).tolist()
        return flags

    def refer(self, key: bytes, uses: int, clock: int) -> None:
        """One use of sampled ``key``, now used ``uses`` times, at ``clock``."""
        self.refer_run(((key, uses),), clock)

    def refer_run(self, run: Iterable[tuple[bytes, int]], clock: int) -> None:
        """`refer` each (key, uses) of ``run`` in turn, at ``clock`` (one call
        per released run: its loop holds the shadows in locals)."""
        lru, size, grow, unit = self.lru, self.size, self.grow, self.unit
        hits, apart = self.hits, self.apart
        weighted = [(w.where, w.classes, w.heads, w.weights) for w in self.weighted]
        now = clock + 1
        for key, uses in run:
            a = key in lru
            if a:
                lru.move_to_end(key)
            else:
                lru[key] = None
                if len(lru) > size:
                    lru.popitem(last=False)
            hit = []
            for where, classes, heads, weights in weighted:
                old = where.get(key)
                if old is not None:
                    queue = classes[old]
                    if queue.pop(key) == heads[old]:  # perhaps the head: look again
                        heads[old] = next(iter(queue.values())) if queue else -1
                elif len(where) >= size:
                    # The head oldest in units of weight goes, the lowest class on a tie.
                    best, score = 0, -1
                    for cls in _CLASS_RANGE:
                        h = heads[cls]
                        if h >= 0:
                            t = (now - h) * weights[cls]
                            if t > score:
                                best, score = cls, t
                    queue = classes[best]
                    gone, _ = queue.popitem(last=False)
                    del where[gone]
                    heads[best] = next(iter(queue.values())) if queue else -1
                where[key] = uses
                queue = classes[uses]
                if not queue:
                    heads[uses] = clock
                queue[key] = clock
                hit.append(old is not None)
            b, c = hit
            unit *= grow
            if unit > _RESCALE:
                self.unit = unit
                self._rescale()
                hits, apart, unit = self.hits, self.apart, 1.0
            if a or b or c:
                if a:
                    hits[0] += unit
                if b:
                    hits[1] += unit
                if c:
                    hits[2] += unit
                if not (a and b and c):
                    if a != b:
                        apart[0] += unit
                    if a != c:
                        apart[1] += unit
                    if b != c:
                        apart[2] += unit
        self.unit = unit

    def averages(self) -> tuple[list[float], list[float]]:
        """``hits`` and ``apart`` in uses (averages over about `WINDOW` uses)."""
        unit = self.unit
        return [h / unit for h in self.hits], [d / unit for d in self.apart]

    def _rescale(self) -> None:
        """Bring ``unit`` back to 1 (the averages unchanged)."""
        self.hits, self.apart = self.averages()
        self.unit = 1.0

    def choose(self, order: int) -> int:
        """The order to evict in, the pool's now being ``order``: the shadow
        with the most hits (`_PREFER` on a tie), if its lead over ``order``'s
        is enough (`LEAVE` from LRU's, `RETURN` back to it, any between the
        use-count orders); else ``order``."""
        hits = self.hits
        best = max(_PREFER, key=hits.__getitem__)
        if best == order:
            return order
        unit = self.unit
        if order == 0:
            need = LEAVE * (self.apart[best - 1] * unit) ** 0.5
        elif best == 0:
            need = RETURN * unit
        else:
            need = 0.0
        return best if hits[best] - hits[order] > need else order

    def check(self, problems: list[str]) -> None:
        """Append what is wrong with the shadows to ``problems``."""
        if len(self.lru) > self.size:
            problems.append("a shadow cache holds more keys than its size")
        for w in self.weighted:
            w.check(self.size, problems)


class AdaptivePool(FrequencyPool):
    """`FrequencyPool` evicting in the order of `ORDERS` its shadows chose
    (module docstring), counts lowered along each released chain. Costs beside
    `FrequencyPool`'s: the lowering in its release pass, the sampling test once
    per published key (a byte per block), `Shadows.refer_run` per run with
    sampled keyed blocks (1 in `Shadows.every`), and three shadows of
    `MIN_KEYS` to `MAX_KEYS` keys."""

    __slots__ = ("order", "sampled", "shadows")

    policy: ClassVar[str] = "adaptive"

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.shadows = Shadows(num_blocks)
        #: The index in `ORDERS` of the order the pool evicts in (0: LRU's).
        self.order = 0
        self._weigh(_FLAT)
        #: sampled[id]: whether the key of keyed block ``id`` is in the shadows'
        #: sample (`Shadows.sampled`), tested once when it is published, not at
        #: each of its releases. Meaningless while the block has no key.
        self.sampled = bytearray(num_blocks)

    def publish(self, blocks: Sequence[Block]) -> None:
        """As `FrequencyPool.publish`, and each block's sampling test taken (``sampled``)."""
        super().publish(blocks)
        sampled = self.sampled
        if len(blocks) >= _VECTOR_MIN:
            flags = self.shadows.sampled_all([b.key for b in blocks])  # type: ignore[misc]
            for block, flag in zip(blocks, flags, strict=True):
                sampled[block.block_id] = flag
            return
        test = self.shadows.sampled
        for block in blocks:
            sampled[block.block_id] = test(block.key)  # type: ignore[arg-type]

    def release(self, blocks: Iterable[Block]) -> None:
        """As `FrequencyPool.release` (``blocks`` in release order, a chain's
        tail first), each keyed block's count first lowered to the lowest count
        before it in the chain; then the shadows see each sampled keyed block,
        in release order, with its count (module docstring).

        One pass, head first (the lowering runs from the chain's head): each
        class's blocks are linked into a segment, newest in front, and the
        segments are spliced at their queues' tails at the end, which puts
        them in release order as `FrequencyPool.release` would. Lowered counts
        never rise towards the tail, so each class's blocks are one segment."""
        run: list[Block] = blocks if isinstance(blocks, list) else list(blocks)
        uses = self.uses
        stamps = self.stamps
        clock = self.clock & _STAMP_MASK
        sampled = self.sampled
        picked: list[tuple[bytes, int]] = []
        pick = picked.append
        freed: list[Block] = []
        free = freed.append
        # (class, front, end) of each segment, and the one being built.
        segments: list[tuple[int, Block, Block]] = []
        cur = 0
        front: Block = self.tails[0]
        end: Block = front
        low = CLASSES
        queued = 0
        for block in reversed(run):
            ref = block.ref - 1
            block.ref = ref
            key = block.key
            if key is None:
                if ref == 0:
                    free(block)
                continue
            bid = block.block_id
            u = uses[bid]
            if u > low:
                uses[bid] = u = low
            else:
                low = u
            if sampled[bid]:
                pick((key, u))
            if ref == 0:
                stamps[bid] = clock
                if u != cur:
                    if cur:
                        segments.append((cur, front, end))
                    cur = u
                    front = end = block
                else:
                    block.next = front
                    front.prev = block
                    front = block
                queued += 1
        if freed:
            freed.reverse()
            self.free += freed
        if queued:
            segments.append((cur, front, end))
            tails = self.tails
            for c, first, last in segments:
                tail = tails[c]
                before: Block = tail.prev  # type: ignore[assignment]
                before.next = first
                first.prev = before
                last.next = tail
                tail.prev = last
            self.evictable += queued
        if picked:
            picked.reverse()
            shadows = self.shadows
            shadows.refer_run(picked, self.clock)
            order = shadows.choose(self.order)
            if order != self.order:
                self.order = order
                self._weigh(ORDERS[order])

    def check(self, problems: list[str]) -> None:
        super().check(problems)
        self.shadows.check(problems)
        sampled, test = self.sampled, self.shadows.sampled
        if any(b.key is not None and sampled[b.block_id] != test(b.key) for b in self.blocks):
            problems.append("a keyed block's sampling flag is not its key's")
        if [w for _, _, w in self.ends] != ORDERS[self.order][1:]:
            problems.append("the eviction weights do not follow the shadows")
