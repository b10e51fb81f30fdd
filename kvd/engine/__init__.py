"""kvd's block engine and prefix cache: pure, synchronous, metadata only.

See ``docs/architecture.md`` for the contract. Imports only the standard
library, numpy and the block-key function of the wire contract
(`kvd_client.wire.hashing`: clients compute the same keys).

The per-block modules (`COMPILED_MODULES`) are compiled by mypyc when kvd is
installed (setup.py); `COMPILED` says whether they run so, and a checkout
run without that build warns here.
"""

import warnings
from typing import Final

from kvd.engine import pool as _pool
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

#: The modules mypyc compiles (setup.py's ``ENGINE``): those with the loops over
#: every block of a prompt.
COMPILED_MODULES: Final = ("block", "block_queue", "pool", "frequency", "adaptive")
#: Whether they run compiled (an extension module) rather than as Python source.
COMPILED: Final = not _pool.__file__.endswith(".py")
if not COMPILED:
    warnings.warn(
        "kvd's engine modules are not compiled: long prompts cost the daemon several"
        " times more. Build them with `pip install -e .` (`make venv`).",
        RuntimeWarning,
        stacklevel=1,
    )

__all__ = [
    "COMPILED",
    "COMPILED_MODULES",
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
