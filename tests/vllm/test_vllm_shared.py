"""Shared mode with real vLLM processes: the kvd pool is every process's KV cache (#19).

Process A computes a prompt with a 4,096-token prefix in the pool; process B,
a separate ``LLM`` mapping the same pool, finds the prefix in vLLM's own
prefix cache (kvd's: ``num_cached_tokens``) and reads it in place: its greedy
output equals a cold run's, and noise written into those blocks changes it.
Publication waits for the step's output (a manager-level test that a
schedule-time publish fails). Processes running at once over a pool smaller
than their prompts (evictions) all produce cold outputs, and a SIGKILLed
one's holds and blocks come back while another runs on. With the prefix
evicted from the pool, a new process gets it back from the pool's host tier
(``memory.runtime_pool_tier_factor``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.block_pool", reason="needs vLLM: run `make test-vllm`")

from kvd_client import Client
from kvd_client.integrations.vllm_plan import Link, paged_layout, pool_name
from kvd_client.integrations.vllm_shared import KvdBlockPool, building_block_pools
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from tests.vllm.support import (
    TIERED,
    LlamaSpec,
    evict_from_the_pool,
    kill_once_holding,
    kvd_shared,
    prompt_tokens,
    start_vllm,
    tier_stats,
    tiny_llama,
)

PREFIX = 4096
BLOCK_SIZE = 32
MAX_LEN = 8192
SPEC = LlamaSpec(max_position_embeddings=MAX_LEN)


def _run(model: Any, prompts: list[list[int]], address: str | None, blocks: int, **kw: Any) -> Any:
    """A vLLM process (shared mode over ``blocks`` ids when ``address``, else cold)."""
    llm_kwargs = dict(kw.pop("llm_kwargs", {}))
    if address is not None:
        llm_kwargs |= {
            "scheduler_cls": "kvd_client.integrations.vllm.KvdScheduler",
            "num_gpu_blocks_override": blocks,
        }
        kw["kv_transfer_config"] = kvd_shared(address)
    return start_vllm(
        model,
        prompts,
        block_size=BLOCK_SIZE,
        max_model_len=kw.pop("max_model_len", MAX_LEN),
        max_tokens=kw.pop("max_tokens", 16),
        llm_kwargs=llm_kwargs,
        **kw,
    )


def _pools(address: str) -> dict[str, Any]:
    with Client.connect(address, pool=None) as kv:
        stats = kv.stats()
    return {
        name: {**p, "blocks": stats["blocks"][name], "prefix": stats["prefix"][name]}
        for name, p in stats["pools"].items()
    }


def _the_pool(address: str) -> tuple[str, dict[str, Any]]:
    (name, stats), *rest = [(n, p) for n, p in _pools(address).items() if n.startswith("vllm")]
    assert not rest, rest
    return name, stats


def _wait_no_holds(address: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        _, stats = _the_pool(address)
        if stats["holds"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _kvd_lines(stderr: str) -> str:
    """vLLM's log lines of the kvd integration (assertion messages)."""
    return "\n".join(line for line in stderr.splitlines() if "kvd" in line)


def _noise(address: str, name: str, tokens: list[int]) -> int:
    """Write noise into the pool's blocks of ``tokens``' cached prefix; how many blocks."""
    with Client.connect(address, pool=name) as kv:
        keys = kv.block_keys(np.asarray(tokens, np.int32))
        found = kv.lookup(keys, hold=True)
        ids = [int(b) for b in found.blocks.tolist()]
        rng = np.random.default_rng(0)
        for layer in range(kv.pool.layout.num_layers):
            pages = kv.pool.np_pages(layer)
            pages[ids] = rng.standard_normal((len(ids), pages.shape[1])).astype(pages.dtype)
        kv.release(found.hold)
    return len(ids)


@pytest.mark.timeout(900)
def test_a_second_process_reads_the_prefix_in_place(start_kvd: Any) -> None:
    kvd_daemon = start_kvd(overrides=TIERED)
    model = tiny_llama(SPEC)
    prompt = prompt_tokens(PREFIX) + prompt_tokens(9, salt=1)
    a = _run(model, [prompt], kvd_daemon.address, 512)
    cold = _run(model, [prompt], None, 0)
    (ra,), (rc,) = a.result()["requests"], cold.result()["requests"]
    name, after_a = _the_pool(kvd_daemon.address)
    assert after_a["holds"] == 0, after_a  # A is gone: its blocks are cached, not held
    assert after_a["blocks"]["evictable"] >= PREFIX // BLOCK_SIZE, after_a

    b = _run(model, [prompt], kvd_daemon.address, 512).result()
    (rb,) = b["requests"]
    # vLLM's CPU platform turns async scheduling off: the plain scheduler's subclass.
    assert "kvd shared mode: KvdScheduler" in b["stderr"], _kvd_lines(b["stderr"])
    # B's own cache was empty: kvd's blocks.
    assert rb["num_cached_tokens"] == PREFIX, (rb, _kvd_lines(b["stderr"]))
    assert rb["output_token_ids"] == ra["output_token_ids"] == rc["output_token_ids"]
    assert _wait_no_holds(kvd_daemon.address)["holds"] == 0

    # The negative control: B really read those bytes.
    assert _noise(kvd_daemon.address, name, prompt[:PREFIX]) == PREFIX // BLOCK_SIZE
    (rn,) = _run(model, [prompt], kvd_daemon.address, 512).result()["requests"]
    assert rn["num_cached_tokens"] == PREFIX, rn
    assert rn["output_token_ids"] != rc["output_token_ids"]

    # Evicted from the pool, the prefix comes back from its host tier, whose copy
    # was taken when A published it, before the noise: cold's output again.
    evict_from_the_pool(kvd_daemon.address, name)
    t = _run(model, [prompt], kvd_daemon.address, 512).result()
    (rt,) = t["requests"]
    assert rt["num_cached_tokens"] == PREFIX, (rt, _kvd_lines(t["stderr"]))
    assert rt["output_token_ids"] == rc["output_token_ids"]
    tier = tier_stats(kvd_daemon.address, name)
    assert tier["promotions"] >= PREFIX // BLOCK_SIZE and tier["errors"] == 0, tier


def _manager(address: str, num_blocks: int) -> tuple[KVCacheManager, KvdBlockPool, Client]:
    """vLLM's KV cache manager over a `KvdBlockPool` of a fresh shared pool (no model)."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype="float32")
    layout = paged_layout(
        num_layers=1,
        num_kv_heads=2,
        head_size=64,
        dtype="float32",
        block_size=BLOCK_SIZE,
        engine="vllm/test/cpu/LBHNC/shared",
        num_blocks=num_blocks,
    )
    name = pool_name(layout)
    owner = Client.connect(address, pool=name, layout=layout, create=True, backend="shm")
    link = Link(lambda: Client.connect(address, pool=name, layout=layout), retry_s=1.0)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )

    def factory(*a: Any, **k: Any) -> KvdBlockPool:
        return KvdBlockPool(*a, link=link, spare_target=None, **k)

    with building_block_pools(factory):
        manager = KVCacheManager(
            config,
            max_model_len=MAX_LEN,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
        )
    pool = manager.block_pool
    assert isinstance(pool, KvdBlockPool)
    return manager, pool, owner


def test_a_block_is_published_only_after_its_step_output(kvd_daemon: Any) -> None:
    init_none_hash(sha256_cbor)
    manager, pool, other = _manager(kvd_daemon.address, 256)
    tokens = prompt_tokens(20 * BLOCK_SIZE + 5, salt=7)
    req = Request(
        "r0",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256_cbor),
    )
    keys = [bytes(h) for h in req.block_hashes]
    pool.sync([req], 0, 8192)  # the step's spare ids
    blocks, hit = manager.get_computed_blocks(req)[:2]
    assert hit == 0
    assert manager.allocate_slots(req, req.num_tokens, hit, blocks) is not None
    step = object()  # stands for the step's SchedulerOutput
    pool.end_step(step)  # type: ignore[arg-type]
    # vLLM cached the 20 full blocks at schedule time; no forward pass wrote them yet.
    assert len(pool.unpublished) == 20
    pool.sync([], 1, 8192)
    assert other.lookup(keys).cached == 0  # not visible to another process
    # The request ends with this step (max_tokens=1): vLLM frees its blocks in
    # update_from_output, before the scheduler hears the output arrived.
    manager.free(req)
    pool.written(step)  # type: ignore[arg-type]
    pool.sync([], 0, 8192)  # publishes, then releases: the same batch
    assert other.lookup(keys).cached == 20
    assert not pool.unpublished
    assert set(pool.hold_of) <= set(pool.granted), "cached ids went back to kvd"
    other.close()


def test_async_steps_publish_in_order_of_their_outputs(kvd_daemon: Any) -> None:
    """vLLM's async scheduler schedules step 2 before step 1's output arrives:
    each step's blocks publish after its own output, not the other's."""
    init_none_hash(sha256_cbor)
    manager, pool, other = _manager(kvd_daemon.address, 256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256_cbor)
    reqs = [
        Request(
            f"r{i}",
            prompt_tokens(4 * BLOCK_SIZE + 1, salt=60 + i),
            SamplingParams(),
            None,
            block_hasher=hasher,
        )
        for i in range(2)
    ]
    steps = [object(), object()]
    for req, step in zip(reqs, steps, strict=True):
        pool.sync([req], 1, 8192)
        blocks, hit = manager.get_computed_blocks(req)[:2]
        assert manager.allocate_slots(req, req.num_tokens, hit, blocks) is not None
        pool.end_step(step)  # type: ignore[arg-type]
    keys = [[bytes(h) for h in r.block_hashes] for r in reqs]
    pool.written(steps[0])  # type: ignore[arg-type]
    pool.sync([], 2, 8192)
    assert [other.lookup(k).cached for k in keys] == [4, 0]
    pool.written(steps[1])  # type: ignore[arg-type]
    pool.sync([], 2, 8192)
    assert [other.lookup(k).cached for k in keys] == [4, 4]
    other.close()


@pytest.mark.timeout(900)
def test_processes_at_once_share_prefixes_evict_and_survive_a_sigkill(kvd_daemon: Any) -> None:
    """Two processes over a 160-block pool (prompts need 33 blocks each, 8 distinct
    prefixes): evictions happen, outputs are cold's; a SIGKILLed process's holds go."""
    model = tiny_llama(SPEC)
    head = prompt_tokens(512, salt=40)
    prompts = [head + prompt_tokens(544, salt=41 + i) for i in range(8)]
    mine = {"max_num_seqs": 2}
    small: dict[str, Any] = {"llm_kwargs": mine, "max_model_len": 2048}
    cold = _run(model, prompts, None, 0, **small)
    a = _run(model, prompts, kvd_daemon.address, 160, **small)
    b = _run(model, prompts[::-1], kvd_daemon.address, 160, **small)
    want = [r["output_token_ids"] for r in cold.result()["requests"]]
    got_a = [r["output_token_ids"] for r in a.result()["requests"]]
    got_b = [r["output_token_ids"] for r in b.result()["requests"]]
    assert got_a == want
    assert got_b == want[::-1]
    _, stats = _the_pool(kvd_daemon.address)
    assert stats["prefix"]["evictions"] > 0, stats  # the pool was too small for both

    # D is killed while it holds blocks; E runs on and ends with cold's outputs.
    d = _run(model, prompts * 4, kvd_daemon.address, 160, **small, max_tokens=64)
    e = _run(model, prompts, kvd_daemon.address, 160, **small)
    kill_once_holding(d, lambda: _the_pool(kvd_daemon.address)[1]["holds"])
    assert [r["output_token_ids"] for r in e.result()["requests"]] == want
    after = _wait_no_holds(kvd_daemon.address)
    assert after["holds"] == 0 and after["held_blocks"] == 0, after
    assert after["blocks"]["in_use"] == 0, after
