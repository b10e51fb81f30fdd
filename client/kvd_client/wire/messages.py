"""The typed messages: every request kind and every result body.

Nothing is ever pickled and no message names a method to call: each kind
maps to one dataclass (`REQUESTS`), decoded field by field with type and
size checks (`kvd_client.wire.codec`), so a malformed body becomes a
`ProtocolError` with a code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeVar, dataclass_transform

# Runtime imports, not TYPE_CHECKING ones: the codec resolves the field
# annotations (``npt.NDArray``, ``Blocks``) in this module's namespace.
import numpy as np
import numpy.typing as npt

from kvd_client.wire.codec import (
    DECODERS,
    ENCODERS,
    LENIENT_DECODERS,
    Field,
    compile_decoder,
    compile_encoder,
    fields,
)
from kvd_client.wire.codes import Kind
from kvd_client.wire.payloads import Blocks, Keys, keys_frame, pack, token_frame

__all__ = [
    "REQUESTS",
    "RESULTS",
    "AllocateRequest",
    "AllocateResult",
    "AppendRequest",
    "AppendResult",
    "BatchRequest",
    "BatchResult",
    "CanAllocateRequest",
    "CanAllocateResult",
    "CheckRequest",
    "CheckResult",
    "ClientsRequest",
    "CommitRequest",
    "CommitResult",
    "Empty",
    "FlushRequest",
    "FlushResult",
    "ForkRequest",
    "ForkResult",
    "FreeRequest",
    "GoodbyeRequest",
    "GrantRequest",
    "GrantResult",
    "HeartbeatRequest",
    "HelloRequest",
    "HelloResult",
    "Info",
    "InfoResult",
    "LookupRequest",
    "LookupResult",
    "Message",
    "OpResult",
    "PinRequest",
    "PinResult",
    "PingRequest",
    "PingResult",
    "PoolsRequest",
    "PublishRequest",
    "PublishResult",
    "ReleaseRequest",
    "ReleaseResult",
    "Request",
    "Result",
    "StatsRequest",
    "TruncateRequest",
    "TruncateResult",
    "UnpinRequest",
]

M = TypeVar("M", bound="Message")


class Message:
    """Base of every body type: encodes to a map, decodes with checks.

    Each class's codec is generated once from its dataclass schema (straight
    code per field, no loop over a schema per message). Messages are plain
    slotted dataclasses (not frozen: a frozen ``__init__`` costs four times as
    much); treat them as values.
    """

    __slots__ = ()

    def to_map(self, extras: list[bytes]) -> dict[str, Any]:
        """The body map; token and keys fields are appended to ``extras`` as frames."""
        cls = type(self)
        enc = ENCODERS.get(cls)
        if enc is None:
            enc = ENCODERS[cls] = compile_encoder(cls)
        return enc(self, extras, token_frame, keys_frame)  # type: ignore[no-any-return]

    @classmethod
    def from_map(cls: type[M], body: Any, extras: Sequence[bytes]) -> M:
        """Decode a body map; raises ProtocolError(INVALID/TOO_LARGE)."""
        dec = DECODERS.get(cls)
        if dec is None:
            dec = DECODERS[cls] = compile_decoder(cls, lenient=False)
        return dec(body, extras)  # type: ignore[no-any-return]

    @classmethod
    def from_map_lenient(cls: type[M], body: Any, extras: Sequence[bytes]) -> M:
        """Like `from_map`, ignoring unknown fields (a result from a newer daemon)."""
        dec = LENIENT_DECODERS.get(cls)
        if dec is None:
            dec = LENIENT_DECODERS[cls] = compile_decoder(cls, lenient=True)
        return dec(body, extras)  # type: ignore[no-any-return]

    @classmethod
    def _fields(cls) -> tuple[Field, ...]:
        return fields(cls)


class Request(Message):
    """A client → daemon message. ``KIND`` is its frame-0 byte."""

    __slots__ = ()
    KIND: ClassVar[Kind]
    #: Request kinds that may appear inside a `BatchRequest`.
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
class HelloRequest(Request):
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
class HeartbeatRequest(Request):
    """Renew the lease without doing anything else."""

    id: int


@_req(Kind.GOODBYE)
class GoodbyeRequest(Request):
    """Close the session: its sequences are freed and its pins released."""

    id: int


@_req(Kind.ALLOCATE, batchable=True)
class AllocateRequest(Request):
    """Match the longest cached prefix, allocate the rest, reserve room to ``reserve`` tokens.

    ``keys``: the client's keys of every full block of ``tokens`` (exactly
    ``len(tokens) // block_size``, computed with the hello's hash seed, the
    namespace and adapter); the daemon hashes when they are omitted.
    """

    id: int
    seq: str
    tokens: npt.NDArray[np.int32]
    reserve: int | None = None
    keys: Keys | None = None


@_req(Kind.COMMIT, batchable=True)
class CommitRequest(Request):
    """The first ``n`` tokens (all when omitted) are written; full blocks become cached."""

    id: int
    seq: str
    n: int | None = None


@_req(Kind.APPEND, batchable=True)
class AppendRequest(Request):
    """Grow the sequence by ``tokens``; may answer copy-on-write copies.

    ``keys``: the client's keys of the blocks this append fills (the daemon
    hashes them at commit when omitted).
    """

    id: int
    seq: str
    tokens: npt.NDArray[np.int32]
    keys: Keys | None = None


@_req(Kind.FORK, batchable=True)
class ForkRequest(Request):
    """Share every block of ``seq`` with a new sequence ``child``."""

    id: int
    seq: str
    child: str
    reserve: int | None = None


@_req(Kind.TRUNCATE, batchable=True)
class TruncateRequest(Request):
    """Keep the first ``n`` tokens (rolls back rejected speculative tokens)."""

    id: int
    seq: str
    n: int


@_req(Kind.FREE, batchable=True)
class FreeRequest(Request):
    """Release the sequence; its committed full blocks stay cached."""

    id: int
    seq: str


@_req(Kind.PIN, batchable=True)
class PinRequest(Request):
    """Pin the committed full blocks of the first ``n`` tokens (all committed when omitted)."""

    id: int
    seq: str
    n: int | None = None


@_req(Kind.UNPIN, batchable=True)
class UnpinRequest(Request):
    """Release a pin made by this session."""

    id: int
    pin: int


@_req(Kind.CAN_ALLOCATE, batchable=True)
class CanAllocateRequest(Request):
    """Would an allocation of ``tokens`` tokens (reserving ``reserve``) be admitted now?"""

    id: int
    tokens: int
    reserve: int | None = None


@_req(Kind.LOOKUP, batchable=True)
class LookupRequest(Request):
    """How many leading ``keys`` are cached in the session's namespace.

    With ``hold``, those blocks are held (by a new hold, refused like an
    allocation when they cannot be) until released, so no eviction takes
    them before they are read.
    """

    id: int
    keys: Keys
    hold: bool | None = None


@_req(Kind.GRANT, batchable=True)
class GrantRequest(Request):
    """Hold ``n`` fresh blocks for the session to write, then publish or release."""

    id: int
    n: int


@_req(Kind.PUBLISH, batchable=True)
class PublishRequest(Request):
    """Granted ``blocks`` of ``hold`` are written: cache them under ``keys``.

    One key per block, in chain order; ``parent`` is the key before the
    first (for KV events); ``tokens`` are the blocks' token ids.
    """

    id: int
    hold: int
    blocks: Blocks
    keys: Keys
    tokens: npt.NDArray[np.int32]
    parent: bytes | None = None


@_req(Kind.RELEASE, batchable=True)
class ReleaseRequest(Request):
    """Let go of ``blocks`` of ``hold`` (all when omitted); any session of the
    hold's namespace may; a hold that is gone releases nothing."""

    id: int
    hold: int
    blocks: Blocks | None = None


@_req(Kind.BATCH)
class BatchRequest(Request):
    """Many operations of one scheduler step in one round trip.

    ``ops`` is a list of ``[kind, body]`` pairs of batchable kinds; token
    fields index the message's extra frames. Operations run in order, each
    on its own (a refused one does not undo the others); the reply lists
    one result per operation.
    """

    id: int
    ops: list[Any]


@_req(Kind.STATS, admin=True)
class StatsRequest(Request):
    """The daemon's statistics, by section (all sections when ``sections`` is omitted)."""

    id: int
    sections: list[Any] | None = None


@_req(Kind.CHECK, admin=True)
class CheckRequest(Request):
    """Run the engine's invariant checks now."""

    id: int


@_req(Kind.FLUSH, admin=True)
class FlushRequest(Request):
    """Drop every evictable cached block (of ``namespace`` when given) and bump the epoch."""

    id: int
    namespace: str | None = None


@_req(Kind.CLIENTS, admin=True)
class ClientsRequest(Request):
    """The connected sessions."""

    id: int


@_req(Kind.POOLS, admin=True)
class PoolsRequest(Request):
    """The pools, their layouts and usage."""

    id: int


@_req(Kind.PING, admin=True)
class PingRequest(Request):
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
class LookupResult(Result):
    """``cached`` leading blocks; with a hold, their ids and the hold (0: nothing held)."""

    cached: int
    blocks: Blocks
    hold: int


@_res
class GrantResult(Result):
    """The hold and its fresh block ids."""

    hold: int
    blocks: Blocks


@_res
class PublishResult(Result):
    """How many blocks became cached (a key cached already leaves its block private)."""

    published: int


@_res
class ReleaseResult(Result):
    """How many blocks were let go."""

    released: int


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
    Kind.LOOKUP: LookupResult,
    Kind.GRANT: GrantResult,
    Kind.PUBLISH: PublishResult,
    Kind.RELEASE: ReleaseResult,
    Kind.BATCH: BatchResult,
    Kind.STATS: InfoResult,
    Kind.CHECK: CheckResult,
    Kind.FLUSH: FlushResult,
    Kind.CLIENTS: InfoResult,
    Kind.POOLS: InfoResult,
    Kind.PING: PingResult,
}
