"""The hand-compiled wire codec vs msgspec Structs, on the requests of the hot path.

Each case encodes a request to its frames and decodes them as the daemon does,
once with `kvd_client.wire` and once with msgspec Structs of the same fields
(msgpack maps, ``array_like=False``, so the bytes are the same format; the
msgspec side checks what the wire checks: field types, int64/uint64 range,
name length, unknown fields, token frames through the same `tokens_from_bytes`).
Figures are ns per message (encode + decode), the wire codec as the anchor:
a ratio below 1 means msgspec is faster.

Run: ``.venv/bin/python -m bench.codec [--n 20000] [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt
from kvd_client import wire

from bench._common import Figure, print_table

Name = Annotated[str, msgspec.Meta(max_length=wire.MAX_NAME_LEN)]
#: msgspec refuses bounds beyond int64 (``le=2**64 - 1``); msgpack itself holds
#: int64/uint64 only, so a plain int checks the same range.
Int = int
#: A token field: the index of its extra frame, or ``[frame, start, stop]`` in a batch.
TokenRef = int | list[int]


class _Base(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    id: Int


class Allocate(_Base):
    seq: Name
    tokens: TokenRef
    reserve: Int | None = None


class Commit(_Base):
    seq: Name
    n: Int | None = None


class Free(_Base):
    seq: Name


class Ping(_Base):
    pass


class Batch(_Base):
    ops: list[tuple[int, msgspec.Raw]]


class BatchOut(_Base):
    """The encoding side of `Batch`: each op encoded in place, not pre-encoded."""

    ops: list[tuple[int, _Base]]


_TYPES: dict[int, type[_Base]] = {
    wire.Kind.ALLOCATE: Allocate,
    wire.Kind.COMMIT: Commit,
    wire.Kind.FREE: Free,
    wire.Kind.PING: Ping,
    wire.Kind.BATCH: Batch,
}
_DECODERS = {k: msgspec.msgpack.Decoder(t) for k, t in _TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()
_KIND = {t: bytes((k,)) for k, t in _TYPES.items()}
_KIND[BatchOut] = _KIND[Batch]


def ms_encode(msg: _Base, extras: list[bytes]) -> list[bytes]:
    """Frames of a msgspec request (token frames already in ``extras``)."""
    return [_KIND[type(msg)], _ENCODER.encode(msg), *extras]


def ms_decode(frames: list[bytes]) -> tuple[_Base, list[npt.NDArray[np.int32]]]:
    """Decode like `wire.decode_request`: the body, then its token frames, checked."""
    kind = frames[0][0]
    try:
        msg = _DECODERS[kind].decode(frames[1])
    except msgspec.ValidationError as exc:
        raise wire.ProtocolError(wire.Code.INVALID, str(exc)) from None
    tokens = [wire.tokens_from_bytes(f) for f in frames[2:]]
    if type(msg) is Batch:
        frame = tokens[0] if tokens else None
        for op_kind, raw in msg.ops:
            op = _DECODERS[op_kind].decode(raw)
            ref = getattr(op, "tokens", None)
            if ref is not None and frame is not None:
                assert isinstance(ref, list)
                frame[ref[1] : ref[2]]  # the op's slice (the frame was checked whole)
    return msg, tokens


def _time(fns: tuple[Callable[[], Any], ...], n: int, rounds: int) -> list[float]:
    """Median ns per call of each of ``fns``, runs of ``n`` calls interleaved.

    Interleaved so that a noisy neighbour on this shared host hits both alike.
    """
    per: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, per, strict=True):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            times.append((time.perf_counter_ns() - t0) / n)
    return [statistics.median(times) for times in per]


def cases() -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Per case: (wire encode+decode, msgspec encode+decode) of the same request."""
    prompt = np.arange(512, dtype=np.int32)
    step = np.arange(16, dtype=np.int32)
    wire_ops: list[wire.Request] = []
    for i in range(32):
        wire_ops.append(wire.AllocateRequest(id=0, seq=f"r{i}", tokens=step))
        wire_ops.append(wire.CommitRequest(id=0, seq=f"r{i}", n=16))

    def wire_batch() -> Any:
        frames = wire.encode_batch(9, wire_ops)
        req = wire.decode_request(frames)
        assert isinstance(req, wire.BatchRequest)
        extras = wire.TokenFrames(frames[2:])
        return [wire.decode_batch_op(op, extras) for op in req.ops]

    def ms_batch() -> Any:
        # The same work as encode_batch: one shared token frame, each op's slice of it.
        ops: list[tuple[int, _Base]] = []
        for i in range(32):
            ops.append(
                (wire.Kind.ALLOCATE, Allocate(id=0, seq=f"r{i}", tokens=[0, 16 * i, 16 * i + 16]))
            )
            ops.append((wire.Kind.COMMIT, Commit(id=0, seq=f"r{i}", n=16)))
        frame = np.concatenate([step] * 32).tobytes()
        return ms_decode(ms_encode(BatchOut(id=9, ops=ops), [frame]))

    return {
        "allocate (512 tokens)": (
            lambda: wire.decode_request(
                wire.AllocateRequest(id=7, seq="req-7", tokens=prompt, reserve=600).encode()
            ),
            lambda: ms_decode(
                ms_encode(Allocate(id=7, seq="req-7", tokens=0, reserve=600), [prompt.tobytes()])
            ),
        ),
        "commit": (
            lambda: wire.decode_request(wire.CommitRequest(id=8, seq="req-7", n=512).encode()),
            lambda: ms_decode(ms_encode(Commit(id=8, seq="req-7", n=512), [])),
        ),
        "free": (
            lambda: wire.decode_request(wire.FreeRequest(id=9, seq="req-7").encode()),
            lambda: ms_decode(ms_encode(Free(id=9, seq="req-7"), [])),
        ),
        "ping": (
            lambda: wire.decode_request(wire.PingRequest(id=10).encode()),
            lambda: ms_decode(ms_encode(Ping(id=10), [])),
        ),
        "batch (64 ops)": (wire_batch, ms_batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="messages per timed run")
    parser.add_argument("--rounds", type=int, default=7, help="timed runs (median)")
    args = parser.parse_args()
    figures = []
    for name, (ours, theirs) in cases().items():
        n = max(1, args.n // 64) if name.startswith("batch") else args.n
        ours(), theirs()  # compile the codecs, warm the caches
        anchor, value = _time((ours, theirs), n, args.rounds)
        figures.append(
            Figure(
                f"msgspec {name}", value, "ns", f"wire {name}", anchor, 1.0, higher_is_better=False
            )
        )
    print_table("encode + decode, ns per message (target: msgspec <= 1.0x the wire codec)", figures)


if __name__ == "__main__":
    main()
