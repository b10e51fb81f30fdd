"""Free-memory readings of a GPU, as far as a machine without one allows."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest

from kvd.errors import BackendUnavailableError, NoSuchDeviceError
from kvd.memory import gpuinfo

no_cupy = pytest.mark.skipif(
    importlib.util.find_spec("cupy") is not None, reason="cupy is installed here"
)


@pytest.mark.parametrize("device", [-1, 1.0, "0", True, None])
def test_check_device_takes_only_ordinals(device: Any) -> None:
    with pytest.raises(ValueError, match="CUDA ordinal"):
        gpuinfo.check_device(device)


def test_check_device_passes_an_ordinal_through() -> None:
    assert gpuinfo.check_device(3) == 3


def test_place_names_the_device_for_the_budget() -> None:
    mem = gpuinfo.DeviceMemory(2, "GPU-x", free=1, total=2, source="cuda")
    assert mem.place == "cuda:2"


@no_cupy
@pytest.mark.parametrize(
    "call",
    [
        gpuinfo.device_count,
        lambda: gpuinfo.device_uuid(0),
        lambda: gpuinfo.device_memory(0),
    ],
)
def test_without_cupy_every_reading_says_how_to_install_it(call: Any) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        call()
    assert str(info.value).startswith("cupy is not installed: pip install 'kvd[cuda]'")


def test_bad_device_is_refused_before_cupy_is_needed() -> None:
    with pytest.raises(ValueError, match="CUDA ordinal"):
        gpuinfo.device_memory(-1)


UUID = bytes.fromhex("8f2c1a0e5b7d4c3e9a1b2c3d4e5f6071")
UUID_TEXT = "GPU-8f2c1a0e-5b7d-4c3e-9a1b-2c3d4e5f6071"


class FakeRuntime:
    """cupy.cuda.runtime of one visible GPU whose properties carry ``uuid``."""

    def __init__(self, uuid: bytes) -> None:
        self.uuid = uuid

    def getDeviceCount(self) -> int:
        return 1

    def getDeviceProperties(self, device: int) -> dict[str, bytes]:
        return {"uuid": self.uuid}

    def deviceGetPCIBusId(self, device: int) -> str:
        return "0000:01:00.0"


class FakeNvml:
    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> str:
        return bus_id

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        return UUID_TEXT.upper().encode()


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    runtime = FakeRuntime(UUID)
    monkeypatch.setattr(
        gpuinfo, "cupy_module", lambda: SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))
    )
    monkeypatch.setattr(gpuinfo, "_nvml_module", FakeNvml)
    return runtime


def test_a_device_uuid_is_written_in_nvml_form(fake_gpu: FakeRuntime) -> None:
    assert gpuinfo.device_uuid(0) == UUID_TEXT


def test_a_uuid_cut_short_by_cupy_is_read_from_nvml(fake_gpu: FakeRuntime) -> None:
    fake_gpu.uuid = UUID[:5]  # a zero byte ends cupy's C string
    assert gpuinfo.device_uuid(0) == UUID_TEXT


def test_a_device_past_the_visible_ones_is_no_such_device(fake_gpu: FakeRuntime) -> None:
    with pytest.raises(NoSuchDeviceError, match="cuda:1 is not visible"):
        gpuinfo.device_uuid(1)
