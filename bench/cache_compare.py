"""Eviction candidates against LRU and Belady on the traces and the constructed workloads.

For each trace (``/work/shared/traces``) and workload (`bench.cache_workloads`, seed 1)
at three capacities (heavy eviction, medium, near the working set), prints LRU's and
Belady's token hit ratio and each candidate's difference from LRU in points:
``adaptive (default)`` and ``frequency`` are kvd's ``eviction`` settings exactly
(`cache_policies.EngineAdaptive`, `EngineFrequency`), the others are
`cache_policies.PROTOTYPES`. A default must not be below LRU anywhere.

Run: ``.venv/bin/python -m bench.cache_compare [--only NAME ...] [--policies NAME ...]
[--sample-offset N]`` (the synthetic trace takes most of the time: about a minute per
policy and capacity). ``--sample-offset N``: the adaptive shadows sample keys by digest
bytes N..N+3 instead of the engine's 8..11 (how much the figures hang on the sample).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from bench.cache_policies import (
    LRU,
    PROTOTYPES,
    EngineAdaptive,
    EngineFrequency,
    engine_keys,
    run_policy,
)
from bench.cache_sim import PER_ID, Trace, load_trace, simulate_optimum
from bench.cache_workloads import WORKLOADS

__all__ = ["CAPACITIES", "main"]

TRACES = Path("/work/shared/traces")
#: Capacities in 512-token trace blocks (x32 kvd blocks) per trace or workload.
CAPACITIES: dict[str, tuple[int, int, int]] = {
    "synthetic_trace": (500, 2_000, 10_000),
    "mooncake_trace_slice": (500, 1_000, 2_000),
    "chat-recency": (100, 400, 1_500),
    "loop": (400, 700, 760),
    "shifting-zipf": (100, 500, 2_000),
    "scan-hot": (50, 200, 1_000),
    "agent-sessions": (50, 200, 1_000),
}


def trace_of(name: str) -> Trace:
    """A workload by name (seed 1), else the trace file ``name.jsonl``."""
    if name in WORKLOADS:
        return Trace.from_requests(WORKLOADS[name](1))
    return Trace.from_requests(load_trace(TRACES / f"{name}.jsonl"))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CAPACITIES), default=list(CAPACITIES))
    parser.add_argument(
        "--policies", nargs="*", choices=sorted(PROTOTYPES), default=list(PROTOTYPES)
    )
    parser.add_argument(
        "--sample-offset",
        type=int,
        default=8,
        help="digest byte where the adaptive shadows' sampling test reads (the engine's: 8)",
    )
    args = parser.parse_args(argv)
    names = ["adaptive (default)", "frequency", *args.policies]
    print("| trace | capacity | LRU % | Belady % | " + " | ".join(names) + " |")
    print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for name in args.only:
        trace = trace_of(name)
        digests = engine_keys(trace)
        for cap in CAPACITIES[name]:
            c = cap * PER_ID
            lru = run_policy(trace, c, LRU(c)).hit_ratio
            best = simulate_optimum(trace, c).hit_ratio
            cells = [
                run_policy(trace, c, EngineAdaptive(c, digests, args.sample_offset)).hit_ratio,
                run_policy(trace, c, EngineFrequency(c, digests)).hit_ratio,
            ]
            cells += [run_policy(trace, c, PROTOTYPES[p](c)).hit_ratio for p in args.policies]
            diffs = " | ".join(f"{100 * (h - lru):+.2f}" for h in cells)
            print(
                f"| {name} | {cap:,} | {100 * lru:.2f} | {100 * best:.2f} | {diffs} |", flush=True
            )


if __name__ == "__main__":
    main()
