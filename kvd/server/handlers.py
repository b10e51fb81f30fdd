"""Requests in, replies out: decode, dispatch by kind, call the engine, encode.

`Dispatcher.handle` takes one client message (frames after the routing id)
and returns the reply frames; it never raises. Decoding is the wire
contract's typed decoders (`kvd_client.wire.decode_request`): no
pickle, no method names on the wire; each kind maps to one handler in a
table built at start.

Outcomes and their replies:

- `ProtocolError` (malformed frames, wrong types, sizes): its code, with
  the request id when one could be read.
- Engine `EngineError` (unknown sequence, duplicate id, bad argument): its
  code; the engine raises before changing anything.
- `Refusal` (OUT_OF_BLOCKS, QUOTA_EXCEEDED): its code, nothing changed.
- Anything else is a daemon bug: INTERNAL, logged with its traceback. The
  engine checks before it mutates, so no rollback is attempted here.

Admin kinds (STATS, CHECK, FLUSH, CLIENTS, POOLS, PING) need no session:
the socket file's mode is the access control, and with ``security.admins``
set, kinds other than PING need an admin principal (FORBIDDEN). Every
other kind needs a session opened by HELLO on the same connection, else
SESSION_LOST.

Access policy (`kvd.server.security`), checked before anything moves: a
HELLO naming a namespace its principal (the ipc peer's uid/gid, the tcp
client's CURVE key) is not granted gets FORBIDDEN; a request beyond the
session's rate (one shared bucket without a session) RATE_LIMITED; too
many tokens in one allocate/append/fork, or a session's sequence beyond
``security.max_sequences_per_session``, TOO_LARGE.

Engine calls are microseconds and run inline in the daemon's request
thread (one at a time: see kvd.server.daemon). The one blocking step a
request can need, creating a runtime pool (a HELLO with ``create``), is
checked here and then *deferred*: `handle` returns no frames, the request
is queued as a `PoolCreation` for the daemon, which checks the memory
budget and creates the pool in a worker thread, adds it with `add_pool`
and handles the same HELLO again (now an attach).

`reload` applies what a re-read config may change on a running daemon
(admission quotas and thresholds, runtime-pool limits) and says what it
could not.
"""

from __future__ import annotations

import array
import dataclasses
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog
from kvd_client import wire
from kvd_client.wire import PoolLayout

import kvd
from kvd.config import BACKENDS, AdmissionConfig, Config, PoolConfig
from kvd.engine import Engine, Refusal
from kvd.engine.errors import EngineError, InvariantError
from kvd.engine.stats import EngineStats
from kvd.errors import ConfigError
from kvd.memory import PoolMemory
from kvd.memory.budget import format_bytes
from kvd.server.security import NamespacePolicy, Principal, RateLimiter, RequestLimits
from kvd.server.sessions import PeerCred, Session, SessionTable
from kvd.server.stats import RpcStats

__all__ = [
    "DRAIN_REFUSED",
    "RELOADABLE",
    "Dispatcher",
    "PoolCreation",
    "PoolRuntime",
    "ReloadReport",
    "RequestError",
]

log = structlog.get_logger("kvd.server")

#: Kinds refused with SHUTTING_DOWN while draining: they start new work.
#: Running sequences may still append, commit, truncate, free and unpin.
DRAIN_REFUSED: Final = frozenset(
    {wire.Kind.HELLO, wire.Kind.ALLOCATE, wire.Kind.FORK, wire.Kind.PIN, wire.Kind.FLUSH}
)


#: Config keys a SIGHUP applies to the running daemon (`Dispatcher.reload`).
#: The others need a restart; ``log`` is applied by the daemon's logging hook.
RELOADABLE: Final = frozenset(
    {
        "log.level",
        "log.format",
        "admission.session_quota_blocks",
        "admission.pressure_thresholds",
        "admission.namespaces",
        "memory.budget_bytes",
        "memory.headroom_bytes",
        "memory.runtime_pools",
        "memory.max_runtime_pools",
        "memory.runtime_pool_max_bytes",
        "memory.runtime_pool_backend",
    }
)

#: Kind names for stats, looked up once (Enum.name is a descriptor call).
_KIND_NAMES: Final = {kind: kind.name for kind in wire.Kind}
# Plain ints: an enum member's attribute lookup costs more than the dict lookup it feeds.
_HELLO: Final = int(wire.Kind.HELLO)
_BATCH: Final = int(wire.Kind.BATCH)


class RequestError(Exception):
    """A handler's refusal of a request (not a bug): replied with ``code``."""

    def __init__(self, code: wire.Code, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(slots=True)
class PoolRuntime:
    """One pool as the server holds it: its config, engine and memory."""

    config: PoolConfig
    engine: Engine
    memory: PoolMemory

    @property
    def name(self) -> str:
        """The pool's name."""
        return self.config.name

    @property
    def layout(self) -> PoolLayout:
        """The pool's layout."""
        return self.memory.layout


@dataclass(frozen=True, slots=True)
class PoolCreation:
    """A HELLO whose pool must be created first: the checked pool and the request to redo."""

    config: PoolConfig
    req_id: int
    identity: bytes
    frames: list[bytes]
    peer: PeerCred | None
    #: The CURVE key (z85) of a tcp client, as ZAP vouched for it.
    user_id: str | None = None


@dataclass(frozen=True, slots=True)
class ReloadReport:
    """What `Dispatcher.reload` did: the config now in force and the changed keys by fate."""

    config: Config
    #: Changed keys now in force (dotted names).
    applied: list[str]
    #: Changed keys or whole sections that take effect only after a restart.
    needs_restart: list[str]
    #: Changed reloadable keys that were refused, with why (the old value stays).
    refused: dict[str, str]


class _Deferred(Exception):
    """Raised by the HELLO handler once it queued a `PoolCreation` (no reply yet)."""


def _changed(old: Any, new: Any, prefix: str) -> list[str]:
    """Dotted names of the fields that differ between two config dataclasses."""
    return [
        f"{prefix}.{f.name}"
        for f in dataclasses.fields(old)
        if getattr(old, f.name) != getattr(new, f.name)
    ]


class _Ctx:
    """One message being handled: who sent it, its session and extra frames."""

    __slots__ = ("engine", "extras", "identity", "message", "peer", "session", "user_id")

    def __init__(
        self,
        identity: bytes,
        peer: PeerCred | None,
        session: Session | None,
        extras: Sequence[bytes],
        *,
        message: Sequence[bytes] = (),
        user_id: str | None = None,
    ) -> None:
        self.identity = identity
        self.peer = peer
        self.session = session
        self.extras = extras
        #: The whole message (kept for a request handled again later).
        self.message = message
        #: The CURVE key (z85) of a tcp client (ZAP's User-Id); None on ipc.
        self.user_id = user_id
        #: The session's pool's engine (set with the session).
        self.engine: Engine | None = None

    @property
    def principal(self) -> Principal:
        """Who sent it, as far as the kernel or CURVE vouches."""
        return Principal.of(self.peer, self.user_id)


#: A handler's answer: a result map as it goes on the wire (the hot kinds build it
#: directly, same keys and order as their `wire.Result`'s ``to_map``), a `wire.Result`,
#: or an engine refusal.
_Outcome = dict[str, Any] | wire.Result | Refusal
_Handler = Callable[[Any, _Ctx], _Outcome]


_LITTLE: Final = sys.byteorder == "little"


def _blocks(ids: Sequence[int]) -> bytes:
    """Block ids as the wire's int32 little-endian bytes (an array module copy:
    a fraction of numpy's cost for the few ids of one request)."""
    arr = array.array("i", ids)
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


#: The result map of kinds that answer nothing (free, unpin, heartbeat, goodbye).
_EMPTY: Final[dict[str, Any]] = {}
#: Extra frames of a result without token fields (never appended to).
_NO_FRAMES: Final[list[bytes]] = []


class Dispatcher:
    """The daemon's request handling, independent of sockets and the event loop.

    ``on_events`` receives each pool's engine events after every request
    (None: the engines keep none); ``observe(kind, seconds)`` is told each
    request's service time (the metrics histogram).
    """

    def __init__(
        self,
        config: Config,
        pools: dict[str, PoolRuntime],
        sessions: SessionTable,
        *,
        epoch: int,
        addresses: Sequence[str],
        on_events: Callable[[str, list[Any]], None] | None = None,
        observe: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pools = pools
        self.sessions = sessions
        self.epoch = epoch
        self.addresses = list(addresses)
        self.on_events = on_events
        self.observe = observe
        self.clock = clock
        self.started = clock()
        self.draining = False
        self.rpc = RpcStats(clock=clock)
        self.closed_sessions: Counter[str] = Counter()
        #: Sessions closed by lease expiry whose engine sessions (so their blocks) are
        #: kept until the deadline: (deadline, session), oldest first.
        self.quarantined: list[tuple[float, Session]] = []
        self._pressure: dict[str, int] = {}
        #: Pools created at runtime (by a client's hello), and those being created.
        self.runtime: set[str] = set()
        self.creating: set[str] = set()
        self._creations: list[PoolCreation] = []
        #: More stats sections by name (the daemon adds ``events`` when publishing).
        self.sections: dict[str, Callable[[], dict[str, Any]]] = {}
        sec = config.security
        self.policy = NamespacePolicy.from_config(
            sec.namespaces, enforce=sec.enforce_namespaces, admins=sec.admins
        )
        self.limiter = RateLimiter(sec.rate_limit, sec.rate_burst) if sec.rate_limit else None
        self.limits = RequestLimits(sec.max_tokens_per_request, sec.max_sequences_per_session)
        self._table: dict[int, _Handler] = {
            wire.Kind.HELLO: self._hello,
            wire.Kind.HEARTBEAT: self._heartbeat,
            wire.Kind.GOODBYE: self._goodbye,
            wire.Kind.ALLOCATE: self._allocate,
            wire.Kind.COMMIT: self._commit,
            wire.Kind.APPEND: self._append,
            wire.Kind.FORK: self._fork,
            wire.Kind.TRUNCATE: self._truncate,
            wire.Kind.FREE: self._free,
            wire.Kind.PIN: self._pin,
            wire.Kind.UNPIN: self._unpin,
            wire.Kind.CAN_ALLOCATE: self._can_allocate,
            wire.Kind.BATCH: self._batch,
            wire.Kind.STATS: self._stats,
            wire.Kind.CHECK: self._check,
            wire.Kind.FLUSH: self._flush,
            wire.Kind.CLIENTS: self._clients,
            wire.Kind.POOLS: self._pools,
            wire.Kind.PING: self._ping,
        }
        missing = set(wire.REQUESTS) - set(self._table)
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
        kinds. No frames: the request was deferred (a pool to create, see
        `take_creations`).
        """
        t0 = time.perf_counter_ns()
        kind, ops, reply = self._reply(identity, frames, peer, user_id)
        if not reply:
            return reply
        elapsed = time.perf_counter_ns() - t0
        self.rpc.record(kind, elapsed, ops)
        if self.observe is not None:
            self.observe(kind.lower(), elapsed / 1e9)
        return reply

    def _reply(
        self,
        identity: bytes,
        frames: Sequence[bytes],
        peer: PeerCred | None,
        user_id: str | None = None,
    ) -> tuple[str, int, list[bytes]]:
        """(kind name for stats, operations carried, reply frames)."""
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
        ops = len(req.ops) if kind == _BATCH else 1  # type: ignore[attr-defined]
        try:
            ctx = _Ctx(identity, peer, None, frames[2:], message=frames, user_id=user_id)
            if not req.ADMIN and kind != _HELLO:
                session = ctx.session = self.sessions.lookup(identity)
                if session is None:
                    raise RequestError(
                        wire.Code.SESSION_LOST,
                        "no session for this connection (daemon restarted, lease expired, "
                        "or no hello); old sequences are gone: send hello again",
                    )
                ctx.engine = self.pools[session.pool].engine
            if self.limiter is not None:
                denial = self.limiter.check(
                    ctx.session.id if ctx.session is not None else None, self.clock()
                )
                if denial is not None:
                    raise RequestError(denial.code, denial.message)
            if req.ADMIN and self.policy.admins:
                denial = self.policy.check_admin(ctx.principal, kind)
                if denial is not None:
                    raise RequestError(denial.code, denial.message)
            outcome = self._run(req, ctx)
        except _Deferred:
            return _KIND_NAMES[kind], ops, []
        except RequestError as exc:
            return _KIND_NAMES[kind], ops, self._error(req_id, exc.code, exc.message)
        if isinstance(outcome, Refusal):
            return (
                _KIND_NAMES[kind],
                ops,
                self._error(req_id, wire.Code(outcome.code), outcome.message),
            )
        return _KIND_NAMES[kind], ops, wire.encode_ok(req_id, outcome)

    def _run(self, req: wire.Request, ctx: _Ctx) -> _Outcome:
        """One request (or batch op) through its handler; errors become RequestError."""
        if self.draining and req.KIND in DRAIN_REFUSED:
            raise RequestError(wire.Code.SHUTTING_DOWN, "the daemon is shutting down")
        try:
            outcome = self._table[req.KIND](req, ctx)
        except (RequestError, wire.ProtocolError, _Deferred):
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
        return outcome

    def refuse_shutting_down(self, frames: Sequence[bytes]) -> list[bytes]:
        """SHUTTING_DOWN for a message still queued when the daemon stops (its id if readable)."""
        try:
            req_id: int | None = getattr(wire.decode_request(frames), "id", None)
        except wire.ProtocolError as exc:
            req_id = exc.req_id
        return self._error(req_id, wire.Code.SHUTTING_DOWN, "the daemon stopped")

    def _error(self, req_id: int | None, code: wire.Code, message: str) -> list[bytes]:
        self.rpc.error(code)
        return wire.encode_error(req_id, code, message)

    def _publish_events(self) -> None:
        assert self.on_events is not None
        for name, pool in self.pools.items():
            events = pool.engine.drain_events()
            if events:
                self.on_events(name, events)

    # ------------------------------------------------------------------
    # Sessions

    def close_session(self, session: Session, reason: str) -> None:
        """Close ``session`` in its engine (sequences freed, cached blocks kept) and forget it.

        A session whose lease expired without a pid to watch (tcp) is only
        forgotten: its engine session keeps every block for
        ``server.quarantine_leases`` leases more (`release_quarantined`), since
        the stopped process may resume and finish writing into them before
        its next call gets SESSION_LOST. Blocks handed to another client in
        the meantime would take that write.
        """
        self.sessions.remove(session)
        grace = self.config.server.quarantine_leases * self.sessions.lease_s
        quarantine = reason == "lease_expired" and session.watched_pid is None and grace > 0
        if quarantine:
            self.quarantined.append((self.clock() + grace, session))
        else:
            self.pools[session.pool].engine.close_session(session.id)
        self.closed_sessions[reason] += 1
        if self.limiter is not None:
            self.limiter.forget(session.id)
        if self.on_events is not None:
            self._publish_events()
        log.info(
            "session_closed",
            session=session.id,
            client=session.name,
            pid=session.pid,
            pool=session.pool,
            reason=reason,
            quarantine_s=grace if quarantine else None,
        )

    def release_quarantined(self) -> int:
        """Free the blocks of quarantined sessions whose grace is over; how many were released."""
        now = self.clock()
        done = 0
        while self.quarantined and self.quarantined[0][0] <= now:
            _, session = self.quarantined.pop(0)
            self.pools[session.pool].engine.close_session(session.id)
            done += 1
            log.info("quarantine_released", session=session.id, pool=session.pool)
        if done and self.on_events is not None:
            self._publish_events()
        return done

    def _hello(self, req: wire.Hello, ctx: _Ctx) -> _Outcome:
        if req.version != wire.PROTOCOL_VERSION:
            raise RequestError(
                wire.Code.VERSION,
                f"client speaks protocol {req.version}, daemon speaks {wire.PROTOCOL_VERSION}",
            )
        if self.policy.enforce:
            denial = self.policy.check_namespace(ctx.principal, req.namespace)
            if denial is not None:
                raise RequestError(denial.code, denial.message)
        pool = self.pools.get(req.pool)
        if pool is None:
            if req.create:
                self._defer_creation(req, ctx)
            raise RequestError(
                wire.Code.NOT_FOUND, f"no pool {req.pool!r} (have: {', '.join(sorted(self.pools))})"
            )
        if req.layout is not None:
            try:
                theirs = PoolLayout.from_dict(req.layout)
            except (ValueError, TypeError) as exc:
                raise RequestError(wire.Code.INVALID, f"field 'layout': {exc}") from None
            if theirs != pool.layout:
                diff = {
                    k: (v, pool.layout.to_dict()[k])
                    for k, v in theirs.to_dict().items()
                    if v != pool.layout.to_dict()[k]
                }
                raise RequestError(
                    wire.Code.MISMATCH, f"pool {req.pool!r} layout differs (yours, ours): {diff}"
                )
        if req.hash_seed is not None and req.hash_seed != self.config.cache.hash_seed:
            raise RequestError(
                wire.Code.MISMATCH,
                f"hash seed {req.hash_seed!r} differs from the daemon's "
                f"{self.config.cache.hash_seed!r}",
            )
        previous = self.sessions.peek(ctx.identity)
        limit = self.config.server.max_sessions
        if previous is None and limit and len(self.sessions) >= limit:
            raise RequestError(wire.Code.BUSY, f"the daemon already serves {limit} sessions")
        if previous is not None:
            self.close_session(previous, "hello_again")
        peer = ctx.peer
        session = self.sessions.open(
            ctx.identity,
            pool=pool.name,
            name=req.name,
            pid=req.pid,
            namespace=req.namespace,
            adapter=req.adapter,
            peer=peer,
        )
        quota = self.config.admission.session_quota_blocks or None
        try:
            pool.engine.open_session(
                session.id, namespace=req.namespace, adapter=req.adapter, quota=quota, minimum=0
            )
        except BaseException:
            self.sessions.remove(session)
            raise
        log.info(
            "session_opened",
            session=session.id,
            client=req.name,
            pid=req.pid,
            peer_pid=peer.pid if peer else None,
            pool=pool.name,
            namespace=req.namespace,
        )
        if peer is not None and peer.pid != req.pid:
            log.warning(
                "hello_pid_differs",
                session=session.id,
                hello_pid=req.pid,
                peer_pid=peer.pid,
                note="watching the kernel's pid (another pid namespace?)",
            )
        return wire.HelloResult(
            session=session.id,
            epoch=self.epoch,
            pool=pool.name,
            layout=pool.layout.to_dict(),
            memory=pool.memory.handle(),
            lease_ms=self.config.server.lease_ms,
            hash_seed=self.config.cache.hash_seed,
            namespace=req.namespace,
            max_message_bytes=wire.MAX_MESSAGE_BYTES,
        )

    def _defer_creation(self, req: wire.Hello, ctx: _Ctx) -> None:
        """Check a request to create pool ``req.pool`` and queue it; raises `_Deferred`.

        Refusals here change nothing: FORBIDDEN when runtime pools are off,
        INVALID for a bad layout or backend, MISMATCH for another hash seed,
        QUOTA_EXCEEDED above the operator's count or size cap. The memory
        budget (free bytes, headroom, node cap) is read by the daemon in a
        thread before it allocates.
        """
        mem = self.config.memory
        if not mem.runtime_pools:
            raise RequestError(
                wire.Code.FORBIDDEN,
                f"no pool {req.pool!r} and runtime pools are disabled (memory.runtime_pools)",
            )
        if req.layout is None:
            raise RequestError(wire.Code.INVALID, "field 'layout' is required to create a pool")
        try:
            layout = PoolLayout.from_dict(req.layout)
        except (ValueError, TypeError) as exc:
            raise RequestError(wire.Code.INVALID, f"field 'layout': {exc}") from None
        if req.hash_seed is not None and req.hash_seed != self.config.cache.hash_seed:
            raise RequestError(
                wire.Code.MISMATCH,
                f"hash seed {req.hash_seed!r} differs from the daemon's "
                f"{self.config.cache.hash_seed!r}",
            )
        backend = mem.runtime_pool_backend if req.backend is None else req.backend
        if backend not in BACKENDS:
            raise RequestError(
                wire.Code.INVALID, f"field 'backend': {backend!r} is not one of {list(BACKENDS)}"
            )
        try:
            config = PoolConfig(
                name=req.pool,
                backend=backend,
                num_layers=layout.num_layers,
                num_kv_heads=layout.num_kv_heads,
                head_dim=layout.head_dim,
                dtype=layout.dtype,
                block_size=layout.block_size,
                num_blocks=layout.num_blocks,
                order=layout.order,
                device=0 if req.device is None else req.device,
            )
        except ConfigError as exc:
            raise RequestError(wire.Code.INVALID, f"pool {exc.key}: {exc.message}") from None
        if req.pool not in self.creating:
            count = len(self.runtime) + len(self.creating)
            if count >= mem.max_runtime_pools:
                raise RequestError(
                    wire.Code.QUOTA_EXCEEDED,
                    f"no pool {req.pool!r} and {count} runtime pools exist "
                    f"(memory.max_runtime_pools = {mem.max_runtime_pools})",
                )
            cap = mem.runtime_pool_max_bytes
            if cap and layout.total_bytes > cap:
                raise RequestError(
                    wire.Code.QUOTA_EXCEEDED,
                    f"pool {req.pool!r} asked {format_bytes(layout.total_bytes)}, "
                    f"runtime pools are capped at {format_bytes(cap)} "
                    f"(memory.runtime_pool_max_bytes)",
                )
            self.creating.add(req.pool)
        # A second creator of a pool being created waits for it, then attaches (or
        # gets MISMATCH for another layout) when its hello is handled again.
        self._creations.append(
            PoolCreation(config, req.id, ctx.identity, list(ctx.message), ctx.peer, ctx.user_id)
        )
        raise _Deferred

    def take_creations(self) -> list[PoolCreation]:
        """The pool creations queued since the last call (the daemon runs them)."""
        jobs, self._creations = self._creations, []
        return jobs

    def add_pool(self, pool: PoolRuntime) -> None:
        """Serve a pool created at runtime."""
        self.pools[pool.name] = pool
        self.runtime.add(pool.name)
        self.creating.discard(pool.name)

    def refuse_creation(self, job: PoolCreation, code: wire.Code, message: str) -> list[bytes]:
        """The error reply for a creation the budget or the backend refused; nothing changed."""
        self.creating.discard(job.config.name)
        log.warning("pool_refused", pool=job.config.name, code=str(code), reason=message)
        self.rpc.record(_KIND_NAMES[wire.Kind.HELLO], 0)
        return self._error(job.req_id, code, message)

    def _heartbeat(self, req: wire.Heartbeat, ctx: _Ctx) -> _Outcome:
        return _EMPTY

    def _goodbye(self, req: wire.Goodbye, ctx: _Ctx) -> _Outcome:
        assert ctx.session is not None
        self.close_session(ctx.session, "goodbye")
        return _EMPTY

    # ------------------------------------------------------------------
    # Sequences

    def _check_size(self, req: wire.Request, engine: Engine | None, sid: int) -> None:
        """TOO_LARGE for too many tokens, or (``engine`` given) one sequence too many."""
        limits = self.limits
        denial = limits.check_request(req) if limits.max_tokens else None
        if denial is None and engine is not None and limits.max_sequences:
            denial = limits.check_sequences(engine.sequences_of(sid))
        if denial is not None:
            raise RequestError(denial.code, denial.message)

    def _allocate(self, req: wire.Allocate, ctx: _Ctx) -> _Outcome:
        engine, sid = ctx.engine, ctx.session.id  # type: ignore[union-attr]
        assert engine is not None
        self._check_size(req, engine, sid)
        r = engine.allocate(sid, req.seq, req.tokens, reserve=req.reserve)
        if isinstance(r, Refusal):
            return r
        return {
            "table": _blocks(r.table),
            "cached": r.num_cached_tokens,
            "reserved": r.reserved_blocks,
        }

    def _commit(self, req: wire.Commit, ctx: _Ctx) -> _Outcome:
        assert ctx.engine is not None and ctx.session is not None
        c = ctx.engine.commit(ctx.session.id, req.seq, req.n)
        return {"committed": c.committed, "cached_blocks": c.cached_blocks}

    def _append(self, req: wire.Append, ctx: _Ctx) -> _Outcome:
        engine, sid = ctx.engine, ctx.session.id  # type: ignore[union-attr]
        assert engine is not None
        if self.limits.max_tokens and len(req.tokens) > self.limits.max_tokens:
            self._check_size(req, None, sid)
        a = engine.append(sid, req.seq, req.tokens)
        if isinstance(a, Refusal):
            return a
        copies = a.copies
        return {
            "start": a.start,
            "blocks": _blocks(a.blocks) if a.blocks else b"",
            "copies": _blocks([b for pair in copies for b in pair]) if copies else b"",
            "length": a.length,
        }

    def _fork(self, req: wire.Fork, ctx: _Ctx) -> _Outcome:
        engine, sid = ctx.engine, ctx.session.id  # type: ignore[union-attr]
        assert engine is not None
        self._check_size(req, engine, sid)
        f = engine.fork(sid, req.seq, req.child, reserve=req.reserve)
        if isinstance(f, Refusal):
            return f
        return {"table": _blocks(f.table)}

    def _truncate(self, req: wire.Truncate, ctx: _Ctx) -> _Outcome:
        assert ctx.engine is not None and ctx.session is not None
        t = ctx.engine.truncate(ctx.session.id, req.seq, req.n)
        return {"length": t.length, "num_blocks": t.num_blocks}

    def _free(self, req: wire.Free, ctx: _Ctx) -> _Outcome:
        assert ctx.engine is not None and ctx.session is not None
        ctx.engine.free(ctx.session.id, req.seq)
        return _EMPTY

    def _pin(self, req: wire.Pin, ctx: _Ctx) -> _Outcome:
        assert ctx.engine is not None and ctx.session is not None
        p = ctx.engine.pin(ctx.session.id, req.seq, req.n)
        if isinstance(p, Refusal):
            return p
        return {"pin": p.pin_id, "blocks": p.blocks}

    def _unpin(self, req: wire.Unpin, ctx: _Ctx) -> _Outcome:
        assert ctx.engine is not None and ctx.session is not None
        ctx.engine.unpin(ctx.session.id, req.pin)
        return _EMPTY

    def _can_allocate(self, req: wire.CanAllocate, ctx: _Ctx) -> _Outcome:
        assert ctx.engine is not None and ctx.session is not None
        ok, available = ctx.engine.can_allocate(ctx.session.id, req.tokens, reserve=req.reserve)
        return {"ok": ok, "available": available}

    def _batch(self, req: wire.Batch, ctx: _Ctx) -> _Outcome:
        if len(req.ops) > wire.MAX_BATCH_OPS:
            raise RequestError(wire.Code.TOO_LARGE, f"more than {wire.MAX_BATCH_OPS} operations")
        # The batch's token frame is decoded once; each op takes a slice of it.
        ctx.extras = wire.TokenFrames(ctx.extras)
        op_result = self._batch_op
        return wire.BatchResult(results=[op_result(op, ctx) for op in req.ops])

    def _batch_op(self, op: Any, ctx: _Ctx) -> dict[str, Any]:
        """One operation's `wire.OpResult` map (built directly: same keys, same order)."""
        try:
            sub = wire.decode_batch_op(op, ctx.extras)
            outcome = self._run(sub, ctx)
        except (wire.ProtocolError, RequestError) as exc:
            self.rpc.error(exc.code)
            return {"ok": False, "code": str(exc.code), "msg": exc.message}
        if isinstance(outcome, Refusal):
            self.rpc.error(str(outcome.code))
            return {"ok": False, "code": str(outcome.code), "msg": outcome.message}
        # Results carry no token fields: nothing goes to extra frames.
        if isinstance(outcome, dict):
            return {"ok": True, "r": outcome}
        return {"ok": True, "r": outcome.to_map(_NO_FRAMES)}

    # ------------------------------------------------------------------
    # Admin

    def _ping(self, req: wire.Ping, ctx: _Ctx) -> _Outcome:
        return {"epoch": self.epoch, "version": wire.PROTOCOL_VERSION}

    def _check(self, req: wire.Check, ctx: _Ctx) -> _Outcome:
        problems: list[str] = []
        for name, pool in self.pools.items():
            try:
                pool.engine.check_invariants()
            except InvariantError as exc:
                problems.extend(f"{name}: {p}" for p in exc.problems)
        if problems:
            log.error("invariants_violated", problems=problems)
        return wire.CheckResult(ok=not problems, problems=problems)

    def _flush(self, req: wire.Flush, ctx: _Ctx) -> _Outcome:
        dropped = sum(pool.engine.flush(req.namespace) for pool in self.pools.values())
        log.info("flushed", namespace=req.namespace, dropped=dropped)
        return wire.FlushResult(dropped=dropped)

    def _clients(self, req: wire.Clients, ctx: _Ctx) -> _Outcome:
        now = self.sessions.clock()
        usage = {name: pool.engine.stats().session_usage for name, pool in self.pools.items()}
        listing = [
            s.info(now) | {"usage_blocks": usage[s.pool].get(s.id, 0)} for s in self.sessions
        ]
        return wire.InfoResult(info={"sessions": listing})

    def _pools(self, req: wire.Pools, ctx: _Ctx) -> _Outcome:
        info = {}
        for name, pool in self.pools.items():
            info[name] = {
                "backend": pool.config.backend,
                "runtime": name in self.runtime,
                "layout": pool.layout.to_dict(),
                "memory": pool.memory.info(),
                "blocks": self._block_counts(pool.engine.stats()),
                "sessions": sum(1 for s in self.sessions if s.pool == name),
            }
        return wire.InfoResult(info={"pools": info})

    def _stats(self, req: wire.Stats, ctx: _Ctx) -> _Outcome:
        sections = self.stats()
        if req.sections is not None:
            wanted = {str(s) for s in req.sections}
            unknown = wanted - sections.keys()
            if unknown:
                raise RequestError(
                    wire.Code.INVALID,
                    f"unknown stats sections {sorted(unknown)} (have: {', '.join(sections)})",
                )
            sections = {k: v for k, v in sections.items() if k in wanted}
        return wire.InfoResult(info=sections)

    # ------------------------------------------------------------------
    # Stats

    @staticmethod
    def _block_counts(stats: EngineStats) -> dict[str, int]:
        return {
            "free": stats.blocks_free,
            "evictable": stats.blocks_evictable,
            "in_use": stats.blocks_in_use,
            "pinned": stats.blocks_pinned,
            "reserved": stats.reserved,
            "total": stats.blocks_total,
        }

    def pressure_notices(self) -> list[tuple[bytes, list[bytes]]]:
        """Notices for the sessions of each pool whose usage crossed a threshold since last call.

        Usage is (blocks in use + reserved) / blocks: what running sequences
        hold or are promised (evictable cached blocks count as available).
        A crossing up or down sends ``pressure`` with the pool, the usage, the
        level (how many of ``admission.pressure_thresholds`` are reached) and
        those thresholds, to every session of the pool. Called periodically
        by the daemon, never per request.
        """
        thresholds = self.config.admission.pressure_thresholds
        out: list[tuple[bytes, list[bytes]]] = []
        for name, pool in self.pools.items():
            es = pool.engine.stats()
            usage = (es.blocks_in_use + es.reserved) / es.blocks_total
            level = sum(usage >= t for t in thresholds)
            if level == self._pressure.get(name, 0):
                continue
            self._pressure[name] = level
            log.info("pressure", pool=name, usage=round(usage, 4), level=level)
            frames = wire.encode_notice(
                "pressure",
                {
                    "pool": name,
                    "usage": round(usage, 4),
                    "level": level,
                    "thresholds": list(thresholds),
                },
            )
            out.extend((s.identity, frames) for s in self.sessions if s.pool == name)
        return out

    def reload(self, fresh: Config) -> ReloadReport:
        """Apply what ``fresh`` changes among the `RELOADABLE` keys; report the rest.

        Applied at once: the session quota (to sessions opened from now on:
        the engine fixes a session's quota when it opens), pressure
        thresholds (next maintenance tick), per-namespace quotas and
        minimums (to every pool's engine), runtime-pool limits and the
        budget they are checked against. Namespace limits are checked
        against every pool's usage first: a quota below a namespace's
        usage refuses ``admission.namespaces`` as a whole and keeps the
        old limits. ``log`` is reported as applied (the daemon's hook
        applies it). Everything else, ``admission.watermark_blocks`` and
        ``memory.shm_dir`` included, needs a restart.
        """
        running = self.config
        applied: list[str] = []
        restart: list[str] = []
        refused: dict[str, str] = {}
        for section in ("server", "cache", "pools", "metrics", "events", "security"):
            if getattr(fresh, section) != getattr(running, section):
                restart.append(section)
        changed = [
            key
            for section in ("log", "admission", "memory")
            for key in _changed(getattr(running, section), getattr(fresh, section), section)
        ]
        restart += [key for key in changed if key not in RELOADABLE]
        wanted = [key for key in changed if key in RELOADABLE]
        if "admission.namespaces" in wanted:
            problem = self._namespace_problem(fresh.admission)
            if problem is not None:
                refused["admission.namespaces"] = problem
            else:
                self._apply_namespaces(running.admission, fresh.admission)
        admission = dataclasses.replace(
            fresh.admission,
            watermark_blocks=running.admission.watermark_blocks,
            namespaces=running.admission.namespaces
            if "admission.namespaces" in refused
            else fresh.admission.namespaces,
        )
        memory = dataclasses.replace(fresh.memory, shm_dir=running.memory.shm_dir)
        applied = [key for key in wanted if key not in refused]
        self.config = dataclasses.replace(
            running, log=fresh.log, admission=admission, memory=memory
        )
        return ReloadReport(self.config, applied, restart, refused)

    def _namespace_problem(self, admission: AdmissionConfig) -> str | None:
        """Why the namespace quotas of ``admission`` cannot apply now (None: they can)."""
        for name, pool in self.pools.items():
            usage = pool.engine.stats().namespaces
            for ns, limits in admission.namespaces.items():
                used = usage[ns].usage if ns in usage else 0
                if limits.quota_blocks and limits.quota_blocks < used:
                    return (
                        f"quota {limits.quota_blocks} of namespace {ns!r} is below its usage "
                        f"of {used} blocks in pool {name!r}"
                    )
        return None

    def _apply_namespaces(self, old: AdmissionConfig, new: AdmissionConfig) -> None:
        """Set every pool's namespace limits to ``new``'s; namespaces it dropped lose theirs."""
        for pool in self.pools.values():
            for ns in old.namespaces.keys() - new.namespaces.keys():
                pool.engine.set_namespace_limits(ns, quota=None, minimum=0)
            for ns, limits in new.namespaces.items():
                pool.engine.set_namespace_limits(
                    ns, quota=limits.quota_blocks or None, minimum=limits.minimum_blocks
                )

    def in_flight(self) -> int:
        """Sequences held by live sessions (what a graceful drain waits for; not quarantined)."""
        held = sum(pool.engine.stats().sequences for pool in self.pools.values())
        return held - sum(self.pools[s.pool].engine.sequences_of(s.id) for _, s in self.quarantined)

    def stats(self) -> dict[str, Any]:
        """Every stats section (the STATS reply and kvd-ctl's source)."""
        now = self.clock()
        engine = {name: pool.engine.stats() for name, pool in self.pools.items()}
        by_pool = Counter(s.pool for s in self.sessions)
        refusals: Counter[str] = Counter()
        for es in engine.values():
            refusals.update(es.refusals)
        return {
            "server": {
                "version": kvd.__version__,
                "protocol": wire.PROTOCOL_VERSION,
                "pid": os.getpid(),
                "epoch": self.epoch,
                "uptime_s": round(now - self.started, 3),
                "address": self.addresses[0],
                "addresses": self.addresses,
                "state": "draining" if self.draining else "serving",
            },
            "pools": {
                name: {
                    "backend": pool.config.backend,
                    "runtime": name in self.runtime,
                    "num_blocks": pool.layout.num_blocks,
                    "block_size": pool.layout.block_size,
                    "bytes": pool.memory.size,
                    "bytes_per_block": pool.layout.kv_bytes_per_block,
                    "sequences": engine[name].sequences,
                }
                for name, pool in self.pools.items()
            },
            "blocks": {name: self._block_counts(es) for name, es in engine.items()},
            "prefix": {
                name: {
                    "queries": es.prefix_queries,
                    "query_tokens": es.query_tokens,
                    "hit_tokens": es.hit_tokens,
                    "hit_ratio": round(es.hit_ratio, 4),
                    "evictions": es.evictions,
                    "eviction_policy": self.pools[name].engine.config.eviction,
                }
                for name, es in engine.items()
            },
            "clients": {
                "sessions": len(self.sessions),
                "by_pool": {name: by_pool.get(name, 0) for name in self.pools},
                "closed": dict(sorted(self.closed_sessions.items())),
                "quarantined": len(self.quarantined),
            },
            "admission": {
                "refusals": dict(sorted(refusals.items())),
                "by_pool": {name: dict(sorted(es.refusals.items())) for name, es in engine.items()},
            },
            "rpc": self.rpc.section(),
        } | {name: section() for name, section in self.sections.items()}
