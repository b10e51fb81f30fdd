"""Fixtures of the client tests: pool files under /dev/shm and ROUTER threads."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvd_client.wire import PoolLayout

from .support import LAYOUT, Handler, Router, make_pool_file


@pytest.fixture
def pool_file() -> Iterator[Callable[[PoolLayout], Path]]:
    """Factory of pool files in /dev/shm, removed at teardown."""
    made: list[Path] = []

    def make(layout: PoolLayout = LAYOUT) -> Path:
        path = make_pool_file(layout)
        made.append(path)
        return path

    yield make
    for path in made:
        path.unlink(missing_ok=True)


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short private directory for ipc sockets (Unix socket paths are short)."""
    with tempfile.TemporaryDirectory(prefix="kvdc-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def router(ipc_dir: Path) -> Iterator[Callable[[Handler], Router]]:
    """Factory of `Router` threads on private ipc addresses, stopped at teardown."""
    started: list[Router] = []

    def start(handler: Handler) -> Router:
        r = Router(f"ipc://{ipc_dir}/r{len(started)}.sock", handler)
        started.append(r)
        return r

    yield start
    for r in started:
        r.close()
