"""KvdCache: transformers generation over kvd, against the model's own DynamicCache."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from kvd_client import Client, OutOfBlocks
from kvd_client.errors import InvalidRequest

from .support import NUM_BLOCKS, POOL, run_python, tokens

transformers = pytest.importorskip("transformers")

from kvd_client.integrations.hf import KvdCache  # noqa: E402  (needs transformers)

BS = 16


def generate(model: Any, prompt: torch.Tensor, cache: Any, max_new: int = 8) -> Any:
    return model.generate(
        prompt,
        cache=cache,
        max_new_tokens=max_new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )


def assert_same_generation(got: Any, want: Any) -> None:
    assert got.sequences.tolist() == want.sequences.tolist()
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-5)


def dynamic(model: Any) -> Any:
    return transformers.DynamicCache(config=model.config)


PROCESS_A = """
import torch
from kvd_client import Client, OutOfBlocks
from kvd_client.integrations.hf import KvdCache
from kvd_llm.hf_model import tiny_llama_hf

model = tiny_llama_hf()
prompt = torch.tensor([[{prompt}]])
with Client.connect({address!r}, pool={pool!r}, name="A") as kv:
    with KvdCache(kv, model, "A", prompt, reserve=prompt.shape[1] + 4) as cache:
        model.generate(prompt, cache=cache, max_new_tokens=4, do_sample=False)
        print(cache.num_cached_tokens, cache.computed_tokens)
"""


def test_b_reuses_the_prefix_a_committed_and_matches_dynamic_cache(
    kv: Client, daemon: str, hf_model: Any
) -> None:
    system = tokens(4 * BS + 3, seed=1)
    prompt_a = torch.cat([system, tokens(5, seed=2)], dim=1)
    prompt_b = torch.cat([system, tokens(11, seed=3)], dim=1)
    code = PROCESS_A.format(
        prompt=",".join(map(str, prompt_a[0].tolist())), address=daemon, pool=POOL
    )
    assert run_python(code).split() == ["0", str(prompt_a.shape[1] + 3)]

    with KvdCache(kv, hf_model, "B", prompt_b, reserve=prompt_b.shape[1] + 8) as cache:
        assert cache.num_cached_tokens == 4 * BS  # whole blocks of the shared system prompt
        got = generate(hf_model, prompt_b, cache)
        assert cache.computed_tokens == prompt_b.shape[1] - 4 * BS + 7
        assert cache.sequence.num_tokens == prompt_b.shape[1] + 7
    assert_same_generation(got, generate(hf_model, prompt_b, dynamic(hf_model)))


def test_the_deprecated_past_key_values_keyword_works_too(kv: Client, hf_model: Any) -> None:
    prompt = tokens(BS + 3, seed=15)
    with KvdCache(kv, hf_model, "pkv", prompt) as cache, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.x: "use `cache`"
        got = hf_model.generate(prompt, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert cache.sequence.num_tokens == prompt.shape[1] + 3
    want = hf_model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert got.tolist() == want.tolist()


def test_a_plain_forward_takes_only_the_uncached_tail(kv: Client, hf_model: Any) -> None:
    prompt = tokens(3 * BS + 2, seed=4)
    with KvdCache(kv, hf_model, "first", prompt) as first:
        hf_model(prompt, cache=first)
    with KvdCache(kv, hf_model, "second", prompt) as cache, torch.no_grad():
        hit = cache.num_cached_tokens
        assert hit == 3 * BS
        logits = hf_model(prompt[:, hit:], cache=cache).logits
        full = hf_model(prompt).logits
    torch.testing.assert_close(logits, full[:, hit:], rtol=0, atol=1e-5)


def test_crop_then_feed_equals_never_feeding_the_rejected_tokens(kv: Client, hf_model: Any) -> None:
    prompt = tokens(BS + 9, seed=5)
    kept, rejected, correct = [4, 5], [6, 7, 8, 9, 10], [11]
    reserve = prompt.shape[1] + 8
    with KvdCache(kv, hf_model, "spec", prompt, reserve=reserve) as cache, torch.no_grad():
        hf_model(prompt, cache=cache)
        hf_model(torch.tensor([kept + rejected]), cache=cache)  # crosses into a new block
        cache.crop(-len(rejected))
        assert cache.get_seq_length() == prompt.shape[1] + len(kept)
        assert cache.sequence.num_tokens == prompt.shape[1] + len(kept)
        got = hf_model(torch.tensor([correct]), cache=cache).logits[0, -1]
        want = hf_model(torch.cat([prompt, torch.tensor([kept + correct])], 1)).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_assisted_generation_crops_rejected_drafts_and_matches_greedy(
    kv: Client, hf_model: Any
) -> None:
    from kvd_llm.hf_model import tiny_llama_hf
    from kvd_llm.model import TinyConfig

    draft = tiny_llama_hf(TinyConfig(num_layers=1, seed=9))
    prompt = tokens(2 * BS, seed=6)
    with KvdCache(kv, hf_model, "assisted", prompt) as cache:
        got = hf_model.generate(
            prompt, cache=cache, assistant_model=draft, max_new_tokens=10, do_sample=False
        )
        # Drafts were computed and rolled back: more K/V computed than tokens kept.
        assert cache.computed_tokens > cache.sequence.num_tokens
        assert cache.sequence.num_tokens == got.shape[1] - 1
    want = hf_model.generate(prompt, max_new_tokens=10, do_sample=False)
    assert got.tolist() == want.tolist()


def test_forks_continue_independently_from_the_shared_prompt(kv: Client, hf_model: Any) -> None:
    prompt = tokens(BS + 5, seed=7)
    with KvdCache(kv, hf_model, "parent", prompt, reserve=prompt.shape[1] + 8) as parent:
        with torch.no_grad():
            hf_model(prompt, cache=parent)
        children = [parent.fork(f"parent.{i}") for i in range(2)]
        outs = []
        for i, child in enumerate(children):
            start = torch.cat([prompt, torch.tensor([[100 + i]])], dim=1)
            with child:
                outs.append(generate(hf_model, start, child, max_new=5))
        for i, out in enumerate(outs):
            start = torch.cat([prompt, torch.tensor([[100 + i]])], dim=1)
            assert_same_generation(out, generate(hf_model, start, dynamic(hf_model), max_new=5))
        assert outs[0].sequences.tolist() != outs[1].sequences.tolist()
        # The parent saw none of its children's tokens.
        start = torch.cat([prompt, torch.tensor([[7]])], dim=1)
        parent_out = generate(hf_model, start, parent, max_new=4)
    assert_same_generation(parent_out, generate(hf_model, start, dynamic(hf_model), max_new=4))


def test_a_batch_is_refused_before_anything_is_allocated(kv: Client, hf_model: Any) -> None:
    with pytest.raises(InvalidRequest, match="one sequence") as info:
        KvdCache(kv, hf_model, "batch", tokens(8, seed=8).repeat(2, 1))
    assert info.value.code == "INVALID"
    assert kv.stats()["pools"][POOL]["sequences"] == 0
    assert hf_model._forward_pre_hooks == {}


def test_a_refused_allocation_propagates_and_attaches_nothing(kv: Client, hf_model: Any) -> None:
    with pytest.raises(OutOfBlocks):
        KvdCache(kv, hf_model, "huge", tokens(8, seed=14), reserve=(NUM_BLOCKS + 1) * BS)
    assert kv.stats()["pools"][POOL]["sequences"] == 0
    assert hf_model._forward_pre_hooks == {}


def test_a_model_of_another_geometry_is_refused(kv: Client) -> None:
    from kvd_llm.hf_model import tiny_llama_hf
    from kvd_llm.model import TinyConfig

    other = tiny_llama_hf(TinyConfig(num_kv_heads=4))
    with pytest.raises(InvalidRequest, match="differ from the pool"):
        KvdCache(kv, other, "other", tokens(8, seed=9))
    assert kv.stats()["pools"][POOL]["sequences"] == 0


def test_feeding_other_tokens_than_the_prompt_is_refused(kv: Client, hf_model: Any) -> None:
    prompt = tokens(10, seed=10)
    with KvdCache(kv, hf_model, "strict", prompt) as cache:
        with pytest.raises(InvalidRequest, match="differ from the sequence"):
            hf_model(tokens(10, seed=11), cache=cache)
        assert cache.get_seq_length() == 0
        assert cache.sequence.num_tokens == 10


def test_generating_from_a_prompt_the_cache_already_holds_is_refused(
    kv: Client, hf_model: Any
) -> None:
    prompt = tokens(BS + 2, seed=13)
    with KvdCache(kv, hf_model, "whole", prompt) as cache:
        hf_model(prompt, cache=cache)
        with pytest.raises(InvalidRequest, match="feed only what follows"):
            hf_model.generate(prompt, cache=cache, max_new_tokens=2, do_sample=False)
        assert cache.sequence.num_tokens == prompt.shape[1]


def test_close_frees_the_sequence_and_detaches_from_the_model(kv: Client, hf_model: Any) -> None:
    cache = KvdCache(kv, hf_model, "closing", tokens(BS + 1, seed=12))
    assert len(hf_model._forward_pre_hooks) == 1
    cache.close()
    cache.close()
    assert not cache.sequence.alive
    assert hf_model._forward_pre_hooks == {}
    assert kv.stats()["pools"][POOL]["sequences"] == 0
