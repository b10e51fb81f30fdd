"""The adaptive eviction policy: its shadow caches and the order they pick."""

from __future__ import annotations

from kvd.engine import adaptive
from kvd.engine.adaptive import MAX_KEYS, MIN_KEYS, SAMPLE, AdaptivePool, Shadows
from kvd.engine.frequency import CLASSES, WEIGHT
from kvd.engine.prefix_index import PrefixIndex

from .test_frequency import cache, key


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


def test_a_use_of_a_key_in_a_shadow_is_its_hit() -> None:
    shadows = Shadows(4)
    shadows.refer(key(1), 1, 0)
    assert shadows.hits == [0, 0]
    shadows.refer(key(1), 2, 1)
    assert shadows.hits == [1, 1]
    assert shadows.where == {key(1): 2}


def test_the_lru_shadow_drops_the_least_recent_key_the_weighted_one_the_least_used() -> None:
    shadows = Shadows(2)
    shadows.refer(key(1), 1, 0)
    shadows.refer(key(1), 2, 1)  # key 1: used twice, least recent
    shadows.refer(key(2), 1, 2)
    shadows.refer(key(3), 1, 3)
    assert list(shadows.lru) == [key(2), key(3)]
    assert set(shadows.where) == {key(1), key(3)}
    problems: list[str] = []
    shadows.check(problems)
    assert problems == []


def test_the_hits_halve_every_decay_uses(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(adaptive, "DECAY", 4)
    shadows = Shadows(4)
    for clock in range(4):
        shadows.refer(key(1), 1, clock)
    assert shadows.hits == [1, 1] and shadows.refs == 0


def test_the_pool_starts_in_lru_order() -> None:
    pool, index = AdaptivePool(2), PrefixIndex()
    a, b = pool.take(2, [])
    cache(pool, index, [a, b], [key(1), key(2)])
    pool.match([a])  # a: 2 uses but released first
    pool.release([a, a])
    pool.match([])
    pool.release([b])
    assert not pool.weighted and weights(pool) == [1] * CLASSES
    assert pool.take(1, []) == [a]


def test_the_shadows_see_releases_in_the_pools_order_not_matches() -> None:
    pool, index = AdaptivePool(3), PrefixIndex()  # shadows of 3 keys, every key sampled
    head, tail, private = pool.take(3, [])
    cache(pool, index, [head, tail], [key(1), key(2)])
    pool.match([head, tail])
    assert pool.shadows.refs == 0
    pool.release(reversed([head, tail, private]))  # tail first; the unkeyed one is no use
    assert list(pool.shadows.lru) == [key(2), key(1)] and pool.shadows.refs == 2
    assert pool.shadows.where == {key(2): 2, key(1): 2}


def test_the_pool_weighs_uses_while_the_weighted_shadow_hits_more() -> None:
    pool, index = AdaptivePool(3), PrefixIndex()  # shadows of 3 keys, every key sampled
    (a,) = pool.take(1, [])
    cache(pool, index, [a], [key(1)])
    for _ in range(3):
        pool.match([a])  # 4 uses
    pool.release([a] * 4)  # 4 holders: a hit in both shadows after the first
    for i in range(2, 6):  # one-use keys push key 1 out of the pool and the LRU shadow
        blocks = pool.take(1, [])
        cache(pool, index, blocks, [key(i)])
        pool.match([])
        pool.release(blocks)
    assert key(1) not in index and pool.shadows.hits == [3, 3] and not pool.weighted
    blocks = pool.take(1, [])
    cache(pool, index, blocks, [key(1)])
    pool.release(blocks)  # a hit in the weighted shadow only
    assert pool.shadows.hits == [3, 4]
    assert pool.weighted and weights(pool) == WEIGHT[1:]
    problems: list[str] = []
    pool.check(problems)
    assert problems == []


def test_check_notices_weights_that_do_not_follow_the_shadows() -> None:
    pool = AdaptivePool(4)
    pool._weigh(WEIGHT)
    problems: list[str] = []
    pool.check(problems)
    assert problems == ["the eviction weights do not follow the shadows"]
