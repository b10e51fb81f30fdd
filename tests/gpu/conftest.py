"""GPU tests: marked ``cuda`` and skipped, with the reason, without cupy, torch's CUDA or a device.

Clients run in processes of their own (a process cannot open a CUDA IPC
handle it exported), started with ``spawn``: a forked child cannot use the
CUDA context of its parent.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_workers import Worker, start_workers

HERE = Path(__file__).parent


def _missing() -> str | None:
    """Why these tests cannot run here, or None."""
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'kvd[cuda]')"
    import cupy

    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"no CUDA device: {exc}"
    if count == 0:
        return "no CUDA device"
    import torch

    if not torch.cuda.is_available():
        return "torch cannot use CUDA"
    return None


MISSING = _missing()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.cuda)
            if MISSING is not None:
                item.add_marker(pytest.mark.skip(reason=MISSING))


@pytest.fixture(scope="session")
def clients() -> Iterator[tuple[Worker, Worker]]:
    """Two client processes, shared by every GPU test (starting one costs seconds)."""
    a, b = start_workers(2)
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()
