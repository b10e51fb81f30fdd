"""Clients killed or stopped at random moments: the daemon stays consistent and frees their work.

Workers (``worker.py``) loop random valid operations and write KV that is a
function of the token prefix, so a block handed to two writers, or cached
KV that changed, shows up as an integrity count.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq.auth
from kvd_client import Client

from .conftest import ROOT, curve_overrides, sessions, total_counts, wait_for
from .worker import PREFIXES, kv_value

#: Unexpected in a run of valid operations, whatever happens to the processes.
BUGS = ("err.INTERNAL", "err.INVALID", "err.NOT_FOUND", "err.EXISTS", "err.TOO_LARGE", "integrity")


def _blocks(daemon) -> dict[str, int]:
    return daemon.stats()["blocks"]["default"]


def _assert_clean(daemon) -> None:
    """No session, nothing held or reserved, every block free or cached; CHECK passes."""
    assert daemon.check() == {"ok": True, "problems": []}
    b = _blocks(daemon)
    assert (b["in_use"], b["pinned"], b["reserved"]) == (0, 0, 0), b
    assert b["free"] + b["evictable"] == b["total"]
    assert daemon.stats()["pools"]["default"]["sequences"] == 0


def test_clients_killed_mid_operation_are_released_within_a_second(
    kvd_daemon, spawn_worker, worker_stats: Path
) -> None:
    rng = random.Random(8)
    workers = [spawn_worker(kvd_daemon.address) for _ in range(4)]
    for w in workers:
        w.read_event("ready")
    released_after = []
    for round_ in range(6):
        victim = workers[rng.randrange(len(workers))]
        time.sleep(rng.uniform(0.05, 0.4))  # a random moment of its loop
        victim.kill()
        released_after.append(
            wait_for(
                lambda pid=victim.pid: all(s["peer_pid"] != pid for s in sessions(kvd_daemon)),
                5.0,
                f"session of killed pid {victim.pid} closed",
            )
        )
        assert kvd_daemon.check()["ok"] is True
        if round_ < 5:  # restart a client in the freed slot
            fresh = workers[workers.index(victim)] = spawn_worker(
                kvd_daemon.address, slot=victim.slot
            )
            fresh.read_event("ready")
    for w in workers:
        w.kill()
    wait_for(lambda: not sessions(kvd_daemon), 5.0, "every session closed")

    assert max(released_after) < 1.0, released_after
    counts = total_counts(worker_stats)
    assert counts["ok.commit"] > 100 and counts["ok.fork"] > 0
    assert not {k: v for k, v in counts.items() if k in BUGS}, counts
    assert kvd_daemon.stats()["clients"]["closed"]["pid_exited"] == 6 + 3
    _assert_clean(kvd_daemon)
    assert _blocks(kvd_daemon)["evictable"] > 0  # the killed clients' committed blocks stay cached


def test_kv_committed_by_killed_clients_is_served_intact(kvd_daemon, spawn_worker) -> None:
    workers = [spawn_worker(kvd_daemon.address) for _ in range(3)]
    for w in workers:
        w.read_event("ready")
    time.sleep(1.0)
    for w in workers:
        w.kill()
    wait_for(lambda: not sessions(kvd_daemon), 5.0, "every session closed")

    with Client.connect(kvd_daemon.address, name="reader") as kv:
        hits = 0
        for k, prefix in enumerate(PREFIXES):
            seq = kv.allocate(f"r{k}", np.asarray([*prefix, 7], dtype=np.int32))
            n = seq.num_cached_tokens
            hits += n
            pos = np.arange(n)
            table = seq.block_table
            got = kv.pool.np_layers()[0][0, table[pos // 16], pos % 16, 0, 0]
            assert np.array_equal(got, kv_value(np.asarray(prefix[:n]), pos)), k
            seq.free()
    assert hits > 0


def test_a_stopped_ipc_client_keeps_its_session_while_its_process_lives(
    start_kvd, spawn_worker
) -> None:
    daemon = start_kvd(overrides={"server.lease_ms": "200"})
    worker = spawn_worker(daemon.address)
    worker.read_event("ready")
    time.sleep(0.3)
    worker.kill(signal.SIGSTOP)
    time.sleep(1.0)  # five leases without a request: the pid watch renews it
    assert [s["peer_pid"] for s in sessions(daemon)] == [worker.pid]
    before = worker.counts()
    worker.kill(signal.SIGCONT)
    wait_for(
        lambda: worker.counts().get("ok.commit", 0) > before.get("ok.commit", 0) + 20, 10, "work"
    )
    assert "err.SESSION_LOST" not in worker.counts()
    assert daemon.stats()["clients"]["closed"] == {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: tests/e2e/agent.py with CURVE keys for connect (tcp is served only with CURVE).
AGENT = Path(__file__).with_name("curve_agent.py")


class Agent:
    """tests/e2e/agent.py driven line by line (a client that is idle between commands)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )

    def do(self, op: str, **args) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def agents(kvd_env):
    started: list[Agent] = []

    def spawn() -> Agent:
        started.append(Agent(kvd_env))
        return started[-1]

    yield spawn
    for agent in started:
        agent.close()


def _curve(files: dict[str, Path]) -> list[str]:
    """The agent's ``curve`` argument: server public, client public, client secret (z85)."""
    server, _ = zmq.auth.load_certificate(files["server_public"])
    public, secret = zmq.auth.load_certificate(files["client_secret"])
    assert secret is not None
    return [server.decode(), public.decode(), secret.decode()]


def test_a_stopped_tcp_client_past_its_lease_gets_session_lost_and_its_blocks_stay_its_own(
    start_kvd, agents, curve_files
) -> None:
    # A tcp peer whose process is not found (here: tcp_pid_watch off; in life another host,
    # or another user's process) has no pid watch: the lease alone decides, and the blocks of
    # the expired session stay quarantined for 10 leases, so the stale writer's late write
    # lands in blocks nobody else holds.
    tcp = f"tcp://127.0.0.1:{_free_port()}"
    daemon = start_kvd(
        overrides={
            **curve_overrides(curve_files),
            "server.lease_ms": "300",
            "server.quarantine_leases": "10",
            "server.tcp_address": tcp,
            "server.tcp_pid_watch": "false",
        }
    )
    stopped, other = agents(), agents()
    assert stopped.do("connect", address=tcp, curve=_curve(curve_files))["ok"]
    assert stopped.do("allocate", seq="s", tokens=list(range(40 * 16)))["ok"]
    assert stopped.do("commit", seq="s", n=8 * 16)["ok"]
    stopped.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: not sessions(daemon), 5.0, "the silent tcp session expired")
        clients = daemon.stats()["clients"]
        assert (clients["closed"], clients["quarantined"]) == ({"lease_expired": 1}, 1)
        assert other.do("connect", address=daemon.address)["ok"]
        refused = other.do("allocate", seq="o", tokens=list(range(5000, 5000 + 50 * 16)))
        assert refused["code"] == "OUT_OF_BLOCKS"  # its 40 blocks are still out of circulation
    finally:
        stopped.proc.send_signal(signal.SIGCONT)
    # The resumed client finishes its write into its (stale) blocks before its next call...
    assert stopped.do("fill", seq="s", start=8 * 16, stop=40 * 16, value=9.0)["ok"]
    lost = stopped.do("commit", seq="s")
    assert (lost["error"], lost["code"]) == ("SessionLost", "SESSION_LOST")
    assert stopped.do("table", seq="s")["ok"]  # the stale handle is local state only...
    assert stopped.do("free", seq="s")["code"] == "SESSION_LOST"  # ...and stays dead

    # ...and once the quarantine is over another client gets those blocks, untouched by it.
    wait_for(lambda: daemon.stats()["clients"]["quarantined"] == 0, 10.0, "quarantine over")
    theirs = other.do("allocate", seq="o", tokens=list(range(5000, 5000 + 50 * 16)))
    assert theirs["ok"]
    assert other.do("fill", seq="o", start=0, stop=50 * 16, value=1.0)["ok"]
    assert set(other.do("read", seq="o", start=0, stop=50 * 16)["values"]) == {1.0}
    mine = stopped.do("allocate", seq="new", tokens=list(range(7 * 16)))  # re-attached
    assert mine["ok"] and not set(mine["table"]) & set(theirs["table"])
    assert mine["cached"] == 7 * 16 - 16  # its committed blocks stayed cached (capped hit)
    assert daemon.check()["ok"] is True
