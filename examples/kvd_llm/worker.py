"""One inference process: ``python -m kvd_llm.worker`` (run from ``examples/``).

Reads one JSON request on stdin, serves it through kvd, prints one JSON
result line on stdout::

    {"address": "ipc:///...", "pool": "tiny", "name": "A", "size": "tiny",
     "engine": "paged", "prompt": [1, 2, ...], "max_new": 8,
     "cold": false, "check": true, "threads": 0}

It prefills the prompt (computing only what the node's prefix cache lacks),
decodes ``max_new`` greedy tokens, frees the sequence (its committed blocks
stay cached for the next process) and reports what it computed and how
long the prefill took. ``engine`` is ``paged`` (`PagedRunner` over
`TinyLlama`) or ``hf`` (the same weights as a transformers
``LlamaForCausalLM`` generating through `KvdCache`). ``cold`` also times
the same prefill in a namespace of its own, where nothing is cached (after
a warm-up, so that neither timed prefill pays torch's first-use costs);
``check`` compares the tokens and logits with the model's own path without
kvd (full attention, or transformers' ``DynamicCache``). ``threads``, when
not 0, sets torch's intra-op threads (1 gives steadier times on a busy host).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from kvd_client import Client

from kvd_llm.model import SIZES, TinyConfig, TinyLlama
from kvd_llm.runner import PagedRunner

__all__ = ["main", "serve"]


class _Paged:
    """The engine over `TinyLlama` and `PagedRunner`."""

    def __init__(self, cfg: TinyConfig) -> None:
        self.model = TinyLlama(cfg)

    def run(
        self, kv: Client, seq_id: str, prompt: list[int], max_new: int
    ) -> tuple[int, float, list[int], list[torch.Tensor]]:
        """Prefill (timed) and decode; cached tokens, seconds, tokens, logits rows."""
        runner = PagedRunner(kv, self.model)
        start = time.perf_counter()
        req = runner.prefill(seq_id, prompt, reserve=len(prompt) + max_new)
        elapsed = time.perf_counter() - start
        out = runner.generate(req, max_new) if max_new else []
        req.seq.free()
        return req.cached, elapsed, out, req.history

    def reference(self, prompt: list[int], out: list[int]) -> list[torch.Tensor]:
        """Logits rows that chose ``out``, computed with full attention and no pool."""
        return list(
            self.model.forward_reference(torch.tensor(prompt + out[:-1]))[len(prompt) - 1 :]
        )


class _HF:
    """The engine over transformers' ``LlamaForCausalLM`` and `KvdCache`."""

    def __init__(self, cfg: TinyConfig) -> None:
        # transformers takes seconds to import: only this engine pays for it.
        from kvd_llm.hf_model import tiny_llama_hf  # noqa: PLC0415

        self.model = tiny_llama_hf(cfg)

    def run(
        self, kv: Client, seq_id: str, prompt: list[int], max_new: int
    ) -> tuple[int, float, list[int], list[torch.Tensor]]:
        """Prefill: the uncached tail in one forward (timed); then ``generate`` the rest."""
        from kvd_client.integrations.hf import KvdCache  # noqa: PLC0415 (see __init__)

        ids = torch.tensor([prompt])
        start = time.perf_counter()
        with KvdCache(kv, self.model, seq_id, ids, reserve=len(prompt) + max_new) as cache:
            with torch.no_grad():
                first = self.model(ids[:, cache.num_cached_tokens :], cache=cache).logits[0, -1]
            elapsed = time.perf_counter() - start
            if max_new <= 1:
                out = [int(torch.argmax(first))][:max_new]
                return cache.num_cached_tokens, elapsed, out, [first][:max_new]
            token = torch.argmax(first).view(1, 1)
            gen = self.model.generate(
                torch.cat([ids, token], dim=1),
                cache=cache,
                max_new_tokens=max_new - 1,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            out = gen.sequences[0, len(prompt) :].tolist()
            return cache.num_cached_tokens, elapsed, out, [first, *(r[0] for r in gen.logits)]

    def reference(self, prompt: list[int], out: list[int]) -> list[torch.Tensor]:
        """Logits rows that chose ``out``, generated with transformers' own DynamicCache."""
        gen = self.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=len(out),
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        return [r[0] for r in gen.logits]


def _warm_up(engine: _Paged | _HF, address: str, pool: str, n: int) -> None:
    """Prefill a throwaway prompt of ``n`` tokens twice (a miss, then a hit) in a
    throwaway namespace, so that neither timed prefill pays torch's first-use
    costs of its shapes."""
    junk = [i % 97 for i in range(n)]
    with Client.connect(address, pool=pool, namespace=f"warm-{os.getpid()}") as kv:
        engine.run(kv, "warm-miss", junk, 0)
        engine.run(kv, "warm-hit", junk, 0)


def serve(request: dict[str, Any]) -> dict[str, Any]:
    """Serve one request (the stdin JSON, as a dict); the result dict."""
    if request.get("threads"):
        torch.set_num_threads(int(request["threads"]))
    cfg = SIZES[request.get("size", "tiny")]
    engine = _HF(cfg) if request.get("engine", "paged") == "hf" else _Paged(cfg)
    prompt = [int(t) for t in request["prompt"]]
    max_new = int(request.get("max_new", 8))
    name = str(request.get("name", "worker"))
    address, pool = request["address"], request["pool"]
    cold = bool(request.get("cold", False))
    if cold:
        _warm_up(engine, address, pool, len(prompt))
    with Client.connect(address, pool=pool, name=name) as kv:
        cached, elapsed, out, rows = engine.run(kv, f"{name}-{os.getpid()}", prompt, max_new)
    result: dict[str, Any] = {
        "name": name,
        "pid": os.getpid(),
        "prompt_tokens": len(prompt),
        "cached_tokens": cached,
        "prefill_tokens": len(prompt) - cached,
        "prefill_s": elapsed,
        "tokens": out,
    }
    if request.get("check", False) and out:
        want = engine.reference(prompt, out)
        result["matches_reference"] = out == [int(torch.argmax(r)) for r in want]
        result["max_logit_diff"] = max(
            float((got - exp).abs().max()) for got, exp in zip(rows, want, strict=True)
        )
    if cold:
        with Client.connect(
            address, pool=pool, name=f"{name}-cold", namespace=f"cold-{name}-{os.getpid()}"
        ) as cold_kv:
            hit, cold_s, _, _ = engine.run(cold_kv, f"{name}-cold", prompt, 0)
        result["cold_prefill_tokens"] = len(prompt) - hit
        result["cold_prefill_s"] = cold_s
    return result


def main() -> int:
    """Entry point: JSON request on stdin, JSON result on stdout."""
    print(json.dumps(serve(json.load(sys.stdin))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
