"""The interface every memory backend implements.

A backend creates a pool's bytes for a `PoolLayout`, keeps them alive for
the daemon's lifetime, and describes how a client maps them (the hello
reply's ``memory`` map). The layout itself — where block *b* of layer *l*
lives — is `kvd_client.wire.layout`'s, shared with the clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvd_client.wire import PoolLayout

__all__ = ["Capacity", "PoolMemory"]


@dataclass(frozen=True, slots=True)
class Capacity:
    """How many bytes a backend could reserve now, and what limits it (for the error line)."""

    bytes: int
    where: str


@runtime_checkable
class PoolMemory(Protocol):
    """One pool's memory, owned by the daemon."""

    @property
    def layout(self) -> PoolLayout:
        """The layout the memory was sized for."""
        ...

    @property
    def size(self) -> int:
        """Bytes reserved (``layout.total_bytes``)."""
        ...

    def handle(self) -> dict[str, Any]:
        """How a client maps the pool: ``{"backend": ..., ...}`` (msgpack-ready)."""
        ...

    def info(self) -> dict[str, Any]:
        """Operator facts (path, size, start-up timings) for the pools listing."""
        ...

    def close(self) -> None:
        """Unmap and release the memory (idempotent). Clients' own mappings stay valid."""
        ...
