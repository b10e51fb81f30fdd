"""The daemon stopped under load (SIGTERM), killed (SIGKILL) and restarted; a full pool."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
from kvd_client import Client

from kvd.memory.shm import segment_path

from .conftest import read_counts, sessions, total_counts, wait_for
from .test_client_faults import BUGS, _assert_clean

DRAIN_S = 4.0


def _log_events(daemon) -> list[str]:
    events = []
    for line in daemon.log().splitlines():
        if line.startswith("{"):
            events.append(json.loads(line).get("event"))
    return events


def test_sigterm_under_load_answers_every_request_and_cleans_up(
    start_kvd, spawn_worker, worker_stats: Path
) -> None:
    daemon = start_kvd(overrides={"server.drain_timeout_s": str(DRAIN_S)})
    workers = [spawn_worker(daemon.address, "--exit-on-shutdown") for _ in range(4)]
    for w in workers:
        w.read_event("ready")
    time.sleep(1.0)
    t0 = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.proc.wait(DRAIN_S + 10) == 0
    stopped_after = time.monotonic() - t0
    exits = [w.wait(30) for w in workers]

    assert exits == [0, 0, 0, 0]
    # Each worker met SHUTTING_DOWN (then freed what it held and left) or, holding
    # nothing when the last sequence was freed and the drain ended, the closed socket.
    # A request that reaches the daemon after its drain ended is never answered (a
    # change is proposed): at most the last request of a worker.
    for w in workers:
        counts = read_counts(worker_stats, w.slot)
        assert counts.get("err.SHUTTING_DOWN", 0) + counts.get("err.UNAVAILABLE", 0) >= 1, counts
        assert counts.get("err.UNAVAILABLE", 0) <= 1, counts
    counts = total_counts(worker_stats)
    assert not {k: v for k, v in counts.items() if k in BUGS}, counts
    assert stopped_after < DRAIN_S
    assert "drained" in _log_events(daemon)
    assert not Path(daemon.address[len("ipc://") :]).exists()
    assert not segment_path("/dev/shm", daemon.instance, "default").exists()


def test_sigterm_with_a_client_that_keeps_its_sequences_stops_at_the_deadline(start_kvd) -> None:
    daemon = start_kvd(overrides={"server.drain_timeout_s": "1.0"})
    with Client.connect(daemon.address, name="stubborn") as kv:
        seq = kv.allocate("s", np.arange(40, dtype=np.int32))
        t0 = time.monotonic()
        daemon.signal(signal.SIGTERM)
        wait_for(lambda: daemon.stats()["server"]["state"] == "draining", 5, "draining")
        seq.append(np.arange(3, dtype=np.int32))  # running sequences may go on while draining
        seq.commit()
        assert daemon.proc.wait(15) == 0
        stopped_after = time.monotonic() - t0
    assert 1.0 <= stopped_after < 1.0 + 3.0  # the deadline, plus exit and cleanup
    assert "drain_timeout" in _log_events(daemon)
    assert not Path(daemon.address[len("ipc://") :]).exists()
    assert not segment_path("/dev/shm", daemon.instance, "default").exists()


def test_after_a_sigkill_the_next_daemon_cleans_up_and_clients_reattach(
    start_kvd, spawn_worker, worker_stats: Path
) -> None:
    first = start_kvd()
    workers = [spawn_worker(first.address, "--timeout", "1.0") for _ in range(3)]
    for w in workers:
        w.read_event("ready")
    time.sleep(0.5)
    first.signal(signal.SIGKILL)
    first.proc.wait(10)
    sock = Path(first.address[len("ipc://") :])
    segment = segment_path("/dev/shm", first.instance, "default")
    assert sock.exists() and segment.exists()  # what a killed daemon leaves behind
    stale_inode = segment.stat().st_ino

    second = start_kvd()
    assert "stale_segments_removed" in _log_events(second)
    assert segment.stat().st_ino != stale_inode  # a new file at the same path
    pids = {w.pid for w in workers}
    wait_for(lambda: {s["peer_pid"] for s in sessions(second)} == pids, 20, "all re-attached")
    epoch = second.stats()["server"]["epoch"]
    for w in workers:
        before = w.counts().get("ok.commit", 0)
        wait_for(lambda w=w, b=before: w.counts().get("ok.commit", 0) > b + 10, 20, "work resumed")
        counts = w.counts()
        # Each learnt of the restart one way or the other, and none wrote into stale blocks.
        assert counts.get("err.SESSION_LOST", 0) + counts.get("err.UNAVAILABLE", 0) >= 1, counts
    assert second.stats()["server"]["epoch"] == epoch
    for w in workers:
        w.kill()
    wait_for(lambda: not sessions(second), 5.0, "every session closed")
    counts = total_counts(worker_stats)
    assert not {k: v for k, v in counts.items() if k in BUGS}, counts
    _assert_clean(second)


def test_a_full_pool_under_many_clients_refuses_with_out_of_blocks_only(
    kvd_daemon, spawn_worker, worker_stats: Path
) -> None:
    workers = [
        spawn_worker(kvd_daemon.address, "--seconds", "3", "--max-seqs", "8", "--max-len", "240")
        for _ in range(10)
    ]
    exits = [w.wait(60) for w in workers]
    for w in workers:
        w.read_event("exit")
    assert exits == [0] * 10  # no process died (no MemoryError, no SIGBUS)
    counts = total_counts(worker_stats)
    errors = {k: v for k, v in counts.items() if k.startswith("err.")}
    assert set(errors) == {"err.OUT_OF_BLOCKS"}, counts
    assert errors["err.OUT_OF_BLOCKS"] > 50 and counts.get("integrity", 0) == 0
    stats = kvd_daemon.stats()
    assert stats["admission"]["refusals"]["OUT_OF_BLOCKS"] == errors["err.OUT_OF_BLOCKS"]
    wait_for(lambda: not sessions(kvd_daemon), 5.0, "every session closed")
    _assert_clean(kvd_daemon)
