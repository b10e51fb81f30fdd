"""Keeps the daemon's permanent objects out of the cyclic collector's full passes.

CPython's collector runs a full pass whenever the objects promoted to its
oldest generation grow by a quarter, and a full pass visits every tracked
object while holding the GIL. A pool's `Block` records are such objects
(they link to each other), born on first use and kept for the daemon's
life: while a 1M-block pool fills, nine full passes of up to ~160 ms each
stop every client's requests (measured, bench/README "Collector pauses").

So the daemon's own process moves what it keeps to the collector's
permanent generation (`gc.freeze`): once before ready (the imports,
config and engines), then whenever the pools have born `FREEZE_STEP` more blocks
since the last freeze, checked on a timer. A full pass then visits only
what was made since. A cycle that was alive at a freeze and dies later is
never collected, so freezes are few: at most one per `FREEZE_STEP` blocks
born, which ends when every pool is whole, and each follows a collection
of the young generations so that their garbage is not kept. A daemon
embedded in another process (tests, a library user) does not freeze its
host's heap: `Daemon` runs this only when the process is its own.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Final

import anyio
import structlog
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

__all__ = ["FREEZE_STEP", "Freezer", "gc_stats"]

log = structlog.get_logger("kvd.server")

#: Blocks born since the last freeze that make the next one due.
FREEZE_STEP: Final = 4096
#: Seconds between checks. Short, because a pool fills at up to ~350k blocks a
#: second and what is born between two checks is scanned by every full pass;
#: a check is a sum over the pools (backing off when idle let 185k blocks
#: wait for the next one when a fill began).
_CHECK_S: Final = 0.05


class Freezer:
    """Freezes the process's objects when ``born()`` (blocks created in every
    pool) has grown by ``step`` since the last freeze."""

    def __init__(self, born: Callable[[], int], step: int = FREEZE_STEP) -> None:
        self._born = born
        self._step = step
        self._frozen_at = 0
        self._freezes = 0

    def freeze(self, *, full: bool = False) -> None:
        """Collect the young generations (``full``: every generation, as at
        start-up, before any client waits), then freeze everything left."""
        self._frozen_at = self._born()
        gc.collect(2 if full else 1)
        gc.freeze()
        self._freezes += 1
        log.debug("gc_freeze", born=self._frozen_at)

    def due(self) -> bool:
        """Whether ``step`` blocks were born since the last freeze."""
        return self._born() - self._frozen_at >= self._step

    async def run(self, *, task_status: TaskStatus[None] = TASK_STATUS_IGNORED) -> None:
        """Freeze everything now (after a full collection: start-up, before
        ready), then whenever a freeze is `due`, until cancelled."""
        self.freeze(full=True)
        task_status.started()
        while True:
            await anyio.sleep(_CHECK_S)
            if self.due():
                self.freeze()

    def stats(self) -> dict[str, object]:
        """`gc_stats` and the freezes so far, with the blocks born at the last."""
        return gc_stats() | {"freezes": self._freezes, "frozen_blocks": self._frozen_at}


def gc_stats() -> dict[str, object]:
    """The collector's counters (the stats' ``gc`` section): passes and objects
    collected per generation, youngest first. Not `gc.get_freeze_count`: it
    walks every frozen object (~10 ms at 1M blocks, under the GIL)."""
    gens = gc.get_stats()
    return {
        "collections": [g["collections"] for g in gens],
        "collected": [g["collected"] for g in gens],
    }
