"""Engine: block tables, commits and the prefix cache (DESIGN.md section 4)."""

from __future__ import annotations

import numpy as np
import pytest
from kvd_client.wire.hashing import BlockHasher

from kvd.engine import (
    Allocation,
    Appended,
    BlockStored,
    Committed,
    Truncated,
)

from .support import BS, Checked, MakeEngine, toks


def alloc(
    eng: Checked, seq: str, tokens: np.ndarray, reserve: int | None = None, sid: int = 1
) -> Allocation:
    r = eng.allocate(sid, seq, tokens, reserve=reserve)
    assert isinstance(r, Allocation), r
    return r


def seq_tokens(eng: Checked, seq: str, sid: int = 1) -> list[int]:
    s = eng._sessions[sid].seqs[seq]
    return s.tokens[: s.length].tolist()


# --- Constant block size -----------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 3, 4, 5, 8, 9, 15, 16, 17])
def test_a_sequence_holds_ceil_length_over_block_size_blocks(eng: Checked, length: int) -> None:
    r = alloc(eng, "a", toks(length))
    assert len(r.table) == -(-length // BS)


def test_appends_add_a_block_only_when_the_last_one_is_full(eng: Checked) -> None:
    alloc(eng, "a", toks(3))
    sizes = []
    for i in range(6):
        a = eng.append(1, "a", [100 + i])
        assert isinstance(a, Appended)
        sizes.append(len(eng._sessions[1].seqs["a"].table))
    assert sizes == [1, 2, 2, 2, 2, 3]


def test_truncate_frees_the_whole_blocks_past_the_new_end(eng: Checked) -> None:
    r = alloc(eng, "a", toks(11))
    t = eng.truncate(1, "a", 5)
    assert t == Truncated(5, 2)
    assert [b.block_id for b in eng._sessions[1].seqs["a"].table] == r.table[:2]
    assert eng._pool.blocks[r.table[2]].ref == 0


def test_popping_a_token_off_a_full_block_keeps_its_capacity(eng: Checked) -> None:
    # mistral.rs's LogicalTokenBlock::pop_token shrank the block: refilling it
    # then spilled into a new block and table and tokens drifted apart.
    alloc(eng, "a", toks(8))
    eng.truncate(1, "a", 7)
    a = eng.append(1, "a", [70])
    assert isinstance(a, Appended)
    assert a.length == 8 and a.blocks == [] and a.start == 2
    assert len(eng._sessions[1].seqs["a"].table) == 2
    a = eng.append(1, "a", [71])
    assert isinstance(a, Appended)
    assert len(eng._sessions[1].seqs["a"].table) == 3


def test_stored_tokens_follow_truncates_and_appends(eng: Checked) -> None:
    alloc(eng, "a", toks(6))
    eng.truncate(1, "a", 2)
    eng.append(1, "a", [50, 51, 52])
    eng.truncate(1, "a", 4)
    eng.append(1, "a", [60])
    assert seq_tokens(eng, "a") == [0, 1, 50, 51, 60]


def test_truncate_to_zero_releases_every_block(eng: Checked) -> None:
    alloc(eng, "a", toks(6))
    assert eng.truncate(1, "a", 0) == Truncated(0, 0)
    assert eng.stats().blocks_in_use == 0


# --- Only full, committed blocks are cached -----------------------------------


def test_uncommitted_blocks_never_match(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    assert alloc(eng, "b", toks(9)).num_cached_tokens == 0


def test_commit_caches_only_blocks_it_fully_covers(eng: Checked) -> None:
    alloc(eng, "a", toks(12))
    assert eng.commit(1, "a", 7) == Committed(7, 1)
    assert alloc(eng, "b", toks(12)).num_cached_tokens == 4


def test_commit_defaults_to_every_token(eng: Checked) -> None:
    alloc(eng, "a", toks(10))
    assert eng.commit(1, "a") == Committed(10, 2)


def test_commit_below_the_committed_count_changes_nothing(eng: Checked) -> None:
    alloc(eng, "a", toks(10))
    eng.commit(1, "a", 9)
    assert eng.commit(1, "a", 3) == Committed(9, 0)


def test_a_partial_last_block_is_never_shared(eng: Checked) -> None:
    a = alloc(eng, "a", toks(10))
    eng.commit(1, "a")
    b = alloc(eng, "b", toks(14))
    assert b.num_cached_tokens == 8
    assert b.table[2] != a.table[2]


def test_blocks_filled_by_appends_are_cached_at_commit(eng: Checked) -> None:
    alloc(eng, "a", toks(3))
    eng.append(1, "a", toks(6, start=3))
    eng.commit(1, "a")
    assert alloc(eng, "b", toks(9)).num_cached_tokens == 8


def test_prefix_hits_count_as_committed(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    alloc(eng, "b", toks(9))
    assert eng.commit(1, "b", 8) == Committed(8, 0)


# --- Longest prefix, capped ---------------------------------------------------


def test_a_prompt_of_exactly_cached_blocks_leaves_its_last_block_to_compute(
    make_engine: MakeEngine,
) -> None:
    eng = make_engine(block_size=16)
    alloc(eng, "a", toks(32))
    eng.commit(1, "a")
    assert alloc(eng, "b", toks(32)).num_cached_tokens == 16


def test_one_token_past_the_cached_blocks_hits_them_all(eng: Checked) -> None:
    alloc(eng, "a", toks(8))
    eng.commit(1, "a")
    assert alloc(eng, "b", toks(9)).num_cached_tokens == 8


def test_the_match_stops_at_the_first_differing_block(eng: Checked) -> None:
    alloc(eng, "a", toks(13))
    eng.commit(1, "a")
    other = toks(13)
    other[5] = 999
    b = alloc(eng, "b", other)
    assert b.num_cached_tokens == 4


def test_hits_share_the_cached_blocks(eng: Checked) -> None:
    a = alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    b = alloc(eng, "b", toks(9))
    assert b.table[:2] == a.table[:2]
    assert [eng._pool.blocks[i].ref for i in a.table[:2]] == [2, 2]


# --- Hashing: lazy, incremental, never twice ------------------------------------


class CountingHasher(BlockHasher):
    """Counts the blocks it hashes."""

    __slots__ = ("hashed",)

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.hashed = 0

    def keys(self, tokens, parent, **kw):  # type: ignore[no-untyped-def]
        out = super().keys(tokens, parent, **kw)
        self.hashed += len(out)
        return out


def counting(eng: Checked) -> CountingHasher:
    hasher = CountingHasher(BS)
    eng.engine._hasher = hasher
    return hasher


def test_allocate_hashes_only_the_matchable_blocks(eng: Checked) -> None:
    hasher = counting(eng)
    alloc(eng, "a", toks(12))
    assert hasher.hashed == 2


def test_commit_hashes_only_blocks_not_hashed_yet(eng: Checked) -> None:
    hasher = counting(eng)
    alloc(eng, "a", toks(12))
    eng.commit(1, "a")
    assert hasher.hashed == 3
    eng.append(1, "a", toks(5, start=12))
    eng.commit(1, "a")
    assert hasher.hashed == 4


def test_incremental_keys_equal_one_shot_keys(eng: Checked) -> None:
    alloc(eng, "a", toks(2))
    for i in range(2, 17):
        eng.append(1, "a", [i])
        eng.commit(1, "a")
    one_shot = BlockHasher(BS).keys(toks(16), None)
    assert eng._sessions[1].seqs["a"].keys == one_shot


# --- Ref counts and block states ---------------------------------------------------


def test_free_plus_evictable_plus_in_use_is_the_pool(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    alloc(eng, "b", toks(5, start=50))
    eng.free(1, "a")
    s = eng.stats()
    assert (s.blocks_free, s.blocks_evictable, s.blocks_in_use) == (12, 2, 2)
    assert s.blocks_free + s.blocks_evictable + s.blocks_in_use == s.blocks_total


def test_a_released_cached_block_is_evictable_and_still_matches(eng: Checked) -> None:
    a = alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    eng.free(1, "a")
    assert eng.stats().blocks_evictable == 2
    b = alloc(eng, "b", toks(9))
    assert b.table[:2] == a.table[:2]
    assert eng.stats().blocks_evictable == 0


def test_a_released_uncached_block_is_free(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    eng.free(1, "a")
    s = eng.stats()
    assert (s.blocks_free, s.blocks_evictable) == (16, 0)


def test_each_holder_adds_one_reference(eng: Checked) -> None:
    a = alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    alloc(eng, "b", toks(9))
    eng.fork(1, "a", "c")
    eng.pin(1, "a")
    assert [eng._pool.blocks[i].ref for i in a.table] == [4, 4, 2]


# --- Duplicate keys ---------------------------------------------------------------


def test_a_block_whose_key_is_already_cached_stays_private(eng: Checked) -> None:
    a = alloc(eng, "a", toks(9))
    b = alloc(eng, "b", toks(9))  # computed concurrently: no hits
    eng.commit(1, "a")
    assert eng.commit(1, "b") == Committed(9, 0)
    assert eng._pool.blocks[b.table[0]].key is None
    assert alloc(eng, "c", toks(9)).table[:2] == a.table[:2]


def test_a_private_duplicate_is_free_once_released(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    alloc(eng, "b", toks(9))
    eng.commit(1, "a")
    eng.commit(1, "b")
    eng.free(1, "b")
    s = eng.stats()
    assert (s.blocks_evictable, s.blocks_free) == (0, 13)


# --- Events ----------------------------------------------------------------------


def test_one_commit_stores_its_consecutive_blocks_in_one_event(eng: Checked) -> None:
    alloc(eng, "a", toks(13))
    eng.commit(1, "a")
    keys = eng._sessions[1].seqs["a"].keys
    assert eng.drain_events() == [
        BlockStored(keys[:3], None, toks(12), block_size=BS, namespace="", adapter=None)
    ]


def test_a_later_commit_names_its_parent(eng: Checked) -> None:
    alloc(eng, "a", toks(13))
    eng.commit(1, "a", 4)
    eng.drain_events()
    eng.commit(1, "a")
    keys = eng._sessions[1].seqs["a"].keys
    (ev,) = eng.drain_events()
    assert isinstance(ev, BlockStored)
    assert (ev.keys, ev.parent, ev.token_ids) == (keys[1:3], keys[0], list(range(4, 12)))


def test_stored_events_split_around_a_private_duplicate(eng: Checked) -> None:
    alloc(eng, "a", toks(5))
    alloc(eng, "b", toks(13))
    eng.commit(1, "a")
    eng.drain_events()
    eng.commit(1, "b")
    keys = eng._sessions[1].seqs["b"].keys
    (ev,) = eng.drain_events()
    assert isinstance(ev, BlockStored)
    assert (ev.keys, ev.parent) == (keys[1:3], keys[0])


def test_events_carry_namespace_and_adapter(eng: Checked) -> None:
    eng.open_session(2, namespace="tenant", adapter="lora-a")
    alloc(eng, "a", toks(5), sid=2)
    eng.commit(2, "a")
    (ev,) = eng.drain_events()
    assert isinstance(ev, BlockStored)
    assert (ev.namespace, ev.adapter, ev.block_size) == ("tenant", "lora-a", BS)


def test_drain_empties_the_event_list(eng: Checked) -> None:
    alloc(eng, "a", toks(5))
    eng.commit(1, "a")
    assert len(eng.drain_events()) == 1
    assert eng.drain_events() == []


def test_events_can_be_turned_off(make_engine: MakeEngine) -> None:
    eng = make_engine(events=False)
    alloc(eng, "a", toks(5))
    eng.commit(1, "a")
    eng.flush()
    assert eng.drain_events() == []


# --- Stats and invariants --------------------------------------------------------------


def test_stats_count_queries_hits_and_usage(eng: Checked) -> None:
    eng.open_session(2, namespace="t")
    alloc(eng, "a", toks(9), reserve=12)
    eng.commit(1, "a")
    alloc(eng, "b", toks(9))
    alloc(eng, "c", toks(3), sid=2)
    s = eng.stats()
    assert (s.prefix_queries, s.query_tokens, s.hit_tokens) == (3, 21, 8)
    assert s.hit_ratio == pytest.approx(8 / 21)
    assert (s.sequences, s.sessions, s.reserved) == (3, 2, 0)
    assert s.session_usage == {1: 6, 2: 1}
    assert s.namespaces[""].queries == 2 and s.namespaces[""].hit_tokens == 8
    assert s.namespaces["t"].usage == 1 and s.namespaces[""].cached_blocks == 2


def test_stats_count_reserved_blocks(eng: Checked) -> None:
    alloc(eng, "a", toks(3), reserve=13)
    assert eng.stats().reserved == 3


def test_born_counts_block_records_made_on_first_use_and_kept(eng: Checked) -> None:
    assert eng.born() == 0
    alloc(eng, "a", toks(3 * BS))
    assert eng.born() == 3
    eng.free(1, "a")
    alloc(eng, "b", toks(2 * BS, start=1000))
    assert eng.born() == 3
