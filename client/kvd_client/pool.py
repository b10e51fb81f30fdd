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

Writing and reading KV: `PoolMapping.write_block` / `read_block` copy one
block over all layers, `write_blocks` / `read_blocks` many (a prefill's
``[num_layers, 2, n, block_size, heads, head_dim]``), `write_layer` /
`read_layer` one layer of many, from and into torch tensors or numpy arrays.
Consecutive block ids are coalesced into one copy. On a shm pool a CPU
tensor goes through numpy (``np.copyto`` on views of the same bits, also for
bfloat16 and float8: one C call per run of blocks, whatever torch's thread
settings); device tensors and cuda pools take torch's ``copy_``.

dtypes without a numpy equivalent are exposed raw in the numpy views:
``bfloat16`` as ``uint16`` and the ``float8`` types as ``uint8`` (same bits;
the torch views carry the real dtype).

A ``paged`` pool (`PoolLayout` order ``"paged"``: an engine's own KV pages,
e.g. vLLM's CPU blocks) maps as `ShmPages`: `PoolMapping.pages` gives each
layer's pages, every kvd-layout view and copy above raises `LayoutMismatch`
(its bytes are never handed out as kvd-layout KV).

A mapping is never unmapped explicitly: views may outlive any client, so the
memory is released when the last view and mapping object are collected.
"""

from __future__ import annotations

import abc
import importlib
import mmap
import operator
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, TypeAlias, Union, cast

import numpy as np
import numpy.typing as npt

from kvd_client.errors import InternalError, InvalidRequest, LayoutMismatch
from kvd_client.wire import PoolLayout

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKENDS",
    "KV",
    "NUMPY_DTYPES",
    "RAW_DTYPES",
    "BlockIds",
    "PoolMapping",
    "ShmPages",
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

#: torch dtype of the same width through which a tensor of a `RAW_DTYPES`
#: dtype becomes a numpy array (torch cannot hand those to numpy directly).
_RAW_VIA: Final = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}

#: Every layer (the layer selection of `PoolMapping.write_blocks` and friends).
_ALL: Final = slice(None)

#: Block ids the write and read methods take: ints, a 1-D integer array or CPU tensor.
BlockIds: TypeAlias = Union[Sequence[int], npt.NDArray[Any], "torch.Tensor"]

#: What the write and read methods take: a torch tensor or a numpy array.
KV: TypeAlias = Union["torch.Tensor", npt.NDArray[Any]]

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

    def pages(self, layer: int) -> torch.Tensor:
        """A ``paged`` pool's layer ``layer``: ``[num_blocks, page_elems]`` of the pool's dtype.

        Row ``b`` is block ``b``'s page (``layout.page_bytes``, contiguous), its
        inner packing the engine's (``layout.format``). Zero-copy. Raises
        `LayoutMismatch` for kvd's own orders (use `layer`), IndexError for a
        layer outside the pool.
        """
        raise LayoutMismatch(
            f"a {self.layout.order} pool has kvd's K/V layout, not engine pages: use layer()"
        )

    @abc.abstractmethod
    def block(self, b: int) -> torch.Tensor:
        """Block ``b`` over all layers: ``[num_layers, 2, block_size, heads, head_dim]``."""

    @abc.abstractmethod
    def blocks(self, first: int, count: int) -> torch.Tensor:
        """Blocks ``first..first+count-1``: ``[num_layers, 2, count, block_size, heads, head_dim]``.

        Zero-copy, like `block`. Raises IndexError for a run outside the pool.
        """

    def write_block(self, block_id: int, src: KV) -> None:
        """Copy ``src`` ``[num_layers, 2, block_size, heads, head_dim]`` into block ``block_id``.

        ``src`` is a torch tensor of the pool's dtype (any device, any strides)
        or a numpy array of `NUMPY_DTYPES`' dtype. Raises `InvalidRequest`
        (nothing written) for an id outside the pool or a wrong shape, dtype
        or type. On a device pool the copy is queued like any torch copy:
        `fence` before handing the block on.
        """
        b = self._block_id(block_id)
        self._write([b], self._kv(src, self._shape(None), "src")[:, :, None], _ALL)

    def write_blocks(self, block_ids: BlockIds, src: KV) -> None:
        """Copy ``src[:, :, i]`` into block ``block_ids[i]`` for each i (a prefill's write).

        ``src`` is ``[num_layers, 2, len(block_ids), block_size, heads, head_dim]``
        (a ``[num_layers, 2, tokens, heads, head_dim]`` tensor of whole blocks
        reshapes to it for free). Runs of consecutive ids are one copy each.
        Raises `InvalidRequest` (nothing written) as `write_block` does, and for
        an id given twice.
        """
        ids = self._block_ids(block_ids, unique=True)
        self._write(ids, self._kv(src, self._shape(len(ids)), "src"), _ALL)

    def write_layer(self, layer: int, block_ids: BlockIds, src: KV) -> None:
        """Copy ``src[:, i]`` into layer ``layer`` of block ``block_ids[i]`` (K and V).

        ``src`` is ``[2, len(block_ids), block_size, heads, head_dim]``: what a
        model computes for one layer (``layer(l)[:, block_ids] = src``, without
        torch's indexed write). Raises `InvalidRequest` as `write_blocks` does,
        and for a layer outside the pool.
        """
        ids = self._block_ids(block_ids, unique=True)
        i = self._layer(layer)
        self._write(ids, self._kv(src, self._shape(len(ids), True), "src")[None], slice(i, i + 1))

    def read_block(self, block_id: int, out: KV) -> None:
        """Copy block ``block_id`` into ``out`` ``[num_layers, 2, block_size, heads, head_dim]``.

        ``out`` as `write_block`'s ``src``, writable. Raises `InvalidRequest`
        (nothing read) as `write_block` does.
        """
        b = self._block_id(block_id)
        self._read([b], self._kv(out, self._shape(None), "out")[:, :, None], _ALL)

    def read_blocks(self, block_ids: BlockIds, out: KV) -> None:
        """Copy block ``block_ids[i]`` into ``out[:, :, i]`` for each i.

        ``out`` is ``[num_layers, 2, len(block_ids), block_size, heads, head_dim]``.
        Raises `InvalidRequest` (nothing read) as `write_block` does.
        """
        ids = self._block_ids(block_ids, unique=False)
        self._read(ids, self._kv(out, self._shape(len(ids)), "out"), _ALL)

    def read_layer(self, layer: int, block_ids: BlockIds, out: KV) -> None:
        """Copy layer ``layer`` of block ``block_ids[i]`` into ``out[:, i]`` (K and V).

        ``out`` is ``[2, len(block_ids), block_size, heads, head_dim]``. Raises
        `InvalidRequest` (nothing read) as `write_layer` does.
        """
        ids = self._block_ids(block_ids, unique=False)
        i = self._layer(layer)
        self._read(ids, self._kv(out, self._shape(len(ids), True), "out")[None], slice(i, i + 1))

    def _write(self, ids: list[int], src: KV, layers: slice) -> None:
        """Copy ``src[:, :, i]`` into block ``ids[i]`` of ``layers`` through torch (checked)."""
        kv = _torch_of(src, self.layout.dtype) if isinstance(src, np.ndarray) else src
        for pos, first, count in _runs(ids):
            self.blocks(first, count)[layers].copy_(kv[:, :, pos : pos + count])

    def _read(self, ids: list[int], out: KV, layers: slice) -> None:
        """Copy block ``ids[i]`` of ``layers`` into ``out[:, :, i]`` through torch (checked)."""
        kv = _torch_of(out, self.layout.dtype) if isinstance(out, np.ndarray) else out
        for pos, first, count in _runs(ids):
            kv[:, :, pos : pos + count].copy_(self.blocks(first, count)[layers])

    def _shape(self, count: int | None, one_layer: bool = False) -> tuple[int, ...]:
        """Shape of the KV of ``count`` blocks (None: one, no block axis), all or one layer."""
        lay = self.layout
        inner = (lay.block_size, lay.num_kv_heads, lay.head_dim)
        run = inner if count is None else (count, *inner)
        return (2, *run) if one_layer else (lay.num_layers, 2, *run)

    def _layer(self, layer: int) -> int:
        """``layer`` as an int inside the pool; raises `InvalidRequest` otherwise."""
        try:
            i = operator.index(layer)
        except TypeError:
            raise InvalidRequest(f"a layer must be an integer, got {layer!r}") from None
        if not 0 <= i < self.layout.num_layers:
            raise InvalidRequest(f"layer {i} outside the pool's 0..{self.layout.num_layers - 1}")
        return i

    def _block_ids(self, block_ids: BlockIds, *, unique: bool) -> list[int]:
        """``block_ids`` as ints inside the pool; raises `InvalidRequest` otherwise."""
        if isinstance(block_ids, np.ndarray):
            if block_ids.ndim != 1 or block_ids.dtype.kind not in "iu":
                raise InvalidRequest(
                    f"block ids must be a 1-D integer array, got {block_ids.dtype} "
                    f"of shape {block_ids.shape}"
                )
            block_ids = block_ids.tolist()
        elif not isinstance(block_ids, Sequence):
            try:  # a CPU torch tensor of ids, or another array-like
                arr = np.asarray(block_ids)
            except (TypeError, ValueError, RuntimeError):
                raise InvalidRequest(f"block ids must be integers, got {block_ids!r}") from None
            return self._block_ids(arr, unique=unique)
        n = self.layout.num_blocks
        if type(block_ids) is list and all(type(b) is int and 0 <= b < n for b in block_ids):
            ids: list[int] = block_ids  # the common case, checked in one pass
        else:
            ids = [self._block_id(b) for b in block_ids]
        if unique and len(set(ids)) != len(ids):
            raise InvalidRequest(f"a block id is given twice: {ids}")
        return ids

    def _block_id(self, block_id: int) -> int:
        """``block_id`` as an int inside the pool; raises `InvalidRequest` otherwise."""
        try:
            b = operator.index(block_id)
        except TypeError:
            raise InvalidRequest(f"a block id must be an integer, got {block_id!r}") from None
        if not 0 <= b < self.layout.num_blocks:
            raise InvalidRequest(f"block id {b} outside the pool's 0..{self.layout.num_blocks - 1}")
        return b

    def _kv(self, kv: object, shape: tuple[int, ...], what: str) -> KV:
        """``kv`` checked against ``shape`` and the pool's dtype.

        Raises `InvalidRequest` for another type, shape or dtype, or a
        read-only numpy ``out``.
        """
        if isinstance(kv, np.ndarray):
            found: tuple[int, ...] = kv.shape
            dtype, expected = kv.dtype, np.dtype(NUMPY_DTYPES[self.layout.dtype])
            if what == "out" and not kv.flags.writeable:
                raise InvalidRequest("out is a read-only array")
        else:
            import torch  # noqa: PLC0415 - optional dependency, needed only for tensors

            if not isinstance(kv, torch.Tensor):
                raise InvalidRequest(
                    f"{what} must be a torch tensor or a numpy array, got {type(kv).__name__}"
                )
            found, dtype, expected = tuple(kv.shape), kv.dtype, getattr(torch, self.layout.dtype)
        if found != shape:
            raise InvalidRequest(f"{what} has shape {found}, the pool's blocks need {shape}")
        if dtype != expected:
            raise InvalidRequest(f"{what} holds {dtype}, the pool holds {expected}")
        return kv

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
        #: Every block: ``[num_layers, 2, num_blocks, block_size, heads, head_dim]``.
        #: Block and run views are slices of it (a fresh ``np.ndarray`` on the
        #: mmap costs microseconds, a slice a fraction of one).
        self._all: npt.NDArray[Any] = np.ndarray(
            (
                layout.num_layers,
                2,
                layout.num_blocks,
                layout.block_size,
                layout.num_kv_heads,
                layout.head_dim,
            ),
            dtype=self._dtype,
            buffer=mapping,
            offset=base,
            strides=layout.blocks_strides(),
        )
        self._block_shape = self._shape(None)

    @classmethod
    def open(cls, memory: dict[str, Any], layout: PoolLayout) -> PoolMapping:
        """Map the handle ``{"backend": "shm", "path", "size", "offset"}`` (shared per process).

        A ``paged`` layout maps as `ShmPages`, any other as `ShmPool`.

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
                kind = ShmPages if layout.order == "paged" else ShmPool
                return kind(layout, memory, mapping, base)

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
        if not 0 <= b < self.layout.num_blocks:
            raise IndexError(f"no block {b} in 0..{self.layout.num_blocks - 1}")
        return self._all[:, :, b]

    def np_blocks(self, first: int, count: int) -> npt.NDArray[Any]:
        """Blocks ``first..first+count-1`` as a numpy view (shape as `blocks`)."""
        n = self.layout.num_blocks
        if not (first >= 0 and count > 0 and first + count <= n):
            raise IndexError(f"no blocks {first}..{first + count - 1} in 0..{n - 1}")
        return self._all[:, :, first : first + count]

    def layer(self, i: int) -> torch.Tensor:
        return _torch_of(self.np_layer(i), self.layout.dtype)

    def block(self, b: int) -> torch.Tensor:
        return _torch_of(self.np_block(b), self.layout.dtype)

    def blocks(self, first: int, count: int) -> torch.Tensor:
        return _torch_of(self.np_blocks(first, count), self.layout.dtype)

    # After a 2 MiB copy has flushed the caches each Python or torch call here
    # costs several times what it costs hot (torch's most): arrays of the right
    # shape and dtype, and CPU tensors made into such arrays by one call, take
    # a lean path. Anything else (a device tensor, autograd, a wrong id, shape
    # or dtype) takes the checked one, which raises or copies.

    def write_block(self, block_id: int, src: KV) -> None:
        arr = self._array(src, self._block_shape, writable=False)
        if arr is None or type(block_id) is not int or not 0 <= block_id < self.layout.num_blocks:
            super().write_block(block_id, src)
        else:
            np.copyto(self._all[:, :, block_id], arr)

    def read_block(self, block_id: int, out: KV) -> None:
        arr = self._array(out, self._block_shape, writable=True)
        if arr is None or type(block_id) is not int or not 0 <= block_id < self.layout.num_blocks:
            super().read_block(block_id, out)
        else:
            np.copyto(arr, self._all[:, :, block_id])

    def write_layer(self, layer: int, block_ids: BlockIds, src: KV) -> None:
        ids = self._block_ids(block_ids, unique=True)
        arr = self._array(src, self._shape(len(ids), True), writable=False)
        if arr is None or type(layer) is not int or not 0 <= layer < self.layout.num_layers:
            super().write_layer(layer, ids, src)
            return
        for pos, first, count in _runs(ids):
            np.copyto(self._all[layer, :, first : first + count], arr[:, pos : pos + count])

    def read_layer(self, layer: int, block_ids: BlockIds, out: KV) -> None:
        ids = self._block_ids(block_ids, unique=False)
        arr = self._array(out, self._shape(len(ids), True), writable=True)
        if arr is None or type(layer) is not int or not 0 <= layer < self.layout.num_layers:
            super().read_layer(layer, ids, out)
            return
        for pos, first, count in _runs(ids):
            np.copyto(arr[:, pos : pos + count], self._all[layer, :, first : first + count])

    def _array(self, kv: object, shape: tuple[int, ...], writable: bool) -> npt.NDArray[Any] | None:
        """``kv`` as an array of the pool's dtype and ``shape`` on its memory, or None."""
        if type(kv) is not np.ndarray:
            try:
                kv = _numpy_of(cast("torch.Tensor", kv), self.layout.dtype)
            except (AttributeError, TypeError, RuntimeError):
                return None
        if kv.shape != shape or kv.dtype != self._dtype or (writable and not kv.flags.writeable):
            return None
        return kv

    def _kv(self, kv: object, shape: tuple[int, ...], what: str) -> KV:
        """Checked ``kv``; a CPU tensor becomes a numpy array of its memory (device ones stay)."""
        arr = self._array(kv, shape, writable=what == "out")
        if arr is not None:
            return arr
        checked = super()._kv(kv, shape, what)  # raises for anything but tensors and arrays
        if isinstance(checked, np.ndarray) or checked.device.type != "cpu":
            return checked
        return _numpy_of(checked.detach(), self.layout.dtype)  # autograd tracked it

    def _write(self, ids: list[int], src: KV, layers: slice) -> None:
        """Arrays: one ``np.copyto`` per run of blocks; device tensors through torch."""
        if not isinstance(src, np.ndarray):
            super()._write(ids, src, layers)
            return
        for pos, first, count in _runs(ids):
            np.copyto(self._all[layers, :, first : first + count], src[:, :, pos : pos + count])

    def _read(self, ids: list[int], out: KV, layers: slice) -> None:
        """Arrays: one ``np.copyto`` per run of blocks; device tensors through torch."""
        if not isinstance(out, np.ndarray):
            super()._read(ids, out, layers)
            return
        for pos, first, count in _runs(ids):
            np.copyto(out[:, :, pos : pos + count], self._all[layers, :, first : first + count])

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if len(src) != len(dst):
            raise InternalError(f"{len(src)} copy sources for {len(dst)} destinations")
        if not src:
            return
        self._check_blocks(src, dst)
        kv = self._all
        kv[:, :, np.asarray(dst)] = kv[:, :, np.asarray(src)]

    def fence(self) -> None:
        """Nothing to wait for: CPU writes through the mapping are done when they return."""


class ShmPages(PoolMapping):
    """A ``paged`` pool in shared memory: per layer ``num_blocks`` opaque engine pages.

    Mapped by `ShmPool.open` for a ``paged`` layout. `pages` / `np_pages` view
    them; `copy_blocks` copies whole pages. Every view and copy in kvd's K/V
    layout raises `LayoutMismatch`: the pages' packing is the engine's
    (``layout.format``), so no kvd-layout reader may be handed them.
    """

    BACKEND = "shm"

    def __init__(
        self, layout: PoolLayout, memory: dict[str, Any], mapping: mmap.mmap, base: int
    ) -> None:
        super().__init__(layout, memory)
        self._mmap = mapping
        self._base = base
        item = layout.itemsize
        #: Every page: ``[num_layers, num_blocks, page_elems]`` (layer regions page-aligned).
        self._pages: npt.NDArray[Any] = np.ndarray(
            (layout.num_layers, layout.num_blocks, layout.page_bytes // item),
            dtype=np.dtype(NUMPY_DTYPES[layout.dtype]),
            buffer=mapping,
            offset=base,
            strides=(layout.layer_stride, layout.page_bytes, item),
        )

    def buffer(self) -> memoryview:
        """The pool's bytes (``layout.total_bytes`` from the pool's first byte)."""
        return memoryview(self._mmap)[self._base : self._base + self.layout.total_bytes]

    def np_pages(self, layer: int) -> npt.NDArray[Any]:
        """Layer ``layer``'s pages as a numpy view ``[num_blocks, page_elems]``."""
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} outside the pool's 0..{self.layout.num_layers - 1}")
        page: npt.NDArray[Any] = self._pages[layer]
        return page

    def pages(self, layer: int) -> torch.Tensor:
        return _torch_of(self.np_pages(layer), self.layout.dtype)

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy page ``src[i]`` to ``dst[i]`` in every layer (copy-on-write of whole pages)."""
        if len(src) != len(dst):
            raise InternalError(f"{len(src)} copy sources for {len(dst)} destinations")
        if not src:
            return
        self._check_blocks(src, dst)
        self._pages[:, np.asarray(dst)] = self._pages[:, np.asarray(src)]

    def fence(self) -> None:
        """Nothing to wait for: CPU writes through the mapping are done when they return."""

    def _opaque(self) -> LayoutMismatch:
        return LayoutMismatch(
            f"pool pages are {self.layout.format!r}, opaque to kvd: no view or copy in "
            "kvd's K/V layout exists for them (pages() gives the engine's pages)"
        )

    def layer(self, i: int) -> torch.Tensor:
        raise self._opaque()

    def layers(self) -> list[torch.Tensor]:
        raise self._opaque()

    def block(self, b: int) -> torch.Tensor:
        raise self._opaque()

    def blocks(self, first: int, count: int) -> torch.Tensor:
        raise self._opaque()

    def write_block(self, block_id: int, src: KV) -> None:
        raise self._opaque()

    def write_blocks(self, block_ids: BlockIds, src: KV) -> None:
        raise self._opaque()

    def write_layer(self, layer: int, block_ids: BlockIds, src: KV) -> None:
        raise self._opaque()

    def read_block(self, block_id: int, out: KV) -> None:
        raise self._opaque()

    def read_blocks(self, block_ids: BlockIds, out: KV) -> None:
        raise self._opaque()

    def read_layer(self, layer: int, block_ids: BlockIds, out: KV) -> None:
        raise self._opaque()


def _torch_of(arr: npt.NDArray[Any], dtype: str) -> torch.Tensor:
    """A numpy array of `NUMPY_DTYPES`' dtype as a tensor of the pool ``dtype`` (same memory)."""
    import torch  # noqa: PLC0415 - optional dependency, imported on first torch view

    if dtype == "bfloat16":
        # torch's uint16 supports few ops; int16 has the same bits and views to bf16.
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    tensor = torch.from_numpy(arr)
    if dtype in RAW_DTYPES:
        return tensor.view(getattr(torch, dtype))
    return tensor


def _numpy_of(tensor: torch.Tensor, dtype: str) -> npt.NDArray[Any]:
    """A CPU tensor of the pool ``dtype`` as a numpy array of `NUMPY_DTYPES`' dtype (same bits).

    Raises TypeError for a tensor of a `RAW_DTYPES` dtype other than ``dtype``,
    and whatever ``Tensor.numpy`` raises (TypeError off the CPU or for dtypes
    numpy lacks, RuntimeError when autograd tracks the tensor). Other dtypes
    come back as numpy has them: the caller checks.
    """
    via = _RAW_VIA.get(dtype)
    if via is None:
        return tensor.numpy()
    import torch  # noqa: PLC0415 - a tensor was given: torch is there

    if tensor.dtype != getattr(torch, dtype):
        raise TypeError(f"a {tensor.dtype} tensor for a {dtype} pool")
    return tensor.view(getattr(torch, via)).numpy().view(NUMPY_DTYPES[dtype])


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position, first id, count)`` of each run of consecutive ids, in order."""
    runs = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


register_backend(ShmPool.BACKEND, ShmPool.open)
