"""The ``cuda`` backend: each pool its own device allocation, shared by CUDA IPC handle.

A pool is one ``cudaMalloc`` of its layout's size rounded up to 2 MiB
(`CUDA_ALIGN`), made with cupy's raw runtime call, never carved from cupy's
or torch's caching allocator: an IPC handle exports the whole allocation it
points into, and a carved one would expose its neighbours to every client.
The allocation is zeroed (no earlier tenant's bytes reach a client) and
exported with ``cudaIpcGetMemHandle``; the hello reply carries that handle
with the device's UUID (`kvd_client.wire.CudaMemoryMap`), and clients map
it with ``cudaIpcOpenMemHandle``. The daemon, the exporting process, keeps
the allocation until the pool is closed.

Before allocating, the device's free memory is read (`gpuinfo`) and the
pool is refused (`PoolTooLargeError`, one line: asked, free, headroom)
when it would leave less than the headroom; a ``cudaMalloc`` that still
fails (another process was faster) is refused the same way, nothing held.
"""

from __future__ import annotations

import time
from typing import Any, Final

from kvd_client.wire import POOL_ALIGN, CudaMemoryMap, PoolLayout, round_up

from kvd.errors import PoolTooLargeError, StartupError
from kvd.memory.base import Capacity
from kvd.memory.budget import BudgetDecision, decide, format_bytes
from kvd.memory.gpuinfo import DeviceMemory, check_device, cupy_module, device_memory

__all__ = [
    "CAPACITY_OPTS",
    "CREATE_OPTS",
    "CUDA_ALIGN",
    "CudaAllocation",
    "allocation_size",
    "capacity",
    "check_headroom",
    "create",
    "refusal",
    "remove_stale",
]

#: Pools are whole multiples of 2 MiB, CUDA's allocation granularity for large buffers.
CUDA_ALIGN: Final = POOL_ALIGN
#: Options `create` takes (the registry drops the others).
CREATE_OPTS: Final = frozenset({"device", "headroom_bytes"})
#: Options `capacity` takes.
CAPACITY_OPTS: Final = frozenset({"device", "headroom_bytes"})

#: ``cudaErrorMemoryAllocation``: cudaMalloc found too little free memory.
_CUDA_ERROR_MEMORY_ALLOCATION: Final = 2


def allocation_size(nbytes: int) -> int:
    """``nbytes`` rounded up to `CUDA_ALIGN`; ValueError unless a positive int."""
    if type(nbytes) is not int or nbytes <= 0:
        raise ValueError(f"a pool's size must be a positive integer, got {nbytes!r}")
    return round_up(nbytes, CUDA_ALIGN)


def check_headroom(headroom_bytes: object) -> int:
    """``headroom_bytes`` as bytes; ValueError unless a non-negative int."""
    if type(headroom_bytes) is not int or headroom_bytes < 0:
        raise ValueError(f"headroom_bytes must be an integer >= 0, got {headroom_bytes!r}")
    return headroom_bytes


def refusal(decision: BudgetDecision, mem: DeviceMemory) -> PoolTooLargeError:
    """The startup error of a pool that does not fit ``mem``: one line, every number."""
    return PoolTooLargeError(
        f"pool {decision.pool!r}",
        decision.asked,
        max(0, decision.free - decision.headroom),
        f"{mem.place} {mem.uuid} ({mem.source}: free {format_bytes(decision.free)}, "
        f"headroom {format_bytes(decision.headroom)})",
    )


def capacity(*, device: int = 0, headroom_bytes: int = 0) -> Capacity:
    """Bytes a new pool could take on ``device`` now: free less ``headroom_bytes``.

    ``where`` names the device alone (``cuda:0 GPU-… (nvml)``), the same on
    every call, so a budget can key its places by it; a daemon that applies
    its headroom in `kvd.memory.budget` leaves ``headroom_bytes`` at 0 here.
    """
    check_device(device)
    check_headroom(headroom_bytes)
    mem = device_memory(device)
    return Capacity(max(0, mem.free - headroom_bytes), f"{mem.place} {mem.uuid} ({mem.source})")


def remove_stale(*, instance: str, **_opts: Any) -> list[str]:
    """A dead daemon's cuda pools need no cleanup: the driver freed them when it exited.

    Touches no GPU (every daemon calls this at start, shm-only ones too).
    """
    return []


class CudaAllocation:
    """A pool's bytes in one device allocation of its own, exported by IPC handle.

    Create with `CudaAllocation.create` (blocking: run it in a worker thread).
    """

    def __init__(
        self,
        name: str,
        layout: PoolLayout,
        *,
        mem: DeviceMemory,
        ptr: int,
        size: int,
        handle: bytes,
    ) -> None:
        self._name = name
        self._layout = layout
        self._mem = mem
        self._ptr: int | None = ptr
        self._size = size
        self._map = CudaMemoryMap(
            device=mem.index, uuid=mem.uuid, handle=handle, offset=0, size=size
        )
        self.alloc_s = 0.0
        self.headroom_bytes = 0

    @classmethod
    def create(
        cls, name: str, layout: PoolLayout, *, device: int = 0, headroom_bytes: int = 0
    ) -> CudaAllocation:
        """Allocate, zero and export the pool on ``device``.

        Raises ValueError on bad arguments, StartupError when cupy or the
        device is missing, PoolTooLargeError when the pool would leave less
        than ``headroom_bytes`` free (checked before allocating, and again
        if ``cudaMalloc`` fails), all with nothing allocated.
        """
        if not isinstance(layout, PoolLayout):
            raise ValueError(f"layout must be a PoolLayout, got {type(layout).__name__}")
        check_device(device)
        check_headroom(headroom_bytes)
        size = allocation_size(layout.total_bytes)
        mem = device_memory(device)
        decision = decide(name, mem.place, size, mem.free, headroom=headroom_bytes)
        if not decision.ok:
            raise refusal(decision, mem)
        cupy = cupy_module()
        runtime = cupy.cuda.runtime
        t0 = time.perf_counter()
        with cupy.cuda.Device(device):
            try:
                ptr = int(runtime.malloc(size))
            except runtime.CUDARuntimeError as exc:
                if exc.status == _CUDA_ERROR_MEMORY_ALLOCATION:
                    now = device_memory(device)
                    raise refusal(
                        decide(name, now.place, size, now.free, headroom=headroom_bytes), now
                    ) from None
                raise StartupError(f"pool {name!r}: cudaMalloc on {mem.place}: {exc}") from None
            try:
                runtime.memset(ptr, 0, size)
                handle = bytes(runtime.ipcGetMemHandle(ptr))
                runtime.deviceSynchronize()
            except runtime.CUDARuntimeError as exc:
                runtime.free(ptr)
                raise StartupError(f"pool {name!r}: exporting on {mem.place}: {exc}") from None
        pool = cls(name, layout, mem=mem, ptr=ptr, size=size, handle=handle)
        pool.alloc_s = time.perf_counter() - t0
        pool.headroom_bytes = headroom_bytes
        return pool

    @property
    def layout(self) -> PoolLayout:
        """The layout the allocation was sized for."""
        return self._layout

    @property
    def size(self) -> int:
        """Bytes allocated (``layout.total_bytes``, a multiple of `CUDA_ALIGN`)."""
        return self._size

    @property
    def device(self) -> int:
        """The daemon's CUDA ordinal of the pool's GPU."""
        return self._mem.index

    @property
    def ptr(self) -> int:
        """The allocation's device address in the daemon (ValueError once closed)."""
        if self._ptr is None:
            raise ValueError(f"pool {self._name!r} memory is closed")
        return self._ptr

    @property
    def memory_map(self) -> CudaMemoryMap:
        """How a client maps the pool, typed."""
        return self._map

    def handle(self) -> dict[str, Any]:
        """``{"backend": "cuda", "device", "uuid", "handle", "offset": 0, "size"}``."""
        return self._map.to_dict()

    def info(self) -> dict[str, Any]:
        """Device, size, the free memory it was admitted against, and timings."""
        return {
            "backend": "cuda",
            "device": self._mem.index,
            "uuid": self._mem.uuid,
            "size": self._size,
            "offset": 0,
            "free_before": self._mem.free,
            "total": self._mem.total,
            "free_source": self._mem.source,
            "headroom_bytes": self.headroom_bytes,
            "alloc_ms": round(self.alloc_s * 1e3, 3),
        }

    def close(self) -> None:
        """Free the allocation (idempotent); clients must have dropped their mappings."""
        if self._ptr is None:
            return
        ptr, self._ptr = self._ptr, None
        cupy = cupy_module()
        with cupy.cuda.Device(self._mem.index):
            cupy.cuda.runtime.free(ptr)


def create(name: str, layout: PoolLayout, **opts: Any) -> CudaAllocation:
    """The registry's entry point: `CudaAllocation.create` with ``device``/``headroom_bytes``."""
    return CudaAllocation.create(name, layout, **opts)
