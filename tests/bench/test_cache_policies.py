"""The eviction candidates of bench/cache_policies.py, the workloads and the tier model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.cache_policies import (
    LRU,
    PROTOTYPES,
    EngineAdaptive,
    EngineFrequency,
    engine_keys,
    run_policy,
)
from bench.cache_sim import BLOCK, TRACE_BLOCK, Trace, TraceRequest, simulate_optimum
from bench.cache_tier import ADMISSION, simulate_tier
from bench.cache_workloads import WORKLOADS
from bench.replay import replay_kvd

traces = st.lists(
    st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=3), st.integers(0, 31)),
    min_size=1,
    max_size=25,
).map(
    # Any length, multiples of 16 included: the capped last block is then cached
    # already and the engine keeps the request's copy private.
    lambda reqs: Trace.from_requests(
        [TraceRequest((len(ids) - 1) * 512 + 16 * tail + 16, tuple(ids)) for ids, tail in reqs]
    )
)


@settings(max_examples=15, deadline=None)
@given(trace=traces, capacity=st.integers(33, 90))
def test_the_engine_faithful_simulations_equal_kvds_engine(trace: Trace, capacity: int) -> None:
    assert run_policy(trace, capacity, LRU(capacity)).hit_tokens == (
        replay_kvd(trace, capacity, eviction="lru").hit_tokens
    )
    digests = engine_keys(trace)
    for policy, simulated in (("frequency", EngineFrequency), ("adaptive", EngineAdaptive)):
        assert run_policy(trace, capacity, simulated(capacity, digests)).hit_tokens == (
            replay_kvd(trace, capacity, eviction=policy).hit_tokens
        )


@settings(max_examples=40, deadline=None)
@given(trace=traces, capacity=st.integers(1, 90))
def test_no_prototype_beats_the_optimum(trace: Trace, capacity: int) -> None:
    best = simulate_optimum(trace, capacity).hit_tokens
    for make in PROTOTYPES.values():
        assert run_policy(trace, capacity, make(capacity)).hit_tokens <= best


def test_every_prototype_hits_like_an_infinite_cache_when_nothing_is_evicted() -> None:
    trace = Trace.from_requests([TraceRequest(300, (1,)), TraceRequest(700, (1, 2))] * 2)
    roomy = sum(trace.blocks)
    expected = run_policy(trace, roomy, LRU(roomy)).hit_tokens
    assert expected > 0
    for make in PROTOTYPES.values():
        assert run_policy(trace, roomy, make(roomy)).hit_tokens == expected


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_workload_is_deterministic_and_well_formed(name: str) -> None:
    requests = WORKLOADS[name](3)
    assert requests == WORKLOADS[name](3)
    for r in requests:
        assert len(r.hash_ids) == -(-r.input_length // TRACE_BLOCK)
        assert max(r.hash_ids) < 4_194_303


def test_a_prefix_evicted_from_the_pool_is_found_in_the_tier() -> None:
    # Pool of 40 blocks: b (38 blocks) evicts 35 of a's 37 cached blocks, tail
    # first; a comes back.
    trace = Trace.from_requests(
        [TraceRequest(600, (1, 2)), TraceRequest(600, (3, 4)), TraceRequest(600, (1, 2))]
    )
    pool_only, moved = simulate_tier(trace, 40, 160, ADMISSION["none"])
    assert (pool_only.hit_tokens, moved) == (2 * BLOCK, 0)
    tiered, moved = simulate_tier(trace, 40, 160, ADMISSION["all"])
    assert tiered.hit_tokens == (600 - 1) // BLOCK * BLOCK
    assert moved > 0
