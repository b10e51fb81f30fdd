"""What a promotion from the remote tier (tier 2, Redis) costs beside recomputing the prefill.

A real redis-server on a free loopback port, and two daemons ("nodes", pools
of their own) of the example model's layout (``examples/kvd_llm``, size
``demo``: 8 layers, 2 KV heads of 64, fp32) sharing it. Client A commits a
``--tokens`` prompt on node A and frees it; once it is stored and node B has
read its names, client B allocates the prompt on node B, whose daemon fetches,
checks and copies every block of the prefix into its pool before the reply.
Timed: B's allocate with the promotion (median of ``rounds``; between rounds
another prompt pushes the blocks out of B's pool), the same allocate as a plain
pool hit, and the model's own prefill of those tokens (`tier_cost`).

`throughput` times the store itself in this process: `RedisTier.store`/`load`
of the prompt's blocks (gather, header, blake2b, pipeline; MGET, checks,
scatter) beside a bare redis-py pipeline SET / MGET of the same bytes on the
same server. Nothing asserts on time: the figures are ratios.
Run: ``.venv/bin/python -m bench.remote_tier`` (needs ``redis-server``: ``make redis``).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import redis
from kvd_client import Client

from bench._common import Figure, run_daemon
from bench.tier_cost import (
    PromotionCost,
    example_model,
    prefill_seconds,
    promotion_figure,
    promotion_rounds,
    prompts,
)
from kvd.memory.remote import RedisTier
from kvd.memory.tier import object_name

__all__ = ["RemoteCost", "describe", "figures", "measure", "redis_server", "throughput"]

#: How long the background copies may take before the run gives up (a bound, not a figure).
_SETTLE_S = 60.0


@dataclass(frozen=True, slots=True)
class RemoteCost:
    """The promotion from node B's remote tier (`PromotionCost`), and the store's
    rates in bytes per second beside bare redis-py's."""

    promotion: PromotionCost
    store_bps: float
    load_bps: float
    set_bps: float
    get_bps: float


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A redis-server on a free loopback port (no persistence) until the block ends; its url."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (make redis)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvd-bench-redis-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + _SETTLE_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()
        yield url
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _pool(num_blocks: int) -> dict[str, object]:
    layout = example_model().SIZES["demo"].layout(num_blocks)
    keys = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "num_blocks")
    return {key: getattr(layout, key) for key in keys} | {"remote_tier": True}


def _wait(kv: Client, key: str, blocks: int) -> None:
    deadline = time.monotonic() + _SETTLE_S
    while time.monotonic() < deadline:
        if kv.stats(["tiers"])["tiers"]["default"][key] >= blocks:
            return
        time.sleep(0.01)
    raise RuntimeError(f"the remote tier's {key} did not reach {blocks} within {_SETTLE_S} s")


def _median_s(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput(url: str, blocks: int, rounds: int) -> tuple[float, float, float, float]:
    """Bytes/s of `RedisTier.store`, `.load`, and a bare pipeline SET and MGET of the same bytes."""
    layout = example_model().SIZES["demo"].layout(blocks)
    buf = memoryview(bytearray(layout.total_bytes))
    np.frombuffer(buf, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 255, len(buf))
    store = RedisTier(layout, buf, url, timeout_s=10.0, retry_after_s=1.0)
    ids = list(range(blocks))
    names = [object_name("bench", i.to_bytes(32, "big")) for i in ids]
    size = blocks * store.block_bytes
    put = _median_s(lambda: store.store(ids, ids, names), rounds)
    get = _median_s(lambda: store.load(ids, ids, names), rounds)
    bare = redis.Redis.from_url(url)
    payload = bytes(buf[: store.block_bytes])
    keys = [f"bare:{i}" for i in ids]

    def set_all() -> None:
        pipe = bare.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, payload)
        pipe.execute()

    bare_put = _median_s(set_all, rounds)
    bare_get = _median_s(lambda: bare.mget(keys), rounds)
    bare.close()
    store.close()
    return size / put, size / get, size / bare_put, size / bare_get


def measure(tokens: int = 1024, rounds: int = 5) -> RemoteCost:
    """Promotion from node B's remote tier, plain hit, recompute, store rates (see the module)."""
    layout, blocks, prompt, other = prompts(tokens)
    cached = blocks * layout.block_size
    with redis_server() as url:
        remote = {"tiers.remote": {"url": url, "poll_s": 0.01}}
        with (
            run_daemon(_pool(blocks + 2), sections=remote) as node_a,
            run_daemon(_pool(blocks + 2), sections=remote) as node_b,
            Client.connect(node_a.address, name="bench-a") as kv_a,
            Client.connect(node_b.address, name="bench-b") as kv_b,
        ):
            seq = kv_a.allocate("a", prompt)
            seq.commit()
            seq.free()
            _wait(kv_a, "demotions", blocks)
            _wait(kv_b, "blocks", blocks)
            promote_s, hit_s = promotion_rounds(kv_b, prompt, other, cached, rounds)
        rates = throughput(url, blocks, rounds)
    cost = PromotionCost(
        cached,
        blocks,
        layout.num_layers * layout.page_bytes,
        promote_s,
        hit_s,
        prefill_seconds(cached, rounds),
    )
    return RemoteCost(cost, *rates)


def figures(cost: RemoteCost) -> list[Figure]:
    """The recompute a remote promotion saves, and the store's rates beside bare redis-py."""
    return [
        promotion_figure(cost.promotion, " from Redis"),
        Figure(
            "RedisTier.store (checksummed)",
            cost.store_bps / 1e6,
            "MB/s",
            "bare pipeline SET",
            cost.set_bps / 1e6,
            0.5,
        ),
        Figure(
            "RedisTier.load (checked)",
            cost.load_bps / 1e6,
            "MB/s",
            "bare MGET",
            cost.get_bps / 1e6,
            0.5,
        ),
    ]


def describe(cost: RemoteCost) -> str:
    """The figures' context in one line."""
    p = cost.promotion
    size = p.blocks * p.block_bytes
    return (
        f"remote promotion {p.promote_s * 1e3:.2f} ms ({size / p.promote_s / 1e6:.0f} MB/s "
        f"through the round trip), plain pool hit {p.hit_s * 1e3:.2f} ms, example model "
        f"prefill {p.prefill_s * 1e3:.1f} ms = {p.prefill_tokens_per_s:,.0f} tokens/s; "
        f"store {cost.store_bps / 1e6:.0f} MB/s (bare SET {cost.set_bps / 1e6:.0f}), "
        f"load {cost.load_bps / 1e6:.0f} MB/s (bare MGET {cost.get_bps / 1e6:.0f})"
    )


if __name__ == "__main__":
    from bench._common import machine, print_table

    measured = measure()
    print(describe(measured))
    print_table(f"remote tier promotion ({machine()})", figures(measured))
