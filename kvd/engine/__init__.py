"""kvd's block engine and prefix cache: pure, synchronous, metadata only.

See ``docs/architecture.md`` for the contract. Imports only the standard
library and numpy.
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
from kvd.engine.hashing import DEFAULT_HASH_SEED
from kvd.engine.results import (
    Allocation,
    Appended,
    Committed,
    Forked,
    Pinned,
    Refusal,
    Truncated,
)
from kvd.engine.stats import EngineStats, NamespaceStats

__all__ = [
    "DEFAULT_HASH_SEED",
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
    "InvalidError",
    "InvariantError",
    "NamespaceStats",
    "NotFoundError",
    "Pinned",
    "Refusal",
    "TokensLike",
    "Truncated",
]
