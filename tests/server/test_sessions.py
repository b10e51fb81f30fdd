"""kvd.server.sessions: leases on an injected clock, the pid watch, peer credentials."""

from __future__ import annotations

import os
import resource
import select
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvd.server.sessions import (
    FD_RESERVE,
    FDS_PER_SESSION,
    DescriptorBudget,
    PeerCred,
    SessionTable,
    nofile_limit,
    open_fd_count,
    parse_peer_address,
    pid_alive,
    session_capacity,
)


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


# -- the pid watch past FD_SETSIZE, and the descriptor budget (issue #14, finding 2) ----


@pytest.fixture
def many_fds() -> Iterator[None]:
    """The soft RLIMIT_NOFILE raised so that descriptors past 1024 can be opened."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if wanted < 2048:
        pytest.skip(f"hard RLIMIT_NOFILE {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open")
def test_pid_alive_with_a_pidfd_numbered_past_fd_setsize(many_fds: None) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    table = SessionTable(5.0)
    s = table.open(b"a", pool="p", name="x", pid=proc.pid, peer=PeerCred(0, 0, proc.pid))
    assert s.pidfd is not None
    high = os.dup2(s.pidfd, 1500)  # select() raises ValueError on this one
    os.close(s.pidfd)
    table._poller.unregister(s.pidfd)
    s.pidfd = high
    table._poller.register(high, select.POLLIN)
    try:
        assert pid_alive(s)
        assert table.sweep_pids() == []
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
        assert not pid_alive(s)
        assert table.sweep_pids() == [s]
    finally:
        table.remove(s)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open")
def test_sweep_watches_more_pidfds_than_fd_setsize(many_fds: None) -> None:
    table = SessionTable(5.0)
    me = PeerCred(0, 0, os.getpid())
    live = [
        table.open(bytes([k % 256, k // 256]), pool="p", name="x", pid=1, peer=me)
        for k in range(1100)
    ]
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = table.open(b"dead", pool="p", name="d", pid=1, peer=PeerCred(0, 0, proc.pid))
    proc.wait()
    try:
        assert max(s.pidfd or 0 for s in [*live, dead]) > 1024
        assert table.sweep_pids() == [dead]
        table.remove(dead)
        table.remove(live[0])  # unregistered from the poll set as it closes
        assert table.sweep_pids() == []
    finally:
        for s in list(table):
            table.remove(s)


def test_session_capacity() -> None:
    assert session_capacity(1024, 2, 64) == 480
    assert session_capacity(1024, 2, 64, in_use=20) == 470
    assert session_capacity(256, 2, 64, in_use=17) == 87
    assert session_capacity(50, 2, 64) == 0  # never negative
    assert session_capacity(1024) == (1024 - FD_RESERVE) // FDS_PER_SESSION
    with pytest.raises(ValueError):
        session_capacity(1024, 0)


class Counter:
    """An injected open-descriptor count."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.n


def test_budget_admits_until_the_reserve_and_decides_refusals_on_a_fresh_count() -> None:
    clock, fds = Clock(), Counter(20)
    budget = DescriptorBudget(limit=100, reserve=10, per_session=2, count=fds, clock=clock)
    admitted = 0
    while budget.admits():  # as a flood of hellos within one count's lifetime
        budget.opened()
        fds.n += 2  # what each session really added
        admitted += 1
    assert admitted == session_capacity(100, 2, 10, in_use=20) == 35
    assert fds.calls == 2  # one count at the start, one to confirm the refusal
    fds.n -= 10  # five sessions closed: room again, seen by the fresh count
    assert budget.admits()
    assert budget.describe() == {"limit": 100, "reserve": 10, "per_session": 2, "open": 80}


def test_budget_recounts_a_stale_count() -> None:
    clock, fds = Clock(), Counter(10)
    budget = DescriptorBudget(limit=100, reserve=0, count=fds, clock=clock, max_age_s=0.25)
    assert budget.admits() and budget.admits()
    assert fds.calls == 1
    clock.now += 1.0
    fds.n = 99  # connections that never said hello took the descriptors
    assert not budget.admits()
    assert fds.calls == 2


def test_budget_reads_the_process_limit() -> None:
    budget = DescriptorBudget()
    assert budget.limit == nofile_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert budget.capacity() == session_capacity(nofile_limit(), in_use=budget.describe()["open"])


def test_refusal_names_max_sessions_then_descriptors() -> None:
    fds = Counter(10)
    table = SessionTable(
        5.0,
        clock=Clock(),
        watch_pids=False,
        descriptors=DescriptorBudget(limit=20, reserve=4, count=fds),
    )
    assert table.refusal(max_sessions=8) is None
    table.open(b"a", pool="p", name="x", pid=1)
    assert table.refusal(max_sessions=1) == "the daemon already serves 1 sessions"
    assert table.refusal(max_sessions=8) is None  # 10 + 2 opened + 2 <= 20 - 4
    table.open(b"b", pool="p", name="x", pid=1)
    assert table.refusal(max_sessions=8) is None  # 10 + 2 x 2 opened + 2 <= 16
    table.open(b"c", pool="p", name="x", pid=1)
    fds.n = 16  # the fresh count confirms: 16 + 2 > 20 - 4
    reason = table.refusal(max_sessions=8)
    assert reason is not None and "file descriptors" in reason and "limit 20" in reason


def test_open_fd_count_follows_open_and_close() -> None:
    before = open_fd_count()
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        assert open_fd_count() == before + 1
    finally:
        os.close(fd)
    assert open_fd_count() == before


def test_raise_nofile_limit_lifts_the_soft_limit_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 64:
        pytest.skip(f"hard RLIMIT_NOFILE {hard}")
    code = (
        "import resource; from kvd.server.sessions import raise_nofile_limit, nofile_limit;"
        "before, after = raise_nofile_limit();"
        "print(before, after, nofile_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)),
    ).stdout.split()
    before, after, now, child_hard = (int(v) for v in out)
    assert before == 64
    assert after == now > 64
    if child_hard != resource.RLIM_INFINITY:
        assert after == child_hard
