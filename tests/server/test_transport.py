"""kvd.server.transport: default paths, the live-daemon probe, socket file modes."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from kvd_client import wire

from kvd.config import ServerConfig
from kvd.errors import StartupError
from kvd.server.security import CurveKeys
from kvd.server.transport import (
    MAXMSGSIZE,
    bind_router,
    check_address,
    instance_id,
    probe_daemon,
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


_KEYS = CurveKeys(*zmq.curve_keypair())


def test_instance_id_is_stable_per_address() -> None:
    assert instance_id("ipc:///a") == instance_id("ipc:///a")
    assert instance_id("ipc:///a") != instance_id("ipc:///b")


def test_bind_sets_socket_mode_and_options(
    ctx: zmq.Context[zmq.Socket[bytes]], sockdir: Path
) -> None:
    path = sockdir / "kvd.sock"
    sock = bind_router(ctx, [f"ipc://{path}"], ServerConfig())
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        assert sock.getsockopt(zmq.MAXMSGSIZE) == MAXMSGSIZE > wire.MAX_MESSAGE_BYTES
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
                live.send_multipart([ident, bytes((wire.Kind.OK,)), poller_answer])

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
            bind_router(ctx, [f"tcp://127.0.0.1:{port}"], ServerConfig(), _KEYS)
    finally:
        taken.close()


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:*", "ipc://@kvd-test-abstract"])
def test_an_endpoint_without_a_socket_file_needs_curve_keys(
    ctx: zmq.Context[zmq.Socket[bytes]], address: str
) -> None:
    # No file mode protects a tcp port or an abstract socket: only CURVE vets its clients.
    with pytest.raises(StartupError, match="only with CURVE"):
        bind_router(ctx, [address], ServerConfig())


def test_ipc_endpoints_are_bound_before_the_curve_ones(
    ctx: zmq.Context[zmq.Socket[bytes]], sockdir: Path
) -> None:
    addresses = ["tcp://127.0.0.1:*", f"ipc://{sockdir}/kvd.sock"]
    sock = bind_router(ctx, addresses, ServerConfig(), _KEYS)
    try:
        assert sock.getsockopt(zmq.LAST_ENDPOINT).decode().startswith("tcp://")
        assert sock.getsockopt(zmq.CURVE_SERVER) == 1
    finally:
        sock.close(0)


def test_binding_leaves_the_process_umask_alone(
    ctx: zmq.Context[zmq.Socket[bytes]], sockdir: Path
) -> None:
    old = os.umask(0o022)
    try:
        bind_router(ctx, [f"ipc://{sockdir}/kvd.sock"], ServerConfig()).close(0)
        assert os.umask(0o022) == 0o022
    finally:
        os.umask(old)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_socket_directory_owned_by_another_user_is_refused(
    ctx: zmq.Context[zmq.Socket[bytes]], sockdir: Path
) -> None:
    theirs = sockdir / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)
    with pytest.raises(StartupError, match="owned by uid 4242"):
        check_address(f"ipc://{theirs}/kvd.sock", ServerConfig(), ctx)
