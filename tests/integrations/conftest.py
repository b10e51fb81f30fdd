"""Fixtures for the transformers adapter: a real kvd daemon and the tiny Llama."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .support import NUM_BLOCKS, POOL  # first: puts examples/ on sys.path

# isort: split
from kvd_client import Client
from kvd_llm.daemon import private_daemon
from kvd_llm.model import TinyConfig


@pytest.fixture(scope="package")
def hf_model() -> Any:
    """``LlamaForCausalLM`` with the tiny model's seeded weights (skipped without transformers)."""
    pytest.importorskip("transformers")
    from kvd_llm.hf_model import tiny_llama_hf

    return tiny_llama_hf()


@pytest.fixture(scope="package")
def daemon() -> Iterator[str]:
    """The address of a kvd daemon serving the tiny model's pool (one per test package)."""
    with private_daemon(TinyConfig().layout(NUM_BLOCKS), POOL) as address:
        yield address


@pytest.fixture
def kv(daemon: str) -> Iterator[Client]:
    """A fresh session; the prefix cache is flushed first so tests never share hits."""
    with Client.connect(daemon, pool=POOL, name="pytest") as client:
        client.flush()
        yield client
