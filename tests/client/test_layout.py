"""The pool layout: sizes, page alignment and where each block's bytes live."""

from __future__ import annotations

import itertools

import pytest
from kvd_client.wire import PAGE, POOL_ALIGN, PoolLayout


def _layout(**kw: object) -> PoolLayout:
    base: dict[str, object] = {
        "num_layers": 3,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float16",
        "block_size": 4,
        "num_blocks": 5,
    }
    base.update(kw)
    return PoolLayout(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_every_slot_is_distinct_and_inside_the_pool(order: str) -> None:
    layout = _layout(order=order)
    spans = sorted(
        (layout.offset(layer, kv, block), layout.slot_bytes)
        for layer in range(layout.num_layers)
        for kv in (0, 1)
        for block in range(layout.num_blocks)
    )
    for (start, size), (nxt, _) in itertools.pairwise(spans):
        assert start + size <= nxt
    last_start, last_size = spans[-1]
    assert last_start + last_size <= layout.used_bytes <= layout.total_bytes


def test_layer_major_is_what_paged_attention_indexes() -> None:
    layout = _layout()
    # [2, num_blocks, block_size, heads, head_dim] contiguous per layer.
    assert layout.offset(1, 1, 2) == layout.layer_stride + (5 + 2) * layout.slot_bytes


def test_block_major_keeps_each_block_contiguous() -> None:
    layout = _layout(order="block_major")
    first = layout.offset(0, 0, 2)
    last = layout.offset(2, 1, 2)
    assert last + layout.slot_bytes - first == layout.kv_bytes_per_block


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_regions_start_page_aligned(order: str) -> None:
    layout = _layout(order=order, num_blocks=7)
    stride = layout.layer_stride if order == "layer_major" else layout.block_stride
    assert stride % PAGE == 0
    assert layout.total_bytes % POOL_ALIGN == 0


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_layer_strides_address_the_same_bytes_as_offset(order: str) -> None:
    layout = _layout(order=order)
    s_kv, s_block, s_tok, s_head, s_dim = layout.layer_strides()
    for layer in range(layout.num_layers):
        base = layout.layer_offset(layer)
        for kv in (0, 1):
            for block in range(layout.num_blocks):
                assert base + kv * s_kv + block * s_block == layout.offset(layer, kv, block)
    assert s_dim == layout.itemsize
    assert s_head == layout.head_dim * layout.itemsize
    assert s_tok == layout.num_kv_heads * s_head


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_blocks_strides_address_the_same_bytes_as_offset(order: str) -> None:
    layout = _layout(order=order)
    s_layer, s_kv, s_block, *inner = layout.blocks_strides()
    first = layout.offset(0, 0, 1)
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            for block in range(1, layout.num_blocks):
                at = first + layer * s_layer + kv * s_kv + (block - 1) * s_block
                assert at == layout.offset(layer, kv, block)
    assert tuple(inner) == layout.layer_strides()[2:]


def test_dict_round_trip() -> None:
    layout = _layout(order="block_major", dtype="bfloat16")
    assert PoolLayout.from_dict(layout.to_dict()) == layout


def test_missing_field_is_a_clear_error() -> None:
    d = _layout().to_dict()
    del d["head_dim"]
    with pytest.raises(ValueError, match="head_dim"):
        PoolLayout.from_dict(d)


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_blocks", 0), ("head_dim", -1), ("block_size", 1.5), ("dtype", "int4"), ("order", "x")],
)
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        _layout(**{field: value})


def test_offset_outside_the_pool_raises() -> None:
    with pytest.raises(IndexError):
        _layout().offset(0, 0, 5)
