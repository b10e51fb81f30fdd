"""Runtime pools: a client's hello with ``create`` makes a pool for its layout (real daemon)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvd_client import Client
from kvd_client.errors import Forbidden, LayoutMismatch, QuotaExceeded
from kvd_client.wire import PoolLayout

from kvd.memory.shm import segment_path

ROOT = Path(__file__).resolve().parents[2]
#: The fixtures' types (tests/conftest.py): a daemon process and its starter.
KvdProcess = Any
StartKvd = Any

#: 32 blocks of 16 tokens, 2 layers x 2 heads x 16 dims of float16 (2 MiB once aligned).
LAYOUT = PoolLayout(
    num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=16, num_blocks=32
)


def _pools(daemon: KvdProcess) -> dict[str, dict[str, object]]:
    with Client.connect(daemon.address, pool=None) as kv:
        pools: dict[str, dict[str, object]] = kv.pools()["pools"]
        return pools


def test_a_client_creates_a_pool_and_a_second_one_attaches(kvd_daemon: KvdProcess) -> None:
    tokens = np.arange(40, dtype=np.int32)
    with Client.connect(kvd_daemon.address, pool="rt-a", layout=LAYOUT, create=True) as first:
        assert first.layout == LAYOUT
        seq = first.allocate("a", tokens)
        first.pool.np_layer(0)[0, seq.block_table[0]] = 7
        seq.commit()
        seq.free()
        with Client.connect(kvd_daemon.address, pool="rt-a", layout=LAYOUT) as second:
            again = second.allocate("b", tokens)
            assert again.num_cached_tokens == 32
            assert (second.pool.np_layer(0)[0, again.block_table[0]] == 7).all()
            again.free()
    assert segment_path("/dev/shm", kvd_daemon.instance, "rt-a").exists()
    assert _pools(kvd_daemon)["rt-a"]["runtime"] is True


def test_an_existing_pool_of_another_layout_is_a_mismatch(kvd_daemon: KvdProcess) -> None:
    other = PoolLayout(**(LAYOUT.to_dict() | {"num_blocks": 48}))  # default has 64
    with pytest.raises(LayoutMismatch, match="layout differs"):
        Client.connect(kvd_daemon.address, pool="default", layout=other, create=True)
    assert set(_pools(kvd_daemon)) == {"default"}


def test_a_pool_over_the_size_cap_is_refused_and_nothing_changes(start_kvd: StartKvd) -> None:
    daemon = start_kvd(overrides={"memory.runtime_pool_max_bytes": str(1 << 20)})
    with pytest.raises(QuotaExceeded, match=r"asked 2\.0 MiB, runtime pools are capped at 1\.0"):
        Client.connect(daemon.address, pool="rt-big", layout=LAYOUT, create=True)
    assert set(_pools(daemon)) == {"default"}
    assert not segment_path("/dev/shm", daemon.instance, "rt-big").exists()


def test_a_pool_over_the_node_budget_is_refused_with_its_numbers(start_kvd: StartKvd) -> None:
    # The tiny default pool holds 2 MiB; the budget leaves 1 MiB for runtime pools.
    daemon = start_kvd(overrides={"memory.budget_bytes": str(3 << 20)})
    with pytest.raises(QuotaExceeded, match=r"does not fit the node's cap: asked 2\.0 MiB, free"):
        Client.connect(daemon.address, pool="rt-b", layout=LAYOUT, create=True)
    assert set(_pools(daemon)) == {"default"}
    assert not segment_path("/dev/shm", daemon.instance, "rt-b").exists()


def test_the_count_cap_refuses_one_pool_more(start_kvd: StartKvd) -> None:
    daemon = start_kvd(overrides={"memory.max_runtime_pools": "1"})
    with Client.connect(daemon.address, pool="rt-1", layout=LAYOUT, create=True):
        pass
    with pytest.raises(QuotaExceeded, match="max_runtime_pools = 1"):
        Client.connect(daemon.address, pool="rt-2", layout=LAYOUT, create=True)
    assert set(_pools(daemon)) == {"default", "rt-1"}


def test_disabled_runtime_pools_are_forbidden(start_kvd: StartKvd) -> None:
    daemon = start_kvd(overrides={"memory.runtime_pools": "false"})
    with pytest.raises(Forbidden, match="runtime pools are disabled"):
        Client.connect(daemon.address, pool="rt-c", layout=LAYOUT, create=True)
    assert set(_pools(daemon)) == {"default"}


def test_kvd_ctl_lists_the_runtime_pool(kvd_daemon: KvdProcess) -> None:
    with Client.connect(kvd_daemon.address, pool="rt-d", layout=LAYOUT, create=True):
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from kvd_client.ctl import main; sys.exit(main())",
                "--address",
                kvd_daemon.address,
                "pools",
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
            timeout=60,
        )
    pools = json.loads(out.stdout)["pools"]
    assert pools["rt-d"]["runtime"] is True
    assert pools["rt-d"]["layout"] == LAYOUT.to_dict()
    assert pools["default"]["runtime"] is False


def test_shutdown_removes_the_runtime_pool_segment(kvd_daemon: KvdProcess) -> None:
    with Client.connect(kvd_daemon.address, pool="rt-e", layout=LAYOUT, create=True):
        pass
    segment = segment_path("/dev/shm", kvd_daemon.instance, "rt-e")
    assert segment.exists()
    assert kvd_daemon.stop() == 0
    assert not segment.exists()


def test_a_runtime_pool_of_another_layout_is_a_mismatch(kvd_daemon: KvdProcess) -> None:
    other = PoolLayout(**(LAYOUT.to_dict() | {"num_blocks": 48}))
    with (
        Client.connect(kvd_daemon.address, pool="rt-f", layout=LAYOUT, create=True),
        pytest.raises(LayoutMismatch, match="layout differs"),
    ):
        Client.connect(kvd_daemon.address, pool="rt-f", layout=other, create=True)
    assert _pools(kvd_daemon)["rt-f"]["layout"] == LAYOUT.to_dict()


def test_concurrent_creators_of_one_pool_share_it(kvd_daemon: KvdProcess) -> None:
    clients: list[Client] = []

    def connect() -> None:
        clients.append(Client.connect(kvd_daemon.address, pool="rt-g", layout=LAYOUT, create=True))

    threads = [threading.Thread(target=connect) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(clients) == 4
        assert len({c.pool.np_layer(0).ctypes.data for c in clients}) == 1  # one mapping
        assert _pools(kvd_daemon)["rt-g"]["sessions"] == 4
    finally:
        for c in clients:
            c.close()


def test_a_runtime_pool_gets_a_host_tier_of_the_configured_factor(start_kvd: StartKvd) -> None:
    daemon = start_kvd(overrides={"memory.runtime_pool_tier_factor": "4"})
    small = PoolLayout(**(LAYOUT.to_dict() | {"num_blocks": 8}))
    prompt = np.arange(3 * 16 + 1, dtype=np.int32)
    with Client.connect(daemon.address, pool="rt-tier", layout=small, create=True) as kv:
        seq = kv.allocate("a", prompt)
        for i, layer in enumerate(kv.pool.np_layers()):
            layer[:, seq.block_table] = i + 1
        seq.commit()
        seq.free()
        deadline = time.monotonic() + 30
        while daemon.stats()["tiers"]["rt-tier"]["demotions"] < 3:
            assert time.monotonic() < deadline, "the tier never got the committed blocks"
            time.sleep(0.01)
        kv.allocate("other", np.arange(5000, 5000 + 8 * 16, dtype=np.int32)).free()  # evicts all

        again = kv.allocate("b", prompt)
        assert again.num_cached_tokens == 3 * 16
        for i, layer in enumerate(kv.pool.np_layers()):
            assert (layer[:, again.block_table[:3]] == i + 1).all()
        again.free()
    tier = daemon.stats()["tiers"]["rt-tier"]
    assert (tier["capacity"], tier["promotions"], tier["errors"]) == (32, 3, 0)
    assert daemon.check()["ok"] is True


def test_a_runtime_pool_whose_tier_does_not_fit_is_refused(start_kvd: StartKvd) -> None:
    from kvd.memory.tier import tier_layout

    small = PoolLayout(**(LAYOUT.to_dict() | {"num_blocks": 8}))
    probe = start_kvd(overrides={"memory.runtime_pool_tier_factor": "4"})
    held = probe.stats()["pools"]["default"]["bytes"]
    probe.stop()
    # Room for the pool under the node's cap, not for its tier as well.
    budget = held + small.total_bytes + tier_layout(small, 32).total_bytes - 1
    daemon = start_kvd(
        overrides={"memory.runtime_pool_tier_factor": "4", "memory.budget_bytes": str(budget)}
    )
    with pytest.raises(QuotaExceeded, match="rt-tier tier 1"):
        Client.connect(daemon.address, pool="rt-tier", layout=small, create=True)
    assert set(_pools(daemon)) == {"default"}
