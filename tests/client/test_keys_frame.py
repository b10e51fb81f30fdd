"""Keys frames: cut into KEY_SIZE-byte keys (any count, trailing zero bytes kept)."""

from __future__ import annotations

import os

import pytest
from kvd_client import wire
from kvd_client.wire.hashing import KeyList
from kvd_client.wire.payloads import decode_keys, keys_from_bytes, keys_to_bytes


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 600])
def test_keys_round_trip(n: int) -> None:
    keys = [os.urandom(31) + b"\0" for _ in range(n)]
    got = keys_from_bytes(keys_to_bytes(keys))
    assert type(got) is KeyList and got == keys
    assert keys_from_bytes(memoryview(keys_to_bytes(keys))) == keys


def test_keys_frame_of_a_bad_length_is_invalid() -> None:
    with pytest.raises(wire.ProtocolError) as err:
        keys_from_bytes(b"x" * 33)
    assert err.value.code == wire.Code.INVALID


def test_a_keys_field_may_slice_a_frame() -> None:
    frame = b"a" * 32 + b"b" * 32 + b"c" * 32
    assert decode_keys([0, 1, 3], [frame], "keys") == [b"b" * 32, b"c" * 32]
    assert decode_keys([0, 2, 2], [frame], "keys") == []


@pytest.mark.parametrize(
    "value",
    [[0, 2, 4], [0, 2, 1], [0, -1, 1], [1, 0, 1], [0, 0], [0, 0, "1"], "0", [0, 0, 1.0]],
)
def test_a_bad_keys_slice_is_invalid(value: object) -> None:
    with pytest.raises(wire.ProtocolError) as err:
        decode_keys(value, [b"k" * 96], "keys")
    assert err.value.code == wire.Code.INVALID


def test_a_keys_slice_of_a_frame_of_a_bad_length_is_invalid() -> None:
    with pytest.raises(wire.ProtocolError) as err:
        decode_keys([0, 0, 1], [b"k" * 33], "keys")
    assert err.value.code == wire.Code.INVALID
