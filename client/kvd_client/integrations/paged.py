"""Paged attention in plain torch over a kvd pool layer.

A pool layer is the ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
tensor of `kvd_client` (K at index 0, V at 1), shared with every process
on the node. Token ``t`` of a sequence lives in block ``table[t // bs]``,
slot ``t % bs``. These helpers scatter new K/V into those slots and gather
a sequence's K/V back for attention; they accept any strides, so both
``layer_major`` and ``block_major`` views work.

Shapes follow the token-major convention of paged kernels: one sequence,
``[tokens, heads, head_dim]``. Attention is causal, supports grouped-query
attention (query head ``h`` reads KV head ``h // (Hq // Hkv)``, as in
Hugging Face's ``repeat_kv``) and computes in the inputs' dtype. Misuse
raises `InvalidRequest` (code ``INVALID``) before anything is written.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
from torch.nn import functional as F

from kvd_client.errors import InvalidRequest

__all__ = [
    "BlockTable",
    "causal_attention",
    "gather_kv",
    "paged_attention",
    "slot_indices",
    "write_kv",
]

#: A sequence's block ids: what `Sequence.block_table` holds (int32), or a tensor.
BlockTable = npt.NDArray[np.integer] | torch.Tensor | list[int]


def _check_layer(layer: torch.Tensor) -> None:
    if layer.dim() != 5 or layer.shape[0] != 2:
        raise InvalidRequest(
            "a pool layer is [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(layer.shape)}"
        )


def slot_indices(
    block_table: BlockTable, start: int, stop: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids and slots of token positions ``[start, stop)``, as int64 tensors.

    Raises `InvalidRequest` when the range is negative or runs past the table.
    """
    # Tables arrive as read-only int32 arrays; torch wants its own (writable) int64 copy.
    table = (
        block_table
        if isinstance(block_table, torch.Tensor)
        else torch.from_numpy(np.array(block_table, dtype=np.int64))
    )
    if table.dim() != 1:
        raise InvalidRequest(f"a block table is 1-D, got shape {tuple(table.shape)}")
    if not 0 <= start <= stop:
        raise InvalidRequest(f"bad token range [{start}, {stop})")
    if stop > table.numel() * block_size:
        raise InvalidRequest(
            f"token {stop - 1} lies past the block table ({table.numel()} blocks of {block_size})"
        )
    positions = torch.arange(start, stop, device=device)
    blocks = table.to(device=device, dtype=torch.long)[positions // block_size]
    return blocks, positions % block_size


def write_kv(
    layer: torch.Tensor,
    block_table: BlockTable,
    start: int,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Write K/V ``[n, num_kv_heads, head_dim]`` of positions ``[start, start+n)`` in place."""
    _check_layer(layer)
    expected = tuple(layer.shape[3:])
    if key.dim() != 3 or tuple(key.shape[1:]) != expected or key.shape != value.shape:
        raise InvalidRequest(
            f"key/value must be [n, {expected[0]}, {expected[1]}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    blocks, slots = slot_indices(
        block_table, start, start + key.shape[0], layer.shape[2], layer.device
    )
    # Advanced-index assignment is an index_put_ on the view: it lands in the shared pool.
    layer[0, blocks, slots] = key.to(device=layer.device, dtype=layer.dtype)
    layer[1, blocks, slots] = value.to(device=layer.device, dtype=layer.dtype)


def gather_kv(
    layer: torch.Tensor, block_table: BlockTable, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[length, num_kv_heads, head_dim]`` of a sequence's first ``length`` tokens.

    The results are copies: the pool may change under them afterwards.
    """
    _check_layer(layer)
    blocks, slots = slot_indices(block_table, 0, length, layer.shape[2], layer.device)
    kv = layer[:, blocks, slots]
    return kv[0], kv[1]


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``q`` positions of a ``T``-token sequence.

    ``query`` is ``[q, Hq, D]`` for positions ``[T-q, T)``; ``key``/``value``
    are ``[T, Hkv, D]`` for positions ``[0, T)``; ``Hq`` is a multiple of
    ``Hkv``. Returns ``[q, Hq, D]``.
    """
    q_len, num_heads, _ = query.shape
    total, num_kv_heads, _ = key.shape
    if num_heads % num_kv_heads or q_len > total or key.shape != value.shape:
        raise InvalidRequest(
            f"query {tuple(query.shape)} does not fit key {tuple(key.shape)} / "
            f"value {tuple(value.shape)}"
        )
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # heads first
    if q_len == total:  # a whole sequence: SDPA's own (top-left aligned) causal mask fits
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # the last q positions: query i sees keys [0, T - q + i]
        rows = torch.arange(total - q_len, total, device=query.device)[:, None]
        allowed = torch.arange(total, device=query.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True
        )
    return out.transpose(0, 1)


def paged_attention(
    query: torch.Tensor,
    layer: torch.Tensor,
    block_table: BlockTable,
    length: int,
    scale: float,
) -> torch.Tensor:
    """`causal_attention` of ``query`` over the pooled K/V of a sequence's ``length`` tokens.

    ``query`` holds the last positions (``[length - q, length)``).
    """
    key, value = gather_kv(layer, block_table, length)
    return causal_attention(query, key.to(query.dtype), value.to(query.dtype), scale)
