"""The adaptive eviction policy: its shadow caches, the order they pick and its counts."""

from __future__ import annotations

import hashlib

import pytest

from kvd.engine import adaptive
from kvd.engine.adaptive import (
    LEAVE,
    MAX_KEYS,
    MIN_KEYS,
    ORDERS,
    RETURN,
    SAMPLE,
    AdaptivePool,
    Shadows,
)
from kvd.engine.frequency import CLASSES, WEIGHT, FrequencyPool
from kvd.engine.prefix_index import PrefixIndex

from .test_frequency import cache, classes, key


def weights(pool: AdaptivePool) -> list[int]:
    return [w for _, _, w in pool.ends]


def test_the_sample_keeps_the_shadows_near_their_size() -> None:
    small = Shadows(100)  # below MIN_KEYS blocks: every key, the pool's size
    assert (small.every, small.size) == (1, 100) and small.sampled(key(5))
    assert (Shadows(MIN_KEYS * SAMPLE).every, Shadows(MIN_KEYS * SAMPLE).size) == (SAMPLE, MIN_KEYS)
    mid = Shadows(1_000 * SAMPLE)  # 1 key in SAMPLE
    assert (mid.every, mid.size) == (SAMPLE, 1_000)
    big = Shadows(1_000_000)
    assert big.every == 1_000_000 // MAX_KEYS
    assert MAX_KEYS <= big.size < MAX_KEYS + 2


def test_a_key_is_sampled_by_its_digest_bytes_8_to_11() -> None:
    shadows = Shadows(4 * MIN_KEYS)  # 1 in 4
    assert shadows.sampled(bytes(8) + (8).to_bytes(4, "little") + bytes(20))
    assert not shadows.sampled(bytes(8) + (9).to_bytes(4, "little") + bytes(20))


def test_another_offset_samples_by_other_digest_bytes() -> None:
    shadows = Shadows(4 * MIN_KEYS, offset=16)
    assert shadows.sampled(bytes(16) + (8).to_bytes(4, "little") + bytes(12))
    bytes_8_to_11_sampled = bytes(8) + (8).to_bytes(4, "little") + bytes(4)
    assert not shadows.sampled(bytes_8_to_11_sampled + (9).to_bytes(4, "little") + bytes(12))


def test_a_use_of_a_key_in_a_shadow_is_its_hit() -> None:
    shadows = Shadows(4)
    shadows.refer(key(1), 1, 0)
    assert shadows.hits == [0, 0, 0]
    shadows.refer(key(1), 2, 1)
    assert shadows.averages() == ([1, 1, 1], [0, 0, 0])
    assert [w.where for w in shadows.weighted] == [{key(1): 2}] * 2


def test_each_shadow_drops_the_key_its_order_evicts_first() -> None:
    shadows = Shadows(2)
    shadows.refer(key(1), 2, 0)  # used twice, 6 ticks old when key 3 comes
    shadows.refer(key(2), 1, 5)  # used once, 1 tick old
    shadows.refer(key(3), 1, 5)
    assert list(shadows.lru) == [key(2), key(3)]
    squared, cubed = shadows.weighted
    assert set(squared.where) == {key(2), key(3)}  # 6 / 2² > 1 / 1²
    assert set(cubed.where) == {key(1), key(3)}  # 6 / 2³ < 1 / 1³
    shadows.refer(key(1), 3, 6)  # a hit in the cubed shadow only
    assert shadows.averages() == ([0, 0, 1], [0, 1, 1])
    problems: list[str] = []
    shadows.check(problems)
    assert problems == []


def test_the_hits_average_over_a_window_of_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adaptive, "WINDOW", 2)  # each use halves the averages first
    shadows = Shadows(4)
    for clock in range(3):
        shadows.refer(key(1), 1, clock)
    assert shadows.averages()[0] == [1.5, 1.5, 1.5]


def test_leaving_lru_takes_a_lead_beyond_the_noise_of_the_uses_that_differ() -> None:
    shadows = Shadows(4)
    shadows.hits, shadows.apart = [10.0, 12.0, 11.0], [9.0, 9.0, 1.0]
    assert shadows.choose(0) == 0  # lead 2, not above LEAVE * 3
    shadows.hits[1] = 10 + LEAVE * 3 + 0.5
    assert shadows.choose(0) == 1


def test_going_back_to_lru_takes_a_lead_of_more_than_return() -> None:
    shadows = Shadows(4)
    shadows.hits = [10 + RETURN, 10.0, 10.0]
    assert shadows.choose(1) == 1 and shadows.choose(2) == 2
    shadows.hits[0] += 0.5
    assert shadows.choose(1) == 0 and shadows.choose(2) == 0


def test_between_use_count_orders_any_lead_moves_a_tie_stays() -> None:
    shadows = Shadows(4)
    shadows.hits = [0.0, 5.0, 5.5]
    assert shadows.choose(1) == 2
    shadows.hits = [0.0, 5.0, 5.0]
    assert shadows.choose(1) == 1 and shadows.choose(2) == 2
    assert shadows.choose(0) == 2  # leaving LRU on a tie of the others: uses³
    shadows.hits = [5.0, 5.0, 5.0]
    assert shadows.choose(0) == 0


def test_the_pool_starts_in_lru_order() -> None:
    pool, index = AdaptivePool(2), PrefixIndex()
    a, b = pool.take(2, [])
    cache(pool, index, [a, b], [key(1), key(2)])
    pool.match([a])  # a: 2 uses but released first
    pool.release([a, a])
    pool.match([])
    pool.release([b])
    assert pool.order == 0 and weights(pool) == [1] * CLASSES
    assert pool.take(1, []) == [a]


def test_a_count_above_an_ancestors_is_lowered_at_release() -> None:
    pool, index = AdaptivePool(4), PrefixIndex()
    blocks = pool.take(4, [])
    cache(pool, index, blocks, [key(i) for i in range(4)])
    for block, uses in zip(blocks, [2, 3, 1, 2], strict=True):
        pool.uses[block.block_id] = uses  # as sampled remembered counts could be
    pool.release(reversed(blocks))
    assert [pool.uses[b.block_id] for b in blocks] == [2, 2, 1, 1]
    # In LRU's order the chain goes tail first, as LRU evicts it.
    assert pool.take(4, []) == blocks[::-1]


def test_a_release_queues_and_frees_in_frequencys_order() -> None:
    # Counts that never rise towards the tail (nothing to lower), some blocks
    # still held elsewhere, some unkeyed: the one head-first pass must leave
    # every queue and the free stack as FrequencyPool's release does.
    pools = AdaptivePool(12), FrequencyPool(12)
    for pool in pools:
        index = PrefixIndex()
        blocks = pool.take(12, [])
        cache(pool, index, blocks[:9], [key(i) for i in range(9)])
        for block, uses in zip(blocks, [5, 5, 3, 3, 3, 2, 1, 1, 1], strict=False):
            pool.uses[block.block_id] = uses
        pool.touch([blocks[1], blocks[4]])  # held by another sequence too
        pool.release(reversed(blocks))
    adaptive_pool, frequency_pool = pools
    assert classes(adaptive_pool) == classes(frequency_pool)
    assert [b.block_id for b in adaptive_pool.free] == [b.block_id for b in frequency_pool.free]
    assert adaptive_pool.evictable == frequency_pool.evictable == 7


def test_a_keys_sampling_test_is_taken_when_it_is_published() -> None:
    pool, index = AdaptivePool(4 * MIN_KEYS), PrefixIndex()  # 1 in 4 sampled
    a, b = pool.take(2, [])
    sampled, unsampled = (bytes(8) + (n).to_bytes(4, "little") + bytes(20) for n in (8, 9))
    cache(pool, index, [a, b], [sampled, unsampled])
    assert (pool.sampled[a.block_id], pool.sampled[b.block_id]) == (1, 0)
    pool.release([b, a])
    assert list(pool.shadows.lru) == [sampled]


def test_sampled_all_is_sampled_of_each_key() -> None:
    keys = [hashlib.sha256(bytes([i % 256, i // 256])).digest() for i in range(1000)]
    for shadows in (Shadows(48 * MAX_KEYS), Shadows(4 * MIN_KEYS, offset=16)):
        flags = shadows.sampled_all(keys)
        assert flags == [shadows.sampled(k) for k in keys] and 0 < sum(flags) < len(keys)


def test_a_long_run_is_tested_in_one_pass_with_the_same_flags() -> None:
    n = 2 * adaptive._VECTOR_MIN
    pool, index = AdaptivePool(48 * MAX_KEYS), PrefixIndex()
    blocks = pool.take(n, [])
    keys = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(n)]
    cache(pool, index, blocks, keys)
    assert [pool.sampled[b.block_id] for b in blocks] == [pool.shadows.sampled(k) for k in keys]
    problems: list[str] = []
    pool.check(problems)
    assert problems == []


def test_check_notices_a_sampling_flag_that_is_not_its_keys() -> None:
    pool, index = AdaptivePool(4), PrefixIndex()  # every key sampled
    (a,) = pool.take(1, [])
    cache(pool, index, [a], [key(1)])
    pool.sampled[a.block_id] = 0
    problems: list[str] = []
    pool.check(problems)
    assert problems == ["a keyed block's sampling flag is not its key's"]


def test_the_shadows_see_releases_in_the_pools_order_not_matches() -> None:
    pool, index = AdaptivePool(3), PrefixIndex()  # shadows of 3 keys, every key sampled
    head, tail, private = pool.take(3, [])
    cache(pool, index, [head, tail], [key(1), key(2)])
    pool.match([head, tail])
    assert pool.shadows.lru == {}
    pool.release(reversed([head, tail, private]))  # tail first; the unkeyed one is no use
    assert list(pool.shadows.lru) == [key(2), key(1)]
    assert [w.where for w in pool.shadows.weighted] == [{key(2): 2, key(1): 2}] * 2


def test_the_pool_evicts_in_the_order_its_shadows_choose_after_each_release() -> None:
    pool, index = AdaptivePool(3), PrefixIndex()  # shadows of 3 keys, every key sampled

    def release_one(i: int) -> None:
        blocks = pool.take(1, [])
        cache(pool, index, blocks, [key(i)])
        pool.match([])
        pool.release(blocks)

    pool.shadows.hits, pool.shadows.apart = [0.0, 10.0, 10.0], [10.0, 10.0, 0.0]
    release_one(1)
    assert pool.order == 2 and weights(pool) == ORDERS[2][1:]
    pool.shadows.hits = [30.0, 10.0, 10.0]
    release_one(2)
    assert pool.order == 0 and weights(pool) == [1] * CLASSES
    problems: list[str] = []
    pool.check(problems)
    assert problems == []


def test_check_notices_weights_that_do_not_follow_the_shadows() -> None:
    pool = AdaptivePool(4)
    pool._weigh(WEIGHT)
    problems: list[str] = []
    pool.check(problems)
    assert problems == ["the eviction weights do not follow the shadows"]


def test_bringing_the_unit_back_keeps_the_averages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adaptive, "WINDOW", 2)
    monkeypatch.setattr(adaptive, "_RESCALE", 5.0)  # every third use or so
    shadows = Shadows(4)
    expected = 0.0
    for clock in range(10):
        shadows.refer(key(1), 1, clock)
        expected = expected / 2 + (clock > 0)
    assert shadows.unit < 5.0
    assert shadows.averages()[0] == pytest.approx([expected] * 3)
