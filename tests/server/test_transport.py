"""kvd.server.transport: default paths, the live-daemon probe, socket file modes."""

from __future__ import annotations

import socket
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from kvd_client import protocol as P

from kvd.config import ServerConfig
from kvd.errors import StartupError
from kvd.server.transport import (
    MAXMSGSIZE,
    bind_router,
    check_address,
    instance_id,
    ipc_path,
    probe_daemon,
    resolve_address,
    runtime_dir,
)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="kvd-t-", dir="/tmp") as d:
        yield Path(d)


@pytest.mark.parametrize(
    ("env", "uid", "expected"),
    [
        ({"RUNTIME_DIRECTORY": "/run/kvd-x"}, 1000, "/run/kvd-x"),
        ({"RUNTIME_DIRECTORY": "/run/a:/run/b"}, 0, "/run/a"),
        ({}, 0, "/run/kvd"),
        ({"XDG_RUNTIME_DIR": "/run/user/1000"}, 1000, "/run/user/1000/kvd"),
        ({}, 1000, "/tmp/kvd-1000"),
    ],
)
def test_runtime_dir(env: dict[str, str], uid: int, expected: str) -> None:
    assert runtime_dir(env, uid) == Path(expected)


def test_default_address_is_ipc_in_the_runtime_dir() -> None:
    address = resolve_address(ServerConfig(), {"RUNTIME_DIRECTORY": "/run/kvd"})
    assert address == "ipc:///run/kvd/kvd.sock"
    assert resolve_address(ServerConfig(address="tcp://127.0.0.1:5555")) == "tcp://127.0.0.1:5555"


def test_ipc_path_and_instance_id() -> None:
    assert ipc_path("ipc:///tmp/a.sock") == Path("/tmp/a.sock")
    assert ipc_path("tcp://127.0.0.1:1") is None
    assert instance_id("ipc:///a") == instance_id("ipc:///a")
    assert instance_id("ipc:///a") != instance_id("ipc:///b")


def test_bind_sets_socket_mode_and_options(
    ctx: zmq.Context[zmq.Socket[bytes]], sockdir: Path
) -> None:
    path = sockdir / "kvd.sock"
    sock = bind_router(ctx, [f"ipc://{path}"], ServerConfig())
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        assert sock.getsockopt(zmq.MAXMSGSIZE) == MAXMSGSIZE > P.MAX_MESSAGE_BYTES
        assert sock.getsockopt(zmq.LINGER) == 0
        assert sock.getsockopt(zmq.RCVHWM) == ServerConfig().rcvhwm
    finally:
        sock.close(0)


def test_check_creates_the_directory_with_its_mode(
    ctx: zmq.Context[zmq.Socket[bytes]], sockdir: Path
) -> None:
    path = sockdir / "sub" / "kvd.sock"
    check_address(f"ipc://{path}", ServerConfig(dir_mode=0o750), ctx)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750


def test_probe_finds_nobody_on_a_stale_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], sockdir: Path
) -> None:
    path = sockdir / "kvd.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens
    assert not probe_daemon(ctx, f"ipc://{path}", 100)
    check_address(f"ipc://{path}", ServerConfig(probe_timeout_ms=100), ctx)
    assert not path.exists()


def test_live_daemon_refuses_the_start(ctx: zmq.Context[zmq.Socket[bytes]], sockdir: Path) -> None:
    path = sockdir / "kvd.sock"
    live = bind_router(ctx, [f"ipc://{path}"], ServerConfig())
    poller_answer = msgpack.packb({"id": 1, "r": {"epoch": 1, "version": 1}})
    try:
        # Answer the probe's PING from a thread while check_address waits.
        def answer() -> None:
            if live.poll(2000):
                ident, *_ = live.recv_multipart()
                live.send_multipart([ident, bytes((P.Kind.OK,)), poller_answer])

        t = threading.Thread(target=answer)
        t.start()
        with pytest.raises(StartupError, match="another kvd is serving"):
            check_address(f"ipc://{path}", ServerConfig(probe_timeout_ms=2000), ctx)
        t.join()
        assert path.exists()
    finally:
        live.close(0)


def test_a_regular_file_at_the_path_is_not_replaced(
    ctx: zmq.Context[zmq.Socket[bytes]], sockdir: Path
) -> None:
    path = sockdir / "kvd.sock"
    path.write_text("precious")
    with pytest.raises(StartupError, match="not a socket"):
        check_address(f"ipc://{path}", ServerConfig(), ctx)
    assert path.read_text() == "precious"


def test_bind_failure_is_a_startup_error(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(StartupError, match="cannot bind"):
            bind_router(ctx, [f"tcp://127.0.0.1:{port}"], ServerConfig())
    finally:
        taken.close()
