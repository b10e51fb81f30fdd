"""Failure paths end to end: refusal, a client killed mid-request, a daemon restart."""

from __future__ import annotations

import signal
import time

BS = 16  # the tiny pool: 64 blocks of 16 tokens


def _state(daemon) -> dict:
    stats = daemon.stats()
    return {k: stats[k] for k in ("blocks", "prefix", "pools")}


def test_out_of_blocks_refusal_changes_nothing(kvd_daemon, spawn_agent) -> None:
    a = spawn_agent()
    a.ok("connect", address=kvd_daemon.address)
    a.ok("allocate", seq="big", tokens=list(range(40 * BS)))
    a.ok("commit", seq="big", n=20 * BS)
    before = _state(kvd_daemon)
    refused = a.do("allocate", seq="more", tokens=list(range(10_000, 10_000 + 30 * BS)))
    assert refused == {"ok": False, "error": "OutOfBlocks", "code": "OUT_OF_BLOCKS"}
    reserve = a.do("allocate", seq="r", tokens=[1, 2, 3], reserve=30 * BS)
    assert reserve["code"] == "OUT_OF_BLOCKS"
    assert _state(kvd_daemon) == before
    assert kvd_daemon.stats()["admission"]["refusals"]["OUT_OF_BLOCKS"] == 2
    assert kvd_daemon.check() == {"ok": True, "problems": []}
    # what fits is still served
    assert a.ok("allocate", seq="fits", tokens=list(range(20_000, 20_000 + 24 * BS)))


def test_killed_client_is_released_by_the_pid_watch(kvd_daemon, spawn_agent) -> None:
    a = spawn_agent()
    a.ok("connect", address=kvd_daemon.address)
    a.ok("allocate", seq="s", tokens=list(range(10 * BS)))
    a.ok("commit", seq="s", n=8 * BS)
    assert kvd_daemon.stats()["blocks"]["default"]["in_use"] == 10
    t0 = time.monotonic()
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    while kvd_daemon.stats()["clients"]["sessions"]:
        assert time.monotonic() - t0 < 30, "the session was never closed"
        time.sleep(0.02)
    stats = kvd_daemon.stats()
    # The pid watch closed it (the lease alone would take lease_ms = 5 s).
    assert stats["clients"]["closed"] == {"pid_exited": 1}
    blocks = stats["blocks"]["default"]
    assert (blocks["in_use"], blocks["evictable"]) == (0, 8)  # committed blocks stay cached
    assert kvd_daemon.check()["ok"] is True


def test_idle_live_client_keeps_its_session(start_kvd, spawn_agent) -> None:
    daemon = start_kvd(overrides={"server.lease_ms": "200"})
    a = spawn_agent()
    a.ok("connect", address=daemon.address)
    a.ok("allocate", seq="s", tokens=list(range(BS)))
    time.sleep(0.7)  # > 3 leases without a request; the pid watch renews it
    assert daemon.stats()["clients"]["sessions"] == 1
    assert a.ok("commit", seq="s") == {"committed": BS, "cached_blocks": 1}


def test_daemon_restart_loses_the_session_and_the_client_reattaches(start_kvd, spawn_agent) -> None:
    first = start_kvd(overrides={"server.drain_timeout_s": "0.2"})
    a = spawn_agent()
    old = a.ok("connect", address=first.address)
    a.ok("allocate", seq="s", tokens=list(range(2 * BS)))
    assert first.stop() == 0  # after the drain timeout: the agent still holds "s"

    second = start_kvd()
    lost = a.do("commit", seq="s")
    assert (lost["error"], lost["code"]) == ("SessionLost", "SESSION_LOST")
    # The next call re-attaches on its own, with the new daemon's epoch, and maps
    # the new pool file: bytes written now are what another process reads.
    prompt = list(range(500, 500 + 2 * BS))
    a.ok("allocate", seq="s2", tokens=prompt)
    a.ok("fill", seq="s2", start=0, stop=2 * BS, value=6.0)
    a.ok("commit", seq="s2")
    stats = second.stats()
    assert stats["server"]["epoch"] != old["epoch"]
    assert stats["clients"]["sessions"] == 1
    b = spawn_agent()
    b.ok("connect", address=second.address)
    assert b.ok("allocate", seq="s", tokens=[*prompt, 1])["cached"] == 2 * BS
    assert set(b.ok("read", seq="s", start=0, stop=2 * BS)["values"]) == {6.0}
    # the old sequence stays gone
    assert a.do("free", seq="s")["code"] == "SESSION_LOST"
