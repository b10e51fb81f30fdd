"""kvd.server.sdnotify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from kvd.log import configure_logging
from kvd.server.sdnotify import Notifier


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """Route kvd's logs (JSON) into a buffer for the test, then restore logging."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    buf = io.StringIO()
    configure_logging("info", "json", stream=buf)
    yield buf
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def _events(buf: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A bound datagram socket playing systemd's side; yields (NOTIFY_SOCKET, socket)."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield path, sock
    sock.close()


def _recv(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_ready_sends_ready_and_status(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address})
    assert notifier.enabled
    assert notifier.ready(status="serving 1 pool")
    assert _recv(sock) == ["READY=1", "STATUS=serving 1 pool"]
    notifier.close()


def test_status_watchdog_and_stopping(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address})
    notifier.status("blocks in use 3/8")
    notifier.watchdog()
    notifier.stopping()
    assert _recv(sock) == ["STATUS=blocks in use 3/8"]
    assert _recv(sock) == ["WATCHDOG=1"]
    assert _recv(sock) == ["STOPPING=1"]
    notifier.close()


def test_status_text_stays_on_one_line(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address})
    notifier.status("two\nlines")
    assert _recv(sock) == ["STATUS=two lines"]
    notifier.close()


def test_reloading_carries_the_monotonic_clock(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address})
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    reloading, monotonic = _recv(sock)
    assert reloading == "RELOADING=1"
    key, _, value = monotonic.partition("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after
    notifier.close()


def test_extend_timeout_in_microseconds(systemd: tuple[str, socket.socket]) -> None:
    address, sock = systemd
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address})
    notifier.extend_timeout(90)
    assert _recv(sock) == ["EXTEND_TIMEOUT_USEC=90000000"]
    notifier.close()


def test_abstract_socket_names() -> None:
    name = f"kvd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert _recv(sock) == ["READY=1"]
        notifier.close()
    finally:
        sock.close()


def test_no_op_outside_systemd() -> None:
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    assert notifier.watchdog_interval() is None


def test_watchdog_interval_is_half_the_timeout() -> None:
    env = {"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "30000000"}
    assert Notifier.from_env(env).watchdog_interval() == 15.0


def test_watchdog_for_this_pid_only() -> None:
    mine = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    other = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier.from_env(mine).watchdog_interval() == 1.0
    assert Notifier.from_env(other).watchdog_interval() is None


@pytest.mark.parametrize("usec", ["", "0", "abc", "-5"])
def test_invalid_watchdog_usec_means_no_watchdog(usec: str) -> None:
    assert Notifier.from_env({"WATCHDOG_USEC": usec}).watchdog_interval() is None


def test_send_failure_returns_false_and_warns_once(tmp_path: Path, log_lines: io.StringIO) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    logs = _events(log_lines)
    assert [entry["event"] for entry in logs] == ["sd_notify failed"]
    assert logs[0]["level"] == "warning"
    notifier.close()


def test_unsupported_address_family_disables_the_notifier(log_lines: io.StringIO) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert len(_events(log_lines)) == 1


def test_full_receive_buffer_does_not_block(systemd: tuple[str, socket.socket]) -> None:
    address, _ = systemd
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address})
    # Nobody reads: the receiver's queue fills up and sends start failing
    # with EAGAIN instead of blocking the caller.
    results = [notifier.status("x" * 1000) for _ in range(10_000)]
    assert results[0] is True
    assert results[-1] is False
    notifier.close()
