"""Engine: fork and copy-on-write."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.engine import Allocation, Appended, Forked, NotFoundError

from .support import BS, Checked, MakeEngine, toks


def alloc(eng: Checked, seq: str, tokens: np.ndarray, reserve: int | None = None) -> Allocation:
    r = eng.allocate(1, seq, tokens, reserve=reserve)
    assert isinstance(r, Allocation), r
    return r


def append(eng: Checked, seq: str, tokens: list[int]) -> Appended:
    a = eng.append(1, seq, tokens)
    assert isinstance(a, Appended), a
    return a


def refs(eng: Checked, table: list[int]) -> list[int]:
    return [eng._pool.blocks[i].ref for i in table]


def test_fork_shares_every_block(eng: Checked) -> None:
    a = alloc(eng, "a", toks(10))
    f = eng.fork(1, "a", "b")
    assert f == Forked(a.table)
    assert refs(eng, a.table) == [2, 2, 2]


def test_a_fork_has_the_parents_tokens_and_commit_state(eng: Checked) -> None:
    alloc(eng, "a", toks(10))
    eng.commit(1, "a", 6)
    eng.fork(1, "a", "b")
    child = eng._sessions[1].seqs["b"]
    assert child.tokens[: child.length].tolist() == list(range(10))
    assert child.committed == 6


def test_a_fork_shares_the_token_buffer_until_either_side_writes(eng: Checked) -> None:
    alloc(eng, "a", toks(10), reserve=20)
    eng.fork(1, "a", "b")
    seqs = eng._sessions[1].seqs
    assert seqs["a"].tokens is seqs["b"].tokens
    eng.truncate(1, "a", 6)
    append(eng, "a", [70, 71])  # in place before the fork: now into a copy
    append(eng, "b", [80])
    assert seqs["a"].tokens[: seqs["a"].length].tolist() == [0, 1, 2, 3, 4, 5, 70, 71]
    assert seqs["b"].tokens[: seqs["b"].length].tolist() == [*range(10), 80]
    assert seqs["a"].tokens is not seqs["b"].tokens


def test_appending_into_a_shared_partial_block_copies_it(eng: Checked) -> None:
    a = alloc(eng, "a", toks(6))
    eng.fork(1, "a", "b")
    r = append(eng, "b", [99])
    dst = r.blocks[0]
    assert r.copies == [(a.table[1], dst)]
    assert r.start == 1 and dst not in a.table
    # The source: held by "a" and, until the session's next call, by the copy.
    assert refs(eng, [a.table[1], dst]) == [2, 1]


def test_the_other_holder_keeps_writing_in_place_after_the_copy(eng: Checked) -> None:
    alloc(eng, "a", toks(6))
    eng.fork(1, "a", "b")
    append(eng, "b", [99])
    r = append(eng, "a", [98])
    assert r.copies == [] and r.blocks == []


def test_appending_into_a_private_partial_block_writes_in_place(eng: Checked) -> None:
    alloc(eng, "a", toks(6))
    r = append(eng, "a", [6])
    assert (r.start, r.blocks, r.copies, r.length) == (2, [], [], 7)


def test_appending_after_a_shared_full_block_needs_no_copy(eng: Checked) -> None:
    a = alloc(eng, "a", toks(8))
    eng.fork(1, "a", "b")
    r = append(eng, "b", [8])
    assert r.copies == [] and r.start == 2 and len(r.blocks) == 1
    assert refs(eng, a.table) == [2, 2]


def test_truncating_into_a_cached_block_then_appending_copies_it(eng: Checked) -> None:
    a = alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    eng.truncate(1, "a", 6)
    r = append(eng, "a", [60])
    assert r.copies == [(a.table[1], r.blocks[0])]
    # The cached block still holds tokens 4..7 and still matches.
    assert alloc(eng, "b", toks(9)).table[:2] == a.table[:2]


def test_truncating_into_a_shared_block_then_appending_copies_it(eng: Checked) -> None:
    a = alloc(eng, "a", toks(8))
    eng.fork(1, "a", "b")
    eng.truncate(1, "b", 6)
    r = append(eng, "b", [60])
    assert r.copies == [(a.table[1], r.blocks[0])]
    assert eng._sessions[1].seqs["a"].tokens[:8].tolist() == list(range(8))


def test_a_copy_and_new_blocks_come_in_one_reply(eng: Checked) -> None:
    a = alloc(eng, "a", toks(6))
    eng.fork(1, "a", "b")
    r = append(eng, "b", [1, 2, 3, 4, 5])
    assert r.start == 1 and len(r.blocks) == 2
    assert r.copies == [(a.table[1], r.blocks[0])]
    assert eng._sessions[1].seqs["b"].table[0].block_id == a.table[0]


def test_appending_nothing_changes_nothing(eng: Checked) -> None:
    alloc(eng, "a", toks(6))
    eng.fork(1, "a", "b")
    r = append(eng, "b", [])
    assert (r.start, r.blocks, r.copies, r.length) == (2, [], [], 6)


def test_freeing_a_fork_leaves_the_parent_intact(eng: Checked) -> None:
    a = alloc(eng, "a", toks(6))
    eng.fork(1, "a", "b")
    eng.free(1, "b")
    assert refs(eng, a.table) == [1, 1]


# --- the source of a copy stays held until the client has copied it ---------------


def copied(make_engine: MakeEngine) -> tuple[Checked, int]:
    """A full 4-block pool: session 1's "a" had its cached partial last block
    (held by "a" alone) copied by an append, session 2 open. Returns the
    engine and the copy's source."""
    eng = make_engine(num_blocks=4)
    eng.open_session(2)
    a = alloc(eng, "a", toks(8))
    eng.commit(1, "a")
    eng.truncate(1, "a", 6)
    r = append(eng, "a", [99])
    assert r.copies == [(a.table[1], r.blocks[0])]
    return eng, a.table[1]


def test_a_copy_source_is_never_handed_to_another_session_before_the_next_call(
    make_engine: MakeEngine,
) -> None:
    eng, src = copied(make_engine)
    taken: list[int] = []
    while isinstance(r := eng.allocate(2, f"b{len(taken)}", toks(BS, 100)), Allocation):
        taken += r.table
    assert taken and src not in taken


def test_a_copy_source_is_released_at_the_sessions_next_call(make_engine: MakeEngine) -> None:
    eng, src = copied(make_engine)
    eng.commit(1, "a", 0)
    assert eng._pool.blocks[src].ref == 0
    assert eng.stats().session_usage[1] == 2


def test_a_copy_source_is_released_by_a_call_that_fails(make_engine: MakeEngine) -> None:
    eng, src = copied(make_engine)
    with pytest.raises(NotFoundError):
        eng.free(1, "nope")
    assert eng._pool.blocks[src].ref == 0


def test_a_copy_source_is_released_when_the_session_closes(make_engine: MakeEngine) -> None:
    eng, src = copied(make_engine)
    eng.close_session(1)
    assert eng.stats().blocks_in_use == 0
    assert eng._pool.blocks[src].ref == 0


def test_another_sessions_call_keeps_a_copy_source_held(make_engine: MakeEngine) -> None:
    eng, src = copied(make_engine)
    eng.can_allocate(2, 0)
    eng.sequences_of(1)
    assert eng._pool.blocks[src].ref == 1
    assert eng.stats().session_usage[1] == 3


def test_a_copy_within_the_reservation_is_admitted_at_the_quota(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    eng.open_session(1, quota=3)
    alloc(eng, "a", toks(8))
    eng.commit(1, "a")
    eng.truncate(1, "a", 6)  # reserves the copy: 2 blocks + 1
    assert eng.stats().session_usage[1] == 3
    r = append(eng, "a", [99, 98])
    assert len(r.copies) == 1
    assert eng.stats().session_usage[1] == 3  # the new block and the held source
