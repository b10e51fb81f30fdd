"""Fixtures for the example client: a real kvd daemon whose pool fits the tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .support import NUM_BLOCKS, POOL  # first: puts examples/ on sys.path

# isort: split
from kvd_client import Client
from kvd_llm.daemon import private_daemon
from kvd_llm.model import TinyConfig, TinyLlama


@pytest.fixture(scope="package")
def model() -> TinyLlama:
    return TinyLlama(TinyConfig())


@pytest.fixture(scope="package")
def daemon(model: TinyLlama) -> Iterator[str]:
    """The address of a kvd daemon serving pool ``tiny`` (one per test package)."""
    with private_daemon(model.cfg.layout(NUM_BLOCKS), POOL) as address:
        yield address


@pytest.fixture
def kv(daemon: str) -> Iterator[Client]:
    """A fresh session; the prefix cache is flushed first so tests never share hits."""
    with Client.connect(daemon, pool=POOL, name="pytest") as client:
        client.flush()
        yield client
