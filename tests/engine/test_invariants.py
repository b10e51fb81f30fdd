"""Invariants: a recount of the engine state finds every inconsistency."""

from __future__ import annotations

import pytest

from kvd.engine import Allocation, Engine, EngineConfig

from .support import Checked, toks


def test_check_invariants_reports_an_unused_namespace(eng: Checked) -> None:
    eng.engine._accounts.namespace("ghost")
    with pytest.raises(AssertionError, match="'ghost' is unused but still registered"):
        eng.engine.check_invariants()


def test_check_invariants_lists_every_problem(eng: Checked) -> None:
    r = eng.allocate(1, "a", toks(5))
    assert isinstance(r, Allocation)
    raw: Engine = eng.engine
    raw._pool.blocks[r.table[0]].ref += 1
    raw._accounts.outstanding += 2
    with pytest.raises(AssertionError) as info:
        raw.check_invariants()
    problems = info.value.problems  # type: ignore[attr-defined]
    assert any("block 0: ref 2, holders 1" in p for p in problems)
    assert any("outstanding reservations 2" in p for p in problems)


def test_check_invariants_recounts_the_references_held_in_pins_and_holds(eng: Checked) -> None:
    raw: Engine = eng.engine
    raw._sessions[1].held += 1
    with pytest.raises(AssertionError, match="1 block references held, recomputed 0"):
        raw.check_invariants()


def test_a_fresh_engine_satisfies_its_invariants() -> None:
    Engine(EngineConfig(num_blocks=4)).check_invariants()


def test_check_invariants_reports_a_shared_token_buffer_not_marked_shared(eng: Checked) -> None:
    assert isinstance(eng.allocate(1, "a", toks(5)), Allocation)
    eng.fork(1, "a", "b")
    raw: Engine = eng.engine
    raw._sessions[1].seqs["b"].shared = False
    with pytest.raises(AssertionError, match="share a token buffer not marked shared"):
        raw.check_invariants()
