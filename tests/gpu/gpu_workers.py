"""Client processes for the GPU tests, driven over a pipe.

Each `Worker` is a spawned process that maps cuda pools the way a client
does (`kvd_client.pool.open_pool` on the hello reply's memory map, sent
through msgpack as on the wire) and answers small commands: fill a slot,
read one back, copy blocks, reopen. Errors come back as `RemoteError`
with the worker's message, so a test fails with the client's own words.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
from collections.abc import Callable
from typing import Any

__all__ = ["RemoteError", "Worker", "device_bytes", "start_workers"]


class RemoteError(AssertionError):
    """A command failed inside a worker; the message is the worker's exception."""


def device_bytes(ptr: int, size: int, device: int) -> Any:
    """A cupy uint8 array over ``size`` bytes at ``ptr`` (the daemon's own view of a pool)."""
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, size, owner=None, device_id=device)
    return cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


def _serve(conn: mpc.Connection) -> None:
    """The worker's loop: one reply per command until ``exit``."""
    import gc

    import msgpack
    import torch
    from kvd_client.cuda import CudaPool
    from kvd_client.pool import open_pool
    from kvd_client.wire import PoolLayout

    pools: dict[str, CudaPool] = {}

    def map_(wire: bytes, layout: dict[str, Any]) -> CudaPool:
        pool = open_pool(msgpack.unpackb(wire, raw=False), PoolLayout.from_dict(layout))
        assert isinstance(pool, CudaPool)
        return pool

    def open_(name: str, wire: bytes, layout: dict[str, Any]) -> dict[str, int]:
        pool = map_(wire, layout)
        pools[name] = pool
        return {"ptr": pool.ptr, "device": pool.device}

    def reopen(name: str, wire: bytes, layout: dict[str, Any]) -> bool:
        return map_(wire, layout).ptr == pools[name].ptr

    def fill(name: str, layer: int, kv: int, block: int, value: float) -> None:
        pool = pools[name]
        pool.layers()[layer][kv, block].fill_(value)
        pool.fence()

    def fill_block(name: str, block: int, value: float) -> None:
        pool = pools[name]
        pool.block(block).fill_(value)
        pool.fence()

    def slot(name: str, layer: int, kv: int, block: int) -> list[float]:
        view = pools[name].layers()[layer][kv, block].float()
        return [float(view.min()), float(view.max())]

    def kv_of(pool: CudaPool, values: list[float], device: str) -> torch.Tensor:
        """``[L, 2, len(values), block_size, heads, head_dim]``, block i all ``values[i]``."""
        lay = pool.layout
        shape = (lay.num_layers, 2, 1, lay.block_size, lay.num_kv_heads, lay.head_dim)
        dtype = getattr(torch, lay.dtype)
        blocks = [torch.full(shape, v, dtype=dtype, device=device) for v in values]
        return torch.cat(blocks, dim=2)

    def write_blocks(name: str, ids: list[int], values: list[float], device: str) -> None:
        pool = pools[name]
        pool.write_blocks(ids, kv_of(pool, values, device))
        pool.fence()

    def write_layer(name: str, layer: int, ids: list[int], value: float, device: str) -> None:
        pool = pools[name]
        pool.write_layer(layer, ids, kv_of(pool, [value] * len(ids), device)[0])
        pool.fence()

    def read_blocks(name: str, ids: list[int], device: str) -> list[list[float]]:
        pool = pools[name]
        out = kv_of(pool, [0.0] * len(ids), device)
        pool.read_blocks(ids, out)
        pool.fence()
        return [[float(out[:, :, i].min()), float(out[:, :, i].max())] for i in range(len(ids))]

    def copy(name: str, pairs: list[list[int]]) -> None:
        pool = pools[name]
        side = torch.cuda.Stream(device=pool.device)  # type: ignore[no-untyped-call]
        pool.copy_blocks([p[0] for p in pairs], [p[1] for p in pairs], stream=side)
        pool.fence(side)

    def drop(name: str) -> None:
        del pools[name]
        gc.collect()
        torch.cuda.synchronize()

    sessions: dict[str, Any] = {}

    def connect(address: str, pool: str) -> dict[str, Any]:
        from kvd_client.client import Client

        kv = Client.connect(address, pool=pool, name="gpu-test-client", timeout=30.0)
        sessions[pool] = kv
        return {"backend": kv.pool.memory["backend"], "session": kv.session_id}

    def expected(tokens: Any, layer: int) -> tuple[Any, Any]:
        """The K and V every test client writes for these token ids: a function of id and layer."""
        return (tokens % 97 + layer).float(), -(tokens % 89 + layer).float()

    def positions(kv: Any, seq: Any, start: int, stop: int) -> tuple[Any, Any, Any]:
        bs = kv.layout.block_size
        device = kv.pool.layers()[0].device
        pos = torch.arange(start, stop, device=device)
        table = torch.as_tensor(seq.block_table.astype("int64"), device=device)
        return pos, table[pos // bs], pos % bs

    def fence(kv: Any) -> None:
        """Wait for this process's work on the pool (a no-op for host memory)."""
        wait = getattr(kv.pool, "fence", None)
        if wait is not None:
            wait()

    def prefill(pool: str, seq_id: str, tokens: list[int], free: bool) -> dict[str, Any]:
        """Allocate, write K/V of the tokens not cached, fence, commit (and free)."""
        kv = sessions[pool]
        seq = kv.allocate(seq_id, tokens)
        cached = seq.num_cached_tokens
        pos, blocks, slots = positions(kv, seq, cached, len(tokens))
        ids = torch.as_tensor(tokens, device=pos.device)[pos]
        for i, layer in enumerate(kv.pool.layers()):
            k, v = expected(ids, i)
            shape = (len(pos), *layer.shape[3:])
            layer[0, blocks, slots] = k[:, None, None].expand(shape).to(layer.dtype)
            layer[1, blocks, slots] = v[:, None, None].expand(shape).to(layer.dtype)
        fence(kv)
        seq.commit()
        table = seq.block_table.tolist()
        if free:
            seq.free()
        return {"cached": cached, "table": table}

    def verify(pool: str, seq_id: str, tokens: list[int]) -> dict[str, Any]:
        """Allocate the tokens again and check the K/V of the cached prefix; free."""
        kv = sessions[pool]
        seq = kv.allocate(seq_id, tokens)
        cached = seq.num_cached_tokens
        pos, blocks, slots = positions(kv, seq, 0, cached)
        ids = torch.as_tensor(tokens, device=pos.device)[pos]
        bad = 0
        for i, layer in enumerate(kv.pool.layers()):
            k, v = expected(ids, i)
            got_k = layer[0, blocks, slots].float()
            got_v = layer[1, blocks, slots].float()
            bad += int((got_k != k[:, None, None]).sum()) + int((got_v != v[:, None, None]).sum())
        fence(kv)
        table = seq.block_table.tolist()
        seq.free()
        return {"cached": cached, "bad": bad, "table": table}

    def close(pool: str) -> None:
        sessions.pop(pool).close()
        gc.collect()

    def env() -> dict[str, Any]:
        return {"pid": os.getpid(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    commands: dict[str, Callable[..., Any]] = {
        "open": open_,
        "reopen": reopen,
        "fill": fill,
        "fill_block": fill_block,
        "slot": slot,
        "copy": copy,
        "write_blocks": write_blocks,
        "read_blocks": read_blocks,
        "write_layer": write_layer,
        "drop": drop,
        "env": env,
        "connect": connect,
        "prefill": prefill,
        "verify": verify,
        "close": close,
    }
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[cmd](*args)))
        except Exception as exc:  # reported to the test, which fails with it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Worker:
    """One client process and its end of the pipe."""

    def __init__(self, ctx: Any, name: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:  # a spawned child takes the environment at start
            self.proc = ctx.Process(target=_serve, args=(child,), name=name, daemon=True)
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()

    def call(self, cmd: str, *args: Any, timeout: float = 120.0) -> Any:
        """Run ``cmd`` in the worker; RemoteError with its message when it fails."""
        self.conn.send((cmd, *args))
        if not self.conn.poll(timeout):
            raise RemoteError(f"{self.name}: no answer to {cmd!r} within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RemoteError(f"{self.name}: {cmd}: {value}")
        return value

    def alive(self) -> bool:
        """Whether the process still runs."""
        return bool(self.proc.is_alive())

    def stop(self) -> None:
        """Ask the worker to exit; kill it if it does not within seconds."""
        if self.proc.is_alive():
            with contextlib.suppress(RemoteError, OSError, EOFError):
                self.call("exit", timeout=10.0)
            self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


def start_workers(n: int, env: dict[str, str] | None = None) -> list[Worker]:
    """``n`` spawned client processes (spawn: a forked child cannot use CUDA)."""
    ctx = mp.get_context("spawn")
    return [Worker(ctx, f"client-{i}", env) for i in range(n)]
