"""Helpers for the engine tests: an engine that checks its invariants after
every call, token ids, and a full-state snapshot for all-or-nothing tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvd.engine import Engine
from kvd.engine.adaptive import AdaptivePool
from kvd.engine.frequency import FrequencyPool

BS = 4


def toks(n: int, start: int = 0) -> npt.NDArray[np.int32]:
    """``n`` consecutive token ids from ``start`` (int32)."""
    return np.arange(start, start + n, dtype=np.int32)


class Checked:
    """An `Engine` whose every public call is followed by `check_invariants`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self.engine.check_invariants()

        return call


def shadows(pool: FrequencyPool) -> object:
    """An adaptive pool's shadow caches and order, as plain values."""
    if not isinstance(pool, AdaptivePool):
        return None
    sh = pool.shadows
    weighted = [[list(q.items()) for q in w.classes] for w in sh.weighted]
    return (list(sh.lru), weighted, list(sh.hits), list(sh.apart), sh.unit, pool.order)


def snapshot(eng: Engine | Checked) -> dict[str, Any]:
    """Everything an operation could change, except the refusal counters."""
    if isinstance(eng, Checked):
        eng = eng.engine
    pool = eng._pool
    stats = eng.stats().to_dict()
    del stats["refusals"]
    return {
        "blocks": [(b.ref, eng._pins.get(b, 0), b.key, b.index is not None) for b in pool.blocks],
        "free": [b.block_id for b in pool.free],
        "unborn": pool.unborn,
        "queues": [[b.block_id for b in q] for q in pool.queues()],
        "policy": (
            (
                bytes(pool.uses),
                pool.stamps.tobytes(),
                pool.clock,
                bytes(pool.table.counters),
                [weight for _, _, weight in pool.ends],
                shadows(pool),
            )
            if isinstance(pool, FrequencyPool)
            else None
        ),
        "outstanding": eng._accounts.outstanding,
        "events": list(eng._events),
        "sessions": {
            sid: (
                s.usage,
                s.held,
                {pid: [b.block_id for b in blocks] for pid, blocks in s.pins.items()},
                {hid: sorted(h.blocks) for hid, h in s.holds.items()},
                {
                    q: (
                        seq.tokens[: seq.length].tolist(),
                        [b.block_id for b in seq.table],
                        seq.committed,
                        list(seq.keys),
                        seq.num_cached,
                        seq.reserve,
                        seq.reserve_blocks,
                        seq.cow,
                        seq.out,
                        seq.epoch,
                    )
                    for q, seq in s.seqs.items()
                },
            )
            for sid, s in eng._sessions.items()
        },
        "namespaces": {
            name: (ns.usage, ns.epoch, {k: b.block_id for k, b in ns.index.items()})
            for name, ns in eng._accounts.namespaces.items()
        },
        "stats": stats,
    }


MakeEngine = Callable[..., Checked]
