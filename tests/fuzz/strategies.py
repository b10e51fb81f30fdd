"""Hypothesis strategies for hostile frames: random bytes, type confusion, huge counts,
foreign ids, well-formed requests with wild arguments, and byte-mutated valid frames."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
from hypothesis import strategies as st
from kvd_client import wire

from .harness import BS, NUM_BLOCKS, VICTIM_SEQS

KINDS = sorted(wire.REQUESTS)
BATCHABLE = sorted(k for k, cls in wire.REQUESTS.items() if cls.BATCHABLE)
FIELDS = sorted(
    {f.name for cls in wire.REQUESTS.values() for f in cls._fields()} | {"r", "code", "x"}
)
SEQ_IDS = st.sampled_from([*VICTIM_SEQS, "mine", "ghost", "", "x" * 300, "victim\x00"])
#: Integers at every interesting edge: negative, zero, block edges, int64/uint64 limits.
INTS = st.one_of(
    st.integers(-3, 3 * BS + 3),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1]),
    st.sampled_from([-(2**31), -(2**63)]),
    st.integers(-(2**63), 2**64 - 1),
)
#: More tokens than the fuzz pool holds.
NUM_TOKENS_OVER_POOL = NUM_BLOCKS * BS + 1
PIN_IDS = st.one_of(st.sampled_from([1, 2, 3]), INTS)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=24),
    SEQ_IDS,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def token_frame(draw: st.DrawFn) -> bytes:
    """An extra frame: int32 tokens (sometimes negative), or bytes of a bad length."""
    n = draw(st.integers(0, 3 * BS + 4))
    kind = draw(st.sampled_from(["ok", "negative", "odd", "huge"]))
    if kind == "odd":
        return draw(st.binary(min_size=1, max_size=9).filter(lambda b: len(b) % 4))
    if kind == "huge":
        return np.arange(
            draw(st.integers(NUM_TOKENS_OVER_POOL, 4 * NUM_TOKENS_OVER_POOL)), dtype="<i4"
        ).tobytes()
    tokens = np.asarray(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), "<i4")
    if kind == "negative" and n:
        tokens[draw(st.integers(0, n - 1))] = -draw(st.integers(1, 2**31))
    return tokens.tobytes()


random_frames = st.lists(st.binary(max_size=48), min_size=0, max_size=6)


@st.composite
def type_confusion(draw: st.DrawFn) -> list[bytes]:
    """A known or unknown kind with a body of arbitrary fields and values."""
    kind = draw(st.one_of(st.sampled_from(KINDS), st.integers(0, 255)))
    body = draw(
        st.one_of(
            st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
            values,
        )
    )
    extras = [token_frame(draw) for _ in range(draw(st.integers(0, 2)))]
    return [bytes((kind,)), pack(body), *extras]


@st.composite
def wild_requests(draw: st.DrawFn) -> list[bytes]:
    """Well-formed requests whose arguments are wild: foreign ids, huge or negative counts."""
    rid = draw(INTS.filter(lambda v: v >= 0))
    seq = draw(SEQ_IDS)
    n = draw(st.one_of(st.none(), INTS.filter(lambda v: 0 <= v < 2**64)))
    which = draw(
        st.sampled_from(
            [
                "allocate",
                "append",
                "commit",
                "fork",
                "truncate",
                "free",
                "pin",
                "unpin",
                "can_allocate",
                "hello",
                "flush",
                "stats",
                "goodbye",
                "batch",
            ]
        )
    )
    body: dict[str, Any] = {"id": rid}
    extras: list[bytes] = []
    kind = {
        "allocate": wire.Kind.ALLOCATE,
        "append": wire.Kind.APPEND,
        "commit": wire.Kind.COMMIT,
        "fork": wire.Kind.FORK,
        "truncate": wire.Kind.TRUNCATE,
        "free": wire.Kind.FREE,
        "pin": wire.Kind.PIN,
        "unpin": wire.Kind.UNPIN,
        "can_allocate": wire.Kind.CAN_ALLOCATE,
        "hello": wire.Kind.HELLO,
        "flush": wire.Kind.FLUSH,
        "stats": wire.Kind.STATS,
        "goodbye": wire.Kind.GOODBYE,
        "batch": wire.Kind.BATCH,
    }[which]
    if which in ("allocate", "append"):
        body |= {"seq": seq, "tokens": 0}
        extras.append(token_frame(draw))
        if which == "allocate" and n is not None:
            body["reserve"] = n
    elif which in ("commit", "pin"):
        body |= {"seq": seq} | ({} if n is None else {"n": n})
    elif which == "fork":
        body |= {"seq": seq, "child": draw(SEQ_IDS)} | ({} if n is None else {"reserve": n})
    elif which == "truncate":
        body |= {"seq": seq, "n": draw(INTS.filter(lambda v: 0 <= v < 2**64))}
    elif which == "free":
        body |= {"seq": seq}
    elif which == "unpin":
        body |= {"pin": draw(PIN_IDS.filter(lambda v: -(2**63) <= v < 2**64))}
    elif which == "can_allocate":
        body |= {"tokens": draw(INTS.filter(lambda v: -(2**63) <= v < 2**64))}
    elif which == "hello":
        body |= {
            "version": draw(st.sampled_from([wire.PROTOCOL_VERSION, 0, 2])),
            "pool": draw(st.sampled_from(["default", "other", ""])),
            "name": "fuzz",
            "pid": draw(INTS.filter(lambda v: -(2**63) <= v < 2**64)),
            "namespace": draw(st.sampled_from(["", "tenant-b", "x" * 257])),
        }
        if draw(st.booleans()):
            body["layout"] = draw(values)
    elif which == "flush":
        body |= {} if draw(st.booleans()) else {"namespace": draw(st.sampled_from(["", "none"]))}
    elif which == "stats":
        body["sections"] = draw(st.lists(st.sampled_from(["blocks", "rpc", "nope"]), max_size=3))
    elif which == "batch":
        ops = []
        for _ in range(draw(st.integers(0, 6))):
            sub = draw(st.sampled_from([*BATCHABLE, 0x01, 0x1F, 0x99]))
            sub_body: dict[str, Any] = {"id": 0, "seq": draw(SEQ_IDS)}
            if sub in (wire.Kind.ALLOCATE, wire.Kind.APPEND):
                sub_body["tokens"] = draw(st.integers(-1, 2))
            if sub == wire.Kind.UNPIN:
                sub_body = {"id": 0, "pin": draw(st.sampled_from([1, 2, 3, 99]))}
            ops.append(draw(st.sampled_from([[sub, sub_body], [sub], "junk", [sub, sub_body, 1]])))
        body["ops"] = ops
        extras = [token_frame(draw) for _ in range(draw(st.integers(0, 2)))]
    return [bytes((kind,)), pack(body), *extras]


TEMPLATES = [
    wire.AllocateRequest(
        id=1, seq="new", tokens=np.arange(40, dtype=np.int32), reserve=64
    ).encode(),
    wire.AppendRequest(id=2, seq="mine", tokens=np.arange(5, dtype=np.int32)).encode(),
    wire.CommitRequest(id=3, seq="victim", n=3).encode(),
    wire.TruncateRequest(id=4, seq="victim.1", n=1).encode(),
    wire.ForkRequest(id=5, seq="mine", child="kid").encode(),
    wire.UnpinRequest(id=6, pin=1).encode(),
    wire.PinRequest(id=7, seq="mine", n=BS).encode(),
    wire.FreeRequest(id=8, seq="mine").encode(),
    wire.StatsRequest(id=9, sections=["blocks"]).encode(),
    wire.HelloRequest(
        id=10, version=wire.PROTOCOL_VERSION, pool="default", name="m", pid=3
    ).encode(),
    wire.encode_batch(
        11, [wire.FreeRequest(id=0, seq="victim"), wire.CommitRequest(id=0, seq="mine")]
    ),
]


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    """A valid frame set with a few bytes flipped, inserted or deleted, or frames dropped/added."""
    frames = list(draw(st.sampled_from(TEMPLATES)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "insert", "delete", "drop", "dup"]))
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        if action == "drop" and frames:
            frames.pop(i)
            continue
        if action == "dup" and frames:
            frames.insert(i, frames[i])
            continue
        if not frames:
            continue
        body = bytearray(frames[i])
        pos = draw(st.integers(0, len(body)))
        if action == "flip" and pos < len(body):
            body[pos] ^= 1 << draw(st.integers(0, 7))
        elif action == "insert":
            body[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif body:
            del body[min(pos, len(body) - 1)]
        frames[i] = bytes(body)
    return frames


huge = st.one_of(
    st.builds(
        lambda n: [
            bytes((wire.Kind.BATCH,)),
            pack({"id": 1, "ops": [[0x15, {"id": 0, "seq": "x"}]] * n}),
        ],
        st.integers(wire.MAX_BATCH_OPS - 1, wire.MAX_BATCH_OPS + 2),
    ),
    st.builds(
        lambda n: [bytes((wire.Kind.STATS,)), pack({"id": 2, "sections": ["x"] * n})],
        st.integers(1000, 20_000),
    ),
    st.just([bytes((wire.Kind.PING,)), pack({"id": 4})] + [b""] * (wire.MAX_FRAMES - 1)),
    st.just([bytes((wire.Kind.PING,)), pack({"id": 4})] + [b""] * (wire.MAX_FRAMES + 1)),
    st.builds(
        lambda d: [bytes((wire.Kind.PING,)), d],
        st.sampled_from(
            [
                b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 Gi elements
                b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 Gi entries
                b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
                b"\x91" * 5000,  # deep nesting
            ]
        ),
    ),
)


@st.composite
def valid_ops(draw: st.DrawFn) -> list[bytes]:
    """Plausible requests on the attacker's own sequences, so that the state moves between
    the hostile messages (most of these succeed)."""
    seq = draw(st.sampled_from(["mine", "a", "b"]))
    tokens = np.arange(draw(st.integers(0, 2 * BS + 3)), dtype=np.int32) + draw(st.integers(0, 3))
    req = draw(
        st.sampled_from(
            [
                wire.AllocateRequest(
                    id=1, seq=seq, tokens=tokens, reserve=draw(st.sampled_from([None, 48]))
                ),
                wire.AppendRequest(id=2, seq=seq, tokens=tokens[: draw(st.integers(0, 5))]),
                wire.CommitRequest(id=3, seq=seq),
                wire.ForkRequest(id=4, seq=seq, child=draw(st.sampled_from(["a", "b", "c"]))),
                wire.TruncateRequest(id=5, seq=seq, n=draw(st.integers(0, BS + 2))),
                wire.FreeRequest(id=6, seq=seq),
                wire.PinRequest(id=7, seq=seq),
                wire.UnpinRequest(id=8, pin=draw(st.integers(1, 4))),
                wire.CanAllocateRequest(id=9, tokens=draw(st.integers(0, 300))),
            ]
        )
    )
    return req.encode()


#: Every family of hostile message, with plausible ones that move the state in between.
messages = st.one_of(
    valid_ops(), valid_ops(), random_frames, type_confusion(), wild_requests(), mutated(), huge
)
