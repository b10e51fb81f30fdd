"""Tier 1 of a cuda pool on a real GPU: pinned host memory, copies both ways.

The test process plays the daemon: `kvd.memory.cuda.CudaAllocation` for the
pool, `kvd.memory.cuda_tier.PinnedHostTier` for its tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gpu_workers import device_bytes
from kvd_client.wire import PoolLayout, round_up

from kvd.memory import cuda
from kvd.memory.cuda_tier import PinnedHostTier
from kvd.memory.tier import tier_layout

pytestmark = pytest.mark.cuda

LAYOUTS = [
    PoolLayout(2, 2, 64, "float16", 16, 64, "layer_major"),
    PoolLayout(2, 2, 64, "float16", 16, 64, "block_major"),
]


@pytest.fixture(params=LAYOUTS, ids=lambda layout: layout.order)
def pool_and_tier(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[cuda.CudaAllocation, PinnedHostTier]]:
    pool = cuda.CudaAllocation.create("tiered", request.param)
    tier = PinnedHostTier.create(pool, 16)
    yield pool, tier
    tier.close()
    pool.close()


def block(pool: cuda.CudaAllocation, b: int) -> Any:
    """The device bytes of block ``b`` of every layer and K/V, concatenated (cupy)."""
    import cupy

    raw = device_bytes(pool.ptr, pool.size, pool.device)
    layout = pool.layout
    parts = [
        raw[layout.offset(layer, kv, b) : layout.offset(layer, kv, b) + layout.slot_bytes]
        for layer in range(layout.num_layers)
        for kv in (0, 1)
    ]
    return cupy.concatenate(parts)


def fill(pool: cuda.CudaAllocation, b: int, value: int) -> None:
    layout = pool.layout
    raw = device_bytes(pool.ptr, pool.size, pool.device)
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            start = layout.offset(layer, kv, b)
            raw[start : start + layout.slot_bytes] = value + layer * 2 + kv


def test_blocks_stored_and_loaded_back_keep_their_bytes(
    pool_and_tier: tuple[cuda.CudaAllocation, PinnedHostTier],
) -> None:
    import cupy

    pool, tier = pool_and_tier
    for b, value in ((3, 10), (4, 20)):
        fill(pool, b, value)
    want = [block(pool, 3).copy(), block(pool, 4).copy()]
    assert tier.store([3, 4], [7, 8], [b"k" * 32, b"l" * 32]) == 2 * tier.block_bytes
    fill(pool, 3, 0)
    fill(pool, 4, 0)
    tier.load([8, 7], [11, 20], [b"l" * 32, b"k" * 32])
    assert bool(cupy.array_equal(block(pool, 11), want[1]))
    assert bool(cupy.array_equal(block(pool, 20), want[0]))


def test_the_tier_is_pinned_host_memory_of_its_own_size(
    pool_and_tier: tuple[cuda.CudaAllocation, PinnedHostTier],
) -> None:
    pool, tier = pool_and_tier
    info = tier.info()
    assert info["kind"] == "pinned" and info["device"] == pool.device
    assert info["size"] == round_up(tier_layout(pool.layout, 16).total_bytes, cuda.CUDA_ALIGN)
