"""kvd_client: the client library of the kvd KV-cache daemon.

`Client` (blocking) and `AsyncClient` (anyio) open a session on a pool,
allocate sequences and map the pool's memory (`PoolMapping`) for zero-copy
numpy/torch views. Errors are `KvdError` subclasses, one per wire code
(`kvd_client.errors`); refusals of capacity are `RefusalError`s.

The contract with the daemon — message kinds and codes, the typed messages
and their frames, the pool layout, the cuda memory map and the daemon's
address — is the subpackage `kvd_client.wire`, the only part the daemon
imports. The names below load on first use, so importing `kvd_client.wire`
does not load the client (zmq, anyio) along with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvd_client import errors
    from kvd_client.client import AsyncClient, Batch, Client, Pin, Sequence
    from kvd_client.core import Admission, Deferred
    from kvd_client.errors import (
        DaemonUnavailable,
        KvdError,
        OutOfBlocks,
        QuotaExceeded,
        RefusalError,
        SessionLost,
    )
    from kvd_client.pool import PoolMapping, ShmPool, open_pool, register_backend
    from kvd_client.wire import Notice, PoolLayout, default_address

__all__ = [
    "Admission",
    "AsyncClient",
    "Batch",
    "Client",
    "DaemonUnavailable",
    "Deferred",
    "KvdError",
    "Notice",
    "OutOfBlocks",
    "Pin",
    "PoolLayout",
    "PoolMapping",
    "QuotaExceeded",
    "RefusalError",
    "Sequence",
    "SessionLost",
    "ShmPool",
    "__version__",
    "default_address",
    "errors",
    "open_pool",
    "register_backend",
]

__version__ = "0.1.0"

#: The module each public name is loaded from (a module itself when the name is one).
_SOURCES: dict[str, str] = {
    "errors": "kvd_client.errors",
    **dict.fromkeys(["AsyncClient", "Batch", "Client", "Pin", "Sequence"], "kvd_client.client"),
    **dict.fromkeys(["Admission", "Deferred"], "kvd_client.core"),
    **dict.fromkeys(
        [
            "DaemonUnavailable",
            "KvdError",
            "OutOfBlocks",
            "QuotaExceeded",
            "RefusalError",
            "SessionLost",
        ],
        "kvd_client.errors",
    ),
    **dict.fromkeys(["PoolMapping", "ShmPool", "open_pool", "register_backend"], "kvd_client.pool"),
    **dict.fromkeys(["Notice", "PoolLayout", "default_address"], "kvd_client.wire"),
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'kvd_client' has no attribute {name!r}")
    module = importlib.import_module(source)
    value = module if name == "errors" else getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
