"""The decoder's total budget per body (issue #14 finding 3): bombs refused, big batches not."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from kvd_client import wire
from kvd_client.wire.frames import MAX_DECODED_OBJECTS

MIB = 1 << 20


def nested_empty_arrays(nbytes: int) -> bytes:
    inner = b"\xdc\x40\x00" + b"\x90" * 16384  # array16 of 16384 empty arrays
    n = max(1, nbytes // len(inner))
    return b"\xdc" + n.to_bytes(2, "big") + inner * n


@pytest.mark.parametrize("megabytes", [1, 8])
def test_a_body_past_the_object_budget_is_too_large_and_stops_early(megabytes: int) -> None:
    frames = [bytes((wire.Kind.PING,)), nested_empty_arrays(megabytes * MIB)]
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(wire.ProtocolError) as info:
            wire.decode_request(frames)
        took = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code == wire.Code.TOO_LARGE
    assert peak < 24 * MIB, peak  # the budget's objects, not the body's 2 Gi lists
    assert took < 2.0  # under tracemalloc; ~30 ms without


def test_a_batch_of_the_most_operations_decodes_within_the_budget() -> None:
    ops = [
        wire.AllocateRequest(id=0, seq=f"seq-{i:06d}", tokens=list(range(16)), reserve=64)
        for i in range(wire.MAX_BATCH_OPS)
    ]
    frames = wire.encode_batch(9, ops)
    assert len(frames[1]) > MAX_DECODED_OBJECTS // 2  # past the uncounted size: hooks ran
    req = wire.decode_request(frames)
    assert isinstance(req, wire.BatchRequest)
    assert len(req.ops) == wire.MAX_BATCH_OPS


def test_a_wide_flat_body_counts_its_elements() -> None:
    # 20 arrays of 16384 small ints (each within the per-container limit): 327,700 objects.
    inner = b"\xdc\x40\x00" + b"\x01" * 16384
    body = b"\x82\xa2id\x01\xa1x\xdc\x00\x14" + inner * 20
    with pytest.raises(wire.ProtocolError) as info:
        wire.decode_request([bytes((wire.Kind.PING,)), body])
    assert info.value.code == wire.Code.TOO_LARGE
    assert info.value.req_id is None  # the id cannot be read from a body that was refused
