"""A pool's memory mapped into this process, viewed as numpy arrays and torch tensors.

The hello reply names the pool's memory as a handle
``{"backend": ..., ...}``; `open_pool` picks the backend from `BACKENDS`
(``shm`` here; ``cuda`` registers itself from ``kvd_client.cuda`` when that
module is present) and maps the memory once per process: clients of the same
pool in one process share one mapping.

Views follow `PoolLayout` exactly (`PoolLayout.layer_offset`,
`PoolLayout.layer_strides`, `PoolLayout.offset`), so the daemon and every
client agree on where a block's bytes live. torch is imported only when a
torch view is asked for.

dtypes without a numpy equivalent are exposed raw in the numpy views:
``bfloat16`` as ``uint16`` and the ``float8`` types as ``uint8`` (same bits;
the torch views carry the real dtype).

A mapping is never unmapped explicitly: views may outlive any client, so the
memory is released when the last view and mapping object are collected.
"""

from __future__ import annotations

import abc
import importlib
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from kvd_client.errors import InternalError, LayoutMismatch
from kvd_client.layout import PoolLayout

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKENDS",
    "NUMPY_DTYPES",
    "RAW_DTYPES",
    "PoolMapping",
    "ShmPool",
    "open_pool",
    "register_backend",
]

#: numpy dtype of the numpy views, per pool dtype.
NUMPY_DTYPES: Final[dict[str, type[np.generic]]] = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "uint8": np.uint8,
}

#: Pool dtypes whose numpy views hold raw bits (no numpy equivalent).
RAW_DTYPES: Final = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})

Opener = Callable[[dict[str, Any], PoolLayout], "PoolMapping"]

#: Backend name (``memory["backend"]``) → function mapping such a handle.
BACKENDS: dict[str, Opener] = {}

#: Backends that live in their own module, imported on first use (their
#: module calls `register_backend` at import).
_BACKEND_MODULES: Final = {"cuda": "kvd_client.cuda"}

_lock = threading.Lock()
_mappings: weakref.WeakValueDictionary[Hashable, PoolMapping] = weakref.WeakValueDictionary()


def register_backend(name: str, opener: Opener) -> None:
    """Make ``opener`` map memory handles whose ``backend`` is ``name``."""
    BACKENDS[name] = opener


def open_pool(memory: dict[str, Any], layout: PoolLayout) -> PoolMapping:
    """Map the memory named by a hello reply's ``memory`` handle (shared per process).

    Raises `LayoutMismatch` for a backend this client cannot map or memory
    smaller than the layout, `InternalError` for a malformed handle, and
    `OSError` when the memory cannot be opened (e.g. permissions).
    """
    name = memory.get("backend")
    if not isinstance(name, str):
        raise InternalError(f"memory handle without a backend name: {memory!r}")
    if name not in BACKENDS and name in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[name])
    opener = BACKENDS.get(name)
    if opener is None:
        raise LayoutMismatch(
            f"memory backend {name!r} is not available in this client "
            f"(available: {', '.join(sorted(BACKENDS))})"
        )
    return opener(memory, layout)


def _shared(key: Hashable, make: Callable[[], PoolMapping]) -> PoolMapping:
    """The live mapping for ``key``, or a new one from ``make`` (one per process)."""
    with _lock:
        found = _mappings.get(key)
        if found is None:
            found = make()
            _mappings[key] = found
        return found


class PoolMapping(abc.ABC):
    """One pool's memory in this process: torch views and block copies."""

    #: The ``backend`` name this class maps.
    BACKEND: ClassVar[str]

    def __init__(self, layout: PoolLayout, memory: dict[str, Any]) -> None:
        self.layout = layout
        #: The handle this mapping was opened from (as the daemon sent it).
        self.memory = dict(memory)
        self._torch_layers: list[torch.Tensor] | None = None

    @abc.abstractmethod
    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i`` as ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K, V)."""

    def layers(self) -> list[torch.Tensor]:
        """Every layer's view, in order (what paged-attention kernels take)."""
        if self._torch_layers is None:
            self._torch_layers = [self.layer(i) for i in range(self.layout.num_layers)]
        return self._torch_layers

    @abc.abstractmethod
    def block(self, b: int) -> torch.Tensor:
        """Block ``b`` over all layers: ``[num_layers, 2, block_size, heads, head_dim]``."""

    @abc.abstractmethod
    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy block ``src[i]`` to ``dst[i]`` in every layer, K and V (copy-on-write)."""

    @abc.abstractmethod
    def fence(self) -> None:
        """Wait until this process's queued reads and writes of the pool have finished.

        The client calls it before ``commit``, ``truncate`` and ``free``, which
        hand blocks to other processes. Memory written synchronously (shm)
        needs nothing; device backends wait for their stream.
        """

    def _check_blocks(self, *ids: Sequence[int]) -> None:
        n = self.layout.num_blocks
        for group in ids:
            for b in group:
                if not 0 <= b < n:
                    raise InternalError(f"block id {b} outside the pool's 0..{n - 1}")


class ShmPool(PoolMapping):
    """A pool in a shared-memory file (``/dev/shm``), mapped ``MAP_SHARED``.

    Writes through any view are visible to every process mapping the file.
    ``block(b)`` is zero-copy in both orders: contiguous for ``block_major``,
    strided (one slot per layer and K/V) for ``layer_major``.
    """

    BACKEND = "shm"

    def __init__(
        self, layout: PoolLayout, memory: dict[str, Any], mapping: mmap.mmap, base: int
    ) -> None:
        super().__init__(layout, memory)
        self._mmap = mapping
        #: Byte offset of the pool within the mapping (the handle's offset
        #: rounded down to the mmap granularity leaves this remainder).
        self._base = base
        self._dtype = np.dtype(NUMPY_DTYPES[layout.dtype])
        self._np_layers: list[npt.NDArray[Any]] = []
        n, slot = layout.num_blocks, layout.slot_bytes
        if layout.order == "layer_major":
            slot_strides = (layout.layer_stride, n * slot, slot, 1)
        else:
            slot_strides = (2 * slot, slot, layout.block_stride, 1)
        #: Raw bytes ``[num_layers, 2, num_blocks, slot_bytes]``: the copy-on-write view.
        self._slots: npt.NDArray[np.uint8] = np.ndarray(
            (layout.num_layers, 2, n, slot),
            dtype=np.uint8,
            buffer=mapping,
            offset=base,
            strides=slot_strides,
        )

    @classmethod
    def open(cls, memory: dict[str, Any], layout: PoolLayout) -> PoolMapping:
        """Map the handle ``{"backend": "shm", "path", "size", "offset"}`` (shared per process).

        The per-process key includes the file's inode: a daemon that
        re-creates its file at the same path gets a fresh mapping, never the
        stale one.
        """
        path, size, offset = memory.get("path"), memory.get("size"), memory.get("offset", 0)
        if not (isinstance(path, str) and os.path.isabs(path)):
            raise InternalError(f"shm memory handle needs an absolute path: {memory!r}")
        if type(size) is not int or type(offset) is not int or size <= 0 or offset < 0:
            raise InternalError(f"shm memory handle needs size > 0 and offset >= 0: {memory!r}")
        if size < layout.used_bytes:
            raise LayoutMismatch(
                f"pool memory of {size} bytes is smaller than its layout's {layout.used_bytes}"
            )
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_size < offset + size:
                raise LayoutMismatch(
                    f"{path} holds {st.st_size} bytes, the pool needs {offset + size} "
                    f"(from offset {offset})"
                )
            key = (cls.BACKEND, st.st_dev, st.st_ino, offset, size, layout)

            def make() -> PoolMapping:
                base = offset % mmap.ALLOCATIONGRANULARITY
                mapping = mmap.mmap(
                    fd,
                    size + base,
                    flags=mmap.MAP_SHARED,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                    offset=offset - base,
                )
                return cls(layout, memory, mapping, base)

            return _shared(key, make)
        finally:
            os.close(fd)

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """dtype of the numpy views (raw ``uint16``/``uint8`` for `RAW_DTYPES`)."""
        return self._dtype

    def buffer(self) -> memoryview:
        """The pool's bytes (``layout.total_bytes`` from the pool's first byte)."""
        return memoryview(self._mmap)[self._base : self._base + self.layout.total_bytes]

    def np_layer(self, i: int) -> npt.NDArray[Any]:
        """Layer ``i`` as a numpy view ``[2, num_blocks, block_size, heads, head_dim]``."""
        if not self._np_layers:
            lay = self.layout
            shape = (2, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
            self._np_layers = [
                np.ndarray(
                    shape,
                    dtype=self._dtype,
                    buffer=self._mmap,
                    offset=self._base + lay.layer_offset(j),
                    strides=lay.layer_strides(),
                )
                for j in range(lay.num_layers)
            ]
        return self._np_layers[i]

    def np_layers(self) -> list[npt.NDArray[Any]]:
        """Every layer's numpy view, in order."""
        self.np_layer(0)
        return list(self._np_layers)

    def np_block(self, b: int) -> npt.NDArray[Any]:
        """Block ``b`` as a numpy view ``[num_layers, 2, block_size, heads, head_dim]``."""
        lay = self.layout
        strides = lay.layer_strides()
        if lay.order == "layer_major":
            outer = (lay.layer_stride, strides[0])
        else:
            outer = (2 * lay.slot_bytes, lay.slot_bytes)
        return np.ndarray(
            (lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim),
            dtype=self._dtype,
            buffer=self._mmap,
            offset=self._base + lay.offset(0, 0, b),
            strides=(*outer, *strides[2:]),
        )

    def layer(self, i: int) -> torch.Tensor:
        return self._torch(self.np_layer(i))

    def block(self, b: int) -> torch.Tensor:
        return self._torch(self.np_block(b))

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if len(src) != len(dst):
            raise InternalError(f"{len(src)} copy sources for {len(dst)} destinations")
        if not src:
            return
        self._check_blocks(src, dst)
        slots = self._slots
        slots[:, :, np.asarray(dst)] = slots[:, :, np.asarray(src)]

    def fence(self) -> None:
        """Nothing to wait for: CPU writes through the mapping are done when they return."""

    def _torch(self, arr: npt.NDArray[Any]) -> torch.Tensor:
        import torch  # noqa: PLC0415 - optional dependency, imported on first torch view

        if self.layout.dtype == "bfloat16":
            # torch's uint16 supports few ops; int16 has the same bits and views to bf16.
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        tensor = torch.from_numpy(arr)
        if self.layout.dtype in RAW_DTYPES:
            return tensor.view(getattr(torch, self.layout.dtype))
        return tensor


register_backend(ShmPool.BACKEND, ShmPool.open)
