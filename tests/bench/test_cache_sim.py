"""The trace expansion and the cache simulators of bench/cache_sim.py, on tiny traces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.cache_sim import (
    BLOCK,
    PER_ID,
    POLICIES,
    Trace,
    TraceError,
    TraceRequest,
    expand_tokens,
    load_trace,
    simulate_lru,
    simulate_optimum,
)
from bench.replay import replay_kvd


def req(length: int, *ids: int) -> TraceRequest:
    return TraceRequest(length, ids)


def write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_load_trace_reads_length_and_ids(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 600, "hash_ids": [3, 4]}])
    assert load_trace(path) == [TraceRequest(600, (3, 4))]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{", "not JSON"),
        ("[]", "expected an object"),
        ('{"input_length": 0, "hash_ids": []}', "input_length"),
        ('{"input_length": 600, "hash_ids": [1]}', "expected ceil"),
        ('{"input_length": 10, "hash_ids": [-1]}', "non-negative"),
    ],
)
def test_load_trace_names_the_bad_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 10, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=rf"bad.jsonl:2: .*{message}"):
        load_trace(path)


def test_expand_tokens_cuts_to_length_and_follows_ids() -> None:
    tokens = expand_tokens(req(600, 2, 7))
    assert tokens.dtype == np.int32
    assert tokens.shape == (600,)
    assert tokens[:512].tolist() == list(range(1024, 1536))
    assert tokens[512:].tolist() == list(range(7 * 512, 7 * 512 + 88))


def test_trace_keys_cover_full_blocks_and_share_common_prefixes() -> None:
    trace = Trace.from_requests([req(600, 1, 2), req(1030, 1, 2, 3), req(40, 9)])
    assert trace.blocks == (38, 65, 3)  # ceil(len / 16)
    assert [len(k) for k in trace.keys] == [37, 64, 2]  # full blocks only
    assert trace.keys[1][:37] == trace.keys[0]
    assert set(trace.keys[2]).isdisjoint(trace.keys[0])


def test_trace_keys_tell_one_id_after_two_parents_apart() -> None:
    trace = Trace.from_requests([req(1024, 1, 5), req(1024, 2, 5)])
    assert set(trace.keys[0][PER_ID:]).isdisjoint(trace.keys[1][PER_ID:])


def test_lru_hits_the_cached_prefix_and_caps_before_the_last_token() -> None:
    trace = Trace.from_requests([req(64, 1), req(80, 1), req(64, 1)])
    out = simulate_lru(trace, 100)
    # 2nd: 4 cached blocks of 5 full; 3rd: 4 cached but capped at (64 - 1) // 16 = 3.
    assert out.hit_tokens == (4 + 3) * BLOCK
    assert out.total_tokens == 64 + 80 + 64


def test_lru_evicts_least_recently_released_tail_first() -> None:
    # Capacity 7: a holds 4 keyed blocks + 1 partial; b fits in the free room; c
    # needs 3 more and evicts a's blocks 3, 2, 1 (tail first): a's head survives.
    trace = Trace.from_requests([req(65, 1), req(33, 2), req(49, 3), req(65, 1)])
    assert simulate_lru(trace, 7).hit_tokens == 1 * BLOCK


def test_requests_larger_than_the_cache_are_refused_misses() -> None:
    trace = Trace.from_requests([req(100, 1), req(100, 1)])
    for simulate in (simulate_lru, simulate_optimum):
        out = simulate(trace, 6)
        assert (out.refused, out.hit_tokens) == (2, 0)


def test_lru_keeps_vllms_duplicate_of_a_cached_key() -> None:
    # The 16-token request's only block is a's block 0 but its hit is capped at 0
    # blocks: vLLM indexes the recomputed copy beside the original, taking the
    # last free block, so c must evict two of a's blocks; kvd keeps the copy private
    # (free again), evicts one, and the last request hits one block more.
    trace = Trace.from_requests([req(64, 2), req(16, 2), req(32, 0), req(64, 2)])
    assert simulate_lru(trace, 5, duplicates=True).hit_tokens == 2 * BLOCK
    assert simulate_lru(trace, 5, duplicates=False).hit_tokens == 3 * BLOCK


def test_optimum_keeps_the_block_used_soonest() -> None:
    # Room for two keyed blocks and a partial one: LRU evicts a for c, the
    # optimum evicts b, never used again, and a hits.
    trace = Trace.from_requests([req(17, 1), req(17, 2), req(17, 3), req(17, 1)])
    assert simulate_lru(trace, 3).hit_tokens == 0
    assert simulate_optimum(trace, 3).hit_tokens == BLOCK


def test_every_simulator_matches_an_infinite_cache_when_nothing_is_evicted() -> None:
    trace = Trace.from_requests([req(300, 1), req(700, 1, 2), req(300, 1), req(20, 3)])
    roomy = sum(trace.blocks)
    expected = simulate_lru(trace, roomy).hit_tokens
    assert expected == (18 + 18) * BLOCK
    for simulate in (simulate_optimum, *POLICIES.values()):
        assert simulate(trace, roomy).hit_tokens == expected


traces = st.lists(
    st.tuples(
        st.lists(st.integers(0, 3), min_size=1, max_size=3),
        st.integers(1, 31),
    ),
    min_size=1,
    max_size=25,
).map(
    lambda reqs: Trace.from_requests(
        [
            # Each id extends its parent's chain; lengths avoid multiples of 16 so
            # that the hit cap never hides a resident block.
            TraceRequest((len(ids) - 1) * 512 + 16 * tail + 7, tuple(ids))
            for ids, tail in reqs
        ]
    )
)


@settings(max_examples=60, deadline=None)
@given(trace=traces, capacity=st.integers(1, 90))
def test_the_optimum_is_never_beaten(trace: Trace, capacity: int) -> None:
    best = simulate_optimum(trace, capacity).hit_tokens
    assert simulate_lru(trace, capacity).hit_tokens <= best
    for simulate in POLICIES.values():
        assert simulate(trace, capacity).hit_tokens <= best


@settings(max_examples=15, deadline=None)
@given(trace=traces, capacity=st.integers(33, 90))
def test_kvds_engine_evicts_exactly_like_the_lru_simulation(trace: Trace, capacity: int) -> None:
    engine = replay_kvd(trace, capacity, eviction="lru")
    assert engine.hit_tokens == simulate_lru(trace, capacity, duplicates=False).hit_tokens
    assert engine.refused == simulate_lru(trace, capacity).refused


@settings(max_examples=15, deadline=None)
@given(trace=traces, capacity=st.integers(33, 90))
def test_kvds_default_eviction_never_beats_the_optimum(trace: Trace, capacity: int) -> None:
    engine = replay_kvd(trace, capacity)
    assert engine.hit_tokens <= simulate_optimum(trace, capacity).hit_tokens
    assert engine.refused == simulate_lru(trace, capacity).refused
