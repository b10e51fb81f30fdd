"""Free-memory readings of a GPU, as far as a machine without one allows."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from kvd.errors import StartupError
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
    with pytest.raises(StartupError) as info:
        call()
    assert str(info.value).startswith("cupy is not installed: pip install 'kvd[cuda]'")


def test_bad_device_is_refused_before_cupy_is_needed() -> None:
    with pytest.raises(ValueError, match="CUDA ordinal"):
        gpuinfo.device_memory(-1)
