"""Where a block's bytes live in a pool: the one definition both sides use.

The daemon (``kvd.memory``) sizes and creates pools from a `PoolLayout`;
clients build their views from the same object, received in the hello
reply. Offsets are bytes from the start of the pool's mapping.

``layer_major`` (default): per layer one ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` tensor (K then V), the shape paged-attention
kernels index. ``block_major``: each block one contiguous span
``[num_layers, 2, block_size, num_kv_heads, head_dim]``, best for copying
a block out whole. Layer regions and blocks start page-aligned (copies
whose ends differ by 64 bytes mod 4096 ran three times slower here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

__all__ = ["DTYPE_SIZES", "PAGE", "POOL_ALIGN", "Order", "PoolLayout", "round_up"]

#: Bytes per element of each supported dtype (torch's names).
DTYPE_SIZES: Final[dict[str, int]] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

#: Alignment of every layer region (layer_major) and block (block_major).
PAGE: Final = 4096
#: Pools are sized in whole 2 MiB units (huge pages on CPU, CUDA's granularity).
POOL_ALIGN: Final = 2 * 1024 * 1024

Order = Literal["layer_major", "block_major"]
_ORDERS: Final = ("layer_major", "block_major")


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """The shape of one pool: a model's KV geometry and the block count."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    num_blocks: int
    order: Order = "layer_major"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if self.order not in _ORDERS:
            raise ValueError(f"order must be one of {_ORDERS}, got {self.order!r}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def slot_bytes(self) -> int:
        """Bytes of K (or V) of one block in one layer: ``block_size*heads*head_dim``."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layer_stride(self) -> int:
        """layer_major: bytes from one layer's region to the next (page-aligned)."""
        return round_up(2 * self.num_blocks * self.slot_bytes, PAGE)

    @property
    def block_stride(self) -> int:
        """block_major: bytes from one block's span to the next (page-aligned)."""
        return round_up(self.num_layers * 2 * self.slot_bytes, PAGE)

    @property
    def kv_bytes_per_block(self) -> int:
        """Payload bytes of one block over all layers, K and V (no padding)."""
        return self.num_layers * 2 * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes covered by the layout (before rounding to `POOL_ALIGN`)."""
        if self.order == "layer_major":
            return self.num_layers * self.layer_stride
        return self.num_blocks * self.block_stride

    @property
    def total_bytes(self) -> int:
        """The pool's size: `used_bytes` rounded up to `POOL_ALIGN`."""
        return round_up(self.used_bytes, POOL_ALIGN)

    def offset(self, layer: int, kv: int, block: int) -> int:
        """Byte offset of K (``kv=0``) or V (``kv=1``) of ``block`` in ``layer``."""
        if not (0 <= layer < self.num_layers and kv in (0, 1) and 0 <= block < self.num_blocks):
            raise IndexError(f"no slot (layer={layer}, kv={kv}, block={block}) in {self}")
        if self.order == "layer_major":
            return layer * self.layer_stride + (kv * self.num_blocks + block) * self.slot_bytes
        return block * self.block_stride + (layer * 2 + kv) * self.slot_bytes

    def layer_strides(self) -> tuple[int, int, int, int, int]:
        """Byte strides of a layer view ``[2, num_blocks, block_size, heads, head_dim]``."""
        item = self.itemsize
        token = self.num_kv_heads * self.head_dim * item
        inner = (token, self.head_dim * item, item)
        if self.order == "layer_major":
            return (self.num_blocks * self.slot_bytes, self.slot_bytes, *inner)
        return (self.slot_bytes, self.block_stride, *inner)

    def blocks_strides(self) -> tuple[int, int, int, int, int, int]:
        """Byte strides of a run view ``[num_layers, 2, count, block_size, heads, head_dim]``.

        The run is blocks ``first..first+count-1``, its element ``[0, 0, 0, 0, 0, 0]``
        at ``offset(0, 0, first)``. ``layer_major``: the blocks of a run are one
        contiguous span per layer and K/V; ``block_major``: one span per block.
        Without the block axis (``count=1``) it is the view of one block.
        """
        inner = self.layer_strides()[2:]
        if self.order == "layer_major":
            return (self.layer_stride, self.num_blocks * self.slot_bytes, self.slot_bytes, *inner)
        return (2 * self.slot_bytes, self.slot_bytes, self.block_stride, *inner)

    def layer_offset(self, layer: int) -> int:
        """Byte offset of element ``[0, 0, 0, 0, 0]`` of layer ``layer``'s view."""
        return self.offset(layer, 0, 0)

    def to_dict(self) -> dict[str, Any]:
        """The msgpack-ready form sent in the hello reply."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolLayout:
        """Inverse of `to_dict`; raises ValueError on missing or bad fields."""
        try:
            return cls(
                num_layers=d["num_layers"],
                num_kv_heads=d["num_kv_heads"],
                head_dim=d["head_dim"],
                dtype=d["dtype"],
                block_size=d["block_size"],
                num_blocks=d["num_blocks"],
                order=d.get("order", "layer_major"),
            )
        except KeyError as exc:
            raise ValueError(f"layout is missing {exc.args[0]!r}") from None
