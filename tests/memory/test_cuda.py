"""The cuda backend, as far as a machine without a GPU allows.

Argument checks, the 2 MiB rounding, the refusal line and the memory map a
pool exports (through msgpack, into the client's parser) run here; the
allocation itself runs in tests/gpu.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import msgpack
import pytest
from kvd_client.wire import POOL_ALIGN, CudaMemoryMap, PoolLayout

from kvd.errors import PoolTooLargeError, StartupError
from kvd.memory import cuda
from kvd.memory.base import PoolMemory
from kvd.memory.budget import decide
from kvd.memory.gpuinfo import DeviceMemory

GiB = 1 << 30
MiB = 1 << 20
UUID = "GPU-8f2c1a0e-5b7d-4c3a-9e1f-00112233aabb"
HANDLE = bytes(range(64))
LAYOUT = PoolLayout(
    num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16, num_blocks=300
)

no_cupy = pytest.mark.skipif(
    importlib.util.find_spec("cupy") is not None, reason="cupy is installed here"
)


@pytest.mark.parametrize(
    ("nbytes", "size"),
    [(1, 2 * MiB), (2 * MiB, 2 * MiB), (2 * MiB + 1, 4 * MiB), (100 * GiB, 100 * GiB)],
)
def test_allocation_size_rounds_up_to_2_mib(nbytes: int, size: int) -> None:
    assert cuda.allocation_size(nbytes) == size
    assert 2 * MiB == cuda.CUDA_ALIGN


@pytest.mark.parametrize("nbytes", [0, -1, 1.0, True, "4096"])
def test_allocation_size_rejects_non_positive_ints(nbytes: Any) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        cuda.allocation_size(nbytes)


@pytest.mark.parametrize("headroom", [-1, 1.5, None, False])
def test_check_headroom_rejects_bad_values(headroom: Any) -> None:
    with pytest.raises(ValueError, match="headroom_bytes"):
        cuda.check_headroom(headroom)


def test_check_headroom_takes_zero() -> None:
    assert cuda.check_headroom(0) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": -1}, "device"),
        ({"device": "0"}, "device"),
        ({"device": True}, "device"),
        ({"headroom_bytes": -1}, "headroom_bytes"),
    ],
)
def test_create_checks_arguments_before_touching_a_device(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        cuda.CudaAllocation.create("p", LAYOUT, **kwargs)


def test_create_refuses_something_that_is_not_a_layout() -> None:
    with pytest.raises(ValueError, match="PoolLayout"):
        cuda.CudaAllocation.create("p", LAYOUT.to_dict())  # type: ignore[arg-type]


@no_cupy
def test_create_without_cupy_says_how_to_install_it() -> None:
    with pytest.raises(StartupError, match=r"cupy is not installed: pip install 'kvd\[cuda\]'"):
        cuda.create("p", LAYOUT, device=0, headroom_bytes=GiB)


@no_cupy
def test_capacity_without_cupy_says_how_to_install_it() -> None:
    with pytest.raises(StartupError, match=r"pip install 'kvd\[cuda\]'"):
        cuda.capacity(device=0)


def test_registry_options_match_the_entry_points() -> None:
    def keyword_only(fn: Any) -> set[str]:
        params = inspect.signature(fn).parameters.values()
        return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}

    assert keyword_only(cuda.CudaAllocation.create) == cuda.CREATE_OPTS
    assert keyword_only(cuda.capacity) == cuda.CAPACITY_OPTS


def test_remove_stale_has_nothing_to_remove_and_needs_no_gpu() -> None:
    assert cuda.remove_stale(instance="abc", device=0) == []


def test_the_registry_entry_works_without_cupy() -> None:
    from kvd import memory

    entry = memory.BACKENDS.get("cuda")
    if entry is None:
        pytest.skip("kvd.memory does not register the cuda backend yet")
    assert entry.create_opts == cuda.CREATE_OPTS
    assert entry.capacity_opts == cuda.CAPACITY_OPTS
    assert memory.remove_stale_segments("abc", shm_dir="/nonexistent-kvd-test") == []


def device(free: int) -> DeviceMemory:
    return DeviceMemory(index=0, uuid=UUID, free=free, total=141 * GiB, source="nvml")


def test_refusal_is_one_line_with_asked_free_and_headroom() -> None:
    decision = decide("big", "cuda:0", 200 * GiB, 139 * GiB, headroom=2 * GiB)
    err = cuda.refusal(decision, device(139 * GiB))
    assert isinstance(err, PoolTooLargeError)
    assert isinstance(err, StartupError)
    assert err.asked == 200 * GiB
    assert err.available == 137 * GiB
    line = str(err)
    assert "\n" not in line
    assert line.startswith("pool 'big' needs 200.0 GiB")
    assert f"cuda:0 {UUID} (nvml: free 139.0 GiB, headroom 2.0 GiB)" in line


def test_refusal_reports_nothing_available_when_headroom_exceeds_free() -> None:
    decision = decide("p", "cuda:0", GiB, GiB, headroom=4 * GiB)
    assert cuda.refusal(decision, device(GiB)).available == 0


def made_pool() -> cuda.CudaAllocation:
    """A pool object as `create` builds it, around a device address never dereferenced here."""
    return cuda.CudaAllocation(
        "p",
        LAYOUT,
        mem=device(100 * GiB),
        ptr=0x7F0000000000,
        size=LAYOUT.total_bytes,
        handle=HANDLE,
    )


def test_pool_exports_a_map_the_client_parses_after_msgpack() -> None:
    pool = made_pool()
    wire = msgpack.packb(pool.handle(), use_bin_type=True)
    parsed = CudaMemoryMap.from_dict(msgpack.unpackb(wire, raw=False))
    assert parsed == CudaMemoryMap(
        device=0, uuid=UUID, handle=HANDLE, offset=0, size=3 * POOL_ALIGN
    )
    assert pool.handle()["backend"] == "cuda"


def test_pool_meets_the_backend_interface() -> None:
    pool = made_pool()
    assert isinstance(pool, PoolMemory)
    assert pool.size == LAYOUT.total_bytes
    assert pool.layout == LAYOUT
    info = pool.info()
    assert info["uuid"] == UUID
    assert info["free_before"] == 100 * GiB
    assert info["free_source"] == "nvml"
    assert "handle" not in info
