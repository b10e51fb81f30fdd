"""Sessions begin and end here: hello (attach, or ask for a runtime pool), goodbye, close.

A hello is checked in this order, and each refusal changes nothing:
VERSION, FORBIDDEN (namespace policy), then for an existing pool MISMATCH
(layout, hash seed) and BUSY (``server.max_sessions``); for a missing pool
with ``create`` the pools' own checks (`Pools.ask`), after which the hello
is a `PendingHello` that the daemon completes with `Handshake.attach` once
the pool exists (or answers with the creation's refusal).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import structlog
from kvd_client import wire

from kvd.config import PoolConfig
from kvd.errors import RequestError
from kvd.server.context import Call, ServerState, SessionCall
from kvd.server.pools import check_hash_seed, parse_layout
from kvd.server.security import NamespacePolicy, RateLimiter
from kvd.server.sessions import Session

__all__ = ["Handshake", "PendingHello"]

log = structlog.get_logger("kvd.server")

#: The result map of kinds that answer nothing.
_EMPTY: Final[dict[str, Any]] = {}


@dataclass(frozen=True, slots=True)
class PendingHello:
    """A hello whose pool must be created first (by the daemon, off the request thread)."""

    req: wire.HelloRequest
    call: Call
    config: PoolConfig


class Handshake:
    """Opens and closes sessions; ``publish`` hands engine events on after a close."""

    def __init__(
        self,
        state: ServerState,
        policy: NamespacePolicy,
        limiter: RateLimiter | None,
        publish: Callable[[], None] | None,
    ) -> None:
        self.state = state
        self.policy = policy
        self.limiter = limiter
        self.publish = publish

    def hello(self, req: wire.HelloRequest, call: Call) -> wire.HelloResult | PendingHello:
        """Attach to ``req.pool``, or (``create``, no such pool) the pending creation."""
        if req.version != wire.PROTOCOL_VERSION:
            raise RequestError(
                wire.Code.VERSION,
                f"client speaks protocol {req.version}, daemon speaks {wire.PROTOCOL_VERSION}",
            )
        if self.policy.enforce:
            refusal = self.policy.check_namespace(call.principal, req.namespace)
            if refusal is not None:
                raise refusal
        pools = self.state.pools
        if req.pool in pools:
            return self.attach(req, call)
        if req.create:
            return PendingHello(req, call, pools.ask(req))
        raise RequestError(
            wire.Code.NOT_FOUND, f"no pool {req.pool!r} (have: {', '.join(sorted(pools.names()))})"
        )

    def attach(self, req: wire.HelloRequest, call: Call) -> wire.HelloResult:
        """Open a session on the existing pool ``req.pool`` (MISMATCH, BUSY change nothing)."""
        state = self.state
        pool = state.pools[req.pool]
        if req.layout is not None:
            theirs = parse_layout(req.layout)
            if theirs != pool.layout:
                ours = pool.layout.to_dict()
                diff = {k: (v, ours[k]) for k, v in theirs.to_dict().items() if v != ours[k]}
                raise RequestError(
                    wire.Code.MISMATCH, f"pool {req.pool!r} layout differs (yours, ours): {diff}"
                )
        check_hash_seed(req.hash_seed, state.config.cache.hash_seed)
        sessions = state.sessions
        previous = sessions.peek(call.identity)
        if previous is None:
            # max_sessions (0: no cap of its own), then the descriptors the process has left.
            busy = sessions.refusal(state.config.server.max_sessions or sys.maxsize)
            if busy is not None:
                raise RequestError(wire.Code.BUSY, busy)
        if previous is not None:
            self.close(previous, "hello_again")
        peer = call.peer
        session = sessions.open(
            call.identity,
            pool=pool.name,
            name=req.name,
            pid=req.pid,
            namespace=req.namespace,
            adapter=req.adapter,
            peer=peer,
        )
        quota = state.config.admission.session_quota_blocks or None
        try:
            pool.engine.open_session(
                session.id, namespace=req.namespace, adapter=req.adapter, quota=quota, minimum=0
            )
        except BaseException:
            sessions.remove(session)
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
            epoch=state.epoch,
            pool=pool.name,
            layout=pool.layout.to_dict(),
            memory=pool.memory.handle(),
            lease_ms=state.config.server.lease_ms,
            hash_seed=state.config.cache.hash_seed,
            namespace=req.namespace,
            max_message_bytes=wire.MAX_MESSAGE_BYTES,
        )

    def heartbeat(self, req: wire.HeartbeatRequest, call: SessionCall) -> dict[str, Any]:
        """Nothing: the lookup of the session renewed its lease."""
        return _EMPTY

    def goodbye(self, req: wire.GoodbyeRequest, call: SessionCall) -> dict[str, Any]:
        """Close the caller's session (sequences freed, committed blocks stay cached)."""
        self.close(call.session, "goodbye")
        return _EMPTY

    def close(self, session: Session, reason: str) -> None:
        """Close ``session`` in its engine (sequences freed, cached blocks kept) and forget it.

        A session whose lease expired without a pid to watch (tcp) is only
        forgotten: its engine session keeps every block for
        ``server.quarantine_leases`` leases more (`release_quarantined`), since
        the stopped process may resume and finish writing into them before
        its next call gets SESSION_LOST. Blocks handed to another client in
        the meantime would take that write.
        """
        state = self.state
        state.sessions.remove(session)
        grace = state.config.server.quarantine_leases * state.sessions.lease_s
        quarantine = reason == "lease_expired" and session.watched_pid is None and grace > 0
        if quarantine:
            state.quarantined.append((state.clock() + grace, session))
        else:
            state.pools[session.pool].engine.close_session(session.id)
        state.closed_sessions[reason] += 1
        if self.limiter is not None:
            self.limiter.forget(session.id)
        if self.publish is not None:
            self.publish()
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
        state = self.state
        now = state.clock()
        done = 0
        while state.quarantined and state.quarantined[0][0] <= now:
            _, session = state.quarantined.pop(0)
            state.pools[session.pool].engine.close_session(session.id)
            done += 1
            log.info("quarantine_released", session=session.id, pool=session.pool)
        if done and self.publish is not None:
            self.publish()
        return done
