"""Side effects on the prefix cache, as records the caller drains.

They mirror vLLM's KV events (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) so a router built for vLLM can index kvd; the
publisher turns each 32-byte key into its 64-bit event form
(`kvd_client.wire.hashing.event_id`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "Event"]


class BlockStored:
    """Consecutive blocks of one commit became matchable.

    ``keys[0]`` chains from ``parent`` (None for a sequence's first block);
    ``token_ids`` are the ``len(keys) * block_size`` token ids of those
    blocks (kept as an int32 array until read, so building the event costs
    no per-token objects). ``tier`` 1: the blocks were copied into tier 1
    (`kvd.engine.tier`; no chain, no token ids), 0: cached in the pool.
    """

    __slots__ = ("_tokens", "adapter", "block_size", "keys", "namespace", "parent", "tier")

    def __init__(
        self,
        keys: list[bytes],
        parent: bytes | None,
        tokens: npt.NDArray[np.int32],
        *,
        block_size: int,
        namespace: str,
        adapter: str | None,
        tier: int = 0,
    ) -> None:
        self.keys = keys
        self.parent = parent
        self._tokens = tokens
        self.block_size = block_size
        self.namespace = namespace
        self.adapter = adapter
        self.tier = tier

    @property
    def token_ids(self) -> list[int]:
        """The token ids of the stored blocks, in order."""
        ids: list[int] = self._tokens.tolist()
        return ids

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockStored):
            return NotImplemented
        return (
            self.keys == other.keys
            and self.parent == other.parent
            and self.token_ids == other.token_ids
            and self.block_size == other.block_size
            and self.namespace == other.namespace
            and self.adapter == other.adapter
            and self.tier == other.tier
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"BlockStored({len(self.keys)} blocks, parent="
            f"{self.parent.hex()[:12] if self.parent else None}, namespace={self.namespace!r}, "
            f"adapter={self.adapter!r})"
        )


class BlockRemoved:
    """Blocks left the prefix cache (evicted or flushed), in one pass; ``tier`` 1:
    their copies left tier 1, 0: the pool."""

    __slots__ = ("keys", "tier")

    def __init__(self, keys: list[bytes], tier: int = 0) -> None:
        self.keys = keys
        self.tier = tier

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockRemoved):
            return NotImplemented
        return self.keys == other.keys and self.tier == other.tier

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockRemoved({len(self.keys)} blocks)"


class AllBlocksCleared:
    """Every block left the prefix cache (a flush of all namespaces)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AllBlocksCleared):
            return NotImplemented
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "AllBlocksCleared()"


#: Anything `Engine.drain_events` returns.
Event = BlockStored | BlockRemoved | AllBlocksCleared
