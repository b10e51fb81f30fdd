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
race with pid reuse); otherwise it probes with ``kill(pid, 0)``.

tcp connections carry no credentials. A local tcp peer is found as ``ss
-p`` finds it (`local_tcp_pid`: the connection's two addresses, the peer's
socket inode in ``/proc/net/tcp``/``tcp6``, the process holding that inode
in ``/proc/*/fd``; ~10 ms, so the daemon runs it in a worker thread before
the hello is handled and hands the pid over with `SessionTable.expect_pid`).
Its session is then watched by that pid as an ipc peer's is: alive
(stopped included) it keeps its session and its blocks, dead it is closed
within a sweep. Peers not found (another host, another network or pid
namespace, another user's process unreadable to the daemon) keep the lease
and the quarantine (`Handshake.close`): a remote peer cannot map the pool
at all (shm and CUDA IPC are node-local), so it cannot write into blocks.

The pidfds are watched with ``poll(2)`` (one poll object for the table),
never ``select(2)``: select cannot take a descriptor numbered 1024 or more
(``FD_SETSIZE``), which a daemon with ~510 sessions has (issue #14).

Descriptor budget: every session costs descriptors (`FDS_PER_SESSION`: its
connection's socket, held by libzmq's I/O thread, and its pidfd), and
libzmq aborts the whole process when ``accept`` on an ipc endpoint fails
with EMFILE (``ipc_listener.cpp``: EMFILE is not among the errors it
tolerates). `DescriptorBudget` knows the limit the process actually has
(``RLIMIT_NOFILE``, soft) and how many descriptors are open, and says
whether one more session fits with `FD_RESERVE` descriptors left for the
daemon's own use and for connections that have not said hello yet;
`SessionTable.refusal` turns that, and ``server.max_sessions``, into the
reason of a BUSY reply. `raise_nofile_limit` lifts the soft limit to the
hard one (call it once at start).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

__all__ = [
    "FDS_PER_SESSION",
    "FD_RESERVE",
    "HELLO_WAITING",
    "PID_LOOKUPS_MAX",
    "DescriptorBudget",
    "PeerCred",
    "PidLookups",
    "Session",
    "SessionTable",
    "local_tcp_pid",
    "nofile_limit",
    "open_fd_count",
    "parse_peer_address",
    "pid_alive",
    "raise_nofile_limit",
    "session_capacity",
]

#: Descriptors one session holds: its connection's socket (in libzmq's I/O
#: thread; libzmq needs nothing else per ipc or tcp connection) and its pidfd.
FDS_PER_SESSION: Final = 2
#: Descriptors kept free of sessions: the daemon's own (log, pool files, a
#: runtime pool's creation, metrics and events sockets, the ZAP handler's),
#: connections accepted but not yet past their hello (each holds one), and the
#: margin libzmq needs to accept them at all, and the tcp hellos' pid lookups
#: (`PID_LOOKUPS_MAX`, a duplicate of their connection's descriptor each).
FD_RESERVE: Final = 64
#: Tcp hellos waiting for their peer's pid at once (`PidLookups`).
PID_LOOKUPS_MAX: Final = 16
#: BUSY's reason for a hello sent while the connection's previous one still waits
#: (for its peer's pid, or for its pool's creation).
HELLO_WAITING: Final = "this connection's previous hello is still being answered"
#: Largest soft limit `raise_nofile_limit` asks for when the hard one is unlimited.
_NOFILE_FALLBACK: Final = 1 << 20
_POLL_EXITED: Final = select.POLLIN | select.POLLHUP | select.POLLERR


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
    #: A local tcp peer's pid, found from its connection (`local_tcp_pid`).
    tcp_pid: int | None = None
    #: Open pidfd of the watched pid (None without one or without pidfd support).
    pidfd: int | None = field(default=None, repr=False)

    @property
    def watched_pid(self) -> int | None:
        """The kernel-verified pid the watch follows (None: lease only)."""
        return self.peer.pid if self.peer is not None else self.tcp_pid

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


def _pidfd_events(pidfd: int) -> int:
    """The poll(2) events of one pidfd, now (POLLIN: the process exited)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    ready = poller.poll(0)
    return ready[0][1] if ready else 0


def pid_alive(session: Session) -> bool:
    """Is the session's watched process alive? Sessions without one count as alive.

    With a pidfd: readable (``poll``, any descriptor number) means the process
    exited. Otherwise ``kill(pid, 0)``: EPERM means it exists (another user),
    ESRCH that it is gone.
    """
    if session.pidfd is not None:
        events = _pidfd_events(session.pidfd)
        if not events & select.POLLNVAL:
            return not events & _POLL_EXITED
        # A closed pidfd (a bug elsewhere): decide by the pid, below.
    return _kill_probe(session)


def _kill_probe(session: Session) -> bool:
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


# -- local tcp peers --------------------------------------------------------------------


def _proc_net_address(host: str, port: int) -> str:
    """``host:port`` as ``/proc/net/tcp*`` prints it (address in 32-bit host-order words)."""
    packed = ipaddress.ip_address(host).packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _socket_inode(local: str, remote: str, tables: tuple[str, ...]) -> int | None:
    for table in tables:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[1] == local and fields[2] == remote:
                return int(fields[9]) or None
    return None


def _holder_of(inode: int, proc: Path) -> int | None:
    link = f"socket:[{inode}]"
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone, or another user's (unreadable)
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == link:
                        return int(entry.name)
    return None


def local_tcp_pid(conn: socket.socket, proc: Path = Path("/proc")) -> int | None:
    """The pid of the process on this host at the other end of tcp ``conn``; None if not found.

    The peer's socket is the one whose local address is our ``conn``'s remote
    one and the other way round (``/proc/net/tcp``, ``tcp6``); its holder is the
    process with a descriptor on that socket's inode. Blocking (~10 ms: every
    process's descriptors are read); run it in a worker thread.
    """
    try:
        ours, theirs = conn.getsockname(), conn.getpeername()
    except OSError:
        return None
    six = conn.family == socket.AF_INET6
    try:
        local = _proc_net_address(theirs[0], theirs[1])
        remote = _proc_net_address(ours[0], ours[1])
    except ValueError:
        return None
    tables = (str(proc / "net" / ("tcp6" if six else "tcp")),)
    inode = _socket_inode(local, remote, tables)
    return None if inode is None else _holder_of(inode, proc)


class PidLookups:
    """The tcp hellos whose peer's pid a worker thread is looking for, by connection.

    Each holds a duplicate of its connection's descriptor and its frames until
    answered (one at a time, ~10 ms each), so at most one per connection and
    ``limit`` in all: a client pipelining hellos gets BUSY instead of making the
    daemon hold descriptors without bound (libzmq aborts at the descriptor limit).
    `begin` runs in the request thread, `end` in the event loop.
    """

    def __init__(self, limit: int = PID_LOOKUPS_MAX) -> None:
        self.limit = limit
        self._waiting: set[bytes] = set()
        self._lock = threading.Lock()

    def begin(self, identity: bytes) -> str | None:
        """Count a lookup for connection ``identity``; the reason to refuse it (BUSY) instead."""
        with self._lock:
            if identity in self._waiting:
                return HELLO_WAITING
            if len(self._waiting) >= self.limit:
                return f"{self.limit} tcp hellos are waiting for their peer's process; retry"
            self._waiting.add(identity)
        return None

    def end(self, identity: bytes) -> None:
        """The lookup for ``identity`` is over (its hello answered, or never queued)."""
        with self._lock:
            self._waiting.discard(identity)

    def __len__(self) -> int:
        return len(self._waiting)


# -- descriptors ------------------------------------------------------------------------


def nofile_limit() -> int:
    """This process's soft RLIMIT_NOFILE (an unlimited one as the kernel's ``nr_open``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _finite(soft)


def _finite(limit: int) -> int:
    if limit != resource.RLIM_INFINITY:
        return int(limit)
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return _NOFILE_FALLBACK


def raise_nofile_limit() -> tuple[int, int]:
    """Lift the soft RLIMIT_NOFILE to the hard limit; ``(before, after)`` soft limits.

    An unlimited hard limit gives ``nr_open``. Where the kernel refuses,
    the limit stays as it was (``after == before``).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before, target = _finite(soft), _finite(hard)
    if target <= before:
        return before, before
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        return before, before
    return before, target


def open_fd_count() -> int:
    """Descriptors this process has open now (``/proc/self/fd``, less the listing's own).

    ~40 µs with 100 open, ~400 µs with 1000 (`DescriptorBudget` counts
    seldom). Without ``/proc``: every descriptor below the limit probed.
    """
    try:
        return len(os.listdir("/proc/self/fd")) - 1
    except OSError:
        count = 0
        for fd in range(min(nofile_limit(), 1 << 16)):
            with contextlib.suppress(OSError):
                os.fstat(fd)
                count += 1
        return count


def session_capacity(
    nofile_limit: int,
    per_session: int = FDS_PER_SESSION,
    reserve: int = FD_RESERVE,
    in_use: int = 0,
) -> int:
    """How many sessions fit in ``nofile_limit`` descriptors, ``in_use`` of them taken.

    ``reserve`` stays free for the daemon's own use; never negative.
    """
    if per_session <= 0:
        raise ValueError("per_session must be > 0")
    return max(0, (nofile_limit - reserve - in_use) // per_session)


class DescriptorBudget:
    """Whether one more session fits in the descriptors the process has.

    The open descriptors are counted (`open_fd_count`) at most every
    ``max_age_s`` seconds; in between, every opened session is taken to
    have added ``per_session``. A refusal is always decided on a fresh
    count. ``limit`` None reads the soft RLIMIT_NOFILE at each count (it may
    change: `raise_nofile_limit`, ``prlimit``).
    """

    def __init__(
        self,
        *,
        limit: int | None = None,
        reserve: int = FD_RESERVE,
        per_session: int = FDS_PER_SESSION,
        count: Callable[[], int] = open_fd_count,
        clock: Callable[[], float] = time.monotonic,
        max_age_s: float = 0.25,
    ) -> None:
        if per_session <= 0 or reserve < 0:
            raise ValueError("per_session must be > 0 and reserve >= 0")
        self._fixed_limit = limit
        self.reserve = reserve
        self.per_session = per_session
        self._count = count
        self._clock = clock
        self._max_age_s = max_age_s
        self._counted = 0
        self._counted_at = -float("inf")
        self._opened_since = 0
        self.limit = limit if limit is not None else nofile_limit()

    def _recount(self) -> None:
        self.limit = self._fixed_limit if self._fixed_limit is not None else nofile_limit()
        self._counted = self._count()
        self._counted_at = self._clock()
        self._opened_since = 0

    def _estimate(self) -> int:
        return self._counted + self.per_session * self._opened_since

    def _fits(self) -> bool:
        return self._estimate() + self.per_session <= self.limit - self.reserve

    def admits(self) -> bool:
        """Does one more session fit now (its connection, already open, counted)?"""
        fresh = self._clock() - self._counted_at > self._max_age_s
        if fresh:
            self._recount()
        if self._fits():
            return True
        if not fresh:  # refuse only on a fresh count
            self._recount()
        return self._fits()

    def opened(self) -> None:
        """A session was opened (its pidfd, and its connection if counted before it)."""
        self._opened_since += 1

    def capacity(self) -> int:
        """Sessions that fit, with what is open now (a fresh count)."""
        self._recount()
        return session_capacity(self.limit, self.per_session, self.reserve, self._counted)

    def describe(self) -> dict[str, int]:
        """Plain data for STATS: the limit, the reserve, the last count."""
        return {
            "limit": self.limit,
            "reserve": self.reserve,
            "per_session": self.per_session,
            "open": self._estimate(),
        }


class SessionTable:
    """The live sessions by connection identity and by id; no engine calls here."""

    def __init__(
        self,
        lease_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        watch_pids: bool = True,
        descriptors: DescriptorBudget | None = None,
    ) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._watch_pids = watch_pids
        #: Refuses sessions before the descriptors run out (None: not checked).
        self.descriptors = descriptors
        self._by_identity: dict[bytes, Session] = {}
        self._by_id: dict[int, Session] = {}
        self._next_id = 1
        #: Every open pidfd, for one poll(2) per sweep.
        self._poller = select.poll()
        #: Pids of local tcp peers found before their hello, by connection identity.
        self._tcp_pids: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def refusal(self, max_sessions: int) -> str | None:
        """Why a new session must be refused with BUSY now; None when it may open.

        ``max_sessions`` (the config's) first, then the descriptor budget.
        """
        if len(self._by_id) >= max_sessions:
            return f"the daemon already serves {max_sessions} sessions"
        budget = self.descriptors
        if budget is not None and not budget.admits():
            return (
                f"the daemon is short of file descriptors ({len(self._by_id)} sessions, "
                f"limit {budget.limit}, {budget.reserve} kept in reserve)"
            )
        return None

    def expect_pid(self, identity: bytes, pid: int | None) -> None:
        """The next session `open` for ``identity`` without credentials watches ``pid``.

        None forgets what was expected (a hello that opened no session).
        """
        if pid is None:
            self._tcp_pids.pop(identity, None)
        else:
            self._tcp_pids[identity] = pid

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
        if peer is None:
            session.tcp_pid = self._tcp_pids.pop(identity, None)
        pid_watched = session.watched_pid
        if self._watch_pids and pid_watched is not None:
            session.pidfd = _open_pidfd(pid_watched)
            if session.pidfd is not None:
                self._poller.register(session.pidfd, select.POLLIN)
        if self.descriptors is not None:
            self.descriptors.opened()
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
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(session.pidfd)
            with contextlib.suppress(OSError):
                os.close(session.pidfd)
            session.pidfd = None

    def expired(self) -> list[Session]:
        """Sessions whose lease ran out (not removed: the caller closes them)."""
        deadline = self.clock() - self.lease_s
        return [s for s in self._by_id.values() if s.last_seen < deadline]

    def sweep_pids(self, alive: Callable[[Session], bool] | None = None) -> list[Session]:
        """Sessions whose watched process is gone; renews the lease of watched live ones.

        An idle client whose process lives keeps its session; sessions
        without a watched pid are left to their lease. ``alive`` None: one
        ``poll(2)`` over every pidfd, `pid_alive` for sessions without one.
        """
        now = self.clock()
        dead = []
        check = alive if alive is not None else self._alive_checker()
        for session in self._by_id.values():
            if session.watched_pid is None:
                continue
            if check(session):
                session.last_seen = now
            else:
                dead.append(session)
        return dead

    def _alive_checker(self) -> Callable[[Session], bool]:
        """`pid_alive` with every pidfd's events read by one poll(2) call."""
        events = dict(self._poller.poll(0))

        def alive(session: Session) -> bool:
            fd = session.pidfd
            happened = 0 if fd is None else events.get(fd, 0)
            if fd is None or happened & select.POLLNVAL:  # no pidfd, or a closed one
                return _kill_probe(session)
            return not happened & _POLL_EXITED

        return alive
