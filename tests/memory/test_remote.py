"""kvd.memory.remote: tier 2's blocks in a real redis-server, checked before they are loaded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from kvd_client.wire import PoolLayout

from kvd.memory.remote import (
    REMOTE_CORRUPT,
    REMOTE_MISSING,
    REMOTE_UNAVAILABLE,
    RedisTier,
    RemoteError,
    decode_block,
    encode_block,
    layout_fingerprint,
)
from kvd.memory.tier import TierStore, block_view, object_name

LAYOUT = PoolLayout(2, 2, 8, "float16", 4, 6, "layer_major")
#: The same model's KV in another order: its bytes sit elsewhere in a block.
OTHER = PoolLayout(2, 2, 8, "float16", 4, 6, "block_major")
NAME = object_name("tenant", b"k" * 32)
#: A redis-server fixture (tests/conftest.RedisServer).
Server = Any


def node(server: Server, layout: PoolLayout = LAYOUT) -> tuple[np.ndarray[Any, Any], RedisTier]:
    """A pool buffer of ``layout`` (its block view) and a remote tier over it."""
    buf = memoryview(bytearray(layout.total_bytes))
    store = RedisTier(layout, buf, server.url, timeout_s=2.0, retry_after_s=30.0)
    return block_view(layout, buf), store


def fill(view: np.ndarray[Any, Any], block: int, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    view[..., block, :] = rng.integers(0, 255, view[..., block, :].shape, dtype=np.uint8)
    return np.asarray(view[..., block, :].copy())


def test_the_store_is_a_tier_store_of_level_2(redis_server: Server) -> None:
    _, store = node(redis_server)
    assert isinstance(store, TierStore) and store.level == 2


def test_a_block_stored_by_one_node_loads_into_another_with_its_bytes(
    redis_server: Server,
) -> None:
    view_a, a = node(redis_server)
    view_b, b = node(redis_server)
    want = fill(view_a, 3, seed=1)
    assert a.store([3], [0], [NAME]) == a.block_bytes
    assert b.load([0], [5], [NAME]) == b.block_bytes
    assert np.array_equal(view_b[..., 5, :], want)


def test_another_node_reads_the_names_stored(redis_server: Server) -> None:
    view_a, a = node(redis_server)
    _, b = node(redis_server)
    fill(view_a, 1, seed=2)
    a.store([1], [0], [NAME])
    assert b.poll() == [NAME]
    assert b.poll() == []


def test_a_corrupted_value_is_refused_and_writes_nothing(redis_server: Server) -> None:
    view_a, a = node(redis_server)
    view_b, b = node(redis_server)
    fill(view_a, 2, seed=3)
    a.store([2], [0], [NAME])
    (name,) = redis_server.client.keys("kvd:*:tenant:*")
    value = bytearray(redis_server.client.get(name))
    value[-1] ^= 0xFF
    redis_server.client.set(name, bytes(value))
    with pytest.raises(RemoteError) as err:
        b.load([0], [4], [NAME])
    assert err.value.code == REMOTE_CORRUPT
    assert not view_b[..., 4, :].any()
    assert b.info()["store_errors"] == {REMOTE_CORRUPT: 1}


def test_a_pool_of_another_layout_never_reads_the_block(redis_server: Server) -> None:
    view_a, a = node(redis_server)
    _, other = node(redis_server, OTHER)
    fill(view_a, 2, seed=4)
    a.store([2], [0], [NAME])
    with pytest.raises(RemoteError) as err:
        other.load([0], [1], [NAME])
    assert err.value.code == REMOTE_MISSING


def test_another_namespace_never_reads_the_block(redis_server: Server) -> None:
    view_a, a = node(redis_server)
    _, b = node(redis_server)
    fill(view_a, 2, seed=5)
    a.store([2], [0], [NAME])
    with pytest.raises(RemoteError) as err:
        b.load([0], [1], [object_name("other", b"k" * 32)])
    assert err.value.code == REMOTE_MISSING


def test_a_killed_store_fails_every_call_with_a_counted_code(redis_server: Server) -> None:
    view, store = node(redis_server)
    fill(view, 1, seed=6)
    redis_server.kill()
    for call in (
        lambda: store.store([1], [0], [NAME]),
        lambda: store.load([0], [2], [NAME]),
        store.poll,
    ):
        with pytest.raises(RemoteError) as err:
            call()
        assert err.value.code == REMOTE_UNAVAILABLE
    assert store.info()["store_errors"] == {REMOTE_UNAVAILABLE: 3}
    assert not view[..., 2, :].any()


@pytest.mark.parametrize(
    ("fingerprint", "key", "size"),
    [
        (layout_fingerprint(OTHER), b"k" * 32, 8),
        (layout_fingerprint(LAYOUT), b"j" * 32, 8),
        (layout_fingerprint(LAYOUT), b"k" * 32, 9),
    ],
    ids=["layout", "key", "length"],
)
def test_a_value_of_another_layout_key_or_length_is_refused(
    fingerprint: bytes, key: bytes, size: int
) -> None:
    value = encode_block(layout_fingerprint(LAYOUT), b"k" * 32, b"x" * 8)
    with pytest.raises(RemoteError) as err:
        decode_block(fingerprint, key, size, value)
    assert err.value.code == REMOTE_CORRUPT


def test_a_value_decodes_to_its_payload() -> None:
    fp = layout_fingerprint(LAYOUT)
    assert bytes(decode_block(fp, b"k" * 32, 8, encode_block(fp, b"k" * 32, b"payload!"))) == (
        b"payload!"
    )
