"""One physical KV block's metadata, and the loops over a list of blocks that
the engine's other modules need (compiled with this one: setup.py)."""

from __future__ import annotations

__all__ = ["Block", "idle", "ids"]


class Block:
    """A fixed-size slot of ``block_size`` tokens in the pool (metadata only).

    ``ref`` counts holders: each sequence whose table holds the block and
    each pin. With ``ref == 0`` the block is *evictable* when it has a
    ``key`` (it is in the prefix index and still matchable) and *free*
    otherwise. ``index`` is the prefix-index dict that maps ``key`` to this
    block (so eviction can unlink it without knowing the namespace).
    ``prev``/``next`` link the block into an intrusive eviction queue while
    it is evictable; they are meaningless otherwise. Pin counts and the
    eviction policy's per-block state live in arrays and dicts beside the
    blocks (a slot costs 8 bytes on every block of a million-block pool).
    """

    __slots__ = ("block_id", "index", "key", "next", "prev", "ref")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref = 0
        self.key: bytes | None = None
        self.index: dict[bytes, Block] | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        key = self.key.hex()[:12] if self.key is not None else None
        return f"Block({self.block_id}, ref={self.ref}, key={key})"


def ids(blocks: list[Block]) -> list[int]:
    """The ids of ``blocks``, in order."""
    return [b.block_id for b in blocks]


def idle(blocks: list[Block]) -> int:
    """How many of ``blocks`` have no holder (``ref == 0``)."""
    n = 0
    for b in blocks:
        if not b.ref:
            n += 1
    return n
