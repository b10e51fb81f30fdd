"""Engine: eviction order and what an evicted block loses."""

from __future__ import annotations

import numpy as np

from kvd.engine import Allocation, BlockRemoved, Refusal

from .support import Checked, MakeEngine, toks


def alloc(eng: Checked, seq: str, tokens: np.ndarray, reserve: int | None = None) -> Allocation:
    r = eng.allocate(1, seq, tokens, reserve=reserve)
    assert isinstance(r, Allocation), r
    return r


def cached(eng: Checked, seq: str, tokens: np.ndarray) -> Allocation:
    """Allocate, commit everything and free: the full blocks stay cached."""
    r = alloc(eng, seq, tokens)
    eng.commit(1, seq)
    eng.free(1, seq)
    return r


def lru(eng: Checked) -> list[int]:
    return [b.block_id for b in eng._pool.lru]


def test_free_blocks_are_used_before_cached_ones(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    a = cached(eng, "a", toks(9))
    b = alloc(eng, "b", toks(20, start=100))
    assert not set(b.table) & set(a.table[:2])
    assert eng.stats().evictions == 0


def test_the_least_recently_released_block_goes_first(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=6)
    a = cached(eng, "a", toks(5))
    b = cached(eng, "b", toks(5, start=100))
    alloc(eng, "x", toks(17, start=500))  # 5 blocks: 4 free + 1 evicted
    evicted = {i for i in (a.table[0], b.table[0]) if eng._pool.blocks[i].key is None}
    assert evicted == {a.table[0]}


def test_a_chain_is_evicted_tail_first(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=4)
    a = cached(eng, "a", toks(13))  # 3 cached blocks + 1 free
    assert lru(eng) == a.table[2::-1]
    alloc(eng, "x", toks(6, start=500))  # 2 blocks: 1 free + the tail
    assert eng._pool.blocks[a.table[2]].key is None
    eng.free(1, "x")
    assert alloc(eng, "y", toks(13)).num_cached_tokens == 8


def test_a_request_never_evicts_its_own_hits(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=4)
    a = cached(eng, "a", toks(5))  # block 0 cached, released first
    cached(eng, "c", toks(12, start=100))
    assert lru(eng)[0] == a.table[0]  # the hit-to-be is next in line
    r = alloc(eng, "b", toks(9))  # hits block 0, needs 2 more: both evicted
    assert r.num_cached_tokens == 4
    assert r.table[0] == a.table[0]
    assert eng.stats().evictions == 2


def test_an_evicted_block_loses_its_key_at_once(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=3)
    a = cached(eng, "a", toks(9))
    alloc(eng, "x", toks(12, start=500))
    for bid in a.table[:2]:
        assert eng._pool.blocks[bid].key is None
    assert len(eng._namespaces[""].index) == 0
    eng.free(1, "x")
    assert alloc(eng, "b", toks(9)).num_cached_tokens == 0


def test_one_eviction_pass_is_one_removal_event(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=3)
    cached(eng, "a", toks(9))
    keys = list(eng._namespaces[""].index)
    eng.drain_events()
    alloc(eng, "x", toks(12, start=500))
    assert eng.drain_events() == [BlockRemoved(keys[::-1])]


def test_evictions_are_counted(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=3)
    cached(eng, "a", toks(9))
    alloc(eng, "x", toks(12, start=500))
    assert eng.stats().evictions == 2


def test_hits_are_pulled_off_the_queue(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=6)
    a = cached(eng, "a", toks(9))
    alloc(eng, "b", toks(5))
    assert lru(eng) == [a.table[1]]


def test_a_pool_too_small_for_the_prompt_refuses(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=2)
    assert isinstance(eng.allocate(1, "a", toks(9)), Refusal)
