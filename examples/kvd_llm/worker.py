"""One inference process: ``python -m kvd_llm.worker`` (run from ``examples/``).

Reads one JSON request on stdin, serves it through kvd, prints one JSON
result line on stdout::

    {"address": "ipc:///...", "pool": "tiny", "name": "A", "size": "tiny",
     "prompt": [1, 2, ...], "max_new": 8, "cold": false, "check": true}

It prefills the prompt (computing only what the node's prefix cache lacks),
decodes ``max_new`` greedy tokens, frees the sequence (its committed blocks
stay cached for the next process) and reports what it computed and how
long the prefill took. ``cold`` also times the same prefill in a private
namespace, where nothing is cached; ``check`` compares every logit with the
model's reference path (full attention, no pool).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from kvd_client import Client

from kvd_llm.model import SIZES, TinyLlama
from kvd_llm.runner import PagedRunner

__all__ = ["main", "serve"]


def _timed_prefill(runner: PagedRunner, seq_id: str, prompt: list[int], max_new: int) -> Any:
    start = time.perf_counter()
    req = runner.prefill(seq_id, prompt, reserve=len(prompt) + max_new)
    return req, time.perf_counter() - start


def serve(request: dict[str, Any]) -> dict[str, Any]:
    """Serve one request (the stdin JSON, as a dict); the result dict."""
    torch.manual_seed(0)
    model = TinyLlama(SIZES[request.get("size", "tiny")])
    prompt = [int(t) for t in request["prompt"]]
    max_new = int(request.get("max_new", 8))
    name = str(request.get("name", "worker"))
    model.forward_reference(torch.tensor(prompt[:16]))  # warm up torch before timing
    with Client.connect(request["address"], pool=request["pool"], name=name) as kv:
        runner = PagedRunner(kv, model)
        req, prefill_s = _timed_prefill(runner, f"{name}-{os.getpid()}", prompt, max_new)
        tokens = runner.generate(req, max_new)
        result: dict[str, Any] = {
            "name": name,
            "pid": os.getpid(),
            "prompt_tokens": len(prompt),
            "cached_tokens": req.cached,
            "prefill_tokens": len(prompt) - req.cached,
            "prefill_s": prefill_s,
            "tokens": tokens,
        }
        if request.get("check", False):
            ref = model.forward_reference(torch.tensor(prompt + tokens[:-1]))
            rows = ref[len(prompt) - 1 :]
            result["matches_reference"] = tokens == [int(t) for t in rows.argmax(-1)]
            result["max_logit_diff"] = max(
                float((got - want).abs().max()) for got, want in zip(req.history, rows, strict=True)
            )
        req.seq.free()
    if request.get("cold", False):
        with Client.connect(
            request["address"], pool=request["pool"], name=f"{name}-cold", namespace=f"cold-{name}"
        ) as cold_kv:
            cold, cold_s = _timed_prefill(
                PagedRunner(cold_kv, model), f"{name}-cold", prompt, max_new
            )
            result["cold_prefill_tokens"] = len(prompt) - cold.cached
            result["cold_prefill_s"] = cold_s
            cold.seq.free()
    return result


def main() -> int:
    """Entry point: JSON request on stdin, JSON result on stdout."""
    print(json.dumps(serve(json.load(sys.stdin))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
