"""vLLM shared mode (the kvd pool is every process's KV cache) beside cold and the copy connector.

Run in the vLLM venv (``scripts/vllm-env.sh``):

    $(scripts/vllm-env.sh | tail -n 1)/bin/python -m bench.vllm_shared [--prefix 2048]

The model of `bench.vllm_connector` (8 layers, hidden 1024, fp32). One vLLM
process at a time: cold (no kvd); shared A then shared B (B reads A's
prefix in place: no byte copied); copy-mode A then B (`KvdConnector`
copying between kvd and a private cache), the anchor. Each process runs a
warm-up prompt, then ``--rounds`` prompts with distinct prefixes; figures
are medians. Node memory for ``--processes`` processes that ran one prompt
each, with one prefix and their own tails: the pool's blocks in use or
cached (kvd's stats) against the blocks of as many private caches.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from kvd_client import Client

from bench._common import run_daemon
from bench.vllm_connector import BS, MODEL, _kvd, _ttfts
from tests.vllm.support import kvd_shared, prompt_tokens, run_vllm, tiny_llama

SCHEDULER = "kvd_client.integrations.vllm.KvdScheduler"


def _pool_blocks(address: str) -> tuple[int, int]:
    """(blocks in use or cached, bytes per block) of the shared pool."""
    with Client.connect(address, pool=None) as kv:
        stats = kv.stats()
    (name,) = [n for n in stats["pools"] if n.startswith("vllm")]
    blocks = stats["blocks"][name]
    return blocks["in_use"] + blocks["evictable"], stats["pools"][name]["bytes_per_block"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="prompts per process (medians)")
    ap.add_argument("--processes", type=int, default=3, help="processes of the memory figure")
    ap.add_argument("--blocks", type=int, default=2048, help="the shared pool's blocks")
    args = ap.parse_args()
    model = tiny_llama(MODEL)
    warmup = prompt_tokens(3 * BS, salt=99)
    prompts = [warmup] + [
        prompt_tokens(args.prefix, salt=2 + r) + prompt_tokens(9, salt=1)
        for r in range(args.rounds)
    ]
    run = {"block_size": BS, "max_model_len": 8192, "max_tokens": 1}
    shared_kw = {"scheduler_cls": SCHEDULER, "num_gpu_blocks_override": args.blocks}
    t: dict[str, float] = {}
    outs: dict[str, list[Any]] = {}
    cached: dict[str, list[int]] = {}

    def one(name: str, config: dict[str, Any] | None, llm: dict[str, Any] | None = None) -> None:
        res = run_vllm(model, prompts, kv_transfer_config=config, llm_kwargs=llm or {}, **run)
        t[name] = statistics.median(_ttfts(res))
        outs[name] = [r["output_token_ids"] for r in res["requests"][1:]]
        cached[name] = [r["num_cached_tokens"] for r in res["requests"][1:]]

    one("cold", None)
    with run_daemon({"num_blocks": 16, "num_layers": 1}) as daemon:
        one("shared_a", kvd_shared(daemon.address), shared_kw)
        one("shared_b", kvd_shared(daemon.address), shared_kw)
        one("copy_a", _kvd(daemon.address))
        one("copy_b", _kvd(daemon.address))
    assert all(c == args.prefix for c in cached["shared_b"]), cached
    assert all(c == args.prefix for c in cached["copy_b"]), cached
    assert len({repr(v) for v in outs.values()}) == 1, outs

    # Memory: N processes, one prefix, a tail each (one prompt per process).
    head = prompt_tokens(args.prefix, salt=77)
    with run_daemon({"num_blocks": 16, "num_layers": 1}) as daemon:
        for i in range(args.processes):
            mem_prompt = [head + prompt_tokens(BS * 4, salt=200 + i)]
            run_vllm(
                model,
                mem_prompt,
                kv_transfer_config=kvd_shared(daemon.address),
                llm_kwargs=shared_kw,
                **run,
            )
        used, per_block = _pool_blocks(daemon.address)
    private = args.processes * (len(head) // BS + 4)

    print(
        f"model: 8 layers, hidden 1024, 8 KV heads x 64, fp32; prefix {args.prefix} tokens; "
        f"medians of {args.rounds} prompts per process after a warm-up prompt"
    )
    print(f"{'figure':52} {'value':>10} {'anchor':>10} {'ratio':>7} goal")
    rows = [
        ("B TTFT, shared prefix read in place vs cold", t["shared_b"], t["cold"], "-"),
        ("B TTFT, shared vs copy connector's B", t["shared_b"], t["copy_b"], "<= 1.00"),
        ("A TTFT (prefill), shared vs cold", t["shared_a"], t["cold"], "-"),
        ("copy connector's B vs cold (the anchor)", t["copy_b"], t["cold"], "-"),
    ]
    for name, value, anchor, goal in rows:
        print(f"{name:52} {value:9.3f}s {anchor:9.3f}s {value / anchor:7.3f} {goal}")
    mib = per_block / (1 << 20)
    print(
        f"{f'node KV for {args.processes} processes, shared vs private (MiB)':52} "
        f"{used * mib:10.1f} {private * mib:10.1f} {used / private:7.3f} "
        f"one prefix: {(len(head) // BS + 4 * args.processes) * mib:.1f} MiB"
    )


if __name__ == "__main__":
    main()
