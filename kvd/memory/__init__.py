"""The pool's bytes: a registry of memory backends (``shm``, ``cuda``).

``create_pool_memory(backend, name, layout, **opts)`` creates one pool's
memory; ``backend_capacity(backend, **opts)`` says how much the backend
could reserve now (the daemon checks a whole pool set against it before
creating any). Both are blocking: the daemon calls them from a thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvd_client.wire import PoolLayout

from kvd.errors import StartupError
from kvd.memory import cuda, shm
from kvd.memory.base import Capacity, PoolMemory

__all__ = [
    "BACKENDS",
    "Capacity",
    "PoolMemory",
    "backend_capacity",
    "create_pool_memory",
    "remove_stale_segments",
]


@dataclass(frozen=True, slots=True)
class _Backend:
    create: Callable[..., PoolMemory]
    capacity: Callable[..., Capacity]
    #: Removes a dead daemon instance's leftovers; returns what it removed.
    remove_stale: Callable[..., list[str]]
    #: Option names each call accepts (others are dropped: e.g. shm_dir means nothing to cuda).
    create_opts: frozenset[str]
    capacity_opts: frozenset[str]


def _shm_create(name: str, layout: PoolLayout, **opts: Any) -> PoolMemory:
    return shm.ShmSegment.create(name, layout, **opts)


#: Registered backends by name.
BACKENDS: dict[str, _Backend] = {
    "shm": _Backend(
        create=_shm_create,
        capacity=shm.capacity,
        remove_stale=shm.remove_stale,
        create_opts=frozenset({"instance", "shm_dir", "prefault", "hugepages"}),
        capacity_opts=frozenset({"shm_dir"}),
    ),
    # Importing the cuda backend touches no GPU and imports no cupy/torch.
    "cuda": _Backend(
        create=cuda.create,
        capacity=cuda.capacity,
        remove_stale=cuda.remove_stale,
        create_opts=cuda.CREATE_OPTS,
        capacity_opts=cuda.CAPACITY_OPTS,
    ),
}


def _backend(name: str) -> _Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise StartupError(
            f"memory backend {name!r} is not available (have: {', '.join(sorted(BACKENDS))})"
        ) from None


def create_pool_memory(backend: str, name: str, layout: PoolLayout, **opts: Any) -> PoolMemory:
    """Create pool ``name``'s memory with ``backend``; raises StartupError (or a subclass)."""
    b = _backend(backend)
    return b.create(name, layout, **{k: v for k, v in opts.items() if k in b.create_opts})


def backend_capacity(backend: str, **opts: Any) -> Capacity:
    """Bytes ``backend`` could reserve now, and what limits it."""
    b = _backend(backend)
    return b.capacity(**{k: v for k, v in opts.items() if k in b.capacity_opts})


def remove_stale_segments(instance: str, **opts: Any) -> list[str]:
    """Remove every backend's leftovers of a dead daemon ``instance`` (no live daemon owns it)."""
    removed: list[str] = []
    for b in BACKENDS.values():
        removed.extend(
            b.remove_stale(
                instance=instance, **{k: v for k, v in opts.items() if k in b.capacity_opts}
            )
        )
    return removed
