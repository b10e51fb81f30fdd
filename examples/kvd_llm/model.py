"""A tiny Llama-like decoder whose attention reads and writes K/V in a kvd pool.

Random weights from a fixed seed, fp32: RMSNorm, grouped-query attention
with rotary embeddings (Hugging Face's ``rotate_half`` convention) and a
SwiGLU MLP. Parameter names follow ``LlamaForCausalLM``, so the same
weights load into a Hugging Face model built from `TinyConfig.to_llama`.

Two forward paths compute the same function:

- `TinyLlama.forward_paged`: K/V of the new tokens are scattered into the
  sequence's pool blocks; attention gathers the whole context back by
  block table (`kvd_client.integrations.paged`).
- `TinyLlama.forward_reference`: plain full causal attention over the
  whole sequence, no pool at all; the baseline for comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvd_client.integrations.paged import BlockTable, causal_attention, paged_attention, write_kv
from kvd_client.wire import PoolLayout
from torch import nn
from torch.nn import functional as F

__all__ = ["SIZES", "TinyConfig", "TinyLlama"]


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """The model's geometry; `layout` derives the matching pool layout."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_positions: int = 4096
    seed: int = 0

    def layout(self, num_blocks: int, block_size: int = 16) -> PoolLayout:
        """The fp32 ``layer_major`` pool layout that holds this model's K/V."""
        return PoolLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype="float32",
            block_size=block_size,
            num_blocks=num_blocks,
        )

    def to_llama(self) -> dict[str, Any]:
        """Keyword arguments of an equivalent ``transformers.LlamaConfig``."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.rms_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
        }


#: Named model sizes: ``tiny`` for tests (milliseconds per forward), ``demo``
#: large enough that a long prompt's prefill takes visible time on a CPU.
SIZES: dict[str, TinyConfig] = {
    "tiny": TinyConfig(),
    "demo": TinyConfig(
        vocab_size=4096,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1408,
    ),
}


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Attention(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q ``[n, Hq, D]``, k and v ``[n, Hkv, D]`` of ``n`` tokens."""
        n, d = x.shape[0], self.cfg.head_dim
        q = self.q_proj(x).view(n, self.cfg.num_heads, d)
        k = self.k_proj(x).view(n, self.cfg.num_kv_heads, d)
        v = self.v_proj(x).view(n, self.cfg.num_kv_heads, d)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v


class _MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = _MLP(cfg)


class _Body(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class TinyLlama(nn.Module):
    """The model. Inputs are one sequence's token ids (1-D int64)."""

    def __init__(self, cfg: TinyConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or TinyConfig()
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        gen = torch.Generator().manual_seed(cfg.seed)
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = cfg.head_dim**-0.5
        self.eval()

    def _rope(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, stop, dtype=torch.float32)
        freqs = positions[:, None] * self.get_buffer("inv_freq")[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def _blocks(self) -> list[_Block]:
        return [b for b in self.model.layers if isinstance(b, _Block)]

    @torch.no_grad()
    def forward_paged(
        self,
        tokens: torch.Tensor,
        start: int,
        pool_layers: list[torch.Tensor],
        block_table: BlockTable,
    ) -> torch.Tensor:
        """Logits ``[n, vocab]`` of ``tokens`` at positions ``[start, start+n)``.

        K/V of positions ``[0, start)`` are read from the pool (``pool_layers[i]``
        is layer ``i``'s view); those of the new tokens are written there first.
        """
        if len(pool_layers) != self.cfg.num_layers:
            raise ValueError(f"need {self.cfg.num_layers} pool layers, got {len(pool_layers)}")
        stop = start + tokens.shape[0]
        cos, sin = self._rope(start, stop)
        h = self.model.embed_tokens(tokens)
        for block, layer in zip(self._blocks(), pool_layers, strict=True):
            q, k, v = block.self_attn.qkv(block.input_layernorm(h), cos, sin)
            write_kv(layer, block_table, start, k, v)
            att = paged_attention(q, layer, block_table, stop, self.scale)
            h = h + block.self_attn.o_proj(att.reshape(tokens.shape[0], -1))
            h = h + block.mlp(block.post_attention_layernorm(h))
        logits: torch.Tensor = self.lm_head(self.model.norm(h))
        return logits

    @torch.no_grad()
    def forward_reference(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` of the whole sequence with full attention, no pool."""
        cos, sin = self._rope(0, tokens.shape[0])
        h = self.model.embed_tokens(tokens)
        for block in self._blocks():
            q, k, v = block.self_attn.qkv(block.input_layernorm(h), cos, sin)
            att = causal_attention(q, k, v, self.scale)
            h = h + block.self_attn.o_proj(att.reshape(tokens.shape[0], -1))
            h = h + block.mlp(block.post_attention_layernorm(h))
        logits: torch.Tensor = self.lm_head(self.model.norm(h))
        return logits
