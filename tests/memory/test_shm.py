"""kvd.memory.shm: reserved, prefaulted pool files that refuse to overcommit."""

from __future__ import annotations

import mmap
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvd_client.wire import PoolLayout

from kvd.errors import PoolTooLargeError, StartupError
from kvd.memory import shm
from kvd.memory.shm import ShmSegment, capacity, remove_stale, segment_path

TINY = PoolLayout(
    num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=16, num_blocks=8
)
SHM_DIR = "/dev/shm"


@pytest.fixture
def instance() -> Iterator[str]:
    """A unique instance id; removes whatever the test left behind."""
    name = f"test{uuid.uuid4().hex[:10]}"
    yield name
    remove_stale(SHM_DIR, name)


def test_creates_file_of_layout_size_with_mode_0660(instance: str) -> None:
    pool = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
    try:
        st = os.stat(pool.path)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_size == TINY.total_bytes
        assert pool.path == segment_path(SHM_DIR, instance, "p")
    finally:
        pool.close()


def test_file_is_fully_reserved(instance: str) -> None:
    pool = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR, prefault=False)
    try:
        # fallocate reserves every block of the file: nothing is sparse.
        assert os.stat(pool.path).st_blocks * 512 >= TINY.total_bytes
    finally:
        pool.close()


def test_mode_survives_a_restrictive_umask(instance: str) -> None:
    old = os.umask(0o077)
    try:
        pool = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(pool.path).st_mode) == 0o660
    finally:
        pool.close()


def test_handle_describes_the_mapping(instance: str) -> None:
    pool = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
    try:
        assert pool.handle() == {
            "backend": "shm",
            "path": str(pool.path),
            "size": TINY.total_bytes,
            "offset": 0,
            "token": pool.token,
        }
        info = pool.info()
        assert info["prefault_method"] in ("populate_write", "touch")
        assert info["prefault_ms"] >= 0
    finally:
        pool.close()


def test_each_segment_has_its_own_token(instance: str) -> None:
    a = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
    a.close()
    b = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
    try:
        assert a.handle()["path"] == b.handle()["path"]
        assert a.handle() != b.handle()
    finally:
        b.close()


def test_bytes_written_by_daemon_are_seen_by_another_mapping(instance: str) -> None:
    pool = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
    try:
        view = np.frombuffer(pool.buffer(), dtype=np.uint8)
        off = TINY.offset(1, 1, 3)
        view[off : off + 4] = [1, 2, 3, 4]
        del view
        fd = os.open(pool.path, os.O_RDONLY)
        try:
            with mmap.mmap(fd, TINY.total_bytes, prot=mmap.PROT_READ) as mm:
                assert mm[off : off + 4] == bytes([1, 2, 3, 4])
        finally:
            os.close(fd)
    finally:
        pool.close()


def test_refuses_a_pool_larger_than_memory(instance: str) -> None:
    cap = capacity(SHM_DIR)
    blocks = cap.bytes // TINY.kv_bytes_per_block + 1024
    huge = PoolLayout(2, 2, 16, "float16", 16, blocks)
    with pytest.raises(PoolTooLargeError) as info:
        ShmSegment.create("huge", huge, instance=instance, shm_dir=SHM_DIR)
    message = str(info.value)
    assert "pool 'huge' needs" in message
    assert str(huge.total_bytes) in message
    assert "\n" not in message
    assert info.value.asked == huge.total_bytes
    assert not segment_path(SHM_DIR, instance, "huge").exists()


def test_refuses_to_reuse_an_existing_segment(instance: str) -> None:
    pool = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
    try:
        with pytest.raises(StartupError, match="exists"):
            ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
        assert pool.path.exists()
    finally:
        pool.close()


def test_close_unlinks_but_client_mapping_stays_valid(instance: str) -> None:
    pool = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
    fd = os.open(pool.path, os.O_RDWR)
    mm = mmap.mmap(fd, TINY.total_bytes)
    os.close(fd)
    pool.close()
    pool.close()  # idempotent
    assert not pool.path.exists()
    mm[0:3] = b"abc"
    assert mm[0:3] == b"abc"
    mm.close()


def test_remove_stale_removes_only_that_instance(instance: str) -> None:
    other = f"{instance}x"
    mine = [segment_path(SHM_DIR, instance, n) for n in ("a", "b")]
    theirs = segment_path(SHM_DIR, other, "a")
    try:
        for p in [*mine, theirs]:
            p.write_bytes(b"")
        removed = remove_stale(SHM_DIR, instance)
        assert sorted(removed) == sorted(str(p) for p in mine)
        assert not any(p.exists() for p in mine)
        assert theirs.exists()
    finally:
        theirs.unlink(missing_ok=True)


def test_capacity_is_bounded_by_tmpfs_free_space() -> None:
    st = os.statvfs(SHM_DIR)
    cap = capacity(SHM_DIR)
    assert 0 < cap.bytes <= st.f_bavail * st.f_frsize
    assert cap.where


def test_unwritable_directory_is_a_startup_error(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(StartupError, match="cannot create"):
        ShmSegment.create("p", TINY, instance="x", shm_dir=str(missing))


def test_prefault_falls_back_to_touching_pages(
    instance: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kernel without MADV_POPULATE_WRITE rejects the advice with EINVAL.
    monkeypatch.setattr(shm, "_MADV_POPULATE_WRITE", -1)
    pool = ShmSegment.create("p", TINY, instance=instance, shm_dir=SHM_DIR)
    try:
        assert pool.prefault_method == "touch"
    finally:
        pool.close()
