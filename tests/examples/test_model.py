"""The tiny model: the paged path equals the reference path, and both equal Llama."""

from __future__ import annotations

import pytest
import torch
from kvd_llm.model import TinyConfig, TinyLlama

from .support import tokens


def test_paged_path_over_a_scattered_table_equals_full_attention(model: TinyLlama) -> None:
    cfg = model.cfg
    pool = [torch.zeros(2, 16, 4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    table = torch.tensor([9, 2, 14, 0, 7, 11, 3, 5, 12, 1])  # 40 slots, blocks out of order
    seq = torch.tensor(tokens(37, seed=1))
    chunks = [(0, 13), (13, 14), (14, 30), (30, 37)]  # a prefill, a decode step, two extends
    out = torch.cat([model.forward_paged(seq[a:b], a, pool, table) for a, b in chunks])
    torch.testing.assert_close(out, model.forward_reference(seq), rtol=0, atol=1e-5)


def test_same_seed_same_weights_and_layout_from_config() -> None:
    a, b = TinyLlama(TinyConfig(seed=3)), TinyLlama(TinyConfig(seed=3))
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    layout = TinyConfig().layout(num_blocks=8, block_size=4)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    assert (layout.dtype, layout.block_size, layout.num_blocks) == ("float32", 4, 8)


def test_reference_equals_hugging_face_llama_with_the_same_weights(model: TinyLlama) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model.cfg.to_llama()))
    hf.load_state_dict(model.state_dict())
    hf.eval()
    seq = torch.tensor(tokens(29, seed=2))
    with torch.no_grad():
        expected = hf(seq[None]).logits[0]
    torch.testing.assert_close(model.forward_reference(seq), expected, rtol=0, atol=1e-5)


def test_gqa_config_must_divide_heads() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TinyLlama(TinyConfig(num_heads=4, num_kv_heads=3))
