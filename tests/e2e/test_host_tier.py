"""Tier 1 end to end: a prefix evicted from a small pool comes back from the host tier."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from tiering import BS, SETTLE_S, AgentProcess, KvdProcess, compute, evict_everything, wait_for

ROOT = Path(__file__).resolve().parents[2]
StartKvd = Callable[..., Any]
#: A pool of 8 blocks over a tier of 32 (4x), and the KV events on a free port.
TIERED = {"pools.0.num_blocks": "8", "pools.0.tier_blocks": "32"}
_CTL = "import sys; from kvd_client.ctl import main; sys.exit(main())"


@pytest.fixture
def tiered(start_kvd: StartKvd) -> KvdProcess:
    return start_kvd(overrides=TIERED)


def test_an_evicted_prefix_is_a_hit_from_tier_1_with_its_bytes(
    tiered: KvdProcess, spawn_agent: Callable[[], AgentProcess]
) -> None:
    a, b, c = spawn_agent(), spawn_agent(), spawn_agent()
    for agent in (a, b, c):
        agent.ok("connect", address=tiered.address)
    prompt = list(range(100, 100 + 3 * BS + 5))
    values = compute(a, "req-a", prompt)
    assert wait_for(tiered, lambda t: t["demotions"] >= 3)["demotions"] == 3
    evict_everything(b)
    assert tiered.stats()["prefix"]["default"]["evictions"] >= 3

    r = c.ok("allocate", seq="req-c", tokens=[*prompt, 1, 2])
    assert r["cached"] == 3 * BS
    assert c.ok("read", seq="req-c", start=0, stop=3 * BS)["values"] == values[: 3 * BS]
    tier = tiered.stats()["tiers"]["default"]
    assert (tier["hits"], tier["promotions"], tier["errors"]) == (3, 3, 0)
    assert tier["bytes_moved"] == 6 * tier["capacity_bytes"] // 32
    assert tiered.check()["ok"] is True


def test_an_allocate_in_a_batch_is_promoted_before_the_batch_is_answered(
    tiered: KvdProcess, spawn_agent: Callable[[], AgentProcess]
) -> None:
    a, b, c = spawn_agent(), spawn_agent(), spawn_agent()
    for agent in (a, b, c):
        agent.ok("connect", address=tiered.address)
    prompt = list(range(500, 500 + 3 * BS + 5))
    values = compute(a, "req-a", prompt)
    wait_for(tiered, lambda t: t["demotions"] >= 3)
    evict_everything(b)

    # A scheduler's step: a fresh prompt, then one whose prefix is in tier 1 only.
    r = c.ok("allocate_batch", prompts={"fresh": list(range(9000, 9000 + BS)), "req-c": prompt})
    assert (r["fresh"]["cached"], r["req-c"]["cached"]) == (0, 3 * BS)
    assert c.ok("read", seq="req-c", start=0, stop=3 * BS)["values"] == values[: 3 * BS]
    assert tiered.stats()["tiers"]["default"]["promotions"] == 3
    assert tiered.check()["ok"] is True


def test_a_prefix_partly_in_the_pool_continues_into_the_tier(
    tiered: KvdProcess, spawn_agent: Callable[[], AgentProcess]
) -> None:
    a, b = spawn_agent(), spawn_agent()
    a.ok("connect", address=tiered.address)
    b.ok("connect", address=tiered.address)
    prompt = list(range(300, 300 + 4 * BS + 1))
    values = compute(a, "req-a", prompt)
    wait_for(tiered, lambda t: t["demotions"] >= 4)
    # 6 fresh blocks: the 4 free ones, then the chain's tail (its blocks 3 and 2) first.
    b.ok("allocate", seq="other", tokens=list(range(7000, 7000 + 6 * BS)))
    b.ok("free", seq="other")
    r = b.ok("allocate", seq="again", tokens=prompt)
    assert r["cached"] == 4 * BS
    assert b.ok("read", seq="again", start=0, stop=4 * BS)["values"] == values[: 4 * BS]
    assert tiered.stats()["tiers"]["default"]["promotions"] == 2


def test_kvd_ctl_stats_shows_the_tier(
    tiered: KvdProcess, spawn_agent: Callable[[], AgentProcess]
) -> None:
    a = spawn_agent()
    a.ok("connect", address=tiered.address)
    compute(a, "req-a", list(range(2 * BS + 1)))
    wait_for(tiered, lambda t: t["demotions"] >= 2)
    out = subprocess.run(
        [sys.executable, "-c", _CTL, "--address", tiered.address, "stats", "tiers"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
        timeout=60,
    ).stdout
    assert "default.demotions:2" in out
    assert "default.capacity:32" in out


def test_tier_moves_are_kv_events_with_the_tier_medium(
    start_kvd: StartKvd, spawn_agent: Callable[[], AgentProcess], kvd_workdir: Any
) -> None:
    endpoint = f"ipc://{kvd_workdir / 'ev.sock'}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    overrides = TIERED | {
        "events.enabled": "true",
        "events.endpoint": endpoint,
        "events.replay_endpoint": "",
    }
    daemon = start_kvd(overrides=overrides)
    a = spawn_agent()
    a.ok("connect", address=daemon.address)
    compute(a, "req-a", list(range(2 * BS + 1)))
    stored: dict[str, int] = {}
    deadline = time.monotonic() + SETTLE_S
    while "CPU_TIER1" not in stored and time.monotonic() < deadline:
        if sub.poll(100):
            _, _, payload = sub.recv_multipart()
            for ev in msgpack.unpackb(payload)[1]:
                if ev["type"] == "BlockStored":
                    stored[ev["medium"]] = stored.get(ev["medium"], 0) + len(ev["block_hashes"])
    sub.close(0)
    assert stored == {"CPU": 2, "CPU_TIER1": 2}
