"""Tier-aware admission: which blocks evicted from the pool deserve a host tier.

`simulate_tier` replays a trace through an LRU pool of ``capacity`` blocks whose
evicted blocks go, when ``admit`` lets them, into an LRU tier of ``tier`` blocks
(indexed by the same keys). A request's hit is its longest prefix found in the pool
or the tier; tier hits are promoted (they take pool blocks like new ones). The
figures: the hit ratio, and the demotions (blocks copied into the tier, the cost).

Run: ``.venv/bin/python -m bench.cache_tier TRACE.jsonl [CAPACITY ...]`` (trace blocks).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from bench.cache_sim import BLOCK, PER_ID, Outcome, Trace, load_trace, simulate_lru

__all__ = ["ADMISSION", "simulate_tier"]

#: Admission rules: (uses so far, depth in its chain in blocks) -> keep in the tier.
ADMISSION: dict[str, Callable[[int, int], bool]] = {
    "none": lambda uses, depth: False,
    "all": lambda uses, depth: True,
    "uses>=2": lambda uses, depth: uses >= 2,
    "head (first 512 tokens)": lambda uses, depth: depth < PER_ID,
    "uses>=2 or head": lambda uses, depth: uses >= 2 or depth < PER_ID,
}


def simulate_tier(
    trace: Trace, capacity: int, tier: int, admit: Callable[[int, int], bool]
) -> tuple[Outcome, int]:
    """(hit ratio outcome, demotions) of an LRU pool over an LRU tier (module doc)."""
    out = Outcome(total_tokens=trace.total_tokens)
    free = capacity
    pool: OrderedDict[int, None] = OrderedDict()  # evictable, least recent first
    held: set[int] = set()
    below: OrderedDict[int, None] = OrderedDict()
    uses: dict[int, int] = {}
    depth: dict[int, int] = {}
    demotions = 0
    for keys, nblocks, length in zip(trace.keys, trace.blocks, trace.tokens, strict=True):
        if nblocks > capacity:
            out.refused += 1
            continue
        hit = 0
        for key in keys[: (length - 1) // BLOCK]:
            if key not in pool and key not in below:
                break
            hit += 1
        resident = [k for k in keys[:hit] if k in pool]
        for k in resident:
            del pool[k]
        need = nblocks - len(resident)
        take = min(free, need)
        free -= take
        for _ in range(need - take):
            k, _ = pool.popitem(last=False)
            held.discard(k)
            if admit(uses[k], depth[k]):
                below[k] = None
                demotions += 1
                if len(below) > tier:
                    below.popitem(last=False)
        for i, k in enumerate(keys):
            below.pop(k, None)
            uses[k] = uses.get(k, 0) + 1
            depth.setdefault(k, i)
        new = [k for k in keys if k not in held and k not in pool]
        held.update(new)
        free += nblocks - len(resident) - len(new)
        for k in reversed(keys):
            if k in held:
                pool[k] = None
        out.hit_tokens += hit * BLOCK
    return out, demotions


def main(argv: list[str]) -> None:
    trace = Trace.from_requests(load_trace(Path(argv[0])))
    for cap in [int(c) for c in argv[1:]] or [500, 2000]:
        c = cap * PER_ID
        base = simulate_lru(trace, c, duplicates=False).hit_ratio
        same = simulate_lru(trace, 5 * c, duplicates=False).hit_ratio
        print(f"{Path(argv[0]).stem} pool {cap:,} + tier {4 * cap:,} trace blocks:")
        print(f"  pool only {100 * base:.2f} %, LRU pool of 5x {100 * same:.2f} %")
        for name, admit in ADMISSION.items():
            res, moved = simulate_tier(trace, c, 4 * c, admit)
            print(f"  {name:<24} {100 * res.hit_ratio:6.2f} %  demotions {moved:>10,}")


if __name__ == "__main__":
    main(sys.argv[1:])
