"""Paged K/V helpers: slots by block table, any layout's strides, causal GQA attention."""

from __future__ import annotations

import pytest
import torch
from kvd_client.errors import InvalidRequest
from kvd_client.integrations.paged import (
    causal_attention,
    gather_kv,
    paged_attention,
    slot_indices,
    write_kv,
)
from kvd_client.wire import Order, PoolLayout

HEADS, DIM = 2, 8


def pool_layers(order: Order, num_blocks: int = 12, bs: int = 4) -> list[torch.Tensor]:
    """Layer views over one flat buffer, with exactly `PoolLayout`'s strides and offsets."""
    layout = PoolLayout(2, HEADS, DIM, "float32", bs, num_blocks, order)
    flat = torch.zeros(layout.used_bytes // 4)
    shape = (2, num_blocks, bs, HEADS, DIM)
    strides = tuple(s // 4 for s in layout.layer_strides())
    return [flat.as_strided(shape, strides, layout.layer_offset(i) // 4) for i in range(2)]


def kv_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, DIM, generator=gen), torch.randn(n, HEADS, DIM, generator=gen)


def test_slot_indices_follow_the_table() -> None:
    blocks, slots = slot_indices([7, 2, 5], 3, 9, 4, torch.device("cpu"))
    assert blocks.tolist() == [7, 2, 2, 2, 2, 5]
    assert slots.tolist() == [3, 0, 1, 2, 3, 0]


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_written_tokens_land_in_their_slots_and_gather_back(order: Order) -> None:
    layers = pool_layers(order)
    table = [9, 0, 4, 11]
    key, value = kv_rows(14, seed=1)
    write_kv(layers[1], table, 0, key[:6], value[:6])
    write_kv(layers[1], table, 6, key[6:], value[6:])
    for t in range(14):
        assert torch.equal(layers[1][0, table[t // 4], t % 4], key[t])
        assert torch.equal(layers[1][1, table[t // 4], t % 4], value[t])
    k, v = gather_kv(layers[1], table, 14)
    assert torch.equal(k, key) and torch.equal(v, value)
    assert not layers[0].any()  # the other layer is untouched


def test_gather_returns_copies() -> None:
    layer = pool_layers("layer_major")[0]
    key, value = kv_rows(4, seed=2)
    write_kv(layer, [3], 0, key, value)
    k, _ = gather_kv(layer, [3], 4)
    k.zero_()
    assert torch.equal(layer[0, 3], key)


@pytest.mark.parametrize(
    ("start", "rows", "table", "why"),
    [
        (6, 3, [1, 2], "past the block table"),
        (-1, 2, [1, 2], "bad token range"),
        (0, 2, [[1, 2]], "1-D"),
    ],
)
def test_bad_writes_raise_invalid_and_write_nothing(
    start: int, rows: int, table: list[int], why: str
) -> None:
    layer = pool_layers("layer_major")[0]
    key, value = kv_rows(rows, seed=3)
    with pytest.raises(InvalidRequest, match=why) as info:
        write_kv(layer, table, start, key, value)
    assert info.value.code == "INVALID"
    assert not layer.any()


def test_kv_of_the_wrong_shape_is_refused() -> None:
    layer = pool_layers("layer_major")[0]
    with pytest.raises(InvalidRequest, match="key/value must be"):
        write_kv(layer, [0], 0, torch.zeros(2, HEADS + 1, DIM), torch.zeros(2, HEADS + 1, DIM))
    with pytest.raises(InvalidRequest, match="pool layer"):
        gather_kv(layer[0], [0], 1)
    assert not layer.any()


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Textbook causal GQA attention of the last ``len(q)`` of ``len(k)`` positions."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM**-0.5
    first = k.shape[0] - q.shape[0]
    for i in range(q.shape[0]):
        scores[:, i, first + i + 1 :] = float("-inf")
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("q_len", [10, 3, 1])
def test_causal_gqa_attention_of_the_last_positions(q_len: int) -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(q_len, 4 * HEADS, DIM, generator=gen)
    k, v = torch.randn(10, HEADS, DIM, generator=gen), torch.randn(10, HEADS, DIM, generator=gen)
    torch.testing.assert_close(causal_attention(q, k, v, DIM**-0.5), naive_attention(q, k, v))


def test_paged_attention_reads_the_pool() -> None:
    layer = pool_layers("block_major")[0]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2 * HEADS, DIM, generator=gen)
    key, value = kv_rows(9, seed=6)
    write_kv(layer, [5, 1, 8], 0, key, value)
    torch.testing.assert_close(
        paged_attention(q, layer, [5, 1, 8], 9, 0.3), causal_attention(q, key, value, 0.3)
    )


def test_attention_refuses_heads_that_do_not_group() -> None:
    with pytest.raises(InvalidRequest, match="does not fit"):
        causal_attention(
            torch.zeros(1, 3, DIM), torch.zeros(1, 2, DIM), torch.zeros(1, 2, DIM), 1.0
        )
