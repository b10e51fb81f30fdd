"""Fixtures for the engine tests."""

from __future__ import annotations

from typing import Any

import pytest

from kvd.engine import Engine, EngineConfig

from .support import BS, Checked, MakeEngine


@pytest.fixture
def make_engine() -> MakeEngine:
    """Build a checked engine (block size 4 unless told) with session 1 open."""

    def make(
        num_blocks: int = 16, block_size: int = BS, session: bool = True, **kw: Any
    ) -> Checked:
        eng = Checked(Engine(EngineConfig(num_blocks=num_blocks, block_size=block_size, **kw)))
        if session:
            eng.open_session(1)
        return eng

    return make


@pytest.fixture
def eng(make_engine: MakeEngine) -> Checked:
    """A 16-block engine, block size 4, session 1 open in the default namespace."""
    return make_engine()
