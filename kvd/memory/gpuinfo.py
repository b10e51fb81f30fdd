"""What a GPU has free, read before a pool is allocated on it.

NVML (``pynvml``, from ``nvidia-ml-py``) first, found by the device's UUID
so that ``CUDA_VISIBLE_DEVICES`` renumbering cannot make it read another
GPU; ``cudaMemGetInfo`` when NVML is missing or fails. Either way the
device's CUDA context is created first, so the reading already excludes
the context's own few hundred MiB.

cupy is imported on first use: without it every function here raises
`BackendUnavailableError` saying how to install it. The daemon loads cupy
itself: the client library's loader lives in `kvd_client.cuda`, which also
registers the client's cuda backend, and the daemon imports only the wire.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvd_client.wire.cudamap import canonical_uuid, format_uuid

from kvd.errors import BackendUnavailableError, NoSuchDeviceError

__all__ = [
    "DeviceMemory",
    "check_device",
    "cupy_module",
    "device_count",
    "device_memory",
    "device_uuid",
    "nvml_memory",
]

Source = Literal["nvml", "cuda"]


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One reading of a GPU's memory, in bytes, and where it came from."""

    index: int
    uuid: str
    free: int
    total: int
    source: Source

    @property
    def place(self) -> str:
        """The budget's name for the device: ``cuda:<index>``."""
        return f"cuda:{self.index}"


def check_device(device: object) -> int:
    """``device`` as a CUDA ordinal; ValueError unless a non-negative int."""
    if type(device) is not int or device < 0:
        raise ValueError(f"device must be a CUDA ordinal >= 0, got {device!r}")
    return device


def cupy_module() -> Any:
    """The ``cupy`` module; BackendUnavailableError with the install hint when it is missing."""
    try:
        import cupy  # noqa: PLC0415 (optional dependency, imported on use)
    except ImportError:
        raise BackendUnavailableError(
            "cupy is not installed: pip install 'kvd[cuda]' (cupy-cuda13x)"
        ) from None
    return cupy


def device_count() -> int:
    """GPUs visible to this process (0 when the driver finds none)."""
    runtime = cupy_module().cuda.runtime
    try:
        return int(runtime.getDeviceCount())
    except runtime.CUDARuntimeError:
        return 0


def _visible(device: int) -> Any:
    """cupy's runtime, after checking that ``device`` is visible."""
    count = device_count()
    if device >= count:
        raise NoSuchDeviceError(f"cuda:{device} is not visible: this process sees {count} GPU(s)")
    return cupy_module().cuda.runtime


def device_uuid(device: int) -> str:
    """The GPU's UUID in NVML's ``GPU-…`` form.

    cupy returns ``cudaDeviceProp.uuid`` as a C string, so a UUID holding a
    zero byte comes back cut short; NVML (by PCI bus id) or torch answer then.
    """
    runtime = _visible(check_device(device))
    raw = bytes(runtime.getDeviceProperties(device).get("uuid", b""))
    uuid = (
        (format_uuid(raw) if len(raw) == 16 else None)
        or _uuid_from_nvml(runtime, device)
        or _uuid_from_torch(device)
    )
    if uuid is None:
        raise BackendUnavailableError(
            f"cannot read the UUID of cuda:{device}: cupy cut it short and neither NVML "
            "nor torch answered"
        )
    return uuid


def _uuid_from_nvml(runtime: Any, device: int) -> str | None:
    nvml = _nvml_module()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByPciBusId(runtime.deviceGetPCIBusId(device))
        text = nvml.nvmlDeviceGetUUID(handle)
    except Exception:  # NVMLError, or no answer: try the next source
        return None
    return canonical_uuid(text)


def _uuid_from_torch(device: int) -> str | None:
    try:
        import torch  # noqa: PLC0415 (optional dependency)

        return canonical_uuid(str(torch.cuda.get_device_properties(device).uuid))
    except Exception:  # no torch, no CUDA in torch, or no uuid field: no answer
        return None


_NVML_LOCK: Final = threading.Lock()
_nvml: list[Any] = []  # the initialised pynvml module, once


def _nvml_module() -> Any:
    """pynvml after ``nvmlInit`` (once per process), or None when NVML is unusable."""
    with _NVML_LOCK:
        if not _nvml:
            try:
                import pynvml  # noqa: PLC0415 (optional dependency)

                pynvml.nvmlInit()
            except Exception:  # no module, no library, no driver: each means "no NVML"
                _nvml.append(None)
            else:
                _nvml.append(pynvml)
        return _nvml[0]


def nvml_memory(uuid: str) -> tuple[int, int] | None:
    """``(free, total)`` of GPU ``uuid`` from NVML, or None when NVML cannot say."""
    nvml = _nvml_module()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:  # NVMLError, or a pynvml that wants bytes: fall back to CUDA
        return None
    return int(info.free), int(info.total)


def device_memory(device: int) -> DeviceMemory:
    """Free and total bytes of ``device`` now (NVML, else cudaMemGetInfo).

    Creates the device's CUDA context first, as allocating there would.
    """
    runtime = _visible(check_device(device))
    uuid = device_uuid(device)
    cupy = cupy_module()
    with cupy.cuda.Device(device):
        free, total = (int(n) for n in runtime.memGetInfo())
    from_nvml = nvml_memory(uuid)
    if from_nvml is not None:
        return DeviceMemory(device, uuid, from_nvml[0], from_nvml[1], "nvml")
    return DeviceMemory(device, uuid, free, total, "cuda")
