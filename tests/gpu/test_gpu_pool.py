"""cuda pools on a real GPU: allocation, export, client mapping, refusal.

The test process plays the daemon (`kvd.memory.cuda.CudaAllocation`); the
``clients`` fixture's two spawned processes map the pool through the
client library, from the memory map as it crosses the wire (msgpack).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from gpu_workers import RemoteError, Worker, device_bytes, start_workers
from kvd_client.wire import POOL_ALIGN, PoolLayout

from kvd.errors import PoolTooLargeError
from kvd.memory import cuda
from kvd.memory.gpuinfo import device_count, device_memory, device_uuid

pytestmark = pytest.mark.cuda

GiB = 1 << 30
MiB = 1 << 20
#: Allocations of other processes may come and go while a test runs; free-memory
#: comparisons allow this much slack.
SLACK = 256 * MiB
LAYOUT = PoolLayout(
    num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32", block_size=16, num_blocks=512
)


def wire(pool: cuda.CudaAllocation) -> bytes:
    """The pool's memory map as the hello reply carries it."""
    packed: bytes = msgpack.packb(pool.handle(), use_bin_type=True)
    return packed


def slot_values(pool: cuda.CudaAllocation, layer: int, kv: int, block: int) -> Any:
    """The daemon's own reading of one slot, as float32 values (cupy)."""
    import cupy

    start = LAYOUT.offset(layer, kv, block)
    raw = device_bytes(pool.ptr, pool.size, pool.device)
    return raw[start : start + LAYOUT.slot_bytes].view(cupy.float32)


def daemon_fill(pool: cuda.CudaAllocation, layer: int, kv: int, block: int, value: float) -> None:
    """Write one slot as the daemon, and wait for it: clients read from other contexts."""
    import cupy

    slot_values(pool, layer, kv, block).fill(value)
    cupy.cuda.runtime.deviceSynchronize()


@pytest.fixture(scope="module")
def pool() -> Iterator[cuda.CudaAllocation]:
    p = cuda.CudaAllocation.create("gpu-test", LAYOUT, device=0, headroom_bytes=GiB)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def mapped(
    pool: cuda.CudaAllocation, clients: tuple[Worker, Worker]
) -> Iterator[tuple[Worker, Worker]]:
    """Both clients with the module's pool open."""
    for c in clients:
        c.call("open", "gpu-test", wire(pool), LAYOUT.to_dict())
    yield clients
    for c in clients:
        c.call("drop", "gpu-test")


def test_pool_is_its_own_2mib_allocation(pool: cuda.CudaAllocation) -> None:
    assert pool.size == LAYOUT.total_bytes
    assert pool.size % POOL_ALIGN == 0
    handle = pool.handle()
    assert len(handle["handle"]) == 64
    assert handle["uuid"] == device_uuid(0)
    assert pool.info()["free_source"] in ("nvml", "cuda")


def test_pool_starts_zeroed(pool: cuda.CudaAllocation) -> None:
    raw = device_bytes(pool.ptr, pool.size, pool.device)
    assert int(raw.any()) == 0


def test_client_reads_what_the_daemon_wrote(
    pool: cuda.CudaAllocation, mapped: tuple[Worker, Worker]
) -> None:
    daemon_fill(pool, 2, 1, 300, 7.5)
    assert mapped[0].call("slot", "gpu-test", 2, 1, 300) == [7.5, 7.5]
    assert mapped[1].call("slot", "gpu-test", 2, 1, 300) == [7.5, 7.5]


def test_daemon_sees_what_a_client_wrote_at_the_layout_offset(
    pool: cuda.CudaAllocation, mapped: tuple[Worker, Worker]
) -> None:
    mapped[0].call("fill", "gpu-test", 3, 0, 511, -2.0)
    assert float(slot_values(pool, 3, 0, 511).min()) == -2.0
    assert float(slot_values(pool, 3, 0, 511).max()) == -2.0
    assert float(slot_values(pool, 3, 1, 511).max()) == 0.0


def test_two_clients_share_the_same_blocks(mapped: tuple[Worker, Worker]) -> None:
    a, b = mapped
    a.call("fill_block", "gpu-test", 42, 3.25)
    for layer in range(LAYOUT.num_layers):
        for kv in (0, 1):
            assert b.call("slot", "gpu-test", layer, kv, 42) == [3.25, 3.25]
    b.call("fill", "gpu-test", 1, 1, 42, 9.0)
    assert a.call("slot", "gpu-test", 1, 1, 42) == [9.0, 9.0]
    assert a.call("slot", "gpu-test", 1, 0, 42) == [3.25, 3.25]


def test_copy_on_write_lands_for_the_other_client(mapped: tuple[Worker, Worker]) -> None:
    a, b = mapped
    a.call("fill_block", "gpu-test", 10, 1.0)
    a.call("fill_block", "gpu-test", 11, 2.0)
    a.call("copy", "gpu-test", [[10, 100], [11, 101]])
    assert b.call("slot", "gpu-test", 3, 1, 100) == [1.0, 1.0]
    assert b.call("slot", "gpu-test", 0, 0, 101) == [2.0, 2.0]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_write_blocks_lands_for_the_other_client(
    mapped: tuple[Worker, Worker], device: str
) -> None:
    a, b = mapped
    ids = [200, 201, 202, 150]  # a run of three, then one more
    a.call("write_blocks", "gpu-test", ids, [1.5, 2.5, 3.5, 4.5], device)
    assert b.call("slot", "gpu-test", 0, 0, 200) == [1.5, 1.5]
    assert b.call("slot", "gpu-test", 3, 1, 202) == [3.5, 3.5]
    assert b.call("slot", "gpu-test", 2, 1, 150) == [4.5, 4.5]
    assert b.call("read_blocks", "gpu-test", [150, 201], device) == [[4.5, 4.5], [2.5, 2.5]]


@pytest.mark.parametrize(("device", "blocks"), [("cpu", [420, 421]), ("cuda", [430, 433])])
def test_write_layer_writes_only_that_layer(
    mapped: tuple[Worker, Worker], device: str, blocks: list[int]
) -> None:
    a, b = mapped
    a.call("write_layer", "gpu-test", 2, blocks, 6.5, device)
    for block in blocks:
        assert b.call("slot", "gpu-test", 2, 1, block) == [6.5, 6.5]
        assert b.call("slot", "gpu-test", 1, 1, block) == [0.0, 0.0]


def test_a_process_opens_a_handle_once(
    pool: cuda.CudaAllocation, mapped: tuple[Worker, Worker]
) -> None:
    assert mapped[0].call("reopen", "gpu-test", wire(pool), LAYOUT.to_dict())


def test_a_handle_for_a_gpu_the_client_cannot_see_is_refused(
    pool: cuda.CudaAllocation, clients: tuple[Worker, Worker]
) -> None:
    handle = dict(pool.handle(), uuid="GPU-00000000-0000-0000-0000-000000000000")
    raw = msgpack.packb(handle, use_bin_type=True)
    with pytest.raises(RemoteError, match="is not visible in this process"):
        clients[0].call("open", "ghost", raw, LAYOUT.to_dict())


def layout_of(nbytes: int) -> PoolLayout:
    """A Llama-3-8B-like layout (2 MiB per block over all layers) of about ``nbytes``."""
    return PoolLayout(
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        block_size=16,
        num_blocks=max(1, nbytes // (2 * MiB)),
    )


def test_pool_larger_than_free_memory_is_refused_and_nobody_fails(
    pool: cuda.CudaAllocation, mapped: tuple[Worker, Worker]
) -> None:
    before = device_memory(0)
    with pytest.raises(PoolTooLargeError) as info:
        cuda.CudaAllocation.create(
            "too-big", layout_of(before.free + GiB), device=0, headroom_bytes=GiB
        )
    line = str(info.value)
    assert "\n" not in line
    assert "free" in line
    assert "headroom 1.0 GiB" in line
    assert device_memory(0).free >= before.free - SLACK
    # The clients and the pool already there carry on.
    assert all(c.alive() for c in mapped)
    mapped[1].call("fill", "gpu-test", 0, 0, 7, 4.0)
    assert mapped[0].call("slot", "gpu-test", 0, 0, 7) == [4.0, 4.0]


def test_headroom_refuses_a_pool_that_would_fit_the_free_memory() -> None:
    free = device_memory(0).free
    with pytest.raises(PoolTooLargeError, match="headroom"):
        cuda.CudaAllocation.create("tight", layout_of(free // 2), device=0, headroom_bytes=free)


def test_capacity_is_free_memory_less_headroom() -> None:
    cap = cuda.capacity(device=0, headroom_bytes=2 * GiB)
    free = device_memory(0).free
    assert abs(cap.bytes - (free - 2 * GiB)) <= SLACK
    assert device_uuid(0) in cap.where


def test_pool_memory_is_returned_on_close() -> None:
    before = device_memory(0).free
    p = cuda.CudaAllocation.create("returned", layout_of(GiB), device=0)
    assert device_memory(0).free <= before - GiB + SLACK
    p.close()
    p.close()
    assert device_memory(0).free >= before - SLACK


def big_pool_bytes() -> int:
    return int(float(os.environ.get("KVD_GPU_BIG_POOL_GIB", "100")) * GiB)


def test_big_pool_is_mapped_by_two_clients(clients: tuple[Worker, Worker]) -> None:
    nbytes = big_pool_bytes()
    free = device_memory(0).free
    if free < nbytes + 4 * GiB:
        pytest.skip(f"{free / GiB:.1f} GiB free, the big pool needs {nbytes / GiB:.0f} + 4 GiB")
    layout = layout_of(nbytes)
    big = cuda.CudaAllocation.create("big", layout, device=0, headroom_bytes=2 * GiB)
    try:
        assert big.size >= nbytes
        a, b = clients
        for c in clients:
            c.call("open", "big", msgpack.packb(big.handle(), use_bin_type=True), layout.to_dict())
        last = layout.num_blocks - 1
        a.call("fill", "big", layout.num_layers - 1, 1, last, 1.5)
        a.call("fill", "big", 0, 0, 0, -1.5)
        assert b.call("slot", "big", layout.num_layers - 1, 1, last) == [1.5, 1.5]
        assert b.call("slot", "big", 0, 0, 0) == [-1.5, -1.5]
        b.call("fill_block", "big", last // 2, 0.5)
        assert a.call("slot", "big", 17, 1, last // 2) == [0.5, 0.5]
    finally:
        for c in clients:
            with contextlib.suppress(RemoteError):  # never opened there
                c.call("drop", "big")
        big.close()


def test_clients_find_the_gpu_by_uuid_when_devices_are_renumbered(
    pool: cuda.CudaAllocation,
) -> None:
    if device_count() < 2:
        pytest.skip("renumbering needs two GPUs")
    order = ",".join(str(i) for i in reversed(range(device_count())))
    (w,) = start_workers(1, env={"CUDA_VISIBLE_DEVICES": order})
    try:
        opened = w.call("open", "gpu-test", wire(pool), LAYOUT.to_dict())
        assert opened["device"] == device_count() - 1
        daemon_fill(pool, 0, 1, 5, 6.0)
        assert w.call("slot", "gpu-test", 0, 1, 5) == [6.0, 6.0]
    finally:
        w.stop()
