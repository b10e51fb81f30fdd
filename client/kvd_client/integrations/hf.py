"""A Hugging Face transformers `Cache` whose K/V live in a kvd pool.

``KvdCache`` allocates one kvd sequence for a prompt: the daemon hands back
the longest prefix that any process on the node has already committed, and
the cache starts out holding it, so ``generate`` feeds the model only the
uncached tokens (with the right positions). Every forward scatters the new
tokens' K/V into the sequence's blocks, attends over the whole sequence
gathered by block table, and commits what it wrote, so that full blocks
become visible to every other process at once.

    cache = KvdCache(kv, model, "req-7", input_ids, reserve=len + max_new)
    out = model.generate(input_ids, cache=cache, max_new_tokens=max_new)
    cache.close()            # free the sequence; committed blocks stay cached

kvd needs the token ids of everything it stores (they name the blocks), and
a transformers cache only ever sees K/V tensors, so the cache registers a
forward pre-hook on the model that reads ``input_ids`` of the calls that
pass this cache, and appends new tokens to the sequence before the layers
run. One `KvdCache` holds one sequence: batch size 1. Parallel samples
come from `KvdCache.fork` (shared blocks, copy-on-write), not from a batch.

Written against transformers 5.x (``cache=`` keyword; ``past_key_values=``
still works there, deprecated).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import numpy.typing as npt
import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionCacheLayerMixin,
)

from kvd_client.errors import InvalidRequest
from kvd_client.integrations.paged import gather_kv, write_kv

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle
    from transformers import PreTrainedModel

    from kvd_client import Client, Sequence
    from kvd_client.wire import PoolLayout

__all__ = ["KvdCache", "KvdCacheLayer", "check_model"]


def _one_sequence() -> NoReturn:
    raise InvalidRequest(
        "a KvdCache holds one sequence (batch 1): use KvdCache.fork for samples or beams"
    )


class _Shared:
    """State of the one sequence that every layer of a `KvdCache` writes into."""

    __slots__ = ("computed", "sequence", "tokens")

    def __init__(self, sequence: Sequence[Client], tokens: list[int]) -> None:
        self.sequence = sequence
        #: The sequence's token ids, as kvd knows them.
        self.tokens = tokens
        #: Tokens whose K/V this cache computed (the rest came from the prefix cache).
        self.computed = 0


class KvdCacheLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One decoder layer's K/V: a view of the pool layer and the sequence's block table.

    ``length`` counts the tokens whose K/V this layer holds; `update` writes
    the next ones at positions ``[length, length + n)``. The last layer
    commits them once written, so their full blocks join the prefix cache.
    """

    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, shared: _Shared, pool_layer: torch.Tensor, length: int, last: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._shared = shared
        self._pool = pool_layer
        self._last = last
        self.length = length
        self.device = pool_layer.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to set up: the pool exists before the first token."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new K/V ``[1, Hkv, n, D]`` to the pool; return all of it, ``[1, Hkv, T, D]``."""
        if key_states.shape[0] != 1:
            _one_sequence()
        n = key_states.shape[2]
        stop = self.length + n
        if stop > len(self._shared.tokens):
            raise InvalidRequest(
                f"K/V for {stop} tokens but the sequence has {len(self._shared.tokens)}: "
                "call the model with this cache as its cache= argument, so it sees the tokens"
            )
        table = self._shared.sequence.block_table
        key, value = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        write_kv(self._pool, table, self.length, key, value)
        self.length = stop
        if self._last:
            self._shared.sequence.commit(stop)
        keys, values = gather_kv(self._pool, table, stop)
        # The pool may live elsewhere than the model (an shm pool under a GPU model).
        keys = keys.to(device=key_states.device, dtype=key_states.dtype)
        values = values.to(device=value_states.device, dtype=value_states.dtype)
        return keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the next forward: the whole sequence, from 0."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens whose K/V this layer holds."""
        return self.length

    def get_max_length(self) -> int:
        """No fixed maximum: the sequence grows block by block (-1)."""
        return -1

    def reset(self) -> None:
        """Refused: a pooled sequence is rolled back with `KvdCache.crop`, never zeroed."""
        raise InvalidRequest("a KvdCache cannot be reset: crop it, or close it and allocate anew")

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (`KvdCache.crop` truncates the sequence)."""
        if tokens_to_remove > 0:
            raise InvalidRequest("crop takes a negative count: the number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Refused: one sequence per cache (see `KvdCache.fork`)."""
        _one_sequence()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Refused: one sequence per cache (see `KvdCache.fork`)."""
        _one_sequence()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Refused: one sequence per cache (see `KvdCache.fork`)."""
        _one_sequence()


def _token_list(input_ids: torch.Tensor | Seq[int] | npt.NDArray[np.integer]) -> list[int]:
    arr = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
    arr = np.asarray(arr)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        _one_sequence()
    return [int(t) for t in arr]


def check_model(model: PreTrainedModel, layout: PoolLayout) -> None:
    """Raise `InvalidRequest` unless ``model``'s K/V geometry and dtype are the pool's."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dtype = str(model.dtype).removeprefix("torch.")
    got = (cfg.num_hidden_layers, kv_heads, head_dim, dtype)
    want = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype)
    if got != want:
        raise InvalidRequest(
            f"the model's (layers, kv heads, head_dim, dtype) {got} differ from the pool's {want}"
        )


class KvdCache(Cache):
    """A transformers cache over one kvd sequence: prefix hits, paged K/V, commits.

    ``KvdCache(kv, model, seq_id, input_ids, reserve=...)`` allocates the
    sequence for the prompt ``input_ids`` (one sequence: ``[n]`` or
    ``[1, n]``); `num_cached_tokens` of them come from the prefix cache and
    are never recomputed. Pass the cache to ``generate`` / ``forward`` as
    ``cache=`` with the *whole* prompt for ``generate`` (it feeds only the
    uncached tail), or the tail alone for a plain forward. `close` frees the
    sequence (its committed blocks stay cached for others).

    Errors of the daemon (``OUT_OF_BLOCKS`` and the like) propagate from the
    client unchanged; nothing is registered on the model when allocation fails.
    """

    def __init__(
        self,
        kv: Client,
        model: PreTrainedModel,
        seq_id: str,
        input_ids: torch.Tensor | Seq[int] | npt.NDArray[np.integer],
        *,
        reserve: int | None = None,
    ) -> None:
        tokens = _token_list(input_ids)
        check_model(model, kv.pool.layout)
        sequence = kv.allocate(seq_id, tokens, reserve=reserve)
        self._attach(kv, model, sequence, tokens, sequence.num_cached_tokens)

    def _attach(
        self,
        kv: Client,
        model: PreTrainedModel,
        sequence: Sequence[Client],
        tokens: list[int],
        length: int,
    ) -> None:
        self._kv = kv
        self._model = model
        self._shared = _Shared(sequence, tokens)
        self._cached = length
        n = kv.pool.layout.num_layers
        layers: list[CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer] = [
            KvdCacheLayer(self._shared, kv.pool.layer(i), length, i == n - 1) for i in range(n)
        ]
        super().__init__(layers=layers)
        self._hook: RemovableHandle | None = model.register_forward_pre_hook(
            self._on_forward, with_kwargs=True
        )

    @property
    def sequence(self) -> Sequence[Client]:
        """The kvd sequence behind this cache."""
        return self._shared.sequence

    @property
    def tokens(self) -> list[int]:
        """The sequence's token ids (a copy)."""
        return list(self._shared.tokens)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens served from the prefix cache when this cache was made."""
        return self._cached

    @property
    def computed_tokens(self) -> int:
        """Tokens whose K/V the model computed through this cache."""
        return self._shared.computed

    def _on_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Forward pre-hook: register the call's new tokens with the sequence first."""
        if kwargs.get("cache", kwargs.get("past_key_values")) is not self:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            raise InvalidRequest("a KvdCache needs input_ids: kvd names its blocks by token ids")
        start = self.get_seq_length()
        positions = kwargs.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.numel():
            first = int(positions.reshape(-1)[0])
            if first != start:
                raise InvalidRequest(
                    f"tokens fed at position {first} but the cache holds {start}: "
                    "feed only what follows the cached tokens"
                )
        self._feed(start, _token_list(ids))

    def _feed(self, start: int, new: list[int]) -> None:
        shared = self._shared
        known = shared.tokens[start : start + len(new)]
        if new[: len(known)] != known:
            raise InvalidRequest(
                f"the tokens fed at position {start} differ from the sequence's: "
                "pass the same prompt the cache was allocated with"
            )
        extra = new[len(known) :]
        if extra:
            shared.sequence.append(extra)
            shared.tokens.extend(extra)
        shared.computed += len(new)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (rejected speculative tokens)."""
        if tokens_to_remove > 0:
            raise InvalidRequest("crop takes a negative count: the number of tokens to remove")
        keep = max(0, self.get_seq_length() + tokens_to_remove)
        if keep < len(self._shared.tokens):
            self._shared.sequence.truncate(keep)
            del self._shared.tokens[keep:]
        super().crop(tokens_to_remove)

    def fork(self, seq_id: str, *, reserve: int | None = None) -> KvdCache:
        """A new cache on a child sequence sharing every block written so far."""
        if self.get_seq_length() != len(self._shared.tokens):
            raise InvalidRequest("fork a KvdCache between forwards, once its tokens are written")
        child = self._shared.sequence.fork(seq_id, reserve=reserve)
        forked = KvdCache.__new__(KvdCache)
        forked._attach(
            self._kv, self._model, child, list(self._shared.tokens), len(self._shared.tokens)
        )
        return forked

    def close(self) -> None:
        """Free the sequence and detach from the model; committed blocks stay cached."""
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        self._shared.sequence.free()

    def __enter__(self) -> KvdCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
