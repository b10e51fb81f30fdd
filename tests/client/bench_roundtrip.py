"""Round trip of a small request: kvd_client vs a bare pyzmq DEALER/ROUTER ping-pong.

Not collected by pytest (no ``test_`` prefix). Run::

    .venv/bin/python -m tests.client.bench_roundtrip [--n 5000] [--rounds 5]

One ROUTER server process answers every PING with a real ``encode_ok``
reply. The bare client sends the same frames (a pre-encoded PING) and reads
the reply without decoding it; the kvd clients build, encode, send, match
and decode. Rounds alternate between the clients so drift hits all alike;
the figures are per round trip over all rounds (p50, p99, mean), and the
ratio of p50s to the bare client's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgpack
import zmq
from kvd_client import AsyncClient, Client
from kvd_client import protocol as P


def serve(address: str, ready: Any) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()
    while True:
        ident, *frames = sock.recv_multipart()
        if frames[0] == b"stop":
            return
        rid = msgpack.unpackb(frames[1])["id"]
        sock.send_multipart([ident, *P.encode_ok(rid, P.PingResult(epoch=1, version=1))])


def bare(address: str, n: int) -> list[int]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    frames = P.Ping(id=12345).encode()
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        sock.send_multipart(frames)
        sock.recv_multipart()
        out.append(time.perf_counter_ns() - t0)
    sock.close(linger=0)
    return out


def blocking(kv: Client, n: int) -> list[int]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        kv.ping()
        out.append(time.perf_counter_ns() - t0)
    return out


def asynchronous(address: str, n: int) -> list[int]:
    async def run() -> list[int]:
        kv = await AsyncClient.connect(address, pool=None)
        out = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            await kv.ping()
            out.append(time.perf_counter_ns() - t0)
        await kv.aclose()
        return out

    return anyio.run(run)


def quantile(xs: list[int], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=5000, help="round trips per client per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvdb-", dir="/tmp") as d:
        address = f"ipc://{d}/bench.sock"
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        server = ctx.Process(target=serve, args=(address, ready), daemon=True)
        server.start()
        ready.wait(30)
        kv = Client.connect(address, pool=None)
        runs: dict[str, Callable[[], list[int]]] = {
            "bare pyzmq DEALER": lambda: bare(address, args.n),
            "kvd_client Client": lambda: blocking(kv, args.n),
            "kvd_client AsyncClient (asyncio)": lambda: asynchronous(address, args.n),
        }
        samples: dict[str, list[int]] = {name: [] for name in runs}
        for fn in runs.values():  # warm up
            fn()
        for _ in range(args.rounds):
            for name, fn in runs.items():
                samples[name].extend(fn())
        kv.close()
        stop = zmq.Context.instance().socket(zmq.DEALER)
        stop.connect(address)
        stop.send_multipart([b"stop", b""])
        server.join(10)
        stop.close(linger=0)
    base = quantile(samples["bare pyzmq DEALER"], 0.5)
    print(f"PING round trip over ipc, {args.rounds} x {args.n} per client (µs)")
    print(f"{'client':34} {'p50':>7} {'p99':>7} {'mean':>7} {'p50/bare':>9}")
    for name, xs in samples.items():
        p50 = quantile(xs, 0.5)
        mean = statistics.fmean(xs) / 1e3
        print(f"{name:34} {p50:7.1f} {quantile(xs, 0.99):7.1f} {mean:7.1f} {p50 / base:9.2f}")


if __name__ == "__main__":
    main()
