"""Replay a Mooncake-format trace: kvd's token hit ratio beside LRU and the offline optimum.

For each capacity, the trace runs through kvd's engine with its default eviction
policy (``allocate`` the prompt, ``commit``, ``free``, one request at a time in file
order; a request that does not fit is a miss) and through the simulators of
``bench/cache_sim.py`` (how the trace becomes 16-token blocks, and what every simulator
counts, is documented there):

- ``LRU (vLLM)``: vLLM 0.33.0's ``BlockPool`` eviction, block for block. In
  ``.bench-venv`` (``bench/setup-vllm-venv.sh``) vLLM's real ``KVCacheManager`` replays
  the trace too, with real sha256_cbor keys, and must agree with the simulation.
- ``optimum``: Belady's MIN with prefix closure (``cache_sim.simulate_optimum``).
- ``--engine-lru``: kvd's engine again with ``eviction = "lru"`` (it equals the LRU
  simulation with kvd's one-block-per-key rule; ``tests/bench`` checks that).
- ``--policy NAME``: prototype eviction policies (``cache_sim.POLICIES``).
- ``--tier-factor F`` (default 4; 0: off): kvd's engine with a tier 1 of F times the
  pool (``kvd + tier 1``), every committed block copied to the tier before the next
  request (the daemon's copies run at GB/s between requests; ``lost`` copies are
  the exception) and a prefix that continues there promoted before its allocate;
  beside it LRU and the optimum with the pool and the tier's blocks together
  (``(1+F)x``), which a single-level cache of that size would reach, and LRU
  at the tier's size alone (``Fx``: the tier is inclusive, so that is the
  one-level cache it matches).
- ``--promotion``: what a promotion costs beside recomputing the prefill with the
  example model (``bench/tier_cost.py``), measured in the same run.

Capacities count 512-token trace blocks, the README's unit: the pool gets 32 times as
many 16-token blocks. Figures: kvd's hit ratio beside LRU's (target: at least as high)
and beside the optimum (target: within 5 points), per capacity; ``--plot`` draws hit
ratio against capacity.

Run: ``.venv/bin/python -m bench.replay --trace FILE [--capacity-blocks N ...]
[--policy NAME ...] [--engine-lru] [--tier-factor F] [--promotion] [--plot FILE.png]
[--json]`` (``.bench-venv/bin/python`` adds the real vLLM column).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import tier_cost
from bench._common import Figure, machine, print_table, write_results
from bench.cache_sim import (
    BLOCK,
    PER_ID,
    POLICIES,
    Outcome,
    Trace,
    TraceError,
    expand_tokens,
    load_trace,
    simulate_lru,
    simulate_optimum,
)

__all__ = ["DEFAULT_CAPACITIES", "main", "plot", "replay_kvd", "replay_vllm", "run"]

#: Trace blocks (512 tokens each): from heavy eviction to (for the slice) none.
DEFAULT_CAPACITIES = (500, 1_000, 2_000, 5_000, 10_000, 20_000)
TARGET_VS_LRU = 0.0
TARGET_VS_OPTIMUM = -5.0
#: Tier 1's size in pools (``--tier-factor``).
DEFAULT_TIER_FACTOR = 4


def replay_kvd(trace: Trace, capacity: int, eviction: str = "adaptive") -> Outcome:
    """Replay through kvd's engine with ``capacity`` 16-token blocks."""
    from kvd.engine import Engine, EngineConfig, Refusal

    eng = Engine(
        EngineConfig(num_blocks=capacity, block_size=BLOCK, events=False, eviction=eviction)
    )
    eng.open_session(1)
    out = Outcome(total_tokens=trace.total_tokens)
    allocate, commit, free = eng.allocate, eng.commit, eng.free
    t0 = time.perf_counter()
    for req in trace.requests:
        r = allocate(1, "r", expand_tokens(req))
        if isinstance(r, Refusal):
            out.refused += 1
            continue
        out.hit_tokens += r.num_cached_tokens
        commit(1, "r")
        free(1, "r")
    out.seconds = time.perf_counter() - t0
    eng.check_invariants()
    return out


def replay_kvd_tier(trace: Trace, capacity: int, factor: int) -> Outcome:
    """Replay through kvd's engine with ``capacity`` blocks over a tier 1 of
    ``factor * capacity``: promotions before each allocate, every demotion
    recorded before the next request (the copies themselves are the server's)."""
    from kvd_client.wire.hashing import DEFAULT_HASH_SEED, BlockHasher

    from kvd.engine import Engine, EngineConfig, Refusal

    eng = Engine(
        EngineConfig(
            num_blocks=capacity, block_size=BLOCK, events=False, tier_blocks=factor * capacity
        )
    )
    tier = eng.tier
    assert tier is not None
    eng.open_session(1)
    hasher = BlockHasher(BLOCK, DEFAULT_HASH_SEED)
    out = Outcome(total_tokens=trace.total_tokens)
    t0 = time.perf_counter()
    for req in trace.requests:
        tokens = expand_tokens(req)
        keys = hasher.keys(tokens[: len(tokens) // BLOCK * BLOCK], None)
        promo = eng.promote(1, "r", tokens, keys)
        if promo is not None:
            tier.promoted(promo, True)
        r = eng.allocate(1, "r", tokens, keys=keys)
        if isinstance(r, Refusal):
            out.refused += 1
            continue
        out.hit_tokens += r.num_cached_tokens
        eng.commit(1, "r")
        eng.free(1, "r")
        tier.demoted(tier.demotions(1 << 30), True)
    out.seconds = time.perf_counter() - t0
    eng.check_invariants()
    return out


def replay_vllm(trace: Trace, capacity: int) -> Outcome:
    """Replay through vLLM 0.33.0's real ``KVCacheManager`` (sha256_cbor keys).

    Driven like its scheduler: ``get_computed_blocks``, ``allocate_slots`` for the
    rest of the prompt, ``free``. Keys are computed once per distinct chain block
    with vLLM's own ``hash_block_tokens`` and handed to each ``Request``.
    """
    from bench.vllm_support import VllmDriver, make_manager, make_request, sha256_block_keys

    driver = VllmDriver(make_manager(capacity, BLOCK))
    keys = sha256_block_keys(trace, expand_tokens, BLOCK)
    out = Outcome(total_tokens=trace.total_tokens)
    t0 = time.perf_counter()
    for i, req in enumerate(trace.requests):
        request = make_request(f"r{i}", expand_tokens(req).tolist(), keys[i], block_size=BLOCK)
        hit = driver.admit(request)
        if hit is None:
            out.refused += 1
            continue
        out.hit_tokens += hit
        driver.finish(request)
    out.seconds = time.perf_counter() - t0
    return out


def vllm_available() -> bool:
    """Whether vLLM's KV-cache manager imports here (``.bench-venv``)."""
    try:
        import bench.vllm_support  # noqa: F401
    except ImportError:
        return False
    return True


Replayer = Callable[[Trace, int], Outcome]


def run(
    trace: Trace,
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    vllm: bool,
    engine_lru: bool = False,
    tier_factor: int = 0,
) -> dict[str, list[Outcome]]:
    """Every replayer at every capacity (in trace blocks): name -> outcomes."""
    replayers: dict[str, Replayer] = {
        "kvd": replay_kvd,
        "LRU (vLLM)": simulate_lru,
        "optimum": simulate_optimum,
    }
    if vllm:
        replayers["vLLM 0.33.0"] = replay_vllm
    if engine_lru:
        replayers["kvd, eviction=lru"] = functools.partial(replay_kvd, eviction="lru")
    for name in policies:
        replayers[f"proto: {name}"] = POLICIES[name]
    if tier_factor:
        total = 1 + tier_factor
        replayers |= {
            f"kvd + tier 1 ({tier_factor}x)": functools.partial(
                replay_kvd_tier, factor=tier_factor
            ),
            # The tier is inclusive (the pool's blocks are in it too): one level of its size.
            f"LRU ({tier_factor}x)": lambda trace, cap: simulate_lru(trace, tier_factor * cap),
            f"LRU ({total}x)": lambda trace, cap: simulate_lru(trace, total * cap),
            f"optimum ({total}x)": lambda trace, cap: simulate_optimum(trace, total * cap),
        }
    results: dict[str, list[Outcome]] = {name: [] for name in replayers}
    for cap in capacities:
        for name, replayer in replayers.items():
            results[name].append(replayer(trace, cap * PER_ID))
    return results


def ideal(trace: Trace) -> Outcome:
    """The hit ratio of a cache that never evicts."""
    return simulate_lru(trace, sum(trace.blocks))


def plot(
    path: Path,
    title: str,
    capacities: Sequence[int],
    results: dict[str, list[Outcome]],
    infinite: float,
) -> None:
    """Hit ratio against capacity, one line per replayer, the infinite cache dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style: dict[str, dict[str, Any]] = {
        "kvd": {"color": "C0", "marker": "o", "linewidth": 2.5, "zorder": 3},
        "LRU (vLLM)": {"color": "C1", "marker": "x", "linestyle": "--", "markersize": 9},
        "vLLM 0.33.0": {"color": "C1", "marker": "+", "linestyle": "none", "markersize": 12},
        "kvd, eviction=lru": {"color": "C1", "marker": "1", "linestyle": "none", "markersize": 12},
        "optimum": {"color": "C2", "marker": "s", "linewidth": 2},
    }
    prototype = iter(["C3", "C4", "C5", "C6", "C7", "C8", "C9"])
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    for name, outcomes in results.items():
        kw = style.get(name) or {"color": next(prototype), "marker": ".", "linestyle": ":"}
        ax.plot(capacities, [100 * o.hit_ratio for o in outcomes], label=name, **kw)
    ax.axhline(100 * infinite, color="grey", linestyle="--", linewidth=1, label="infinite cache")
    ax.set_xscale("log")
    ax.set_xticks(list(capacities), [f"{c:,}" for c in capacities])
    ax.minorticks_off()
    ax.set_xlabel(f"capacity, 512-token trace blocks (x{PER_ID} kvd blocks of {BLOCK} tokens)")
    ax.set_ylabel("token hit ratio, %")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(outcome: Outcome) -> str:
    refused = f" r{outcome.refused}" if outcome.refused else ""
    return f"{100 * outcome.hit_ratio:.2f} %{refused}"


def tier_figures(
    capacities: Sequence[int], results: dict[str, list[Outcome]], factor: int
) -> list[Figure]:
    """Per capacity: pool + tier 1 beside the pool alone (target: a gain), and
    beside LRU and the optimum with the same blocks in one level."""
    tiered = results[f"kvd + tier 1 ({factor}x)"]
    rows = []
    for i, cap in enumerate(capacities):
        value = tiered[i].hit_ratio
        for anchor, target in (
            ("kvd", 0.0),
            (f"LRU ({1 + factor}x)", TARGET_VS_LRU),
            (f"optimum ({1 + factor}x)", TARGET_VS_OPTIMUM),
        ):
            rows.append(
                Figure(
                    f"{cap:,}: kvd + tier 1 vs {anchor}",
                    value,
                    "%",
                    anchor if anchor != "kvd" else "kvd, pool only",
                    results[anchor][i].hit_ratio,
                    target,
                    compare="points",
                )
            )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake JSON Lines file")
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        nargs="+",
        default=list(DEFAULT_CAPACITIES),
        metavar="N",
        help=f"capacities in 512-token trace blocks (default {list(DEFAULT_CAPACITIES)})",
    )
    parser.add_argument(
        "--policy",
        nargs="*",
        default=[],
        choices=sorted(POLICIES),
        help="also simulate these prototype eviction policies",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's real manager")
    parser.add_argument(
        "--engine-lru", action="store_true", help='also replay kvd\'s engine with eviction = "lru"'
    )
    parser.add_argument(
        "--tier-factor",
        type=int,
        default=DEFAULT_TIER_FACTOR,
        metavar="F",
        help=f"tier 1 of F pools (default {DEFAULT_TIER_FACTOR}; 0: no tier columns)",
    )
    parser.add_argument(
        "--promotion",
        action="store_true",
        help="also time a promotion beside the example model's prefill (starts a daemon)",
    )
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw hit ratio vs capacity")
    parser.add_argument("--json", action="store_true", help="also write bench/results/")
    args = parser.parse_args(argv)
    if any(c < 1 for c in args.capacity_blocks) or args.tier_factor < 0:
        parser.error("capacities must be positive and the tier factor at least 0")
    try:
        trace = Trace.from_requests(load_trace(args.trace))
    except (OSError, TraceError) as exc:
        parser.error(str(exc))
    capacities = sorted(set(args.capacity_blocks))
    vllm = not args.no_vllm and vllm_available()
    t0 = time.perf_counter()
    results = run(
        trace,
        capacities,
        args.policy,
        vllm=vllm,
        engine_lru=args.engine_lru,
        tier_factor=args.tier_factor,
    )
    infinite = ideal(trace).hit_ratio
    name = args.trace.stem
    print(
        f"{name}: {len(trace.requests):,} requests, {trace.total_tokens:,} prompt tokens, "
        f"{sum(trace.blocks):,} blocks of {BLOCK} tokens; infinite cache "
        f"{100 * infinite:.2f} %; {time.perf_counter() - t0:.0f} s"
        + ("" if vllm else " (vLLM's real manager not run: use .bench-venv)")
    )
    width = max(16, *(len(n) + 2 for n in results))
    print("\ncapacity (trace / kvd blocks)" + "".join(f"{n:>{width}}" for n in results))
    for i, cap in enumerate(capacities):
        cells = "".join(f"{_cell(o[i]):>{width}}" for o in results.values())
        print(f"{cap:>10,} / {cap * PER_ID:<16,}" + cells)
    print("(rN: N requests larger than the pool, counted as misses)")
    figures = []
    for i, cap in enumerate(capacities):
        kvd = results["kvd"][i].hit_ratio
        figures.append(
            Figure(
                f"{cap:,}: kvd vs LRU",
                kvd,
                "%",
                "LRU (vLLM)",
                results["LRU (vLLM)"][i].hit_ratio,
                TARGET_VS_LRU,
                compare="points",
            )
        )
        figures.append(
            Figure(
                f"{cap:,}: kvd vs optimum",
                kvd,
                "%",
                "optimum (Belady)",
                results["optimum"][i].hit_ratio,
                TARGET_VS_OPTIMUM,
                compare="points",
            )
        )
    if args.tier_factor:
        figures += tier_figures(capacities, results, args.tier_factor)
    if args.promotion:
        cost = tier_cost.measure()
        print("\n" + tier_cost.describe(cost))
        figures += tier_cost.figures(cost)
    print_table(f"{name}: token hit ratio ({machine()})", figures)
    if args.plot:
        plot(args.plot, f"{name}: prefix-cache hit ratio", capacities, results, infinite)
        print(f"\nplot: {args.plot}")
    if args.json:
        write_results(
            f"replay-{name}",
            figures,
            {
                "capacities": capacities,
                "hit_ratio": {k: [o.hit_ratio for o in v] for k, v in results.items()},
                "infinite": infinite,
            },
        )


if __name__ == "__main__":
    main()
