"""One vLLM ``LLM`` in this process: the subprocess side of `tests.vllm.support.run_vllm`.

``python -m tests.vllm.runner SPEC.json`` reads the spec (model dir, token-id
prompts, max_tokens, block_size, kv_transfer_config, kv_events_config, ...),
runs each prompt on its own (in order, greedy) and prints one JSON object on
stdout: per request the output token ids, ``num_cached_tokens`` and timings;
plus the engine's start-up time. Everything vLLM itself prints goes to stderr
(fd 1 is pointed at fd 2 before vLLM is imported, for the engine-core child
too), so stdout is exactly the JSON.

The ``__main__`` guard is required: vLLM spawns its engine core, which
re-imports the main module.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "enable_prefix_caching": spec.get("enable_prefix_caching", True),
        # The only algorithm whose block hashes equal kvd's keys.
        "prefix_caching_hash_algo": "sha256_cbor",
        "block_size": spec["block_size"],
        "max_model_len": spec.get("max_model_len", 4096),
        "dtype": spec.get("dtype", "float32"),
        "seed": 0,
        # RequestOutput.metrics (first-token timestamps) only with stats on.
        "disable_log_stats": False,
    }
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    if spec.get("kv_events_config"):
        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    kwargs.update(spec.get("llm_kwargs") or {})
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False
    )
    if spec.get("together"):
        return {"startup_s": startup_s, "requests": together(llm, spec, params)}
    salts = spec.get("cache_salts") or [None] * len(spec["prompts"])
    requests = []
    for prompt, salt in zip(spec["prompts"], salts, strict=True):
        tokens_prompt = TokensPrompt(prompt_token_ids=list(prompt))
        if salt is not None:
            tokens_prompt["cache_salt"] = salt
        t0 = time.perf_counter()
        (out,) = llm.generate([tokens_prompt], params, use_tqdm=False)
        wall_s = time.perf_counter() - t0
        metrics = out.metrics
        ttft_s = None
        if metrics is not None and getattr(metrics, "first_token_ts", 0):
            ttft_s = metrics.first_token_ts - (metrics.scheduled_ts or metrics.queued_ts)
        requests.append(
            {
                "output_token_ids": list(out.outputs[0].token_ids),
                "num_cached_tokens": out.num_cached_tokens,
                "wall_s": wall_s,
                "ttft_s": ttft_s,
                "first_token_latency_s": getattr(metrics, "first_token_latency", None),
            }
        )
    if spec.get("reset_prefix_cache"):
        llm.reset_prefix_cache()
        # One more step so the scheduler publishes what the reset queued.
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
    time.sleep(spec.get("linger_s", 0.0))
    return {"startup_s": startup_s, "requests": requests}


def together(llm: Any, spec: dict[str, Any], params: Any) -> list[dict[str, Any]]:
    """Every prompt at once through the engine's step loop (batched: preemption is possible).

    ``abort``: request ids (``"r<i>"``) aborted after ``abort_after_steps`` steps.
    Aborted requests report ``"aborted": true`` and their tokens so far.
    """
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    for i, prompt in enumerate(spec["prompts"]):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=list(prompt)), params)
    abort, after = spec.get("abort") or [], spec.get("abort_after_steps", 0)
    outputs: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        steps += 1
        if abort and steps == after:
            engine.abort_request(abort)
    return [
        {
            "request_id": f"r{i}",
            "output_token_ids": list(outputs[f"r{i}"].outputs[0].token_ids)
            if f"r{i}" in outputs
            else [],
            "num_cached_tokens": getattr(outputs.get(f"r{i}"), "num_cached_tokens", None),
            "aborted": f"r{i}" in abort,
        }
        for i in range(len(spec["prompts"]))
    ]


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    result = run(spec)
    out.write(json.dumps(result) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
