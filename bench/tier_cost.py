"""What a tier-1 promotion costs beside recomputing the prefill with the example model.

A real daemon serves one pool of the example model's layout (``examples/kvd_llm``,
size ``demo``: 8 layers, 2 KV heads of 64, fp32) over a tier of 4x its blocks.
Client A commits a ``--tokens`` prompt and frees it; once tier 1 holds its blocks,
another prompt pushes them out of the pool; client B then allocates the prompt
again, and the daemon promotes every block of the prefix from the tier before its
reply. Timed: B's allocate round trip with the promotion (median of ``rounds``),
the same allocate when the prefix is still in the pool (a plain hit), and the
model's own prefill of those tokens without kvd (``forward_reference``, median of
``rounds`` after a warm-up). Nothing asserts on time: the figures are ratios.

`churn` measures the race of copying ahead of eviction at its worst (each
request evicting the previous one). Run: ``.venv/bin/python -m bench.tier_cost``
(both; ``bench.replay --promotion`` prints the promotion beside its trace rows).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kvd_client import Client
from kvd_client.wire import PoolLayout

from bench._common import Figure, run_daemon

__all__ = [
    "PromotionCost",
    "describe",
    "example_model",
    "figures",
    "measure",
    "prefill_seconds",
    "promotion_figure",
    "promotion_rounds",
    "prompts",
]

_EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
#: How long the background demotion may take before the run gives up (a bound, not a figure).
_SETTLE_S = 60.0


@dataclass(frozen=True, slots=True)
class PromotionCost:
    """Medians in seconds for ``tokens`` prompt tokens (``blocks`` promoted each time)."""

    tokens: int
    blocks: int
    block_bytes: int
    promote_s: float
    hit_s: float
    prefill_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        """The example model's prefill speed."""
        return self.tokens / self.prefill_s


def example_model() -> Any:
    """``examples/kvd_llm/model.py`` (the examples are not a package of the repository)."""
    if str(_EXAMPLES) not in sys.path:
        sys.path.insert(0, str(_EXAMPLES))
    import kvd_llm.model

    return kvd_llm.model


def _pool(num_blocks: int, tier_blocks: int) -> dict[str, object]:
    """The ``[[pools]]`` keys of a pool of the example model's layout with a tier."""
    layout = example_model().SIZES["demo"].layout(num_blocks)
    keys = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "num_blocks")
    return {key: getattr(layout, key) for key in keys} | {"tier_blocks": tier_blocks}


def prefill_seconds(tokens: int, rounds: int) -> float:
    """Median time of the example model's prefill of ``tokens`` tokens (no kvd)."""
    import torch

    example = example_model()
    cfg = example.SIZES["demo"]
    torch.set_num_threads(1)  # as the demo's figures: threads wait on each other on 2 cores
    model = example.TinyLlama(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator())
    times = []
    with torch.inference_mode():
        model.forward_reference(ids)  # warm-up: torch's first-use costs
        for _ in range(rounds):
            t0 = time.perf_counter()
            model.forward_reference(ids)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _wait_demoted(kv: Client, blocks: int) -> None:
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline:
        if kv.stats(["tiers"])["tiers"]["default"]["demotions"] >= blocks:
            return
        time.sleep(0.01)
    raise RuntimeError(f"tier 1 did not take {blocks} blocks within {_SETTLE_S} s")


def prompts(tokens: int) -> tuple[PoolLayout, int, np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The example layout (one block), the prompt's full blocks, the prompt
    (``tokens`` + 1 ids) and another prompt that fills a pool of blocks + 2."""
    layout = example_model().SIZES["demo"].layout(num_blocks=1)
    blocks = tokens // layout.block_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, tokens + 1, dtype=np.int32)
    other = rng.integers(256, 512, (blocks + 2) * layout.block_size, dtype=np.int32)
    return layout, blocks, prompt, other


def promotion_rounds(
    kv: Client, prompt: np.ndarray[Any, Any], other: np.ndarray[Any, Any], cached: int, rounds: int
) -> tuple[float, float]:
    """Medians of ``kv``'s allocate of ``prompt`` promoting ``cached`` tokens after
    ``other`` pushed them out of the pool, and of the same allocate as a plain hit."""
    promote, hit = [], []
    for _ in range(rounds):
        kv.allocate("evict", other).free()  # the whole pool: the prefix leaves it
        t0 = time.perf_counter()
        seq = kv.allocate("b", prompt)
        promote.append(time.perf_counter() - t0)
        assert seq.num_cached_tokens == cached, seq.num_cached_tokens
        seq.free()
        t0 = time.perf_counter()
        seq = kv.allocate("b", prompt)
        hit.append(time.perf_counter() - t0)
        seq.free()
    return statistics.median(promote), statistics.median(hit)


def measure(tokens: int = 1024, rounds: int = 5) -> PromotionCost:
    """Promotion, plain hit and recompute of a ``tokens``-token prompt (see the module)."""
    layout, blocks, prompt, other = prompts(tokens)
    bs = layout.block_size
    pool = _pool(blocks + 2, 4 * (blocks + 2))
    with run_daemon(pool) as daemon, Client.connect(daemon.address, name="bench-tier") as kv:
        seq = kv.allocate("a", prompt)
        seq.commit()
        seq.free()
        _wait_demoted(kv, blocks)
        promote_s, hit_s = promotion_rounds(kv, prompt, other, blocks * bs, rounds)
    return PromotionCost(
        tokens=blocks * bs,
        blocks=blocks,
        block_bytes=layout.num_layers * layout.page_bytes,
        promote_s=promote_s,
        hit_s=hit_s,
        prefill_s=prefill_seconds(blocks * bs, rounds),
    )


def churn(think_ms: tuple[float, ...] = (0.0, 1.0, 5.0), requests: int = 200) -> list[str]:
    """How many committed blocks reach tier 1 when each request evicts the last.

    One client, a pool of 70 blocks of the example model's layout over a tier of
    1,024: every request allocates a new 64-block prompt (evicting the previous
    one's blocks at once), commits it, waits ``think_ms`` (its decode) and frees
    it. The lines say how many of the committed blocks were copied in time and
    how many copies an eviction voided (`TierStats.lost`): the race the
    design accepts for copying ahead of eviction."""
    pool = _pool(70, 1024)
    lines = []
    with run_daemon(pool) as daemon, Client.connect(daemon.address, name="bench-churn") as kv:
        first = 0
        for think in think_ms:
            before = kv.stats(["tiers"])["tiers"]["default"]
            for _ in range(requests):
                seq = kv.allocate("r", np.arange(first, first + 64 * 16 + 1, dtype=np.int32))
                first += 100_000
                seq.commit()
                time.sleep(think / 1e3)
                seq.free()
            time.sleep(0.5)  # the last copies
            after = kv.stats(["tiers"])["tiers"]["default"]
            done = after["demotions"] - before["demotions"]
            lost = after["lost"] - before["lost"]
            lines.append(
                f"decode {think:.0f} ms: {done:,} of {64 * requests:,} committed blocks "
                f"copied ({100 * done / (64 * requests):.0f} %), {lost:,} copies voided"
            )
    return lines


def promotion_figure(cost: PromotionCost, source: str = "") -> Figure:
    """The recompute a promotion saves beside the promotion (score: how many
    times cheaper the promotion is; target: cheaper at all); ``source``: from where."""
    size = cost.blocks * cost.block_bytes / 2**20
    return Figure(
        f"recompute {cost.tokens} tokens (example model)",
        cost.prefill_s * 1e3,
        "ms",
        f"allocate promoting them{source} ({size:.0f} MiB)",
        cost.promote_s * 1e3,
        1.0,
    )


def figures(cost: PromotionCost) -> list[Figure]:
    """The promotion's figure (`promotion_figure`)."""
    return [promotion_figure(cost)]


def describe(cost: PromotionCost) -> str:
    """The figures' context in one line: the plain hit, the copy rate, the model's speed."""
    size = cost.blocks * cost.block_bytes
    return (
        f"promotion {cost.promote_s * 1e3:.2f} ms ({size / cost.promote_s / 1e9:.2f} GB/s "
        f"through the round trip), plain pool hit {cost.hit_s * 1e3:.2f} ms, example model "
        f"prefill {cost.prefill_s * 1e3:.1f} ms = {cost.prefill_tokens_per_s:,.0f} tokens/s"
    )


if __name__ == "__main__":
    from bench._common import machine, print_table

    measured = measure()
    print(describe(measured))
    print("\n".join(churn()))
    print_table(f"tier 1 promotion ({machine()})", figures(measured))
