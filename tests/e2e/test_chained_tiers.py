"""The chain end to end: two daemons ("nodes"), pool -> tier 1 (host) -> tier 2 (one redis-server).

Tier 1 is small (4 blocks over a pool of 8), so blocks leave it; what tier
1 recorded was written through to the store, where the other node, and
this one, still find it.
"""

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
_CTL = "import sys; from kvd_client.ctl import main; sys.exit(main())"
StartKvd = Callable[..., Any]
#: A redis-server fixture (tests/conftest.RedisServer).
Server = Any
#: Node A, node B and the store they share.
Nodes = tuple[KvdProcess, KvdProcess, Server]
#: The stats key of a chain's tier 2.
REMOTE = "default@tier2"


def chained(redis_server: Server) -> dict[str, str]:
    return {
        "pools.0.num_blocks": "8",
        "pools.0.tier_blocks": "4",
        "pools.0.remote_tier": "true",
        "tiers.remote.url": redis_server.url,
        "tiers.remote.timeout_s": "2.0",
        "tiers.remote.poll_s": "0.02",
    }


@pytest.fixture
def nodes(start_kvd: StartKvd, redis_server: Server, kvd_workdir: Any) -> Nodes:
    """Two chained daemons (own sockets, own shm pools and tiers 1) on one store."""
    a = start_kvd(address=f"ipc://{kvd_workdir / 'a.sock'}", overrides=chained(redis_server))
    b = start_kvd(address=f"ipc://{kvd_workdir / 'b.sock'}", overrides=chained(redis_server))
    return a, b, redis_server


def agents(spawn_agent: Callable[[], AgentProcess], daemon: KvdProcess, n: int) -> list[Any]:
    out = [spawn_agent() for _ in range(n)]
    for agent in out:
        agent.ok("connect", address=daemon.address)
    return out


def settled(daemon: KvdProcess, blocks: int) -> None:
    """Until ``blocks`` blocks were copied into tier 1 and written through to tier 2."""
    assert wait_for(daemon, lambda t: t["demotions"] >= blocks)["demotions"] == blocks
    assert wait_for(daemon, lambda t: t["demotions"] >= blocks, REMOTE)["demotions"] == blocks


def test_a_prefix_that_left_tier_1_is_a_hit_on_both_nodes_through_the_store(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess]
) -> None:
    a, b, _ = nodes
    writer, other, again = agents(spawn_agent, a, 3)
    (reader,) = agents(spawn_agent, b, 1)
    prompt = list(range(100, 100 + 3 * BS + 5))
    values = compute(writer, "req-a", prompt)
    settled(a, 3)
    evict_everything(other)
    # Four blocks of another prompt take tier 1's four slots: the prompt's three go.
    compute(other, "push", list(range(3000, 3000 + 4 * BS + 1)))
    assert wait_for(a, lambda t: t["evictions"] >= 3)["evictions"] == 3
    assert wait_for(b, lambda t: t["blocks"] >= 7, REMOTE)["blocks"] == 7

    r = reader.ok("allocate", seq="req-b", tokens=[*prompt, 1, 2])
    assert r["cached"] == 3 * BS
    assert reader.ok("read", seq="req-b", start=0, stop=3 * BS)["values"] == values[: 3 * BS]
    tier1, tier2 = b.stats()["tiers"]["default"], b.stats()["tiers"][REMOTE]
    assert (tier1["tier"], tier1["kind"], tier1["hits"], tier1["promotions"]) == (1, "host", 0, 0)
    assert (tier2["tier"], tier2["kind"], tier2["pool"]) == (2, "redis", "default")
    assert (tier2["hits"], tier2["promotions"], tier2["errors"]) == (3, 3, 0)

    evict_everything(other)  # node A itself: out of its pool and its tier 1, still in the store
    r = again.ok("allocate", seq="req-a2", tokens=prompt)
    assert r["cached"] == 3 * BS
    assert again.ok("read", seq="req-a2", start=0, stop=3 * BS)["values"] == values[: 3 * BS]
    assert a.stats()["tiers"][REMOTE]["promotions"] == 3
    assert a.check()["ok"] is True and b.check()["ok"] is True


def test_a_prompt_larger_than_tier_1_reaches_the_store_whole(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess]
) -> None:
    a, b, _ = nodes
    (writer,) = agents(spawn_agent, a, 1)
    (reader,) = agents(spawn_agent, b, 1)
    prompt = list(range(200, 200 + 6 * BS + 1))
    values = compute(writer, "req-a", prompt)
    # Tier 1 (4 slots) drops a block only once it went down to the store.
    settled(a, 6)
    assert wait_for(a, lambda t: t["evictions"] >= 2)["evictions"] == 2
    assert wait_for(b, lambda t: t["blocks"] >= 6, REMOTE)["blocks"] == 6
    assert reader.ok("allocate", seq="req-b", tokens=prompt)["cached"] == 6 * BS
    assert reader.ok("read", seq="req-b", start=0, stop=6 * BS)["values"] == values[: 6 * BS]


def head_in_tier_1_tail_in_the_store(
    a: KvdProcess, spawn_agent: Callable[[], AgentProcess]
) -> tuple[AgentProcess, list[int], list[float]]:
    """A 4-block prompt on node A with its first 2 blocks in tier 1 and the
    other 2 only in the store (none in the pool); a client, the prompt, its values."""
    writer, other = agents(spawn_agent, a, 2)
    prompt = list(range(500, 500 + 4 * BS + 1))
    values = compute(writer, "req-a", prompt)
    settled(a, 4)
    evict_everything(other)
    # The head comes back from tier 1 (now its most recent entries) ...
    assert writer.ok("allocate", seq="head", tokens=prompt[: 2 * BS + 1])["cached"] == 2 * BS
    writer.ok("free", seq="head")
    # ... and two blocks of another prompt take the tail's tier-1 slots.
    compute(other, "push", list(range(6000, 6000 + 2 * BS + 1)))
    assert wait_for(a, lambda t: t["evictions"] >= 2)["evictions"] == 2
    settled(a, 6)
    evict_everything(other)
    return writer, prompt, values


def test_a_prefix_in_tier_1_then_only_in_the_store_is_promoted_whole(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess]
) -> None:
    a, _, _ = nodes
    client, prompt, values = head_in_tier_1_tail_in_the_store(a, spawn_agent)
    r = client.ok("allocate", seq="all", tokens=prompt)
    assert r["cached"] == 4 * BS
    assert client.ok("read", seq="all", start=0, stop=4 * BS)["values"] == values[: 4 * BS]
    tier1, tier2 = a.stats()["tiers"]["default"], a.stats()["tiers"][REMOTE]
    assert (tier1["hits"], tier1["promotions"]) == (4, 4)  # the head twice
    assert (tier2["hits"], tier2["promotions"], tier2["errors"]) == (2, 2, 0)
    per_block = tier2["capacity_bytes"] // tier2["capacity"]
    assert tier2["bytes_moved"] == 8 * per_block  # 6 blocks written through, 2 read
    assert a.check()["ok"] is True
    out = subprocess.run(
        [sys.executable, "-c", _CTL, "--address", a.address, "stats", "tiers"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
        timeout=60,
    ).stdout
    assert "default.promotions:4" in out and "default@tier2.promotions:2" in out


def test_a_killed_store_still_promotes_the_tier_1_part(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess]
) -> None:
    a, b, server = nodes
    client, prompt, values = head_in_tier_1_tail_in_the_store(a, spawn_agent)
    assert wait_for(b, lambda t: t["blocks"] >= 6, REMOTE)["blocks"] == 6
    server.kill()
    # Node B has none of it in tier 1: a miss, counted.
    (reader,) = agents(spawn_agent, b, 1)
    assert reader.ok("allocate", seq="req-b", tokens=prompt)["cached"] == 0
    assert (b.stats()["tiers"][REMOTE]["errors"], b.stats()["tiers"]["default"]["hits"]) == (4, 0)
    r = client.ok("allocate", seq="all", tokens=prompt)
    assert r["cached"] == 2 * BS
    assert client.ok("read", seq="all", start=0, stop=2 * BS)["values"] == values[: 2 * BS]
    tier1, tier2 = a.stats()["tiers"]["default"], a.stats()["tiers"][REMOTE]
    assert (tier1["promotions"], tier1["errors"]) == (4, 0)
    assert (tier2["promotions"], tier2["errors"]) == (0, 2)
    assert tier2["store_errors"]["REMOTE_UNAVAILABLE"] >= 1
    # The names it could not read are forgotten: the next allocate stops at the pool's part.
    client.ok("free", seq="all")
    assert client.ok("allocate", seq="again", tokens=prompt)["cached"] == 2 * BS
    assert a.stats()["tiers"][REMOTE]["hits"] == 2
    # New blocks still reach tier 1; their copies to the store fail, counted.
    (writer,) = agents(spawn_agent, a, 1)
    compute(writer, "req-c", list(range(900, 900 + 2 * BS + 1)))
    assert wait_for(a, lambda t: t["demotions"] >= 8)["demotions"] == 8
    assert wait_for(a, lambda t: t["errors"] >= 4, REMOTE)["errors"] == 4
    assert a.check()["ok"] is True and b.check()["ok"] is True


def test_each_tier_of_the_chain_announces_its_medium(
    start_kvd: StartKvd,
    redis_server: Server,
    spawn_agent: Callable[[], AgentProcess],
    kvd_workdir: Any,
) -> None:
    endpoint = f"ipc://{kvd_workdir / 'ev.sock'}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    events = {"events.enabled": "true", "events.endpoint": endpoint, "events.replay_endpoint": ""}
    daemon = start_kvd(overrides=chained(redis_server) | events)
    (writer,) = agents(spawn_agent, daemon, 1)
    compute(writer, "req-a", list(range(2 * BS + 1)))
    stored: dict[str, int] = {}
    deadline = time.monotonic() + SETTLE_S
    while stored.get("REMOTE", 0) < 2 and time.monotonic() < deadline:
        if sub.poll(100):
            _, _, payload = sub.recv_multipart()
            for ev in msgpack.unpackb(payload)[1]:
                if ev["type"] == "BlockStored":
                    stored[ev["medium"]] = stored.get(ev["medium"], 0) + len(ev["block_hashes"])
    sub.close(0)
    assert stored == {"CPU": 2, "CPU_TIER1": 2, "REMOTE": 2}
