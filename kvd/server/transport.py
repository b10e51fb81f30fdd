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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from pathlib import Path
from typing import Final

import msgpack
import structlog
import zmq
from kvd_client import wire

from kvd.config import ServerConfig
from kvd.errors import StartupError
from kvd.server.security import CurveKeys, bind_curve, check_dir

__all__ = [
    "MAXMSGSIZE",
    "bind_router",
    "check_address",
    "instance_id",
    "probe_daemon",
]

#: Per-frame limit given to libzmq; the protocol's limit (and TOO_LARGE) applies below it.
MAXMSGSIZE: Final = wire.MAX_MESSAGE_BYTES + 64 * 1024
#: Umask while binding: the socket file is created at most 0660 (chmod sets the mode after).
_BIND_UMASK: Final = 0o117

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
