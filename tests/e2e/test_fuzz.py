"""Thousands of malformed frames against a live daemon: an error reply each, no harm done.

Hypothesis generates random frames, known kinds with wrongly typed fields,
huge lists, unknown kinds, negative and foreign ids, requests on another
session's sequence, and byte-mutated valid frames; they come from a
connection with a session and from one without. Every message must get one
reply with a stable code, never INTERNAL; afterwards the daemon serves a well-behaved
client, CHECK passes, and the blocks are exactly as before. FLUSH is the one
admin kind left out (it is allowed to change the cache). ``KVD_FUZZ_EXAMPLES``
raises the number of examples (default 80, 25 to 40 messages each).
"""

from __future__ import annotations

import os
from typing import Any

import msgpack
import numpy as np
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvd_client import wire

BS = 16
VICTIM_PROMPT = list(range(700, 700 + 2 * BS + 3))
CODES = {str(c) for c in wire.Code}
KINDS = sorted(k for k in wire.REQUESTS if k != wire.Kind.FLUSH)
UNKNOWN_KINDS = sorted(set(range(256)) - set(wire.REQUESTS))
FIELDS = [
    "id",
    "seq",
    "tokens",
    "n",
    "child",
    "reserve",
    "pin",
    "ops",
    "sections",
    "namespace",
    "version",
    "pool",
    "name",
    "pid",
    "layout",
    "hash_seed",
    "adapter",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.sampled_from(["victim", "ghost", "", "default", "x" * 300]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def _pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


random_frames = st.lists(st.binary(max_size=40), min_size=1, max_size=5).filter(
    lambda fs: not (fs and fs[0] == bytes((wire.Kind.FLUSH,)))
)
wrong_types = st.builds(
    lambda kind, body: [bytes((kind,)), _pack(body)],
    st.sampled_from(KINDS),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
)
unknown_kind = st.builds(
    lambda kind, rid: [bytes((kind,)), _pack({"id": rid})],
    st.sampled_from(UNKNOWN_KINDS),
    st.integers(min_value=0, max_value=2**32),
)
huge_lists = st.one_of(
    st.builds(
        lambda n, op: [bytes((wire.Kind.BATCH,)), _pack({"id": 1, "ops": [op] * n})],
        st.integers(min_value=wire.MAX_BATCH_OPS + 1, max_value=wire.MAX_BATCH_OPS * 5),
        st.sampled_from([[0x15, {"id": 0, "seq": "ghost"}], "junk", [0x10, {}], []]),
    ),
    st.builds(
        lambda n: [bytes((wire.Kind.STATS,)), _pack({"id": 2, "sections": ["x"] * n})],
        st.integers(min_value=100, max_value=20_000),
    ),
    st.builds(
        # more tokens than the tiny pool holds: refused, nothing allocated
        lambda n: [
            bytes((wire.Kind.ALLOCATE,)),
            _pack({"id": 3, "seq": "huge", "tokens": 0}),
            np.arange(n, dtype="<i4").tobytes(),
        ],
        st.integers(min_value=64 * BS + 1, max_value=300_000),
    ),
    st.just([bytes((wire.Kind.PING,)), _pack({"id": 4})] + [b""] * (wire.MAX_FRAMES + 1)),
)
foreign_ids = st.one_of(
    st.builds(
        lambda seq, rid: wire.FreeRequest(id=rid, seq=seq).encode(),
        st.sampled_from(["victim", "ghost"]),
        st.integers(min_value=0, max_value=2**63),
    ),
    st.builds(
        lambda n: wire.TruncateRequest(id=5, seq="victim", n=n).encode(),
        st.integers(-(2**40), 2**40),
    ),
    st.builds(lambda p: wire.UnpinRequest(id=6, pin=p).encode(), st.integers(-(2**63), 2**63)),
    st.builds(lambda: wire.ForkRequest(id=7, seq="victim", child="mine").encode()),
    st.builds(
        lambda n: wire.CommitRequest(id=8, seq="victim", n=n).encode(), st.integers(-5, 10**9)
    ),
    st.builds(lambda: wire.PinRequest(id=9, seq="victim").encode()),
    st.builds(
        lambda rid: [bytes((wire.Kind.PING,)), _pack({"id": rid})], st.integers(-(2**63), 2**64 - 1)
    ),
)
TEMPLATES = [
    wire.FreeRequest(id=11, seq="victim").encode(),
    wire.CommitRequest(id=12, seq="victim", n=3).encode(),
    wire.TruncateRequest(id=13, seq="victim", n=1).encode(),
    wire.PingRequest(id=14).encode(),
    wire.StatsRequest(id=15, sections=["blocks"]).encode(),
    wire.encode_batch(
        16, [wire.FreeRequest(id=0, seq="victim"), wire.CommitRequest(id=0, seq="victim")]
    ),
]


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    frames = list(draw(st.sampled_from(TEMPLATES)))
    i = draw(st.integers(0, len(frames) - 1))
    body = bytearray(frames[i])
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "insert", "delete"]))
        pos = draw(st.integers(0, len(body)))
        if action == "flip" and pos < len(body):
            body[pos] ^= 1 << draw(st.integers(0, 7))
        elif action == "insert":
            body[pos:pos] = draw(st.binary(min_size=1, max_size=3))
        elif body:
            del body[min(pos, len(body) - 1)]
    frames[i] = bytes(body)
    if frames and frames[0] == bytes((wire.Kind.FLUSH,)):
        frames[0] = bytes((wire.Kind.PING,))
    return frames


#: (frames, must the reply be an error?)
messages = st.one_of(
    random_frames.map(lambda f: (f, len(f) < 2 or len(f[0]) != 1)),
    wrong_types.map(lambda f: (f, False)),
    unknown_kind.map(lambda f: (f, True)),
    huge_lists.map(lambda f: (f, True)),
    foreign_ids.map(lambda f: (f, False)),
    mutated().map(lambda f: (f, False)),
)


def _short(frames: list[bytes]) -> str:
    return f"{len(frames)} frames, first {[f[:24] for f in frames[:3]]}"


def _rpc(sock: zmq.Socket[bytes], frames: list[bytes]) -> Any:
    sock.send_multipart(frames)
    assert sock.poll(10_000), f"no reply to {_short(frames)}"
    return wire.decode_reply(sock.recv_multipart())


def _hello(sock: zmq.Socket[bytes]) -> None:
    hello = wire.HelloRequest(
        id=1, version=wire.PROTOCOL_VERSION, pool="default", name="fuzz", pid=os.getpid()
    )
    assert isinstance(_rpc(sock, hello.encode()), wire.OkReply)


def test_fuzzed_frames_get_error_replies_and_change_nothing(kvd_daemon, spawn_agent) -> None:
    victim = spawn_agent()
    victim.ok("connect", address=kvd_daemon.address)
    victim.ok("allocate", seq="victim", tokens=VICTIM_PROMPT)
    victim.ok("fill", seq="victim", start=0, stop=len(VICTIM_PROMPT), value=5.0)
    victim.ok("commit", seq="victim", n=2 * BS)
    table = victim.ok("table", seq="victim")["table"]
    before = kvd_daemon.stats()["blocks"]

    ctx = zmq.Context.instance()
    with_session = ctx.socket(zmq.DEALER)
    without = ctx.socket(zmq.DEALER)
    for sock in (with_session, without):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(kvd_daemon.address)
    _hello(with_session)
    sent = {"messages": 0, "errors": 0}
    examples = int(os.environ.get("KVD_FUZZ_EXAMPLES", "80"))

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(batch=st.lists(messages, min_size=25, max_size=40), use_session=st.booleans())
    def fuzz(batch: list[tuple[list[bytes], bool]], use_session: bool) -> None:
        sock = with_session if use_session else without
        for frames, must_fail in batch:
            reply = _rpc(sock, frames)
            sent["messages"] += 1
            assert isinstance(reply, wire.OkReply | wire.ErrorReply), _short(frames)
            if isinstance(reply, wire.ErrorReply):
                sent["errors"] += 1
                assert reply.code in CODES, (reply.code, _short(frames))
                assert reply.code != wire.Code.INTERNAL, (reply.msg, _short(frames))
                if reply.code == wire.Code.SESSION_LOST and use_session:
                    _hello(with_session)  # a fuzzed goodbye closed it
            else:
                assert not must_fail, f"accepted: {_short(frames)}"

    try:
        fuzz()
        assert sent["messages"] > 1000
        assert sent["errors"] > sent["messages"] // 2
        _rpc(with_session, wire.GoodbyeRequest(id=99).encode())
    finally:
        with_session.close(0)
        without.close(0)

    # The daemon is unharmed: same blocks, invariants hold, the victim's sequence and
    # bytes are intact, and a well-behaved client still shares the victim's prefix.
    assert kvd_daemon.stats()["blocks"] == before
    assert kvd_daemon.check() == {"ok": True, "problems": []}
    assert victim.ok("table", seq="victim")["table"] == table
    assert set(victim.ok("read", seq="victim", start=0, stop=len(VICTIM_PROMPT))["values"]) == {5.0}
    good = spawn_agent()
    good.ok("connect", address=kvd_daemon.address)
    assert good.ok("allocate", seq="s", tokens=VICTIM_PROMPT)["cached"] == 2 * BS
    assert victim.ok("commit", seq="victim") == {
        "committed": len(VICTIM_PROMPT),
        "cached_blocks": 0,
    }
    victim.ok("free", seq="victim")
