"""The wire contract between kvd and its clients.

Every message is a ZeroMQ multipart message (the daemon's ROUTER adds the
peer's routing id in front, which this module never sees)::

    frame 0   one byte: the message kind (`Kind`)
    frame 1   msgpack body: a map, decoded by the kind's own typed decoder
    frame 2.. extra binary frames: token ids as little-endian int32 bytes

Requests carry an ``id`` chosen by the client; every reply repeats it. A
reply is `Kind.OK` with a ``r`` result map, or `Kind.ERROR` with a stable
``code`` (`Code`) and a human ``msg``. The daemon may also push
`Kind.NOTICE` messages (pressure notifications) with ``id`` 0.

Nothing here is ever pickled and no message names a method to call: each
kind maps to one dataclass, decoded field by field with type and size
checks, so a malformed frame becomes a `ProtocolError` with a code.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import threading
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeVar, Union, dataclass_transform

import msgpack
import numpy as np
import numpy.typing as npt

__all__ = [
    "MAX_BATCH_OPS",
    "MAX_FRAMES",
    "MAX_MESSAGE_BYTES",
    "MAX_NAME_LEN",
    "MAX_TOKENS",
    "PROTOCOL_VERSION",
    "REQUESTS",
    "RESULTS",
    "Allocate",
    "AllocateResult",
    "Append",
    "AppendResult",
    "Batch",
    "BatchResult",
    "CanAllocate",
    "CanAllocateResult",
    "Check",
    "CheckResult",
    "Clients",
    "Code",
    "Commit",
    "CommitResult",
    "Empty",
    "ErrorReply",
    "Flush",
    "FlushResult",
    "Fork",
    "ForkResult",
    "Free",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "HelloResult",
    "Info",
    "InfoResult",
    "Kind",
    "Message",
    "Notice",
    "OkReply",
    "OpResult",
    "Pin",
    "PinResult",
    "Ping",
    "PingResult",
    "Pools",
    "ProtocolError",
    "Request",
    "Stats",
    "TokenFrames",
    "Truncate",
    "TruncateResult",
    "Unpin",
    "blocks_from_bytes",
    "blocks_to_bytes",
    "decode_batch_op",
    "decode_reply",
    "decode_request",
    "encode_batch",
    "encode_error",
    "encode_notice",
    "encode_ok",
    "pack",
    "tokens_from_bytes",
    "tokens_to_bytes",
]

PROTOCOL_VERSION: Final = 2

#: A message (all frames together) larger than this is refused with TOO_LARGE.
#: The daemon sets ZMQ_MAXMSGSIZE above it so that zmq never drops silently.
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
#: Most tokens in one token frame (16 Mi tokens of int32 = 64 MiB).
MAX_TOKENS: Final = MAX_MESSAGE_BYTES // 4
#: Most operations in one batch.
MAX_BATCH_OPS: Final = 4096
#: Most frames in one message (kind + body + extras).
MAX_FRAMES: Final = MAX_BATCH_OPS + 2
#: Longest sequence id, client name, namespace, pool name or adapter name.
MAX_NAME_LEN: Final = 256

_INT64_MIN: Final = -(2**63)
_UINT64_MAX: Final = 2**64 - 1


class Kind(enum.IntEnum):
    """The one-byte message kind in frame 0."""

    HELLO = 0x01
    HEARTBEAT = 0x02
    GOODBYE = 0x03
    ALLOCATE = 0x10
    COMMIT = 0x11
    APPEND = 0x12
    FORK = 0x13
    TRUNCATE = 0x14
    FREE = 0x15
    PIN = 0x16
    UNPIN = 0x17
    CAN_ALLOCATE = 0x18
    BATCH = 0x1F
    STATS = 0x20
    CHECK = 0x21
    FLUSH = 0x22
    CLIENTS = 0x23
    POOLS = 0x24
    PING = 0x25
    OK = 0x80
    ERROR = 0x81
    NOTICE = 0x82


class Code(enum.StrEnum):
    """Stable error codes: one per condition, counted per code in stats."""

    #: The pool cannot serve the blocks (or the reservation) now; nothing changed.
    OUT_OF_BLOCKS = "OUT_OF_BLOCKS"
    #: The session's or namespace's hard quota would be exceeded; nothing changed.
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    #: The sequence, pin or pool does not exist (or belongs to another session).
    NOT_FOUND = "NOT_FOUND"
    #: A sequence with that id already exists in this session.
    EXISTS = "EXISTS"
    #: A field is missing, of the wrong type, or out of range.
    INVALID = "INVALID"
    #: The message or a list in it is larger than the daemon accepts.
    TOO_LARGE = "TOO_LARGE"
    #: Frame 0 is not a known request kind.
    UNKNOWN_KIND = "UNKNOWN_KIND"
    #: The client speaks another protocol version.
    VERSION = "VERSION"
    #: The client's expected pool layout or hash seed differs from the daemon's.
    MISMATCH = "MISMATCH"
    #: No session for this connection: the daemon restarted, the lease
    #: expired, or no hello was sent. Old sequences are gone; re-attach.
    SESSION_LOST = "SESSION_LOST"
    #: The operation is not allowed for this session (namespace, admin op).
    FORBIDDEN = "FORBIDDEN"
    #: The session sends faster than its configured request rate.
    RATE_LIMITED = "RATE_LIMITED"
    #: The daemon is overloaded; retry later.
    BUSY = "BUSY"
    #: The daemon is draining for shutdown; no new work is accepted.
    SHUTTING_DOWN = "SHUTTING_DOWN"
    #: A bug in the daemon: the request was rolled back and logged.
    INTERNAL = "INTERNAL"


class ProtocolError(Exception):
    """A message could not be decoded; carries the stable code for the reply."""

    def __init__(self, code: Code, message: str, req_id: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.req_id = req_id


# --------------------------------------------------------------------------
# msgpack

#: One Packer per thread: ``packb`` builds a Packer per call, which costs
#: four times the packing of a small body; a Packer is not shareable.
_packers = threading.local()


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (``bin`` type for bytes), with this thread's Packer."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------
# Binary payloads

_INT32_LE: Final = np.dtype("<i4")


#: Up to this many ids, a range check goes through a list: numpy's reductions
#: cost more on short arrays (a 1-token append, a block table of one block).
_SHORT: Final = 16
#: Bytes 0x00-0x7f: deleting them from the high bytes of int32 LE ids leaves
#: something exactly when an id is negative.
_NON_NEGATIVE_HIGH: Final = bytes(range(0x80))
#: Up to this many bytes (4 Ki ids) the sign check reads the bytes (one C pass,
#: no array); above, numpy's min is faster than copying every fourth byte.
_SIGN_BY_BYTES: Final = 16 * 1024


def _min(arr: npt.NDArray[Any]) -> int:
    """The smallest element of a non-empty 1-D integer array."""
    return min(arr.tolist()) if arr.shape[0] <= _SHORT else int(arr.min())


def _any_negative(buf: bytes) -> bool:
    """Whether int32 little-endian ``buf`` (length a multiple of 4) holds a negative id."""
    if len(buf) <= _SIGN_BY_BYTES:
        return bool(buf[3::4].translate(None, _NON_NEGATIVE_HIGH))
    return int(np.frombuffer(buf, dtype=_INT32_LE).min()) < 0


def tokens_to_bytes(tokens: npt.ArrayLike) -> bytes:
    """Token ids as little-endian int32 bytes (the extra-frame form)."""
    if type(tokens) is np.ndarray and tokens.dtype is _INT32_LE and tokens.ndim == 1:
        # The common form: only the sign can be out of range, read from the bytes.
        buf = tokens.tobytes()
        if _any_negative(buf):
            raise ValueError("token ids must lie in [0, 2**31)")
        return buf
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("token ids must be a 1-D sequence")
    if not arr.size:
        return b""
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == _INT32_LE:  # only the sign can be out of range
        if _min(arr) < 0:
            raise ValueError("token ids must lie in [0, 2**31)")
        return arr.tobytes()
    if _min(arr) < 0 or int(arr.max()) > 2**31 - 1:
        raise ValueError("token ids must lie in [0, 2**31)")
    return arr.astype("<i4", copy=False).tobytes()


def tokens_from_bytes(buf: bytes | memoryview) -> npt.NDArray[np.int32]:
    """Decode a token frame (a read-only array on it); ProtocolError on a bad length or value."""
    if len(buf) % 4:
        raise ProtocolError(Code.INVALID, f"token frame of {len(buf)} bytes is not int32s")
    if len(buf) // 4 > MAX_TOKENS:
        raise ProtocolError(Code.TOO_LARGE, f"more than {MAX_TOKENS} tokens in one frame")
    if type(buf) is not bytes:
        buf = bytes(buf)
    if _any_negative(buf):
        raise ProtocolError(Code.INVALID, "negative token id")
    return np.frombuffer(buf, dtype=_INT32_LE)


#: Block ids travel inside bodies as msgpack ``bin`` of little-endian int32.
blocks_to_bytes = tokens_to_bytes


def blocks_from_bytes(buf: bytes) -> npt.NDArray[np.int32]:
    """Decode a block-id ``bin`` field (int32 LE)."""
    return tokens_from_bytes(buf)


# --------------------------------------------------------------------------
# The typed field schema shared by every message


class Tokens:
    """Annotation marker: a field carried as an extra int32 frame.

    In the body the field holds the index of its frame among the extras.
    """


if TYPE_CHECKING:
    #: To type checkers a Blocks field is the int32 array it holds.
    Blocks = npt.NDArray[np.int32]
else:

    class Blocks:
        """Annotation marker: an int32 array carried as msgpack ``bin`` in the body."""


_TokenArray = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    check: Any  # Callable[[Any, str], Any]
    optional: bool
    is_tokens: bool
    default: Any


def _fail(name: str, expected: str, value: object) -> typing.NoReturn:
    raise ProtocolError(
        Code.INVALID, f"field {name!r}: expected {expected}, got {type(value).__name__}"
    )


def _check_int(value: Any, name: str) -> int:
    if type(value) is not int:
        _fail(name, "an integer", value)
    if not _INT64_MIN <= value <= _UINT64_MAX:
        raise ProtocolError(Code.INVALID, f"field {name!r}: integer out of range")
    return value


def _check_bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        _fail(name, "a boolean", value)
    return value


def _check_str(value: Any, name: str) -> str:
    if type(value) is not str:
        _fail(name, "a string", value)
    if len(value) > MAX_NAME_LEN:
        raise ProtocolError(Code.TOO_LARGE, f"field {name!r}: longer than {MAX_NAME_LEN}")
    return value


def _check_map(value: Any, name: str) -> dict[str, Any]:
    if type(value) is not dict:
        _fail(name, "a map", value)
    return value


def _check_list(value: Any, name: str) -> list[Any]:
    if type(value) is not list:
        _fail(name, "an array", value)
    return value


_NO_BLOCKS: Final = np.empty(0, dtype="<i4")
_NO_BLOCKS.flags.writeable = False


def _check_blocks(value: Any, name: str) -> _TokenArray:
    if type(value) is not bytes:
        _fail(name, "int32 bytes", value)
    # Most appends get no new block and no copy: one shared empty array.
    return tokens_from_bytes(value) if value else _NO_BLOCKS


_CHECKS: dict[Any, Any] = {
    int: _check_int,
    bool: _check_bool,
    str: _check_str,
    dict: _check_map,
    list: _check_list,
    Blocks: _check_blocks,
}


#: Each message class's decoded field schema, built on first use.
_SCHEMAS: dict[type[Message], tuple[_Field, ...]] = {}


def _schema(cls: type[Message]) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    fields: list[_Field] = []
    for f in dataclasses.fields(typing.cast(Any, cls)):
        ann = hints[f.name]
        optional = False
        origin = typing.get_origin(ann)
        if origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            optional = len(args) < len(typing.get_args(ann))
            (ann,) = args
            origin = typing.get_origin(ann)
        base = origin or ann
        if base is np.ndarray or ann is Tokens:
            fields.append(_Field(f.name, None, optional, True, None))
            continue
        if ann is Blocks:
            base = Blocks
        default: Any = None
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        optional = optional or f.default is not dataclasses.MISSING
        optional = optional or f.default_factory is not dataclasses.MISSING
        fields.append(_Field(f.name, _CHECKS[base], optional, False, default))
    return tuple(fields)


M = TypeVar("M", bound="Message")


class TokenFrames(list[bytes]):
    """The extra frames of one message, each decoded to tokens at most once.

    A batch's token fields slice one shared frame: the frame is decoded and
    sign-checked once, and each operation gets a view of its slice.
    """

    __slots__ = ("_arrays",)

    def __init__(self, frames: Sequence[bytes] = ()) -> None:
        super().__init__(frames)
        self._arrays: dict[int, tuple[_TokenArray, bool]] = {}

    def tokens(self, index: int) -> tuple[_TokenArray, bool]:
        """Frame ``index`` as int32 (length checked) and whether every id is >= 0."""
        got = self._arrays.get(index)
        if got is None:
            buf = self[index]
            if len(buf) % 4:
                raise ProtocolError(Code.INVALID, f"token frame of {len(buf)} bytes is not int32s")
            if len(buf) // 4 > MAX_TOKENS:
                raise ProtocolError(Code.TOO_LARGE, f"more than {MAX_TOKENS} tokens in one frame")
            arr = np.frombuffer(buf, dtype="<i4")
            got = self._arrays[index] = (arr, not arr.size or int(arr.min()) >= 0)
        return got


def _decode_tokens(value: Any, extras: Sequence[bytes], name: str) -> _TokenArray:
    """A token field: ``i`` (all of extra frame ``i``) or ``[i, start, stop]`` (a slice of it)."""
    if type(value) is int:
        if not 0 <= value < len(extras):
            raise ProtocolError(Code.INVALID, f"field {name!r}: no extra frame {value!r}")
        return tokens_from_bytes(extras[value])
    if (
        type(value) is not list
        or len(value) != 3
        or type(value[0]) is not int
        or type(value[1]) is not int
        or type(value[2]) is not int
    ):
        raise ProtocolError(
            Code.INVALID, f"field {name!r}: expected a frame index or [frame, start, stop]"
        )
    index, start, stop = value
    if not 0 <= index < len(extras):
        raise ProtocolError(Code.INVALID, f"field {name!r}: no extra frame {index!r}")
    frames = extras if type(extras) is TokenFrames else TokenFrames(extras)
    arr, nonnegative = frames.tokens(index)
    if not 0 <= start <= stop <= arr.shape[0]:
        raise ProtocolError(
            Code.INVALID,
            f"field {name!r}: tokens {start}:{stop} outside frame {index} of {arr.shape[0]}",
        )
    part = arr[start:stop]
    if not nonnegative and stop > start and int(part.min()) < 0:
        raise ProtocolError(Code.INVALID, "negative token id")
    return part


def _unknown_fields(body: dict[Any, Any], names: frozenset[str]) -> None:
    """INVALID when ``body`` has keys outside ``names`` (the keys may also be nil fields)."""
    unknown = body.keys() - names
    if unknown:
        raise ProtocolError(Code.INVALID, f"unknown fields {sorted(map(str, unknown))}")


def _token_frame(value: Any, extras: list[bytes]) -> int:
    """Append a token field's frame to ``extras``; the field's body value (its index)."""
    extras.append(tokens_to_bytes(value))
    return len(extras) - 1


class _SharedTokens:
    """One token frame for a whole batch: each field becomes ``[frame, start, stop]``."""

    __slots__ = ("arrays", "frame", "size")

    def __init__(self, frame: int) -> None:
        self.frame = frame
        self.arrays: list[_TokenArray] = []
        self.size = 0

    def add(self, value: Any, extras: list[bytes]) -> list[int]:
        if type(value) is np.ndarray and value.dtype == _INT32_LE and value.ndim == 1:
            if value.shape[0] and _min(value) < 0:
                raise ValueError("token ids must lie in [0, 2**31)")
            arr = value
        else:
            arr = np.frombuffer(tokens_to_bytes(value), dtype=_INT32_LE)
        start = self.size
        self.size = start + arr.shape[0]
        self.arrays.append(arr)
        return [self.frame, start, self.size]

    def frame_bytes(self) -> bytes:
        arrays = self.arrays
        return arrays[0].tobytes() if len(arrays) == 1 else np.concatenate(arrays).tobytes()


def _compile_decoder(cls: type[Message], lenient: bool) -> Any:
    """A straight-line decoder for ``cls`` (same checks and messages as the field loop).

    ``lenient``: ignore unknown fields (results from a newer daemon) instead of
    refusing them (requests).
    """
    fields = cls._fields()
    env: dict[str, Any] = {
        "cls": cls,
        "ProtocolError": ProtocolError,
        "INVALID": Code.INVALID,
        "MIN": _INT64_MIN,
        "MAX": _UINT64_MAX,
        "LEN": MAX_NAME_LEN,
        "check_int": _check_int,
        "check_str": _check_str,
        "tokens": _decode_tokens,
        "unknown": _unknown_fields,
        "NAMES": frozenset(f.name for f in fields),
    }
    not_map = f"{cls.__name__} body must be a map"
    lines = [
        "def decode(body, extras):",
        "    if type(body) is not dict:",
        f"        raise ProtocolError(INVALID, {not_map!r})",
        "    get = body.get",
        "    seen = 0",
    ]
    args = []
    for i, f in enumerate(fields):
        v, name = f"v{i}", f.name
        args.append(v)
        lines.append(f"    {v} = get({name!r})")
        lines.append(f"    if {v} is None:")
        if f.optional:
            env[f"D{i}"] = f.default
            lines.append(f"        {v} = D{i}")
        else:
            required = f"field {name!r} is required"
            lines.append(f"        raise ProtocolError(INVALID, {required!r})")
        lines.append("    else:")
        lines.append("        seen += 1")
        if f.is_tokens:
            lines.append(f"        {v} = tokens({v}, extras, {name!r})")
        elif f.check is _check_int:
            lines.append(f"        if type({v}) is not int or not MIN <= {v} <= MAX:")
            lines.append(f"            check_int({v}, {name!r})")
        elif f.check is _check_str:
            lines.append(f"        if type({v}) is not str or len({v}) > LEN:")
            lines.append(f"            check_str({v}, {name!r})")
        else:
            env[f"C{i}"] = f.check
            lines.append(f"        {v} = C{i}({v}, {name!r})")
    if not lenient:
        lines.append("    if seen != len(body):")
        lines.append("        unknown(body, NAMES)")
    lines.append(f"    return cls({', '.join(args)})")
    exec("\n".join(lines), env)  # noqa: S102 (source built above from the dataclass schema)
    return env["decode"]


def _compile_encoder(cls: type[Message]) -> Any:
    """A straight-line ``to_map`` for ``cls``: absent (None) fields are left out.

    An int32 array in a Blocks field is trusted as it is (the daemon's engine
    made it; a negative id still fails the peer's decoder): its bytes are
    taken without the range scan `blocks_to_bytes` does.
    """
    fields = cls._fields()
    env: dict[str, Any] = {"ndarray": np.ndarray, "I32": _INT32_LE, "blocks": blocks_to_bytes}
    lines = ["def encode(self, extras, tok):", "    out = {}"]
    for f in fields:
        name = f.name
        lines.append(f"    v = self.{name}")
        lines.append("    if v is not None:")
        if f.is_tokens:
            lines.append(f"        out[{name!r}] = tok(v, extras)")
        elif f.check is _check_blocks:
            lines.append("        if type(v) is ndarray and v.dtype == I32 and v.ndim == 1:")
            lines.append(f"            out[{name!r}] = v.tobytes()")
            lines.append("        else:")
            lines.append(f"            out[{name!r}] = blocks(v)")
        else:
            lines.append(f"        out[{name!r}] = v")
    lines.append("    return out")
    exec("\n".join(lines), env)  # noqa: S102 (source built above from the dataclass schema)
    return env["encode"]


#: Compiled codecs by message class (built on first use).
_DECODERS: dict[type[Message], Any] = {}
_LENIENT: dict[type[Message], Any] = {}
_ENCODERS: dict[type[Message], Any] = {}


class Message:
    """Base of every body type: encodes to a map, decodes with checks.

    Each class's codec is generated once from its dataclass schema (straight
    code per field, no loop over a schema per message). Messages are plain
    slotted dataclasses (not frozen: a frozen ``__init__`` costs four times as
    much); treat them as values.
    """

    __slots__ = ()
    _FIELDS: ClassVar[tuple[_Field, ...]] = ()

    def to_map(self, extras: list[bytes]) -> dict[str, Any]:
        """The body map; token fields are appended to ``extras`` as frames."""
        cls = type(self)
        enc = _ENCODERS.get(cls)
        if enc is None:
            enc = _ENCODERS[cls] = _compile_encoder(cls)
        return enc(self, extras, _token_frame)  # type: ignore[no-any-return]

    @classmethod
    def from_map(cls: type[M], body: Any, extras: Sequence[bytes]) -> M:
        """Decode a body map; raises ProtocolError(INVALID/TOO_LARGE)."""
        dec = _DECODERS.get(cls)
        if dec is None:
            dec = _DECODERS[cls] = _compile_decoder(cls, lenient=False)
        return dec(body, extras)  # type: ignore[no-any-return]

    @classmethod
    def from_map_lenient(cls: type[M], body: Any, extras: Sequence[bytes]) -> M:
        """Like `from_map`, ignoring unknown fields (a result from a newer daemon)."""
        dec = _LENIENT.get(cls)
        if dec is None:
            dec = _LENIENT[cls] = _compile_decoder(cls, lenient=True)
        return dec(body, extras)  # type: ignore[no-any-return]

    @classmethod
    def _fields(cls) -> tuple[_Field, ...]:
        schema = _SCHEMAS.get(cls)
        if schema is None:
            schema = _SCHEMAS[cls] = _schema(cls)
        return schema


class Request(Message):
    """A client → daemon message. ``KIND`` is its frame-0 byte."""

    __slots__ = ()
    KIND: ClassVar[Kind]
    #: Request kinds that may appear inside a `Batch`.
    BATCHABLE: ClassVar[bool] = False
    #: Operator requests (stats, flush...) allowed before/without a hello.
    ADMIN: ClassVar[bool] = False

    def encode(self) -> list[bytes]:
        """Frames for the wire: kind, body, extras."""
        extras: list[bytes] = []
        body = pack(self.to_map(extras))
        return [_KIND_BYTES[self.KIND], body, *extras]


@dataclass_transform()
def _req(kind: Kind, *, batchable: bool = False, admin: bool = False) -> Any:
    """Class decorator: a slotted dataclass registered under ``kind``."""

    def wrap(cls: type[Request]) -> type[Request]:
        cls = dataclass(slots=True)(cls)
        cls.KIND = kind
        cls.BATCHABLE = batchable
        cls.ADMIN = admin
        REQUESTS[kind] = cls
        return cls

    return wrap


#: Every request kind's decoder. The daemon dispatches on this table only.
REQUESTS: dict[int, type[Request]] = {}
#: Frame 0 of each kind.
_KIND_BYTES: Final = {kind: bytes((kind,)) for kind in Kind}


# --------------------------------------------------------------------------
# Requests


@_req(Kind.HELLO)
class Hello(Request):
    """Open a session. ``layout`` and ``hash_seed``, when given, must match the pool.

    ``create`` (with ``layout``): when no pool ``pool`` exists, the daemon
    creates it for ``layout`` on ``backend`` (the daemon's default when
    omitted) and ``device`` (a GPU index for ``cuda``), under the same
    memory checks as its configured pools and the operator's runtime-pool
    cap, then opens the session on it. An existing pool with the same
    layout is simply attached. Omitted fields are not sent, so a hello
    without them is byte-identical to protocol 1's first form.
    """

    id: int
    version: int
    pool: str
    name: str
    pid: int
    namespace: str = ""
    adapter: str | None = None
    layout: dict[str, Any] | None = None
    hash_seed: str | None = None
    create: bool | None = None
    backend: str | None = None
    device: int | None = None


@_req(Kind.HEARTBEAT)
class Heartbeat(Request):
    """Renew the lease without doing anything else."""

    id: int


@_req(Kind.GOODBYE)
class Goodbye(Request):
    """Close the session: its sequences are freed and its pins released."""

    id: int


@_req(Kind.ALLOCATE, batchable=True)
class Allocate(Request):
    """Match the longest cached prefix, allocate the rest, reserve room to ``reserve`` tokens."""

    id: int
    seq: str
    tokens: npt.NDArray[np.int32]
    reserve: int | None = None


@_req(Kind.COMMIT, batchable=True)
class Commit(Request):
    """The first ``n`` tokens (all when omitted) are written; full blocks become cached."""

    id: int
    seq: str
    n: int | None = None


@_req(Kind.APPEND, batchable=True)
class Append(Request):
    """Grow the sequence by ``tokens``; may answer copy-on-write copies."""

    id: int
    seq: str
    tokens: npt.NDArray[np.int32]


@_req(Kind.FORK, batchable=True)
class Fork(Request):
    """Share every block of ``seq`` with a new sequence ``child``."""

    id: int
    seq: str
    child: str
    reserve: int | None = None


@_req(Kind.TRUNCATE, batchable=True)
class Truncate(Request):
    """Keep the first ``n`` tokens (rolls back rejected speculative tokens)."""

    id: int
    seq: str
    n: int


@_req(Kind.FREE, batchable=True)
class Free(Request):
    """Release the sequence; its committed full blocks stay cached."""

    id: int
    seq: str


@_req(Kind.PIN, batchable=True)
class Pin(Request):
    """Pin the committed full blocks of the first ``n`` tokens (all committed when omitted)."""

    id: int
    seq: str
    n: int | None = None


@_req(Kind.UNPIN, batchable=True)
class Unpin(Request):
    """Release a pin made by this session."""

    id: int
    pin: int


@_req(Kind.CAN_ALLOCATE, batchable=True)
class CanAllocate(Request):
    """Would an allocation of ``tokens`` tokens (reserving ``reserve``) be admitted now?"""

    id: int
    tokens: int
    reserve: int | None = None


@_req(Kind.BATCH)
class Batch(Request):
    """Many operations of one scheduler step in one round trip.

    ``ops`` is a list of ``[kind, body]`` pairs of batchable kinds; token
    fields index the message's extra frames. Operations run in order, each
    on its own (a refused one does not undo the others); the reply lists
    one result per operation.
    """

    id: int
    ops: list[Any]


@_req(Kind.STATS, admin=True)
class Stats(Request):
    """The daemon's statistics, by section (all sections when ``sections`` is omitted)."""

    id: int
    sections: list[Any] | None = None


@_req(Kind.CHECK, admin=True)
class Check(Request):
    """Run the engine's invariant checks now."""

    id: int


@_req(Kind.FLUSH, admin=True)
class Flush(Request):
    """Drop every evictable cached block (of ``namespace`` when given) and bump the epoch."""

    id: int
    namespace: str | None = None


@_req(Kind.CLIENTS, admin=True)
class Clients(Request):
    """The connected sessions."""

    id: int


@_req(Kind.POOLS, admin=True)
class Pools(Request):
    """The pools, their layouts and usage."""

    id: int


@_req(Kind.PING, admin=True)
class Ping(Request):
    """Liveness: answers the daemon's epoch."""

    id: int


# --------------------------------------------------------------------------
# Results (the ``r`` map of an OK reply)


class Result(Message):
    """Base of result bodies."""

    __slots__ = ()


@dataclass_transform()
def _res(cls: type[Result]) -> type[Result]:
    return dataclass(slots=True)(cls)


@_res
class Empty(Result):
    """A result with no fields (free, unpin, goodbye, heartbeat)."""


@_res
class HelloResult(Result):
    """Session id, daemon epoch, the pool's layout and how to map its memory."""

    session: int
    epoch: int
    pool: str
    layout: dict[str, Any]
    memory: dict[str, Any]
    lease_ms: int
    hash_seed: str
    namespace: str
    max_message_bytes: int


@_res
class AllocateResult(Result):
    """``table``: the block ids; ``cached``: tokens served from the prefix cache."""

    table: Blocks
    cached: int
    reserved: int


@_res
class CommitResult(Result):
    """Tokens committed now, and how many blocks this call made cacheable."""

    committed: int
    cached_blocks: int


@_res
class AppendResult(Result):
    """``table[start:] = blocks``; ``copies`` is flat ``[src, dst, ...]`` to copy first."""

    start: int
    blocks: Blocks
    copies: Blocks
    length: int


@_res
class ForkResult(Result):
    """The child's block table (shared with the parent)."""

    table: Blocks


@_res
class TruncateResult(Result):
    """The sequence's new length and number of blocks (``table[:num_blocks]`` remains)."""

    length: int
    num_blocks: int


@_res
class PinResult(Result):
    """The pin's id and how many blocks it holds."""

    pin: int
    blocks: int


@_res
class CanAllocateResult(Result):
    """``ok``: admitted now; ``available``: blocks this session could take now."""

    ok: bool
    available: int


@_res
class FlushResult(Result):
    """How many cached blocks were dropped."""

    dropped: int


@_res
class CheckResult(Result):
    """``ok`` when every invariant holds; ``problems`` lists violations."""

    ok: bool
    problems: list[Any]


@_res
class PingResult(Result):
    """The daemon's epoch and protocol version."""

    epoch: int
    version: int


@_res
class InfoResult(Result):
    """Free-form sections for operators (stats, clients, pools)."""

    info: dict[str, Any]


@_res
class OpResult(Result):
    """One operation's outcome inside a batch: ``r`` on success, else ``code``/``msg``."""

    ok: bool
    r: dict[str, Any] | None = None
    code: str | None = None
    msg: str | None = None


@_res
class BatchResult(Result):
    """One `OpResult` map per operation, in order."""

    results: list[Any]


#: Request types whose result is free-form operator information.
Info = InfoResult

#: The result type of each request kind (for client-side decoding).
RESULTS: dict[int, type[Result]] = {
    Kind.HELLO: HelloResult,
    Kind.HEARTBEAT: Empty,
    Kind.GOODBYE: Empty,
    Kind.ALLOCATE: AllocateResult,
    Kind.COMMIT: CommitResult,
    Kind.APPEND: AppendResult,
    Kind.FORK: ForkResult,
    Kind.TRUNCATE: TruncateResult,
    Kind.FREE: Empty,
    Kind.PIN: PinResult,
    Kind.UNPIN: Empty,
    Kind.CAN_ALLOCATE: CanAllocateResult,
    Kind.BATCH: BatchResult,
    Kind.STATS: InfoResult,
    Kind.CHECK: CheckResult,
    Kind.FLUSH: FlushResult,
    Kind.CLIENTS: InfoResult,
    Kind.POOLS: InfoResult,
    Kind.PING: PingResult,
}


# --------------------------------------------------------------------------
# Replies


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


def _unpack(body: bytes | memoryview) -> Any:
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
        )
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
        if type(value) is int and 0 <= value <= _UINT64_MAX:
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
    (``[0, start, stop]``): one frame per batch, not one per operation.
    """
    if len(ops) > MAX_BATCH_OPS:
        raise ValueError(f"a batch holds at most {MAX_BATCH_OPS} operations")
    extras: list[bytes] = []
    shared = _SharedTokens(0)
    add = shared.add
    entries = []
    for op in ops:
        cls = type(op)
        if not cls.BATCHABLE:
            raise ValueError(f"{cls.__name__} cannot be batched")
        enc = _ENCODERS.get(cls)
        if enc is None:
            enc = _ENCODERS[cls] = _compile_encoder(cls)
        entries.append([int(cls.KIND), enc(op, extras, add)])
    body = pack({"id": req_id, "ops": entries})
    if shared.arrays:
        return [_KIND_BATCH, body, shared.frame_bytes()]
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
