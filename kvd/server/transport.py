"""The ROUTER socket: where it lives, who else is there, how it is configured.

Address: ``server.address`` or the default socket, resolved by
`kvd_client.wire.address` (the same function the clients use, so both
sides agree on ``$RUNTIME_DIRECTORY``, the effective uid and abstract
sockets).

Binding an ipc path that another daemon serves silently steals it (the
old daemon keeps an unreachable socket), so before binding, an existing
socket file is PINGed: a live daemon's answer refuses the start; silence
means the file is stale and it is unlinked. The socket file gets
``socket_mode`` (0660) after bind; it is bound under umask 0117, so it is
never more open than 0660 between bind and chmod. Its directory gets
``dir_mode`` when the daemon creates it, and any directory is refused
when someone else owns it (they could swap the socket file for their
own daemon's; `security.check_dir`).

Endpoints without a socket file — tcp, and abstract ``ipc://@name``
sockets, which no file mode protects — are served only with CURVE
(`security.bind_curve`): ipc endpoints with a file are bound first
(libzmq applies the CURVE options at bind time and cannot clear them, so
everything bound after a CURVE endpoint is one).

Socket options: MAXMSGSIZE a little above the protocol's
MAX_MESSAGE_BYTES, because libzmq drops a larger frame by closing the
connection without a word; anything the decoder refuses below it gets a
TOO_LARGE reply instead. ROUTER_MANDATORY stays off (a reply to a vanished
peer is dropped, not an error), high-water marks from the config, LINGER 0.

What libzmq cannot bound, watched from outside (issue #14):

- `ConnectionWatch`: the ROUTER's accepted connections by descriptor (its
  monitor's ACCEPTED and DISCONNECTED/CLOSED events), which of them sent a
  complete message lately (``Frame.get(SRCFD)`` in the request thread, noted
  with the connection's inode) and which sent a hello. It picks the
  connections to `shutdown`: those that sent no hello within
  ``server.hello_timeout_ms`` (each holds a descriptor, and libzmq aborts
  the process on EMFILE in an ipc accept), and, once the
  daemon's anonymous memory grew past ``server.memory_guard_bytes``, those
  that sent no complete message while it grew. The second is an interim
  bound: libzmq 4.3.5 buffers an unfinished multipart message without limit
  (MAXMSGSIZE bounds one frame, the high-water marks count whole messages),
  so the daemon can only see its memory grow and drop the silent
  connections; the root fix belongs in libzmq.
- `ReplyQueues`: the bytes of replies libzmq still holds per peer (a
  reply's last frame sent with ``track=True`` every 64 KiB), so a peer that never reads
  is cut off at ``server.max_queued_reply_bytes`` instead of at SNDHWM
  messages of any size.
- `anon_rss` and `malloc_trim`: the daemon's own memory, and giving freed
  heap back to the kernel when idle (glibc keeps it otherwise).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import hashlib
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgpack
import structlog
import zmq
from kvd_client import wire

from kvd.config import ServerConfig
from kvd.errors import StartupError
from kvd.server.security import CurveKeys, bind_curve, check_dir

__all__ = [
    "MAXMSGSIZE",
    "MONITOR_EVENTS",
    "ConnectionWatch",
    "Heard",
    "ReplyQueues",
    "anon_rss",
    "bind_router",
    "check_address",
    "instance_id",
    "malloc_trim",
    "probe_daemon",
    "refuse_queued",
    "shutdown",
    "transport_stats",
]

#: Per-frame limit given to libzmq; the protocol's limit (and TOO_LARGE) applies below it.
MAXMSGSIZE: Final = wire.MAX_MESSAGE_BYTES + 64 * 1024
#: Umask while binding: the socket file is created at most 0660 (chmod sets the mode after).
_BIND_UMASK: Final = 0o117
# Plain ints: pyzmq's flag enums cost an enum construction per operation.
_NOBLOCK: Final = int(zmq.NOBLOCK)
_NOBLOCK_SNDMORE: Final = _NOBLOCK | int(zmq.SNDMORE)
#: The Cython socket's own send (zmq.Socket.send is a Python wrapper around it).
_send: Final = zmq.backend.Socket.send
#: Most queued messages answered with SHUTTING_DOWN when the request thread stops.
_REFUSE_AT_EXIT: Final = 10_000

log = structlog.get_logger("kvd.server")


def instance_id(address: str) -> str:
    """A short stable id of the daemon serving ``address`` (names its shm segments)."""
    return hashlib.sha256(address.encode()).hexdigest()[:12]


def probe_daemon(ctx: zmq.Context[zmq.Socket[bytes]], address: str, timeout_ms: int) -> bool:
    """Does a live kvd answer PING at ``address`` within ``timeout_ms``? Blocking."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(wire.PingRequest(id=1).encode(), zmq.NOBLOCK)
        if not sock.poll(timeout_ms, zmq.POLLIN):
            return False
        frames = sock.recv_multipart()
        return len(frames) >= 2 and type(msgpack.unpackb(frames[1])) is dict
    except (zmq.ZMQError, ValueError, msgpack.UnpackException):
        return False
    finally:
        sock.close(0)


def _prepare_ipc(path: Path, config: ServerConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Create the socket's directory, refuse a live daemon, remove a stale socket file."""
    directory = path.parent
    if not directory.exists():
        try:
            directory.mkdir(parents=True, mode=config.dir_mode)
            os.chmod(directory, config.dir_mode)  # mkdir's mode is filtered by the umask
        except OSError as exc:
            raise StartupError(f"cannot create {directory}: {exc.strerror}") from None
    problems = check_dir(directory)
    if problems.fatal:
        raise StartupError(f"unsafe socket directory: {'; '.join(problems.fatal)}")
    for warning in problems.warnings:
        log.warning("socket_dir_open", problem=warning)
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
    if probe_daemon(ctx, f"ipc://{path}", config.probe_timeout_ms):
        raise StartupError(f"another kvd is serving ipc://{path}; stop it first")
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def bind_router(
    ctx: zmq.Context[zmq.Socket[bytes]],
    addresses: list[str],
    config: ServerConfig,
    curve: CurveKeys | None = None,
) -> zmq.Socket[bytes]:
    """A configured ROUTER bound to every address; raises StartupError.

    ipc addresses with a socket file are bound first and plain; the others
    (tcp, abstract ipc) after, as CURVE endpoints with ``curve`` (required
    for them: their clients are vetted by the ZAP handler, which must be
    bound already). Call it only after
    `check_address` ran for each ipc address (which also removes stale
    socket files). Blocking (bind is quick; the probe is not).
    """
    tcp = [a for a in addresses if wire.ipc_path(a) is None]
    if tcp and curve is None:
        raise StartupError(
            f"{tcp[0]}: an endpoint without a socket file is served only with CURVE keys"
        )
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAXMSGSIZE)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.setsockopt(zmq.RCVHWM, config.rcvhwm)
    sock.setsockopt(zmq.SNDHWM, config.sndhwm)
    ordered = [a for a in addresses if wire.ipc_path(a) is not None] + tcp
    old_umask = os.umask(_BIND_UMASK)
    try:
        for address in ordered:
            try:
                if wire.ipc_path(address) is None:
                    assert curve is not None
                    bind_curve(sock, address, curve)
                else:
                    sock.bind(address)
            except zmq.ZMQError as exc:
                raise StartupError(
                    f"cannot bind {address}: {zmq.strerror(exc.errno or 0)}"
                ) from None
            path = wire.ipc_path(address)
            if path is not None:
                os.chmod(path, config.socket_mode)
    except BaseException:
        sock.close(0)
        raise
    finally:
        os.umask(old_umask)
    return sock


def check_address(address: str, config: ServerConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Before binding: for ipc, make the directory, refuse a live daemon, unlink a stale file."""
    path = wire.ipc_path(address)
    if path is not None:
        _prepare_ipc(path, config, ctx)


# -- what libzmq does not bound --------------------------------------------------------

#: The ROUTER monitor's events `ConnectionWatch` follows.
MONITOR_EVENTS: Final = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_PAGE: Final = os.sysconf("SC_PAGE_SIZE")


def anon_rss() -> int:
    """This process's resident anonymous memory in bytes (``/proc/self/statm``).

    Resident less shared (file and shm pages: the pools' mappings), which is
    what libzmq's buffers and the Python heap grow. ~5 µs.
    """
    with open("/proc/self/statm", "rb") as fh:
        fields = fh.read().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


def malloc_trim() -> bool:
    """Give the heap's free memory back to the kernel (glibc ``malloc_trim(0)``).

    Blocking (milliseconds on a large heap; ctypes releases the GIL): call
    it in a worker thread. False where the C library has no malloc_trim.
    """
    return _malloc_trim is not None and bool(_malloc_trim(0))


def shutdown(fd: int, inode: int) -> bool:
    """``shutdown(SHUT_RDWR)`` the connection at ``fd`` if it is still socket ``inode``.

    libzmq owns the descriptor and closes it when it sees the end; this only
    ends the connection. The inode check keeps a descriptor number that was
    closed and reused (a pool file, another connection) from being touched.
    """
    try:
        if os.fstat(fd).st_ino != inode:
            return False
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    finally:
        dup.close()
    return True


@dataclass(slots=True)
class _Connection:
    inode: int
    accepted: float
    #: Why it was shut down (it stays listed until libzmq closes it).
    shut: str | None = None


@dataclass(slots=True)
class Heard:
    """What the request thread heard from the connection at one descriptor.

    Noted with the connection's routing id and socket inode, so that what an
    earlier connection at the same number said is never taken for the
    current one's (descriptors are reused at once, and the monitor's CLOSED
    for the old connection may reach the loop after the new one spoke).
    """

    identity: bytes
    inode: int
    #: ``ConnectionWatch.tick`` of its last complete message.
    tick: int = -1
    #: It sent a hello.
    hello: bool = False


class ConnectionWatch:
    """The ROUTER's connections by descriptor, and the ones to shut down.

    Fed by the monitor (`accepted`, `closed`, on the event loop) and by the
    request thread (a `Heard` per descriptor, made by `note` when a new
    routing id speaks there, its ``tick`` set for every complete message and
    ``hello`` for a hello; ``drained``/``waiting`` when its queue is empty,
    looked for only while ``asking``: plain stores, no lock). A `Heard`
    counts for a connection only with its inode, so the order in which the
    monitor's events reach the loop does not matter. `overdue`, and
    `memory` then `silent`, say which connections to `shutdown`; ``shut``
    counts them by reason.
    """

    def __init__(
        self,
        *,
        hello_timeout_s: float,
        memory_budget: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hello_timeout_s = hello_timeout_s
        self.memory_budget = memory_budget
        self.clock = clock
        #: Bumped by every `memory` check; what the request thread stores in ``Heard.tick``.
        self.tick = 0
        #: Descriptor -> what the request thread heard there (`note`).
        self.heard: dict[int, Heard] = {}
        #: The request thread found its queue empty at this tick / is blocked on it
        #: now: every complete message that came before has been heard.
        self.drained = 0
        self.waiting = False
        #: Memory is past the budget (`memory`): the request thread is to look
        #: for an empty queue after each message (a failed non-blocking receive,
        #: ~6 µs, paid only while the guard needs ``drained``/``waiting``).
        self.asking = False
        self.shut: collections.Counter[str] = collections.Counter()
        self._open: dict[int, _Connection] = {}
        #: Lowest anonymous memory seen since the last re-arm, and the last tick
        #: at which memory was within half the budget of it (growth began after).
        self._low: int | None = None
        self._calm = 0

    def __len__(self) -> int:
        return len(self._open)

    def accepted(self, fd: int) -> None:
        """The monitor's ACCEPTED: ``fd`` is a new connection."""
        try:
            inode = os.fstat(fd).st_ino
        except OSError:  # already gone
            return
        self._open[fd] = _Connection(inode, self.clock())

    def closed(self, fd: int) -> None:
        """The monitor's DISCONNECTED or CLOSED: ``fd`` is no longer that connection."""
        self._open.pop(fd, None)
        try:
            os.fstat(fd)
        except OSError:  # nothing there: what was heard there is stale
            self.heard.pop(fd, None)

    def note(self, fd: int, identity: bytes) -> Heard:
        """A new `Heard` for ``identity`` at ``fd`` (request thread; one ``fstat``)."""
        try:
            inode = os.fstat(fd).st_ino
        except OSError:  # closed meanwhile: matches no connection
            inode = -1
        seen = self.heard[fd] = Heard(identity, inode)
        return seen

    def _said(self, fd: int, conn: _Connection) -> Heard | None:
        """What the connection ``conn`` at ``fd`` said (None: nothing yet)."""
        seen = self.heard.get(fd)
        return seen if seen is not None and seen.inode == conn.inode else None

    def overdue(self) -> list[int]:
        """Connections that sent no hello within ``hello_timeout_s`` of their accept."""
        if self.hello_timeout_s <= 0:
            return []
        deadline = self.clock() - self.hello_timeout_s
        overdue = []
        for fd, c in self._open.items():
            if c.shut is None and c.accepted < deadline:
                seen = self._said(fd, c)
                if seen is None or not seen.hello:
                    overdue.append(fd)
        return overdue

    def memory(self, anon: int) -> bool:
        """Note the daemon's anonymous memory, ``anon`` bytes; is it past the budget?

        The budget counts from the lowest level seen (re-armed by `silent`).
        Called every check: it also advances ``tick`` and sets ``asking``.
        """
        self.tick += 1
        budget = self.memory_budget
        if budget <= 0:
            return False
        if self._low is None or anon < self._low:
            self._low = anon
        if anon <= self._low + budget // 2:
            self._calm = self.tick  # growth, if any, begins after this check
        self.asking = past = anon > self._low + budget
        return past

    def headroom(self, anon: int) -> int | None:
        """Bytes ``anon`` may grow before `memory` says past the budget (None: no budget)."""
        if self.memory_budget <= 0:
            return None
        low = anon if self._low is None else min(self._low, anon)
        return low + self.memory_budget - anon

    def silent(self, anon: int) -> list[int]:
        """Connections to shut down with memory still at ``anon`` after `memory` said past it.

        Those that sent no complete message since memory was last within half
        the budget: an unfinished message grows memory while its connection
        stays silent. Only once the request thread has heard everything queued
        since then (a backlog of complete messages also looks silent), unless
        memory is past twice the budget. None, and none being shut: the growth
        is the daemon's own, and the budget counts from here.
        """
        low, budget, calm = self._low, self.memory_budget, self._calm
        if low is None or budget <= 0 or anon <= low + budget:
            return []
        if not (self.waiting or self.drained >= calm) and anon <= low + 2 * budget:
            return []
        found = []
        for fd, c in self._open.items():
            if c.shut is None:
                seen = self._said(fd, c)
                if seen is None or seen.tick < calm:
                    found.append(fd)
        if not found and not any(c.shut for c in self._open.values()):
            self._low = anon
            self._calm = self.tick
        return found

    def shutdown(self, fds: list[int], reason: str) -> int:
        """`shutdown` each of ``fds`` (counted under ``reason``); how many were ended."""
        done = 0
        for fd in fds:
            conn = self._open.get(fd)
            if conn is None:
                continue
            if shutdown(fd, conn.inode):
                conn.shut = reason
                self.shut[reason] += 1
                done += 1
            else:  # closed and perhaps reused since its accept: not ours to touch
                del self._open[fd]
        return done


#: Reply bytes to one peer between two probes (`ReplyQueues`).
PROBE_BYTES: Final = 64 * 1024


@dataclass(slots=True)
class _Peer:
    #: Bytes of replies sent to it, and how many of them libzmq let go of (as of
    #: the last probe found done).
    sent: int = 0
    taken: int = 0
    #: ``sent`` at the last probe, and the probes pending: (tracker, ``sent`` after it).
    probed: int = 0
    probes: collections.deque[tuple[zmq.MessageTracker, int]] = field(
        default_factory=collections.deque
    )


class ReplyQueues:
    """Bytes of replies libzmq still holds, per peer, measured by probes (request thread only).

    A tracked send costs ~14 µs (zero-copy, and pyzmq's garbage thread told
    when libzmq lets go), so not every reply is tracked: once per
    `PROBE_BYTES` sent to a peer, one reply's last frame goes as a probe
    (`sending` says which). Replies to one peer leave in order, so a probe
    done means every byte before it was taken (written to the kernel, or
    dropped with the connection); what is queued is known to within
    `PROBE_BYTES`. `admits` says whether one more reply stays within
    ``limit`` (a reply to a peer with nothing queued always does).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._peers: dict[bytes, _Peer] = {}
        self._sends = 0
        #: Replies not sent because their peer was past the limit.
        self.dropped = 0

    @staticmethod
    def _settle(peer: _Peer) -> int:
        probes = peer.probes
        while probes and probes[0][0].done:
            peer.taken = probes.popleft()[1]
        return peer.sent - peer.taken

    def admits(self, identity: bytes, size: int) -> bool:
        """Does a reply of ``size`` bytes to ``identity`` fit under the limit now?"""
        if self.limit <= 0:
            return True
        peer = self._peers.get(identity)
        if peer is None:
            return True
        queued = self._settle(peer)
        return queued == 0 or queued + size <= self.limit

    def sending(self, identity: bytes, size: int) -> bool:
        """Count a reply of ``size`` bytes to ``identity``; is it to go tracked (a probe)?"""
        if self.limit <= 0:
            return False
        peer = self._peers.get(identity)
        if peer is None:
            peer = self._peers[identity] = _Peer()
        peer.sent += size
        self._sends += 1
        if self._sends % 4096 == 0:
            self._sweep()
        return peer.sent - peer.probed >= PROBE_BYTES

    def probe(self, identity: bytes, tracker: zmq.MessageTracker) -> None:
        """The probe `sending` asked for went out, tracked by ``tracker``."""
        peer = self._peers.get(identity)
        if peer is not None:
            peer.probed = peer.sent
            peer.probes.append((tracker, peer.sent))

    def send(self, sock: zmq.Socket[bytes], identity: bytes, reply: list[bytes]) -> bool:
        """Send ``reply`` to ``identity`` on the ROUTER ``sock`` (non-blocking),
        as a probe when due; False (nothing sent) when the peer is past the limit.

        A peer whose queue is full or that is gone loses the reply silently:
        libzmq drops it, as it would any reply to a closed connection.
        """
        size = sum(map(len, reply))
        if not self.admits(identity, size):
            self.dropped += 1
            return False
        send = _send
        probe = self.sending(identity, size)
        try:
            send(sock, identity, _NOBLOCK_SNDMORE)
            for part in reply[:-1]:
                send(sock, part, _NOBLOCK_SNDMORE)
            if probe:  # zero-copy (the socket's copy_threshold is 0), tracked
                self.probe(identity, send(sock, reply[-1], _NOBLOCK, False, True))
            else:
                send(sock, reply[-1], _NOBLOCK)
        except zmq.ZMQError:
            pass
        return True

    def _sweep(self) -> None:
        """Forget peers with no probe pending: at most `PROBE_BYTES` queued, or gone."""
        for identity, peer in list(self._peers.items()):
            self._settle(peer)
            if not peer.probes:
                del self._peers[identity]

    def queued(self) -> int:
        """Bytes queued to every peer, as last settled."""
        return sum(p.sent - p.taken for p in list(self._peers.values()) if p.probes)

    def peers(self) -> int:
        """Peers with a probe pending (replies they have not taken yet)."""
        return sum(1 for p in list(self._peers.values()) if p.probes)


def refuse_queued(sock: zmq.Socket[bytes], refuse: Callable[[list[bytes]], list[bytes]]) -> None:
    """Answer what is still queued on the ROUTER ``sock`` with ``refuse(frames)``
    (SHUTTING_DOWN) rather than silence, up to `_REFUSE_AT_EXIT` messages."""
    for _ in range(_REFUSE_AT_EXIT):
        try:
            ident = sock.recv(_NOBLOCK)
            frames = sock.recv_multipart(_NOBLOCK)
        except zmq.Again:
            return
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart([ident, *refuse(frames)], _NOBLOCK)


def transport_stats(watch: ConnectionWatch, replies: ReplyQueues) -> dict[str, Any]:
    """The ``transport`` stats section: connections, shut ones, queued and dropped replies."""
    return {
        "connections": len(watch),
        "shut": dict(sorted(watch.shut.items())),
        "replies_queued_bytes": replies.queued(),
        "replies_queued_peers": replies.peers(),
        "replies_dropped": replies.dropped,
    }
