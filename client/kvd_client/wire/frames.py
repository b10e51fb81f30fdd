"""Whole messages as frames: replies, notices, and the request/reply decoders.

The daemon decodes with `decode_request` (and `decode_batch_op` for the
operations of a batch) and answers with `encode_ok`/`encode_error`; clients
encode with `Request.encode`/`encode_batch` and decode with `decode_reply`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from kvd_client.wire.codec import ENCODERS, compile_encoder
from kvd_client.wire.codes import (
    MAX_BATCH_OPS,
    MAX_FRAMES,
    MAX_MESSAGE_BYTES,
    UINT64_MAX,
    Code,
    Kind,
    ProtocolError,
)
from kvd_client.wire.messages import REQUESTS, Request, Result
from kvd_client.wire.payloads import SharedKeys, SharedTokens, pack

__all__ = [
    "ErrorReply",
    "Notice",
    "OkReply",
    "decode_batch_op",
    "decode_reply",
    "decode_request",
    "encode_batch",
    "encode_error",
    "encode_notice",
    "encode_ok",
]


@dataclass(slots=True)
class OkReply:
    """A decoded OK reply: the raw result map (decode with ``RESULTS[kind]``)."""

    id: int
    result: dict[str, Any]
    extras: Sequence[bytes] = ()


@dataclass(slots=True)
class ErrorReply:
    """A decoded error reply."""

    id: int | None
    code: str
    msg: str


@dataclass(slots=True)
class Notice:
    """A daemon push (``event`` e.g. ``"pressure"``) with free-form data."""

    event: str
    data: dict[str, Any]


_OK: Final = int(Kind.OK)
_ERROR: Final = int(Kind.ERROR)
_KIND_OK: Final = bytes((Kind.OK,))
_KIND_ERROR: Final = bytes((Kind.ERROR,))
_KIND_BATCH: Final = bytes((Kind.BATCH,))


def encode_ok(req_id: int, result: Result | dict[str, Any]) -> list[bytes]:
    """Frames of an OK reply."""
    if type(result) is dict:
        return [_KIND_OK, pack({"id": req_id, "r": result})]
    extras: list[bytes] = []
    r = typing.cast(Result, result).to_map(extras)
    return [_KIND_OK, pack({"id": req_id, "r": r}), *extras]


def encode_error(req_id: int | None, code: Code, msg: str) -> list[bytes]:
    """Frames of an error reply."""
    return [_KIND_ERROR, pack({"id": req_id, "code": str(code), "msg": msg})]


def encode_notice(event: str, data: dict[str, Any]) -> list[bytes]:
    """Frames of a daemon push notification."""
    body = {"id": 0, "event": event, "data": data}
    return [bytes((Kind.NOTICE,)), pack(body)]


#: Most objects one body may decode into: each container counts itself and its
#: elements. Per-container limits alone let a 32 MB body of nested empty arrays
#: become 2.4 GiB of lists (issue #14); a batch of MAX_BATCH_OPS operations needs
#: ~16 per operation. Worst case ~60 B per object: ~16 MiB.
MAX_DECODED_OBJECTS: Final = 1 << 18
#: Up to this many body bytes the budget cannot be reached (an object takes a
#: byte at least, counted at most twice), so no hook is paid for.
_UNCOUNTED_BYTES: Final = MAX_DECODED_OBJECTS // 2


class _OverBudget(Exception):
    """Raised inside the unpacker once a body's objects exceed `MAX_DECODED_OBJECTS`."""


def _budget_hooks() -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """``list_hook`` and ``object_hook`` counting one body's objects (fresh per body)."""
    left = MAX_DECODED_OBJECTS

    def count_list(obj: list[Any]) -> list[Any]:
        nonlocal left
        left -= 1 + len(obj)
        if left < 0:
            raise _OverBudget
        return obj

    def count_map(obj: dict[Any, Any]) -> dict[Any, Any]:
        nonlocal left
        left -= 1 + 2 * len(obj)
        if left < 0:
            raise _OverBudget
        return obj

    return count_list, count_map


def _unpack(body: bytes | memoryview) -> Any:
    """One msgpack body, within the per-container limits and `MAX_DECODED_OBJECTS` in all.

    Past the budget the unpacker stops at once (TOO_LARGE), having built at
    most the budget's objects plus one container's elements.
    """
    list_hook = object_hook = None
    if len(body) > _UNCOUNTED_BYTES:
        list_hook, object_hook = _budget_hooks()
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_MESSAGE_BYTES,
            max_bin_len=MAX_MESSAGE_BYTES,
            max_array_len=MAX_BATCH_OPS * 4,
            max_map_len=4096,
            max_ext_len=0,
            list_hook=list_hook,
            object_hook=object_hook,
        )
    except _OverBudget:
        raise ProtocolError(
            Code.TOO_LARGE, f"body decodes into more than {MAX_DECODED_OBJECTS} objects"
        ) from None
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        RecursionError,
    ) as exc:
        raise ProtocolError(Code.INVALID, f"body is not valid msgpack: {exc}") from None


def _peek_id(body: Any) -> int | None:
    if type(body) is dict:
        value = body.get("id")
        if type(value) is int and 0 <= value <= UINT64_MAX:
            return value
    return None


#: The extra frames of a message that has none (shared: never appended to).
_NO_EXTRAS: Final[tuple[bytes, ...]] = ()


def decode_request(frames: Sequence[bytes | memoryview]) -> Request:
    """Decode a client's frames (routing id already removed).

    Raises ProtocolError carrying the request id when one could be read,
    so that the daemon can still address its error reply.
    """
    if len(frames) < 2:
        raise ProtocolError(Code.INVALID, "a message needs a kind frame and a body frame")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(Code.TOO_LARGE, f"more than {MAX_FRAMES} frames")
    kind_frame = frames[0]
    if len(kind_frame) != 1:
        raise ProtocolError(Code.INVALID, "frame 0 must be exactly one byte")
    body = _unpack(frames[1])
    req_id = _peek_id(body)
    cls = REQUESTS.get(kind_frame[0])
    if cls is None:
        raise ProtocolError(Code.UNKNOWN_KIND, f"unknown kind 0x{kind_frame[0]:02x}", req_id)
    try:
        extras = [bytes(f) for f in frames[2:]] if len(frames) > 2 else _NO_EXTRAS
        return cls.from_map(body, extras)
    except ProtocolError as exc:
        exc.req_id = req_id
        raise


def decode_batch_op(op: Any, extras: Sequence[bytes]) -> Request:
    """Decode one ``[kind, body]`` entry of a batch (must be batchable)."""
    if type(op) is not list or len(op) != 2 or type(op[0]) is not int:
        raise ProtocolError(Code.INVALID, "a batch op is [kind, body]")
    cls = REQUESTS.get(op[0])
    if cls is None:
        raise ProtocolError(Code.UNKNOWN_KIND, f"unknown kind 0x{op[0]:02x}")
    if not cls.BATCHABLE:
        raise ProtocolError(Code.INVALID, f"{cls.__name__} cannot be batched")
    return cls.from_map(op[1], extras)


def encode_batch(req_id: int, ops: Sequence[Request]) -> list[bytes]:
    """Frames of a batch request carrying ``ops`` (each batchable).

    Every token field of the batch slices one shared extra frame
    (``[0, start, stop]``) and every keys field another (``[1, start,
    stop]``): two frames per batch, not one per operation. Frame 0 is sent
    (empty) when there are keys but no tokens.
    """
    if len(ops) > MAX_BATCH_OPS:
        raise ValueError(f"a batch holds at most {MAX_BATCH_OPS} operations")
    extras: list[bytes] = []
    tokens, keys = SharedTokens(0), SharedKeys(1)
    tok, key = tokens.add, keys.add
    entries = []
    for op in ops:
        cls = type(op)
        if not cls.BATCHABLE:
            raise ValueError(f"{cls.__name__} cannot be batched")
        enc = ENCODERS.get(cls)
        if enc is None:
            enc = ENCODERS[cls] = compile_encoder(cls)
        entries.append([int(cls.KIND), enc(op, extras, tok, key)])
    body = pack({"id": req_id, "ops": entries})
    if keys.parts:
        shared = tokens.frame_bytes() if tokens.arrays else b""
        return [_KIND_BATCH, body, shared, keys.frame_bytes()]
    if tokens.arrays:
        return [_KIND_BATCH, body, tokens.frame_bytes()]
    return [_KIND_BATCH, body]


def decode_reply(frames: Sequence[bytes | memoryview]) -> OkReply | ErrorReply | Notice:
    """Decode a daemon reply on the client side."""
    if len(frames) < 2 or len(frames[0]) != 1:
        raise ProtocolError(Code.INVALID, "malformed reply")
    body = _unpack(frames[1])
    if type(body) is not dict:
        raise ProtocolError(Code.INVALID, "reply body must be a map")
    kind = frames[0][0]
    if kind == _OK:
        r = body.get("r")
        rid = body.get("id")
        if type(rid) is not int or type(r) is not dict:
            raise ProtocolError(Code.INVALID, "malformed OK reply")
        return OkReply(rid, r, [bytes(f) for f in frames[2:]] if len(frames) > 2 else ())
    if kind == _ERROR:
        return ErrorReply(_peek_id(body), str(body.get("code")), str(body.get("msg")))
    if kind == Kind.NOTICE:
        data = body.get("data")
        return Notice(str(body.get("event")), data if type(data) is dict else {})
    raise ProtocolError(Code.INVALID, f"unknown reply kind 0x{kind:02x}")
