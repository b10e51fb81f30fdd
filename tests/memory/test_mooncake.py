"""kvd.memory.mooncake: tier 2's blocks in a real Mooncake Store, found through the nodes' logs."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from kvd_client.wire import PoolLayout

from kvd.memory.mooncake import MooncakeTier, parse_url
from kvd.memory.remote import (
    REMOTE_CORRUPT,
    REMOTE_MISSING,
    REMOTE_UNAVAILABLE,
    RemoteError,
    encode_block,
)
from kvd.memory.tier import TierStore, block_view, object_name

LAYOUT = PoolLayout(2, 2, 8, "float16", 4, 6, "layer_major")
OTHER = PoolLayout(2, 2, 8, "float16", 4, 6, "block_major")
#: A mooncake_master fixture (tests/conftest.MooncakeMaster).
Master = Any


def name(i: int, namespace: str = "tenant") -> bytes:
    return object_name(namespace, bytes([i]) * 32)


def node(master: Master, layout: PoolLayout = LAYOUT) -> tuple[np.ndarray[Any, Any], MooncakeTier]:
    """A pool buffer of ``layout`` (its block view) and a Mooncake tier over it."""
    buf = memoryview(bytearray(layout.total_bytes))
    return block_view(layout, buf), MooncakeTier(layout, buf, master.url, retry_after_s=30.0)


def fill(view: np.ndarray[Any, Any], block: int, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    view[..., block, :] = rng.integers(0, 255, view[..., block, :].shape, dtype=np.uint8)
    return np.asarray(view[..., block, :].copy())


def test_the_store_is_a_tier_store_of_level_2(mooncake_master: Master) -> None:
    _, store = node(mooncake_master)
    assert isinstance(store, TierStore) and store.level == 2
    store.close()


def test_a_block_stored_by_one_node_loads_into_another_with_its_bytes(
    mooncake_master: Master,
) -> None:
    (view_a, a), (view_b, b) = node(mooncake_master), node(mooncake_master)
    want = fill(view_a, 3, seed=1)
    assert a.store([3], [0], [name(1)]) == a.block_bytes
    assert b.load([0], [5], [name(1)]) == b.block_bytes
    assert np.array_equal(view_b[..., 5, :], want)
    a.close()
    b.close()


def test_another_node_finds_the_names_through_the_logs(mooncake_master: Master) -> None:
    (view_a, a), (_, b) = node(mooncake_master), node(mooncake_master)
    fill(view_a, 0, seed=2)
    a.store([0, 1], [0, 1], [name(1), name(2)])
    a.store([2], [2], [name(3)])
    assert b.poll() == [name(1), name(2), name(3)]
    assert b.poll() == []  # read once
    a.store([3], [3], [name(4)])
    assert b.poll() == [name(4)]
    assert a.poll() == []  # a node's own log is not its news
    a.close()
    b.close()


def test_names_of_another_layout_are_never_seen(mooncake_master: Master) -> None:
    (_, a), (_, other) = node(mooncake_master), node(mooncake_master, OTHER)
    a.store([0], [0], [name(1)])
    assert other.poll() == []
    with pytest.raises(RemoteError) as err:
        other.load([0], [0], [name(1)])
    assert err.value.code == REMOTE_MISSING
    a.close()
    other.close()


def test_a_corrupt_value_is_refused_and_writes_nothing(mooncake_master: Master) -> None:
    (view_a, a), (view_b, b) = node(mooncake_master), node(mooncake_master)
    fill(view_a, 0, seed=3)
    a.store([0], [0], [name(1)])
    # Another writer's value under block 2's name: a block of the wrong key.
    bad = encode_block(a.fingerprint, b"\x09" * 32, bytes(a.block_bytes))
    a._put([a._name(name(2))], [bad])
    before = view_b.copy()
    with pytest.raises(RemoteError) as err:
        b.load([0, 0], [1, 2], [name(1), name(2)])
    assert err.value.code == REMOTE_CORRUPT
    assert np.array_equal(view_b, before)  # not even the good block
    assert b.info()["store_errors"] == {REMOTE_CORRUPT: 1}
    a.close()
    b.close()


def test_a_dead_master_fails_fast_and_opens_the_breaker(mooncake_master: Master) -> None:
    (view_a, a), (_, b) = node(mooncake_master), node(mooncake_master)
    fill(view_a, 0, seed=4)
    a.store([0], [0], [name(1)])
    b.poll()
    mooncake_master.kill()
    started = time.monotonic()
    with pytest.raises(RemoteError) as err:
        a.store([0], [0], [name(2)])
    assert err.value.code == REMOTE_UNAVAILABLE
    with pytest.raises(RemoteError) as err:  # the breaker: no call at all
        a.store([0], [0], [name(3)])
    assert err.value.code == REMOTE_UNAVAILABLE
    with pytest.raises(RemoteError) as err:  # the store lost its metadata: a miss
        b.load([0], [1], [name(1)])
    assert err.value.code in (REMOTE_MISSING, REMOTE_UNAVAILABLE)
    assert time.monotonic() - started < 15  # bounded by Mooncake's RPC timeout, never a hang
    a.close()
    b.close()


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379",
        "mooncake://127.0.0.1",
        "mooncake://127.0.0.1:1?segment_mb=x",
        "mooncake://127.0.0.1:1?segment_mb=0",
        "mooncake://127.0.0.1:1?protocol=rdma",
    ],
)
def test_a_malformed_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_url(url)


def test_the_url_names_master_metadata_and_sizes() -> None:
    where = parse_url("mooncake://10.0.0.5:50051?segment_mb=512&hostname=10.0.0.7")
    assert where.master == "10.0.0.5:50051"
    assert where.metadata == "http://10.0.0.5:8080/metadata"
    assert where.segment_bytes == 512 << 20 and where.hostname == "10.0.0.7"
