"""The default eviction policy: `frequency`'s order while it pays, LRU's otherwise.

bench/README.md, "Eviction policies against adversarial workloads", has the
measurements behind it.

Counting uses (`kvd.engine.frequency`) gains where shared prefixes keep coming
back and loses badly where prefixes with many uses stop (a finished
conversation's prefix outlives the newest turn 64 times over). `AdaptivePool`
keeps `FrequencyPool`'s queues, stamps and counts, which do not depend on the
order they are evicted in, and evicts either by age / uses² or by age alone:
with every weight equal the heads compare by release stamp, the lowest class
on a tie, which is LRU's order. Which one is decided by a duel of two small
caches (`Shadows`) fed the same sample of the keys' uses: one LRU, one
evicting by age / uses², each as large as the pool scaled by the sample
(SHARDS-style spatial sampling: 1 key in `SAMPLE`, between `MIN_KEYS` and
`MAX_KEYS` keys). The pool follows the shadow that hit more lately.

The shadows see a use when the pool queues it: each keyed block as its holder
releases it, in the pool's release order (a chain's tail first), so that the
LRU shadow's order is the pool's LRU order. Fed at match time in chain order
they evicted a chain head first, which the pool never does: the LRU shadow
lost hits the pool's LRU keeps, and the duel favoured counts where they lose.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvd.engine.block import Block
from kvd.engine.frequency import CLASSES, WEIGHT, FrequencyPool

__all__ = ["DECAY", "MAX_KEYS", "MIN_KEYS", "SAMPLE", "AdaptivePool", "Shadows"]

#: Keys per shadow: ``num_blocks // SAMPLE`` within [MIN_KEYS, MAX_KEYS] (the
#: whole pool below MIN_KEYS blocks). More keys see more of the reuses that
#: tell the orders apart; the bounds keep a small pool's shadows meaningful
#: and a large one's under 1 MB (about 200 KB at MIN_KEYS, 780 KB at
#: MAX_KEYS), and at most 1 key in SAMPLE sampled from MIN_KEYS * SAMPLE
#: blocks up keeps the shadows' cost per block.
SAMPLE = 16
MIN_KEYS = 512
MAX_KEYS = 2048
#: Both shadows' hit counts halve every DECAY sampled uses (a window of recent
#: behaviour; long, so that a burst does not flip the order back and forth).
DECAY = 65536
#: Every weight equal: the heads compare by age alone, LRU's order.
_FLAT = [0] + [1] * CLASSES


class Shadows:
    """An LRU cache and a uses²-weighted cache of ``size`` sampled keys each.

    `refer` records one use of a sampled key (a holder's release of it) with
    its use count in the pool: a hit in a shadow counts for it in
    ``hits`` (``[lru, weighted]``). The weighted shadow keeps one queue per
    use count and evicts like `FrequencyPool` (the head oldest in units of
    uses², the lowest class on a tie), stamped with the pool's clock.
    O(CLASSES) per sampled use at most.
    """

    __slots__ = ("classes", "every", "hits", "lru", "refs", "size", "where")

    def __init__(self, num_blocks: int) -> None:
        keys = min(MAX_KEYS, max(MIN_KEYS, num_blocks // SAMPLE))
        self.every = max(1, num_blocks // keys)
        self.size = max(1, num_blocks // self.every)
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        #: classes[c]: the weighted shadow's keys used c times -> their stamp.
        self.classes: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(CLASSES + 1)]
        #: The weighted shadow's keys -> their class.
        self.where: dict[bytes, int] = {}
        self.hits = [0, 0]
        self.refs = 0

    def sampled(self, key: bytes) -> bool:
        """Whether ``key`` is in the sample (a fixed 1/``every`` of the keys, by
        digest bytes 8..11, which no other sample of the engine reads)."""
        return int.from_bytes(key[8:12], "little") % self.every == 0

    def refer(self, key: bytes, uses: int, clock: int) -> None:
        """One use of sampled ``key``, now used ``uses`` times, at ``clock``."""
        lru, hits = self.lru, self.hits
        if key in lru:
            hits[0] += 1
            lru.move_to_end(key)
        else:
            lru[key] = None
            if len(lru) > self.size:
                lru.popitem(last=False)
        where, classes = self.where, self.classes
        old = where.get(key)
        if old is not None:
            hits[1] += 1
            del classes[old][key]
        elif len(where) >= self.size:
            self._evict(clock)
        where[key] = uses
        classes[uses][key] = clock
        self.refs += 1
        if self.refs >= DECAY:
            self.refs = 0
            hits[0] >>= 1
            hits[1] >>= 1

    def _evict(self, clock: int) -> None:
        best, score = 0, -1
        for c in range(1, CLASSES + 1):
            queue = self.classes[c]
            if queue:
                s = (clock + 1 - queue[next(iter(queue))]) * WEIGHT[c]
                if s > score:
                    best, score = c, s
        key, _ = self.classes[best].popitem(last=False)
        del self.where[key]

    def check(self, problems: list[str]) -> None:
        """Append what is wrong with the shadows to ``problems``."""
        if len(self.lru) > self.size or len(self.where) > self.size:
            problems.append("a shadow cache holds more keys than its size")
        if sum(map(len, self.classes)) != len(self.where) or any(
            key not in self.classes[c] for key, c in self.where.items()
        ):
            problems.append("the weighted shadow's classes and queues disagree")


class AdaptivePool(FrequencyPool):
    """`FrequencyPool` evicting in LRU's order unless the weighted shadow hit more
    lately (module docstring). Costs beside `FrequencyPool`'s: the sampling
    test per block released, `Shadows.refer` per sampled keyed block released
    (1 in `Shadows.every`), and two shadows of `MIN_KEYS` to `MAX_KEYS` keys."""

    __slots__ = ("shadows", "weighted")

    policy = "adaptive"
    #: A chain is released tail first, and every use of a block is a use of its
    #: ancestors, so counts never fall towards the head; sampled counts can
    #: (a descendant's remembered count above its parent's), and then the
    #: lowest class that goes first on a tie of release stamps would be the
    #: ancestor, not LRU's tail. Raising them keeps the unweighted order LRU's.
    monotone = True

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.shadows = Shadows(num_blocks)
        #: Whether the pool now evicts by age / uses² (else by age: LRU).
        self.weighted = False
        self._weigh(_FLAT)

    def _refer(self, blocks: Sequence[Block]) -> None:
        shadows = self.shadows
        every, whole = shadows.every, int.from_bytes
        # `Shadows.sampled` inline, in a comprehension: it runs for every block.
        picked = [
            b for b in blocks if (k := b.key) is not None and not whole(k[8:12], "little") % every
        ]
        if not picked:
            return
        uses, clock = self.uses, self.clock
        for block in picked:
            shadows.refer(block.key, uses[block.block_id], clock)  # type: ignore[arg-type]
        lru, weighted = shadows.hits
        if (weighted > lru) != self.weighted:
            self.weighted = not self.weighted
            self._weigh(WEIGHT if self.weighted else _FLAT)

    def release(self, blocks: Iterable[Block]) -> None:
        """As `FrequencyPool.release`; then the shadows see each sampled keyed
        block released, in that order, with its count (module docstring)."""
        run = list(blocks)
        super().release(run)
        self._refer(run)

    def check(self, problems: list[str]) -> None:
        super().check(problems)
        self.shadows.check(problems)
        weights = WEIGHT if self.weighted else _FLAT
        if [w for _, _, w in self.ends] != weights[1:]:
            problems.append("the eviction weights do not follow the shadows")
