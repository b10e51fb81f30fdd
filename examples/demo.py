"""Two inference processes share a long system prompt through kvd.

    .venv/bin/python examples/demo.py              # a model big enough to see the time
    .venv/bin/python examples/demo.py --size tiny  # the test model, in seconds
    .venv/bin/python examples/demo.py --engine hf  # transformers generating through KvdCache
    .venv/bin/python examples/demo.py --repeat 5   # medians of B's prefill, hit vs cold

Uses the daemon at ``--address`` (default: ``$KVD_ADDRESS`` or the usual
ipc socket) when it serves pool ``--pool`` with the model's layout;
otherwise starts a private ``kvd`` for the run and stops it at the end.

Process A prefills ``system + question A`` (nothing cached), decodes, and
exits: its committed blocks stay in the pool. Process B then prefills
``system + question B``: the daemon hands it A's blocks and B computes only
its own question. B also times the same prefill in a namespace of its own
(nothing cached there), and both check every logit against the model's
reference path without kvd. The demo ends with ``kvd-ctl stats``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from kvd_client import default_address
from kvd_llm.daemon import pool_matches, private_daemon
from kvd_llm.model import SIZES

HERE = Path(__file__).resolve().parent


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="daemon address (default: the usual one)")
    p.add_argument("--pool", default="tiny-llama", help="pool name (default: tiny-llama)")
    p.add_argument("--size", choices=sorted(SIZES), default="demo", help="model size")
    p.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt length")
    p.add_argument("--question-tokens", type=int, default=48, help="each process's own tokens")
    p.add_argument("--max-new", type=int, default=16, help="tokens each process generates")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run B this many times (new questions each time) and report median prefill times",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per process (default: torch's; 1 is steadier on a busy host)",
    )
    p.add_argument(
        "--engine",
        choices=["paged", "hf"],
        default="paged",
        help="paged: the example's own paged attention; hf: transformers with KvdCache",
    )
    return p.parse_args(argv)


@contextlib.contextmanager
def _daemon(args: argparse.Namespace, num_blocks: int) -> Iterator[str]:
    layout = SIZES[args.size].layout(num_blocks)
    address = args.address or default_address()
    if pool_matches(address, args.pool, layout):
        print(f"using the running daemon at {address} (pool {args.pool!r})")
        yield address
        return
    if args.address:
        raise SystemExit(f"no daemon at {address} serves pool {args.pool!r} with {layout}")
    with private_daemon(layout, args.pool) as private:
        print(f"started kvd at {private} (pool {args.pool!r}, {num_blocks} blocks); stops at exit")
        yield private


def _worker(request: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "kvd_llm.worker"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=HERE,
        env=env,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"worker {request['name']} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _kvd_ctl(address: str) -> str:
    ctl = Path(sys.executable).with_name("kvd-ctl")
    done = subprocess.run(
        [str(ctl), "--address", address, "stats"], capture_output=True, text=True, check=False
    )
    return done.stdout if done.returncode == 0 else done.stderr


def main(argv: list[str] | None = None) -> int:
    """Run the demo; 0 when both processes matched the reference, else 1."""
    args = _args(argv)
    cfg = SIZES[args.size]
    gen = torch.Generator().manual_seed(args.seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in torch.randint(0, cfg.vocab_size, (n,), generator=gen)]

    system = draw(args.system_tokens)
    prompts = {name: system + draw(args.question_tokens) for name in ("A", "B")}
    extra = [system + draw(args.question_tokens) for _ in range(args.repeat - 1)]
    per_seq = -(-(len(prompts["A"]) + args.max_new) // 16)
    with _daemon(args, num_blocks=6 * per_seq + 16) as address:
        base = {
            "address": address,
            "pool": args.pool,
            "size": args.size,
            "engine": args.engine,
            "threads": args.threads,
            "check": True,
        }
        results = [
            _worker({**base, "name": "A", "prompt": prompts["A"], "max_new": args.max_new}),
            _worker(
                {**base, "name": "B", "prompt": prompts["B"], "max_new": args.max_new, "cold": True}
            ),
        ]
        print(
            f"\nengine {args.engine}, model {args.size}: {cfg.num_layers} layers, "
            f"hidden {cfg.hidden_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} kv heads; "
            f"system prompt {len(system)} tokens, questions {args.question_tokens}\n"
        )
        print(
            f"{'process':<16}{'prompt':>8}{'cached':>8}{'computed':>10}{'prefill':>11}  reference"
        )
        for r in results:
            ok = "match" if r["matches_reference"] else "MISMATCH"
            print(
                f"{r['name'] + ' (pid ' + str(r['pid']) + ')':<16}"
                f"{r['prompt_tokens']:>8}{r['cached_tokens']:>8}{r['prefill_tokens']:>10}"
                f"{r['prefill_s'] * 1e3:>9.1f}ms  {ok} (max |dlogit| {r['max_logit_diff']:.1e})"
            )
        b = results[1]
        print(
            f"{'B, cold':<16}{b['prompt_tokens']:>8}"
            f"{b['prompt_tokens'] - b['cold_prefill_tokens']:>8}{b['cold_prefill_tokens']:>10}"
            f"{b['cold_prefill_s'] * 1e3:>9.1f}ms  (same prompt, a namespace with nothing cached)"
        )
        print(
            f"\nB's prefill with A's prefix: {b['prefill_s'] * 1e3:.1f} ms for "
            f"{b['prefill_tokens']} tokens, versus {b['cold_prefill_s'] * 1e3:.1f} ms for all "
            f"{b['cold_prefill_tokens']}: {b['cold_prefill_s'] / b['prefill_s']:.1f}x faster; "
            f"{b['cached_tokens']} tokens hit.\n"
        )
        if extra:
            runs = [b] + [
                _worker(
                    {**base, "name": "B", "prompt": p, "max_new": 1, "cold": True, "check": False}
                )
                for p in extra
            ]
            hit = statistics.median(r["prefill_s"] for r in runs)
            cold = statistics.median(r["cold_prefill_s"] for r in runs)
            print(
                f"median over {len(runs)} runs of B (a new question each): {hit * 1e3:.1f} ms with "
                f"the shared prefix, {cold * 1e3:.1f} ms without: {cold / hit:.1f}x\n"
            )
        print(f"$ kvd-ctl --address {address} stats")
        print(_kvd_ctl(address))
    return 0 if all(r["matches_reference"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
