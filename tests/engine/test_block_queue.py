"""The intrusive eviction queue."""

from __future__ import annotations

from kvd.engine.block import Block
from kvd.engine.block_queue import BlockQueue


def ids(queue: BlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_append_queues_at_the_tail() -> None:
    q = BlockQueue()
    blocks = [Block(i) for i in range(3)]
    for b in blocks:
        q.append(b)
    assert ids(q) == [0, 1, 2]


def test_extend_keeps_the_given_order() -> None:
    q = BlockQueue()
    q.append(Block(9))
    q.extend([Block(2), Block(1)])
    assert ids(q) == [9, 2, 1]


def test_remove_unlinks_from_the_middle() -> None:
    q = BlockQueue()
    blocks = [Block(i) for i in range(3)]
    q.extend(blocks)
    q.remove(blocks[1])
    assert ids(q) == [0, 2]


def test_popleft_takes_the_head_in_order() -> None:
    q = BlockQueue()
    q.extend([Block(i) for i in range(4)])
    assert [b.block_id for b in q.popleft(3)] == [0, 1, 2]
    assert ids(q) == [3]


def test_popleft_everything_leaves_an_empty_queue_that_still_works() -> None:
    q = BlockQueue()
    q.extend([Block(0), Block(1)])
    q.popleft(2)
    assert ids(q) == [] and not q
    q.append(Block(5))
    assert ids(q) == [5]
