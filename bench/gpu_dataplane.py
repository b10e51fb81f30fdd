"""A cuda pool's data plane: a client writing KV into its blocks, beside a device-to-device copy.

This process plays the daemon: `kvd.memory.cuda.CudaAllocation.create` makes the
pool (its own ``cudaMalloc``, exported by IPC handle). A spawned client
process maps it the way every client does (`kvd_client.pool.open_pool` on
the memory map after a msgpack round trip) and times, in the same run:

- ``block_write``: prefill-style, K and V of ``--blocks`` whole blocks in
  every layer (``layer[:, blocks] = kv``, one indexed write per layer), the
  blocks scattered over the pool as a block table would be;
- ``token_write``: the same tokens through the paged scatter the example
  model uses (`kvd_client.integrations.paged.write_kv`: K and V per token);
- ``pool_copy``: one contiguous copy of the same bytes into the pool;
- ``d2d_copy``: the anchor, the same bytes copied between two ordinary
  allocations of the client (``dst.copy_(src)``).

Every case reads as many bytes (from a local source tensor of random
values) as it writes, so the figures compare like with like: GB/s of bytes
written, median of ``--repeat`` timed runs after ``--warmup`` (CUDA events
around each run). Each write is checked against its source once before
timing. The layout is Llama-3-8B's (32 layers, 8 KV heads, head_dim 128,
bf16, 16 tokens per block: 2 MiB per block over all layers).

``--cpu`` runs the same cases on CPU tensors in one process (tiny sizes,
wall clock): a dry run of the plumbing, not a measurement.

Run: ``python bench/gpu_dataplane.py [--pool-gib 16] [--blocks 1024] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
BLOCK_SIZE = 16
SEED = 20260501


def layout_for(pool_bytes: int, small: bool = False) -> Any:
    from kvd_client.wire import PoolLayout

    geometry = dict(LLAMA3_8B)
    if small:  # the CPU dry run: the same code on a few MiB
        geometry.update(num_layers=4, num_kv_heads=2, head_dim=64)
    per_block = geometry["num_layers"] * 2 * BLOCK_SIZE * geometry["num_kv_heads"]
    per_block *= geometry["head_dim"] * 2
    return PoolLayout(
        block_size=BLOCK_SIZE, num_blocks=max(16, pool_bytes // per_block), **geometry
    )


def timed(
    run: Callable[[], None], sync: Callable[[], None], cuda: bool, repeat: int, warmup: int
) -> list[float]:
    """Milliseconds of each of ``repeat`` runs after ``warmup`` untimed ones."""
    import torch

    for _ in range(warmup):
        run()
    sync()
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure(
    layers: list[Any], raw: Any, layout: Any, args: argparse.Namespace, device: Any
) -> dict[str, Any]:
    """Check, then time, every case on the pool views ``layers`` (bytes ``raw``)."""
    import torch
    from kvd_client.integrations.paged import write_kv

    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    gen = torch.Generator(device="cpu").manual_seed(SEED)
    n = min(args.blocks, layout.num_blocks)
    blocks = torch.randperm(layout.num_blocks, generator=gen)[:n].to(device)
    shape = (2, n, layout.block_size, layout.num_kv_heads, layout.head_dim)
    dtype = layers[0].dtype
    on_device = torch.Generator(device=device).manual_seed(SEED)  # GiBs of values: make them there
    sources = [torch.randn(shape, generator=on_device, device=device, dtype=dtype) for _ in layers]
    nbytes = sum(s.numel() * s.element_size() for s in sources)
    tokens = n * layout.block_size
    table = blocks.cpu().numpy()
    token_kv = [
        (
            s[0].reshape(tokens, layout.num_kv_heads, layout.head_dim),
            s[1].reshape(tokens, layout.num_kv_heads, layout.head_dim),
        )
        for s in sources
    ]
    flat_src = torch.cat([s.reshape(-1).view(torch.uint8) for s in sources])
    local_dst = torch.empty_like(flat_src)

    def block_write() -> None:
        for layer, src in zip(layers, sources, strict=True):
            layer[:, blocks] = src

    def token_write() -> None:
        for layer, (k, v) in zip(layers, token_kv, strict=True):
            write_kv(layer, table, 0, k, v)

    def pool_copy() -> None:
        raw[:nbytes].copy_(flat_src)

    def d2d_copy() -> None:
        local_dst.copy_(flat_src)

    cases = {
        "block_write": block_write,
        "token_write": token_write,
        "pool_copy": pool_copy,
        "d2d_copy": d2d_copy,
    }
    checks = {
        "block_write": lambda: all(
            bool(torch.equal(layer[:, blocks], src))
            for layer, src in zip(layers, sources, strict=True)
        ),
        "token_write": lambda: all(
            bool(torch.equal(layer[:, blocks], src))
            for layer, src in zip(layers, sources, strict=True)
        ),
        "pool_copy": lambda: bool(torch.equal(raw[:nbytes], flat_src)),
        "d2d_copy": lambda: bool(torch.equal(local_dst, flat_src)),
    }
    results: dict[str, Any] = {}
    for name, run in cases.items():
        raw.fill_(0xFF)  # poison: a write that misses bytes fails its check
        local_dst.fill_(0xFF)
        run()
        sync()
        if not checks[name]():
            raise SystemExit(f"{name}: the written bytes differ from the source")
        times = timed(run, sync, cuda, args.repeat, args.warmup)
        median = statistics.median(times)
        results[name] = {
            "median_ms": round(median, 4),
            "min_ms": round(min(times), 4),
            "max_ms": round(max(times), 4),
            "gb_per_s": round(nbytes / (median / 1e3) / 1e9, 1),
        }
    anchor = results["d2d_copy"]["gb_per_s"]
    for name in ("block_write", "token_write", "pool_copy"):
        results[name]["vs_d2d"] = round(results[name]["gb_per_s"] / anchor, 3)
    return {"bytes_written_per_run": nbytes, "blocks": n, "tokens": tokens, "cases": results}


def client(
    conn: mpc.Connection, wire: bytes, layout: dict[str, Any], args: argparse.Namespace
) -> None:
    """The spawned client: map the pool, measure, send the figures back."""
    try:
        import msgpack
        import torch
        from kvd_client.pool import open_pool
        from kvd_client.wire import PoolLayout

        lay = PoolLayout.from_dict(layout)
        pool: Any = open_pool(msgpack.unpackb(wire, raw=False), lay)
        device = torch.device("cuda", pool.device)
        torch.cuda.set_device(device)
        figures = measure(pool.layers(), pool.raw, lay, args, device)
        figures["gpu"] = torch.cuda.get_device_name(device)
        figures["torch"] = torch.__version__
        del pool
        torch.cuda.synchronize()
        conn.send(("ok", figures))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    import msgpack

    from kvd.memory.cuda import CudaAllocation

    layout = layout_for(int(args.pool_gib * GiB))
    pool = CudaAllocation.create("bench", layout, device=args.device, headroom_bytes=2 * GiB)
    try:
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        wire = msgpack.packb(pool.handle(), use_bin_type=True)
        proc = ctx.Process(target=client, args=(there, wire, layout.to_dict(), args))
        proc.start()
        there.close()
        if not here.poll(args.timeout):
            proc.kill()
            raise SystemExit(f"the client gave no figures within {args.timeout} s")
        status, figures = here.recv()
        proc.join(30)
        if status != "ok":
            raise SystemExit(f"client failed: {figures}")
    finally:
        pool.close()
    figures["pool"] = {"bytes": pool.size, "layout": layout.to_dict(), **pool.info()}
    figures["mode"] = "cuda"
    return figures


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from kvd_client.cuda import layer_views

    torch.set_num_threads(1)  # the dry run only proves the plumbing; keep it off other cores
    layout = layout_for(16 * MiB, small=True)
    raw = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    args.blocks = min(args.blocks, 32)
    figures = measure(layer_views(raw, layout), raw, layout, args, torch.device("cpu"))
    figures["pool"] = {"bytes": layout.total_bytes, "layout": layout.to_dict()}
    figures["mode"] = "cpu-dry-run"
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=16.0, help="pool size (GiB)")
    parser.add_argument("--blocks", type=int, default=1024, help="blocks written per run")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the client")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU tensors")
    args = parser.parse_args(argv)
    if args.blocks <= 0 or args.repeat <= 0 or args.warmup < 0 or args.pool_gib <= 0:
        parser.error("--blocks, --repeat and --pool-gib must be positive, --warmup >= 0")
    figures = run_cpu(args) if args.cpu else run_gpu(args)
    figures["argv"] = sys.argv[1:]
    figures["pid"] = os.getpid()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    mb = figures["bytes_written_per_run"] / MiB
    print(
        f"{figures['mode']}: {figures.get('gpu', 'cpu')}, {figures['blocks']} blocks, "
        f"{mb:.0f} MiB written per run"
    )
    print(f"{'case':<12} {'median ms':>10} {'GB/s':>8} {'vs d2d':>7}")
    for name, c in figures["cases"].items():
        print(
            f"{name:<12} {c['median_ms']:>10.3f} {c['gb_per_s']:>8.1f} {c.get('vs_d2d', 1.0):>7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
