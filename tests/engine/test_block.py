"""Block metadata."""

from __future__ import annotations

from kvd.engine.block import Block, idle, ids


def test_a_new_block_is_free_and_unkeyed() -> None:
    block = Block(7)
    assert (block.block_id, block.ref, block.key, block.index) == (7, 0, None, None)


def test_ids_lists_the_block_ids_in_order() -> None:
    assert ids([Block(5), Block(2), Block(9)]) == [5, 2, 9]


def test_idle_counts_the_blocks_without_a_holder() -> None:
    blocks = [Block(i) for i in range(4)]
    blocks[1].ref = 2
    blocks[3].ref = 1
    assert idle(blocks) == 2
