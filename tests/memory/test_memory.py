"""kvd.memory: the backend registry."""

from __future__ import annotations

import uuid

import pytest
from kvd_client.wire import PoolLayout

from kvd.errors import StartupError
from kvd.memory import (
    PoolMemory,
    backend_capacity,
    create_pool_memory,
    remove_stale_segments,
)
from kvd.memory.shm import segment_path

TINY = PoolLayout(1, 1, 16, "float16", 16, 4)


def test_shm_backend_creates_a_pool_memory() -> None:
    instance = f"test{uuid.uuid4().hex[:10]}"
    memory = create_pool_memory(
        "shm", "p", TINY, instance=instance, shm_dir="/dev/shm", prefault=False, device=0
    )
    try:
        assert isinstance(memory, PoolMemory)
        assert memory.handle()["backend"] == "shm"
        assert memory.size == TINY.total_bytes
    finally:
        memory.close()


def test_unknown_backend_is_a_startup_error() -> None:
    with pytest.raises(StartupError, match="memory backend 'nvme' is not available"):
        create_pool_memory("nvme", "p", TINY, instance="x")
    with pytest.raises(StartupError, match="not available"):
        backend_capacity("nvme")


def test_capacity_names_its_limit() -> None:
    cap = backend_capacity("shm", shm_dir="/dev/shm")
    assert cap.bytes > 0
    assert cap.where


def test_remove_stale_segments_covers_every_backend() -> None:
    instance = f"test{uuid.uuid4().hex[:10]}"
    path = segment_path("/dev/shm", instance, "p")
    path.write_bytes(b"")
    assert remove_stale_segments(instance, shm_dir="/dev/shm") == [str(path)]
    assert not path.exists()
