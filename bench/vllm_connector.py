"""KvdConnector across vLLM processes, beside a cold run and vLLM's ExampleConnector.

Run in the vLLM venv (``scripts/vllm-env.sh``):

    $(scripts/vllm-env.sh | tail -n 1)/bin/python -m bench.vllm_connector [--prefix 2048]

A random Llama where prefill dominates (8 layers, hidden 1024, 8 KV heads of
64, fp32). One vLLM process at a time (2 cores: timings must not share them):
cold (no connector); A (KvdConnector, saving); B (KvdConnector, loading A's
prefixes); then ExampleConnector's A and B (safetensors files), the peer.
Each process runs a warm-up prompt, then ``--rounds`` prompts with distinct
prefixes; B's figures are medians over ``--pairs`` B processes of each
connector, run in turns (kvd, Example, kvd, ...): on two shared cores the
forward pass alone swings by 4x from one minute to the next. Both connectors
run as `bench.timed_connectors` subclasses that log their own time in B's
step (load, save), so each connector's cost is also given apart from the
forward pass. Then, in this process, the load path's copy (`copy_pages`,
kvd pages -> vLLM-shaped blocks, every layer) vs one memcpy of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvd_client.integrations.vllm_plan import copy_pages, paged_layout
from kvd_client.pool import ShmPages, open_pool

from bench._common import run_daemon
from bench.timed_connectors import STEP_LINE
from tests.vllm.support import (
    ROOT,
    LlamaSpec,
    example_connector,
    prompt_tokens,
    run_vllm,
    tiny_llama,
)

MODEL = LlamaSpec(
    num_hidden_layers=8,
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
BS = 32
#: The module of the timed connectors (imported by vLLM in its processes).
TIMED = "bench.timed_connectors"


def _ttfts(out: dict[str, Any]) -> list[float]:
    """Each measured request's time to first token (the warm-up request left out)."""
    return [float(req["ttft_s"]) for req in out["requests"][1:]]


def _step_ms(out: dict[str, Any]) -> list[float]:
    """The connector's own milliseconds (load + save) in each step that loaded."""
    steps = []
    for line in out["stderr"].splitlines():
        if STEP_LINE in line:
            words = line.split(STEP_LINE, 1)[1].split()
            steps.append(float(words[1]) + float(words[3]))
    return steps


def _kvd(address: str, connector: str = "KvdConnector") -> dict[str, Any]:
    return {
        "kv_connector": connector,
        "kv_connector_module_path": (
            "kvd_client.integrations.vllm" if connector == "KvdConnector" else TIMED
        ),
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvd_address": address, "kvd_pool_bytes": 2 << 30},
    }


def _example(storage: Path) -> dict[str, Any]:
    return {
        **example_connector(storage),
        "kv_connector": "TimedExample",
        "kv_connector_module_path": TIMED,
    }


def processes(prefix: int, rounds: int, pairs: int) -> dict[str, float]:
    """Median TTFT (and connector step time) of each process kind.

    Every process first runs a short warm-up prompt of its own, so that what
    only a process's first request pays (kernels, the kvd connection, mapping
    the pool) is in no figure; each B asks for the prompts its A ran, in order.
    """
    model = tiny_llama(MODEL)
    warmup = prompt_tokens(3 * BS, salt=99)
    prompts = [warmup] + [
        prompt_tokens(prefix, salt=2 + r) + prompt_tokens(9, salt=1) for r in range(rounds)
    ]
    run = {
        "block_size": BS,
        "max_model_len": 8192,
        "max_tokens": 1,
        # vLLM's processes import bench.timed_connectors.
        "env": {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        },
    }
    ttft: dict[str, list[float]] = {}
    steps: dict[str, list[float]] = {}
    ids: dict[str, list[list[int]]] = {}

    def one(name: str, config: dict[str, Any] | None) -> list[dict[str, Any]]:
        res = run_vllm(model, prompts, kv_transfer_config=config, **run)
        ttft.setdefault(name, []).extend(_ttfts(res))
        steps.setdefault(name, []).extend(_step_ms(res))
        ids[name] = [req["output_token_ids"] for req in res["requests"][1:]]
        return list(res["requests"][1:])

    with (
        run_daemon({"num_blocks": 16, "num_layers": 1}) as daemon,
        tempfile.TemporaryDirectory() as storage,
    ):
        one("cold", None)
        one("kvd_a", _kvd(daemon.address))
        one("example_a", _example(Path(storage)))
        for _ in range(pairs):
            loaded = one("kvd_b", _kvd(daemon.address, "TimedKvd"))
            assert all(req["num_cached_tokens"] == prefix for req in loaded), loaded
            one("example_b", _example(Path(storage)))
    assert len({repr(v) for v in ids.values()}) == 1, ids
    out = {name: statistics.median(v) for name, v in ttft.items()}
    out |= {f"{name}_step_ms": statistics.median(v) for name, v in steps.items() if v}
    return out


def load_bandwidth(num_blocks: int, rounds: int = 9) -> tuple[float, float, int]:
    """Seconds of a load of ``num_blocks`` blocks (all layers) and of a memcpy of its bytes."""
    lay = paged_layout(
        num_layers=8,
        num_kv_heads=8,
        head_size=64,
        dtype="float32",
        block_size=BS,
        engine="vllm/0.32.0/cpu/LBHNC",
        num_blocks=num_blocks + 8,
    )
    path = Path("/dev/shm") / f"kvd-bench-{uuid.uuid4().hex}"
    with open(path, "wb") as f:
        f.truncate(lay.total_bytes)
    try:
        pool = open_pool({"backend": "shm", "path": str(path), "size": lay.total_bytes}, lay)
        assert isinstance(pool, ShmPages)
        pages = [pool.pages(i) for i in range(8)]
        for p in pages:
            p.fill_(1.0)
        vllm = [torch.zeros(2 * num_blocks, 8, BS, 128).view(2 * num_blocks, -1) for _ in range(8)]
        src = list(range(4, 4 + num_blocks))
        dst = list(range(num_blocks // 2, num_blocks // 2 + num_blocks))
        nbytes = 8 * num_blocks * lay.page_bytes
        flat_src = np.ones(nbytes // 4, np.float32)
        flat_dst = np.zeros_like(flat_src)
        load, copy = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            copy_pages(pages, src, vllm, dst)
            load.append(time.perf_counter() - t)
            t = time.perf_counter()
            np.copyto(flat_dst, flat_src)
            copy.append(time.perf_counter() - t)
        return statistics.median(load), statistics.median(copy), nbytes
    finally:
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="prompts per process (medians)")
    ap.add_argument("--pairs", type=int, default=3, help="B processes of each connector")
    args = ap.parse_args()
    t = processes(args.prefix, args.rounds, args.pairs)
    load, memcpy, nbytes = load_bandwidth(args.prefix // BS)
    print(
        f"model: 8 layers, hidden 1024, 8 KV heads x 64, fp32; prefix {args.prefix} tokens; "
        f"medians of {args.rounds} prompts per process after a warm-up prompt, "
        f"{args.pairs} B processes of each connector in turns"
    )
    print(f"{'figure':52} {'value':>10} {'anchor':>10} {'ratio':>7} goal")
    rows = [
        ("B TTFT, prefix from kvd vs cold", t["kvd_b"], t["cold"], "<= 0.10"),
        ("B TTFT, kvd vs ExampleConnector's B", t["kvd_b"], t["example_b"], "<= 1.00"),
        ("A TTFT (prefill) saving to kvd vs no connector", t["kvd_a"], t["cold"], "<= 1.10"),
        ("ExampleConnector's B vs cold (the peer)", t["example_b"], t["cold"], "-"),
        ("ExampleConnector's A vs cold (the peer)", t["example_a"], t["cold"], "-"),
    ]
    for name, value, anchor, goal in rows:
        print(f"{name:52} {value:9.3f}s {anchor:9.3f}s {value / anchor:7.3f} {goal}")
    kvd_ms, ex_ms = t["kvd_b_step_ms"], t["example_b_step_ms"]
    print(
        f"{'B step: connector load+save, kvd vs Example (ms)':52} {kvd_ms:9.1f}  "
        f"{ex_ms:9.1f}  {kvd_ms / ex_ms:7.3f} <= 1.00"
    )
    gbs, mgbs = nbytes / load / 1e9, nbytes / memcpy / 1e9
    print(
        f"{'load kvd -> vLLM blocks vs memcpy (GB/s, ' + str(nbytes >> 20) + ' MiB)':52} "
        f"{gbs:10.2f} {mgbs:10.2f} {gbs / mgbs:7.3f} >= 0.80"
    )


if __name__ == "__main__":
    main()
