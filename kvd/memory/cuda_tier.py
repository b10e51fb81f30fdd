"""Tier 1 of a ``cuda`` pool: pinned host memory, copied by the GPU's copy engines.

``cudaHostAlloc`` reserves and pins the tier at creation (its pages are
resident from then on, the pinned equivalent of a prefaulted segment), laid
out as the pool with ``tier_blocks`` blocks (`tier.tier_layout`). A copy is
one ``cudaMemcpyAsync`` per run of consecutive blocks and per layer and K/V
(one per run in ``block_major``) on a stream of its own, then a stream
synchronise, in the caller's worker thread: a committed block's bytes are
final on the device once its writer committed (the writing stream has
finished), and a promoted block is in place when `load` returns, before the
daemon publishes it. cupy is imported on use, as by the pool itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Final

from kvd_client.wire import PoolLayout, round_up

from kvd.memory.cuda import CUDA_ALIGN, CudaAllocation
from kvd.memory.gpuinfo import cupy_module
from kvd.memory.tier import runs, tier_layout

__all__ = ["PinnedHostTier"]

#: ``cudaMemcpyHostToDevice`` and ``cudaMemcpyDeviceToHost``.
_TO_DEVICE: Final = 1
_TO_HOST: Final = 2


def _spans(
    src: PoolLayout, s0: int, dst: PoolLayout, d0: int, n: int
) -> Iterator[tuple[int, int, int]]:
    """``(src offset, dst offset, bytes)`` of blocks ``s0..s0+n-1`` -> ``d0..``: a run's
    blocks are one span per layer and K/V (``layer_major``), one span (``block_major``)."""
    if src.order == "block_major":
        yield s0 * src.block_stride, d0 * dst.block_stride, n * src.block_stride
        return
    for layer in range(src.num_layers):
        for kv in (0, 1):
            yield src.offset(layer, kv, s0), dst.offset(layer, kv, d0), n * src.slot_bytes


class PinnedHostTier:
    """Tier 1 of a cuda pool in pinned host memory (a `tier.TierStore`)."""

    level = 1

    def __init__(
        self, pool: CudaAllocation, layout: PoolLayout, host: int, size: int, stream: Any
    ) -> None:
        self._pool = pool
        self._layout = layout
        self._host: int | None = host
        self._size = size
        #: One stream for both directions (the CUDA API is thread-safe; copies queue on it).
        self._stream = stream
        self.block_bytes = pool.layout.num_layers * pool.layout.page_bytes

    @classmethod
    def create(cls, pool: CudaAllocation, tier_blocks: int) -> PinnedHostTier:
        """Pin ``tier_blocks`` blocks of host memory for ``pool`` (blocking)."""
        layout = tier_layout(pool.layout, tier_blocks)
        size = round_up(layout.total_bytes, CUDA_ALIGN)
        cupy = cupy_module()
        with cupy.cuda.Device(pool.device):
            host = int(cupy.cuda.runtime.hostAlloc(size, 0))
            stream = cupy.cuda.Stream(non_blocking=True)
        return cls(pool, layout, host, size, stream)

    def _move(self, ids: tuple[Sequence[int], Sequence[int]], to_host: bool) -> None:
        """Copy pool -> host (``to_host``) or host -> pool, ``ids`` = (sources, destinations)."""
        if self._host is None:
            raise ValueError("tier memory is closed")
        cupy = cupy_module()
        pool, tier = self._pool.layout, self._layout
        src_layout, dst_layout = (pool, tier) if to_host else (tier, pool)
        src_base, dst_base = (self._pool.ptr, self._host)
        if not to_host:
            src_base, dst_base = dst_base, src_base
        kind = _TO_HOST if to_host else _TO_DEVICE
        with cupy.cuda.Device(self._pool.device):
            copy, stream = cupy.cuda.runtime.memcpyAsync, self._stream
            for s0, d0, n in runs(*ids):
                for so, do, nbytes in _spans(src_layout, s0, dst_layout, d0, n):
                    copy(dst_base + do, src_base + so, nbytes, kind, stream.ptr)
            stream.synchronize()

    def store(self, blocks: Sequence[int], slots: Sequence[int], keys: Sequence[bytes]) -> int:
        """Pool ``blocks`` -> tier ``slots`` (device to host); the bytes moved."""
        self._move((blocks, slots), to_host=True)
        return len(blocks) * self.block_bytes

    def load(self, slots: Sequence[int], blocks: Sequence[int], keys: Sequence[bytes]) -> int:
        """Tier ``slots`` -> pool ``blocks`` (host to device); the bytes moved."""
        self._move((slots, blocks), to_host=False)
        return len(blocks) * self.block_bytes

    def info(self) -> dict[str, Any]:
        """The tier's kind, device and size."""
        return {"kind": "pinned", "device": self._pool.device, "size": self._size}

    def close(self) -> None:
        """Unpin and free the host memory (idempotent)."""
        if self._host is None:
            return
        host, self._host = self._host, None
        cupy_module().cuda.runtime.freeHost(host)
