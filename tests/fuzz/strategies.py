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


# -- issue #14: multi-frame messages, msgpack bombs, session floods -----------------------

#: Largest bomb body the CI round builds (the daemon-level tests send 8 and 32 MB).
BOMB_MAX_BYTES = 1 << 20
_CONTAINERS = {
    "array": (b"\x90", b"\xdc"),  # fixarray(0), array16 header
    "map": (b"\x80", b"\xde"),  # fixmap(0), map16 header
}


class Bomb(bytes):
    """Bytes of a bomb with a short repr (a failing example prints its family and size)."""

    family = "bomb"

    def __repr__(self) -> str:
        return f"Bomb({self.family}, {len(self)} B, {bytes(self[:12])!r}...)"


def _bomb(family: str, data: bytes) -> Bomb:
    bomb = Bomb(data)
    bomb.family = family
    return bomb


def _wide(kind: str, item: bytes, n: int) -> bytes:
    """A container of ``n`` (< 65536) copies of ``item`` (``item`` a key/value pair for maps)."""
    return _CONTAINERS[kind][1] + n.to_bytes(2, "big") + item * n


@st.composite
def msgpack_bomb(draw: st.DrawFn, max_bytes: int = BOMB_MAX_BYTES) -> Bomb:
    """A msgpack body, small on the wire, that decodes into many objects or deep nesting.

    Families: deep nesting of one-element arrays/maps; wide containers of empty
    containers (one byte each, ~64 B each decoded); two levels of wide containers (past
    the per-container limits in total); wide containers of distinct short strings or
    floats (objects that are not shared singletons); and claims of huge lengths.
    """
    family = draw(st.sampled_from(["deep", "wide", "nested", "strings", "floats", "claim"]))
    return _bomb(family, _bomb_bytes(draw, family, draw(st.integers(1024, max_bytes))))


def _bomb_bytes(draw: st.DrawFn, family: str, size: int) -> bytes:
    if family == "deep":
        depth = min(size, draw(st.integers(100, 100_000)))
        opener = draw(st.sampled_from([b"\x91", b"\x81\x00"]))  # [x] or {0: x}
        return opener * depth + b"\xc0"
    if family == "wide":
        kind = draw(st.sampled_from(["array", "map"]))
        empty = draw(st.sampled_from([b"\x90", b"\x80"]))
        item = empty if kind == "array" else b"\xa1k" + empty  # maps: one key, many values
        return _wide(kind, item, min(65535, size // len(item)))
    if family == "nested":
        inner_n = draw(st.sampled_from([1024, 4096, 16384]))
        inner = _wide("array", draw(st.sampled_from([b"\x90", b"\x80", b"\xc0"])), inner_n)
        return _wide("array", inner, max(1, min(65535, size // len(inner))))
    if family == "strings":
        n = min(65535, size // 4)
        items = b"".join(b"\xa3" + b"%03x" % (i & 0xFFF) for i in range(n))  # each a new str
        return _CONTAINERS["array"][1] + n.to_bytes(2, "big") + items
    if family == "floats":
        n = min(65535, size // 5)
        return _wide("array", b"\xca\x3f\x80\x00\x01", n)
    return draw(
        st.sampled_from(
            [
                b"\xdd\xff\xff\xff\xff",  # array32 of 4 Gi elements, none sent
                b"\xdf\xff\xff\xff\xff",  # map32 of 4 Gi entries
                b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
                b"\xdd\x00\x01\x00\x00" + b"\x90" * 100,  # 65536 claimed, 100 sent
            ]
        )
    )


@st.composite
def bomb_messages(draw: st.DrawFn, max_bytes: int = BOMB_MAX_BYTES) -> list[bytes]:
    """A request kind (known or not) with a bomb for a body, or a bomb inside a batch."""
    body = draw(msgpack_bomb(max_bytes))
    kind = draw(st.sampled_from([wire.Kind.PING, wire.Kind.HELLO, wire.Kind.BATCH, 0x7E]))
    if draw(st.booleans()):
        return [bytes((kind,)), body]
    # The bomb as a field of an otherwise valid body: {"id": 1, "ops"/"sections": <bomb>}
    field = draw(st.sampled_from(["ops", "sections", "layout", "x"]))
    prefix = b"\x82\xa2id\x01" + pack(field)
    return [bytes((kind,)), _bomb(f"{body.family} in {field!r}", prefix + body)]


@st.composite
def multi_frame(draw: st.DrawFn) -> list[bytes]:
    """A valid request followed by many extra frames, around `wire.MAX_FRAMES`.

    Extra frames are empty, one byte, token-sized, or a few large ones; the total
    stays small enough for the in-process dispatcher.
    """
    base = list(draw(st.sampled_from(TEMPLATES)))
    count = draw(
        st.one_of(
            st.integers(0, 8),
            st.integers(wire.MAX_FRAMES - len(base) - 2, wire.MAX_FRAMES - len(base) + 2),
            st.integers(wire.MAX_FRAMES, 2 * wire.MAX_FRAMES),
        )
    )
    shape = draw(st.sampled_from(["empty", "byte", "tokens", "mixed"]))
    if shape == "empty":
        extras = [b""] * count
    elif shape == "byte":
        extras = [b"\x00"] * count
    elif shape == "tokens":
        extras = [np.arange(draw(st.integers(0, 64)), dtype="<i4").tobytes()] * count
    else:
        extras = [
            draw(st.sampled_from([b"", b"\x01", bytes(4 * BS), bytes(4096)])) for _ in range(count)
        ]
    return base + extras


@st.composite
def session_flood(draw: st.DrawFn, identities: int = 48) -> list[tuple[str, bytes]]:
    """A flood of connections: hellos from many identities (more than any session limit),
    some goodbyes and requests in between, as ``(action, identity)`` pairs."""
    n = draw(st.integers(8, identities))
    ids = [b"flood-%d" % k for k in range(n)]
    ops: list[tuple[str, bytes]] = [("hello", i) for i in ids]
    extra = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["hello", "goodbye", "ping", "allocate"]), st.sampled_from(ids)
            ),
            max_size=3 * n,
        )
    )
    ops += extra
    return draw(st.permutations(ops))


def flood_frames(action: str, identity: bytes) -> list[bytes]:
    """The frames of one `session_flood` action."""
    if action == "hello":
        return wire.HelloRequest(
            id=1,
            version=wire.PROTOCOL_VERSION,
            pool="default",
            name=identity.decode(),
            pid=1,
        ).encode()
    if action == "goodbye":
        return wire.GoodbyeRequest(id=2).encode()
    if action == "allocate":
        return wire.AllocateRequest(id=3, seq="f", tokens=np.arange(BS, dtype=np.int32)).encode()
    return wire.PingRequest(id=4).encode()
