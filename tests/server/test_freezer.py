"""kvd.server.freezer: what the daemon keeps leaves the collector's full passes."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator

import anyio
import numpy as np
import pytest
from kvd_client import Client

from kvd.server.freezer import Freezer


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    """Undo each test's freezes: the test process is not a daemon's own."""
    yield
    gc.unfreeze()


class Born:
    """Stands in for the pools' block records: tracked objects kept for good."""

    def __init__(self) -> None:
        self.kept: list[list[int]] = []

    def grow(self, n: int) -> None:
        self.kept += [[i] for i in range(n)]

    def __call__(self) -> int:
        return len(self.kept)


class Node:
    """A class instance that can sit in a reference cycle and be weakly referenced."""

    me: Node


def test_freeze_moves_what_is_alive_to_the_permanent_generation() -> None:
    born = Born()
    born.grow(1000)
    before = gc.get_freeze_count()
    Freezer(born).freeze()
    assert gc.get_freeze_count() >= before + 1000


def test_young_cyclic_garbage_is_collected_not_frozen() -> None:
    node = Node()
    node.me = node
    ref = weakref.ref(node)
    del node
    Freezer(Born()).freeze()
    assert ref() is None


def test_a_freeze_is_due_after_step_blocks_are_born() -> None:
    born = Born()
    freezer = Freezer(born, step=10)
    freezer.freeze()
    born.grow(9)
    assert not freezer.due()
    born.grow(1)
    assert freezer.due()
    freezer.freeze()
    assert not freezer.due()


def test_run_freezes_at_start_then_once_blocks_are_born() -> None:
    born = Born()
    freezer = Freezer(born, step=100)

    async def main() -> dict[str, object]:
        async with anyio.create_task_group() as tg:
            await tg.start(freezer.run)
            assert freezer.stats()["freezes"] == 1
            born.grow(99)
            await anyio.sleep(0.2)
            assert freezer.stats()["freezes"] == 1
            born.grow(1)
            with anyio.move_on_after(5):
                while freezer.stats()["freezes"] == 1:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        return freezer.stats()

    stats = anyio.run(main)
    assert stats["freezes"] == 2
    assert stats["frozen_blocks"] == 100


def test_a_daemon_process_freezes_its_pools_blocks(start_kvd) -> None:
    daemon = start_kvd(
        overrides={
            "pools.0.num_blocks": "20000",
            "pools.0.num_layers": "1",
            "pools.0.num_kv_heads": "1",
            "pools.0.head_dim": "1",
        }
    )
    stats = daemon.stats()["gc"]
    assert stats["freezes"] == 1  # what start-up made
    assert stats["frozen_blocks"] == 0
    with Client.connect(daemon.address, name="fill") as kv:
        seq = kv.allocate("fill", np.arange(8192 * 16, dtype=np.int32) % 50_000)
        seq.commit()
        seq.free()
    deadline = time.monotonic() + 10
    while daemon.stats()["gc"]["frozen_blocks"] < 8192 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = daemon.stats()["gc"]
    assert stats["frozen_blocks"] == 8192
    assert stats["freezes"] >= 2
    assert len(stats["collections"]) == len(stats["collected"]) == 3
