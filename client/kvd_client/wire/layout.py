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

``paged``: an engine's own KV pages, opaque to kvd. Per layer one region of
``num_blocks`` pages of ``2 * slot_bytes`` bytes (the bytes per block of the
other orders), each page one contiguous span whose inner packing is the
engine's, named by ``format`` (e.g. ``"vllm/0.32.0/cpu/LBHNC/float32"``:
vLLM's CPU layer tensor ``[num_blocks, heads, block_size, 2 * head_dim]``,
so a page is one vLLM block of one layer, byte for byte). ``format`` is part
of the layout's equality: a second engine of the same fingerprint attaches,
anything else (kvd's own orders included) is refused with MISMATCH. The K/V
slot geometry (`offset`, `layer_strides`, `blocks_strides`) does not exist for
such a pool and raises `OpaqueLayout`; `page_offset` is where a page lives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

__all__ = [
    "DTYPE_SIZES",
    "MAX_FORMAT_LEN",
    "PAGE",
    "POOL_ALIGN",
    "OpaqueLayout",
    "Order",
    "PoolLayout",
    "round_up",
]

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

Order = Literal["layer_major", "block_major", "paged"]
_ORDERS: Final = ("layer_major", "block_major", "paged")
#: Longest engine fingerprint (`PoolLayout.format`).
MAX_FORMAT_LEN: Final = 256


class OpaqueLayout(ValueError):
    """kvd's K/V geometry was asked of a ``paged`` pool, whose pages are an engine's own."""


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
    #: The engine fingerprint of a ``paged`` pool's pages; empty for kvd's own orders.
    format: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if self.order not in _ORDERS:
            raise ValueError(f"order must be one of {_ORDERS}, got {self.order!r}")
        if type(self.format) is not str or len(self.format) > MAX_FORMAT_LEN:
            raise ValueError(f"format must be a string of at most {MAX_FORMAT_LEN} characters")
        if (self.order == "paged") != bool(self.format):
            raise ValueError("a paged pool needs its engine's format; only a paged pool has one")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def slot_bytes(self) -> int:
        """Bytes of K (or V) of one block in one layer: ``block_size*heads*head_dim``."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one block in one layer, K and V: ``2 * slot_bytes`` (a paged pool's page)."""
        return 2 * self.slot_bytes

    @property
    def layer_stride(self) -> int:
        """layer_major, paged: bytes from one layer's region to the next (page-aligned)."""
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
        if self.order == "block_major":
            return self.num_blocks * self.block_stride
        return self.num_layers * self.layer_stride

    @property
    def total_bytes(self) -> int:
        """The pool's size: `used_bytes` rounded up to `POOL_ALIGN`."""
        return round_up(self.used_bytes, POOL_ALIGN)

    def offset(self, layer: int, kv: int, block: int) -> int:
        """Byte offset of K (``kv=0``) or V (``kv=1``) of ``block`` in ``layer``."""
        if not (0 <= layer < self.num_layers and kv in (0, 1) and 0 <= block < self.num_blocks):
            raise IndexError(f"no slot (layer={layer}, kv={kv}, block={block}) in {self}")
        self._kvd_order()
        if self.order == "layer_major":
            return layer * self.layer_stride + (kv * self.num_blocks + block) * self.slot_bytes
        return block * self.block_stride + (layer * 2 + kv) * self.slot_bytes

    def layer_strides(self) -> tuple[int, int, int, int, int]:
        """Byte strides of a layer view ``[2, num_blocks, block_size, heads, head_dim]``."""
        self._kvd_order()
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
        inner = self.layer_strides()[2:]  # OpaqueLayout for a paged pool
        if self.order == "layer_major":
            return (self.layer_stride, self.num_blocks * self.slot_bytes, self.slot_bytes, *inner)
        return (2 * self.slot_bytes, self.slot_bytes, self.block_stride, *inner)

    def layer_offset(self, layer: int) -> int:
        """Byte offset of element ``[0, 0, 0, 0, 0]`` of layer ``layer``'s view."""
        return self.offset(layer, 0, 0)

    def page_offset(self, layer: int, block: int) -> int:
        """paged: byte offset of the page of ``block`` in ``layer`` (its ``page_bytes`` follow)."""
        if self.order != "paged":
            raise ValueError(f"a {self.order} pool has K/V slots, not pages: use offset()")
        if not (0 <= layer < self.num_layers and 0 <= block < self.num_blocks):
            raise IndexError(f"no page (layer={layer}, block={block}) in {self}")
        return layer * self.layer_stride + block * self.page_bytes

    def _kvd_order(self) -> None:
        if self.order == "paged":
            raise OpaqueLayout(
                f"pool pages are {self.format!r}, opaque to kvd: they have no K/V slots "
                "(kvd's views and copies apply to layer_major and block_major pools)"
            )

    def to_dict(self) -> dict[str, Any]:
        """The msgpack-ready form sent in the hello and its reply (``format`` always there;
        readers before it ignore the key)."""
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
                format=d.get("format", ""),
            )
        except KeyError as exc:
            raise ValueError(f"layout is missing {exc.args[0]!r}") from None
