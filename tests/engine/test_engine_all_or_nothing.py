"""Engine: a refused or mistaken call changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvd.engine import (
    Allocation,
    Code,
    EngineError,
    ExistsError,
    InvalidError,
    NotFoundError,
    Refusal,
)

from .support import Checked, MakeEngine, snapshot, toks


def busy_engine(make_engine: MakeEngine, **kw: Any) -> Checked:
    """A 6-block pool with cached blocks queued for eviction, a live
    sequence with a reservation, a fork and a pin, and pending events."""
    eng = make_engine(num_blocks=6, **kw)
    for seq, tokens in (("old", toks(9)), ("older", toks(5, start=50))):
        assert isinstance(eng.allocate(1, seq, tokens), Allocation)
        eng.commit(1, seq)
    eng.free(1, "older")
    eng.free(1, "old")
    assert isinstance(eng.allocate(1, "live", toks(6, start=100), reserve=8), Allocation)
    eng.commit(1, "live", 4)
    eng.fork(1, "live", "kid")
    return eng


def test_a_refused_allocation_moves_no_ref_lru_or_reservation(make_engine: MakeEngine) -> None:
    eng = busy_engine(make_engine)
    before = snapshot(eng)
    # Would hit 2 evictable blocks and evict the third: but needs 5 blocks.
    r = eng.allocate(1, "x", toks(17), reserve=20)
    assert isinstance(r, Refusal) and r.code == Code.OUT_OF_BLOCKS
    assert snapshot(eng) == before
    assert eng.stats().refusals["OUT_OF_BLOCKS"] == 1


def test_a_quota_refusal_changes_nothing(make_engine: MakeEngine) -> None:
    eng = busy_engine(make_engine)
    eng.open_session(2, quota=2)
    before = snapshot(eng)
    r = eng.allocate(2, "x", toks(9))
    assert isinstance(r, Refusal) and r.code == Code.QUOTA_EXCEEDED
    assert snapshot(eng) == before


def test_a_refused_append_changes_nothing(make_engine: MakeEngine) -> None:
    eng = busy_engine(make_engine)
    before = snapshot(eng)
    r = eng.append(1, "kid", toks(20, start=200))
    assert isinstance(r, Refusal)
    assert snapshot(eng) == before


def test_a_refused_fork_changes_nothing(make_engine: MakeEngine) -> None:
    eng = busy_engine(make_engine)
    before = snapshot(eng)
    assert isinstance(eng.fork(1, "live", "x", reserve=40), Refusal)
    assert snapshot(eng) == before


def test_a_refused_pin_changes_nothing(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    eng.open_session(1, quota=3)
    assert isinstance(eng.allocate(1, "a", toks(9)), Allocation)
    eng.commit(1, "a")
    before = snapshot(eng)
    assert isinstance(eng.pin(1, "a"), Refusal)
    assert snapshot(eng) == before


Mistake = Callable[[Checked], object]

MISTAKES: dict[str, tuple[type[EngineError], Mistake]] = {
    "unknown session": (NotFoundError, lambda e: e.allocate(9, "x", toks(3))),
    "unhashable session": (NotFoundError, lambda e: e.commit([1], "live")),
    "unknown sequence": (NotFoundError, lambda e: e.commit(1, "nope")),
    "duplicate sequence": (ExistsError, lambda e: e.allocate(1, "live", toks(3))),
    "duplicate fork child": (ExistsError, lambda e: e.fork(1, "live", "kid")),
    "duplicate session": (ExistsError, lambda e: e.open_session(1)),
    "sequence id not a str": (InvalidError, lambda e: e.allocate(1, 7, toks(3))),
    "2-D tokens": (InvalidError, lambda e: e.allocate(1, "x", np.zeros((2, 2), np.int32))),
    "negative token": (InvalidError, lambda e: e.append(1, "live", [3, -1])),
    "negative int32 token": (InvalidError, lambda e: e.append(1, "live", np.int32([-5]))),
    "huge token": (InvalidError, lambda e: e.allocate(1, "x", [2**31])),
    "float tokens": (InvalidError, lambda e: e.allocate(1, "x", [1.5, 2.0])),
    "ragged tokens": (InvalidError, lambda e: e.allocate(1, "x", [[1], [2, 3]])),
    "negative reserve": (InvalidError, lambda e: e.allocate(1, "x", toks(3), reserve=-1)),
    "bool reserve": (InvalidError, lambda e: e.allocate(1, "x", toks(3), reserve=True)),
    "str n": (InvalidError, lambda e: e.commit(1, "live", "3")),
    "commit past the end": (InvalidError, lambda e: e.commit(1, "live", 7)),
    "truncate past the end": (InvalidError, lambda e: e.truncate(1, "live", 7)),
    "pin past the commit": (InvalidError, lambda e: e.pin(1, "live", 5)),
    "unknown pin": (NotFoundError, lambda e: e.unpin(1, 12345)),
    "bad namespace": (InvalidError, lambda e: e.open_session(5, namespace=3)),
    "empty adapter": (InvalidError, lambda e: e.open_session(5, adapter="")),
    "negative quota": (InvalidError, lambda e: e.set_namespace_limits("", quota=-1)),
    "flush of a non-str": (InvalidError, lambda e: e.flush(7)),
    "can_allocate of -1": (InvalidError, lambda e: e.can_allocate(1, -1)),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_caller_mistake_raises_its_code_and_changes_nothing(
    make_engine: MakeEngine, name: str
) -> None:
    error, call = MISTAKES[name]
    eng = busy_engine(make_engine)
    before = snapshot(eng)
    with pytest.raises(error) as info:
        call(eng)
    assert info.value.code == error.code
    assert snapshot(eng) == before


def test_sequence_ids_are_scoped_to_their_session(make_engine: MakeEngine) -> None:
    eng = busy_engine(make_engine)
    eng.open_session(2)
    assert isinstance(eng.allocate(2, "live", toks(3)), Allocation)
    with pytest.raises(NotFoundError):
        eng.free(2, "kid")


def test_numpy_integer_arguments_are_accepted(make_engine: MakeEngine) -> None:
    eng = busy_engine(make_engine)
    assert eng.commit(1, "live", np.int64(5)).committed == 5


def test_token_lists_of_python_ints_are_accepted(make_engine: MakeEngine) -> None:
    eng = make_engine()
    r = eng.allocate(1, "a", [1, 2, 3, 4, 5])
    assert isinstance(r, Allocation) and len(r.table) == 2
