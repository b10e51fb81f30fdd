"""The frequency eviction policy: its use table and pool (engine level: test_engine_eviction;
the adaptive pool's own parts: test_frequency_adaptive)."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.engine.adaptive import AdaptivePool
from kvd.engine.block import Block
from kvd.engine.frequency import CLASSES, FrequencyPool, UseTable
from kvd.engine.prefix_index import PrefixIndex


def key(i: int, sampled: bool = False) -> bytes:
    """A 32-byte key whose first byte makes it sampled (0) or not (1)."""
    return bytes([0 if sampled else 1]) + i.to_bytes(31, "little")


def cache(pool: FrequencyPool, index: PrefixIndex, blocks: list[Block], keys: list[bytes]) -> None:
    """Key ``blocks`` (one published run, in chain order) as a commit does."""
    for block, k in zip(blocks, keys, strict=True):
        block.key = k
        block.index = index
        index[k] = block
    pool.publish(blocks)


def classes(pool: FrequencyPool) -> list[list[int]]:
    return [[b.block_id for b in q] for q in pool.queues()]


def test_a_key_is_sampled_by_its_first_byte() -> None:
    assert UseTable.sampled(key(5, sampled=True))
    assert not UseTable.sampled(key(5))


def test_a_key_never_remembered_recalls_zero() -> None:
    assert UseTable(100).recall(key(1, sampled=True)) == 0


def test_a_remembered_count_is_recalled_and_never_lowered() -> None:
    table = UseTable(100)
    k = key(1, sampled=True)
    table.remember(k, 5)
    table.remember(k, 2)
    assert table.recall(k) == 5


def test_the_table_halves_once_it_took_as_many_keys_as_counters() -> None:
    table = UseTable(16)
    k = key(1, sampled=True)
    table.remember(k, 6)
    for i in range(2, table.size + 1):
        table.remember(key(i, sampled=True), 1)
    assert table.writes == 0
    assert table.recall(k) == 3


def test_published_blocks_start_with_one_use() -> None:
    pool, index = FrequencyPool(4), PrefixIndex()
    blocks = pool.take(2, [])
    cache(pool, index, blocks, [key(1), key(2)])
    assert [pool.uses[b.block_id] for b in blocks] == [1, 1]


def test_a_sampled_descendant_lends_its_remembered_count_to_the_blocks_before_it() -> None:
    pool, index = FrequencyPool(4), PrefixIndex()
    pool.table.remember(key(2, sampled=True), 4)
    blocks = pool.take(3, [])
    cache(pool, index, blocks, [key(1), key(2, sampled=True), key(3)])
    assert [pool.uses[b.block_id] for b in blocks] == [5, 5, 1]


def test_a_match_adds_a_use_up_to_the_saturation() -> None:
    pool, index = FrequencyPool(2), PrefixIndex()
    (a,) = pool.take(1, [])
    cache(pool, index, [a], [key(1)])
    for _ in range(CLASSES + 2):
        pool.match([a])
    assert pool.uses[a.block_id] == CLASSES
    assert a.ref == CLASSES + 3


def test_release_queues_a_block_by_its_uses_in_release_order() -> None:
    pool, index = FrequencyPool(4), PrefixIndex()
    a, b, c = pool.take(3, [])
    cache(pool, index, [a, b, c], [key(1), key(2), key(3)])
    pool.match([b])
    pool.release([c, b, a, b])
    assert classes(pool)[:2] == [[c.block_id, a.block_id], [b.block_id]]
    assert pool.evictable == 3
    assert pool.stamps[a.block_id] == pool.clock


def test_a_match_pulls_an_evictable_block_off_its_queue() -> None:
    pool, index = FrequencyPool(2), PrefixIndex()
    (a,) = pool.take(1, [])
    cache(pool, index, [a], [key(1)])
    pool.release([a])
    pool.match([a])
    assert pool.evictable == 0 and classes(pool) == [[]] * CLASSES


def test_eviction_takes_the_head_oldest_in_units_of_uses_squared() -> None:
    pool, index = FrequencyPool(2), PrefixIndex()
    a, b = pool.take(2, [])
    cache(pool, index, [a, b], [key(1), key(2)])
    pool.match([a])  # a: 2 uses, released at clock 1: age 3 at clock 3, scaled 3 / 4
    pool.release([a, a])
    pool.match([])
    pool.release([b])  # 1 use, released at clock 2: age 2, scaled 2 / 1
    pool.match([])
    assert pool.take(1, []) == [b]


def test_a_tie_evicts_from_the_lower_class() -> None:
    pool, index = FrequencyPool(2), PrefixIndex()
    a, b = pool.take(2, [])
    cache(pool, index, [a, b], [key(1), key(2)])
    pool.match([a])  # a: 2 uses, released 3 ticks before b: ages 4 / 4 == 1 / 1
    pool.release([a, a])
    for _ in range(3):
        pool.match([])
    pool.release([b])
    assert pool.take(1, []) == [b]


def test_a_run_from_one_queue_stops_at_a_tie_with_a_lower_class() -> None:
    pool, index = FrequencyPool(3), PrefixIndex()
    a, b, x = pool.take(3, [])
    cache(pool, index, [a, b, x], [key(1), key(2), key(3)])
    pool.match([a, b])  # 2 uses each; the clock is 1
    pool.release([a, a])
    for _ in range(4):
        pool.match([])
    pool.release([b, b])
    for _ in range(3):
        pool.match([])
    pool.release([x])
    # At clock 8 the ages are a 8, b 4, x 1: a scales to 2 and goes first,
    # then b's 4 / 4 ties x's 1 / 1 and the lower class goes.
    assert pool.take(3, []) == [a, x, b]


def test_an_evicted_sampled_key_leaves_its_count_in_the_table() -> None:
    pool, index = FrequencyPool(1), PrefixIndex()
    (a,) = pool.take(1, [])
    k = key(7, sampled=True)
    cache(pool, index, [a], [k])
    pool.match([a])
    pool.match([a])
    pool.release([a, a, a])
    removed: list[bytes] = []
    pool.take(1, removed)
    assert removed == [k]
    assert pool.table.recall(k) == 3
    assert a.key is None


def test_drop_key_frees_an_evictable_block_at_once() -> None:
    pool, index = FrequencyPool(2), PrefixIndex()
    (a,) = pool.take(1, [])
    cache(pool, index, [a], [key(1)])
    pool.release([a])
    pool.drop_key(a)
    assert a in pool.free and pool.evictable == 0 and classes(pool) == [[]] * CLASSES
    problems: list[str] = []
    pool.check(problems)
    assert problems == []


#: The power of uses dividing the age in each of an adaptive pool's `ORDERS`.
ORDERS_POWER = (0, 2, 3)


def reference_victims(pool: FrequencyPool, n: int) -> list[Block]:
    """The next ``n`` victims by the policy's definition, one block at a time:
    the queue head with the largest age / uses² (the lowest class on a tie),
    or, in an adaptive pool, age in its order (alone, / uses², / uses³)."""
    queues = [list(q) for q in pool.queues()]
    power = ORDERS_POWER[pool.order] if isinstance(pool, AdaptivePool) else 2
    out: list[Block] = []
    for _ in range(n):
        scores = [
            Fraction(pool.clock - pool.stamps[q[0].block_id] + 1, c**power) if q else Fraction(-1)
            for c, q in enumerate(queues, 1)
        ]
        out.append(queues[scores.index(max(scores))].pop(0))
    return out


#: Allocations on a small pool: (ticks, hits, new blocks, sampled, kept), each
#: after ``ticks`` allocations that hit nothing and take nothing (the clock
#: ticks). Each matches up to ``hits`` cached blocks (more uses), takes the new
#: blocks (evicting), publishes them (every other key sampled if asked) and,
#: unless kept, releases them all at once, last first; a kept allocation
#: releases the oldest kept one.
allocations = st.lists(
    st.tuples(
        st.integers(0, 6), st.integers(0, 3), st.integers(0, 6), st.booleans(), st.booleans()
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(allocations=allocations, policy=st.sampled_from([FrequencyPool, AdaptivePool]))
def test_eviction_takes_the_blocks_of_one_head_comparison_per_block(
    allocations: list[tuple[int, int, int, bool, bool]], policy: type[FrequencyPool]
) -> None:
    """For an adaptive pool in whichever order its shadows chose at each step."""
    pool, index = policy(12), PrefixIndex()
    kept: list[list[Block]] = []
    serial = 0
    for ticks, hits, new, sampled, keep in allocations:
        for _ in range(ticks):
            pool.match([])
        cached = [b for b in pool.blocks if b.key is not None][serial % 5 :][:hits]
        pool.match(cached)
        n = min(new, pool.available())
        expected = [b.block_id for b in pool.free[::-1][:n]]
        born = min(pool.unborn, n - len(expected))
        expected += range(len(pool.blocks), len(pool.blocks) + born)
        expected += [b.block_id for b in reference_victims(pool, n - len(expected))]
        taken = pool.take(n, [])
        assert [b.block_id for b in taken] == expected
        cache(pool, index, taken, [key(serial + i, sampled and i % 2 == 0) for i in range(n)])
        serial += n
        kept.append(cached + taken)
        if not keep or len(kept) > 3:
            pool.release(reversed(kept.pop(-1 if not keep else 0)))
        problems: list[str] = []
        pool.check(problems)
        assert problems == []
