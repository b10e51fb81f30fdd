"""vLLM 0.33.0's real KV-cache manager, set up the way its scheduler uses it.

Only importable in ``.bench-venv`` (``bench/setup-vllm-venv.sh``). Nothing of vLLM is
changed: the manager is built on CPU from a minimal ``KVCacheConfig`` (one
full-attention group; the manager never touches tensors), requests are real
``vllm.v1.request.Request`` objects hashed by vLLM's own ``sha256_cbor`` block
hasher, and the scheduler's calls are made in its order: ``get_computed_blocks``,
``allocate_slots`` for the prompt, ``allocate_slots(request, 1)`` per decoded token
after ``append_output_token_ids``, ``free``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

__all__ = [
    "BlockHash",
    "Request",
    "VllmDriver",
    "lookup_hasher",
    "make_manager",
    "make_request",
    "sha256_block_keys",
    "sha256_hasher",
]

#: Longest sequence the manager accepts (it only bounds slot counts here).
MAX_MODEL_LEN = 1 << 22

init_none_hash(sha256_cbor)
if not kv_cache_utils.NONE_HASH.hex().startswith("9bd96a485ad84efd"):  # DESIGN.md's vector
    raise RuntimeError("vLLM's sha256_cbor root differs from kvd's: is PYTHONHASHSEED set?")


def make_manager(num_blocks: int, block_size: int) -> KVCacheManager:
    """A prefix-caching ``KVCacheManager`` over ``num_blocks`` blocks on CPU.

    vLLM keeps one block as its null block, so the pool gets one extra to offer
    ``num_blocks`` usable blocks, as kvd does.
    """
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=num_blocks + 1,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
    )


def sha256_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """vLLM's request block hasher with ``sha256_cbor`` (its default for caching)."""
    hasher: Callable[[Request], list[BlockHash]] = get_request_block_hasher(block_size, sha256_cbor)
    return hasher


def lookup_hasher(keys: Sequence[BlockHash], block_size: int) -> Callable[[Request], Any]:
    """A block hasher that hands out precomputed ``keys`` (manager-only timing)."""

    def hasher(request: Request) -> Sequence[BlockHash]:
        return keys[len(request.block_hashes) : request.num_tokens // block_size]

    return hasher


_SAMPLING: dict[int, SamplingParams] = {}


def make_request(
    request_id: str,
    tokens: list[int],
    keys: Sequence[BlockHash] | None = None,
    *,
    block_size: int = 16,
    max_tokens: int = 1,
) -> Request:
    """A ``Request`` hashed by ``sha256_cbor`` (``keys=None``) or by precomputed ``keys``."""
    sampling = _SAMPLING.get(max_tokens)
    if sampling is None:
        sampling = _SAMPLING[max_tokens] = SamplingParams(max_tokens=max_tokens)
    hasher = sha256_hasher(block_size) if keys is None else lookup_hasher(keys, block_size)
    return Request(request_id, tokens, sampling, None, block_hasher=hasher)


def chain_keys(tokens: npt.NDArray[np.int32], block_size: int) -> list[BlockHash]:
    """sha256_cbor keys of every full block of ``tokens``, by vLLM's own function."""
    keys: list[BlockHash] = []
    parent: BlockHash | None = None
    ids = tokens.tolist()
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash_block_tokens(sha256_cbor, parent, ids[start : start + block_size])
        keys.append(parent)
    return keys


def sha256_block_keys(
    trace: Any, expand: Callable[[Any], npt.NDArray[np.int32]], block_size: int
) -> list[list[BlockHash]]:
    """Per request of a `bench.replay.Trace`, the vLLM key of each full block.

    Each distinct chain block is hashed once (by vLLM's ``hash_block_tokens``),
    since equal trace keys mean equal prefixes.
    """
    known: dict[int, BlockHash] = {}
    out = []
    for req, keys in zip(trace.requests, trace.keys, strict=True):
        if not keys or keys[-1] not in known:
            tokens = expand(req)
            start = 0
            while start < len(keys) and keys[start] in known:
                start += 1
            parent = known[keys[start - 1]] if start else None
            ids = tokens.tolist()
            for i in range(start, len(keys)):
                parent = hash_block_tokens(
                    sha256_cbor, parent, ids[i * block_size : (i + 1) * block_size]
                )
                known[keys[i]] = parent
        out.append([known[k] for k in keys])
    return out


class VllmDriver:
    """Drives a ``KVCacheManager`` the way vLLM's scheduler does, one request at a time.

    ``admit`` is the waiting-queue path (lookup, allocate the prompt, mark the
    prompt computed); ``decode`` appends one token and allocates its slot;
    ``finish`` frees. Returns mirror kvd's: the hit in tokens, or None if refused.
    """

    __slots__ = ("manager",)

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager

    def admit(self, request: Request) -> int | None:
        """Match the cached prefix and allocate the rest of the prompt."""
        manager = self.manager
        blocks, hit = manager.get_computed_blocks(request)[:2]
        if manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is None:
            return None
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.RUNNING
        return int(hit)

    def decode(self, request: Request, token: int) -> bool:
        """Append one generated token and allocate its slot; False if refused."""
        request.append_output_token_ids(token)
        if self.manager.allocate_slots(request, 1) is None:
            return False
        request.num_computed_tokens += 1
        return True

    def finish(self, request: Request) -> None:
        """Free the request's blocks (tail first, as vLLM does)."""
        self.manager.free(request)
