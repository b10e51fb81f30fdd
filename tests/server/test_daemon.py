"""kvd.server.daemon: the real daemon process, from start to drain."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq
from kvd_client import wire

from kvd.memory.shm import segment_path


def test_starts_with_socket_0660_and_pool_segment(kvd_daemon) -> None:
    path = Path(kvd_daemon.address.removeprefix("ipc://"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o660
    segment = segment_path("/dev/shm", kvd_daemon.instance, "default")
    assert stat.S_IMODE(segment.stat().st_mode) == 0o660
    stats = kvd_daemon.stats()
    assert stats["server"]["pid"] == kvd_daemon.pid
    assert stats["blocks"]["default"]["total"] == 64


def test_sigterm_drains_and_removes_socket_and_segment(kvd_daemon) -> None:
    path = Path(kvd_daemon.address.removeprefix("ipc://"))
    segment = segment_path("/dev/shm", kvd_daemon.instance, "default")
    assert kvd_daemon.stop() == 0
    assert not path.exists()
    assert not segment.exists()
    log = kvd_daemon.log()
    assert '"draining"' in log
    assert '"stopped"' in log


def test_second_daemon_on_the_same_socket_refuses_to_start(start_kvd) -> None:
    first = start_kvd()
    second = start_kvd(wait=False)
    assert second.proc.wait(30) == 1
    lines = [ln for ln in second.log().splitlines() if ln.startswith("kvd: ")]
    assert lines == [f"kvd: another kvd is serving {first.address}; stop it first"]
    # the first one is untouched and still serving
    assert first.check()["ok"] is True


def test_stale_socket_and_segments_are_replaced(start_kvd) -> None:
    first = start_kvd()
    first.signal(signal.SIGKILL)
    first.proc.wait()
    path = Path(first.address.removeprefix("ipc://"))
    segment = segment_path("/dev/shm", first.instance, "default")
    assert path.exists() and segment.exists()  # what a crash leaves behind
    second = start_kvd()
    assert second.check()["ok"] is True
    assert '"stale_segments_removed"' in second.log()


def test_pool_too_large_is_one_line_and_exit_1(start_kvd) -> None:
    huge = start_kvd(overrides={"pools.0.num_blocks": str(2**31 - 1)}, wait=False)
    assert huge.proc.wait(30) == 1
    (line,) = [ln for ln in huge.log().splitlines() if ln.startswith("kvd: ")]
    assert "pool 'default'" in line
    assert "does not fit" in line


def test_budget_refuses_a_pool_set_above_it(start_kvd) -> None:
    d = start_kvd(overrides={"memory.budget_bytes": str(1024 * 1024)}, wait=False)
    assert d.proc.wait(30) == 1
    (line,) = [ln for ln in d.log().splitlines() if ln.startswith("kvd: ")]
    assert "does not fit the node's cap" in line


def test_drain_waits_for_running_sequences_then_exits(kvd_daemon) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kvd_daemon.address)

    def call(req: wire.Request) -> object:
        sock.send_multipart(req.encode())
        assert sock.poll(10_000)
        return wire.decode_reply(sock.recv_multipart())

    try:
        hello = wire.HelloRequest(
            id=1, version=wire.PROTOCOL_VERSION, pool="default", name="t", pid=os.getpid()
        )
        assert isinstance(call(hello), wire.OkReply)
        tokens = np.arange(20, dtype=np.int32)
        assert isinstance(
            call(wire.AllocateRequest(id=2, seq="s", tokens=tokens, reserve=64)), wire.OkReply
        )
        kvd_daemon.signal(signal.SIGTERM)
        # New work is refused, the running sequence may grow and finish.
        refused = call(wire.AllocateRequest(id=3, seq="t", tokens=tokens))
        while isinstance(refused, wire.OkReply):  # the signal may not have landed yet
            assert isinstance(call(wire.FreeRequest(id=4, seq="t")), wire.OkReply)
            refused = call(wire.AllocateRequest(id=3, seq="t", tokens=tokens))
        assert isinstance(refused, wire.ErrorReply)
        assert refused.code == wire.Code.SHUTTING_DOWN
        appended = call(wire.AppendRequest(id=5, seq="s", tokens=tokens[:4]))
        assert isinstance(appended, wire.OkReply)
        assert kvd_daemon.proc.poll() is None  # still draining: a sequence is held
        assert isinstance(call(wire.FreeRequest(id=6, seq="s")), wire.OkReply)
        assert kvd_daemon.proc.wait(30) == 0
        assert '"drained"' in kvd_daemon.log()
    finally:
        sock.close(0)


def test_second_signal_exits_at_once(kvd_daemon) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kvd_daemon.address)
    try:
        hello = wire.HelloRequest(
            id=1, version=wire.PROTOCOL_VERSION, pool="default", name="t", pid=os.getpid()
        )
        sock.send_multipart(hello.encode())
        sock.recv_multipart()
        tokens = np.arange(20, dtype=np.int32)
        sock.send_multipart(wire.AllocateRequest(id=2, seq="s", tokens=tokens).encode())
        sock.recv_multipart()
        kvd_daemon.signal(signal.SIGTERM)
        # wait until the daemon reports draining, then signal again
        while kvd_daemon.stats()["server"]["state"] != "draining":
            time.sleep(0.01)
        kvd_daemon.signal(signal.SIGINT)
        assert kvd_daemon.proc.wait(30) == 0
        assert '"exit_now"' in kvd_daemon.log()
        assert not Path(kvd_daemon.address.removeprefix("ipc://")).exists()
    finally:
        sock.close(0)


def test_kv_events_are_published_per_pool(start_kvd, kvd_workdir) -> None:
    endpoint = f"ipc://{kvd_workdir / 'events.sock'}"
    daemon = start_kvd(
        overrides={
            "events.enabled": "true",
            "events.endpoint": endpoint,
            "events.replay_endpoint": "",
            "events.topic": "kv@test@{pool}",
        }
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(daemon.address)

    def call(req: wire.Request) -> object:
        dealer.send_multipart(req.encode())
        assert dealer.poll(10_000)
        return wire.decode_reply(dealer.recv_multipart())

    try:
        hello = wire.HelloRequest(
            id=1, version=wire.PROTOCOL_VERSION, pool="default", name="t", pid=os.getpid()
        )
        assert isinstance(call(hello), wire.OkReply)
        stored = []
        tokens = np.arange(32, dtype=np.int32)
        # PUB drops what is sent before the subscription is in place: commit
        # fresh sequences until one BlockStored batch arrives.
        for i in range(200):
            call(wire.AllocateRequest(id=10 + i, seq=f"s{i}", tokens=tokens + 1000 * i))
            call(wire.CommitRequest(id=10 + i, seq=f"s{i}"))
            while sub.poll(20):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv@test@default"
                assert len(seq) == 8
                _, events, _ = msgpack.unpackb(payload)
                stored += [e for e in events if e["type"] == "BlockStored"]
            if stored:
                break
        assert stored
        assert stored[0]["block_size"] == 16
        assert len(stored[0]["token_ids"]) == 16 * len(stored[0]["block_hashes"])
        assert daemon.stats()["events"]["batches"] >= 1
        assert isinstance(call(wire.GoodbyeRequest(id=2)), wire.OkReply)
    finally:
        sub.close(0)
        dealer.close(0)


def test_pressure_notice_reaches_the_client(start_kvd) -> None:
    daemon = start_kvd(overrides={"admission.pressure_thresholds": "[0.5]"})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.address)
    try:
        hello = wire.HelloRequest(
            id=1, version=wire.PROTOCOL_VERSION, pool="default", name="t", pid=os.getpid()
        )
        sock.send_multipart(hello.encode())
        assert isinstance(wire.decode_reply(sock.recv_multipart()), wire.OkReply)
        tokens = np.arange(40 * 16, dtype=np.int32)  # 40 of the tiny pool's 64 blocks
        sock.send_multipart(wire.AllocateRequest(id=2, seq="s", tokens=tokens).encode())
        assert isinstance(wire.decode_reply(sock.recv_multipart()), wire.OkReply)
        assert sock.poll(10_000)
        notice = wire.decode_reply(sock.recv_multipart())
        assert isinstance(notice, wire.Notice)
        assert (notice.event, notice.data["level"]) == ("pressure", 1)
        sock.send_multipart(wire.GoodbyeRequest(id=3).encode())
        sock.recv_multipart()
    finally:
        sock.close(0)


def test_sighup_rereads_the_config_file(start_kvd, kvd_workdir) -> None:
    path = kvd_workdir / "kvd.toml"
    path.write_text('[log]\nlevel = "info"\n')
    daemon = start_kvd("--config", str(path))
    path.write_text('[log]\nlevel = "debug"\n[server]\nlease_ms = 1000\n')
    daemon.signal(signal.SIGHUP)
    while '"reloaded"' not in daemon.log():
        assert daemon.proc.poll() is None
        time.sleep(0.01)
    (line,) = [ln for ln in daemon.log().splitlines() if '"reloaded"' in ln]
    assert '"needs_restart": ["server"]' in line
    path.write_text("[server\n")
    daemon.signal(signal.SIGHUP)
    while '"reload_failed"' not in daemon.log():
        assert daemon.proc.poll() is None
        time.sleep(0.01)
    assert daemon.check()["ok"] is True


def test_cache_eviction_setting_reaches_the_engine(start_kvd) -> None:
    d = start_kvd(overrides={"cache.eviction": "lru"})
    assert d.stats()["prefix"]["default"]["eviction_policy"] == "lru"
