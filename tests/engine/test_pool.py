"""The block pool: free stack, eviction queue, take and release."""

from __future__ import annotations

from kvd.engine.block import Block
from kvd.engine.pool import BlockPool
from kvd.engine.prefix_index import PrefixIndex


def cache(pool: BlockPool, index: PrefixIndex, block: Block, key: bytes) -> None:
    block.key = key
    block.index = index
    index[key] = block


def test_a_new_pool_is_all_free_and_hands_out_low_ids_first() -> None:
    pool = BlockPool(4)
    assert pool.available() == 4
    assert [b.block_id for b in pool.take(2, [])] == [0, 1]


def test_blocks_are_created_on_first_use() -> None:
    pool = BlockPool(1_000_000)
    assert pool.blocks == [] and pool.unborn == 1_000_000
    pool.take(3, [])
    assert [b.block_id for b in pool.blocks] == [0, 1, 2]
    assert pool.unborn == 999_997 and pool.available() == 999_997


def test_a_freed_block_is_taken_before_an_unborn_one() -> None:
    pool = BlockPool(4)
    _, b = pool.take(2, [])
    pool.release([b])
    assert [x.block_id for x in pool.take(2, [])] == [b.block_id, 2]


def test_taken_blocks_have_one_holder() -> None:
    pool = BlockPool(4)
    assert [b.ref for b in pool.take(3, [])] == [1, 1, 1]


def test_release_frees_unkeyed_and_queues_keyed_blocks_in_order() -> None:
    pool, index = BlockPool(4), PrefixIndex()
    a, b, c = pool.take(3, [])
    cache(pool, index, a, b"a")
    cache(pool, index, c, b"c")
    pool.release([c, b, a])
    assert [x.block_id for x in pool.lru] == [c.block_id, a.block_id]
    assert b in pool.free


def test_release_of_a_shared_block_only_drops_a_holder() -> None:
    pool = BlockPool(2)
    (a,) = pool.take(1, [])
    a.ref = 2
    pool.release([a])
    assert a.ref == 1 and a not in pool.free and pool.evictable == 0 and not pool.lru


def test_take_evicts_from_the_head_once_the_free_stack_is_empty() -> None:
    pool, index = BlockPool(3), PrefixIndex()
    blocks = pool.take(3, [])
    for i, block in enumerate(blocks):
        cache(pool, index, block, bytes([i]))
    pool.release(blocks)
    removed: list[bytes] = []
    taken = pool.take(2, removed)
    assert taken == blocks[:2]
    assert removed == [b"\x00", b"\x01"]
    assert all(b.key is None and b.index is None for b in taken)
    assert list(index) == [b"\x02"]
    assert pool.evictions == 2


def test_touch_pulls_an_evictable_block_off_the_queue() -> None:
    pool, index = BlockPool(2), PrefixIndex()
    (a,) = pool.take(1, [])
    cache(pool, index, a, b"a")
    pool.release([a])
    pool.touch([a])
    assert a.ref == 1 and pool.evictable == 0 and not pool.lru


def test_drop_key_frees_an_evictable_block_at_once() -> None:
    pool, index = BlockPool(2), PrefixIndex()
    (a,) = pool.take(1, [])
    cache(pool, index, a, b"a")
    pool.release([a])
    pool.drop_key(a)
    assert a.key is None and a in pool.free and pool.evictable == 0 and not pool.lru


def test_drop_key_of_a_block_in_use_leaves_it_in_use() -> None:
    pool, index = BlockPool(2), PrefixIndex()
    (a,) = pool.take(1, [])
    cache(pool, index, a, b"a")
    pool.drop_key(a)
    assert a.key is None and a.ref == 1 and a not in pool.free


def test_take_reports_the_indexes_its_evictions_emptied() -> None:
    pool, full, kept = BlockPool(3), PrefixIndex("full"), PrefixIndex("kept")
    blocks = pool.take(3, [])
    cache(pool, full, blocks[0], b"a")
    cache(pool, kept, blocks[1], b"b")
    cache(pool, kept, blocks[2], b"c")
    pool.release(blocks)
    pool.take(2, [])
    assert [index.owner for index in pool.emptied] == ["full"]
