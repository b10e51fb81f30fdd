"""A client writing one block's KV into the pool through its torch view, beside np.copyto.

A daemon (``python -m kvd.cli`` on a temporary ipc:// socket) serves a shm pool with
Llama-3-8B's KV geometry (32 layers, 8 KV heads, head_dim 128, float16, 16 tokens per
block: 2 MiB per block over all layers). This process connects with the blocking
``kvd_client.Client``, allocates a sequence and writes the KV of one of its blocks
from a private source tensor, the way an inference process does:

- ``layer_major`` (the default order): ``pool.block(b).copy_(kv)``, one strided write
  through the block's zero-copy view (64 runs of 32 KiB); per layer,
  ``layer[:, b].copy_(kv[l])`` on the torch view of the layer (K and V, 64 KiB), 32
  writes per block, what a per-layer kernel does; and, for context,
  a prefill's form: per layer one indexed write of all 16 blocks,
  ``layer[:, table] = kv[l]``;
- ``block_major``: the block is one contiguous span: ``pool.block(b).copy_(kv)``; and,
  for context, the same write through the numpy view (``np.copyto(pool.np_block(b),
  kv)``), which separates the pool's memory from torch's copy kernel.

The anchor, in the same process and run: ``np.copyto`` of the same 2 MiB between two
private numpy arrays. Both sides rotate over 16 destinations (32 MiB, more than the
last-level cache) and run warm (every destination written once before timing: the
pool's pages are the daemon's, prefaulted, but each process maps them on first
touch). Figures: GB/s of KV written, the median of ``--repeat`` timed passes, each
pass writing every destination ``--passes`` times; loops alternate. Target: the pool
write >= 0.9x the memcpy.

Run: ``.venv/bin/python -m bench.dataplane [--repeat 15] [--json]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from kvd_client import Client

from bench._common import Figure, machine, print_table, run_daemon, write_results

__all__ = ["main", "rate", "run_order"]

TARGET = 0.9
LAYOUT = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}
ROTATE = 16
BLOCK_SIZE = 16


def rate(loop: Callable[[], int]) -> float:
    """GB/s of one run of ``loop``, which returns the bytes it wrote."""
    t0 = time.perf_counter()
    written = loop()
    return written / (time.perf_counter() - t0) / 1e9


def run_order(order: str, repeat: int, passes: int) -> list[Figure]:
    """Time one pool order's writes beside the memcpy, on a fresh daemon."""
    settings: dict[str, object] = {**LAYOUT, "num_blocks": ROTATE + 1, "order": order}
    with (
        run_daemon(settings) as daemon,
        Client.connect(daemon.address, pool="default", name="dataplane") as kv,
    ):
        seq = kv.allocate("dp", np.arange(ROTATE * BLOCK_SIZE, dtype=np.int32))
        blocks = [int(b) for b in seq.block_table]
        table = torch.tensor(blocks)
        pool = kv.pool
        layers = pool.layers()
        src = torch.randn(len(layers), 2, BLOCK_SIZE, 8, 128).to(torch.float16)
        per_block = src.numel() * src.element_size()
        # The same KV for every block, laid out as a prefill's [layer, kv, block, ...].
        prefill = src.unsqueeze(2).expand(-1, -1, len(blocks), -1, -1, -1).contiguous()
        src_np = src.numpy().reshape(-1)
        dst_np = [np.empty_like(src_np) for _ in range(ROTATE)]
        views = [pool.block(b) for b in blocks]
        np_views = [pool.np_block(b) for b in blocks]
        src_block = src.numpy()
        total = passes * len(blocks) * per_block

        def one_block_per_layer() -> int:
            for _ in range(passes):
                for b in blocks:
                    for layer, kv_l in zip(layers, src, strict=True):
                        layer[:, b].copy_(kv_l)
            return total

        def all_blocks_per_layer() -> int:
            for _ in range(passes):
                for layer, kv_l in zip(layers, prefill, strict=True):
                    layer[:, table] = kv_l
            return total

        def one_block() -> int:
            for _ in range(passes):
                for view in views:
                    view.copy_(src)
            return total

        def one_block_numpy() -> int:
            for _ in range(passes):
                for view in np_views:
                    np.copyto(view, src_block)
            return total

        def memcpy() -> int:
            for _ in range(passes):
                for dst in dst_np:
                    np.copyto(dst, src_np)
            return total

        cases: dict[str, Callable[[], int]]
        if order == "layer_major":
            cases = {
                "one block, one write through pool.block(b)": one_block,
                f"one block, {len(layers)} layer writes": one_block_per_layer,
                f"{len(blocks)} blocks per layer write": all_blocks_per_layer,
            }
        else:
            cases = {
                "one block, one write": one_block,
                "one block, numpy view (context)": one_block_numpy,
            }
        rates: dict[str, list[float]] = {name: [] for name in (*cases, "memcpy")}
        for name, write in cases.items():
            write()  # map the pool's pages into this process
            if not all(torch.equal(pool.block(b), src) for b in blocks):
                raise RuntimeError(f"{name}: the pool does not hold what was written")
        memcpy()
        for _ in range(repeat):
            for name, write in cases.items():
                rates[name].append(rate(write))
            rates["memcpy"].append(rate(memcpy))
        seq.free()
    anchor = statistics.median(rates["memcpy"])
    return [
        Figure(
            f"{order}: {name}",
            statistics.median(rates[name]),
            "GB/s",
            "np.copyto, same bytes",
            anchor,
            TARGET,
        )
        for name in cases
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="median of N timed passes")
    parser.add_argument("--passes", type=int, default=4, help="writes of each block per pass")
    parser.add_argument("--json", action="store_true", help="also write bench/results/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures = [
        f
        for order in ("layer_major", "block_major")
        for f in run_order(order, args.repeat, args.passes)
    ]
    print_table(f"data plane: client writes into a shm pool ({machine()})", figures)
    if args.json:
        write_results("dataplane", figures, {"repeat": args.repeat, "passes": args.passes})


if __name__ == "__main__":
    main()
