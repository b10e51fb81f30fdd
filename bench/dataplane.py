"""A client writing (and reading) one block's KV through the pool API, beside np.copyto.

A daemon (``python -m kvd.cli`` on a temporary ipc:// socket) serves a shm pool with
Llama-3-8B's KV geometry (32 layers, 8 KV heads, head_dim 128, float16, 16 tokens per
block: 2 MiB per block over all layers). This process connects with the blocking
``kvd_client.Client``, allocates a sequence and moves the KV of its blocks between
private torch tensors and the pool, the way an inference process does, through the
public API of ``kv.pool`` (``PoolMapping.write_block`` and friends):

- ``pool.write_block(b, kv)``: one block's KV ``[32, 2, 16, 8, 128]`` from a torch
  tensor (the headline row); ``pool.read_block(b, out)``: the same bytes back;
- ``pool.write_blocks(table, kv)``: a prefill's 16 blocks ``[32, 2, 16, 16, 8, 128]``
  (32 MiB) in one call, the block table as allocated (consecutive ids, coalesced into
  one copy) and reversed (no two ids consecutive: one copy per block);
- ``pool.write_layer(l, ids, kv_l)``, what a model computing layer by layer calls:
  the prefill's 16 blocks per layer (32 calls), and one block per layer (32 calls of
  64 KiB per block).

For context, the torch views the API replaces: ``pool.block(b).copy_(kv)`` (one
strided write, torch's CPU copy kernel), per layer ``layer[:, b].copy_(kv[l])`` (32
writes per block, what a per-layer kernel does) and ``layer[:, table] = kv[l]`` (a
prefill's indexed write per layer) in ``layer_major``; and ``np.copyto`` on the
block's numpy view in ``block_major``.

Anchors, in the same process and run, ``np.copyto`` between private numpy arrays of
the same bytes: one block's 2 MiB into (written rows) or out of (read row) one of 16
rotating arrays, and the 32 MiB of a prefill into one array (prefill rows: their
source, too, is 32 MiB). Single-block rows rotate over 16 pool blocks (32 MiB, more
than the last-level cache). Everything runs warm (each destination written once
before timing: the pool's pages are the daemon's, prefaulted, but each process maps
them on first touch). Figures: GB/s of KV moved per second of this thread's CPU
time (torch runs one thread), the median of ``--repeat`` timed passes, each pass
moving every block ``--passes`` times; the loops take turns in a shuffled order.
Target: >= 0.9x the anchor.

Run: ``.venv/bin/python -m bench.dataplane [--repeat 15] [--json]``.
"""

from __future__ import annotations

import argparse
import random
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
#: Anchor names, and which rows each one stands beside.
BLOCK_IN, BLOCK_OUT, PREFILL = (
    "np.copyto, same 2 MiB",
    "np.copyto out, same 2 MiB",
    "np.copyto, same 32 MiB",
)


def rate(loop: Callable[[], int]) -> float:
    """GB/s of one run of ``loop``, which returns the bytes it moved, per CPU second.

    The thread's CPU time (user and system: page faults count), not the wall
    clock: every copy here runs on this one thread, and on a shared box the
    wall clock also times the other processes the scheduler runs meanwhile.
    """
    t0 = time.thread_time()
    moved = loop()
    return moved / (time.thread_time() - t0) / 1e9


def run_order(order: str, repeat: int, passes: int) -> list[Figure]:
    """Time one pool order's copies beside the memcpy anchors, on a fresh daemon."""
    settings: dict[str, object] = {**LAYOUT, "num_blocks": ROTATE + 1, "order": order}
    with (
        run_daemon(settings) as daemon,
        Client.connect(daemon.address, pool="default", name="dataplane") as kv,
    ):
        seq = kv.allocate("dp", np.arange(ROTATE * BLOCK_SIZE, dtype=np.int32))
        blocks = [int(b) for b in seq.block_table]
        scattered = blocks[::-1]
        table = torch.tensor(blocks)
        pool = kv.pool
        layers = pool.layers()
        src = torch.randn(len(layers), 2, BLOCK_SIZE, 8, 128).to(torch.float16)
        out = torch.empty_like(src)
        per_block = src.numel() * src.element_size()
        # The same KV for every block, laid out as a prefill's [layer, kv, block, ...].
        prefill = src.unsqueeze(2).expand(-1, -1, len(blocks), -1, -1, -1).contiguous()
        src_np = src.numpy().reshape(-1)
        private = [np.empty_like(src_np) for _ in range(ROTATE)]
        for arr in private:
            arr[:] = src_np
        out_np = np.empty_like(src_np)
        prefill_np = prefill.numpy().reshape(-1)
        prefill_dst = np.empty_like(prefill_np)
        views = [pool.block(b) for b in blocks]
        np_views = [pool.np_block(b) for b in blocks]
        src_block = src.numpy()
        total = passes * len(blocks) * per_block

        def write_block() -> int:
            for _ in range(passes):
                for b in blocks:
                    pool.write_block(b, src)
            return total

        def read_block() -> int:
            for _ in range(passes):
                for b in blocks:
                    pool.read_block(b, out)
            return total

        def write_blocks() -> int:
            for _ in range(passes):
                pool.write_blocks(blocks, prefill)
            return total

        def write_scattered() -> int:
            for _ in range(passes):
                pool.write_blocks(scattered, prefill)
            return total

        per_layer = list(prefill)  # what a model computes: [2, blocks, ...] per layer
        per_layer_block = [kv_l.unsqueeze(1) for kv_l in src]  # [2, 1, ...] per layer

        def write_layer_prefill() -> int:
            for _ in range(passes):
                for layer, kv_l in enumerate(per_layer):
                    pool.write_layer(layer, blocks, kv_l)
            return total

        def write_layer_block() -> int:
            for _ in range(passes):
                for b in blocks:
                    one = [b]
                    for layer, kv_l in enumerate(per_layer_block):
                        pool.write_layer(layer, one, kv_l)
            return total

        def torch_view() -> int:
            for _ in range(passes):
                for view in views:
                    view.copy_(src)
            return total

        def torch_per_layer() -> int:
            for _ in range(passes):
                for b in blocks:
                    for layer, kv_l in zip(layers, src, strict=True):
                        layer[:, b].copy_(kv_l)
            return total

        def torch_indexed() -> int:
            for _ in range(passes):
                for layer, kv_l in zip(layers, prefill, strict=True):
                    layer[:, table] = kv_l
            return total

        def numpy_view() -> int:
            for _ in range(passes):
                for view in np_views:
                    np.copyto(view, src_block)
            return total

        def memcpy_in() -> int:
            for _ in range(passes):
                for dst in private:
                    np.copyto(dst, src_np)
            return total

        def memcpy_out() -> int:
            for _ in range(passes):
                for arr in private:
                    np.copyto(out_np, arr)
            return total

        def memcpy_prefill() -> int:
            for _ in range(passes):
                np.copyto(prefill_dst, prefill_np)
            return total

        # name -> (loop, anchor name)
        cases: dict[str, tuple[Callable[[], int], str]] = {
            "client writes one block's KV: pool.write_block(b, kv)": (write_block, BLOCK_IN),
            "client reads one block's KV: pool.read_block(b, out)": (read_block, BLOCK_OUT),
            f"prefill: pool.write_blocks({len(blocks)} consecutive ids, kv)": (
                write_blocks,
                PREFILL,
            ),
            f"prefill: pool.write_blocks({len(blocks)} scattered ids, kv)": (
                write_scattered,
                PREFILL,
            ),
            f"per layer: {len(layers)} x pool.write_layer(l, {len(blocks)} ids, kv[l])": (
                write_layer_prefill,
                PREFILL,
            ),
            f"per layer: {len(layers)} x pool.write_layer(l, [b], kv[l]) per block": (
                write_layer_block,
                BLOCK_IN,
            ),
            "context: torch view, pool.block(b).copy_(kv)": (torch_view, BLOCK_IN),
        }
        if order == "layer_major":
            cases[f"context: torch view, {len(layers)} layer writes per block"] = (
                torch_per_layer,
                BLOCK_IN,
            )
            cases[f"context: torch view, {len(blocks)} blocks per layer write"] = (
                torch_indexed,
                PREFILL,
            )
        else:
            cases["context: numpy view, np.copyto(pool.np_block(b), kv)"] = (numpy_view, BLOCK_IN)
        anchors: dict[str, Callable[[], int]] = {
            BLOCK_IN: memcpy_in,
            BLOCK_OUT: memcpy_out,
            PREFILL: memcpy_prefill,
        }
        for name, (loop, _) in cases.items():
            reads = loop is read_block
            if reads:
                out.zero_()
            else:
                for b in blocks:
                    pool.np_block(b)[...] = 0
            loop()  # map the pool's pages into this process
            if reads:
                held = torch.equal(out, src)
            else:
                held = all(torch.equal(pool.block(b), src) for b in blocks)
            if not held:
                raise RuntimeError(f"{name}: the copy does not hold what was written")
        for anchor in anchors.values():
            anchor()
        loops = list(({name: loop for name, (loop, _) in cases.items()} | anchors).items())
        rates: dict[str, list[float]] = {name: [] for name, _ in loops}
        order_rng = random.Random(0)
        for _ in range(repeat):
            # A new order each pass: no loop always inherits the same caches.
            order_rng.shuffle(loops)
            for name, loop in loops:
                rates[name].append(rate(loop))
        seq.free()
    return [
        Figure(
            f"{order}: {name}",
            statistics.median(rates[name]),
            "GB/s",
            anchor,
            statistics.median(rates[anchor]),
            TARGET,
        )
        for name, (_, anchor) in cases.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="median of N timed passes")
    parser.add_argument("--passes", type=int, default=4, help="copies of each block per pass")
    parser.add_argument("--json", action="store_true", help="also write bench/results/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures = [
        f
        for order in ("layer_major", "block_major")
        for f in run_order(order, args.repeat, args.passes)
    ]
    print_table(f"data plane: a client's KV copies with a shm pool ({machine()})", figures)
    if args.json:
        write_results("dataplane", figures, {"repeat": args.repeat, "passes": args.passes})


if __name__ == "__main__":
    main()
