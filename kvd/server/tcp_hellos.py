"""Tcp hellos whose peer's process is found first (``server.tcp_pid_watch``).

At a tcp hello the request thread hands the hello over (`TcpHellos.offer`);
a loop task (`TcpHellos.serve`) finds the peer's pid in a worker thread
(`sessions.local_tcp_pid`, ~10 ms of /proc), then has the hello handled with
that pid expected, so the session is watched by pid like an ipc one. Each
waiting hello holds a duplicate of its connection's descriptor:
`sessions.PidLookups` bounds them (one per connection, 16 in all; BUSY past).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

import anyio
import anyio.lowlevel
import structlog
from kvd_client import wire

from kvd.server.dispatch import Dispatcher
from kvd.server.handshake import PendingHello
from kvd.server.sessions import PidLookups, local_tcp_pid

__all__ = ["TcpHellos"]

log = structlog.get_logger("kvd.server")

#: A tcp hello waiting for its peer's pid: identity, frames, CURVE user id, connection (a dup).
_Waiting = tuple[bytes, list[bytes], str | None, socket.socket]


class TcpHellos:
    """The tcp hellos of one daemon waiting for their peer's pid."""

    def __init__(self, dispatcher: Dispatcher, lock: threading.Lock) -> None:
        self._dispatcher = dispatcher
        self._lock = lock
        self._lookups = PidLookups()
        # Unbounded here: `_lookups` bounds what it holds.
        self._send, self._receive = anyio.create_memory_object_stream[_Waiting](
            max_buffer_size=float("inf")
        )

    def offer(
        self,
        identity: bytes,
        frames: list[bytes],
        user_id: str | None,
        fd: int,
        token: anyio.lowlevel.EventLoopToken,
    ) -> list[bytes] | None:
        """Queue a hello that came on tcp connection ``fd`` (request thread): ``[]``
        once queued, BUSY's reply when too many wait, None when the connection
        cannot be duplicated (the caller handles the hello now, without a pid)."""
        busy = self._lookups.begin(identity)
        if busy is not None:
            return self._dispatcher.refuse(frames, wire.Code.BUSY, busy)
        try:
            conn = socket.socket(fileno=os.dup(fd))
        except OSError:
            self._lookups.end(identity)
            return None
        anyio.from_thread.run_sync(
            self._send.send_nowait, (identity, frames, user_id, conn), token=token
        )
        return []

    async def serve(
        self,
        send: Callable[[bytes, list[bytes]], None],
        create: Callable[[PendingHello], None],
    ) -> None:
        """Find each queued hello's peer pid, then have the hello handled (loop task):
        its reply goes to ``send``, a pool it asks to create to ``create``."""
        dispatcher = self._dispatcher
        sessions = dispatcher.state.sessions
        async for identity, frames, user_id, conn in self._receive:
            try:
                pid = await anyio.to_thread.run_sync(local_tcp_pid, conn)
            finally:
                conn.close()
            with self._lock:
                sessions.expect_pid(identity, pid)
                reply = dispatcher.handle(identity, frames, None, user_id)
                if reply:  # answered (a session or a refusal): nothing more to expect
                    sessions.expect_pid(identity, None)
                pending = dispatcher.take_pending()
                self._lookups.end(identity)
            if pid is not None:
                log.info("tcp_peer_identified", peer_pid=pid)
            for job in pending:
                create(job)
            if reply:
                send(identity, reply)
