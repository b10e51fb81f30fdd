"""Mooncake traces at 16-token-block granularity, and the cache simulators replay.py compares.

A trace (JSON Lines, see ``/work/shared/traces/README.md``) lists per request its
``input_length`` and ``hash_ids``: one id per 512-token block *with its whole prefix*.
Each request is expanded to kvd's 16-token blocks: the 512-token block of id ``h``
becomes 32 blocks whose tokens are ``h * 512 + 0..511`` (mod 2**31 - 1, so ids below
4,194,303 get distinct tokens), and the prompt is cut to ``input_length`` tokens,
which keeps ``ceil(input_length / 16)`` blocks of the last, partial id. The engine's
chained keys then make two prompts share exactly the blocks under their common ids.
The simulators key block ``j`` of the chain ending in id ``h`` by an interned
(chain, j) number, so they agree with the engine even for a trace where an id follows
two different parents.

Every simulator serves requests one at a time in file order, as ``replay.py`` drives
the engine: a request needs all its blocks resident at once (its own blocks are never
evicted to serve it); a request larger than the cache cannot run (a miss, nothing
changes); its hit is the longest cached prefix, capped at ``(input_length - 1) // 16``
blocks (the last token is always computed); only full blocks are cached. The figure
is the token hit ratio: hit tokens over all prompt tokens, refused requests included.

Simulators (all exact at block granularity; a few seconds per million blocks):

- `simulate_lru`: vLLM 0.33.0's ``BlockPool``, block for block (kvd's engine too,
  with ``duplicates=False``).
- `simulate_optimum`: Belady's MIN, the offline optimum (see its docstring).
- prototypes of other policies for the engine's owner, in `POLICIES`.
"""

from __future__ import annotations

import functools
import heapq
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = [
    "BLOCK",
    "PER_ID",
    "POLICIES",
    "TRACE_BLOCK",
    "Outcome",
    "Trace",
    "TraceError",
    "TraceRequest",
    "expand_tokens",
    "load_trace",
    "mix64",
    "next_uses",
    "simulate_freq_classes",
    "simulate_freq_classes_table",
    "simulate_lru",
    "simulate_lru_oracle_admission",
    "simulate_optimum",
    "simulate_s3fifo",
]

#: Tokens per trace block (a ``hash_ids`` entry) and per kvd block.
TRACE_BLOCK = 512
BLOCK = 16
PER_ID = TRACE_BLOCK // BLOCK
#: Token ids are taken modulo this (the wire's int32 range).
_TOKEN_MOD = 2**31 - 1
#: The next use of a block that is never used again.
NEVER = 1 << 62
_PINNED = -1


class TraceError(ValueError):
    """A trace line is not a Mooncake request (names the file and line)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: prompt length in tokens and its 512-token prefix ids."""

    input_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace expanded to 16-token blocks.

    ``keys[r]`` are request ``r``'s full blocks as interned chain-block numbers
    (equal numbers <=> equal prefix up to and including that block); ``blocks[r]``
    counts all its blocks, the partial last one included; ``tokens[r]`` is its
    prompt length.
    """

    requests: tuple[TraceRequest, ...]
    keys: tuple[tuple[int, ...], ...]
    blocks: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        """Prompt tokens over all requests (the hit ratio's denominator)."""
        return sum(self.tokens)

    @classmethod
    def from_requests(cls, requests: Sequence[TraceRequest]) -> Trace:
        """Expand ``requests``; the prefix structure comes from ``hash_ids`` alone."""
        chains: dict[tuple[int, int], int] = {}
        keys = []
        for req in requests:
            full = req.input_length // BLOCK
            out: list[int] = []
            parent = -1
            for h in req.hash_ids:
                if len(out) >= full:
                    break
                chain = chains.setdefault((parent, h), len(chains))
                base = chain * PER_ID
                out.extend(range(base, base + min(PER_ID, full - len(out))))
                parent = chain
            keys.append(tuple(out))
        return cls(
            tuple(requests),
            tuple(keys),
            tuple(-(-r.input_length // BLOCK) for r in requests),
            tuple(r.input_length for r in requests),
        )


def load_trace(path: Path) -> list[TraceRequest]:
    """Read a Mooncake JSON Lines trace; raises `TraceError` on a malformed line."""
    out = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected an object")
            length = obj.get("input_length")
            ids = obj.get("hash_ids")
            if type(length) is not int or length < 1:
                raise TraceError(f"{where}: input_length must be a positive integer")
            if not isinstance(ids, list) or not all(type(h) is int and h >= 0 for h in ids):
                raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
            if len(ids) != -(-length // TRACE_BLOCK):
                raise TraceError(
                    f"{where}: {len(ids)} hash_ids for {length} tokens "
                    f"(expected ceil({length}/{TRACE_BLOCK}))"
                )
            out.append(TraceRequest(length, tuple(ids)))
    if not out:
        raise TraceError(f"{path}: no requests")
    return out


_OFFSETS = np.arange(TRACE_BLOCK, dtype=np.int64)


def expand_tokens(req: TraceRequest) -> npt.NDArray[np.int32]:
    """The request's prompt: id ``h`` contributes ``h * 512 + 0..511``, cut to length."""
    ids = np.asarray(req.hash_ids, dtype=np.int64)
    tokens = (ids[:, None] * TRACE_BLOCK + _OFFSETS[None, :]).reshape(-1)[: req.input_length]
    return (tokens % _TOKEN_MOD).astype(np.int32)


@dataclass(slots=True)
class Outcome:
    """Tokens hit and requests refused by one replay at one capacity."""

    hit_tokens: int = 0
    refused: int = 0
    seconds: float = 0.0
    total_tokens: int = 0

    @property
    def hit_ratio(self) -> float:
        """Hit tokens over all prompt tokens."""
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0


def simulate_lru(trace: Trace, capacity: int, *, duplicates: bool = True) -> Outcome:
    """vLLM's ``BlockPool`` eviction, block for block.

    One queue: unkeyed blocks at the front (reused first), keyed blocks behind them
    in release order (each request's blocks released last block first), evicted
    from the front; a hit takes its block out of the queue. ``duplicates=True``
    (vLLM): when the capped last block is recomputed, the new copy joins the index
    beside the old one and lookups return the oldest copy; ``False`` (kvd): the copy
    stays private and is released unkeyed.
    """
    out = Outcome(total_tokens=trace.total_tokens)
    t0 = time.perf_counter()
    free = capacity
    lru: OrderedDict[int, int] = OrderedDict()  # slot -> key; front evicted first
    dups: dict[int, list[int]] = {}  # key -> duplicate slots (negative), oldest first
    next_dup = -1
    for keys, nblocks, length in zip(trace.keys, trace.blocks, trace.tokens, strict=True):
        if nblocks > capacity:
            out.refused += 1
            continue
        cap = (length - 1) // BLOCK
        held: list[tuple[int, int]] = []  # (slot, key) of the keyed blocks, in block order
        for key in keys[:cap]:
            if key in lru:
                del lru[key]
                held.append((key, key))
            elif key in dups:
                slot = dups[key][0]
                del lru[slot]
                held.append((slot, key))
            else:
                break
        hit = len(held)
        need = nblocks - hit
        take = min(free, need)
        free -= take
        for _ in range(need - take):
            slot, key = lru.popitem(last=False)
            if slot < 0:
                rest = dups[key]
                rest.remove(slot)
                if not rest:
                    del dups[key]
        unkeyed = nblocks - len(keys)
        # Keys past the hit are new, except a capped last block still cached.
        for key in keys[hit:]:
            if key in lru or key in dups:
                if not duplicates:
                    unkeyed += 1
                    continue
                dups.setdefault(key, []).append(next_dup)
                held.append((next_dup, key))
                next_dup -= 1
            else:
                held.append((key, key))
        free += unkeyed
        for slot, key in reversed(held):
            lru[slot] = key
        out.hit_tokens += hit * BLOCK
    out.seconds = time.perf_counter() - t0
    return out


def next_uses(trace: Trace, runs: Sequence[bool]) -> list[list[int]]:
    """For each request that runs, the index of the next running request using each key."""
    seen: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in trace.keys]
    for r in range(len(trace.keys) - 1, -1, -1):
        if not runs[r]:
            continue
        keys = trace.keys[r]
        out[r] = [seen.get(k, NEVER) for k in keys]
        for k in keys:
            seen[k] = r
    return out


def simulate_optimum(trace: Trace, capacity: int) -> Outcome:
    """Belady's MIN for a prefix cache: evict the block whose next use is farthest.

    What "optimal" means here: the cache holds at most ``capacity`` blocks; a
    request must have all its blocks resident while it runs (its own blocks are
    never evicted to serve it); its hit is the longest cached prefix, capped like
    kvd's; the goal is the most hit tokens over the whole trace, knowing the future.
    Every block weighs 16 tokens, so most hit tokens = fewest block misses, and for
    that count MIN (evict the block used again farthest in the future, lazily, only
    when room is needed) is optimal; the exchange argument carries over because the
    set of blocks a request pins depends on the time alone, not on the schedule.

    Prefix closure comes for free: any request that uses a block uses its whole
    prefix, so an ancestor's next use is never later than its descendant's; ties
    evict the deeper block first. So MIN never keeps a block whose prefix is gone,
    and "a block is useful only if its whole prefix is present" costs it nothing.
    Requests that can't run at this capacity are left out of the future it sees.

    Simplification: a capped last block that is cached is treated as held (kvd
    recomputes it into a private block, one more block for that request only).
    """
    out = Outcome(total_tokens=trace.total_tokens)
    runs = [n <= capacity for n in trace.blocks]
    t0 = time.perf_counter()
    nexts = next_uses(trace, runs)
    free = capacity
    prio: dict[int, int] = {}  # cached key -> its next use, or _PINNED while in use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key); stale entries skipped
    push, pop = heapq.heappush, heapq.heappop
    for r, (keys, nblocks, length) in enumerate(
        zip(trace.keys, trace.blocks, trace.tokens, strict=True)
    ):
        if not runs[r]:
            out.refused += 1
            continue
        cached = 0
        for key in keys:
            if key not in prio:
                break
            prio[key] = _PINNED  # its heap entries no longer match: not evictable now
            cached += 1
        need = nblocks - cached
        take = min(free, need)
        free -= take
        for _ in range(need - take):
            while True:
                neg_next, _, key = pop(heap)
                if prio.get(key) == -neg_next:
                    del prio[key]
                    break
        free += nblocks - len(keys)
        for depth, (key, nxt) in enumerate(zip(keys, nexts[r], strict=True)):
            prio[key] = nxt
            push(heap, (-nxt, -depth, key))
        out.hit_tokens += min(cached, (length - 1) // BLOCK) * BLOCK
        if len(heap) > 4 * capacity + 1024:  # drop stale entries now and then
            heap = [e for e in heap if prio.get(e[2]) == -e[0]]
            heapq.heapify(heap)
    out.seconds = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------
# Prototypes for the engine's eviction policy (see bench/README.md, "Eviction").


def _first_missing(keys: Sequence[int], cached: Callable[[int], bool], cap: int) -> int:
    hit = 0
    for key in keys[:cap]:
        if not cached(key):
            break
        hit += 1
    return hit


def simulate_lru_oracle_admission(trace: Trace, capacity: int) -> Outcome:
    """kvd's LRU, except that a block never used again is not kept (an oracle).

    Not a policy one can build: it bounds what any one-hit-wonder filter
    (S3-FIFO's small queue, TinyLFU admission) could add to LRU.
    """
    out = Outcome(total_tokens=trace.total_tokens)
    runs = [n <= capacity for n in trace.blocks]
    t0 = time.perf_counter()
    nexts = next_uses(trace, runs)
    free = capacity
    lru: OrderedDict[int, None] = OrderedDict()
    for r, (keys, nblocks, length) in enumerate(
        zip(trace.keys, trace.blocks, trace.tokens, strict=True)
    ):
        if not runs[r]:
            out.refused += 1
            continue
        hit = _first_missing(keys, lru.__contains__, len(keys))
        for key in keys[:hit]:
            del lru[key]
        need = nblocks - hit
        take = min(free, need)
        free -= take
        for _ in range(need - take):
            lru.popitem(last=False)
        for key, nxt in zip(reversed(keys), reversed(nexts[r]), strict=True):
            if nxt == NEVER:
                free += 1
            else:
                lru[key] = None
        free += nblocks - len(keys)
        out.hit_tokens += min(hit, (length - 1) // BLOCK) * BLOCK
    out.seconds = time.perf_counter() - t0
    return out


def simulate_s3fifo(
    trace: Trace, capacity: int, *, small: float = 0.1, max_freq: int = 3
) -> Outcome:
    """S3-FIFO (Yang et al., SOSP '23) over blocks, released tail first.

    New blocks enter a small FIFO (``small`` of the capacity); a block reused while
    there moves to the main FIFO on eviction, else it is dropped and remembered in a
    ghost FIFO (as many keys as the capacity); a ghost hit enters main directly.
    Main evicts FIFO with second chances (a 2-bit use counter). A request's resident
    blocks leave their queue while it runs and return to its tail with one more use.
    """
    out = Outcome(total_tokens=trace.total_tokens)
    t0 = time.perf_counter()
    free = capacity
    fifo_s: OrderedDict[int, None] = OrderedDict()
    fifo_m: OrderedDict[int, None] = OrderedDict()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}  # cached key -> uses (0..max_freq)
    small_target = max(1, int(capacity * small))
    for keys, nblocks, length in zip(trace.keys, trace.blocks, trace.tokens, strict=True):
        if nblocks > capacity:
            out.refused += 1
            continue
        hit = _first_missing(keys, freq.__contains__, (length - 1) // BLOCK)
        home: dict[int, OrderedDict[int, None]] = {}
        for key in keys:
            if key in fifo_s:
                del fifo_s[key]
                home[key] = fifo_s
            elif key in fifo_m:
                del fifo_m[key]
                home[key] = fifo_m
        need = nblocks - len(home)
        take = min(free, need)
        free -= take
        evicted = 0
        while evicted < need - take:
            if len(fifo_s) >= small_target or not fifo_m:
                key, _ = fifo_s.popitem(last=False)
                if freq[key]:
                    freq[key] = 0
                    fifo_m[key] = None
                    continue
                del freq[key]
                ghost[key] = None
                if len(ghost) > capacity:
                    ghost.popitem(last=False)
            else:
                key, _ = fifo_m.popitem(last=False)
                if freq[key]:
                    freq[key] -= 1
                    fifo_m[key] = None
                    continue
                del freq[key]
            evicted += 1
        for key in reversed(keys):
            queue = home.get(key)
            if queue is not None:
                freq[key] = min(freq[key] + 1, max_freq)
                queue[key] = None
            else:
                freq[key] = 0
                if key in ghost:
                    del ghost[key]
                    fifo_m[key] = None
                else:
                    fifo_s[key] = None
        free += nblocks - len(keys)
        out.hit_tokens += hit * BLOCK
    out.seconds = time.perf_counter() - t0
    return out


def simulate_freq_classes(
    trace: Trace, capacity: int, *, classes: int = 8, power: float = 2.0, ghost: bool = True
) -> Outcome:
    """LRU queues per use count: evict the queue head oldest in units of ``uses**power``.

    A block used ``f`` times (``min(f, classes)``) lives in queue ``f``, each queue in
    release order (tail first, as kvd's). To evict, every queue's head is compared by
    its age (requests since its last use) divided by ``f**power``: a block used twice
    stays 4x as long as a block used once, at equal recency. With ``ghost``, use
    counts persist past eviction, so a returning prefix keeps its class; without,
    an evicted block starts again at one use. In the engine this is ``classes``
    intrusive queues instead of one: O(classes) per eviction.
    """
    out = Outcome(total_tokens=trace.total_tokens)
    t0 = time.perf_counter()
    free = capacity
    queues: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(classes + 1)]
    where: dict[int, int] = {}  # cached key -> its class
    uses: dict[int, int] = {}  # key -> uses so far (kept after eviction)
    scale = [1.0 / max(c, 1) ** power for c in range(classes + 1)]
    for now, (keys, nblocks, length) in enumerate(
        zip(trace.keys, trace.blocks, trace.tokens, strict=True)
    ):
        if nblocks > capacity:
            out.refused += 1
            continue
        hit = _first_missing(keys, where.__contains__, (length - 1) // BLOCK)
        need = nblocks - _pull_resident(keys, where, queues)
        take = min(free, need)
        free -= take
        for _ in range(need - take):
            key, _ = queues[_oldest_class(queues, now, scale)].popitem(last=False)
            del where[key]
            if not ghost:
                del uses[key]
        for key in reversed(keys):
            f = uses.get(key, 0) + 1
            uses[key] = f
            c = min(f, classes)
            where[key] = c
            queues[c][key] = now
        free += nblocks - len(keys)
        out.hit_tokens += hit * BLOCK
    out.seconds = time.perf_counter() - t0
    return out


def _pull_resident(
    keys: Sequence[int], class_of: dict[int, int], queues: list[OrderedDict[int, int]]
) -> int:
    """Take a request's cached ``keys`` out of their class queues (``class_of``
    maps a cached key to its class); how many there were."""
    resident = 0
    for key in keys:
        c = class_of.get(key)
        if c is not None:
            del queues[c][key]
            resident += 1
    return resident


def _oldest_class(queues: list[OrderedDict[int, int]], now: int, scale: list[float]) -> int:
    """The class whose queue head has the largest age (requests since its last use,
    plus one) times its class's ``scale``: the one to evict from."""
    best, oldest = 0, -1.0
    for c, queue in enumerate(queues):
        if queue:
            age = (now - queue[next(iter(queue))] + 1) * scale[c]
            if age > oldest:
                best, oldest = c, age
    return best


_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser: a 64-bit hash of an interned key (a sha256 key's stand-in)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def simulate_freq_classes_table(
    trace: Trace,
    capacity: int,
    *,
    classes: int = 8,
    power: float = 2.0,
    per_block: float = 4.0,
    sample: int = 64,
    probes: int = 2,
    halve: bool = True,
) -> Outcome:
    """`simulate_freq_classes` with the engine's bounded memory of evicted blocks' counts.

    The engine's design (``kvd/engine/frequency.py``): a cached block's use count is
    exact (saturating at ``classes``). Counts outlive eviction only for *sampled* keys
    (``1/sample`` of them, by hash), in a table of ``per_block * capacity`` byte
    counters: an evicted sampled key raises its ``probes`` counters to its count (never
    lowers them); a published key starts from the smallest of its counters plus one.
    An unsampled new key takes the count of the nearest sampled new key after it in
    the same request: every use of a descendant uses its ancestors too, so that is a
    lower bound. With ``halve``, all counters halve once the table has taken as many
    keys as it has counters (counts fade over ``per_block * sample / probes`` pool
    turnovers; the table never silts up).
    """
    out = Outcome(total_tokens=trace.total_tokens)
    t0 = time.perf_counter()
    free = capacity
    queues: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(classes + 1)]
    uses: dict[int, int] = {}  # cached key -> its count (saturated)
    size = max(64, int(per_block * capacity))
    table = bytearray(size)
    halved = bytes(i >> 1 for i in range(256))
    writes = 0
    scale = [1.0 / max(c, 1) ** power for c in range(classes + 1)]

    def slots(key: int) -> list[int] | None:
        h = mix64(key)
        if (h >> 56) % sample:
            return None
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1  # double hashing
        return [(h1 + i * h2) % size for i in range(probes)]

    for now, (keys, nblocks, length) in enumerate(
        zip(trace.keys, trace.blocks, trace.tokens, strict=True)
    ):
        if nblocks > capacity:
            out.refused += 1
            continue
        hit = _first_missing(keys, uses.__contains__, (length - 1) // BLOCK)
        need = nblocks - _pull_resident(keys, uses, queues)
        take = min(free, need)
        free -= take
        for _ in range(need - take):
            key, _ = queues[_oldest_class(queues, now, scale)].popitem(last=False)
            f = uses.pop(key)
            where = slots(key)
            if where is None:
                continue
            for i in where:
                table[i] = max(table[i], f)
            writes += 1
            if halve and writes >= size:
                table = bytearray(table.translate(halved))
                writes = 0
        below = 0
        for key in reversed(keys):
            f = uses.get(key)
            if f is None:
                where = slots(key)
                if where is not None:
                    below = min(table[i] for i in where)
                f = below
            f = min(f + 1, classes)
            uses[key] = f
            queues[f][key] = now
        free += nblocks - len(keys)
        out.hit_tokens += hit * BLOCK
    out.seconds = time.perf_counter() - t0
    return out


#: Prototype policies by name (``replay.py --policy NAME``).
POLICIES: dict[str, Callable[[Trace, int], Outcome]] = {
    "freq-classes": simulate_freq_classes,
    "freq-classes-no-ghost": functools.partial(simulate_freq_classes, ghost=False),
    "freq-classes-table": simulate_freq_classes_table,
    "s3fifo": simulate_s3fifo,
    "lru-oracle-admission": simulate_lru_oracle_admission,
}
