"""The ``paged`` order: an engine's opaque KV pages, one contiguous page per (layer, block).

Layout arithmetic, format as part of layout equality, the raw page views of a
real pool file, and the refusal of every kvd-layout view and copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from kvd_client.errors import LayoutMismatch
from kvd_client.pool import ShmPages, open_pool
from kvd_client.wire import PAGE, OpaqueLayout, PoolLayout

from .support import shm_handle

PoolFile = Callable[[PoolLayout], Path]

#: vLLM's CPU layer tensor for this is [num_blocks, 2 heads, 32 tokens, 2 * 8].
FMT = "vllm/0.32.0/cpu/LBHNC/float32"
PAGED = PoolLayout(
    num_layers=3,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    block_size=32,
    num_blocks=5,
    order="paged",
    format=FMT,
)


def _pages(pool_file: PoolFile, layout: PoolLayout = PAGED) -> ShmPages:
    pool = open_pool(shm_handle(pool_file(layout), layout), layout)
    assert isinstance(pool, ShmPages)
    return pool


def test_a_page_is_one_engine_block_of_one_layer() -> None:
    page = 2 * 2 * 32 * 8 * 4  # K and V of 2 heads x 32 tokens x 8 dims, float32
    assert PAGED.page_bytes == page == 2 * PAGED.slot_bytes
    assert PAGED.kv_bytes_per_block == 3 * page
    for layer in range(3):
        assert PAGED.page_offset(layer, 0) % PAGE == 0  # each layer region page-aligned
        for b in range(5):
            assert PAGED.page_offset(layer, b) == layer * PAGED.layer_stride + b * page
    last = PAGED.page_offset(2, 4) + page
    assert last <= PAGED.used_bytes <= PAGED.total_bytes


def test_format_is_part_of_the_layout() -> None:
    other = dataclasses.replace(PAGED, format="vllm/0.32.0/cpu/LBHNC/bfloat16")
    kvd_own = dataclasses.replace(PAGED, order="layer_major", format="")
    assert other != PAGED
    assert kvd_own != PAGED
    assert PoolLayout.from_dict(PAGED.to_dict()) == PAGED
    assert PAGED.to_dict()["format"] == FMT
    # A dict from before the field: kvd's own order, no format.
    old = kvd_own.to_dict()
    del old["format"]
    assert PoolLayout.from_dict(old) == kvd_own


@pytest.mark.parametrize(
    ("order", "fmt"),
    [("paged", ""), ("layer_major", FMT), ("block_major", FMT), ("paged", "x" * 257)],
)
def test_a_format_goes_with_paged_and_only_with_paged(order: str, fmt: str) -> None:
    with pytest.raises(ValueError, match="format"):
        dataclasses.replace(PAGED, order=order, format=fmt)


def test_kvd_slot_geometry_does_not_exist_for_pages() -> None:
    for call in (
        lambda: PAGED.offset(0, 0, 0),
        PAGED.layer_strides,
        PAGED.blocks_strides,
        lambda: PAGED.layer_offset(0),
    ):
        with pytest.raises(OpaqueLayout, match="opaque"):
            call()
    with pytest.raises(ValueError, match="not pages"):
        dataclasses.replace(PAGED, order="layer_major", format="").page_offset(0, 0)
    with pytest.raises(IndexError):
        PAGED.page_offset(0, 5)


def test_pages_sit_at_their_offsets_and_are_the_same_memory(pool_file: PoolFile) -> None:
    pool = _pages(pool_file)
    raw = np.frombuffer(pool.buffer(), dtype=np.uint8)
    base = raw.__array_interface__["data"][0]
    for layer in range(3):
        view = pool.pages(layer)
        assert view.shape == (5, PAGED.page_bytes // 4) and view.dtype == torch.float32
        assert view.is_contiguous()
        assert view.data_ptr() - base == PAGED.page_offset(layer, 0)
        view[3] = float(layer + 1)
        start = PAGED.page_offset(layer, 3)
        page = raw[start : start + PAGED.page_bytes].view(np.float32)
        assert (page == layer + 1).all()
    assert (pool.np_pages(1)[3] == 2.0).all()
    with pytest.raises(IndexError):
        pool.pages(3)


def test_an_engine_block_tensor_copies_in_and_out_page_for_page(pool_file: PoolFile) -> None:
    pool = _pages(pool_file)
    engine = torch.randn(7, 2, 32, 16)  # vLLM's [num_blocks, H, N, 2C] for one layer
    pages = pool.pages(1)
    pages[[4, 0]] = engine.view(7, -1)[[2, 6]]
    back = torch.empty_like(engine)
    back.view(7, -1)[[6, 2]] = pages[[0, 4]]
    assert torch.equal(back[2], engine[2]) and torch.equal(back[6], engine[6])


def test_copy_blocks_copies_whole_pages_of_every_layer(pool_file: PoolFile) -> None:
    pool = _pages(pool_file)
    for layer in range(3):
        pool.pages(layer)[1] = float(layer)
    pool.copy_blocks([1], [4])
    for layer in range(3):
        assert torch.equal(pool.pages(layer)[4], pool.pages(layer)[1])


def test_bfloat16_pages_are_raw_in_numpy_and_bfloat16_in_torch(pool_file: PoolFile) -> None:
    layout = dataclasses.replace(PAGED, dtype="bfloat16", format="vllm/0.32.0/cpu/LBHNC/bfloat16")
    pool = _pages(pool_file, layout)
    assert pool.pages(0).dtype == torch.bfloat16
    assert pool.np_pages(0).dtype == np.uint16
    assert pool.pages(0).shape == (5, layout.page_bytes // 2)


def test_kvd_layout_views_and_copies_refuse_engine_pages(pool_file: PoolFile) -> None:
    pool = _pages(pool_file)
    kv = torch.zeros(3, 2, 32, 2, 8)
    for call in (
        lambda: pool.layer(0),
        pool.layers,
        lambda: pool.block(0),
        lambda: pool.blocks(0, 1),
        lambda: pool.write_block(0, kv),
        lambda: pool.read_block(0, kv),
        lambda: pool.write_blocks([0], kv[:, :, None]),
        lambda: pool.read_blocks([0], kv[:, :, None]),
        lambda: pool.write_layer(0, [0], kv[0, :, None]),
        lambda: pool.read_layer(0, [0], kv[0, :, None]),
    ):
        with pytest.raises(LayoutMismatch, match="opaque to kvd"):
            call()


def test_pages_refuse_a_kvd_layout_pool(pool_file: PoolFile) -> None:
    layout = dataclasses.replace(PAGED, order="layer_major", format="")
    pool = open_pool(shm_handle(pool_file(layout), layout), layout)
    with pytest.raises(LayoutMismatch, match="use layer"):
        pool.pages(0)
