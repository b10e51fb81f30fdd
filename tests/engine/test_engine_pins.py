"""Engine: pins and session close."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.engine import Allocation, Code, InvalidError, NotFoundError, Pinned, Refusal

from .support import Checked, MakeEngine, snapshot, toks


def alloc(eng: Checked, seq: str, tokens: np.ndarray, sid: int = 1) -> Allocation:
    r = eng.allocate(sid, seq, tokens)
    assert isinstance(r, Allocation), r
    return r


def pin(eng: Checked, seq: str, n: int | None = None, sid: int = 1) -> Pinned:
    p = eng.pin(sid, seq, n)
    assert isinstance(p, Pinned), p
    return p


def test_a_pin_holds_the_cached_blocks_of_the_prefix(eng: Checked) -> None:
    a = alloc(eng, "a", toks(13))
    eng.commit(1, "a")
    p = pin(eng, "a", 8)
    assert p.blocks == 2
    assert [eng._pool.blocks[i].ref for i in a.table] == [2, 2, 1, 1]
    assert eng.stats().blocks_pinned == 2


def test_a_block_pinned_twice_counts_once_as_pinned(eng: Checked) -> None:
    a = alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    first = pin(eng, "a")
    pin(eng, "a")
    assert eng.stats().blocks_pinned == 2
    assert [eng._pool.blocks[i].ref for i in a.table[:2]] == [3, 3]
    eng.unpin(1, first.pin_id)
    assert eng.stats().blocks_pinned == 2


def test_a_pin_defaults_to_every_committed_token(eng: Checked) -> None:
    alloc(eng, "a", toks(13))
    eng.commit(1, "a", 9)
    assert pin(eng, "a").blocks == 2


def test_a_pin_stops_at_the_first_uncached_block(eng: Checked) -> None:
    alloc(eng, "a", toks(5))
    alloc(eng, "b", toks(13))
    eng.commit(1, "a")
    eng.commit(1, "b")  # block 0 duplicates a's and stays private
    assert pin(eng, "b").blocks == 0


def test_pinning_past_the_committed_tokens_is_invalid(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    eng.commit(1, "a", 4)
    with pytest.raises(InvalidError):
        eng.pin(1, "a", 8)


def test_pinned_blocks_are_never_evicted(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=4)
    a = alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    pin(eng, "a")
    eng.free(1, "a")
    assert isinstance(eng.allocate(1, "x", toks(9, start=500)), Refusal)
    assert alloc(eng, "y", toks(8, start=500)).table  # takes the 2 free blocks only
    eng.free(1, "y")
    assert alloc(eng, "b", toks(9)).table[:2] == a.table[:2]


def test_pins_count_against_the_session_quota(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    eng.open_session(1, quota=5)
    alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    alloc(eng, "c", toks(3, start=100))
    r = eng.pin(1, "a")
    assert isinstance(r, Refusal) and r.code == Code.QUOTA_EXCEEDED
    eng.free(1, "c")
    assert pin(eng, "a").blocks == 2
    assert eng.stats().session_usage[1] == 5


def test_unpin_makes_the_blocks_evictable_again(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    p = pin(eng, "a")
    eng.free(1, "a")
    eng.unpin(1, p.pin_id)
    s = eng.stats()
    assert (s.blocks_evictable, s.blocks_pinned, s.session_usage[1]) == (2, 0, 0)


def test_another_sessions_pin_is_not_found(eng: Checked) -> None:
    eng.open_session(2)
    alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    p = pin(eng, "a")
    with pytest.raises(NotFoundError):
        eng.unpin(2, p.pin_id)


def test_closing_a_session_frees_its_sequences_and_pins(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    pin(eng, "a")
    eng.fork(1, "a", "b")
    eng.close_session(1)
    s = eng.stats()
    assert (s.sessions, s.sequences, s.blocks_in_use, s.blocks_evictable) == (0, 0, 0, 2)


def test_committed_blocks_stay_cached_after_a_session_closes(eng: Checked) -> None:
    a = alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    eng.close_session(1)
    eng.open_session(2)
    assert alloc(eng, "b", toks(9), sid=2).table[:2] == a.table[:2]


def test_a_closed_session_is_gone(eng: Checked) -> None:
    eng.close_session(1)
    with pytest.raises(NotFoundError):
        eng.allocate(1, "a", toks(3))


def test_a_pin_past_the_held_limit_is_refused_and_changes_nothing(make_engine: MakeEngine) -> None:
    eng = make_engine(max_held_per_session=5)
    alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    pin(eng, "a")
    pin(eng, "a")
    before = snapshot(eng)
    r = eng.pin(1, "a")
    assert isinstance(r, Refusal) and r.code is Code.TOO_LARGE
    assert "would hold 6 block references" in r.message and "limit 5" in r.message
    assert snapshot(eng) == before


def test_an_unpin_makes_room_under_the_held_limit(make_engine: MakeEngine) -> None:
    eng = make_engine(max_held_per_session=2)
    alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    first = pin(eng, "a")
    assert isinstance(eng.pin(1, "a"), Refusal)
    eng.unpin(1, first.pin_id)
    assert pin(eng, "a").blocks == 2


def test_an_empty_pin_counts_one_reference_against_the_held_limit(
    make_engine: MakeEngine,
) -> None:
    eng = make_engine(max_held_per_session=2)
    alloc(eng, "a", toks(3))  # no full block: every pin of it is empty
    first = pin(eng, "a")
    assert first.blocks == 0
    pin(eng, "a")
    r = eng.pin(1, "a")
    assert isinstance(r, Refusal) and r.code is Code.TOO_LARGE
    eng.unpin(1, first.pin_id)
    assert pin(eng, "a").blocks == 0
