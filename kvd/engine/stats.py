"""A point-in-time snapshot of the engine's counters (plain data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvd.engine.tier import TierStats

__all__ = ["EngineStats", "NamespaceStats"]


@dataclass(slots=True)
class NamespaceStats:
    """One namespace's prefix-cache traffic and usage."""

    queries: int
    query_tokens: int
    hit_tokens: int
    usage: int
    cached_blocks: int
    epoch: int

    @property
    def hit_ratio(self) -> float:
        """Hit tokens over query tokens (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(slots=True)
class EngineStats:
    """Blocks by state, reservations, prefix-cache traffic and refusals.

    ``blocks_in_use`` counts blocks with at least one holder (pinned ones
    included); ``usage`` figures count blocks once per holder plus
    reservations and pins, as the quotas do.
    """

    blocks_total: int
    blocks_free: int
    blocks_evictable: int
    blocks_in_use: int
    blocks_pinned: int
    reserved: int
    sequences: int
    sessions: int
    #: Holds of the block-level mode, and the blocks they keep (once per hold).
    holds: int
    held_blocks: int
    prefix_queries: int
    query_tokens: int
    hit_tokens: int
    evictions: int
    refusals: dict[str, int] = field(default_factory=dict)
    namespaces: dict[str, NamespaceStats] = field(default_factory=dict)
    session_usage: dict[int, int] = field(default_factory=dict)
    #: The first tier's counters (None: the pool has no tier).
    tier: TierStats | None = None
    #: The counters of the tier below it (a chain; None: none).
    tier_below: TierStats | None = None

    @property
    def hit_ratio(self) -> float:
        """Hit tokens over query tokens (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts of ints, floats and strings (JSON-ready)."""
        out = asdict(self)
        out["hit_ratio"] = self.hit_ratio
        for name, ns in self.namespaces.items():
            out["namespaces"][name]["hit_ratio"] = ns.hit_ratio
        out["session_usage"] = {str(sid): usage for sid, usage in self.session_usage.items()}
        return out
