"""Requests in, replies out: decode, dispatch by kind, call the handler, encode.

`Dispatcher.handle` takes one client message (frames after the routing id)
and returns the reply frames; it never raises. Decoding is the wire
contract's typed decoders (`kvd_client.wire.decode_request`): no pickle,
no method names on the wire; each kind maps to one handler in a table
built at start.

Outcomes and their replies:

- `ProtocolError` (malformed frames, wrong types, sizes): its code, with
  the request id when one could be read.
- `RequestError` (a handler's or the policy's refusal) and the engine's
  `EngineError` (unknown sequence, duplicate id, bad argument): their code;
  both are raised before anything changes.
- `Refusal` (OUT_OF_BLOCKS, QUOTA_EXCEEDED): its code, nothing changed.
- Anything else is a daemon bug: INTERNAL, logged with its traceback. The
  handlers check before they mutate, so no rollback is attempted here.

Admin kinds (STATS, CHECK, FLUSH, CLIENTS, POOLS, PING) need no session:
the socket file's mode is the access control, and with ``security.admins``
set, kinds other than PING need an admin principal (FORBIDDEN). Every
other kind but HELLO needs a session opened by HELLO on the same
connection, else SESSION_LOST. A session's rate beyond ``security.rate_limit``
is RATE_LIMITED (one shared bucket without a session).

Engine calls are microseconds and run inline in the daemon's request
thread, one at a time. A batch, though, may carry `wire.MAX_BATCH_OPS`
operations (2,048 allocates: ~50 ms), so `handle_sliced` runs a long one
as a `BatchRun`, a slice of operations (`BATCH_SLICE_NS` of work) at a
time, and the request thread serves other connections' messages between
slices (docs/architecture.md, "Request path"). Each operation stays
atomic, as BATCH promises (each runs on its own, in order); the batch's
reply goes out when its last operation is done. Every batch of a pool
with a tier runs as a `BatchRun` too: an operation whose prefix continues
into the tier pauses it until its promotion is done (`kvd.server.tiers`).
The one blocking step a request can need, creating a runtime pool, is not
run here: the hello's handler answers a `PendingHello`, `handle` returns
no frames, and the daemon creates the pool off the request thread and
asks `finish_hello` for the reply.
"""

from __future__ import annotations

import time
import typing
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import structlog
from kvd_client import wire

from kvd.config import Config
from kvd.engine import EngineError, Refusal
from kvd.errors import RequestError
from kvd.server.context import Call, Outcome, ServerState, SessionCall
from kvd.server.handshake import Handshake, PendingHello
from kvd.server.holds import HoldHandlers
from kvd.server.info import Info
from kvd.server.pools import PoolRefusal, Pools
from kvd.server.security import NamespacePolicy, RateLimiter, RequestLimits
from kvd.server.sequences import SequenceHandlers
from kvd.server.sessions import HELLO_WAITING, PeerCred, SessionTable
from kvd.server.tiers import PendingPromotion, Tiers

__all__ = ["BATCH_SLICE_NS", "DRAIN_REFUSED", "BatchRun", "Dispatcher"]

log = structlog.get_logger("kvd.server")

#: Kinds refused with SHUTTING_DOWN while draining: they start new work.
#: Running sequences may still append, commit, truncate, free and unpin.
DRAIN_REFUSED: Final = frozenset(
    {
        wire.Kind.HELLO,
        wire.Kind.ALLOCATE,
        wire.Kind.FORK,
        wire.Kind.PIN,
        wire.Kind.GRANT,
        wire.Kind.FLUSH,
    }
)

#: Work (ns) of one slice of a long batch before other messages are served.
BATCH_SLICE_NS: Final = 200_000
#: A batch of more operations than this may be sliced (fewer run at once).
_SLICE_MIN_OPS: Final = 16

#: Kind names for stats, looked up once (Enum.name is a descriptor call).
_KIND_NAMES: Final = {kind: kind.name for kind in wire.Kind}
# Plain ints: an enum member's attribute lookup costs more than the dict lookup it feeds.
_HELLO: Final = int(wire.Kind.HELLO)
_FLUSH: Final = int(wire.Kind.FLUSH)
_BATCH: Final = int(wire.Kind.BATCH)
#: Extra frames of a result without token fields (never appended to).
_NO_FRAMES: Final[list[bytes]] = []

C = TypeVar("C", Call, SessionCall)
R = TypeVar("R")
_SessionHandler = Callable[[Any, SessionCall], Outcome | PendingPromotion]
_OpenHandler = Callable[[Any, Call], Outcome | PendingHello]


class Dispatcher:
    """The daemon's request handling, independent of sockets and the event loop.

    ``on_events`` receives each pool's engine events after every request
    (None: the engines keep none); ``observe(kind, seconds)`` is told each
    request's service time (the metrics histogram).
    """

    def __init__(
        self,
        config: Config,
        pools: Pools,
        sessions: SessionTable,
        *,
        epoch: int,
        addresses: Sequence[str],
        on_events: Callable[[str, list[Any]], None] | None = None,
        observe: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = ServerState(config, pools, sessions, epoch, list(addresses), clock)
        self.on_events = on_events
        self.observe = observe
        sec = config.security
        self.policy = NamespacePolicy.from_config(
            sec.namespaces, enforce=sec.enforce_namespaces, admins=sec.admins
        )
        self.limiter = RateLimiter(sec.rate_limit, sec.rate_burst) if sec.rate_limit else None
        publish = self._publish_events if on_events is not None else None
        self.handshake = Handshake(self.state, self.policy, self.limiter, publish)
        self.info = Info(self.state)
        self._pending: list[PendingHello] = []
        #: Connections whose hello waits for its pool's creation (one each: more
        #: would queue without bound while a large pool is being made).
        self._creating: set[bytes] = set()
        self.tiers = Tiers(self.state, on_events, self.finish_promotion)
        if config.memory.runtime_pool_tier_factor or any(
            p.tier_blocks or p.remote_tier for p in config.pools
        ):
            self.info.sections["tiers"] = self.tiers.stats
        limits = RequestLimits(sec.max_tokens_per_request, sec.max_sequences_per_session)
        seq = SequenceHandlers(limits, self.tiers)
        holds = HoldHandlers(limits, self.tiers)
        self._session_table: dict[int, _SessionHandler] = {
            wire.Kind.HEARTBEAT: self.handshake.heartbeat,
            wire.Kind.GOODBYE: self.handshake.goodbye,
            wire.Kind.ALLOCATE: seq.allocate,
            wire.Kind.COMMIT: seq.commit,
            wire.Kind.APPEND: seq.append,
            wire.Kind.FORK: seq.fork,
            wire.Kind.TRUNCATE: seq.truncate,
            wire.Kind.FREE: seq.free,
            wire.Kind.PIN: seq.pin,
            wire.Kind.UNPIN: seq.unpin,
            wire.Kind.CAN_ALLOCATE: seq.can_allocate,
            wire.Kind.LOOKUP: holds.lookup,
            wire.Kind.GRANT: holds.grant,
            wire.Kind.PUBLISH: holds.publish,
            wire.Kind.RELEASE: holds.release,
            wire.Kind.BATCH: self._batch,
        }
        self._open_table: dict[int, _OpenHandler] = {
            wire.Kind.HELLO: self.handshake.hello,
            wire.Kind.STATS: self.info.stats_request,
            wire.Kind.CHECK: self.info.check,
            wire.Kind.FLUSH: self.info.flush,
            wire.Kind.CLIENTS: self.info.clients,
            wire.Kind.POOLS: self.info.pools,
            wire.Kind.PING: self.info.ping,
        }
        missing = set(wire.REQUESTS) - set(self._session_table) - set(self._open_table)
        if missing:  # a new request kind in the contract needs its handler
            raise AssertionError(f"no handler for kinds {sorted(missing)}")

    # ------------------------------------------------------------------
    # Entry point

    def handle(
        self,
        identity: bytes,
        frames: Sequence[bytes],
        peer: PeerCred | None = None,
        user_id: str | None = None,
    ) -> list[bytes]:
        """The reply frames (without routing id) for one message; never raises.

        ``peer``: the ipc connection's kernel credentials; ``user_id``: the
        tcp client's CURVE key (z85). Both only matter for HELLO and admin
        kinds. No frames: a hello waits for its pool to be created
        (`take_pending`, then `finish_hello`).
        """
        t0 = time.perf_counter_ns()
        kind, ops, reply = self._reply(identity, frames, peer, user_id)
        assert not isinstance(reply, BatchRun)  # only when sliced
        if reply:
            self._record(kind, ops, time.perf_counter_ns() - t0)
        return reply

    def handle_sliced(
        self,
        identity: bytes,
        frames: Sequence[bytes],
        peer: PeerCred | None = None,
        user_id: str | None = None,
    ) -> list[bytes] | BatchRun:
        """As `handle`, but a long batch comes back as a `BatchRun` whose first
        slice has run: call its `step` (under the same lock as this) until it
        returns the reply frames, serving other messages in between."""
        t0 = time.perf_counter_ns()
        kind, ops, reply = self._reply(identity, frames, peer, user_id, sliced=True)
        if isinstance(reply, BatchRun):
            reply.elapsed_ns += time.perf_counter_ns() - t0
            return reply
        if reply:
            self._record(kind, ops, time.perf_counter_ns() - t0)
        return reply

    def _record(self, kind: str, ops: int, elapsed_ns: int) -> None:
        self.state.rpc.record(kind, elapsed_ns, ops)
        if self.observe is not None:
            self.observe(kind.lower(), elapsed_ns / 1e9)

    def _reply(
        self,
        identity: bytes,
        frames: Sequence[bytes],
        peer: PeerCred | None,
        user_id: str | None,
        sliced: bool = False,
    ) -> tuple[str, int, list[bytes] | BatchRun]:
        """(kind name for stats, operations carried, reply frames or, ``sliced``,
        the run of a long batch)."""
        try:
            if len(frames) > 2 and sum(map(len, frames)) > wire.MAX_MESSAGE_BYTES:
                raise wire.ProtocolError(
                    wire.Code.TOO_LARGE, f"message larger than {wire.MAX_MESSAGE_BYTES} bytes"
                )
            req = wire.decode_request(frames)
        except wire.ProtocolError as exc:
            return "INVALID", 1, self._error(exc.req_id, exc.code, exc.message)
        req_id: int = req.id  # type: ignore[attr-defined]
        kind = req.KIND
        name = _KIND_NAMES[kind]
        ops = len(req.ops) if kind == _BATCH else 1  # type: ignore[attr-defined]
        state = self.state
        try:
            if req.ADMIN or kind == _HELLO:
                self._limit(None)
                call = Call(identity, peer, frames[2:], user_id)
                if req.ADMIN and self.policy.admins:
                    refusal = self.policy.check_admin(call.principal, kind)
                    if refusal is not None:
                        raise refusal
                elif kind == _FLUSH:
                    namespace = typing.cast(wire.FlushRequest, req).namespace
                    refusal = self.policy.check_flush(call.principal, namespace)
                    if refusal is not None:
                        raise refusal
                if kind == _HELLO and identity in self._creating:
                    raise RequestError(wire.Code.BUSY, HELLO_WAITING)
                outcome = self._run_open(req, call)
                if isinstance(outcome, PendingHello):
                    self._creating.add(identity)
                    self._pending.append(outcome)
                    return name, ops, []
            else:
                session = state.sessions.lookup(identity)
                if session is None:
                    raise RequestError(
                        wire.Code.SESSION_LOST,
                        "no session for this connection (daemon restarted, lease expired, "
                        "or no hello); old sequences are gone: send hello again",
                    )
                self._limit(session.id)
                engine = state.pools[session.pool].engine
                scall = SessionCall(identity, frames[2:], session, engine)
                if (
                    sliced
                    and kind == _BATCH
                    and ops <= wire.MAX_BATCH_OPS
                    and (ops > _SLICE_MIN_OPS or engine.tier is not None)
                ):
                    run = BatchRun(self, typing.cast(wire.BatchRequest, req), scall)
                    if run.step() is not None:
                        return name, ops, run.reply
                    return name, ops, [] if run.paused else run
                done = self._run(req, scall)
                if isinstance(done, PendingPromotion):  # answered by finish_promotion
                    return name, ops, []
                outcome = done
        except RequestError as exc:
            return name, ops, self._error(req_id, exc.code, exc.message)
        if isinstance(outcome, Refusal):
            return name, ops, self._error(req_id, wire.Code(outcome.code), outcome.message)
        return name, ops, wire.encode_ok(req_id, outcome)

    def _limit(self, session_id: int | None) -> None:
        """RATE_LIMITED beyond the session's rate (one shared bucket without a session)."""
        if self.limiter is not None:
            refusal = self.limiter.check(session_id, self.state.clock())
            if refusal is not None:
                raise refusal

    def _run(self, req: wire.Request, call: SessionCall) -> Outcome | PendingPromotion:
        """One session request (or batch op) through its handler; errors become RequestError."""
        return self._guard(req, self._session_table[req.KIND], call)

    def _run_open(self, req: wire.Request, call: Call) -> Outcome | PendingHello:
        """A hello or an admin request through its handler."""
        return self._guard(req, self._open_table[req.KIND], call)

    def _guard(self, req: wire.Request, handler: Callable[[Any, C], R], call: C) -> R:
        if self.state.draining and req.KIND in DRAIN_REFUSED:
            raise RequestError(wire.Code.SHUTTING_DOWN, "the daemon is shutting down")
        try:
            return handler(req, call)
        except (RequestError, wire.ProtocolError):
            raise
        except EngineError as exc:
            raise RequestError(wire.Code(str(exc.code)), exc.message) from None
        except Exception:
            log.exception("internal_error", kind=req.KIND.name)
            raise RequestError(
                wire.Code.INTERNAL, "internal error (logged by the daemon); nothing was changed"
            ) from None
        finally:
            if self.on_events is not None:
                self._publish_events()

    def _batch(self, req: wire.BatchRequest, call: SessionCall) -> Outcome:
        if len(req.ops) > wire.MAX_BATCH_OPS:
            raise RequestError(wire.Code.TOO_LARGE, f"more than {wire.MAX_BATCH_OPS} operations")
        # The batch's token frame is decoded once; each op takes a slice of it.
        call.extras = wire.TokenFrames(call.extras)
        call.defer = False  # answered in one go: its operations match the pool only
        results = []
        for op in req.ops:
            result = self._batch_op(op, call)
            assert not isinstance(result, PendingPromotion)
            results.append(result)
        return wire.BatchResult(results=results)

    def _batch_op(self, op: Any, call: SessionCall) -> dict[str, Any] | PendingPromotion:
        """One operation's `wire.OpResult` map (built directly: same keys, same
        order), or the promotion it waits for (`BatchRun` only)."""
        try:
            sub = wire.decode_batch_op(op, call.extras)
            outcome = self._run(sub, call)
        except (wire.ProtocolError, RequestError) as exc:
            return self._op_error(exc.code, exc.message)
        if isinstance(outcome, PendingPromotion):
            return outcome
        return self._op_map(outcome)

    def _op_map(self, outcome: Outcome) -> dict[str, Any]:
        """The `wire.OpResult` map of an operation's outcome."""
        if isinstance(outcome, Refusal):
            return self._op_error(wire.Code(outcome.code), outcome.message)
        # Results carry no token fields: nothing goes to extra frames.
        if isinstance(outcome, dict):
            return {"ok": True, "r": outcome}
        return {"ok": True, "r": outcome.to_map(_NO_FRAMES)}

    def _op_error(self, code: wire.Code, message: str) -> dict[str, Any]:
        self.state.rpc.error(code)
        return {"ok": False, "code": str(code), "msg": message}

    def _error(self, req_id: int | None, code: wire.Code, message: str) -> list[bytes]:
        self.state.rpc.error(code)
        return wire.encode_error(req_id, code, message)

    def _publish_events(self) -> None:
        assert self.on_events is not None
        for pool in self.state.pools:
            events = pool.engine.drain_events()
            if events:
                self.on_events(pool.name, events)

    # ------------------------------------------------------------------
    # Hellos waiting for a runtime pool

    def take_pending(self) -> list[PendingHello]:
        """The hellos deferred since the last call, oldest first (the daemon runs them)."""
        jobs, self._pending = self._pending, []
        return jobs

    def finish_hello(self, job: PendingHello, refusal: PoolRefusal | None) -> list[bytes]:
        """The reply to a deferred hello once its pool exists (or its creation's refusal).

        The hello is not decoded or checked twice: it attaches as any hello
        to an existing pool does (so a second creator with another layout
        gets MISMATCH).
        """
        t0 = time.perf_counter_ns()
        req_id = job.req.id
        self._creating.discard(job.call.identity)
        if refusal is not None:
            log.warning(
                "pool_refused", pool=job.config.name, code=str(refusal.code), reason=refusal.message
            )
            reply = self._error(req_id, refusal.code, refusal.message)
        else:
            try:
                result = self._guard(job.req, self.handshake.attach, job.call)
                reply = wire.encode_ok(req_id, result)
            except RequestError as exc:
                reply = self._error(req_id, exc.code, exc.message)
        self._record(_KIND_NAMES[wire.Kind.HELLO], 1, time.perf_counter_ns() - t0)
        return reply

    def finish_promotion(self, job: PendingPromotion) -> list[bytes]:
        """The reply to an allocate or lookup once its promotion is done (under
        the lock): it runs now, as if it had just arrived (SESSION_LOST when its
        session closed meanwhile). An operation of a batch goes into its
        `BatchRun`, which is then ready to `step` again: no frames."""
        if job.batch is not None:
            job.batch.resume(self._promoted_op(job))
            return []
        t0 = time.perf_counter_ns()
        req_id = job.req.id
        call = job.call
        if self.state.sessions.peek(call.identity) is not call.session:
            reply = self._error(req_id, wire.Code.SESSION_LOST, "the session closed")
        else:
            try:
                outcome = self._guard(job.req, job.run, call)
            except RequestError as exc:
                reply = self._error(req_id, exc.code, exc.message)
            else:
                reply = (
                    self._error(req_id, wire.Code(outcome.code), outcome.message)
                    if isinstance(outcome, Refusal)
                    else wire.encode_ok(req_id, outcome)
                )
        self._record(_KIND_NAMES[job.req.KIND], 1, time.perf_counter_ns() - t0)
        return reply

    def _promoted_op(self, job: PendingPromotion) -> dict[str, Any]:
        """The result map of a batch's operation whose promotion is done."""
        call = job.call
        if self.state.sessions.peek(call.identity) is not call.session:
            return self._op_error(wire.Code.SESSION_LOST, "the session closed")
        try:
            return self._op_map(self._guard(job.req, job.run, call))
        except RequestError as exc:
            return self._op_error(exc.code, exc.message)

    def refuse_shutting_down(self, frames: Sequence[bytes]) -> list[bytes]:
        """SHUTTING_DOWN for a message still queued when the daemon stops."""
        return self.refuse(frames, wire.Code.SHUTTING_DOWN, "the daemon stopped")

    def refuse(self, frames: Sequence[bytes], code: wire.Code, message: str) -> list[bytes]:
        """An error reply with ``code`` to a message not handled (its id if readable)."""
        try:
            req_id: int | None = getattr(wire.decode_request(frames), "id", None)
        except wire.ProtocolError as exc:
            req_id = exc.req_id
        return self._error(req_id, code, message)


class BatchRun:
    """A batch run a slice at a time (`Dispatcher.handle_sliced`).

    Each `step` runs operations in order for about `BATCH_SLICE_NS` and
    returns None while some are left, then the reply frames (also in
    ``reply``). Between steps other sessions' requests may run, as if they
    had arrived before the rest of the batch: each operation is atomic on
    its own, which is all a batch promises. A session closed meanwhile
    (pid gone, lease expired, goodbye) fails the operations left with
    SESSION_LOST, as a batch sent after the close would. An operation
    waiting for a tier promotion leaves the run ``paused`` (step returns
    None) until `resume` gives its result: the owner of the run must not
    step it meanwhile.
    """

    __slots__ = (
        "_call",
        "_d",
        "_next",
        "_ops",
        "_results",
        "elapsed_ns",
        "paused",
        "reply",
        "req_id",
    )

    def __init__(self, dispatcher: Dispatcher, req: wire.BatchRequest, call: SessionCall) -> None:
        self._d = dispatcher
        self._ops = req.ops
        self._call = call
        # The batch's token frame is decoded once; each op takes a slice of it.
        call.extras = wire.TokenFrames(call.extras)
        self._results: list[dict[str, Any]] = []
        self._next = 0
        self.req_id: int = req.id
        self.elapsed_ns = 0
        self.paused = False
        self.reply: list[bytes] = []

    def step(self) -> list[bytes] | None:
        """Run the next slice; the reply frames once the last operation ran."""
        d, call, ops, results = self._d, self._call, self._ops, self._results
        clock = time.perf_counter_ns
        t0 = clock()
        end = t0 + BATCH_SLICE_NS
        i, n = self._next, len(ops)
        if i and d.state.sessions.peek(call.identity) is not call.session:
            lost = {"ok": False, "code": str(wire.Code.SESSION_LOST), "msg": "the session closed"}
            for _ in range(n - i):
                d.state.rpc.error(wire.Code.SESSION_LOST)
                results.append(lost)
            i = n
        op_result = d._batch_op
        while i < n:
            result = op_result(ops[i], call)
            if isinstance(result, PendingPromotion):  # `resume` adds its result
                result.batch = self
                self.paused = True
                break
            results.append(result)
            i += 1
            if clock() >= end:
                break
        self._next = i
        self.elapsed_ns += clock() - t0
        if i < n:
            return None
        return self._done()

    def resume(self, result: dict[str, Any]) -> None:
        """The paused operation's result, once its promotion is done (under the
        lock): the run may `step` again."""
        self._results.append(result)
        self._next += 1
        self.paused = False

    def _done(self) -> list[bytes]:
        self.reply = wire.encode_ok(self.req_id, wire.BatchResult(results=self._results))
        self._d._record(_KIND_NAMES[wire.Kind.BATCH], len(self._ops), self.elapsed_ns)
        return self.reply
