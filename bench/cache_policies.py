"""Eviction candidates simulated the way replay.py drives kvd's engine.

`run_policy` replays a trace through a `Policy` exactly as replay.py drives the
engine (bench/README.md, "Trace replay and eviction"): `LRU` is ``eviction = "lru"``
block for block, `EngineFrequency` is ``eviction = "frequency"`` on the engine's own
sha256 keys (`engine_keys`) and use table, so both give the engine's hit ratio to
the token (tests/bench checks it). `PROTOTYPES` are the other candidates measured
for the default (bench/README.md, "Eviction policies against adversarial
workloads"); most keep exact use counts and ghosts in unbounded memory, the best
an engine could approach.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from bench.cache_sim import BLOCK, Outcome, Trace, expand_tokens, mix64
from kvd.engine.adaptive import ORDERS, Shadows
from kvd.engine.frequency import CLASSES, WEIGHT, UseTable

__all__ = [
    "LRU",
    "PROTOTYPES",
    "EngineAdaptive",
    "EngineFrequency",
    "Policy",
    "engine_keys",
    "run_policy",
]


class Policy:
    """What the engine's pool does, per key: cached keys, hits, publications,
    releases (tail first), evictions."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cached: set[int] = set()

    def match(self, keys: Sequence[int]) -> None:
        raise NotImplementedError

    def publish(self, keys: Sequence[int]) -> None:
        raise NotImplementedError

    def release(self, keys: Sequence[int]) -> None:
        raise NotImplementedError

    def evict(self, n: int) -> None:
        raise NotImplementedError


def run_policy(trace: Trace, capacity: int, policy: Policy) -> Outcome:
    """Replay ``trace`` as replay.py drives the engine: allocate (longest capped
    prefix hit, the rest taken from free blocks then evictions), commit (keys not
    cached are published; a cached one stays where it is and the new copy is
    private), free (keyed blocks released tail first, the rest free)."""
    out = Outcome(total_tokens=trace.total_tokens)
    t0 = time.perf_counter()
    free = capacity
    cached = policy.cached
    for keys, nblocks, length in zip(trace.keys, trace.blocks, trace.tokens, strict=True):
        if nblocks > capacity:
            out.refused += 1
            continue
        cap = (length - 1) // BLOCK
        hit = 0
        for key in keys[:cap]:
            if key not in cached:
                break
            hit += 1
        policy.match(keys[:hit])
        need = nblocks - hit
        take = min(free, need)
        free -= take
        if need > take:
            policy.evict(need - take)
        new = [k for k in keys[hit:] if k not in cached]
        policy.publish(new)
        free += need - len(new)
        held = list(keys[:hit]) + new
        held.reverse()
        policy.release(held)
        out.hit_tokens += hit * BLOCK
    out.seconds = time.perf_counter() - t0
    return out


class LRU(Policy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.q: OrderedDict[int, None] = OrderedDict()

    def match(self, keys: Sequence[int]) -> None:
        q = self.q
        for k in keys:
            del q[k]

    def publish(self, keys: Sequence[int]) -> None:
        self.cached.update(keys)

    def release(self, keys: Sequence[int]) -> None:
        q = self.q
        for k in keys:
            q[k] = None

    def evict(self, n: int) -> None:
        q, cached = self.q, self.cached
        for _ in range(n):
            k, _ = q.popitem(last=False)
            cached.remove(k)


class Classes(Policy):
    """Queues by use count (exact counts, remembered forever), evict the head with the
    largest age * weight[c]; ``alpha`` sets weight[c] = c**-alpha."""

    def __init__(self, capacity: int, classes: int = 8, alpha: float = 2.0) -> None:
        super().__init__(capacity)
        self.classes = classes
        self.queues: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(classes + 1)]
        self.uses: dict[int, int] = {}
        self.clock = 0
        self.set_alpha(alpha)

    def set_alpha(self, alpha: float) -> None:
        self.alpha = alpha
        self.weight = [0.0] + [c**-alpha for c in range(1, self.classes + 1)]

    def match(self, keys: Sequence[int]) -> None:
        self.clock += 1
        uses, queues = self.uses, self.queues
        for k in keys:
            u = uses[k]
            del queues[min(u, self.classes)][k]
            uses[k] = u + 1

    def publish(self, keys: Sequence[int]) -> None:
        self.cached.update(keys)
        uses = self.uses
        for k in keys:
            uses[k] = uses.get(k, 0) + 1

    def release(self, keys: Sequence[int]) -> None:
        uses, queues, clock = self.uses, self.queues, self.clock
        for k in keys:
            queues[min(uses[k], self.classes)][k] = clock

    def pick(self) -> int:
        clock = self.clock + 1
        best, score = 0, -1.0
        for c in range(1, self.classes + 1):
            q = self.queues[c]
            if q:
                s = (clock - q[next(iter(q))]) * self.weight[c]
                if s > score:
                    best, score = c, s
        return best

    def evict(self, n: int) -> None:
        for _ in range(n):
            k, _ = self.queues[self.pick()].popitem(last=False)
            self.cached.remove(k)
            self.evicted(k)

    def evicted(self, key: int) -> None:
        """Hook for subclasses."""


class ARC(Policy):
    """ARC (Megiddo & Modha, FAST '03) over blocks: T1 holds blocks used once since
    they entered the cache, T2 the rest, both LRU; ghosts B1/B2 of evicted keys
    steer T1's target size ``p``."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.freq: set[int] = set()
        self.p = 0.0

    def match(self, keys: Sequence[int]) -> None:
        for k in keys:
            if k in self.freq:
                del self.t2[k]
            else:
                del self.t1[k]
                self.freq.add(k)

    def publish(self, keys: Sequence[int]) -> None:
        self.cached.update(keys)
        c = self.capacity
        for k in keys:
            if k in self.b1:
                self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1))
                del self.b1[k]
                self.freq.add(k)
            elif k in self.b2:
                self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1))
                del self.b2[k]
                self.freq.add(k)

    def release(self, keys: Sequence[int]) -> None:
        for k in keys:
            (self.t2 if k in self.freq else self.t1)[k] = None

    def evict(self, n: int) -> None:
        c = self.capacity
        for _ in range(n):
            if self.t1 and (len(self.t1) > self.p or not self.t2):
                k, _ = self.t1.popitem(last=False)
                self.b1[k] = None
            else:
                k, _ = self.t2.popitem(last=False)
                self.freq.discard(k)
                self.b2[k] = None
            self.cached.remove(k)
            while self.b1 and len(self.b1) + len(self.t1) > c:
                self.b1.popitem(last=False)
            while len(self.b1) + len(self.b2) > c:
                (self.b2 or self.b1).popitem(last=False)


class GhostAlpha(Classes):
    """`Classes` with alpha in [0, 2] moved by ghost hits: a key evicted in the last
    ``capacity`` evictions (1 in ``sample`` of them remembered) that is published
    again moves alpha up ``step`` if its class was above the victims' mean class,
    else down ``down * step``. Starts at 0, LRU's order."""

    def __init__(
        self, capacity: int, step: float = 0.05, down: float = 1.0, sample: int = 1
    ) -> None:
        super().__init__(capacity, alpha=0.0)
        self.ghost: OrderedDict[int, int] = OrderedDict()
        # A sampled ghost hit stands for ``sample`` of them.
        self.step, self.down, self.sample = step * sample, down, sample
        self.mean = 1.0

    def evicted(self, key: int) -> None:
        c = min(self.uses[key], self.classes)
        self.mean += (c - self.mean) / 256
        if self.sample > 1 and mix64(key) % self.sample:
            return
        self.ghost[key] = c
        if len(self.ghost) > self.capacity // self.sample:
            self.ghost.popitem(last=False)

    def publish(self, keys: Sequence[int]) -> None:
        for k in keys:
            c = self.ghost.pop(k, None)
            if c is not None:
                a = self.alpha + (self.step if c > self.mean else -self.step * self.down)
                self.set_alpha(min(2.0, max(0.0, a)))
        super().publish(keys)


class Duel(Classes):
    """`Classes` at alpha 0 (LRU's order) or ``hi``, whichever of two shadow caches
    hit more lately: one LRU, one at ``hi``, each over a sample of the keys sized
    ``keys`` (SHARDS-style: 1 in capacity/keys), hits halved every ``decay``."""

    def __init__(
        self, capacity: int, hi: float = 2.0, keys: int = 2048, decay: int = 65536
    ) -> None:
        super().__init__(capacity, alpha=0.0)
        self.hi = hi
        self.sample = max(1, capacity // keys)
        self.size = max(1, capacity // self.sample)
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.fq = Classes(self.size, alpha=hi)
        self.score = [0.0, 0.0]
        self.refs = 0
        self.decay = decay
        self.hits: list[int] = []

    def _refer(self, keys: Sequence[int]) -> None:
        s, lru, fq = self.sample, self.lru, self.fq
        picked = [k for k in keys if s == 1 or not mix64(k) % s]
        if not picked:
            return
        fq.clock += 1
        for k in picked:
            if k in lru:
                self.score[0] += 1
                del lru[k]
            lru[k] = None
            if len(lru) > self.size:
                lru.popitem(last=False)
            if k in fq.cached:
                self.score[1] += 1
                u = fq.uses[k]
                del fq.queues[min(u, fq.classes)][k]
                fq.uses[k] = u + 1
            else:
                if len(fq.cached) >= self.size:
                    fq.evict(1)
                fq.publish([k])
            fq.queues[min(fq.uses[k], fq.classes)][k] = fq.clock
            self.refs += 1
            if self.refs >= self.decay:
                self.refs = 0
                self.score = [x / 2 for x in self.score]
        want = self.hi if self.score[1] > self.score[0] else 0.0
        if want != self.alpha:
            self.set_alpha(want)

    def match(self, keys: Sequence[int]) -> None:
        super().match(keys)
        self.hits = list(keys)

    def publish(self, keys: Sequence[int]) -> None:
        self._refer(self.hits + list(keys))
        super().publish(keys)


class Branching(Classes):
    """`Classes` counting only uses that branch: a request whose hit ends at the last
    block of a published run (a conversation's previous turn, continued) adds no use
    to its hits or to the keys it publishes (they keep their count, at least 1).
    The run-end mark moves to the next block of the same release when its block is
    evicted, so a chain evicted from its end keeps its new end marked."""

    def __init__(self, capacity: int, alpha: float = 2.0) -> None:
        super().__init__(capacity, alpha=alpha)
        self.ends: set[int] = set()
        self.continued = False

    def match(self, keys: Sequence[int]) -> None:
        self.continued = bool(keys) and keys[-1] in self.ends
        if not self.continued:
            super().match(keys)
            return
        self.clock += 1
        for k in keys:
            del self.queues[min(self.uses[k], self.classes)][k]

    def publish(self, keys: Sequence[int]) -> None:
        if self.continued:
            self.cached.update(keys)
            for k in keys:
                self.uses[k] = max(self.uses.get(k, 0), 1)
        else:
            super().publish(keys)
        if keys:
            self.ends.add(keys[-1])

    def evict(self, n: int) -> None:
        for _ in range(n):
            q = self.queues[self.pick()]
            k, stamp = q.popitem(last=False)
            self.cached.remove(k)
            if k in self.ends:
                self.ends.discard(k)
                if q:
                    head = next(iter(q))
                    if q[head] == stamp:
                        self.ends.add(head)


def engine_keys(trace: Trace) -> dict[int, bytes]:
    """The engine's sha256_cbor key of every interned chain block of ``trace``."""
    from kvd_client.wire.hashing import BlockHasher

    hasher = BlockHasher(BLOCK)
    known: dict[int, bytes] = {}
    for req, keys in zip(trace.requests, trace.keys, strict=True):
        if keys and keys[-1] not in known:
            tokens = expand_tokens(req)[: len(keys) * BLOCK]
            known.update(zip(keys, hasher.keys(tokens, None), strict=True))
    return known


class EngineFrequency(Policy):
    """kvd's ``eviction = "frequency"`` (`kvd.engine.frequency.FrequencyPool`) on
    interned keys with the engine's sha256 ``digests`` (`engine_keys`), use table
    and weights: the same hit ratio as replay.py's engine, to the token."""

    def __init__(self, capacity: int, digests: dict[int, bytes]) -> None:
        super().__init__(capacity)
        self.digests = digests
        self.weight = WEIGHT
        self.table = UseTable(capacity)
        self.queues: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(CLASSES + 1)]
        self.uses: dict[int, int] = {}
        self.clock = 0

    def match(self, keys: Sequence[int]) -> None:
        self.clock += 1
        uses, queues = self.uses, self.queues
        for k in keys:
            u = uses[k]
            del queues[u][k]
            uses[k] = min(u + 1, CLASSES)

    def publish(self, keys: Sequence[int]) -> None:
        self.cached.update(keys)
        below = 1
        for k in reversed(keys):
            digest = self.digests[k]
            if UseTable.sampled(digest):
                below = min(self.table.recall(digest) + 1, CLASSES)
            self.uses[k] = below

    def release(self, keys: Sequence[int]) -> None:
        uses, queues, clock = self.uses, self.queues, self.clock
        for k in keys:
            queues[uses[k]][k] = clock

    def evict(self, n: int) -> None:
        queues = self.queues
        clock = self.clock + 1
        for _ in range(n):
            # The queue head oldest in units of uses², the lowest class on a tie.
            best, score = 0, -1
            for c in range(1, CLASSES + 1):
                q = queues[c]
                if q:
                    s = (clock - q[next(iter(q))]) * self.weight[c]
                    if s > score:
                        best, score = c, s
            k, _ = queues[best].popitem(last=False)
            self.cached.remove(k)
            u = self.uses.pop(k)
            digest = self.digests[k]
            if UseTable.sampled(digest):
                self.table.remember(digest, u)


class EngineAdaptive(EngineFrequency):
    """kvd's ``eviction = "adaptive"`` (`kvd.engine.adaptive.AdaptivePool`): the
    same queues, counts lowered along each released chain, in the order of
    `ORDERS` the engine's own `Shadows` choose, fed each request's sampled keys
    as they are released (tail first); ``offset`` is where the shadows' sampling
    test reads the digest (the engine's: 8)."""

    def __init__(self, capacity: int, digests: dict[int, bytes], offset: int = 8) -> None:
        super().__init__(capacity, digests)
        self.shadows = Shadows(capacity, offset)
        self.order = 0
        self.weight = ORDERS[0]

    def release(self, keys: Sequence[int]) -> None:
        uses = self.uses
        low = CLASSES
        for k in reversed(keys):
            if uses[k] > low:
                uses[k] = low
            else:
                low = uses[k]
        super().release(keys)
        shadows, digests = self.shadows, self.digests
        picked = [(d, uses[k]) for k in keys if shadows.sampled(d := digests[k])]
        if picked:
            shadows.refer_run(picked, self.clock)
            self.order = shadows.choose(self.order)
            self.weight = ORDERS[self.order]


#: The candidates measured beside kvd's policies, by name: capacity -> policy.
PROTOTYPES: dict[str, Callable[[int], Policy]] = {
    "arc": ARC,
    "ghost-alpha": GhostAlpha,
    "ghost-alpha-sampled": lambda cap: GhostAlpha(cap, sample=64),
    "duel": Duel,
    "branching": Branching,
}
