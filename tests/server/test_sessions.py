"""kvd.server.sessions: leases on an injected clock, the pid watch, peer credentials."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvd.server.sessions import PeerCred, SessionTable, parse_peer_address, pid_alive


class Clock:
    """A manual monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(clock: Clock, lease_s: float = 5.0) -> SessionTable:
    return SessionTable(lease_s, clock=clock, watch_pids=False)


def test_open_assigns_increasing_ids_and_lookup_finds_by_identity() -> None:
    table = _table(Clock())
    a = table.open(b"a", pool="p", name="x", pid=1)
    b = table.open(b"b", pool="p", name="y", pid=2)
    assert (a.id, b.id) == (1, 2)
    assert table.lookup(b"b") is b
    assert table.lookup(b"zz") is None
    assert len(table) == 2


def test_one_session_per_identity() -> None:
    table = _table(Clock())
    table.open(b"a", pool="p", name="x", pid=1)
    with pytest.raises(ValueError, match="already has a session"):
        table.open(b"a", pool="p", name="x", pid=1)


def test_lease_expires_without_requests() -> None:
    clock = Clock()
    table = _table(clock, lease_s=5.0)
    s = table.open(b"a", pool="p", name="x", pid=1)
    clock.now += 4.9
    assert table.expired() == []
    clock.now += 0.2
    assert table.expired() == [s]


def test_any_request_renews_the_lease() -> None:
    clock = Clock()
    table = _table(clock, lease_s=5.0)
    s = table.open(b"a", pool="p", name="x", pid=1)
    clock.now += 4.0
    table.lookup(b"a")
    clock.now += 4.0
    assert table.expired() == []
    assert s.requests == 1


def test_peek_does_not_renew() -> None:
    clock = Clock()
    table = _table(clock, lease_s=5.0)
    s = table.open(b"a", pool="p", name="x", pid=1)
    clock.now += 4.0
    assert table.peek(b"a") is s
    clock.now += 1.5
    assert table.expired() == [s]


def test_remove_forgets_and_is_idempotent() -> None:
    table = _table(Clock())
    s = table.open(b"a", pool="p", name="x", pid=1)
    table.remove(s)
    table.remove(s)
    assert table.lookup(b"a") is None
    assert len(table) == 0
    # the identity may open a new session afterwards
    assert table.open(b"a", pool="p", name="x", pid=1).id == 2


def test_pid_sweep_reports_dead_and_renews_live() -> None:
    clock = Clock()
    table = _table(clock, lease_s=5.0)
    live = table.open(b"a", pool="p", name="x", pid=10, peer=PeerCred(0, 0, 10))
    dead = table.open(b"b", pool="p", name="y", pid=11, peer=PeerCred(0, 0, 11))
    clock.now += 4.0
    assert table.sweep_pids(lambda s: s.watched_pid == 10) == [dead]
    assert live.last_seen == clock.now
    clock.now += 4.0
    # the live one was renewed by the watch; the dead one was not
    assert table.expired() == [dead]


def test_sessions_without_credentials_are_left_to_their_lease() -> None:
    clock = Clock()
    table = _table(clock, lease_s=5.0)
    s = table.open(b"a", pool="p", name="x", pid=10, peer=None)
    assert table.sweep_pids(lambda _: False) == []
    clock.now += 6.0
    assert table.expired() == [s]


def test_watch_follows_kernel_pid_not_the_claimed_one() -> None:
    table = _table(Clock())
    s = table.open(b"a", pool="p", name="x", pid=4242, peer=PeerCred(0, 0, os.getpid()))
    assert s.watched_pid == os.getpid()
    assert s.pid == 4242


def test_pid_alive_with_a_real_process_and_pidfd() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    table = SessionTable(5.0)
    s = table.open(b"a", pool="p", name="x", pid=proc.pid, peer=PeerCred(0, 0, proc.pid))
    try:
        if hasattr(os, "pidfd_open"):
            assert s.pidfd is not None
        assert pid_alive(s)
        assert table.sweep_pids() == []
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
        assert not pid_alive(s)
        assert table.sweep_pids() == [s]
    finally:
        table.remove(s)
        assert s.pidfd is None


def test_pid_alive_without_pidfd_uses_kill() -> None:
    table = SessionTable(5.0, watch_pids=False)
    me = table.open(b"a", pool="p", name="x", pid=1, peer=PeerCred(0, 0, os.getpid()))
    assert me.pidfd is None
    assert pid_alive(me)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    gone = table.open(b"b", pool="p", name="y", pid=1, peer=PeerCred(0, 0, proc.pid))
    assert not pid_alive(gone)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("localhost:1000:100:4242", PeerCred(1000, 100, 4242)),
        ("some:host:0:0:7", PeerCred(0, 0, 7)),
        ("127.0.0.1", None),
        ("", None),
        (None, None),
        ("localhost:0:0:0", None),
        ("localhost:a:b:c", None),
    ],
)
def test_parse_peer_address(value: str | None, expected: PeerCred | None) -> None:
    assert parse_peer_address(value) == expected


def test_info_lists_operator_fields() -> None:
    clock = Clock()
    table = _table(clock)
    s = table.open(b"a", pool="p", name="x", pid=3, namespace="t", peer=PeerCred(5, 6, 7))
    clock.now += 2.0
    info = s.info(clock.now)
    assert info["name"] == "x"
    assert info["peer_pid"] == 7
    assert info["uid"] == 5
    assert info["namespace"] == "t"
    assert info["age_s"] == 2.0
