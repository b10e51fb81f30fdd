"""No client can take the daemon down (issue #14): one test per finding, on a real daemon.

Each test drives a ``python -m kvd.cli`` process the way the probe did and
holds it to the fixed behaviour: the daemon is alive and answers PING
afterwards, refusals are replies with a stable code, and its memory
(``/proc/<pid>/status``: VmRSS, and VmHWM after resetting it through
``/proc/<pid>/clear_refs``) stays within the issue's goals.

Tests, by finding, and why each fails on main (before the fixes):

1. ``test_a_hello_creating_a_pool_on_a_backend_the_host_lacks_gets_a_reply``:
   the daemon exited 1 without a reply (StartupError escaped the creation
   task). Passes since 34f4f50 (the daemon loads cupy itself: UNSUPPORTED
   "cupy is not installed"); kept as the regression test. The device-99
   case checks INVALID for a missing device only on a host with cupy.
2. ``test_a_session_flood_is_refused_with_busy_before_descriptors_run_out``:
   RLIMIT_NOFILE 256: libzmq aborts on EMFILE (``ipc_listener.cpp``) after
   120 sessions; 1400: ``select()`` raises once a pidfd passes 1024 and the
   daemon stops (SHUTTING_DOWN).
3. ``test_a_msgpack_bomb_is_refused_within_the_decode_budget``: +595 MiB
   (8 MB) and +2.4 GiB (32 MB) peak, each holding the request thread for
   seconds.
4. ``test_an_unfinished_message_does_not_grow_the_daemon_without_bound``:
   +1 GiB RSS for 1 GiB of frames of one unfinished message.
5. ``test_clients_that_never_read_replies_leave_no_memory_behind``: the
   queued replies' memory stays with the allocator (+200 MiB) after the
   clients left.
6. ``test_a_stopped_local_tcp_client_keeps_its_session_and_its_blocks``: a
   tcp session has no pid watch (``peer_pid`` None): lease expiry,
   quarantine, then its blocks go to others.

Sizes are chosen for CI (each test a few seconds on 2 cores, at most ~1 GiB
of memory on a daemon that is not fixed). ``bench/hostile.py`` measures the
same figures with the issue's sizes and prints them beside the goals.
"""

from __future__ import annotations

import importlib.util
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvd_client import wire

from .conftest import curve_overrides, sessions, wait_for
from .test_client_faults import (
    _curve,
    _free_port,
    agents,  # noqa: F401 (the fixture, taken by name below)
)
from .zmtp import RawPeer

MIB = 1 << 20

#: The issue's goals.
UNFINISHED_GOAL_MIB = 160
BOMB_GOAL_MIB = 64
NON_READERS_GOAL_MIB = 64
#: A capability the host lacks (no cupy, no such GPU): UNAVAILABLE where the wire has it
#: (the issue's word), UNSUPPORTED (today's code for a backend this host cannot serve) or
#: INVALID (a device index that does not exist).
CAPABILITY_CODES = frozenset({"UNAVAILABLE", "UNSUPPORTED", "INVALID"})
#: Longest a bomb may hold the request thread (every other client waits meanwhile).
BOMB_STALL_S = 0.3

#: 32 blocks of 16 tokens, 2 layers x 2 heads x 16 dims of float16.
LAYOUT = wire.PoolLayout(
    num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=16, num_blocks=32
)


# -- helpers ---------------------------------------------------------------------------


def status_kib(pid: int, field: str) -> int:
    """``field`` (VmRSS, VmHWM, ...) of ``/proc/<pid>/status`` in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_mib(pid: int) -> float:
    return status_kib(pid, "VmRSS") / 1024


def reset_peak(pid: int) -> None:
    """Set VmHWM back to the current RSS (``clear_refs`` 5, Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_mib(pid: int) -> float:
    return status_kib(pid, "VmHWM") / 1024


def answers_ping(daemon: Any) -> bool:
    """Is the daemon process alive and does it answer PING on a fresh connection?"""
    if daemon.proc.poll() is not None:
        return False
    return isinstance(daemon.call(wire.PingRequest(id=77)), wire.OkReply)


def hello(name: str = "hostile", **fields: Any) -> list[bytes]:
    return wire.HelloRequest(
        id=1, version=wire.PROTOCOL_VERSION, pool="default", name=name, pid=1, **fields
    ).encode()


def reply_of(peer: RawPeer) -> wire.OkReply | wire.ErrorReply:
    reply = wire.decode_reply(peer.recv_message())
    assert not isinstance(reply, wire.Notice), reply
    return reply


@pytest.fixture
def fd_headroom() -> Iterator[None]:
    """This process's soft RLIMIT_NOFILE raised to its hard limit (many raw peers)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if wanted < 2048:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}: too few descriptors for the flood")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# -- finding 1: one hello ends the daemon ---------------------------------------------


@pytest.mark.parametrize(
    ("backend", "device"),
    [("cuda", 0), ("cuda", 99)],
    ids=["cuda-on-a-host-without-cupy", "a-device-that-does-not-exist"],
)
def test_a_hello_creating_a_pool_on_a_backend_the_host_lacks_gets_a_reply(
    kvd_daemon: Any, backend: str, device: int
) -> None:
    has_cupy = importlib.util.find_spec("cupy") is not None
    if device == 0 and has_cupy:
        pytest.skip("cupy is installed: a cuda pool on device 0 may well be created")
    req = wire.HelloRequest(
        id=5,
        version=wire.PROTOCOL_VERSION,
        pool=f"rt-{backend}-{device}",
        name="hostile",
        pid=1,
        layout=LAYOUT.to_dict(),
        create=True,
        backend=backend,
        device=device,
    )
    reply = kvd_daemon.call(req)
    assert reply is not None, f"no reply; daemon exit status {kvd_daemon.proc.poll()}"
    assert isinstance(reply, wire.ErrorReply), reply
    assert reply.id == 5
    assert str(reply.code) in CAPABILITY_CODES, reply
    assert reply.msg  # the reason: cupy missing, no such device
    assert answers_ping(kvd_daemon)
    # The daemon goes on serving, runtime pools included.
    ok = kvd_daemon.call(
        wire.HelloRequest(
            id=6,
            version=wire.PROTOCOL_VERSION,
            pool="rt-shm",
            name="after",
            pid=1,
            layout=LAYOUT.to_dict(),
            create=True,
        )
    )
    assert isinstance(ok, wire.OkReply), ok


# -- finding 2: ~510 sessions end the daemon ------------------------------------------


@pytest.mark.parametrize("nofile", [256, 1400], ids=["emfile", "pidfd-past-1024"])
def test_a_session_flood_is_refused_with_busy_before_descriptors_run_out(
    start_kvd: Any, fd_headroom: None, nofile: int
) -> None:
    # 1400 descriptors: the sessions' pidfds pass 1024 (FD_SETSIZE) before the limit.
    daemon = start_kvd(wait=False, overrides={"server.pid_watch_ms": "50"})
    # Lowered before the interpreter is through its imports (Popen returns at exec).
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (nofile, nofile))
    daemon.wait_ready()
    peers: list[RawPeer] = []
    opened = busy = 0
    failure = None
    try:
        for _ in range(nofile):  # more connections than the daemon has descriptors
            try:
                peer = RawPeer(daemon.address, timeout=3.0)
                peers.append(peer)
                peer.send_message(hello(f"flood-{len(peers)}"))
                reply = reply_of(peer)
            except OSError as exc:  # refused, reset, or a handshake that never came
                failure = f"connection {len(peers)}: {exc!r}"
                break
            if isinstance(reply, wire.OkReply):
                assert not busy, "a session opened after a BUSY refusal"
                opened += 1
                continue
            assert reply.code == wire.Code.BUSY, reply
            busy += 1
            if busy == 8:  # a few more: each refused connection still holds a descriptor
                break
        time.sleep(0.3)  # several pid-watch sweeps over every pidfd
        assert daemon.proc.poll() is None, f"the daemon died after {opened} sessions: {failure}"
        assert failure is None, failure
        assert busy == 8, (opened, busy)
        assert opened >= (nofile - 192) // 2, f"refused too early: {opened} sessions"
        assert answers_ping(daemon)
        for peer in peers:
            peer.send_message(wire.GoodbyeRequest(id=2).encode())
    finally:
        for peer in peers:
            peer.close()
    wait_for(lambda: not sessions(daemon), 10.0, "every session closed")
    assert isinstance(daemon.call(hello("after")), wire.OkReply)  # descriptors came back


# -- finding 3: a small message, a huge allocation -------------------------------------


def nested_empty_arrays(nbytes: int) -> bytes:
    """A msgpack body of about ``nbytes``: arrays of 16384 empty arrays (~64 B each decoded)."""
    inner = b"\xdc\x40\x00" + b"\x90" * 16384  # array16 of 16384 x fixarray(0)
    n = max(1, nbytes // len(inner))
    return b"\xdc" + n.to_bytes(2, "big") + inner * n


@pytest.mark.parametrize("megabytes", [8, 32])
def test_a_msgpack_bomb_is_refused_within_the_decode_budget(
    kvd_daemon: Any, megabytes: int
) -> None:
    pid = kvd_daemon.pid
    frames = [bytes((wire.Kind.PING,)), nested_empty_arrays(megabytes * MIB)]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(kvd_daemon.address)
        assert answers_ping(kvd_daemon)
        base = rss_mib(pid)
        reset_peak(pid)
        t0 = time.monotonic()
        sock.send_multipart(frames, copy=False)
        assert sock.poll(30_000), "no reply to the bomb"
        took = time.monotonic() - t0
        reply = wire.decode_reply(sock.recv_multipart())
    finally:
        sock.close(0)
    growth = peak_mib(pid) - base
    assert isinstance(reply, wire.ErrorReply), reply
    assert reply.code in (wire.Code.TOO_LARGE, wire.Code.INVALID), reply
    assert answers_ping(kvd_daemon)
    assert growth <= BOMB_GOAL_MIB, f"{megabytes} MB bomb: +{growth:.0f} MiB peak"
    assert took <= BOMB_STALL_S, f"{megabytes} MB bomb held the daemon {took:.2f} s"


# -- finding 4: an unfinished message grows memory without bound -----------------------


def test_an_unfinished_message_does_not_grow_the_daemon_without_bound(kvd_daemon: Any) -> None:
    pid = kvd_daemon.pid
    total, chunk = 1 << 30, bytes(MIB)
    peer = RawPeer(kvd_daemon.address)
    base = rss_mib(pid)
    reset_peak(pid)
    sent = 0
    try:
        peer.send_frame(bytes((wire.Kind.PING,)), more=True)
        while sent < total:  # 1 GiB as 1 MiB frames of one message that never ends
            peer.send_frame_header(len(chunk), more=True)
            peer.send_raw(chunk)
            sent += len(chunk)
        time.sleep(0.2)  # what is still in the socket buffers reaches the daemon
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon dropped the connection: what the fix may do
    growth = peak_mib(pid) - base
    held = rss_mib(pid) - base
    try:
        assert answers_ping(kvd_daemon)
        assert growth <= UNFINISHED_GOAL_MIB, (
            f"+{growth:.0f} MiB peak (+{held:.0f} MiB held) after {sent // MIB} MiB unfinished"
        )
    finally:
        peer.close()


# -- finding 5: clients that never read replies ----------------------------------------

NON_READERS = 200
#: CLIENTS requests per non-reader (each reply lists every session: ~40 KB with 200).
REQUESTS_EACH = 40


def test_clients_that_never_read_replies_leave_no_memory_behind(kvd_daemon: Any) -> None:
    pid = kvd_daemon.pid
    for _ in range(3):
        assert isinstance(kvd_daemon.call(wire.ClientsRequest(id=1)), wire.OkReply)
    base = rss_mib(pid)
    peers = [RawPeer(kvd_daemon.address) for _ in range(NON_READERS)]
    try:
        for k, peer in enumerate(peers):
            peer.send_message(hello(f"deaf-{k}"))
        clients = wire.ClientsRequest(id=3).encode()
        for _ in range(REQUESTS_EACH):
            for peer in peers:
                peer.send_message(clients)
        for peer in peers:
            peer.send_message(wire.GoodbyeRequest(id=4).encode())
        wait_for(lambda: not sessions(kvd_daemon), 60.0, "every deaf client said goodbye")
    finally:
        for peer in peers:
            peer.close()
    # Gone: their queued replies are freed, and the daemon gives the memory back when idle.
    deadline = time.monotonic() + 5.0
    while rss_mib(pid) - base > NON_READERS_GOAL_MIB and time.monotonic() < deadline:
        time.sleep(0.1)
    left = rss_mib(pid) - base
    assert answers_ping(kvd_daemon)
    assert left <= NON_READERS_GOAL_MIB, f"+{left:.0f} MiB left after {NON_READERS} non-readers"


# -- finding 6: a paused TCP client can write into reused blocks -----------------------


def test_a_stopped_local_tcp_client_keeps_its_session_and_its_blocks(
    start_kvd: Any, request: pytest.FixtureRequest, curve_files: dict[str, Path]
) -> None:
    # A local tcp peer is identified (its socket's process, as ``ss -p`` finds it) and
    # watched by pid like an ipc peer: stopped past its lease and quarantine, it keeps
    # its session and its blocks, so its late writes land in blocks nobody else has.
    tcp = f"tcp://127.0.0.1:{_free_port()}"
    daemon = start_kvd(
        overrides={
            **curve_overrides(curve_files),
            "server.lease_ms": "200",
            "server.quarantine_leases": "2",
            "server.pid_watch_ms": "50",
            "server.tcp_address": tcp,
        }
    )
    spawn = request.getfixturevalue("agents")
    stopped, other = spawn(), spawn()
    assert stopped.do("connect", address=tcp, curve=_curve(curve_files))["ok"]
    pid = stopped.proc.pid
    assert [s["peer_pid"] for s in sessions(daemon)] == [pid]  # identified over tcp
    assert stopped.do("allocate", seq="s", tokens=list(range(40 * 16)))["ok"]
    assert stopped.do("commit", seq="s", n=8 * 16)["ok"]
    stopped.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(1.5)  # lease (0.2 s) and quarantine (0.4 s) over, several times
        assert [s["peer_pid"] for s in sessions(daemon)] == [pid]
        assert daemon.stats()["clients"]["closed"] == {}
        assert other.do("connect", address=daemon.address)["ok"]
        refused = other.do("allocate", seq="o", tokens=list(range(5000, 5000 + 50 * 16)))
        assert refused["code"] == "OUT_OF_BLOCKS"  # its 40 blocks are still its own
    finally:
        stopped.proc.send_signal(signal.SIGCONT)
    assert stopped.do("fill", seq="s", start=8 * 16, stop=40 * 16, value=9.0)["ok"]
    assert stopped.do("commit", seq="s")["ok"]  # no SESSION_LOST: it never lost it
    assert set(stopped.do("read", seq="s", start=8 * 16, stop=40 * 16)["values"]) == {9.0}
    assert stopped.do("free", seq="s")["ok"]
    theirs = other.do("allocate", seq="o", tokens=list(range(5000, 5000 + 50 * 16)))
    assert theirs["ok"]
    # Killed, it is released by the pid watch as an ipc peer is (not by its lease).
    stopped.proc.kill()
    stopped.proc.wait()
    wait_for(lambda: len(sessions(daemon)) == 1, 2.0, "the killed tcp client's session closed")
    assert daemon.stats()["clients"]["closed"] == {"pid_exited": 1}
    assert daemon.check()["ok"] is True


# -- the limits behind findings 4 and 5 -------------------------------------------------


def test_a_peer_past_its_queued_reply_bytes_loses_its_session_not_the_others(
    start_kvd: Any,
) -> None:
    daemon = start_kvd(overrides={"server.max_queued_reply_bytes": str(256 << 10)})
    deaf = RawPeer(daemon.address)
    try:
        deaf.send_message(hello("deaf"))
        stats = wire.StatsRequest(id=3).encode()  # a few KB each, never read
        for _ in range(2000):
            deaf.send_message(stats)
        wait_for(
            lambda: daemon.stats()["clients"]["closed"].get("replies_unread") == 1,
            20.0,
            "the non-reader's session closed",
        )
        transport = daemon.stats()["transport"]
        assert transport["replies_dropped"] > 0, transport
        assert answers_ping(daemon)  # everyone else is served meanwhile
    finally:
        deaf.close()


def test_a_connection_that_sends_no_hello_is_shut_after_the_deadline(start_kvd: Any) -> None:
    daemon = start_kvd(overrides={"server.hello_timeout_ms": "300"})
    quiet, talker = RawPeer(daemon.address), RawPeer(daemon.address)
    try:
        talker.send_message(hello("talker"))
        assert isinstance(reply_of(talker), wire.OkReply)
        quiet.sock.settimeout(5.0)
        t0 = time.monotonic()
        assert quiet.sock.recv(1) == b""  # the daemon ended it
        assert time.monotonic() - t0 < 3.0
        wait_for(
            lambda: daemon.stats()["transport"]["shut"].get("no_hello", 0) >= 1,
            2.0,
            "counted under no_hello",
        )
        talker.send_message(wire.HeartbeatRequest(id=2).encode())
        assert isinstance(reply_of(talker), wire.OkReply)  # a session's connection stays
    finally:
        quiet.close()
        talker.close()
