"""Replay a synthetic shared-prefix workload through the engine.

Two workloads, 2,000 requests each, block size 16, 8,192 blocks, fixed seed:

- ``flat``: each prompt is one of 8 shared 1,024-token prefixes plus a
  unique suffix of 256-2,048 tokens;
- ``stacked``: prefixes built on shared prefixes (2 system prompts of 512
  tokens -> 4 tool prompts of 256 tokens each -> 4 few-shot blocks of 256
  tokens each: 32 distinct 1,024-token prefixes sharing their heads), plus
  the same kind of unique suffix.

Each request: ``allocate`` (reserving prompt + decode tokens), ``commit``
all, ``append`` the decode tokens one at a time, ``commit``, ``free``; at
most 32 requests are live (the oldest finishes when a new one arrives).

Figures: requests/s end to end (hashing included), block operations/s
(blocks matched or allocated, published, and released), hit ratio, the
hashing cost per block on its own, and requests/s *manager only*: the same
replay with each request's real keys precomputed and handed out by a lookup
hasher (the engine's work without the hashing, as vLLM's manager-only
anchor gives its requests precomputed block hashes). Each figure is the
best of ``--repeat`` runs, timed in process CPU time (the machine is shared;
the replay is single threaded, so on an idle machine this is its wall time).

Anchors: vLLM 0.33.0's ``KVCacheManager`` replaying the same workload in the
same run, driven as its scheduler does (``bench/vllm_support.py``; requests
hashed by its ``sha256_cbor`` end to end, precomputed hashes manager only;
token lists are built before the clock starts). That needs ``.bench-venv``
(``bench/setup-vllm-venv.sh``) and runs there as a child process; without it
(or with ``--no-vllm``) the anchors are the figures measured on this machine
before: about 1,100 requests/s end to end and 3,500 manager only.

Run: ``.venv/bin/python bench/engine.py [--requests N] [--repeat N] [--no-vllm]
[--profile e2e|manager]``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from kvd_client.wire.hashing import BlockHasher

from kvd.engine import Allocation, Appended, Engine, EngineConfig

BLOCK_SIZE = 16
NUM_BLOCKS = 8192
REQUESTS = 2000
LIVE = 32
DECODE = 8
VOCAB = 32000
SEED = 20260501
#: vLLM 0.33.0 on this workload and machine, measured before (requests/s).
VLLM_E2E = 1100.0
VLLM_MANAGER = 3500.0
#: CPU time of this process: the machine is shared, and the replay is single
#: threaded, so this is the wall time it would take on an idle machine.
CLOCK = time.process_time
REPO = Path(__file__).resolve().parent.parent
BENCH_PYTHON = REPO / ".bench-venv" / "bin" / "python"

Tokens = npt.NDArray[np.int32]


def _suffix(rng: np.random.Generator) -> Tokens:
    return rng.integers(0, VOCAB, int(rng.integers(256, 2049)), dtype=np.int32)


def flat_workload(n: int, seed: int = SEED) -> list[Tokens]:
    """8 shared 1,024-token prefixes, each prompt one of them + a unique suffix."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, 1024, dtype=np.int32) for _ in range(8)]
    return [np.concatenate([prefixes[int(rng.integers(0, 8))], _suffix(rng)]) for _ in range(n)]


def stacked_workload(n: int, seed: int = SEED) -> list[Tokens]:
    """System prompt -> tool prompt -> few-shot examples, then a unique suffix."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, 512, dtype=np.int32) for _ in range(2)]
    tools = [[rng.integers(0, VOCAB, 256, dtype=np.int32) for _ in range(4)] for _ in systems]
    shots = [
        [[rng.integers(0, VOCAB, 256, dtype=np.int32) for _ in range(4)] for _ in t] for t in tools
    ]
    out = []
    for _ in range(n):
        s, t, f = (int(x) for x in rng.integers(0, [2, 4, 4]))
        out.append(np.concatenate([systems[s], tools[s][t], shots[s][t][f], _suffix(rng)]))
    return out


@dataclass
class Result:
    seconds: float
    block_ops: int
    hit_ratio: float
    requests: int


class LookupHasher:
    """Hands out the real keys of the current request, precomputed: the
    engine's work without the hashing (as vLLM's manager-only anchor, which
    gives its requests precomputed block hashes)."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: list[bytes] = []

    def keys(
        self,
        tokens: Tokens,
        parent: bytes | None,
        *,
        first_block: int = 0,
        namespace: str = "",
        adapter: str | None = None,
    ) -> list[bytes]:
        return self.current[first_block : first_block + len(tokens) // BLOCK_SIZE]


DECODE_TOKENS = np.arange(DECODE, dtype=np.int32)


def precompute_keys(prompts: list[Tokens]) -> list[list[bytes]]:
    """Every request's keys, prompt and decoded tokens together."""
    hasher = BlockHasher(BLOCK_SIZE)
    return [hasher.keys(np.concatenate([p, DECODE_TOKENS]), None) for p in prompts]


def replay(
    prompts: list[Tokens], keys: list[list[bytes]] | None = None, eviction: str = "adaptive"
) -> Result:
    """Run the workload once on a fresh engine (with precomputed ``keys``:
    manager only) evicting by ``eviction`` (the engine's default policy)."""
    eng = Engine(EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, eviction=eviction))
    eng.open_session(1)
    lookup = LookupHasher()
    if keys is not None:
        eng._hasher = lookup  # type: ignore[assignment]  # the one private reach
    decode = [DECODE_TOKENS[i : i + 1] for i in range(DECODE)]
    live: collections.deque[tuple[int, int]] = collections.deque()
    ops = 0
    allocate, commit, append, free = eng.allocate, eng.commit, eng.append, eng.free

    def finish() -> int:
        i, n = live.popleft()
        seq = str(i)
        if keys is not None:
            lookup.current = keys[i]
        for tok in decode:
            a = append(1, seq, tok)
            assert isinstance(a, Appended)
            n += len(a.blocks)
        n += commit(1, seq).cached_blocks
        n += len(eng._sessions[1].seqs[seq].table)
        free(1, seq)
        eng.drain_events()
        return n

    t0 = CLOCK()
    for i, prompt in enumerate(prompts):
        if len(live) == LIVE:
            ops += finish()
        seq = str(i)
        if keys is not None:
            lookup.current = keys[i]
        r = allocate(1, seq, prompt, reserve=len(prompt) + DECODE)
        assert isinstance(r, Allocation), r
        c = commit(1, seq)
        live.append((i, len(r.table) + c.cached_blocks))
    while live:
        ops += finish()
    seconds = CLOCK() - t0
    eng.check_invariants()
    return Result(seconds, ops, eng.stats().hit_ratio, len(prompts))


def hashing_seconds(prompts: list[Tokens]) -> float:
    """Time to hash every full block of every prompt once, in one call each."""
    hasher = BlockHasher(BLOCK_SIZE)
    t0 = CLOCK()
    for p in prompts:
        hasher.keys(p, None)
    return CLOCK() - t0


def replay_vllm(prompts: list[Tokens], keys: list[Any] | None = None) -> Result:
    """The same workload through vLLM's ``KVCacheManager`` (only in .bench-venv)."""
    from bench import vllm_support as V

    manager = V.make_manager(NUM_BLOCKS, BLOCK_SIZE)
    driver = V.VllmDriver(manager)
    lists = [p.tolist() for p in prompts]
    live: collections.deque[Any] = collections.deque()
    hit_tokens = 0

    def finish() -> None:
        req = live.popleft()
        for tok in range(DECODE):
            assert driver.decode(req, tok)
        driver.finish(req)

    t0 = CLOCK()
    for i, tokens in enumerate(lists):
        if len(live) == LIVE:
            finish()
        req = V.make_request(
            str(i),
            tokens,
            None if keys is None else keys[i],
            block_size=BLOCK_SIZE,
            max_tokens=DECODE + 1,
        )
        hit = driver.admit(req)
        assert hit is not None
        hit_tokens += hit
        live.append(req)
    while live:
        finish()
    seconds = CLOCK() - t0
    return Result(seconds, 0, hit_tokens / sum(map(len, lists)), len(prompts))


def vllm_child(requests: int, repeat: int) -> None:
    """Print vLLM's best times per workload as JSON (run inside .bench-venv)."""
    from bench import vllm_support as V

    out = {}
    for name, prompts in workloads(requests).items():
        keys = [V.chain_keys(np.concatenate([p, DECODE_TOKENS]), BLOCK_SIZE) for p in prompts]
        e2e = min((replay_vllm(prompts) for _ in range(repeat)), key=lambda r: r.seconds)
        mgr = min((replay_vllm(prompts, keys) for _ in range(repeat)), key=lambda r: r.seconds)
        out[name] = {
            "e2e": e2e.requests / e2e.seconds,
            "manager": mgr.requests / mgr.seconds,
            "hit_ratio": e2e.hit_ratio,
        }
    json.dump(out, sys.stdout)


def vllm_anchors(requests: int, repeat: int) -> dict[str, dict[str, float]] | None:
    """vLLM's figures measured now in .bench-venv, or None where it is missing."""
    if not BENCH_PYTHON.exists():
        return None
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [
            str(BENCH_PYTHON),
            __file__,
            "--vllm-child",
            f"--requests={requests}",
            f"--repeat={repeat}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
    )
    if child.returncode:
        print(f"(vLLM anchors not measured: {child.stderr.strip().splitlines()[-1:]})")
        return None
    result: dict[str, dict[str, float]] = json.loads(child.stdout)
    return result


def report(name: str, prompts: list[Tokens], repeat: int, anchor: dict[str, float] | None) -> None:
    keys = precompute_keys(prompts)
    e2e = min((replay(prompts) for _ in range(repeat)), key=lambda r: r.seconds)
    mgr = min((replay(prompts, keys) for _ in range(repeat)), key=lambda r: r.seconds)
    assert mgr.hit_ratio == e2e.hit_ratio, "precomputed keys must match the hasher's"
    hashing = min(hashing_seconds(prompts) for _ in range(repeat))
    rps = e2e.requests / e2e.seconds
    mrps = mgr.requests / mgr.seconds
    blocks = sum(len(p) // BLOCK_SIZE for p in prompts)
    if anchor is None:
        v_e2e, v_mgr, v_hit, how = VLLM_E2E, VLLM_MANAGER, None, "measured before"
    else:
        v_e2e, v_mgr, v_hit = anchor["e2e"], anchor["manager"], anchor["hit_ratio"]
        how = "same run"
    print(f"{name}: {e2e.requests} requests, {blocks} full prompt blocks, best of {repeat}")
    print(f"                      kvd      vLLM 0.33.0 ({how})")
    print(f"  end to end    {rps:9.0f} req/s {v_e2e:9.0f} req/s   {rps / v_e2e:4.1f}x")
    print(f"  manager only  {mrps:9.0f} req/s {v_mgr:9.0f} req/s   {mrps / v_mgr:4.1f}x")
    print(
        f"  block ops     {e2e.block_ops / e2e.seconds:9.0f} /s end to end, "
        f"{mgr.block_ops / mgr.seconds:.0f} /s manager only"
    )
    print(f"  hashing       {hashing / blocks * 1e6:9.2f} us/block")
    hit = f"{e2e.hit_ratio:9.3f}"
    print(f"  hit ratio     {hit}" + ("" if v_hit is None else f" {v_hit:9.3f}"))


def workloads(requests: int) -> dict[str, list[Tokens]]:
    return {
        "flat (8 prefixes)": flat_workload(requests),
        "stacked (2 -> 8 -> 32 prefixes)": stacked_workload(requests),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs")
    parser.add_argument(
        "--profile",
        choices=["e2e", "manager"],
        help="cProfile the flat replay (with hashing, or with precomputed keys)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip the same-run vLLM anchors")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_child:
        vllm_child(args.requests, args.repeat)
        return
    if args.profile:
        flat = flat_workload(args.requests)
        prof = cProfile.Profile()
        prof.runcall(replay, flat, None if args.profile == "e2e" else precompute_keys(flat))
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    anchors = None if args.no_vllm else vllm_anchors(args.requests, args.repeat)
    for name, prompts in workloads(args.requests).items():
        report(name, prompts, args.repeat, None if anchors is None else anchors[name])


if __name__ == "__main__":
    main()
