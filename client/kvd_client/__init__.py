"""kvd_client: the client library of the kvd KV-cache daemon.

`Client` (blocking) and `AsyncClient` (anyio) open a session on a pool,
allocate sequences and map the pool's memory (`PoolMapping`) for zero-copy
numpy/torch views. Errors are `KvdError` subclasses, one per wire code
(`kvd_client.errors`). The wire contract — messages, codes, the pool
layout and the daemon's address — is `kvd_client.wire`.
"""

from kvd_client import errors
from kvd_client.client import AsyncClient, Batch, Client, Pin, Sequence
from kvd_client.core import Admission, Deferred
from kvd_client.errors import (
    DaemonUnavailable,
    KvdError,
    OutOfBlocks,
    QuotaExceeded,
    Refused,
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
    "Refused",
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
