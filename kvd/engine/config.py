"""The engine's configuration: one pool's shape and admission policy."""

from __future__ import annotations

from dataclasses import dataclass

from kvd_client.wire.hashing import DEFAULT_HASH_SEED

from kvd.engine.errors import InvalidError

__all__ = ["EVICTION_POLICIES", "EngineConfig"]

#: ``eviction`` settings: the default, "adaptive", orders evictions by use count
#: and recency while that out-hits LRU on a sample of the keys, else like LRU
#: (`kvd.engine.adaptive`); "frequency" always orders by use count
#: (`kvd.engine.frequency`: up to 11 points below LRU where many-use prefixes
#: stop coming back); "lru" is vLLM's order, block for block. bench/README.md,
#: "Eviction policies against adversarial workloads".
EVICTION_POLICIES = ("adaptive", "frequency", "lru")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One pool's engine settings.

    ``watermark_blocks`` blocks are kept for the growth of running
    sequences: new allocations and forks may not dip into them, appends may.
    ``events`` turns the event list off when nobody drains it.
    ``eviction`` picks which cached block goes when the pool is full (one
    of `EVICTION_POLICIES`). ``tier_blocks``: slots of the pool's tier
    (`kvd.engine.tier`; 0: no tier); ``tier_level``: 1 host memory, 2 a
    remote store shared by several nodes. ``remote_blocks``: slots of a
    remote tier below a host one (a chain, `kvd.engine.tier.chain`; 0: none).
    ``max_held_per_session``: block references one session may have in its
    holds and pins together (a block held twice counts twice, an empty pin
    one; 0: no limit): each costs the daemon's heap, and nothing else bounds
    repeated holds of the same cached blocks.
    """

    num_blocks: int
    block_size: int = 16
    hash_seed: str = DEFAULT_HASH_SEED
    watermark_blocks: int = 0
    events: bool = True
    eviction: str = "adaptive"
    tier_blocks: int = 0
    tier_level: int = 1
    remote_blocks: int = 0
    max_held_per_session: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.num_blocks) or self.num_blocks < 1:
            raise InvalidError(f"num_blocks must be a positive int, got {self.num_blocks!r}")
        if not _is_int(self.block_size) or self.block_size < 1:
            raise InvalidError(f"block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.hash_seed, str):
            raise InvalidError(f"hash_seed must be a str, got {type(self.hash_seed).__name__}")
        if not _is_int(self.watermark_blocks) or not 0 <= self.watermark_blocks <= self.num_blocks:
            raise InvalidError(
                f"watermark_blocks must be an int in [0, num_blocks], got {self.watermark_blocks!r}"
            )
        if not isinstance(self.events, bool):
            raise InvalidError(f"events must be a bool, got {type(self.events).__name__}")
        if not _is_int(self.tier_blocks) or self.tier_blocks < 0:
            raise InvalidError(f"tier_blocks must be an int >= 0, got {self.tier_blocks!r}")
        if self.tier_level not in (1, 2):
            raise InvalidError(f"tier_level must be 1 or 2, got {self.tier_level!r}")
        if not _is_int(self.remote_blocks) or self.remote_blocks < 0:
            raise InvalidError(f"remote_blocks must be an int >= 0, got {self.remote_blocks!r}")
        if not _is_int(self.max_held_per_session) or self.max_held_per_session < 0:
            raise InvalidError(
                f"max_held_per_session must be an int >= 0, got {self.max_held_per_session!r}"
            )
        if self.remote_blocks and not (self.tier_blocks and self.tier_level == 1):
            raise InvalidError("remote_blocks needs a host tier above it (tier_blocks, level 1)")
        if self.eviction not in EVICTION_POLICIES:
            raise InvalidError(
                f"eviction must be one of {list(EVICTION_POLICIES)}, got {self.eviction!r}"
            )
