"""The sans-I/O core of the client: every operation defined once, for both clients.

An operation is a generator (`Op`): it checks its arguments, yields the
request to send, receives the `OkReply` (or has the error thrown into it),
interprets the result, updates local state (block tables, copy-on-write
copies on the pool mapping) and returns its value. It never touches a
socket: the blocking and the async driver each run the same generators, and
a batch runs several of them on one round trip. Drivers:

1. ``out = op.send(None)``; encode it with `ClientSession.encode`, send it;
2. read messages and pass each to `ClientSession.accept` until it returns the
   reply (`None` means a notice or a stale reply: keep reading);
3. ``op.send(reply)``, or ``op.throw(error)`` for a `KvdError`; repeat
   until ``StopIteration`` carries the value;
4. finally `ClientSession.deliver_notices`.

Sequences and pins remember the session *generation* they were made in;
``SESSION_LOST`` bumps the generation, which makes every older object raise
`SessionLost`, and clears the session so that `ClientSession.ensure` sends a new
hello before the next session operation.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from kvd_client.errors import (
    InternalError,
    InvalidRequest,
    KvdError,
    NotFound,
    SessionLost,
    TooLarge,
    error_from_reply,
)
from kvd_client.pool import PoolMapping, open_pool
from kvd_client.wire import (
    MAX_MESSAGE_BYTES,
    MAX_NAME_LEN,
    PROTOCOL_VERSION,
    AllocateRequest,
    AllocateResult,
    AppendRequest,
    AppendResult,
    BatchResult,
    CanAllocateRequest,
    CanAllocateResult,
    CheckRequest,
    CheckResult,
    ClientsRequest,
    Code,
    CommitRequest,
    CommitResult,
    ErrorReply,
    FlushRequest,
    FlushResult,
    ForkRequest,
    ForkResult,
    FreeRequest,
    GoodbyeRequest,
    GrantRequest,
    GrantResult,
    HeartbeatRequest,
    HelloRequest,
    HelloResult,
    InfoResult,
    LookupRequest,
    LookupResult,
    Notice,
    OkReply,
    OpResult,
    PingRequest,
    PingResult,
    PinRequest,
    PinResult,
    PoolLayout,
    PoolsRequest,
    ProtocolError,
    PublishRequest,
    PublishResult,
    ReleaseRequest,
    ReleaseResult,
    Request,
    Result,
    StatsRequest,
    TruncateRequest,
    TruncateResult,
    UnpinRequest,
    decode_reply,
    encode_batch,
)
from kvd_client.wire.hashing import BlockHasher

__all__ = [
    "Admission",
    "ClientSession",
    "Deferred",
    "Identity",
    "Op",
    "Outgoing",
    "PinState",
    "SeqState",
]

T = TypeVar("T")
R = TypeVar("R", bound=Result)


class Outgoing(Protocol):
    """What an operation yields: a message with an id that encodes to frames."""

    @property
    def id(self) -> int: ...

    def encode(self) -> list[bytes]: ...


#: An operation: yields requests, receives their OK replies, returns its value.
Op: TypeAlias = Generator[Outgoing, OkReply, T]

NoticeCallback: TypeAlias = Callable[[Notice], None]


@dataclass(frozen=True, slots=True)
class Identity:
    """Who the client is, sent in every hello (``pool=None``: operator connection)."""

    pool: str | None
    name: str
    namespace: str = ""
    adapter: str | None = None
    #: The layout the client requires (refused with MISMATCH when it differs).
    layout: PoolLayout | None = None
    hash_seed: str | None = None
    #: Create the pool for ``layout`` when the daemon has none of that name
    #: (on ``backend``/``device``, the daemon's default backend when None).
    create: bool = False
    backend: str | None = None
    device: int | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    """Answer of ``can_allocate``: truthy when the allocation would be admitted now."""

    ok: bool
    #: Blocks this session could take now.
    available: int

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True, slots=True)
class _OutgoingBatch:
    id: int
    ops: tuple[Request, ...]

    def encode(self) -> list[bytes]:
        return encode_batch(self.id, self.ops)


#: The keys of a successful batch entry (`OpResult` with ``ok`` and ``r``).
_OK_ENTRY: Final = frozenset({"ok", "r"})


def _result(cls: type[R], reply: OkReply) -> R:
    """Decode a result map, ignoring fields added by newer daemons."""
    try:
        return cls.from_map_lenient(reply.result, reply.extras)
    except ProtocolError as exc:
        raise InternalError(f"malformed {cls.__name__} from the daemon: {exc.message}") from None


def _name(value: object, what: str) -> str:
    if type(value) is not str or not value:
        raise InvalidRequest(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME_LEN:
        raise TooLarge(f"{what} is longer than {MAX_NAME_LEN} characters")
    return value


def _count(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise InvalidRequest(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _opt_count(value: object, what: str) -> int | None:
    return None if value is None else _count(value, what)


def _frozen(arr: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    """``arr``, read-only (decoded tables already are: setting the flag costs ~10x reading it)."""
    if arr.flags.writeable:
        arr.flags.writeable = False
    return arr


class ClientSession:
    """State of one connection: identity, hello result, ids, generation, pool mapping."""

    def __init__(self, identity: Identity, on_notice: NoticeCallback | None = None) -> None:
        self.identity = identity
        self.on_notice = on_notice
        #: Bumped whenever the session is lost or closed.
        self.generation = 0
        #: The hello result of the current session (None: not attached).
        self.info: HelloResult | None = None
        #: The pool's layout: as required, then as first attached (kept for re-attach).
        self.layout = identity.layout
        self.hash_seed = identity.hash_seed
        self.max_message_bytes = MAX_MESSAGE_BYTES
        self._ids = itertools.count(1)
        self._notices: list[Notice] = []
        self._pool: PoolMapping | None = None
        #: The pool's block hasher (set by each hello): the client computes the
        #: keys of its prompts' full blocks, so hashing runs in every client
        #: process in parallel, not in the daemon's one request thread.
        self.hasher: BlockHasher | None = None

    # -- the wire -----------------------------------------------------------

    def next_id(self) -> int:
        """A fresh request id (ids start at 1; 0 marks notices)."""
        return next(self._ids)

    def encode(self, out: Outgoing) -> list[bytes]:
        """Frames of ``out``; `InvalidRequest` for bad token ids, `TooLarge` above the limit.

        The payload encoding is the client's one check of token ids (the
        daemon checks them again when it decodes: it trusts no client).
        """
        try:
            frames = out.encode()
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        size = sum(map(len, frames))
        if size > self.max_message_bytes:
            raise TooLarge(f"request of {size} bytes exceeds {self.max_message_bytes}")
        return frames

    def accept(self, frames: Sequence[bytes], req_id: int) -> OkReply | None:
        """The reply to ``req_id``, or None for a notice (queued) or a stale reply.

        An error reply raises its `KvdError` (``SESSION_LOST`` also loses the
        session); an error without a readable id answers the request in flight.
        """
        try:
            reply = decode_reply(frames)
        except ProtocolError as exc:
            raise InternalError(f"malformed reply from the daemon: {exc.message}") from None
        if isinstance(reply, Notice):
            self._notices.append(reply)
            return None
        if isinstance(reply, ErrorReply):
            if reply.id is not None and reply.id != req_id:
                return None
            raise self.error(reply.code, reply.msg)
        if reply.id != req_id:
            return None
        return reply

    def error(self, code: str, message: str) -> KvdError:
        """The exception for an error code; ``SESSION_LOST`` loses the session first."""
        if code == Code.SESSION_LOST:
            self.lose()
        return error_from_reply(code, message)

    def deliver_notices(self) -> None:
        """Hand queued notices to the callback (after the operation completed)."""
        if not self._notices:  # the common case: nothing arrived
            return
        notices, self._notices = self._notices, []
        if self.on_notice is not None:
            for notice in notices:
                self.on_notice(notice)

    # -- the session --------------------------------------------------------

    def lose(self) -> None:
        """Forget the session: older sequences and pins become dead."""
        self.generation += 1
        self.info = None

    @property
    def attached(self) -> bool:
        return self.info is not None

    def require_session(self) -> None:
        if self.identity.pool is None:
            raise InvalidRequest(
                "this connection has no pool (operator connection): connect with pool=NAME"
            )

    def hello(self) -> Op[HelloResult]:
        """Open (or re-open) the session."""
        self.require_session()
        ident = self.identity
        assert ident.pool is not None
        reply = yield HelloRequest(
            id=self.next_id(),
            version=PROTOCOL_VERSION,
            pool=ident.pool,
            name=ident.name,
            pid=os.getpid(),
            namespace=ident.namespace,
            adapter=ident.adapter,
            layout=None if self.layout is None else self.layout.to_dict(),
            hash_seed=self.hash_seed,
            # Only sent when asked: a plain hello stays byte-identical to older clients'.
            create=True if ident.create else None,
            backend=ident.backend if ident.create else None,
            device=ident.device if ident.create else None,
        )
        res = _result(HelloResult, reply)
        try:
            layout = PoolLayout.from_dict(res.layout)
        except (ValueError, TypeError) as exc:
            raise InternalError(f"the daemon sent a bad pool layout: {exc}") from None
        # Re-resolve the mapping lazily: the per-process cache (keyed by the
        # file's identity) returns the same mapping for the same memory and a
        # fresh one when a restarted daemon re-created it, even at the same path.
        self._pool = None
        self.layout = layout
        self.hash_seed = res.hash_seed
        if (
            self.hasher is None
            or self.hasher.block_size != layout.block_size
            or self.hasher.seed != res.hash_seed
        ):
            self.hasher = BlockHasher(layout.block_size, res.hash_seed)
        self.max_message_bytes = min(res.max_message_bytes, MAX_MESSAGE_BYTES)
        self.info = res
        return res

    def ensure(self) -> Op[None]:
        """Attach first when the session was lost (the automatic re-attach)."""
        if self.info is None and self.identity.pool is not None:
            yield from self.hello()

    def fence(self) -> None:
        """Fence the pool mapping, when this process mapped it, before blocks change hands."""
        if self._pool is not None:
            self._pool.fence()

    def pool(self) -> PoolMapping:
        """The pool's memory in this process (mapped on first use, shared per process)."""
        if self._pool is None:
            if self.info is None or self.layout is None:
                raise SessionLost("not attached: the pool is known after the next call")
            self._pool = open_pool(self.info.memory, self.layout)
        return self._pool

    # -- session operations -------------------------------------------------

    def allocate(
        self,
        seq_id: str,
        tokens: npt.ArrayLike,
        reserve: int | None = None,
        keys: Sequence[bytes] | None = None,
    ) -> Op[SeqState]:
        """Allocate ``seq_id`` for ``tokens`` (longest cached prefix first);
        ``keys``: the caller's keys of its full blocks (else computed here)."""
        self.require_session()
        arr = np.asarray(tokens)
        req = AllocateRequest(
            id=self.next_id(),
            seq=_name(seq_id, "sequence id"),
            tokens=arr,
            reserve=_opt_count(reserve, "reserve"),
            keys=self._prompt_keys(arr) if keys is None else list(keys),
        )
        res = _result(AllocateResult, (yield req))
        return SeqState(
            self, seq_id, res.table, length=len(req.tokens), committed=0, cached=res.cached
        )

    def _prompt_keys(self, tokens: npt.NDArray[Any]) -> list[bytes] | None:
        """The keys of the full blocks of a new sequence's ``tokens``.

        None before the first hello (an operation queued in a batch before the
        session opened): the daemon then hashes them itself, with the same result.
        """
        hasher, info = self.hasher, self.info
        if hasher is None or info is None or tokens.ndim != 1 or len(tokens) < hasher.block_size:
            return None
        try:
            return hasher.keys(
                tokens, None, namespace=info.namespace, adapter=self.identity.adapter
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    def block_keys(
        self, tokens: npt.ArrayLike, parent: bytes | None = None, first_block: int = 0
    ) -> list[bytes]:
        """The kvd keys of the full blocks of ``tokens`` in this session's
        namespace and adapter (``parent``: the key before ``tokens[0]``)."""
        hasher, info = self.hasher, self.info
        if hasher is None or info is None:
            raise SessionLost("no session yet: keys depend on the pool's block size and seed")
        try:
            return hasher.keys(
                np.asarray(tokens),
                parent,
                first_block=first_block,
                namespace=info.namespace,
                adapter=self.identity.adapter,
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    def lookup(self, keys: Sequence[bytes], hold: bool = False) -> Op[LookupResult]:
        """How many leading ``keys`` are cached; with ``hold``, their blocks held."""
        self.require_session()
        req = LookupRequest(id=self.next_id(), keys=list(keys), hold=True if hold else None)
        return _result(LookupResult, (yield req))

    def grant(self, n: int) -> Op[GrantResult]:
        """``n`` fresh blocks held for this process to write, then publish or release."""
        self.require_session()
        return _result(GrantResult, (yield GrantRequest(id=self.next_id(), n=_count(n, "n"))))

    def publish(
        self,
        hold: int,
        blocks: npt.ArrayLike,
        keys: Sequence[bytes],
        tokens: npt.ArrayLike,
        parent: bytes | None = None,
    ) -> Op[int]:
        """Granted ``blocks`` are written: cache them under ``keys``; how many were."""
        self.require_session()
        self.fence()
        req = PublishRequest(
            id=self.next_id(),
            hold=_count(hold, "hold"),
            blocks=np.asarray(blocks, dtype="<i4"),
            keys=list(keys),
            tokens=np.asarray(tokens),
            parent=parent,
        )
        return _result(PublishResult, (yield req)).published

    def release(self, hold: int, blocks: npt.ArrayLike | None = None) -> Op[int]:
        """Let go of ``blocks`` of ``hold`` (all when None); how many were released."""
        self.require_session()
        req = ReleaseRequest(
            id=self.next_id(),
            hold=_count(hold, "hold"),
            blocks=None if blocks is None else np.asarray(blocks, dtype="<i4"),
        )
        return _result(ReleaseResult, (yield req)).released

    def can_allocate(self, num_tokens: int, reserve: int | None = None) -> Op[Admission]:
        """Would an allocation of ``num_tokens`` (reserving ``reserve``) be admitted now?"""
        self.require_session()
        req = CanAllocateRequest(
            id=self.next_id(),
            tokens=_count(num_tokens, "num_tokens"),
            reserve=_opt_count(reserve, "reserve"),
        )
        res = _result(CanAllocateResult, (yield req))
        return Admission(res.ok, res.available)

    def heartbeat(self) -> Op[None]:
        """Renew the lease."""
        self.require_session()
        yield HeartbeatRequest(id=self.next_id())

    def goodbye(self) -> Op[None]:
        """Close the session (no-op when not attached); older objects become dead."""
        if self.info is None:
            return
        try:
            yield GoodbyeRequest(id=self.next_id())
        finally:
            self.lose()

    def run_batch(self, items: Sequence[Deferred[Any]], generation: int) -> Op[None]:
        """Send every queued operation in one `BatchRequest`, then settle each item."""
        if generation != self.generation:
            exc = SessionLost("the session was lost while this batch was being built")
            for item in items:
                item.fail(exc)
            raise exc
        if not items:
            return
        try:
            yield from self.ensure()
            self.fence()
            reply = yield _OutgoingBatch(self.next_id(), tuple(item.request for item in items))
            res = _result(BatchResult, reply)
            if len(res.results) != len(items):
                raise InternalError(f"{len(res.results)} batch results for {len(items)} ops")
        except BaseException as exc:
            failure = exc if isinstance(exc, Exception) else InternalError("batch interrupted")
            for item in items:
                item.fail(failure)
            raise
        for item, entry in zip(items, res.results, strict=True):
            item.settle(self, entry)

    # -- operator requests (no session needed) ------------------------------

    def stats(self, sections: Iterable[str] | None = None) -> Op[dict[str, Any]]:
        """Statistics by section (all when ``sections`` is None)."""
        names = None if sections is None else [_name(s, "section") for s in sections]
        reply = yield StatsRequest(id=self.next_id(), sections=names)
        return _result(InfoResult, reply).info

    def clients(self) -> Op[dict[str, Any]]:
        """The connected sessions."""
        return _result(InfoResult, (yield ClientsRequest(id=self.next_id()))).info

    def pools(self) -> Op[dict[str, Any]]:
        """The pools, their layouts and usage."""
        return _result(InfoResult, (yield PoolsRequest(id=self.next_id()))).info

    def check(self) -> Op[CheckResult]:
        """Run the daemon's invariant checks."""
        return _result(CheckResult, (yield CheckRequest(id=self.next_id())))

    def flush(self, namespace: str | None = None) -> Op[int]:
        """Drop evictable cached blocks (of ``namespace``); returns how many."""
        ns = None if namespace is None else _name(namespace, "namespace")
        return _result(FlushResult, (yield FlushRequest(id=self.next_id(), namespace=ns))).dropped

    def ping(self) -> Op[PingResult]:
        """The daemon's epoch and protocol version."""
        return _result(PingResult, (yield PingRequest(id=self.next_id())))


class SeqState:
    """Local state of one sequence: block table, lengths, liveness."""

    __slots__ = (
        "cached",
        "committed",
        "freed",
        "generation",
        "length",
        "seq_id",
        "session",
        "table",
    )

    def __init__(
        self,
        session: ClientSession,
        seq_id: str,
        table: npt.NDArray[np.int32],
        *,
        length: int,
        committed: int,
        cached: int,
    ) -> None:
        self.session = session
        self.seq_id = seq_id
        self.generation = session.generation
        self.table = _frozen(table)
        self.length = length
        self.committed = committed
        self.cached = cached
        self.freed = False

    @property
    def alive(self) -> bool:
        return not self.freed and self.generation == self.session.generation

    def check_alive(self) -> None:
        """Raise `SessionLost` for a sequence of a lost session, `NotFound` once freed."""
        if self.generation != self.session.generation:
            raise SessionLost(f"sequence {self.seq_id!r} belonged to a session that is gone")
        if self.freed:
            raise NotFound(f"sequence {self.seq_id!r} was freed")

    def commit(self, n: int | None = None) -> Op[CommitResult]:
        """The first ``n`` tokens (all when None) are written."""
        self.check_alive()
        s = self.session
        s.fence()
        req = CommitRequest(id=s.next_id(), seq=self.seq_id, n=_opt_count(n, "n"))
        res = _result(CommitResult, (yield req))
        self.committed = res.committed
        return res

    def append(self, tokens: npt.ArrayLike) -> Op[None]:
        """Grow by ``tokens``; performs the reply's copy-on-write copies on the pool."""
        self.check_alive()
        s = self.session
        res = _result(
            AppendResult,
            (yield AppendRequest(id=s.next_id(), seq=self.seq_id, tokens=np.asarray(tokens))),
        )
        if not 0 <= res.start <= len(self.table) or len(res.copies) % 2:
            raise InternalError(f"inconsistent append result for {self.seq_id!r}: {res}")
        if res.start != len(self.table) or len(res.blocks):
            self.table = _frozen(np.concatenate((self.table[: res.start], res.blocks)))
        self.length = res.length
        if len(res.copies):
            # State first: a failing copy must not leave the table behind the daemon's.
            s.pool().copy_blocks(res.copies[0::2].tolist(), res.copies[1::2].tolist())

    def fork(self, child_id: str, reserve: int | None = None) -> Op[SeqState]:
        """A new sequence ``child_id`` sharing every block."""
        self.check_alive()
        s = self.session
        req = ForkRequest(
            id=s.next_id(),
            seq=self.seq_id,
            child=_name(child_id, "child sequence id"),
            reserve=_opt_count(reserve, "reserve"),
        )
        res = _result(ForkResult, (yield req))
        return SeqState(
            s,
            child_id,
            res.table,
            length=self.length,
            committed=self.committed,
            cached=self.cached,
        )

    def truncate(self, n: int) -> Op[None]:
        """Keep the first ``n`` tokens."""
        self.check_alive()
        s = self.session
        s.fence()
        res = _result(
            TruncateResult,
            (yield TruncateRequest(id=s.next_id(), seq=self.seq_id, n=_count(n, "n"))),
        )
        if not 0 <= res.num_blocks <= len(self.table):
            raise InternalError(f"inconsistent truncate result for {self.seq_id!r}: {res}")
        self.table = self.table[: res.num_blocks]
        self.length = res.length
        self.committed = min(self.committed, res.length)
        self.cached = min(self.cached, res.length)

    def free(self) -> Op[None]:
        """Release the sequence (committed full blocks stay cached)."""
        self.check_alive()
        self.session.fence()
        yield FreeRequest(id=self.session.next_id(), seq=self.seq_id)
        self.freed = True

    def pin(self, n: int | None = None) -> Op[PinState]:
        """Pin the committed full blocks of the first ``n`` tokens."""
        self.check_alive()
        s = self.session
        res = _result(
            PinResult, (yield PinRequest(id=s.next_id(), seq=self.seq_id, n=_opt_count(n, "n")))
        )
        return PinState(s, res.pin, res.blocks)


class PinState:
    """A pin held by this session."""

    __slots__ = ("blocks", "generation", "pin_id", "released", "session")

    def __init__(self, session: ClientSession, pin_id: int, blocks: int) -> None:
        self.session = session
        self.pin_id = pin_id
        self.blocks = blocks
        self.generation = session.generation
        self.released = False

    def unpin(self) -> Op[None]:
        """Release the pin."""
        if self.generation != self.session.generation:
            raise SessionLost(f"pin {self.pin_id} belonged to a session that is gone")
        if self.released:
            raise NotFound(f"pin {self.pin_id} was released")
        yield UnpinRequest(id=self.session.next_id(), pin=self.pin_id)
        self.released = True


class Deferred(Generic[T]):
    """One operation queued in a batch: its request now, its outcome after the send.

    Creating it runs the operation's local checks (bad arguments raise here,
    before anything is queued).
    """

    __slots__ = ("_done", "_error", "_id", "_op", "_value", "request")

    def __init__(self, op: Op[T]) -> None:
        out = next(op)
        if not isinstance(out, Request) or not out.BATCHABLE:
            op.close()
            raise InvalidRequest(f"{type(out).__name__} cannot be batched")
        self._op = op
        self._id = out.id
        self.request: Request = out
        self._done = False
        self._value: T | None = None
        self._error: Exception | None = None

    @property
    def done(self) -> bool:
        """Whether the batch was sent and this operation has an outcome."""
        return self._done

    def result(self) -> T:
        """The operation's value; raises its error when it failed."""
        if not self._done:
            raise RuntimeError("the batch has not been sent yet")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def exception(self) -> Exception | None:
        """The operation's error (a `KvdError`, or a local failure), None on success."""
        if not self._done:
            raise RuntimeError("the batch has not been sent yet")
        return self._error

    def fail(self, exc: Exception) -> None:
        """Settle as failed (the whole batch failed before this op ran)."""
        if not self._done:
            self._op.close()
            self._error, self._done = exc, True

    def settle(self, session: ClientSession, entry: Any) -> None:
        """Feed this operation its entry of the batch reply."""
        try:
            r = entry.get("ok") is True and entry.get("r") if type(entry) is dict else None
            if type(r) is dict and entry.keys() <= _OK_ENTRY:
                # The common well-formed success, without decoding an OpResult first.
                self._op.send(OkReply(self._id, r))
            else:
                res = _result(OpResult, OkReply(self._id, entry if type(entry) is dict else {}))
                if res.ok:
                    self._op.send(OkReply(self._id, res.r or {}))
                else:
                    self._op.throw(session.error(str(res.code), str(res.msg)))
            self._op.close()
            raise InternalError(f"{type(self.request).__name__} expected one reply")
        except StopIteration as stop:
            self._value, self._done = stop.value, True
        except Exception as exc:
            # Per-op outcome: an error (or a failed local update such as a
            # copy-on-write copy) belongs to this op, not to the whole batch.
            self._error, self._done = exc, True
