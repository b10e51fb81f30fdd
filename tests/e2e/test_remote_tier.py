"""Tier 2 end to end: two daemons with pools of their own ("two nodes") share one redis-server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from tiering import BS, AgentProcess, KvdProcess, compute, evict_everything, wait_for

StartKvd = Callable[..., Any]
#: A redis-server fixture (tests/conftest.RedisServer).
Server = Any
#: Node A, node B and the store they share.
Nodes = tuple[KvdProcess, KvdProcess, Server]


@pytest.fixture
def nodes(start_kvd: StartKvd, redis_server: Server, kvd_workdir: Any) -> Nodes:
    """Two daemons (own sockets, own shm pools of 8 blocks) on one store."""
    remote = {
        "pools.0.num_blocks": "8",
        "pools.0.remote_tier": "true",
        "tiers.remote.url": redis_server.url,
        "tiers.remote.timeout_s": "2.0",
        "tiers.remote.poll_s": "0.02",
    }
    a = start_kvd(address=f"ipc://{kvd_workdir / 'a.sock'}", overrides=remote)
    b = start_kvd(address=f"ipc://{kvd_workdir / 'b.sock'}", overrides=remote)
    assert a.instance != b.instance
    return a, b, redis_server


def shared(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess], prompt: list[int]
) -> tuple[AgentProcess, list[float]]:
    """``prompt`` computed on node A, stored remotely, evicted there and known
    to node B; a client of B and the values A wrote."""
    a, b, _ = nodes
    writer, other, reader = spawn_agent(), spawn_agent(), spawn_agent()
    writer.ok("connect", address=a.address)
    other.ok("connect", address=a.address)
    reader.ok("connect", address=b.address)
    values = compute(writer, "req-a", prompt)
    full = len(prompt) // BS
    assert wait_for(a, lambda t: t["demotions"] >= full)["demotions"] == full
    evict_everything(other)
    assert a.stats()["prefix"]["default"]["evictions"] >= full
    assert wait_for(b, lambda t: t["blocks"] >= full)["blocks"] == full
    return reader, values


def test_a_prefix_evicted_on_one_node_is_a_hit_on_the_other_with_its_bytes(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess]
) -> None:
    prompt = list(range(100, 100 + 3 * BS + 5))
    reader, values = shared(nodes, spawn_agent, prompt)
    _, b, _ = nodes
    r = reader.ok("allocate", seq="req-b", tokens=[*prompt, 1, 2])
    assert r["cached"] == 3 * BS
    assert reader.ok("read", seq="req-b", start=0, stop=3 * BS)["values"] == values[: 3 * BS]
    tier = b.stats()["tiers"]["default"]
    assert (tier["tier"], tier["kind"], tier["hits"], tier["promotions"]) == (2, "redis", 3, 3)
    assert (tier["errors"], tier["store_errors"]) == (0, {})
    assert tier["bytes_moved"] == 3 * (tier["capacity_bytes"] // tier["capacity"])
    assert b.check()["ok"] is True


def test_a_killed_store_gives_misses_and_counted_errors(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess]
) -> None:
    prompt = list(range(400, 400 + 2 * BS + 3))
    reader, _ = shared(nodes, spawn_agent, prompt)
    a, b, server = nodes
    server.kill()
    r = reader.ok("allocate", seq="req-b", tokens=prompt)
    assert r["cached"] == 0
    tier = b.stats()["tiers"]["default"]
    assert (tier["promotions"], tier["errors"]) == (0, 2)
    assert tier["store_errors"]["REMOTE_UNAVAILABLE"] >= 1
    # Its index forgot what it could not read: the next allocate misses at once.
    reader.ok("free", seq="req-b")
    assert reader.ok("allocate", seq="again", tokens=prompt)["cached"] == 0
    # Node A's copies of a new prompt fail too, and it serves on.
    writer = spawn_agent()
    writer.ok("connect", address=a.address)
    compute(writer, "req-c", list(range(900, 900 + 2 * BS + 1)))
    assert wait_for(a, lambda t: t["errors"] >= 2)["errors"] >= 2
    assert a.check()["ok"] is True and b.check()["ok"] is True


def test_a_corrupted_value_in_the_store_is_refused(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess]
) -> None:
    prompt = list(range(700, 700 + 2 * BS + 3))
    reader, _ = shared(nodes, spawn_agent, prompt)
    _, b, server = nodes
    for name in server.client.keys("kvd:*:*:*"):
        if not name.endswith(b":stored"):
            value = bytearray(server.client.get(name))
            value[-1] ^= 0xFF
            server.client.set(name, bytes(value))
    assert reader.ok("allocate", seq="req-b", tokens=prompt)["cached"] == 0
    tier = b.stats()["tiers"]["default"]
    assert (tier["promotions"], tier["errors"], tier["blocks"]) == (0, 2, 0)
    assert tier["store_errors"] == {"REMOTE_CORRUPT": 1}
    assert b.check()["ok"] is True
