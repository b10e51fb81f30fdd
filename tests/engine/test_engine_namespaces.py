"""Engine: a namespace lives while something refers to it, and is forgotten after."""

from __future__ import annotations

import pytest

from kvd.engine import Allocation, NotFoundError

from .support import Checked, MakeEngine, toks


def _names(eng: Checked) -> set[str]:
    return set(eng.stats().namespaces)


def test_closing_the_last_session_of_an_unused_namespace_forgets_it(eng: Checked) -> None:
    eng.open_session(2, namespace="t")
    assert isinstance(eng.allocate(2, "a", toks(0)), Allocation)
    eng.close_session(2)
    assert _names(eng) == {""}  # session 1's


def test_many_short_sessions_in_distinct_namespaces_leave_none_behind(eng: Checked) -> None:
    for i in range(50):
        eng.open_session(10 + i, namespace=f"tenant-{i}")
        eng.close_session(10 + i)
    assert _names(eng) == {""}  # session 1's


def test_a_namespace_with_another_open_session_stays(eng: Checked) -> None:
    eng.open_session(2, namespace="t")
    eng.open_session(3, namespace="t")
    eng.close_session(2)
    assert "t" in _names(eng)


def test_a_namespace_with_cached_blocks_stays_until_they_are_evicted(
    make_engine: MakeEngine,
) -> None:
    eng = make_engine(num_blocks=4)
    eng.open_session(2, namespace="t")
    eng.allocate(2, "a", toks(8))
    eng.commit(2, "a")
    eng.close_session(2)
    assert eng.stats().namespaces["t"].cached_blocks == 2
    assert isinstance(eng.allocate(1, "b", toks(16, start=100)), Allocation)  # evicts both
    assert _names(eng) == {""}


def test_a_flush_forgets_a_namespace_that_only_had_cached_blocks(eng: Checked) -> None:
    eng.open_session(2, namespace="t")
    eng.allocate(2, "a", toks(8))
    eng.commit(2, "a")
    eng.close_session(2)
    assert eng.flush("t") == 2
    assert "t" not in _names(eng)


def test_a_namespace_with_limits_stays_until_they_are_lifted(eng: Checked) -> None:
    eng.set_namespace_limits("t", quota=4)
    eng.open_session(2, namespace="t")
    eng.close_session(2)
    assert "t" in _names(eng)
    eng.set_namespace_limits("t", quota=None, minimum=0)
    assert "t" not in _names(eng)


def test_a_forgotten_namespace_starts_afresh(eng: Checked) -> None:
    eng.open_session(2, namespace="t")
    eng.allocate(2, "a", toks(8))
    eng.close_session(2)
    eng.open_session(3, namespace="t")
    ns = eng.stats().namespaces["t"]
    assert (ns.queries, ns.usage, ns.epoch) == (0, 0, 0)


def test_sequences_of_counts_the_sessions_sequences(eng: Checked) -> None:
    assert eng.sequences_of(1) == 0
    eng.allocate(1, "a", toks(5))
    eng.fork(1, "a", "b")
    assert eng.sequences_of(1) == 2
    eng.free(1, "a")
    assert eng.sequences_of(1) == 1


def test_sequences_of_an_unknown_session_is_not_found(eng: Checked) -> None:
    with pytest.raises(NotFoundError):
        eng.sequences_of(99)
