"""The two ways frames reach the daemon: a blocking and an anyio DEALER socket.

Both only move frames: the client encodes the request, and an ``accept``
callback it passes (`ClientSession.accept`) picks the reply to the request
in flight out of what arrives (skipping notices and stale replies), so the
transports know nothing of the protocol.

Socket options, and why:

- ``IMMEDIATE=1``: messages are queued only to a completed connection. With
  no daemon listening a send waits (up to the timeout) instead of queueing a
  request that a daemon started minutes later would still execute.
- ``LINGER=0``: closing never blocks on unsent messages.
- ``curve``: a tcp endpoint of the daemon is served only with CURVE; the
  client gives the server's public key and its own key pair (z85), set
  before connecting. An unlisted key gets no connection at all (requests
  time out: `DaemonUnavailable`).
- ZeroMQ reconnects by itself after a daemon restart; the new daemon answers
  ``SESSION_LOST`` and the session re-attaches. A reply that arrives after its
  request timed out carries an old id and is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeAlias, TypeVar

import anyio
import zmq

from kvd_client.errors import DaemonUnavailable

__all__ = ["Accept", "AsyncTransport", "BlockingTransport", "CurveTriple", "dealer"]

#: CURVE keys of a tcp connection, z85: (server public, client public, client secret).
CurveTriple = tuple[bytes, bytes, bytes]

T = TypeVar("T")
#: ``accept(frames, req_id)``: the reply to ``req_id`` out of one received
#: message, or None to keep waiting (a notice, a stale reply); may raise.
Accept: TypeAlias = Callable[[list[bytes], int], T | None]

# Plain ints: pyzmq's flag enums cost an enum construction per operation.
_SNDMORE = int(zmq.SNDMORE)
# The Cython socket's own send and recv: zmq.Socket.send is a Python wrapper
# (routing ids, groups) around it, and reading RCVMORE through Socket.get
# builds a SocketOption enum per call (~1 µs); a received Frame carries ``more``.
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv


def _send_frames(sock: zmq.Socket[bytes], frames: Sequence[bytes]) -> None:
    """``send_multipart`` without its per-frame type checks (every frame is bytes here)."""
    last = len(frames) - 1
    for i in range(last):
        _send(sock, frames[i], _SNDMORE)
    _send(sock, frames[last], 0)


def _recv_frames(sock: zmq.Socket[bytes]) -> list[bytes]:
    """``recv_multipart``, reading each frame's ``more`` flag from the frame itself."""
    frame = _recv(sock, 0, False)
    parts = [frame.bytes]
    while frame.more:
        frame = _recv(sock, 0, False)
        parts.append(frame.bytes)
    return parts


def dealer(address: str, curve: CurveTriple | None = None) -> zmq.Socket[bytes]:
    """A DEALER socket connected to ``address`` (a CURVE client with ``curve``).

    ValueError for a malformed address or keys.
    """
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    try:
        if curve is not None:
            server, public, secret = curve
            sock.setsockopt(zmq.CURVE_SERVERKEY, server)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.connect(address)
    except zmq.ZMQError as exc:
        sock.close()
        raise ValueError(f"cannot connect to {address!r}: {exc}") from None
    return sock


class BlockingTransport:
    """Round trips on a blocking socket (send and receive time-outs in the socket)."""

    def __init__(self, address: str, curve: CurveTriple | None = None) -> None:
        self.address = address
        self._sock = dealer(address, curve)
        self._timeout_ms = -1

    def _set_timeout(self, ms: int) -> None:
        self._sock.setsockopt(zmq.SNDTIMEO, ms)
        self._sock.setsockopt(zmq.RCVTIMEO, ms)
        self._timeout_ms = ms

    def roundtrip(
        self, frames: Sequence[bytes], req_id: int, accept: Accept[T], timeout: float
    ) -> T:
        """Send ``frames``, return what ``accept`` takes; `DaemonUnavailable` after ``timeout``."""
        sock = self._sock
        ms = max(1, int(timeout * 1000))
        if ms != self._timeout_ms:  # the same every call but after a notice
            self._set_timeout(ms)
        deadline = 0.0
        try:
            _send_frames(sock, frames)
            while True:
                reply = accept(_recv_frames(sock), req_id)
                if reply is not None:
                    return reply
                # A notice or a stale reply: keep waiting, within the same deadline.
                now = time.monotonic()
                deadline = deadline or now + timeout
                if now >= deadline:
                    break
                ms = max(1, int((deadline - now) * 1000))
                if ms != self._timeout_ms:
                    self._set_timeout(ms)
        except zmq.Again:
            pass
        raise DaemonUnavailable(self.address, timeout)

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncTransport:
    """Round trips on a plain zmq socket driven by `anyio.wait_readable` on its FD.

    ZeroMQ's FD only signals that the socket's state may have changed
    (edge-triggered): always try the operation with NOBLOCK first and wait on
    the FD only after EAGAIN. Callers serialise round trips (one waiter per FD).
    """

    def __init__(self, address: str, curve: CurveTriple | None = None) -> None:
        self.address = address
        self._sock = dealer(address, curve)
        self._fd: int = self._sock.FD

    async def roundtrip(
        self, frames: Sequence[bytes], req_id: int, accept: Accept[T], timeout: float
    ) -> T:
        """Send ``frames``, return what ``accept`` takes; `DaemonUnavailable` after ``timeout``."""
        with anyio.move_on_after(timeout):
            await self._send(frames)
            while True:
                reply = accept(await self._recv(), req_id)
                if reply is not None:
                    return reply
        raise DaemonUnavailable(self.address, timeout)

    async def _send(self, frames: Sequence[bytes]) -> None:
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                await anyio.wait_readable(self._fd)

    async def _recv(self) -> list[bytes]:
        while True:
            try:
                return self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await anyio.wait_readable(self._fd)

    def close(self) -> None:
        self._sock.close(linger=0)
