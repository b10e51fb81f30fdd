"""Pauses while a large pool warms up: a client's ping beside the first fill of a 1M-block pool.

A real daemon (``python -m kvd.cli`` on a temporary ipc:// socket) with one pool of
``--blocks`` blocks (default 1,000,000, a tiny layout: the metadata is what is timed),
a *probe* process sending ``kv.ping()`` back to back, and a *filler* (this process)
that allocates, commits and frees new 65,536-token prompts (4,096 blocks each) until
every block of the pool has been used once: the *first fill*, in which every block
record is born, every key enters a growing prefix index, and the heap grows by a
few hundred MB. Then the same again, the *refill* (the anchor): the same requests
on a pool whose records all exist and whose blocks are all cached, so each prompt
evicts as many. The difference between the two is what warming up costs the
other clients: the cyclic collector's full passes over the new records (the
issue this bench came with: up to ~160 ms each, see `kvd.server.freezer`), and
the index's resizes.

Figures per round (a fresh daemon each), median over ``--rounds``: the probe's ping
p99, p99.9 and longest during the first fill, each beside the same during the
refill; and the probe's time in pings over 10 ms, a share of each phase's wall
time. Targets: p99.9 and the longest ping <= 2x the refill's. Wall clock, 2 shared
cores: compare ratios.

Run: ``.venv/bin/python -m bench.warmup [--blocks N] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.synchronize import Event as EventType
from typing import Any

from bench._common import Figure, machine, percentile, print_table, run_daemon, write_results
from bench.scale import TINY, Tokens, fill_client

__all__ = ["main", "probe"]

TARGET = 2.0
#: A ping longer than this counts as a stall.
STALL_S = 0.010


def probe(address: str, stop: EventType, out: Any) -> None:
    """Ping back to back until ``stop``; put [(start, seconds)] on ``out``."""
    from kvd_client import Client

    pings: list[tuple[float, float]] = []
    with Client.connect(address, pool="default", name="probe") as kv:
        while not stop.is_set():
            t0 = time.perf_counter()
            kv.ping()
            pings.append((t0, time.perf_counter() - t0))
    out.put(pings)


def one_round(num_blocks: int) -> dict[str, dict[str, float]]:
    """Ping figures (seconds; ``stalled`` a share) of the first fill and the refill."""
    from kvd_client import Client

    ctx = mp.get_context("spawn")
    with run_daemon({**TINY, "num_blocks": num_blocks}, timeout=120) as daemon:
        stop, out = ctx.Event(), ctx.Queue()
        pinger = ctx.Process(target=probe, args=(daemon.address, stop, out))
        pinger.start()
        time.sleep(1.0)  # the probe's interpreter and connection
        with Client.connect(daemon.address, pool="default", name="filler") as kv:
            tokens = Tokens()
            t0 = time.perf_counter()
            fill_client(kv, tokens, num_blocks)
            t1 = time.perf_counter()
            fill_client(kv, tokens, num_blocks)
            t2 = time.perf_counter()
        stop.set()
        pings = out.get()
        pinger.join(30)
    phases = {"first fill": (t0, t1), "refill": (t1, t2)}
    result = {}
    for phase, (start, end) in phases.items():
        lat = [s for t, s in pings if start <= t < end]
        result[phase] = {
            "p99": percentile(lat, 99),
            "p99.9": percentile(lat, 99.9),
            "max": max(lat),
            "stalled": sum(s for s in lat if s > STALL_S) / (end - start),
            "seconds": end - start,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also write bench/results/")
    args = parser.parse_args()
    rounds = [one_round(args.blocks) for _ in range(args.rounds)]

    def median(phase: str, key: str) -> float:
        return statistics.median(r[phase][key] for r in rounds)

    figures = []
    for key, target in (("p99", float("inf")), ("p99.9", TARGET), ("max", TARGET)):
        figures.append(
            Figure(
                f"first fill: probe ping {key}",
                median("first fill", key) * 1e3,
                "ms",
                f"refill: probe ping {key}",
                median("refill", key) * 1e3,
                target,
                higher_is_better=False,
                note=(
                    "per round: "
                    + ", ".join(f"{r['first fill'][key] * 1e3:.1f}" for r in rounds)
                    + " vs "
                    + ", ".join(f"{r['refill'][key] * 1e3:.1f}" for r in rounds)
                    + " ms"
                ),
            )
        )
    figures.append(
        Figure(
            f"first fill: time in pings over {STALL_S * 1e3:.0f} ms",
            median("first fill", "stalled"),
            "%",
            "refill: the same",
            median("refill", "stalled"),
            float("inf"),
            higher_is_better=False,
            note=f"phases {median('first fill', 'seconds'):.2f} s / "
            f"{median('refill', 'seconds'):.2f} s",
        )
    )
    print_table(
        f"warm-up of a {args.blocks:,}-block pool, {args.rounds} rounds ({machine()})", figures
    )
    if args.json:
        write_results("warmup", figures, {"blocks": args.blocks, "rounds": args.rounds})


if __name__ == "__main__":
    main()
