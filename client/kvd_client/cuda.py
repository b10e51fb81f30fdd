"""The client side of GPU pools: open a CUDA IPC handle, build torch views.

The daemon allocates each cuda pool as its own device allocation and sends,
in the hello reply, a memory map (`kvd_client.wire.cudamap.CudaMemoryMap`:
an IPC handle, and the GPU's UUID by which a client finds the same GPU
whatever its ``CUDA_VISIBLE_DEVICES``). A process opens each handle once
(CUDA refuses a second open in one process; every `CudaPool` of a handle
shares it) and builds zero-copy
torch views through ``__cuda_array_interface__``, with the same shapes as
every other backend (`layer_views`, `block_view`).

Ordering: the daemon hands a block to another process as soon as
``commit``, ``truncate`` or ``free`` returns, so the client must make sure
its writes (and reads) of those blocks have finished first: `CudaPool.fence`
before such a request. Copy-on-write copies (`copy_blocks`) are queued on
the client's current stream, ahead of the writes that follow them there.

torch and cupy are imported only when used: this module imports on a
machine without them, and says how to install them when they are needed.
Importing it registers the ``cuda`` backend with `kvd_client.pool`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from kvd_client.errors import InternalError, LayoutMismatch
from kvd_client.pool import PoolMapping, register_backend
from kvd_client.wire import PoolLayout
from kvd_client.wire.cudamap import BACKEND, CudaMemoryMap, canonical_uuid, format_uuid

if TYPE_CHECKING:
    import torch

__all__ = [
    "CudaPool",
    "CudaUnavailableError",
    "block_view",
    "copy_blocks",
    "device_uuid",
    "layer_views",
    "load_cupy",
    "load_torch",
    "local_device",
]


class CudaUnavailableError(LayoutMismatch):
    """This process cannot map a cuda pool: cupy or torch missing, or the GPU not visible.

    A `LayoutMismatch`, as for any backend a client cannot map; the message
    says what to install or check.
    """


def load_cupy() -> Any:
    """The ``cupy`` module, or CudaUnavailableError saying how to install it."""
    try:
        import cupy  # noqa: PLC0415 (optional dependency, imported on use)
    except ImportError:
        raise CudaUnavailableError(
            "cupy is not installed: pip install 'kvd[cuda]' (cupy-cuda13x)"
        ) from None
    return cupy


def load_torch() -> Any:
    """The ``torch`` module, or CudaUnavailableError saying how to install it."""
    try:
        import torch  # noqa: PLC0415 (optional dependency, imported on use)
    except ImportError:
        raise CudaUnavailableError("torch is not installed: pip install 'kvd[torch]'") from None
    return torch


def _uuid_from_nvml(cupy: Any, index: int) -> str | None:
    try:
        import pynvml  # noqa: PLC0415 (optional dependency)

        pynvml.nvmlInit()
        bus_id = cupy.cuda.runtime.deviceGetPCIBusId(index)
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        return canonical_uuid(pynvml.nvmlDeviceGetUUID(handle))
    except Exception:  # no module, library or driver, or no answer: try the next source
        return None


def _uuid_from_torch(index: int) -> str | None:
    try:
        import torch  # noqa: PLC0415 (optional dependency)

        return canonical_uuid(str(torch.cuda.get_device_properties(index).uuid))
    except Exception:  # no torch, no CUDA in torch, or no uuid field: no answer
        return None


def device_uuid(index: int) -> str:
    """The ``GPU-…`` UUID of this process's CUDA device ``index``.

    cupy returns ``cudaDeviceProp.uuid`` as a C string, so a UUID holding a
    zero byte comes back cut short; NVML (by PCI bus id) or torch answer then.
    """
    cupy = load_cupy()
    raw = bytes(cupy.cuda.runtime.getDeviceProperties(index).get("uuid", b""))
    if len(raw) == 16:
        return format_uuid(raw)
    uuid = _uuid_from_nvml(cupy, index) or _uuid_from_torch(index)
    if uuid is None:
        raise CudaUnavailableError(
            f"cannot read the UUID of cuda:{index}: cupy cut it short and neither NVML "
            "nor torch answered"
        )
    return uuid


def local_device(uuid: str) -> int:
    """This process's CUDA ordinal of the GPU ``uuid`` (CUDA_VISIBLE_DEVICES may renumber)."""
    count = int(load_cupy().cuda.runtime.getDeviceCount())
    for index in range(count):
        if device_uuid(index) == uuid:
            return index
    raise CudaUnavailableError(
        f"GPU {uuid} is not visible in this process ({count} devices visible): "
        "check CUDA_VISIBLE_DEVICES"
    )


def _close_ipc(cupy: Any, device: int, base: int) -> None:
    try:
        with cupy.cuda.Device(device):
            # Work queued by views that are gone may still run: let it finish first.
            cupy.cuda.runtime.deviceSynchronize()
            cupy.cuda.runtime.ipcCloseMemHandle(base)
    except cupy.cuda.runtime.CUDARuntimeError:
        # The context is already gone (interpreter exit): the driver unmaps for us.
        pass


class _IpcMemory:
    """One opened IPC handle in this process; unmapped when the last user drops it."""

    def __init__(self, handle: bytes, device: int) -> None:
        cupy = load_cupy()
        with cupy.cuda.Device(device):
            try:
                self.base = int(cupy.cuda.runtime.ipcOpenMemHandle(handle))
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise CudaUnavailableError(
                    f"cannot open the pool's CUDA IPC handle on cuda:{device}: {exc} "
                    "(a process cannot open a handle it exported itself)"
                ) from None
        finalizer = weakref.finalize(self, _close_ipc, cupy, device, self.base)
        finalizer.atexit = False


class _DeviceBytes:
    """``__cuda_array_interface__`` of a byte span; keeps its mapping alive for torch."""

    def __init__(self, memory: _IpcMemory, ptr: int, nbytes: int) -> None:
        self.memory = memory
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


_OPENED: weakref.WeakValueDictionary[tuple[str, bytes], _IpcMemory] = weakref.WeakValueDictionary()
_OPENED_LOCK: Final = threading.Lock()


def _open(handle: bytes, device: int, uuid: str) -> _IpcMemory:
    with _OPENED_LOCK:
        memory = _OPENED.get((uuid, handle))
        if memory is None:
            memory = _IpcMemory(handle, device)
            _OPENED[(uuid, handle)] = memory
        return memory


def _check_raw(raw: torch.Tensor, layout: PoolLayout) -> None:
    th = load_torch()
    if raw.dtype != th.uint8 or raw.dim() != 1 or not raw.is_contiguous():
        raise ValueError("the pool's bytes must be a contiguous 1-D uint8 tensor")
    if raw.numel() < layout.used_bytes:
        raise ValueError(f"{raw.numel()} bytes cannot hold the layout's {layout.used_bytes}")


def _typed(raw: torch.Tensor, layout: PoolLayout) -> torch.Tensor:
    """``raw`` reinterpreted as the layout's dtype (whole elements only)."""
    item = layout.itemsize
    return raw[: raw.numel() // item * item].view(getattr(load_torch(), layout.dtype))


def layer_views(raw: torch.Tensor, layout: PoolLayout) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` view per layer.

    ``raw`` is the pool's bytes as a contiguous 1-D uint8 tensor on any
    device (a cuda pool's mapping, or any other memory); views share it.
    """
    th = load_torch()
    _check_raw(raw, layout)
    item = layout.itemsize
    typed = _typed(raw, layout)
    shape = (2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    strides = tuple(s // item for s in layout.layer_strides())
    return [
        th.as_strided(typed, shape, strides, layout.layer_offset(layer) // item)
        for layer in range(layout.num_layers)
    ]


def block_view(raw: torch.Tensor, layout: PoolLayout, b: int) -> torch.Tensor:
    """Block ``b`` over all layers, ``[num_layers, 2, block_size, num_kv_heads, head_dim]``.

    Zero-copy in both orders: contiguous for ``block_major``, strided (one
    slot per layer and K/V) for ``layer_major``. ``raw`` as for `layer_views`.
    """
    th = load_torch()
    _check_raw(raw, layout)
    start = layout.offset(0, 0, b)  # IndexError outside the pool
    item = layout.itemsize
    inner = layout.layer_strides()[2:]
    if layout.order == "layer_major":
        outer = (layout.layer_stride, layout.num_blocks * layout.slot_bytes)
    else:
        outer = (2 * layout.slot_bytes, layout.slot_bytes)
    shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    strides = tuple(s // item for s in (*outer, *inner))
    view: torch.Tensor = th.as_strided(_typed(raw, layout), shape, strides, start // item)
    return view


def _pairs(pairs: npt.ArrayLike, num_blocks: int) -> npt.NDArray[np.int64]:
    arr = np.asarray(pairs)
    if arr.size == 0:
        return np.empty((0, 2), dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.size % 2:
        raise ValueError("copies are (src, dst) pairs of block ids")
    arr = arr.astype(np.int64).reshape(-1, 2)
    if int(arr.min()) < 0 or int(arr.max()) >= num_blocks:
        raise ValueError(f"a block id of the copies lies outside [0, {num_blocks})")
    dst = arr[:, 1]
    if len(np.unique(dst)) != len(dst):
        raise ValueError("two copies write the same block")
    if np.isin(dst, arr[:, 0]).any():
        raise ValueError("a copy writes a block another copy reads")
    return arr


def copy_blocks(
    layers: Sequence[torch.Tensor],
    pairs: npt.ArrayLike,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Copy block ``src`` to ``dst`` in every layer, K and V, for each pair.

    ``pairs`` is ``[(src, dst), ...]`` or the flat ``[src, dst, ...]`` of an
    append reply. On a GPU the copies are queued on ``stream`` (default: the
    current stream), so later writes on that stream see them; nothing waits.
    Raises ValueError (before copying anything) on ids out of range, a
    block written twice, or a block both read and written.
    """
    if not layers:
        return
    th = load_torch()
    arr = _pairs(pairs, int(layers[0].shape[1]))
    if not len(arr):
        return
    for layer in layers:
        if layer.dim() != 5 or layer.shape[0] != 2 or layer.shape[1] != layers[0].shape[1]:
            raise ValueError(f"not a pool layer view: shape {tuple(layer.shape)}")
    device = layers[0].device
    if any(layer.device != device for layer in layers):
        raise ValueError("the layer views lie on different devices")
    on_stream = th.cuda.stream(stream) if device.type == "cuda" else contextlib.nullcontext()
    with on_stream:
        src = th.from_numpy(arr[:, 0].copy()).to(device)
        dst = th.from_numpy(arr[:, 1].copy()).to(device)
        for layer in layers:
            layer[:, dst] = layer[:, src]


class CudaPool(PoolMapping):
    """A cuda pool mapped in this process: its bytes, torch views, copies and fences.

    Open with `CudaPool.open` (what `kvd_client.pool.open_pool` calls for a
    ``"cuda"`` handle). The IPC handle is opened once per process; every
    `CudaPool` of the same handle shares that mapping, which is closed when
    the last pool object and view are gone.
    """

    BACKEND = BACKEND
    _raw: torch.Tensor

    def __init__(
        self, layout: PoolLayout, memory: dict[str, Any], memory_map: CudaMemoryMap, device: int
    ) -> None:
        super().__init__(layout, memory)
        self.memory_map = memory_map
        #: This process's ordinal of the pool's GPU.
        self.device = device
        ipc = _open(memory_map.handle, device, memory_map.uuid)
        #: Device address of the pool's first byte in this process.
        self.ptr = ipc.base + memory_map.offset
        th = load_torch()
        self._raw = th.as_tensor(
            _DeviceBytes(ipc, self.ptr, memory_map.size), device=th.device("cuda", device)
        )
        if self._raw.data_ptr() != self.ptr:
            raise CudaUnavailableError("torch copied the pool instead of viewing it")

    @classmethod
    def open(cls, memory: dict[str, Any], layout: PoolLayout) -> PoolMapping:
        """Map a hello reply's cuda handle.

        Raises InternalError for a malformed handle, LayoutMismatch when the
        memory is smaller than the layout, and CudaUnavailableError (a
        LayoutMismatch) without cupy or torch, or when the GPU is not visible.
        """
        try:
            memory_map = CudaMemoryMap.from_dict(memory)
        except ValueError as exc:
            raise InternalError(str(exc)) from None
        if memory_map.size < layout.used_bytes:
            raise LayoutMismatch(
                f"pool memory of {memory_map.size} bytes is smaller than its layout's "
                f"{layout.used_bytes}"
            )
        return cls(layout, memory, memory_map, local_device(memory_map.uuid))

    @property
    def raw(self) -> torch.Tensor:
        """The pool's bytes: a 1-D uint8 tensor on the pool's GPU."""
        return self._raw

    def layer(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.layout.num_layers:
            raise IndexError(f"layer {i} outside the pool's 0..{self.layout.num_layers - 1}")
        return self.layers()[i]

    def layers(self) -> list[torch.Tensor]:
        if self._torch_layers is None:
            self._torch_layers = layer_views(self._raw, self.layout)
        return self._torch_layers

    def block(self, b: int) -> torch.Tensor:
        self._check_blocks([b])
        return block_view(self._raw, self.layout, b)

    def blocks(self, first: int, count: int) -> torch.Tensor:
        lay = self.layout
        if not (first >= 0 and count > 0 and first + count <= lay.num_blocks):
            raise IndexError(f"no blocks {first}..{first + count - 1} in 0..{lay.num_blocks - 1}")
        item = lay.itemsize
        shape = (lay.num_layers, 2, count, lay.block_size, lay.num_kv_heads, lay.head_dim)
        strides = tuple(s // item for s in lay.blocks_strides())
        view: torch.Tensor = load_torch().as_strided(
            _typed(self._raw, lay), shape, strides, lay.offset(0, 0, first) // item
        )
        return view

    def copy_blocks(
        self, src: Sequence[int], dst: Sequence[int], stream: torch.cuda.Stream | None = None
    ) -> None:
        """Copy-on-write, queued on ``stream`` (default: the current stream); nothing waits."""
        if len(src) != len(dst):
            raise InternalError(f"{len(src)} copy sources for {len(dst)} destinations")
        if not len(src):
            return
        pairs = np.stack([np.asarray(src), np.asarray(dst)], axis=1)
        try:
            copy_blocks(self.layers(), pairs, stream)
        except ValueError as exc:
            raise InternalError(str(exc)) from None

    def fence(self, stream: torch.cuda.Stream | None = None) -> None:
        """Wait until the work queued on ``stream`` (default: the current one) has finished.

        Call before ``commit``, ``truncate`` or ``free`` so that no other
        process is handed blocks this one is still writing or reading.
        """
        th = load_torch()
        if stream is None:
            stream = th.cuda.current_stream(self.device)
        event = th.cuda.Event()
        event.record(stream)
        event.synchronize()


register_backend(BACKEND, CudaPool.open)
