"""The intrusive doubly linked queue that orders evictable blocks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvd.engine.block import Block

__all__ = ["BlockQueue"]


class BlockQueue:
    """A doubly linked list threaded through `Block.prev`/`Block.next`.

    O(1) append at the tail, removal from the middle and pop at the head,
    with no allocation: the links live in the blocks themselves (like
    vLLM's ``FreeKVCacheBlockQueue``). Two sentinels remove every edge
    case from the link updates. The head is the next block to evict.

    The queue keeps no length: a block is unlinked without knowing which
    of a pool's queues holds it, so the pool counts its evictable blocks.
    """

    __slots__ = ("head", "tail")

    def __init__(self) -> None:
        self.head = Block(-1)
        self.tail = Block(-1)
        self.head.next = self.tail
        self.tail.prev = self.head

    def __bool__(self) -> bool:
        return self.head.next is not self.tail

    def append(self, block: Block) -> None:
        """Put ``block`` at the tail (evicted last)."""
        tail = self.tail
        last = tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = tail
        tail.prev = block

    def extend(self, blocks: Iterable[Block]) -> None:
        """Append ``blocks`` in order (the first is evicted first)."""
        tail = self.tail
        last = tail.prev
        assert last is not None
        for block in blocks:
            last.next = block
            block.prev = last
            last = block
        last.next = tail
        tail.prev = last

    @staticmethod
    def remove(block: Block) -> None:
        """Unlink ``block`` from whichever queue holds it."""
        prev = block.prev
        nxt = block.next
        assert prev is not None and nxt is not None
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None

    def popleft(self, n: int) -> list[Block]:
        """Unlink and return the ``n`` blocks at the head (at least ``n`` queued)."""
        head = self.head
        out: list[Block] = []
        block = head.next
        push = out.append
        for _ in range(n):
            push(block)  # type: ignore[arg-type]
            block = block.next  # type: ignore[union-attr]
        assert block is not None
        head.next = block
        block.prev = head
        return out

    def __iter__(self) -> Iterator[Block]:
        block = self.head.next
        tail = self.tail
        while block is not tail:
            assert block is not None
            yield block
            block = block.next
