"""kvd.memory.tier: tier 1's segment and the block copies between it and a pool."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from kvd_client.wire import PoolLayout

from kvd.memory.shm import ShmSegment, segment_path
from kvd.memory.tier import HostTier, TierStore, block_view, tier_layout

ORDERS = [
    PoolLayout(2, 2, 8, "float16", 4, 6, "layer_major"),
    PoolLayout(2, 2, 8, "float16", 4, 6, "block_major"),
    PoolLayout(2, 2, 8, "float16", 4, 6, "paged", "engine/x"),
]


@pytest.fixture(params=ORDERS, ids=lambda layout: layout.order)
def pool_and_tier(request: pytest.FixtureRequest) -> Iterator[tuple[ShmSegment, HostTier]]:
    layout: PoolLayout = request.param
    instance = f"t{uuid.uuid4().hex[:8]}"
    pool = ShmSegment.create("p", layout, instance=instance, prefault=False)
    tier = HostTier.create("p", layout, pool.buffer(), 3, instance=instance, prefault=False)
    yield pool, tier
    tier.close()
    pool.close()


def test_a_block_view_covers_each_block_and_nothing_else() -> None:
    for layout in ORDERS:
        buf = memoryview(bytearray(layout.total_bytes))
        view = block_view(layout, buf)
        view[..., 2, :] = 1
        raw = np.frombuffer(buf, dtype=np.uint8)
        assert int(raw.sum()) == layout.num_layers * layout.page_bytes


def test_a_block_stored_and_loaded_back_keeps_its_bytes(
    pool_and_tier: tuple[ShmSegment, HostTier],
) -> None:
    pool, tier = pool_and_tier
    view = block_view(pool.layout, pool.buffer())
    rng = np.random.default_rng(1)
    view[..., 4, :] = rng.integers(0, 255, view[..., 4, :].shape, dtype=np.uint8)
    want = view[..., 4, :].copy()
    assert tier.store([4], [2], [b"k" * 32]) == tier.block_bytes
    view[..., 4, :] = 0
    tier.load([2], [1], [b"k" * 32])
    assert np.array_equal(view[..., 1, :], want)
    assert not view[..., 4, :].any()


def test_the_tier_is_a_segment_of_its_own(pool_and_tier: tuple[ShmSegment, HostTier]) -> None:
    pool, tier = pool_and_tier
    info = tier.info()
    assert info["kind"] == "host"
    assert info["path"].endswith("-p@tier1") and info["path"] != str(pool.path)
    assert info["size"] == tier_layout(pool.layout, 3).total_bytes
    assert isinstance(tier, TierStore)


def test_closing_the_tier_unlinks_its_file() -> None:
    layout = ORDERS[0]
    instance = f"t{uuid.uuid4().hex[:8]}"
    pool = ShmSegment.create("p", layout, instance=instance, prefault=False)
    tier = HostTier.create("p", layout, pool.buffer(), 3, instance=instance, prefault=False)
    tier.close()
    assert not segment_path("/dev/shm", instance, "p@tier1").exists()
    pool.close()
