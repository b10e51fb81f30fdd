"""Block metadata."""

from __future__ import annotations

from kvd.engine.block import Block


def test_a_new_block_is_free_and_unkeyed() -> None:
    block = Block(7)
    assert (block.block_id, block.ref, block.key, block.index) == (7, 0, None, None)
