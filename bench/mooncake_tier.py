"""What a promotion from a Mooncake Store remote tier costs beside recomputing the prefill.

`bench.remote_tier`'s run with a real ``mooncake_master`` (its HTTP metadata
server in process, loopback ports) in place of redis-server: two daemons of
the example model's layout, each lending the store a segment, client A commits
a ``--tokens`` prompt on node A and frees it; once node B has read A's log of
names, client B allocates the prompt on node B, whose daemon fetches, checks
and copies every block into its pool before the reply. Beside it: the same
allocate as a plain pool hit, the example model's own prefill of those tokens,
and `MooncakeTier.store`/`load` beside bare ``put_batch``/``get_batch`` of the
same bytes. Nothing asserts on time: the figures are ratios.
Run: ``.venv/bin/python -m bench.mooncake_tier`` (needs ``kvd[mooncake]``: ``make venv``).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from kvd_client import Client

from bench._common import Figure, run_daemon
from bench.remote_tier import RemoteCost, _median_s, _pool, _wait
from bench.tier_cost import (
    PromotionCost,
    example_model,
    prefill_seconds,
    promotion_figure,
    promotion_rounds,
    prompts,
)
from kvd.memory.mooncake import MooncakeTier, parse_url
from kvd.memory.tier import object_name

__all__ = ["figures", "master", "measure", "throughput"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def master() -> Iterator[str]:
    """A mooncake_master on free loopback ports until the block ends; the tier's url."""
    binary = Path(sys.executable).parent / "mooncake_master"
    rpc, http, metrics = _port(), _port(), _port()
    args = [str(binary), "-rpc_port", str(rpc), "-metrics_port", str(metrics)]
    args += ["-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1"]
    args += ["-http_metadata_server_port", str(http)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        for port in (rpc, http):
            while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("mooncake_master did not start")
                time.sleep(0.05)
        yield (
            f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata"
            "&segment_mb=64&buffer_mb=32"
        )
    finally:
        proc.kill()
        proc.wait()


def throughput(url: str, blocks: int, rounds: int) -> tuple[float, float, float, float]:
    """Bytes/s of `MooncakeTier.store`, `.load`, and bare put_batch/get_batch of the same bytes."""
    from mooncake.store import MooncakeDistributedStore

    layout = example_model().SIZES["demo"].layout(blocks)
    buf = memoryview(bytearray(layout.total_bytes))
    np.frombuffer(buf, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 255, len(buf))
    store = MooncakeTier(layout, buf, url, retry_after_s=1.0)
    ids = list(range(blocks))
    size = blocks * store.block_bytes
    n = iter(range(1 << 30))

    def names() -> list[bytes]:  # Mooncake keeps a name's first value: fresh names each round
        return [object_name("bench", next(n).to_bytes(32, "big")) for _ in ids]

    batches = [names() for _ in range(rounds)]
    put = _median_s(lambda: store.store(ids, ids, batches.pop()), rounds)
    got = names()
    store.store(ids, ids, got)
    get = _median_s(lambda: store.load(ids, ids, got), rounds)
    where = parse_url(url)
    bare = MooncakeDistributedStore()
    bare.setup(
        "127.0.0.1",
        where.metadata,
        where.segment_bytes,
        where.buffer_bytes,
        "tcp",
        "",
        where.master,
    )
    payload = bytes(buf[: store.block_bytes])
    keys = [[f"bare:{r}:{i}" for i in ids] for r in range(rounds)]
    bare_put = _median_s(lambda: bare.put_batch(keys.pop(), [payload] * blocks), rounds)
    last = [f"bare:last:{i}" for i in ids]
    bare.put_batch(last, [payload] * blocks)
    bare_get = _median_s(lambda: bare.get_batch(last), rounds)
    bare.close()
    store.close()
    return size / put, size / get, size / bare_put, size / bare_get


def measure(tokens: int = 1024, rounds: int = 5) -> RemoteCost:
    """Promotion from node B's Mooncake tier, plain hit, recompute, store rates."""
    layout, blocks, prompt, other = prompts(tokens)
    cached = blocks * layout.block_size
    with master() as url:
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
    """The recompute a Mooncake promotion saves, and the store's rates beside bare calls."""
    return [
        promotion_figure(cost.promotion, " from Mooncake"),
        Figure(
            "MooncakeTier.store",
            cost.store_bps / 1e6,
            "MB/s",
            "bare put_batch",
            cost.set_bps / 1e6,
            0.5,
        ),
        Figure(
            "MooncakeTier.load",
            cost.load_bps / 1e6,
            "MB/s",
            "bare get_batch",
            cost.get_bps / 1e6,
            0.5,
        ),
    ]


if __name__ == "__main__":
    from bench._common import machine, print_table
    from bench.remote_tier import describe

    measured = measure()
    print(describe(measured).replace("bare SET", "bare put").replace("bare MGET", "bare get"))
    print_table(f"Mooncake remote tier promotion ({machine()})", figures(measured))
