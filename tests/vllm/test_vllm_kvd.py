"""KvdConnector with real vLLM processes: a prefix computed by one process is loaded by another.

Process A computes a prompt with a 4,096-token prefix and saves its full
blocks into kvd; process B, a separate ``LLM`` with its own (empty) KV cache,
loads the prefix from kvd and computes only the tail. B's greedy output
equals A's and a cold run's (no connector), token for token. Every hold is
gone afterwards (kvd's stats), and a client expecting kvd's own layout is
refused the pool. With the prefix then evicted from the pool, a third
process loads it from the pool's host tier (``memory.runtime_pool_tier_factor``)
with the same output.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_events", reason="needs vLLM: run `make test-vllm` (its own venv)"
)

from kvd_client import Client
from kvd_client.errors import LayoutMismatch
from kvd_client.integrations.vllm_plan import model_digest

from tests.vllm.support import (
    TIERED,
    LlamaSpec,
    evict_from_the_pool,
    kill_once_holding,
    prompt_tokens,
    start_vllm,
    tier_stats,
    tiny_llama,
)

PREFIX = 4096
BLOCK_SIZE = 32
MAX_LEN = 8192
#: The tiny Llama, long enough for the prefix and its tail.
SPEC = LlamaSpec(max_position_embeddings=MAX_LEN)


def kvd_connector(address: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd_client.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvd_address": address, "kvd_num_blocks": 1024, **extra},
    }


def _pool_stats(address: str) -> dict[str, Any]:
    """The connector's pool ``vllm-…`` in kvd's stats, its ``blocks`` section beside.

    Its name is a digest of the layout, whose format names the model (the
    pool of another model is never this one): found, not computed here.
    """
    with Client.connect(address, pool=None) as kv:
        stats = kv.stats()
    (name,) = [n for n in stats["pools"] if n.startswith("vllm-")]
    return {**stats["pools"][name], "blocks": stats["blocks"][name], "name": name}


def _wait_no_holds(address: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = _pool_stats(address)
        if stats["holds"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _run(model: Any, prompts: list[list[int]], **kwargs: Any) -> Any:
    return start_vllm(
        model, prompts, block_size=BLOCK_SIZE, max_model_len=MAX_LEN, max_tokens=16, **kwargs
    )


@pytest.mark.timeout(900)
def test_a_second_process_loads_the_prefix_from_kvd(start_kvd: Any) -> None:
    kvd_daemon = start_kvd(overrides=TIERED)
    model = tiny_llama(SPEC)
    prompt = prompt_tokens(PREFIX) + prompt_tokens(9, salt=1)
    config = kvd_connector(kvd_daemon.address)
    a = _run(model, [prompt], kv_transfer_config=config)
    cold = _run(model, [prompt])
    a_out, cold_out = a.result(), cold.result()
    after_a = _pool_stats(kvd_daemon.address)
    b_out = _run(model, [prompt], kv_transfer_config=config).result()
    after_b = _wait_no_holds(kvd_daemon.address)

    (ra,), (rb,), (rc,) = a_out["requests"], b_out["requests"], cold_out["requests"]
    assert rb["output_token_ids"] == ra["output_token_ids"] == rc["output_token_ids"]
    assert len(rb["output_token_ids"]) == 16
    # The prefix came from kvd (B's own cache was empty): the connector's hit.
    assert rb["num_cached_tokens"] == PREFIX, rb
    assert ra["num_cached_tokens"] == rc["num_cached_tokens"] == 0
    assert f"loads {PREFIX} tokens from kvd" in b_out["stderr"]
    # A saved every full block of the prompt (4,105 tokens: 128 blocks) and of its output.
    assert after_a["blocks"]["evictable"] >= (PREFIX + 9) // BLOCK_SIZE, after_a
    assert after_b["holds"] == 0 and after_b["held_blocks"] == 0, after_b
    print(
        f"\nTTFT A {ra['ttft_s']:.3f} s, cold {rc['ttft_s']:.3f} s, B {rb['ttft_s']:.3f} s; "
        f"pool after B: {after_b}"
    )

    # A client expecting kvd's own layout is refused this pool of vLLM pages.
    pool = after_b["name"]
    with Client.connect(kvd_daemon.address, pool=pool) as kv:
        digest = model_digest(str(model), None, "torch.float32")
        assert kv.layout is not None and f"/LBHNC/{digest}/" in kv.layout.format, kv.layout
        kvd_own = dataclasses.replace(kv.layout, order="layer_major", format="")
    with pytest.raises(LayoutMismatch, match="layout differs"):
        Client.connect(kvd_daemon.address, pool=pool, layout=kvd_own)

    # Evicted from the pool, the prefix comes back from its host tier.
    evict_from_the_pool(kvd_daemon.address, pool)
    assert _pool_stats(kvd_daemon.address)["blocks"]["evictable"] == 0
    t_out = _run(model, [prompt], kv_transfer_config=config).result()
    (rt,) = t_out["requests"]
    assert rt["output_token_ids"] == ra["output_token_ids"]
    assert rt["num_cached_tokens"] == PREFIX, rt
    assert f"loads {PREFIX} tokens from kvd" in t_out["stderr"]
    tier = tier_stats(kvd_daemon.address, pool)
    assert tier["promotions"] >= PREFIX // BLOCK_SIZE and tier["errors"] == 0, tier


@pytest.mark.timeout(900)
def test_abort_preemption_and_sigkill_leave_no_hold(kvd_daemon: Any) -> None:
    """Waiting requests hold their kvd prefix; abort, preemption and SIGKILL release it all."""
    model = tiny_llama(SPEC)
    prompts = [prompt_tokens(1024, salt=10 + i) + prompt_tokens(9, salt=1) for i in range(4)]
    config = kvd_connector(kvd_daemon.address)
    # A: each prefix into kvd.
    _run(model, prompts, kv_transfer_config=config).result()
    # C: 68 vLLM blocks for four requests of 33 blocks that grow: two run, two wait
    # (holding their kvd prefix), the running ones preempt each other; r3 is aborted.
    small = {"num_gpu_blocks_override": 68, "max_num_seqs": 4}
    c = start_vllm(
        model,
        prompts,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        max_tokens=96,
        kv_transfer_config=config,
        llm_kwargs=small,
        together=True,
        abort=["r3"],
        abort_after_steps=2,
    ).result()
    assert "preempted, its kvd holds released" in c["stderr"], c["stderr"][-3000:]
    done = [r for r in c["requests"] if not r["aborted"]]
    assert all(len(r["output_token_ids"]) == 96 for r in done), c["requests"]
    assert _wait_no_holds(kvd_daemon.address)["holds"] == 0

    # D: killed (vLLM and its engine core) while requests wait on their holds.
    d = start_vllm(
        model,
        prompts * 2,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        max_tokens=96,
        kv_transfer_config=config,
        llm_kwargs=small,
        together=True,
    )
    kill_once_holding(d, lambda: _pool_stats(kvd_daemon.address)["holds"])
    after = _wait_no_holds(kvd_daemon.address)
    assert after["holds"] == 0 and after["held_blocks"] == 0, after
    assert after["blocks"]["in_use"] == 0, after
