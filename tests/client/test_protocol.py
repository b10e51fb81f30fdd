"""The wire contract: framing, typed decoding, limits and error codes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from kvd_client import wire


def _frames(kind: int, body: object, *extras: bytes) -> list[bytes]:
    return [bytes((kind,)), msgpack.packb(body, use_bin_type=True), *extras]


def _code(frames: list[bytes]) -> wire.Code:
    with pytest.raises(wire.ProtocolError) as info:
        wire.decode_request(frames)
    return info.value.code


def test_request_round_trips_with_tokens_as_an_extra_frame() -> None:
    tokens = np.arange(40, dtype=np.int32)
    frames = wire.AllocateRequest(id=3, seq="req-7", tokens=tokens, reserve=100).encode()
    assert frames[0] == bytes((wire.Kind.ALLOCATE,))
    assert frames[2] == tokens.astype("<i4").tobytes()
    decoded = wire.decode_request(frames)
    assert isinstance(decoded, wire.AllocateRequest)
    assert (decoded.id, decoded.seq, decoded.reserve) == (3, "req-7", 100)
    assert decoded.tokens.tolist() == list(range(40))


def test_optional_fields_take_their_defaults() -> None:
    decoded = wire.decode_request(_frames(wire.Kind.COMMIT, {"id": 1, "seq": "a"}))
    assert decoded == wire.CommitRequest(id=1, seq="a", n=None)


def test_explicit_nil_counts_as_omitted() -> None:
    decoded = wire.decode_request(_frames(wire.Kind.COMMIT, {"id": 1, "seq": "a", "n": None}))
    assert decoded == wire.CommitRequest(id=1, seq="a", n=None)


def test_every_request_kind_round_trips() -> None:
    samples: list[wire.Request] = [
        wire.HelloRequest(id=1, version=1, pool="default", name="x", pid=2, namespace="t"),
        wire.HeartbeatRequest(id=1),
        wire.GoodbyeRequest(id=1),
        wire.CommitRequest(id=1, seq="a", n=3),
        wire.ForkRequest(id=1, seq="a", child="b", reserve=9),
        wire.TruncateRequest(id=1, seq="a", n=0),
        wire.FreeRequest(id=1, seq="a"),
        wire.PinRequest(id=1, seq="a"),
        wire.UnpinRequest(id=1, pin=4),
        wire.CanAllocateRequest(id=1, tokens=10),
        wire.LookupRequest(id=1, keys=[b"k" * 32, b"l" * 32], hold=True),
        wire.GrantRequest(id=1, n=3),
        wire.ReleaseRequest(id=1, hold=5),
        wire.StatsRequest(id=1, sections=["server"]),
        wire.CheckRequest(id=1),
        wire.FlushRequest(id=1, namespace="t"),
        wire.ClientsRequest(id=1),
        wire.PoolsRequest(id=1),
        wire.PingRequest(id=1),
    ]
    for msg in samples:
        assert wire.decode_request(msg.encode()) == msg
    assert {type(m).KIND for m in samples} | {
        wire.Kind.ALLOCATE,
        wire.Kind.APPEND,
        wire.Kind.PUBLISH,
        wire.Kind.BATCH,
    } == set(wire.REQUESTS)


def test_keys_travel_as_one_extra_frame_of_concatenated_keys() -> None:
    keys = [bytes([i]) * 32 for i in range(3)]
    frames = wire.LookupRequest(id=1, keys=keys).encode()
    assert frames[2] == b"".join(keys)
    assert msgpack.unpackb(frames[1]) == {"id": 1, "keys": 0}
    assert wire.decode_request(frames).keys == keys


def test_publish_carries_keys_and_tokens_as_separate_frames() -> None:
    keys = [b"a" * 32, b"b" * 32]
    req = wire.PublishRequest(
        id=1,
        hold=9,
        blocks=np.array([3, 4], dtype="<i4"),
        keys=keys,
        tokens=np.arange(32, dtype="<i4"),
        parent=b"p" * 32,
    )
    got = wire.decode_request(req.encode())
    assert isinstance(got, wire.PublishRequest)
    assert (got.hold, got.blocks.tolist(), got.keys, got.parent) == (9, [3, 4], keys, b"p" * 32)
    assert got.tokens.tolist() == list(range(32))


def test_keys_of_a_partial_key_are_invalid() -> None:
    assert _code(_frames(wire.Kind.LOOKUP, {"id": 1, "keys": 0}, b"x" * 33)) == wire.Code.INVALID


def test_a_keys_field_must_name_an_extra_frame() -> None:
    assert _code(_frames(wire.Kind.LOOKUP, {"id": 1, "keys": 1}, b"x" * 32)) == wire.Code.INVALID
    assert _code(_frames(wire.Kind.LOOKUP, {"id": 1, "keys": b"x" * 32})) == wire.Code.INVALID


def test_more_keys_than_one_frame_may_hold_are_too_large() -> None:
    frame = bytes(32 * (wire.MAX_KEYS + 1))
    assert _code(_frames(wire.Kind.LOOKUP, {"id": 1, "keys": 0}, frame)) == wire.Code.TOO_LARGE


def test_a_batchs_keys_share_one_frame_after_the_token_frame() -> None:
    a, b = [b"a" * 32], [b"b" * 32, b"c" * 32]
    ops = [
        wire.LookupRequest(id=0, keys=a),
        wire.AllocateRequest(id=0, seq="a", tokens=np.arange(32, dtype="<i4"), keys=b),
    ]
    frames = wire.encode_batch(7, ops)
    assert frames[2:] == [np.arange(32, dtype="<i4").tobytes(), b"a" * 32 + b"b" * 32 + b"c" * 32]
    batch = wire.decode_request(frames)
    extras = wire.TokenFrames(frames[2:])
    got = [wire.decode_batch_op(op, extras) for op in batch.ops]  # type: ignore[attr-defined]
    assert got[0].keys == a and got[1].keys == b
    assert got[1].tokens.tolist() == list(range(32))


def test_a_batch_of_keys_without_tokens_sends_an_empty_token_frame() -> None:
    frames = wire.encode_batch(7, [wire.LookupRequest(id=0, keys=[b"k" * 32])])
    assert frames[2:] == [b"", b"k" * 32]


def test_unknown_kind_is_refused_with_the_request_id() -> None:
    with pytest.raises(wire.ProtocolError) as info:
        wire.decode_request(_frames(0x7E, {"id": 42}))
    assert info.value.code == wire.Code.UNKNOWN_KIND
    assert info.value.req_id == 42


def test_reply_kinds_are_not_requests() -> None:
    assert _code(_frames(wire.Kind.OK, {"id": 1, "r": {}})) == wire.Code.UNKNOWN_KIND


def test_garbage_body_is_invalid() -> None:
    assert _code([bytes((wire.Kind.PING,)), b"\xc1\xff\x00"]) == wire.Code.INVALID


def test_trailing_bytes_after_the_body_are_invalid() -> None:
    body = msgpack.packb({"id": 1}) + b"\x00"
    assert _code([bytes((wire.Kind.PING,)), body]) == wire.Code.INVALID


def test_body_must_be_a_map() -> None:
    assert _code(_frames(wire.Kind.PING, [1, 2])) == wire.Code.INVALID


def test_kind_frame_must_be_one_byte() -> None:
    assert _code([b"\x25\x00", msgpack.packb({"id": 1})]) == wire.Code.INVALID


def test_a_single_frame_is_invalid() -> None:
    assert _code([bytes((wire.Kind.PING,))]) == wire.Code.INVALID


def test_missing_required_field_is_invalid() -> None:
    assert _code(_frames(wire.Kind.FREE, {"id": 1})) == wire.Code.INVALID


def test_unknown_field_is_invalid() -> None:
    assert _code(_frames(wire.Kind.FREE, {"id": 1, "seq": "a", "evil": 1})) == wire.Code.INVALID


@pytest.mark.parametrize("value", [True, 1.5, "3", b"3", [3], {"n": 3}])
def test_integer_fields_reject_other_types(value: object) -> None:
    assert (
        _code(_frames(wire.Kind.TRUNCATE, {"id": 1, "seq": "a", "n": value})) == wire.Code.INVALID
    )


def test_the_full_unsigned_64_bit_range_decodes() -> None:
    # Range checks of ids are the handlers' job; the decoder only bounds to 64 bits.
    body = b"\x82\xa2id\x01\xa3pin\xcf" + b"\xff" * 8
    decoded = wire.decode_request([bytes((wire.Kind.UNPIN,)), body])
    assert isinstance(decoded, wire.UnpinRequest)
    assert decoded.pin == 2**64 - 1


def test_string_fields_are_bounded() -> None:
    long_id = "x" * (wire.MAX_NAME_LEN + 1)
    assert _code(_frames(wire.Kind.FREE, {"id": 1, "seq": long_id})) == wire.Code.TOO_LARGE


def test_token_field_must_name_an_existing_frame() -> None:
    body = {"id": 1, "seq": "a", "tokens": 1}
    assert _code(_frames(wire.Kind.APPEND, body, b"\x00" * 4)) == wire.Code.INVALID


def test_token_frame_must_hold_whole_int32s() -> None:
    body = {"id": 1, "seq": "a", "tokens": 0}
    assert _code(_frames(wire.Kind.APPEND, body, b"\x00" * 5)) == wire.Code.INVALID


def test_negative_token_ids_are_invalid() -> None:
    body = {"id": 1, "seq": "a", "tokens": 0}
    frame = np.array([1, -1], dtype="<i4").tobytes()
    assert _code(_frames(wire.Kind.APPEND, body, frame)) == wire.Code.INVALID


def test_too_many_frames_is_too_large() -> None:
    frames = _frames(wire.Kind.PING, {"id": 1}, *([b""] * wire.MAX_FRAMES))
    assert _code(frames) == wire.Code.TOO_LARGE


def test_tokens_to_bytes_rejects_floats_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="integers"):
        wire.tokens_to_bytes(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="2\\*\\*31"):
        wire.tokens_to_bytes([2**31])


def test_batch_carries_ops_and_one_shared_token_frame() -> None:
    ops = [
        wire.FreeRequest(id=0, seq="x"),
        wire.AppendRequest(id=0, seq="y", tokens=np.arange(3, dtype=np.int32)),
        wire.AppendRequest(id=0, seq="z", tokens=np.arange(5, dtype=np.int32)),
    ]
    frames = wire.encode_batch(9, ops)
    assert len(frames) == 3
    batch = wire.decode_request(frames)
    assert isinstance(batch, wire.BatchRequest)
    extras = wire.TokenFrames(frames[2:])
    decoded = [wire.decode_batch_op(op, extras) for op in batch.ops]
    assert [type(d) for d in decoded] == [wire.FreeRequest, wire.AppendRequest, wire.AppendRequest]
    assert isinstance(decoded[2], wire.AppendRequest)
    assert decoded[2].tokens.tolist() == [0, 1, 2, 3, 4]
    assert batch.ops[2][1]["tokens"] == [0, 3, 8]


def test_batch_without_tokens_has_no_extra_frame() -> None:
    assert len(wire.encode_batch(1, [wire.FreeRequest(id=0, seq="x")])) == 2


def test_token_slice_decodes_from_a_plain_frame_list() -> None:
    frame = np.arange(6, dtype="<i4").tobytes()
    op = [int(wire.Kind.APPEND), {"id": 0, "seq": "a", "tokens": [0, 2, 4]}]
    decoded = wire.decode_batch_op(op, [frame])
    assert isinstance(decoded, wire.AppendRequest)
    assert decoded.tokens.tolist() == [2, 3]


@pytest.mark.parametrize("value", [[0, 3, 2], [0, 0, 7], [1, 0, 1], [0, -1, 2], [0, 1], "0"])
def test_token_slice_must_lie_in_an_existing_frame(value: object) -> None:
    body = {"id": 1, "seq": "a", "tokens": value}
    frame = np.arange(6, dtype="<i4").tobytes()
    assert _code(_frames(wire.Kind.APPEND, body, frame)) == wire.Code.INVALID


def test_a_negative_token_fails_only_the_slice_holding_it() -> None:
    extras = wire.TokenFrames([np.array([1, 2, -3, 4], dtype="<i4").tobytes()])
    ok = [int(wire.Kind.APPEND), {"id": 0, "seq": "a", "tokens": [0, 0, 2]}]
    bad = [int(wire.Kind.APPEND), {"id": 0, "seq": "a", "tokens": [0, 2, 4]}]
    assert wire.decode_batch_op(ok, extras).tokens.tolist() == [1, 2]  # type: ignore[attr-defined]
    with pytest.raises(wire.ProtocolError) as info:
        wire.decode_batch_op(bad, extras)
    assert info.value.code == wire.Code.INVALID


def test_batch_refuses_negative_tokens_when_encoding() -> None:
    with pytest.raises(ValueError, match="2\\*\\*31"):
        wire.encode_batch(
            1, [wire.AppendRequest(id=0, seq="a", tokens=np.array([-1], dtype=np.int32))]
        )


def test_batch_refuses_unbatchable_ops() -> None:
    with pytest.raises(ValueError, match="cannot be batched"):
        wire.encode_batch(1, [wire.StatsRequest(id=0)])
    with pytest.raises(wire.ProtocolError) as info:
        wire.decode_batch_op([int(wire.Kind.HELLO), {"id": 0}], [])
    assert info.value.code == wire.Code.INVALID


def test_batch_op_must_be_a_pair() -> None:
    with pytest.raises(wire.ProtocolError) as info:
        wire.decode_batch_op({"kind": 1}, [])
    assert info.value.code == wire.Code.INVALID


def test_ok_reply_round_trips_a_typed_result() -> None:
    result = wire.AllocateResult(table=np.array([4, 5, 6], dtype=np.int32), cached=16, reserved=2)
    reply = wire.decode_reply(wire.encode_ok(7, result))
    assert isinstance(reply, wire.OkReply)
    assert reply.id == 7
    decoded = wire.AllocateResult.from_map(reply.result, reply.extras)
    assert decoded.table.tolist() == [4, 5, 6]
    assert (decoded.cached, decoded.reserved) == (16, 2)


def test_error_reply_carries_code_and_message() -> None:
    reply = wire.decode_reply(wire.encode_error(5, wire.Code.OUT_OF_BLOCKS, "no room"))
    assert reply == wire.ErrorReply(5, "OUT_OF_BLOCKS", "no room")


def test_notice_round_trips() -> None:
    reply = wire.decode_reply(wire.encode_notice("pressure", {"usage": 0.9}))
    assert reply == wire.Notice("pressure", {"usage": 0.9})


def test_every_result_type_is_declared_for_every_request_kind() -> None:
    assert set(wire.RESULTS) == set(wire.REQUESTS)


def test_codes_are_their_own_names() -> None:
    assert all(code.value == code.name for code in wire.Code)
