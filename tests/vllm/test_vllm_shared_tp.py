"""Shared mode with tensor parallelism: one id space, one segment per rank (#19).

Two vLLM processes run the same tiny Llama with ``tensor_parallel_size=2``
(vLLM's CPU backend, one core per rank). The pool's layers are both ranks'
segments (rank r's KV buffer is layers ``r*L .. (r+1)*L - 1``), and the
scheduler's block id N is block N of each. B reads A's prefix in place on
both ranks: cached tokens from kvd, greedy output equal to A's (cold: the
pool was empty). Noise written into rank 1's segment only of those blocks
changes a third process's output: rank 1 reads its own segment, and rank 0's
alone would not have told.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vLLM: run `make test-vllm`")

from kvd_client import Client

from tests.vllm.support import LlamaSpec, kvd_shared, prompt_tokens, start_vllm, tiny_llama

PREFIX = 1024
BLOCK_SIZE = 32
BLOCKS = 160
TP = 2
SPEC = LlamaSpec()
#: One core per rank (vLLM's CPU workers refuse to share this box's one NUMA node).
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _run(model: Any, prompt: list[int], address: str) -> dict[str, Any]:
    llm_kwargs = {
        "scheduler_cls": "kvd_client.integrations.vllm.KvdScheduler",
        "num_gpu_blocks_override": BLOCKS,
        "tensor_parallel_size": TP,
        "distributed_executor_backend": "mp",
    }
    (req,) = start_vllm(
        model,
        [prompt],
        block_size=BLOCK_SIZE,
        max_tokens=16,
        max_model_len=2048,
        kv_transfer_config=kvd_shared(address),
        llm_kwargs=llm_kwargs,
        env=TP_ENV,
        timeout=600,
    ).result()["requests"]
    return req  # type: ignore[no-any-return]


def _the_pool(address: str) -> str:
    with Client.connect(address, pool=None) as kv:
        (name,) = [n for n in kv.stats()["pools"] if n.startswith("vllm")]
    return name


def _noise_segment(address: str, name: str, tokens: list[int], rank: int) -> int:
    """Noise into ``rank``'s segment of the cached prefix of ``tokens``; how many blocks."""
    with Client.connect(address, pool=name) as kv:
        found = kv.lookup(kv.block_keys(np.asarray(tokens, np.int32)), hold=True)
        ids = [int(b) for b in found.blocks.tolist()]
        layers = kv.pool.layout.num_layers // TP
        rng = np.random.default_rng(1)
        for layer in range(rank * layers, (rank + 1) * layers):
            pages = kv.pool.np_pages(layer)
            pages[ids] = rng.standard_normal((len(ids), pages.shape[1])).astype(pages.dtype)
        kv.release(found.hold)
    return len(ids)


@pytest.mark.timeout(1200)
def test_ranks_share_one_id_space_and_read_their_own_segments(kvd_daemon: Any) -> None:
    model = tiny_llama(SPEC)
    prompt = prompt_tokens(PREFIX) + prompt_tokens(9, salt=1)
    a = _run(model, prompt, kvd_daemon.address)
    name = _the_pool(kvd_daemon.address)
    with Client.connect(kvd_daemon.address, pool=name) as kv:
        layout = kv.pool.layout
    assert "/tp2/" in layout.format, layout
    # Both ranks' segments: each rank's two layers.
    assert layout.num_layers == TP * SPEC.num_hidden_layers, layout

    b = _run(model, prompt, kvd_daemon.address)
    assert b["num_cached_tokens"] == PREFIX, b
    assert b["output_token_ids"] == a["output_token_ids"]

    assert _noise_segment(kvd_daemon.address, name, prompt[:PREFIX], rank=1) == PREFIX // BLOCK_SIZE
    c = _run(model, prompt, kvd_daemon.address)
    assert c["num_cached_tokens"] == PREFIX, c
    assert c["output_token_ids"] != a["output_token_ids"]
