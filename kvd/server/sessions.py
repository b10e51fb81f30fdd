"""Sessions: one per connected client, keyed by the ROUTER routing id of its connection.

A session holds a lease of ``lease_s`` seconds, renewed by every request
(and by the pid watch while the client's process is alive). The daemon's
maintenance loop asks `SessionTable.expired` and `SessionTable.sweep_pids`
for the sessions to close; closing them in the engine is the caller's job.

The clock is injectable (``clock=``) so lease logic is tested without
sleeping.

Pid watch: on ``ipc://`` every message carries the peer's kernel
credentials (libzmq reads ``SO_PEERCRED``; pyzmq exposes them as the
``Peer-Address`` frame property ``"<host>:<uid>:<gid>:<pid>"``, the pid as
seen from the daemon's pid namespace). The watch uses that pid, never the
one the hello claims: a client in another pid namespace reports its own
view of its pid, and a wrong claim must not get a live client's session
closed. Where Linux offers it, the watch holds a pidfd per session (no
race with pid reuse); otherwise it probes with ``kill(pid, 0)``. tcp
connections carry no credentials and rely on the lease alone.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PeerCred", "Session", "SessionTable", "parse_peer_address", "pid_alive"]


@dataclass(frozen=True, slots=True)
class PeerCred:
    """Kernel credentials of an ipc peer."""

    uid: int
    gid: int
    pid: int


def parse_peer_address(value: str | None) -> PeerCred | None:
    """``"<host>:<uid>:<gid>:<pid>"`` (libzmq's ipc Peer-Address) to `PeerCred`; None otherwise.

    A tcp peer's address (``"127.0.0.1"``) or anything unexpected gives None.
    """
    if not value:
        return None
    parts = value.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    uid, gid, pid = (int(p) for p in parts[1:])
    return PeerCred(uid, gid, pid) if pid > 0 else None


@dataclass(slots=True, eq=False)
class Session:
    """One connected client."""

    id: int
    identity: bytes
    pool: str
    name: str
    #: The pid the client stated in its hello (shown to operators).
    pid: int
    namespace: str
    adapter: str | None
    peer: PeerCred | None
    created: float
    last_seen: float
    requests: int = 0
    #: Open pidfd of ``peer.pid`` (None without credentials or without pidfd support).
    pidfd: int | None = field(default=None, repr=False)

    @property
    def watched_pid(self) -> int | None:
        """The kernel-verified pid the watch follows (None: lease only)."""
        return self.peer.pid if self.peer is not None else None

    def info(self, now: float) -> dict[str, Any]:
        """Plain data for the clients listing."""
        return {
            "id": self.id,
            "name": self.name,
            "pid": self.pid,
            "peer_pid": self.watched_pid,
            "uid": self.peer.uid if self.peer else None,
            "pool": self.pool,
            "namespace": self.namespace,
            "adapter": self.adapter,
            "age_s": round(now - self.created, 3),
            "idle_ms": round((now - self.last_seen) * 1e3, 1),
            "requests": self.requests,
        }


def _open_pidfd(pid: int) -> int | None:
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return int(pidfd_open(pid))
    except OSError:
        return None


def pid_alive(session: Session) -> bool:
    """Is the session's watched process alive? Sessions without one count as alive.

    With a pidfd: readable means the process exited. Otherwise ``kill(pid,
    0)``: EPERM means it exists (another user), ESRCH that it is gone.
    """
    if session.pidfd is not None:
        readable, _, _ = select.select([session.pidfd], [], [], 0)
        return not readable
    pid = session.watched_pid
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SessionTable:
    """The live sessions by connection identity and by id; no engine calls here."""

    def __init__(
        self,
        lease_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        watch_pids: bool = True,
    ) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._watch_pids = watch_pids
        self._by_identity: dict[bytes, Session] = {}
        self._by_id: dict[int, Session] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def open(
        self,
        identity: bytes,
        *,
        pool: str,
        name: str,
        pid: int,
        namespace: str = "",
        adapter: str | None = None,
        peer: PeerCred | None = None,
    ) -> Session:
        """Register a new session for ``identity`` (which must have none: close it first)."""
        if identity in self._by_identity:
            raise ValueError("identity already has a session")
        now = self.clock()
        session = Session(
            id=self._next_id,
            identity=identity,
            pool=pool,
            name=name,
            pid=pid,
            namespace=namespace,
            adapter=adapter,
            peer=peer,
            created=now,
            last_seen=now,
        )
        if self._watch_pids and peer is not None:
            session.pidfd = _open_pidfd(peer.pid)
        self._next_id += 1
        self._by_identity[identity] = session
        self._by_id[session.id] = session
        return session

    def lookup(self, identity: bytes) -> Session | None:
        """The session of ``identity``, its lease renewed; None when there is none."""
        session = self._by_identity.get(identity)
        if session is not None:
            session.last_seen = self.clock()
            session.requests += 1
        return session

    def peek(self, identity: bytes) -> Session | None:
        """The session of ``identity`` without renewing anything."""
        return self._by_identity.get(identity)

    def remove(self, session: Session) -> None:
        """Forget ``session`` and release its pidfd (idempotent)."""
        if self._by_id.pop(session.id, None) is None:
            return
        del self._by_identity[session.identity]
        if session.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(session.pidfd)
            session.pidfd = None

    def expired(self) -> list[Session]:
        """Sessions whose lease ran out (not removed: the caller closes them)."""
        deadline = self.clock() - self.lease_s
        return [s for s in self._by_id.values() if s.last_seen < deadline]

    def sweep_pids(self, alive: Callable[[Session], bool] = pid_alive) -> list[Session]:
        """Sessions whose watched process is gone; renews the lease of watched live ones.

        An idle client whose process lives keeps its session; sessions
        without a watched pid are left to their lease.
        """
        now = self.clock()
        dead = []
        for session in self._by_id.values():
            if session.watched_pid is None:
                continue
            if alive(session):
                session.last_seen = now
            else:
                dead.append(session)
        return dead
