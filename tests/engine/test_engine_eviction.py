"""Engine: eviction order and what an evicted block loses."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvd.engine import Allocation, BlockRemoved, Refusal
from kvd.engine.config import EVICTION_POLICIES
from kvd.engine.frequency import FrequencyPool, UseTable

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


Make = Callable[[int], Checked]


def lru(eng: Checked) -> list[int]:
    """The evictable blocks, queue by queue (one class of one-use blocks here)."""
    return [b.block_id for q in eng._pool.queues() for b in q]


@pytest.fixture(params=EVICTION_POLICIES)
def make(request: pytest.FixtureRequest, make_engine: MakeEngine) -> Make:
    """`make_engine` for each eviction policy: these rules hold for both."""

    def build(num_blocks: int) -> Checked:
        return make_engine(num_blocks=num_blocks, eviction=request.param)

    return build


def test_free_blocks_are_used_before_cached_ones(make: Make) -> None:
    eng = make(8)
    a = cached(eng, "a", toks(9))
    b = alloc(eng, "b", toks(20, start=100))
    assert not set(b.table) & set(a.table[:2])
    assert eng.stats().evictions == 0


def test_the_least_recently_released_block_goes_first(make: Make) -> None:
    eng = make(6)
    a = cached(eng, "a", toks(5))
    b = cached(eng, "b", toks(5, start=100))
    alloc(eng, "x", toks(17, start=500))  # 5 blocks: 4 free + 1 evicted
    evicted = {i for i in (a.table[0], b.table[0]) if eng._pool.blocks[i].key is None}
    assert evicted == {a.table[0]}


def test_a_chain_is_evicted_tail_first(make: Make) -> None:
    eng = make(4)
    a = cached(eng, "a", toks(13))  # 3 cached blocks + 1 free
    assert lru(eng) == a.table[2::-1]
    alloc(eng, "x", toks(6, start=500))  # 2 blocks: 1 free + the tail
    assert eng._pool.blocks[a.table[2]].key is None
    eng.free(1, "x")
    assert alloc(eng, "y", toks(13)).num_cached_tokens == 8


def test_a_request_never_evicts_its_own_hits(make: Make) -> None:
    eng = make(4)
    a = cached(eng, "a", toks(5))  # block 0 cached, released first
    cached(eng, "c", toks(12, start=100))
    assert lru(eng)[0] == a.table[0]  # the hit-to-be is next in line
    r = alloc(eng, "b", toks(9))  # hits block 0, needs 2 more: both evicted
    assert r.num_cached_tokens == 4
    assert r.table[0] == a.table[0]
    assert eng.stats().evictions == 2


def test_an_evicted_block_loses_its_key_at_once(make: Make) -> None:
    eng = make(3)
    a = cached(eng, "a", toks(9))
    alloc(eng, "x", toks(12, start=500))
    for bid in a.table[:2]:
        assert eng._pool.blocks[bid].key is None
    assert len(eng._accounts.namespaces[""].index) == 0
    eng.free(1, "x")
    assert alloc(eng, "b", toks(9)).num_cached_tokens == 0


def test_one_eviction_pass_is_one_removal_event(make: Make) -> None:
    eng = make(3)
    cached(eng, "a", toks(9))
    keys = list(eng._accounts.namespaces[""].index)
    eng.drain_events()
    alloc(eng, "x", toks(12, start=500))
    assert eng.drain_events() == [BlockRemoved(keys[::-1])]


def test_evictions_are_counted(make: Make) -> None:
    eng = make(3)
    cached(eng, "a", toks(9))
    alloc(eng, "x", toks(12, start=500))
    assert eng.stats().evictions == 2


def test_hits_are_pulled_off_the_queue(make: Make) -> None:
    eng = make(6)
    a = cached(eng, "a", toks(9))
    alloc(eng, "b", toks(5))
    assert lru(eng) == [a.table[1]]


def test_a_pool_too_small_for_the_prompt_refuses(make: Make) -> None:
    eng = make(2)
    assert isinstance(eng.allocate(1, "a", toks(9)), Refusal)


def hit_again(eng: Checked, seq: str, tokens: np.ndarray) -> None:
    """Allocate ``tokens`` again (a prefix hit: one more use), commit and free."""
    assert cached(eng, seq, tokens).num_cached_tokens > 0


@pytest.mark.parametrize(("eviction", "survivor"), [("frequency", "a"), ("lru", "b")])
def test_a_block_used_twice_outlives_a_one_use_block_only_under_frequency(
    make_engine: MakeEngine, eviction: str, survivor: str
) -> None:
    eng = make_engine(num_blocks=4, eviction=eviction)
    a = cached(eng, "a", toks(5))
    hit_again(eng, "a2", toks(5))  # a's block: 2 uses, released 2 allocations ago
    b = cached(eng, "b", toks(5, start=100))  # 1 use, released last
    alloc(eng, "x", toks(12, start=500))  # 3 blocks: 2 free + 1 evicted
    kept = {name for name, r in (("a", a), ("b", b)) if eng._pool.blocks[r.table[0]].key}
    assert kept == {survivor}


def sampled_prompt(eng: Checked) -> np.ndarray:
    """5 tokens whose first block's key the use table remembers."""
    for start in range(0, 10_000, 5):
        tokens = toks(5, start=start)
        if UseTable.sampled(eng._hasher.keys(tokens[:4], None)[0]):
            return tokens
    raise AssertionError("no sampled key in 2,000 prompts")


def test_a_use_count_survives_the_eviction_of_its_block(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=2, eviction="frequency")
    tokens = sampled_prompt(eng)
    cached(eng, "a", tokens)
    hit_again(eng, "a2", tokens)  # 2 uses
    cached(eng, "x", toks(8, start=tokens[-1] + 1))  # evicts it
    r = cached(eng, "a3", tokens)
    assert r.num_cached_tokens == 0
    pool = eng._pool
    assert isinstance(pool, FrequencyPool)
    assert pool.uses[r.table[0]] == 3
