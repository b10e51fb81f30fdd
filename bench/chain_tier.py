"""What a promotion through the chain (tier 1 in host memory, then Redis) costs beside the prefill.

A real redis-server on a free loopback port and one daemon whose pool of the
example model's layout (``examples/kvd_llm``, size ``demo``: 8 layers, 2 KV
heads of 64, fp32) has a tier 1 of half the prompt's blocks over the remote
tier. The client commits a ``--tokens`` prompt; tier 1 takes its first half,
writes it through to Redis, drops it for the second half and writes that
through too, so tier 1 holds one half and only Redis the other. Each round
then pushes the prompt out of the pool and allocates it again: the daemon
copies one half from host memory and fetches, checks and copies the other
from Redis before the reply (the promoted Redis half then goes back into
tier 1 and takes the other half's slots, so the halves alternate; each
round waits for that). Timed: that allocate (median of ``rounds``), the same
allocate as a plain pool hit, and the model's own prefill of those tokens
(`bench.tier_cost.prefill_seconds`), in the same run; the daemon's own
per-tier copy times (``promotion_ms_p50``) beside them. Nothing asserts on
time: the figures are ratios.
Run: ``.venv/bin/python -m bench.chain_tier`` (needs ``redis-server``: ``make redis``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from kvd_client import Client

from bench._common import Figure, run_daemon
from bench.remote_tier import redis_server
from bench.tier_cost import (
    PromotionCost,
    example_model,
    prefill_seconds,
    promotion_figure,
    prompts,
)

__all__ = ["ChainCost", "describe", "figures", "measure"]

#: How long the background copies may take before the run gives up (a bound, not a figure).
_SETTLE_S = 60.0
#: The stats key of the chain's tier 2.
_REMOTE = "default@tier2"


@dataclass(frozen=True, slots=True)
class ChainCost:
    """The chain's promotion (`PromotionCost`, half its blocks from each tier) and
    the daemon's median copy time of each tier's part, in seconds."""

    promotion: PromotionCost
    host_part_s: float
    remote_part_s: float


def _pool(num_blocks: int, tier_blocks: int) -> dict[str, object]:
    layout = example_model().SIZES["demo"].layout(num_blocks)
    keys = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "num_blocks")
    return {key: getattr(layout, key) for key in keys} | {
        "tier_blocks": tier_blocks,
        "remote_tier": True,
    }


def _tiers(kv: Client) -> tuple[dict[str, Any], dict[str, Any]]:
    tiers = kv.stats(["tiers"])["tiers"]
    return tiers["default"], tiers[_REMOTE]


def _until(kv: Client, level: int, demotions: int) -> None:
    """Until tier ``level`` has made ``demotions`` copies in all."""
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline:
        if _tiers(kv)[level - 1]["demotions"] >= demotions:
            return
        time.sleep(0.01)
    raise RuntimeError(f"tier {level} made fewer than {demotions} copies in {_SETTLE_S} s")


def measure(tokens: int = 1024, rounds: int = 5) -> ChainCost:
    """The chain's promotion, plain hit and recompute (see the module)."""
    layout, blocks, prompt, other = prompts(tokens)
    half, cached = blocks // 2, blocks * layout.block_size
    promote, hit = [], []
    with redis_server() as url:
        remote = {"tiers.remote": {"url": url, "poll_s": 0.01}}
        with (
            run_daemon(_pool(blocks + 2, half), sections=remote) as daemon,
            Client.connect(daemon.address, name="bench-chain") as kv,
        ):
            seq = kv.allocate("a", prompt)
            seq.commit()
            seq.free()
            _until(kv, 2, blocks)  # the prompt written through
            for r in range(rounds):
                kv.allocate("evict", other).free()  # the whole pool: the prefix leaves it
                before = _tiers(kv)
                t0 = time.perf_counter()
                seq = kv.allocate("b", prompt)
                promote.append(time.perf_counter() - t0)
                assert seq.num_cached_tokens == cached, seq.num_cached_tokens
                after = _tiers(kv)
                got = [after[i]["promotions"] - before[i]["promotions"] for i in (0, 1)]
                assert got == [half, blocks - half], f"promoted from tier 1, tier 2: {got}"
                seq.free()
                t0 = time.perf_counter()
                kv.allocate("b", prompt).free()
                hit.append(time.perf_counter() - t0)
                _until(kv, 1, blocks + (r + 1) * (blocks - half))  # the Redis half back in tier 1
            host, far = _tiers(kv)
    cost = PromotionCost(
        cached,
        blocks,
        layout.num_layers * layout.page_bytes,
        statistics.median(promote),
        statistics.median(hit),
        prefill_seconds(cached, rounds),
    )
    return ChainCost(cost, host["promotion_ms_p50"] / 1e3, far["promotion_ms_p50"] / 1e3)


def figures(cost: ChainCost) -> list[Figure]:
    """The recompute a promotion through both tiers saves."""
    return [promotion_figure(cost.promotion, " from tier 1 + Redis, half each")]


def describe(cost: ChainCost) -> str:
    """The figures' context in one line."""
    p = cost.promotion
    return (
        f"chain promotion {p.promote_s * 1e3:.2f} ms ({p.blocks // 2} blocks from host memory: "
        f"{cost.host_part_s * 1e3:.2f} ms copying, {p.blocks - p.blocks // 2} from Redis: "
        f"{cost.remote_part_s * 1e3:.2f} ms fetching, checking, copying), plain pool hit "
        f"{p.hit_s * 1e3:.2f} ms, example model prefill {p.prefill_s * 1e3:.1f} ms "
        f"= {p.prefill_tokens_per_s:,.0f} tokens/s"
    )


if __name__ == "__main__":
    from bench._common import machine, print_table

    measured = measure()
    print(describe(measured))
    print_table(f"promotion through the tier chain ({machine()})", figures(measured))
