"""The engine benchmark's workload driven through the daemon by real client processes.

Same prompts as ``bench/engine.py`` (its generator, not a copy): 2,000 requests per
workload (``flat``: one of 8 shared 1,024-token prefixes + a unique 256-2,048-token
suffix; ``stacked``: 2 -> 8 -> 32 shared prefixes + the same kind of suffix); block
size 16, 8,192 blocks; each request allocated (reserving its 8 decode tokens),
committed, decoded 8 tokens one at a time, committed, freed; 32 requests live in all.

Each client is its own process (``multiprocessing`` spawn) with a blocking
``kvd_client.Client`` over ipc://, and drives its share of the requests (every
N-th) the way an inference scheduler does: one ``batch`` round trip per step, where a
step commits the prompt allocated in the previous step, finishes the oldest live
request when its share of the 32 slots is full (8 appends, commit, free) and
allocates the next prompt. A fresh daemon (``python -m kvd.cli`` on a temporary
socket, the bench's pool: 8,192 blocks of a tiny layout, metadata is what is timed)
serves each run, so every run starts cold like the in-process replays.

Beside the figures, where one request's time goes with 1 client (last run): the
client process's CPU, the daemon's Python threads' (its request thread and event
loop) and its ZeroMQ I/O thread's, from ``/proc`` (Linux), per request, against
the wall-clock time per request and the in-process engine's.

Figures per workload, each the median of ``--repeat`` runs, all in wall-clock time
(several processes): aggregate requests/s with 1 and with 4 clients (from the moment
all clients are connected to the last one's end), beside the in-process engine
(``bench/engine.py``'s replay) and vLLM 0.33.0's KVCacheManager in-process, end to
end, in the same run (in this interpreter when it is ``.bench-venv``'s, else from a
``.bench-venv`` child, else not at all). Targets: 1 client >= 1x vLLM in-process end
to end; 4 clients >= 1.5x 1 client; against the in-process engine (what the daemon
costs over a library): 1 client >= 0.6x, 4 clients >= 1.0x.

Run: ``.bench-venv/bin/python -m bench.daemon [--requests N] [--repeat N] [--json]``
(``.venv/bin/python`` works too: the vLLM anchor then comes from a child process).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from typing import Any

from bench import engine as workload
from bench._common import Figure, machine, print_table, run_daemon, write_results

__all__ = ["ClientRun", "client_main", "main", "run_clients"]

TARGET_ONE_VS_VLLM = 1.0
TARGET_FOUR_VS_ONE = 1.5
#: What the daemon may cost over the in-process engine (issue #15).
TARGET_ONE_VS_ENGINE = 0.6
TARGET_FOUR_VS_ENGINE = 1.0
#: The daemon's pool: the bench's block count, a tiny layout (metadata is timed).
POOL = {
    "num_blocks": workload.NUM_BLOCKS,
    "block_size": workload.BLOCK_SIZE,
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_dim": 8,
}


@dataclass(frozen=True, slots=True)
class ClientRun:
    """One client's share: requests, wall-clock span, hit and prompt tokens, CPU seconds."""

    requests: int
    start: float
    end: float
    hit_tokens: int
    prompt_tokens: int
    cpu: float


def client_main(
    address: str,
    *,
    name: str,
    requests: int,
    index: int,
    clients: int,
    go: EventType,
    results: Any,
) -> None:
    """One client process: connect, wait for ``go``, drive every ``clients``-th request."""
    import numpy as np
    from kvd_client import Client

    prompts = workload.workloads(requests)[name][index::clients]
    live_cap = workload.LIVE // clients
    decode = [np.array([t], dtype=np.int32) for t in workload.DECODE_TOKENS.tolist()]
    hit = 0
    with Client.connect(address, pool="default", name=f"bench-{index}") as kv:
        live: collections.deque[Any] = collections.deque()
        pending = None
        results.put(("ready", index))
        go.wait()
        start = time.monotonic()
        cpu0 = time.process_time()
        for i, prompt in enumerate(prompts):
            with kv.batch() as b:
                if pending is not None:
                    b.commit(pending)
                if len(live) == live_cap:
                    old = live.popleft()
                    for tok in decode:
                        b.append(old, tok)
                    b.commit(old)
                    b.free(old)
                new = b.allocate(f"r{i}", prompt, reserve=len(prompt) + workload.DECODE)
            pending = new.result()
            hit += pending.num_cached_tokens
            live.append(pending)
        with kv.batch() as b:
            if pending is not None:
                b.commit(pending)
            for old in live:
                for tok in decode:
                    b.append(old, tok)
                b.commit(old)
                b.free(old)
        end = time.monotonic()
        cpu = time.process_time() - cpu0
    run = ClientRun(len(prompts), start, end, hit, sum(map(len, prompts)), cpu)
    results.put(("done", run))


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of process ``pid``'s threads so far: ZeroMQ's I/O threads
    (``zmq``) and the rest (``python``: Python threads are not named in /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"python": 0.0, "zmq": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # utime and stime: fields 14 and 15 of stat(5), 12 and 13 after the name.
        cpu = (int(fields[11]) + int(fields[12])) / tick
        out["zmq" if name.startswith("ZMQbg") else "python"] += cpu
    return out


@dataclass(frozen=True, slots=True)
class Clients:
    """One run of `run_clients`: aggregate requests/s, hit ratio, CPU per request
    (µs: the clients', the daemon's Python threads' and its ZeroMQ threads'),
    wall-clock µs per request of one client."""

    rate: float
    hit_ratio: float
    client_us: float
    daemon_python_us: float
    daemon_zmq_us: float
    wall_us: float


def run_clients(name: str, requests: int, clients: int) -> Clients:
    """A fresh daemon, ``clients`` client processes, timed from ``go`` to the last one's end."""
    ctx = mp.get_context("spawn")
    with run_daemon(POOL) as daemon:
        go = ctx.Event()
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=client_main,
                args=(daemon.address,),
                kwargs={
                    "name": name,
                    "requests": requests,
                    "index": k,
                    "clients": clients,
                    "go": go,
                    "results": results,
                },
            )
            for k in range(clients)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            kind, _index = results.get(timeout=120)
            assert kind == "ready"
        before = thread_cpu(daemon.proc.pid)
        go.set()
        runs: list[ClientRun] = []
        for _ in procs:
            kind, run = results.get(timeout=600)
            assert kind == "done"
            runs.append(run)
        after = thread_cpu(daemon.proc.pid)
        for p in procs:
            p.join(timeout=30)
            if p.exitcode != 0:
                raise RuntimeError(f"client process exited with {p.exitcode}")
    span = max(r.end for r in runs) - min(r.start for r in runs)
    done = sum(r.requests for r in runs)
    return Clients(
        rate=done / span,
        hit_ratio=sum(r.hit_tokens for r in runs) / sum(r.prompt_tokens for r in runs),
        client_us=sum(r.cpu for r in runs) / done * 1e6,
        daemon_python_us=(after["python"] - before["python"]) / done * 1e6,
        daemon_zmq_us=(after["zmq"] - before["zmq"]) / done * 1e6,
        wall_us=statistics.median((r.end - r.start) / r.requests for r in runs) * 1e6,
    )


def _vllm_in_process() -> bool:
    try:
        import bench.vllm_support  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=workload.REQUESTS)
    parser.add_argument("--repeat", type=int, default=5, help="median of N runs of each")
    parser.add_argument("--json", action="store_true", help="also write bench/results/")
    args = parser.parse_args()
    # Wall clock for the in-process replays too: the daemon's figures can only be.
    workload.CLOCK = time.perf_counter
    in_process = _vllm_in_process()
    anchors = None if in_process else workload.vllm_anchors(args.requests, 1)
    figures: list[Figure] = []
    for name, prompts in workload.workloads(args.requests).items():
        short = name.split()[0]
        rps: dict[str, list[float]] = collections.defaultdict(list)
        hits: dict[str, float] = {}
        for _ in range(args.repeat):
            r = workload.replay(prompts)
            rps["engine"].append(r.requests / r.seconds)
            hits["engine"] = r.hit_ratio
            if in_process:
                v = workload.replay_vllm(prompts)
                rps["vllm"].append(v.requests / v.seconds)
                hits["vllm"] = v.hit_ratio
            for n in (1, 4):
                run = run_clients(name, args.requests, n)
                rps[f"{n}c"].append(run.rate)
                hits[f"{n}c"] = run.hit_ratio
                if n == 1:
                    one_client = run
        med = {k: statistics.median(v) for k, v in rps.items()}
        if anchors is not None:
            med["vllm"], hits["vllm"] = anchors[name]["e2e"], anchors[name]["hit_ratio"]
        one = med["1c"]
        print(
            f"{short}: in-process engine {med['engine']:,.0f} req/s (1 client through the "
            f"daemon: {one / med['engine']:.2f}x of it); hit ratio 1 client "
            f"{100 * hits['1c']:.2f} %, 4 clients {100 * hits['4c']:.2f} %, "
            f"in-process engine {100 * hits['engine']:.2f} %"
            + (f", vLLM {100 * hits['vllm']:.2f} %" if "vllm" in hits else "")
        )
        c = one_client
        print(
            f"{short}, 1 client, per request (last run): wall {c.wall_us:.0f} us; CPU: client "
            f"{c.client_us:.0f} us, daemon Python threads {c.daemon_python_us:.0f} us, daemon "
            f"ZeroMQ I/O {c.daemon_zmq_us:.0f} us; in-process engine {1e6 / med['engine']:.0f} us"
        )
        if "vllm" in med:
            figures.append(
                Figure(
                    f"{short}: daemon, 1 client",
                    one,
                    "req/s",
                    "vLLM in-process e2e",
                    med["vllm"],
                    TARGET_ONE_VS_VLLM,
                    note="" if in_process else "vLLM from a .bench-venv child: best of 1, CPU time",
                )
            )
        figures.append(
            Figure(
                f"{short}: daemon, 4 clients",
                med["4c"],
                "req/s",
                "daemon, 1 client",
                one,
                TARGET_FOUR_VS_ONE,
            )
        )
        for n, target in ((1, TARGET_ONE_VS_ENGINE), (4, TARGET_FOUR_VS_ENGINE)):
            figures.append(
                Figure(
                    f"{short}: daemon, {n} client{'s' if n > 1 else ''}",
                    med[f"{n}c"],
                    "req/s",
                    "in-process engine e2e",
                    med["engine"],
                    target,
                )
            )
    print_table(
        f"daemon over ipc://, {args.requests} requests, median of {args.repeat}, wall clock "
        f"({machine()})",
        figures,
    )
    if args.json:
        write_results("daemon", figures, {"requests": args.requests, "repeat": args.repeat})


if __name__ == "__main__":
    main()
