"""kvd_client.pool: zero-copy views of a real pool file, shared across mappings and processes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvd_client.errors import InternalError, LayoutMismatch
from kvd_client.pool import BACKENDS, ShmPool, open_pool, register_backend
from kvd_client.wire import PoolLayout

from .support import LAYOUT, shm_handle

PoolFile = Callable[[PoolLayout], Path]
ORDERS = ["layer_major", "block_major"]


def _open(pool_file: PoolFile, layout: PoolLayout) -> ShmPool:
    pool = open_pool(shm_handle(pool_file(layout), layout), layout)
    assert isinstance(pool, ShmPool)
    return pool


def _addr(arr: Any) -> int:
    if isinstance(arr, torch.Tensor):
        return int(arr.data_ptr())
    return int(arr.__array_interface__["data"][0])


def _base(pool: ShmPool) -> int:
    return _addr(np.frombuffer(pool.buffer(), dtype=np.uint8))


@pytest.mark.parametrize("order", ORDERS)
def test_layer_views_sit_at_the_layout_offsets(pool_file: PoolFile, order: str) -> None:
    layout = dataclasses.replace(LAYOUT, order=order)
    pool = _open(pool_file, layout)
    base = _base(pool)
    for layer in range(layout.num_layers):
        view = pool.np_layer(layer)
        assert view.shape == (2, 8, 4, 2, 4)
        assert view.strides == layout.layer_strides()
        for kv, block in ((0, 0), (1, 0), (0, 5), (1, 7)):
            assert _addr(view[kv, block]) == base + layout.offset(layer, kv, block)


@pytest.mark.parametrize("order", ORDERS)
def test_block_view_is_zero_copy_over_all_layers(pool_file: PoolFile, order: str) -> None:
    layout = dataclasses.replace(LAYOUT, order=order)
    pool = _open(pool_file, layout)
    base = _base(pool)
    block = pool.np_block(3)
    assert block.shape == (3, 2, 4, 2, 4)
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            assert _addr(block[layer, kv]) == base + layout.offset(layer, kv, 3)
    block[2, 1, 0, 0, 0] = 4.25
    assert pool.np_layer(2)[1, 3, 0, 0, 0] == 4.25


def test_torch_layer_view_is_the_same_memory(pool_file: PoolFile) -> None:
    pool = _open(pool_file, LAYOUT)
    layer = pool.layer(1)
    assert layer.shape == (2, 8, 4, 2, 4)
    assert layer.dtype == torch.float16
    assert _addr(layer) == _addr(pool.np_layer(1))
    layer[1, 6] = 2.5
    assert (pool.np_layer(1)[1, 6] == 2.5).all()
    assert len(pool.layers()) == LAYOUT.num_layers


def test_torch_block_view_matches_the_layer_views(pool_file: PoolFile) -> None:
    pool = _open(pool_file, LAYOUT)
    pool.layer(2)[0, 5].fill_(7.0)
    block = pool.block(5)
    assert block.shape == (3, 2, 4, 2, 4)
    assert (block[2, 0] == 7.0).all()
    assert not (block[1, 0] == 7.0).any()


def test_bfloat16_is_raw_uint16_in_numpy_and_bfloat16_in_torch(pool_file: PoolFile) -> None:
    layout = dataclasses.replace(LAYOUT, dtype="bfloat16")
    pool = _open(pool_file, layout)
    assert pool.np_dtype == np.uint16
    layer = pool.layer(0)
    assert layer.dtype == torch.bfloat16
    layer[0, 1, 2, 1, 3] = 1.5
    assert pool.np_layer(0)[0, 1, 2, 1, 3] == 0x3FC0  # bfloat16 bits of 1.5


def test_float8_is_raw_uint8_in_numpy(pool_file: PoolFile) -> None:
    layout = dataclasses.replace(LAYOUT, dtype="float8_e4m3fn")
    pool = _open(pool_file, layout)
    assert pool.np_dtype == np.uint8
    assert pool.layer(0).dtype == torch.float8_e4m3fn
    pool.layer(0)[1, 0, 0, 0, 0] = 1.0
    assert pool.np_layer(0)[1, 0, 0, 0, 0] == 0x38  # e4m3 bits of 1.0


def test_a_file_is_mapped_once_per_process(pool_file: PoolFile) -> None:
    path = pool_file(LAYOUT)
    first = open_pool(shm_handle(path, LAYOUT), LAYOUT)
    assert open_pool(shm_handle(path, LAYOUT), LAYOUT) is first


def test_a_file_recreated_at_the_same_path_is_mapped_afresh(pool_file: PoolFile) -> None:
    path = pool_file(LAYOUT)
    first = open_pool(shm_handle(path, LAYOUT), LAYOUT)
    path.unlink()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
    os.ftruncate(fd, LAYOUT.total_bytes)
    os.close(fd)
    again = open_pool(shm_handle(path, LAYOUT), LAYOUT)
    assert again is not first
    again.layer(0)[0, 0].fill_(1.0)
    assert not (first.layer(0)[0, 0] == 1.0).any()


def test_writes_are_visible_to_another_process(pool_file: PoolFile) -> None:
    path = pool_file(LAYOUT)
    pool = open_pool(shm_handle(path, LAYOUT), LAYOUT)
    pool.layer(1)[1, 5].fill_(3.0)
    child = textwrap.dedent(
        f"""
        from kvd_client.wire import PoolLayout
        from kvd_client.pool import open_pool
        layout = PoolLayout(**{LAYOUT.to_dict()!r})
        handle = {{"backend": "shm", "path": {str(path)!r}, "size": layout.total_bytes,
                   "offset": 0}}
        pool = open_pool(handle, layout)
        assert (pool.np_layer(1)[1, 5] == 3.0).all(), "parent's write not visible"
        pool.np_layer(2)[0, 6] = 9.0
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    assert (pool.layer(2)[0, 6] == 9.0).all()


@pytest.mark.parametrize("order", ORDERS)
def test_copy_blocks_copies_k_and_v_of_every_layer(pool_file: PoolFile, order: str) -> None:
    layout = dataclasses.replace(LAYOUT, order=order)
    pool = _open(pool_file, layout)
    rng = np.random.default_rng(0)
    for layer in pool.np_layers():
        layer[...] = rng.standard_normal(layer.shape).astype(np.float16)
    before = [layer.copy() for layer in pool.np_layers()]
    pool.copy_blocks([1, 2], [5, 6])
    for old, layer in zip(before, pool.np_layers(), strict=True):
        assert (layer[:, 5] == old[:, 1]).all()
        assert (layer[:, 6] == old[:, 2]).all()
        untouched = [0, 1, 2, 3, 4, 7]
        assert (layer[:, untouched] == old[:, untouched]).all()


def test_copy_blocks_refuses_ids_outside_the_pool_and_copies_nothing(
    pool_file: PoolFile,
) -> None:
    pool = _open(pool_file, LAYOUT)
    pool.layer(0)[:, 1].fill_(5.0)
    with pytest.raises(InternalError, match="block id 8"):
        pool.copy_blocks([1, 1], [2, 8])
    assert not (pool.layer(0)[:, 2] == 5.0).any()


def test_handle_without_backend_is_an_internal_error() -> None:
    with pytest.raises(InternalError, match="backend"):
        open_pool({"path": "/dev/shm/x"}, LAYOUT)


def test_unknown_backend_is_a_mismatch_naming_the_available_ones() -> None:
    with pytest.raises(LayoutMismatch, match=r"'nvme'.*shm"):
        open_pool({"backend": "nvme"}, LAYOUT)


def test_shm_handle_needs_an_absolute_path() -> None:
    with pytest.raises(InternalError, match="absolute path"):
        open_pool({"backend": "shm", "path": "kvd", "size": LAYOUT.total_bytes}, LAYOUT)


def test_a_file_smaller_than_the_pool_is_refused(pool_file: PoolFile) -> None:
    path = pool_file(LAYOUT)
    os.truncate(path, LAYOUT.total_bytes // 2)
    with pytest.raises(LayoutMismatch, match="holds"):
        open_pool(shm_handle(path, LAYOUT), LAYOUT)


def test_memory_smaller_than_the_layout_is_refused(pool_file: PoolFile) -> None:
    path = pool_file(LAYOUT)
    handle = shm_handle(path, LAYOUT) | {"size": LAYOUT.used_bytes - 1}
    with pytest.raises(LayoutMismatch, match="smaller than its layout"):
        open_pool(handle, LAYOUT)


def test_registered_backend_receives_its_handles(pool_file: PoolFile) -> None:
    path = pool_file(LAYOUT)
    seen: list[dict[str, Any]] = []

    def opener(memory: dict[str, Any], layout: PoolLayout) -> Any:
        seen.append(memory)
        return ShmPool.open(shm_handle(path, layout), layout)

    register_backend("test-backend", opener)
    try:
        pool = open_pool({"backend": "test-backend", "x": 1}, LAYOUT)
    finally:
        del BACKENDS["test-backend"]
    assert seen == [{"backend": "test-backend", "x": 1}]
    assert isinstance(pool, ShmPool)


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import sys, kvd_client, kvd_client.pool; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
