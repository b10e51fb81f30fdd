"""The wire decoders on hostile bytes: a request or a ProtocolError with a known code, nothing else.

Covers `decode_request` (the daemon's entry), `decode_batch_op` (batch
entries) and `decode_reply` (what a client does with a daemon's frames).
A request that decodes must encode back to frames that decode to the same
request. ``KVD_FUZZ_EXAMPLES`` raises the number of examples (default 600).
"""

from __future__ import annotations

import os
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvd_client import wire

from .strategies import messages, values

EXAMPLES = int(os.environ.get("KVD_FUZZ_EXAMPLES", "600"))
CODES = frozenset(wire.Code)
fuzz_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def _as_map(req: wire.Request) -> tuple[int, dict[str, Any], list[bytes]]:
    extras: list[bytes] = []
    return req.KIND, req.to_map(extras), extras


@fuzz_settings
@given(frames=messages)
def test_decode_request_answers_a_request_or_a_protocol_error(frames: list[bytes]) -> None:
    try:
        req = wire.decode_request(frames)
    except wire.ProtocolError as exc:
        assert exc.code in CODES
        assert exc.req_id is None or 0 <= exc.req_id < 2**64
        return
    assert type(req) is wire.REQUESTS[frames[0][0]]
    assert _as_map(wire.decode_request(req.encode())) == _as_map(req)


@fuzz_settings
@given(op=values, extras=st.lists(st.binary(max_size=16), max_size=2))
def test_decode_batch_op_answers_a_batchable_request_or_a_protocol_error(
    op: Any, extras: list[bytes]
) -> None:
    try:
        req = wire.decode_batch_op(op, extras)
    except wire.ProtocolError as exc:
        assert exc.code in CODES
        return
    assert req.BATCHABLE


@fuzz_settings
@given(
    frames=st.one_of(
        st.lists(st.binary(max_size=40), max_size=4),
        st.builds(
            lambda kind, body: [bytes((kind,)), msgpack.packb(body, use_bin_type=True)],
            st.sampled_from([wire.Kind.OK, wire.Kind.ERROR, wire.Kind.NOTICE, 0x00, 0xFF]),
            values,
        ),
    )
)
def test_decode_reply_answers_a_reply_or_a_protocol_error(frames: list[bytes]) -> None:
    try:
        reply = wire.decode_reply(frames)
    except wire.ProtocolError as exc:
        assert exc.code in CODES
        return
    assert isinstance(reply, wire.OkReply | wire.ErrorReply | wire.Notice)
