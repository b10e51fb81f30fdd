"""A ``paged`` pool (an engine's opaque pages) with a real daemon: who attaches, who is refused."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from kvd_client import Client
from kvd_client.errors import InvalidRequest, LayoutMismatch
from kvd_client.pool import ShmPages
from kvd_client.wire import PoolLayout

KvdProcess = Any

FMT = "vllm/0.32.0/cpu/LBHNC/float32"
PAGED = PoolLayout(
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    dtype="float32",
    block_size=32,
    num_blocks=16,
    order="paged",
    format=FMT,
)


def test_the_same_engine_attaches_and_shares_pages_through_holds(kvd_daemon: KvdProcess) -> None:
    tokens = np.arange(64, dtype=np.int32)
    with Client.connect(kvd_daemon.address, pool="vllm-a", layout=PAGED, create=True) as a:
        keys = a.block_keys(tokens)
        grant = a.grant(2)
        pool = a.pool
        assert isinstance(pool, ShmPages)
        for layer in range(2):
            pool.pages(layer)[grant.blocks.tolist()] = float(layer + 1)
        assert a.publish(grant.hold, grant.blocks, keys, tokens) == 2
        assert a.release(grant.hold) == 2
        with Client.connect(kvd_daemon.address, pool="vllm-a", layout=PAGED) as b:
            hit = b.lookup(b.block_keys(tokens), hold=True)
            assert hit.cached == 2
            assert (b.pool.pages(1)[hit.blocks.tolist()] == 2.0).all()
            assert b.release(hit.hold) == 2


def test_another_engine_format_is_a_mismatch(kvd_daemon: KvdProcess) -> None:
    other = dataclasses.replace(PAGED, format="vllm/0.32.0/cpu/LBHNC/bfloat16")
    with (
        Client.connect(kvd_daemon.address, pool="vllm-b", layout=PAGED, create=True),
        pytest.raises(LayoutMismatch, match="format"),
    ):
        Client.connect(kvd_daemon.address, pool="vllm-b", layout=other, create=True)


def test_a_client_expecting_kvd_layout_is_refused_the_pages(kvd_daemon: KvdProcess) -> None:
    kvd_own = dataclasses.replace(PAGED, order="layer_major", format="")
    with Client.connect(kvd_daemon.address, pool="vllm-c", layout=PAGED, create=True):
        with pytest.raises(LayoutMismatch, match="layout differs"):
            Client.connect(kvd_daemon.address, pool="vllm-c", layout=kvd_own)
        # Without a layout it attaches, but is never handed the pages as kvd's KV.
        with Client.connect(kvd_daemon.address, pool="vllm-c") as blind:
            assert blind.layout == PAGED
            with pytest.raises(LayoutMismatch, match="opaque to kvd"):
                blind.pool.layer(0)


def test_a_paged_pool_on_a_gpu_is_refused(kvd_daemon: KvdProcess) -> None:
    with pytest.raises(InvalidRequest, match="paged pool must be shm"):
        Client.connect(kvd_daemon.address, pool="vllm-d", layout=PAGED, create=True, backend="cuda")
