"""The vLLM test environment works: two vLLM processes share a prefix through a connector.

Process A computes a 1,024-token prefix and saves its KV with vLLM's shipped
``ExampleConnector`` (safetensors files); process B, a separate deployment
with an empty local cache, loads that prefix through the connector instead
of computing it, and its greedy output equals A's and a cold run's (a third
process without any connector, started beside A).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

# A submodule, not "vllm": tests/vllm itself is a namespace package "vllm" when
# tests/ is on sys.path (the dev run), and would satisfy a plain importorskip.
pytest.importorskip(
    "vllm.distributed.kv_events", reason="needs vLLM: run `make test-vllm` (its own venv)"
)

from tests.vllm.support import example_connector, prompt_tokens, start_vllm, tiny_llama

PREFIX = 1024
BLOCK_SIZE = 32


@pytest.mark.timeout(600)
def test_two_processes_share_a_prefix_through_the_example_connector(tmp_path: Path) -> None:
    model = tiny_llama()
    # ExampleConnector keys its files by the prompt less its last token, rounded
    # down to a block: a tail of 2..32 tokens after the prefix makes that the prefix.
    prompt = prompt_tokens(PREFIX) + prompt_tokens(9, salt=1)
    storage = tmp_path / "kv"
    storage.mkdir()
    started = time.monotonic()
    a = start_vllm(
        model,
        [prompt],
        max_tokens=16,
        block_size=BLOCK_SIZE,
        kv_transfer_config=example_connector(storage),
    )
    cold = start_vllm(model, [prompt], max_tokens=16, block_size=BLOCK_SIZE)
    a_out, cold_out = a.result(), cold.result()
    saved = sorted(p.name for p in storage.rglob("*.safetensors"))
    assert len(saved) == 2, saved  # one file per layer of the prefix
    b_out = start_vllm(
        model,
        [prompt],
        max_tokens=16,
        block_size=BLOCK_SIZE,
        kv_transfer_config=example_connector(storage),
    ).result()
    elapsed = time.monotonic() - started

    (ra,), (rb,), (rc,) = a_out["requests"], b_out["requests"], cold_out["requests"]
    assert "External Cache Hit" in b_out["stderr"]
    assert f"Inject KV cache of {PREFIX} tokens" in b_out["stderr"]
    assert "External Cache Hit" not in a_out["stderr"]
    assert rb["output_token_ids"] == ra["output_token_ids"] == rc["output_token_ids"]
    assert len(rb["output_token_ids"]) == 16
    # The prefix came through the connector, not B's own (empty) prefix cache.
    assert rb["num_cached_tokens"] == PREFIX, rb
    assert ra["num_cached_tokens"] == rc["num_cached_tokens"] == 0
    print(
        f"\nA+cold (side by side) then B: {elapsed:.1f} s; start-up A {a_out['startup_s']:.1f} s, "
        f"B {b_out['startup_s']:.1f} s; TTFT A {ra['ttft_s']:.3f} s, B {rb['ttft_s']:.3f} s"
    )
