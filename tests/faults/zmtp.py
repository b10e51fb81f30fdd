"""A raw ZMTP 3.0 peer (NULL mechanism, DEALER) on a plain socket: hostile clients byte by byte.

libzmq queues a whole message before sending any of it and hides what is
in flight, so a test cannot tell how much of an unfinished message reached
the daemon through a zmq socket. Here every frame is ``sendall`` on a
blocking socket: when it returns, the kernel took the bytes (the daemon
has read all but a socket buffer's worth), and a daemon that drops the
connection shows as ``BrokenPipeError``/``ConnectionResetError``. Replies
are read only when asked for (`recv_message`), so a peer that never reads
is simply one that never calls it.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["RawPeer", "ipc_connect"]

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


def _greeting() -> bytes:
    # signature, version 3.0, mechanism "NULL" (20 bytes), as-server 0, filler (31 bytes)
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def _frame(body: bytes, flags: int) -> bytes:
    if len(body) < 256:
        return bytes((flags, len(body))) + body
    return bytes((flags | _LONG,)) + struct.pack(">Q", len(body)) + body


def _ready(socket_type: bytes) -> bytes:
    name = b"Socket-Type"
    body = b"\x05READY" + bytes((len(name),)) + name + struct.pack(">I", len(socket_type))
    return _frame(body + socket_type, _COMMAND)


def ipc_connect(address: str, timeout: float = 10.0) -> socket.socket:
    """A connected AF_UNIX stream socket to ``ipc://<path>``."""
    assert address.startswith("ipc://"), address
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(address[len("ipc://") :])
    return sock


class RawPeer:
    """One DEALER connection speaking ZMTP 3.0 by hand (NULL security: ipc endpoints)."""

    def __init__(self, address: str, timeout: float = 10.0) -> None:
        self.sock = ipc_connect(address, timeout)
        self.sock.sendall(_greeting() + _ready(b"DEALER"))
        greeting = self._read_exact(64)
        if greeting[0] != 0xFF or greeting[9] != 0x7F:
            raise ConnectionError(f"not a ZMTP peer: {greeting[:12]!r}")
        flags, body = self._read_frame()
        if not flags & _COMMAND or not body.startswith(b"\x05READY"):
            raise ConnectionError(f"no READY from the peer: {body[:16]!r}")

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionResetError("the peer closed the connection")
            buf += chunk
        return bytes(buf)

    def _read_frame(self) -> tuple[int, bytes]:
        flags = self._read_exact(1)[0]
        if flags & _LONG:
            (size,) = struct.unpack(">Q", self._read_exact(8))
        else:
            size = self._read_exact(1)[0]
        return flags, self._read_exact(size)

    def send_frame(self, body: bytes, more: bool) -> None:
        """One frame; ``more`` leaves the message unfinished."""
        self.sock.sendall(_frame(body, _MORE if more else 0))

    def send_frame_header(self, size: int, more: bool) -> None:
        """A long frame's header only (its ``size`` body bytes follow with `send_raw`)."""
        self.sock.sendall(bytes(((_MORE if more else 0) | _LONG,)) + struct.pack(">Q", size))

    def send_raw(self, data: bytes | memoryview) -> None:
        self.sock.sendall(data)

    def send_message(self, frames: list[bytes]) -> None:
        """A whole message (the DEALER's frames, no routing id)."""
        out = b"".join(_frame(f, _MORE if i < len(frames) - 1 else 0) for i, f in enumerate(frames))
        self.sock.sendall(out)

    def recv_message(self) -> list[bytes]:
        """The next whole message (commands, e.g. PING, are skipped)."""
        frames: list[bytes] = []
        while True:
            flags, body = self._read_frame()
            if flags & _COMMAND:
                continue
            frames.append(body)
            if not flags & _MORE:
                return frames

    def close(self) -> None:
        self.sock.close()
