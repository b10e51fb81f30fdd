"""Tier 2 on Mooncake Store end to end: two daemons ("two nodes"), each lending the store a
segment, share one mooncake_master; node B finds what node A stored through A's log."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from tiering import BS, AgentProcess, KvdProcess, compute, evict_everything, wait_for

StartKvd = Callable[..., Any]
#: A mooncake_master fixture (tests/conftest.MooncakeMaster).
Master = Any
Nodes = tuple[KvdProcess, KvdProcess, Master]


@pytest.fixture
def nodes(start_kvd: StartKvd, mooncake_master: Master, kvd_workdir: Any) -> Nodes:
    """Two daemons (own sockets, own shm pools of 8 blocks) on one Mooncake Store."""
    remote = {
        "pools.0.num_blocks": "8",
        "pools.0.remote_tier": "true",
        "tiers.remote.url": mooncake_master.url,
        "tiers.remote.poll_s": "0.02",
    }
    a = start_kvd(address=f"ipc://{kvd_workdir / 'a.sock'}", overrides=remote)
    b = start_kvd(address=f"ipc://{kvd_workdir / 'b.sock'}", overrides=remote)
    return a, b, mooncake_master


def shared(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess], prompt: list[int]
) -> tuple[AgentProcess, list[float]]:
    """``prompt`` computed on node A, stored in Mooncake, evicted there and known
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
    assert wait_for(b, lambda t: t["blocks"] >= full)["blocks"] == full
    return reader, values


def test_a_prefix_stored_by_one_node_is_a_hit_on_the_other_with_its_bytes(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess]
) -> None:
    prompt = list(range(100, 100 + 3 * BS + 5))
    reader, values = shared(nodes, spawn_agent, prompt)
    _, b, _ = nodes
    r = reader.ok("allocate", seq="req-b", tokens=[*prompt, 1, 2])
    assert r["cached"] == 3 * BS
    assert reader.ok("read", seq="req-b", start=0, stop=3 * BS)["values"] == values[: 3 * BS]
    tier = b.stats()["tiers"]["default"]
    assert (tier["tier"], tier["kind"], tier["hits"], tier["promotions"]) == (2, "mooncake", 3, 3)
    assert (tier["errors"], tier["store_errors"]) == (0, {})
    assert b.check()["ok"] is True


def test_a_killed_master_gives_misses_and_counted_errors(
    nodes: Nodes, spawn_agent: Callable[[], AgentProcess]
) -> None:
    prompt = list(range(400, 400 + 2 * BS + 3))
    reader, _ = shared(nodes, spawn_agent, prompt)
    a, b, master = nodes
    master.kill()
    assert reader.ok("allocate", seq="req-b", tokens=prompt)["cached"] == 0
    tier = b.stats()["tiers"]["default"]
    assert (tier["promotions"], tier["errors"]) == (0, 2)
    assert set(tier["store_errors"]) <= {"REMOTE_MISSING", "REMOTE_UNAVAILABLE"}
    reader.ok("free", seq="req-b")
    assert reader.ok("allocate", seq="again", tokens=prompt)["cached"] == 0
    # Node A's copies of a new prompt fail too, and it serves on.
    writer = spawn_agent()
    writer.ok("connect", address=a.address)
    compute(writer, "req-c", list(range(900, 900 + 2 * BS + 1)))
    assert wait_for(a, lambda t: t["errors"] >= 2)["errors"] >= 2
    assert a.check()["ok"] is True and b.check()["ok"] is True
