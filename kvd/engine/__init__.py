"""kvd's block engine and prefix cache: pure, synchronous, metadata only.

See ``docs/architecture.md`` for the contract. Imports only the standard
library, numpy and the block-key function of the wire contract
(`kvd_client.wire.hashing`: clients compute the same keys).
"""

from kvd.engine.checks import TokensLike
from kvd.engine.config import EVICTION_POLICIES, EngineConfig
from kvd.engine.engine import Engine
from kvd.engine.errors import (
    Code,
    EngineError,
    ExistsError,
    InvalidError,
    InvariantError,
    NotFoundError,
)
from kvd.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvd.engine.results import (
    Allocation,
    Appended,
    Committed,
    Forked,
    Granted,
    Looked,
    Pinned,
    Refusal,
    Truncated,
)
from kvd.engine.stats import EngineStats, NamespaceStats

__all__ = [
    "EVICTION_POLICIES",
    "AllBlocksCleared",
    "Allocation",
    "Appended",
    "BlockRemoved",
    "BlockStored",
    "Code",
    "Committed",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "Event",
    "ExistsError",
    "Forked",
    "Granted",
    "InvalidError",
    "InvariantError",
    "Looked",
    "NamespaceStats",
    "NotFoundError",
    "Pinned",
    "Refusal",
    "TokensLike",
    "Truncated",
]
