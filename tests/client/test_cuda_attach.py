"""The client's side of cuda pools, as far as a machine without a GPU allows.

The memory map's parsing and its trip through msgpack, the layer views'
arithmetic and copy-on-write copies run on CPU tensors (the view code is
the same for every device); the IPC open itself is in tests/gpu.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from kvd_client.cuda import (
    CudaPool,
    CudaUnavailableError,
    block_view,
    copy_blocks,
    device_uuid,
    layer_views,
)
from kvd_client.errors import InternalError, LayoutMismatch
from kvd_client.pool import BACKENDS, open_pool
from kvd_client.wire import POOL_ALIGN, CudaMemoryMap, PoolLayout
from kvd_client.wire.cudamap import HANDLE_BYTES, canonical_uuid, format_uuid

UUID_BYTES = bytes.fromhex("8f2c1a0e5b7d4c3a9e1f00112233aabb")
UUID = "GPU-8f2c1a0e-5b7d-4c3a-9e1f-00112233aabb"
# A handle with NUL bytes inside: cupy once lost everything after the first NUL.
HANDLE = bytes(range(32)) + b"\x00" * 16 + bytes(range(200, 216))
LAYOUT = PoolLayout(
    num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4, num_blocks=10
)

no_cupy = pytest.mark.skipif(
    importlib.util.find_spec("cupy") is not None, reason="cupy is installed here"
)


def memory_map(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "backend": "cuda",
        "device": 0,
        "uuid": UUID,
        "handle": HANDLE,
        "offset": 0,
        "size": POOL_ALIGN,
    }
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


def test_format_uuid_matches_nvml_form() -> None:
    assert format_uuid(UUID_BYTES) == UUID


@pytest.mark.parametrize("raw", [b"\x00" * 15, b"\x00" * 17, "00" * 16])
def test_format_uuid_rejects_anything_but_16_bytes(raw: Any) -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        format_uuid(raw)


@pytest.mark.parametrize(
    "text",
    [
        UUID,
        UUID.upper(),
        "gpu-8f2c1a0e-5b7d-4c3a-9e1f-00112233aabb",
        "8f2c1a0e-5b7d-4c3a-9e1f-00112233aabb",
        b"GPU-8f2c1a0e-5b7d-4c3a-9e1f-00112233aabb",
        " GPU-8f2c1a0e5b7d4c3a9e1f00112233aabb\n",
    ],
)
def test_canonical_uuid_reads_nvml_and_torch_forms(text: str | bytes) -> None:
    assert canonical_uuid(text) == UUID


@pytest.mark.parametrize("text", ["", "GPU-1234", "MIG-" + UUID[4:], UUID.replace("8", "g")])
def test_canonical_uuid_refuses_anything_else(text: str) -> None:
    assert canonical_uuid(text) is None


@no_cupy
def test_device_uuid_without_cupy_says_how_to_install_it() -> None:
    with pytest.raises(CudaUnavailableError, match=r"pip install 'kvd\[cuda\]'"):
        device_uuid(0)


def test_memory_map_survives_msgpack() -> None:
    mm = CudaMemoryMap(device=1, uuid=UUID, handle=HANDLE, offset=0, size=4 * POOL_ALIGN)
    wire = msgpack.packb(mm.to_dict(), use_bin_type=True)
    back = msgpack.unpackb(wire, raw=False)
    assert type(back["handle"]) is bytes
    assert CudaMemoryMap.from_dict(back) == mm
    assert back["handle"] == HANDLE
    assert len(back["handle"]) == HANDLE_BYTES


def test_memory_map_packs_the_handle_as_bin() -> None:
    wire = msgpack.packb(memory_map(), use_bin_type=True)
    # bin 8 (0xc4) with length 64, never a str
    assert b"\xc4\x40" + HANDLE in wire


def test_importing_the_module_registers_the_backend() -> None:
    assert BACKENDS["cuda"] == CudaPool.open


def test_open_refuses_memory_smaller_than_the_layout() -> None:
    big = PoolLayout(
        num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4, num_blocks=10**5
    )
    with pytest.raises(LayoutMismatch, match="smaller than its layout"):
        open_pool(memory_map(), big)


def test_open_reports_a_malformed_map_as_internal() -> None:
    with pytest.raises(InternalError, match="cuda memory map: handle"):
        open_pool(memory_map(handle=b"short"), LAYOUT)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"backend": "shm"}, "backend"),
        ({"backend": None}, "backend"),
        ({"handle": None}, "handle"),
        ({"size": None}, "size"),
        ({"extra": 1}, "extra"),
        ({"device": -1}, "device"),
        ({"device": True}, "device"),
        ({"device": "0"}, "device"),
        ({"uuid": "GPU-1234"}, "uuid"),
        ({"uuid": UUID.upper()}, "uuid"),
        ({"uuid": UUID_BYTES}, "uuid"),
        ({"handle": HANDLE[:-1]}, "handle"),
        ({"handle": HANDLE + b"\x00"}, "handle"),
        ({"handle": HANDLE.decode("latin-1")}, "handle"),
        ({"offset": -4096}, "offset"),
        ({"offset": 100}, "offset"),
        ({"size": 0}, "size"),
        ({"size": POOL_ALIGN + 4096}, "size"),
        ({"size": float(POOL_ALIGN)}, "size"),
    ],
)
def test_from_dict_names_the_bad_key(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"cuda memory map: {key}"):
        CudaMemoryMap.from_dict(memory_map(**changes))


def test_from_dict_rejects_a_non_map() -> None:
    with pytest.raises(ValueError, match="must be a map"):
        CudaMemoryMap.from_dict([("backend", "cuda")])  # type: ignore[arg-type]


@no_cupy
def test_open_without_cupy_says_how_to_install_it() -> None:
    with pytest.raises(CudaUnavailableError, match=r"pip install 'kvd\[cuda\]'") as info:
        open_pool(memory_map(), LAYOUT)
    assert isinstance(info.value, LayoutMismatch)
    assert info.value.code == "MISMATCH"


def raw_pool(layout: PoolLayout) -> torch.Tensor:
    return torch.zeros(layout.total_bytes, dtype=torch.uint8)


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
def test_layer_views_put_each_block_at_its_layout_offset(order: str, dtype: str) -> None:
    layout = PoolLayout(
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        block_size=4,
        num_blocks=10,
        order=order,  # type: ignore[arg-type]
    )
    raw = raw_pool(layout)
    views = layer_views(raw, layout)
    assert len(views) == layout.num_layers
    for layer, view in enumerate(views):
        assert tuple(view.shape) == (2, 10, 4, 2, 8)
        assert view.dtype == getattr(torch, dtype)
        for kv in (0, 1):
            for block in (0, 7, 9):
                marker = torch.randint(1, 256, (layout.slot_bytes,), dtype=torch.uint8)
                view[kv, block] = marker.view(view.dtype).reshape(4, 2, 8)
                start = layout.offset(layer, kv, block)
                assert bool(torch.equal(raw[start : start + layout.slot_bytes], marker))
                view[kv, block].view(torch.uint8).zero_()
    assert int(raw.count_nonzero()) == 0


def test_layer_views_share_the_pools_memory() -> None:
    raw = raw_pool(LAYOUT)
    views = layer_views(raw, LAYOUT)
    views[2][1, 9, 3, 1, 7] = 1.0
    assert views[2].data_ptr() != raw.data_ptr()
    assert int(raw.count_nonzero()) == 1  # float16 1.0 is 0x3c00, little-endian
    last = LAYOUT.offset(2, 1, 9) + LAYOUT.slot_bytes - 2
    assert raw[last : last + 2].tolist() == [0x00, 0x3C]


def test_layer_views_refuse_bytes_that_cannot_hold_the_layout() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        layer_views(torch.zeros(LAYOUT.used_bytes - 1, dtype=torch.uint8), LAYOUT)
    with pytest.raises(ValueError, match="uint8"):
        layer_views(torch.zeros(LAYOUT.total_bytes, dtype=torch.int8), LAYOUT)
    with pytest.raises(ValueError, match="uint8"):
        layer_views(torch.zeros(LAYOUT.total_bytes * 2, dtype=torch.uint8)[::2], LAYOUT)


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_block_view_sees_the_same_bytes_as_the_layer_views(order: str) -> None:
    layout = PoolLayout(
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        dtype="bfloat16",
        block_size=4,
        num_blocks=10,
        order=order,  # type: ignore[arg-type]
    )
    raw = raw_pool(layout)
    layers = layer_views(raw, layout)
    block = block_view(raw, layout, 7)
    assert tuple(block.shape) == (3, 2, 4, 2, 8)
    block[2, 1] = 5.0
    assert bool((layers[2][1, 7] == 5.0).all())
    assert int(torch.count_nonzero(torch.stack(layers))) == 4 * 2 * 8
    with pytest.raises(IndexError):
        block_view(raw, layout, 10)


def filled_views(layout: PoolLayout) -> list[torch.Tensor]:
    views = layer_views(raw_pool(layout), layout)
    for layer, view in enumerate(views):
        for block in range(layout.num_blocks):
            view[0, block] = layer * 100 + block
            view[1, block] = -(layer * 100 + block)
    return views


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_copy_blocks_copies_k_and_v_of_every_layer(order: str) -> None:
    layout = PoolLayout(
        num_layers=3,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        block_size=4,
        num_blocks=10,
        order=order,  # type: ignore[arg-type]
    )
    views = filled_views(layout)
    copy_blocks(views, [(2, 5), (3, 8)])
    for layer, view in enumerate(views):
        for block in range(10):
            src = {5: 2, 8: 3}.get(block, block)
            assert bool((view[0, block] == layer * 100 + src).all())
            assert bool((view[1, block] == -(layer * 100 + src)).all())


def test_copy_blocks_takes_the_flat_form_of_an_append_reply() -> None:
    views = filled_views(LAYOUT)
    copy_blocks(views, np.array([4, 1], dtype=np.int32))
    assert bool((views[1][0, 1] == 104).all())


def test_copy_blocks_with_no_pairs_changes_nothing() -> None:
    views = filled_views(LAYOUT)
    before = [v.clone() for v in views]
    copy_blocks(views, [])
    copy_blocks(views, np.empty(0, dtype=np.int32))
    copy_blocks([], [(1, 2)])
    assert all(bool(torch.equal(a, b)) for a, b in zip(views, before, strict=True))


@pytest.mark.parametrize(
    ("pairs", "match"),
    [
        ([(0, 10)], "outside"),
        ([(-1, 2)], "outside"),
        ([(1, 2), (3, 2)], "same block"),
        ([(1, 2), (2, 3)], "reads"),
        ([1, 2, 3], "pairs"),
        ([(1.0, 2.0)], "pairs"),
    ],
)
def test_copy_blocks_rejects_bad_pairs_and_copies_nothing(pairs: Any, match: str) -> None:
    views = filled_views(LAYOUT)
    before = [v.clone() for v in views]
    with pytest.raises(ValueError, match=match):
        copy_blocks(views, pairs)
    assert all(bool(torch.equal(a, b)) for a, b in zip(views, before, strict=True))


def test_copy_blocks_rejects_views_that_are_not_pool_layers() -> None:
    views = filled_views(LAYOUT)
    with pytest.raises(ValueError, match="not a pool layer"):
        copy_blocks([*views, torch.zeros(3, 10)], [(1, 2)])
