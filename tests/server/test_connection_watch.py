"""transport.ConnectionWatch and ReplyQueues, sessions.local_tcp_pid (issue #14, findings 4-6)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import zmq

from kvd.server.sessions import PidLookups, local_tcp_pid
from kvd.server.transport import ConnectionWatch, ReplyQueues, anon_rss, malloc_trim

MIB = 1 << 20


@pytest.fixture
def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_memory_past_the_budget_names_the_connections_silent_while_it_grew(pair) -> None:
    (quiet, _), (talker, _peer) = pair, socket.socketpair()
    watch = ConnectionWatch(hello_timeout_s=0, memory_budget=100 * MIB)
    watch.accepted(quiet.fileno())
    watch.accepted(talker.fileno())
    watch.waiting = True  # the request thread has heard everything
    assert not watch.memory(500 * MIB)  # the low-water mark
    assert not watch.memory(540 * MIB)  # within half the budget: calm
    watch.note(talker.fileno(), b"t").tick = watch.tick  # a complete message after calm
    assert watch.memory(610 * MIB)
    assert watch.silent(610 * MIB) == [quiet.fileno()]
    assert watch.shutdown([quiet.fileno()], "memory_guard") == 1
    assert _peer.fileno() >= 0 and pair[1].recv(1) == b""  # ended: its peer reads EOF
    assert watch.shut == {"memory_guard": 1}
    talker.close()
    _peer.close()


def test_growth_nobody_is_silent_for_re_arms_the_budget(pair) -> None:
    talker = pair[0]
    watch = ConnectionWatch(hello_timeout_s=0, memory_budget=100 * MIB)
    watch.accepted(talker.fileno())
    watch.waiting = True
    watch.memory(500 * MIB)
    watch.note(talker.fileno(), b"talker").tick = watch.tick
    assert watch.memory(700 * MIB)
    assert watch.silent(700 * MIB) == []  # the daemon's own growth
    assert not watch.memory(750 * MIB)  # counted from 700 now


def test_a_backlog_postpones_the_guard_until_twice_the_budget(pair) -> None:
    quiet = pair[0]
    watch = ConnectionWatch(hello_timeout_s=0, memory_budget=100 * MIB)
    watch.accepted(quiet.fileno())
    watch.memory(500 * MIB)  # the request thread is busy: never drained since
    assert watch.memory(650 * MIB)
    assert watch.silent(650 * MIB) == []  # its message may be queued, not unfinished
    assert watch.silent(750 * MIB) == [quiet.fileno()]


def test_a_reused_descriptor_is_never_shut(pair) -> None:
    a, _ = pair
    watch = ConnectionWatch(hello_timeout_s=0, memory_budget=0)
    watch.accepted(a.fileno())
    fd = a.fileno()
    a.close()
    other, keep = socket.socketpair()  # likely the same number: another socket's inode
    try:
        assert watch.shutdown([fd], "memory_guard") == 0
        other.send(b"x")
        assert keep.recv(1) == b"x"
    finally:
        other.close()
        keep.close()


def test_what_an_earlier_connection_said_at_the_number_is_not_the_new_ones() -> None:
    old, old_peer = socket.socketpair()
    watch = ConnectionWatch(hello_timeout_s=0, memory_budget=100 * MIB)
    watch.waiting = True
    watch.memory(500 * MIB)  # calm at this tick
    fd = old.fileno()
    watch.note(fd, b"old").tick = watch.tick  # it spoke after the calm check
    old.close()  # its CLOSED has not reached the loop yet
    new, new_peer = socket.socketpair()
    try:
        if new.fileno() != fd:
            pytest.skip("the descriptor number was not reused")
        watch.accepted(fd)  # the new connection: an unfinished message, never heard
        assert watch.memory(610 * MIB)
        assert watch.silent(610 * MIB) == [fd]
    finally:
        for s in (old_peer, new, new_peer):
            s.close()


def test_hello_deadline_names_connections_without_a_hello(pair) -> None:
    now = [0.0]
    a, b = pair
    watch = ConnectionWatch(hello_timeout_s=1.0, memory_budget=0, clock=lambda: now[0])
    watch.accepted(a.fileno())
    watch.accepted(b.fileno())
    watch.note(b.fileno(), b"b").hello = True
    now[0] = 1.5
    assert watch.overdue() == [a.fileno()]
    watch.closed(a.fileno())
    assert watch.overdue() == []


def test_reply_queues_stop_a_peer_that_does_not_read(tmp_path) -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.copy_threshold = 0  # as the daemon's: probes are zero-copy
    address = f"ipc://{tmp_path}/rq.sock"
    try:
        router.bind(address)
        dealer.setsockopt(zmq.ROUTING_ID, b"d")
        dealer.setsockopt(zmq.RCVHWM, 1)  # its own libzmq takes little off the wire
        dealer.connect(address)
        dealer.send(b"hi")
        router.recv_multipart()
        queues = ReplyQueues(limit=4 * MIB)
        size, sent = 16 << 10, 0
        while queues.admits(b"d", size) and sent < 10_000:
            probe = queues.sending(b"d", size)
            router.send(b"d", zmq.SNDMORE)
            if probe:
                queues.probe(b"d", router.send(bytes(size), copy=False, track=True))
            else:
                router.send(bytes(size))
            sent += 1
            time.sleep(0.0001 if sent % 64 == 0 else 0)  # libzmq's I/O thread writes meanwhile
        assert sent < 10_000, "never refused"
        assert sent * size <= 4 * MIB + 12 * MIB  # the limit, plus what the kernel took
        assert queues.queued() >= 3 * MIB
        while dealer.poll(200):
            dealer.recv()
        time.sleep(0.1)
        assert queues.admits(b"d", size)
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def test_local_tcp_pid_finds_the_process_at_the_other_end() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = f"import socket,sys; s=socket.create_connection(('127.0.0.1',{port})); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        conn, _ = server.accept()
        with conn:
            assert local_tcp_pid(conn) == proc.pid
    finally:
        proc.kill()
        proc.wait()
        server.close()


def test_own_memory_and_trim() -> None:
    assert anon_rss() > MIB
    assert malloc_trim() in (True, False)


def test_the_request_thread_is_asked_to_look_for_an_empty_queue_only_past_the_budget() -> None:
    watch = ConnectionWatch(hello_timeout_s=0, memory_budget=100 * MIB)
    assert not watch.memory(500 * MIB) and not watch.asking
    assert watch.memory(650 * MIB) and watch.asking  # drained/waiting matter now
    watch.waiting = True  # the request thread looked: its queue is empty
    assert watch.silent(650 * MIB) == []  # nobody to shut: re-armed at 650
    assert not watch.memory(660 * MIB) and not watch.asking


def test_headroom_is_what_memory_may_grow_before_the_budget() -> None:
    watch = ConnectionWatch(hello_timeout_s=0, memory_budget=100 * MIB)
    watch.memory(1000 * MIB)
    assert watch.headroom(1000 * MIB) == 100 * MIB
    assert watch.headroom(1060 * MIB) == 40 * MIB
    assert watch.headroom(1200 * MIB) == -100 * MIB


def test_no_budget_has_no_headroom() -> None:
    assert ConnectionWatch(hello_timeout_s=0, memory_budget=0).headroom(MIB) is None


def test_pid_lookups_take_one_hello_per_connection() -> None:
    lookups = PidLookups(limit=4)
    assert lookups.begin(b"a") is None
    assert lookups.begin(b"a") == "this connection's previous hello is still being answered"
    lookups.end(b"a")
    assert lookups.begin(b"a") is None


def test_pid_lookups_refuse_past_their_limit_until_one_ends() -> None:
    lookups = PidLookups(limit=2)
    assert lookups.begin(b"a") is None and lookups.begin(b"b") is None
    assert lookups.begin(b"c") == "2 tcp hellos are waiting for their peer's process; retry"
    lookups.end(b"a")
    assert lookups.begin(b"c") is None
    assert len(lookups) == 2
