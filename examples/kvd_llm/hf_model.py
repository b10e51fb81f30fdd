"""The tiny model as a Hugging Face ``LlamaForCausalLM`` (same weights, no download)."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from kvd_llm.model import TinyConfig, TinyLlama

__all__ = ["tiny_llama_hf"]


def tiny_llama_hf(cfg: TinyConfig | None = None) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` holding `TinyLlama`'s seeded weights, in inference mode.

    Built from `TinyConfig.to_llama` and loaded from the seeded `TinyLlama`,
    so every process gets bit-identical weights whatever transformers' own
    initialisation does.
    """
    tiny = TinyLlama(cfg)
    model = LlamaForCausalLM(LlamaConfig(**tiny.cfg.to_llama()))
    model.load_state_dict(tiny.state_dict())
    # Random weights, arbitrary token ids: no id means "end" or "padding", so that
    # generation runs its full length and no prompt token is masked as padding.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.train(False)
    return model
