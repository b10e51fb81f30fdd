"""kvd_client.pool: write_block, write_blocks, read_block, read_blocks on shm pools."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvd_client.errors import InvalidRequest
from kvd_client.pool import PoolMapping, ShmPool, open_pool
from kvd_client.wire import PoolLayout

from .support import LAYOUT, shm_handle

PoolFile = Callable[[PoolLayout], Path]
ORDERS = ["layer_major", "block_major"]
#: [num_layers, 2, block_size, heads, head_dim] of `LAYOUT`.
BLOCK = (3, 2, 4, 2, 4)


def _open(pool_file: PoolFile, layout: PoolLayout = LAYOUT) -> ShmPool:
    pool = open_pool(shm_handle(pool_file(layout), layout), layout)
    assert isinstance(pool, ShmPool)
    return pool


def _kv(*blocks: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Distinct values per element: ``[3, 2, len(blocks), 4, 2, 4]``, or one block for ()."""
    shape = (3, 2, *blocks, 4, 2, 4)
    n = int(np.prod(shape))
    return (torch.arange(n, dtype=torch.float32) % 251 + 1).reshape(shape).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (compares bfloat16 and float8 exactly)."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
def test_write_block_lands_in_the_layer_views(pool_file: PoolFile, order: str, dtype: str) -> None:
    layout = dataclasses.replace(LAYOUT, order=order, dtype=dtype)
    pool = _open(pool_file, layout)
    kv = _kv(dtype=getattr(torch, dtype))
    pool.write_block(5, kv)
    for layer in range(layout.num_layers):
        assert torch.equal(_bits(pool.layer(layer)[:, 5]), _bits(kv[layer]))
        assert not _bits(pool.layer(layer)[:, 4]).any()


@pytest.mark.parametrize("order", ORDERS)
def test_read_block_returns_what_was_written(pool_file: PoolFile, order: str) -> None:
    pool = _open(pool_file, dataclasses.replace(LAYOUT, order=order))
    kv = _kv()
    pool.write_block(2, kv)
    out = torch.zeros(BLOCK, dtype=torch.float16)
    pool.read_block(2, out)
    assert torch.equal(out, kv)


def test_numpy_arrays_are_written_and_read_too(pool_file: PoolFile) -> None:
    pool = _open(pool_file)
    kv = _kv().numpy()
    pool.write_block(1, kv)
    out = np.zeros(BLOCK, dtype=np.float16)
    pool.read_block(1, out)
    assert (out == kv).all()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("ids", [[2, 3, 4, 5], [6, 1, 2, 0], [7, 5, 3, 1]])
def test_write_blocks_puts_each_block_in_place(
    pool_file: PoolFile, order: str, ids: list[int]
) -> None:
    pool = _open(pool_file, dataclasses.replace(LAYOUT, order=order))
    kv = _kv(len(ids))
    pool.write_blocks(ids, kv)
    for i, b in enumerate(ids):
        assert torch.equal(pool.block(b), kv[:, :, i])
    for b in set(range(LAYOUT.num_blocks)) - set(ids):
        assert not pool.block(b).any()


@pytest.mark.parametrize("order", ORDERS)
def test_read_blocks_gathers_in_the_order_asked(pool_file: PoolFile, order: str) -> None:
    pool = _open(pool_file, dataclasses.replace(LAYOUT, order=order))
    kv = _kv(8)
    pool.write_blocks(range(8), kv)
    ids = [3, 4, 5, 0, 7, 7]
    out = torch.zeros(3, 2, len(ids), 4, 2, 4, dtype=torch.float16)
    pool.read_blocks(ids, out)
    assert torch.equal(out, kv[:, :, ids])


@pytest.mark.parametrize(
    "ids", [np.array([4, 5, 6]), torch.tensor([4, 5, 6]), (np.int64(4), np.int32(5), 6)]
)
def test_block_ids_may_be_arrays_tensors_and_numpy_ints(pool_file: PoolFile, ids: Any) -> None:
    pool = _open(pool_file)
    kv = _kv(3)
    pool.write_blocks(ids, kv)
    assert torch.equal(pool.blocks(4, 3), kv)


def test_strided_sources_are_copied_element_by_element(pool_file: PoolFile) -> None:
    pool = _open(pool_file)
    wide = _kv(6)
    every_other = wide[:, :, ::2]  # not contiguous
    pool.write_blocks([1, 2, 3], every_other)
    assert torch.equal(pool.blocks(1, 3), every_other)
    transposed = _kv().transpose(3, 4).contiguous().transpose(3, 4)
    pool.write_block(0, transposed)
    assert torch.equal(pool.block(0), transposed)


def test_a_tensor_tracked_by_autograd_is_written(pool_file: PoolFile) -> None:
    pool = _open(pool_file, dataclasses.replace(LAYOUT, dtype="float32"))
    kv = _kv(dtype=torch.float32).requires_grad_()
    pool.write_block(3, kv)
    assert torch.equal(pool.block(3), kv.detach())


def test_no_blocks_is_nothing_to_do(pool_file: PoolFile) -> None:
    pool = _open(pool_file)
    pool.write_blocks([], _kv(0))
    pool.read_blocks([], _kv(0))
    assert not pool.np_blocks(0, LAYOUT.num_blocks).any()


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([8], "block id 8 outside"),
        ([-1], "block id -1 outside"),
        ([1.0], "must be an integer"),
        (np.array([1.0]), "1-D integer array"),
        (np.array([[1]]), "1-D integer array"),
        (3, "1-D integer array"),
    ],
)
def test_bad_block_ids_are_refused_and_nothing_is_written(
    pool_file: PoolFile, ids: Any, match: str
) -> None:
    pool = _open(pool_file)
    with pytest.raises(InvalidRequest, match=match) as info:
        pool.write_blocks(ids, _kv(1))
    assert info.value.code == "INVALID"
    assert not pool.np_blocks(0, LAYOUT.num_blocks).any()


@pytest.mark.parametrize("block_id", [8, -1, 2.0])
def test_write_block_refuses_a_bad_id(pool_file: PoolFile, block_id: Any) -> None:
    pool = _open(pool_file)
    with pytest.raises(InvalidRequest, match="block id"):
        pool.write_block(block_id, _kv())
    assert not pool.np_blocks(0, LAYOUT.num_blocks).any()


def test_a_block_given_twice_is_refused_for_writes(pool_file: PoolFile) -> None:
    pool = _open(pool_file)
    with pytest.raises(InvalidRequest, match="given twice"):
        pool.write_blocks([2, 3, 2], _kv(3))
    assert not pool.np_blocks(0, LAYOUT.num_blocks).any()


@pytest.mark.parametrize(
    ("src", "match"),
    [
        (_kv(2), r"shape \(3, 2, 2, 4, 2, 4\)"),  # a run where one block is expected
        (_kv()[:, :1], r"shape \(3, 1, 4, 2, 4\)"),
        (_kv(dtype=torch.float32), "float32"),
        (_kv(dtype=torch.bfloat16), "bfloat16"),
        (_kv().numpy().astype(np.float32), "float32"),
        (_kv().tolist(), "must be a torch tensor or a numpy array"),
    ],
)
def test_a_bad_source_is_refused_and_nothing_is_written(
    pool_file: PoolFile, src: Any, match: str
) -> None:
    pool = _open(pool_file)
    with pytest.raises(InvalidRequest, match=match):
        pool.write_block(0, src)
    assert not pool.np_blocks(0, LAYOUT.num_blocks).any()


def test_a_float16_tensor_is_refused_by_a_bfloat16_pool(pool_file: PoolFile) -> None:
    pool = _open(pool_file, dataclasses.replace(LAYOUT, dtype="bfloat16"))
    with pytest.raises(InvalidRequest, match="float16"):
        pool.write_block(0, _kv())


def test_write_blocks_needs_one_source_block_per_id(pool_file: PoolFile) -> None:
    pool = _open(pool_file)
    with pytest.raises(InvalidRequest, match="shape"):
        pool.write_blocks([1, 2, 3], _kv(2))


def test_a_read_only_array_cannot_be_read_into(pool_file: PoolFile) -> None:
    pool = _open(pool_file)
    out = np.zeros(BLOCK, dtype=np.float16)
    out.flags.writeable = False
    with pytest.raises(InvalidRequest, match="read-only"):
        pool.read_block(0, out)


@pytest.mark.parametrize("order", ORDERS)
def test_blocks_view_is_a_zero_copy_run(pool_file: PoolFile, order: str) -> None:
    pool = _open(pool_file, dataclasses.replace(LAYOUT, order=order))
    run = pool.blocks(2, 3)
    assert run.shape == (3, 2, 3, 4, 2, 4)
    run[1, 0, 2].fill_(6.0)
    assert (pool.layer(1)[0, 4] == 6.0).all()
    assert torch.equal(pool.block(4), run[:, :, 2])


@pytest.mark.parametrize(("first", "count"), [(-1, 2), (7, 2), (0, 0)])
def test_a_run_outside_the_pool_is_an_index_error(
    pool_file: PoolFile, first: int, count: int
) -> None:
    pool = _open(pool_file)
    with pytest.raises(IndexError):
        pool.blocks(first, count)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("ids", [[2, 3, 4], [6, 0, 3]])
def test_write_layer_writes_one_layer_of_each_block(
    pool_file: PoolFile, order: str, ids: list[int]
) -> None:
    pool = _open(pool_file, dataclasses.replace(LAYOUT, order=order))
    kv = _kv(len(ids))[1]  # [2, len(ids), 4, 2, 4]
    pool.write_layer(1, ids, kv)
    assert torch.equal(pool.layer(1)[:, ids], kv)
    assert not pool.layer(0).any()
    assert not pool.layer(2).any()


@pytest.mark.parametrize("order", ORDERS)
def test_read_layer_gathers_one_layer(pool_file: PoolFile, order: str) -> None:
    pool = _open(pool_file, dataclasses.replace(LAYOUT, order=order))
    kv = _kv(8)
    pool.write_blocks(range(8), kv)
    out = torch.zeros(2, 3, 4, 2, 4, dtype=torch.float16)
    pool.read_layer(2, [5, 6, 1], out)
    assert torch.equal(out, kv[2][:, [5, 6, 1]])


@pytest.mark.parametrize("layer", [3, -1, 1.0])
def test_a_layer_outside_the_pool_is_refused(pool_file: PoolFile, layer: Any) -> None:
    pool = _open(pool_file)
    with pytest.raises(InvalidRequest, match="layer"):
        pool.write_layer(layer, [0], _kv(1)[0])
    assert not pool.np_blocks(0, LAYOUT.num_blocks).any()


def test_write_layer_needs_the_layer_shape(pool_file: PoolFile) -> None:
    pool = _open(pool_file)
    with pytest.raises(InvalidRequest, match=r"shape \(3, 2, 1, 4, 2, 4\)"):
        pool.write_layer(0, [0], _kv(1))


def test_a_numpy_integer_block_id_is_taken(pool_file: PoolFile) -> None:
    pool = _open(pool_file)
    kv = _kv()
    pool.write_block(np.int64(6), kv)
    out = torch.zeros(BLOCK, dtype=torch.float16)
    pool.read_block(np.int32(6), out)
    assert torch.equal(out, kv)


@pytest.mark.parametrize("order", ORDERS)
def test_the_torch_path_copies_what_the_numpy_path_does(pool_file: PoolFile, order: str) -> None:
    """The base class's torch copies (cuda pools, device tensors), run here on shm views."""
    pool = _open(pool_file, dataclasses.replace(LAYOUT, order=order))
    kv = _kv(4)
    ids = [1, 2, 6, 3]
    PoolMapping._write(pool, ids, kv, slice(None))
    assert torch.equal(pool.blocks(1, 2), kv[:, :, :2])
    assert torch.equal(pool.block(6), kv[:, :, 2])
    out = torch.zeros_like(kv)
    PoolMapping._read(pool, ids, out, slice(None))
    assert torch.equal(out, kv)
    PoolMapping._write(pool, [0], kv[2:3, :, :1], slice(2, 3))
    assert torch.equal(pool.layer(2)[:, 0], kv[2, :, 0])
