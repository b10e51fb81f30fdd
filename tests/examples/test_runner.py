"""The paged runner against a real daemon: prefix hits across processes, fork, truncate."""

from __future__ import annotations

import pytest
import torch
from kvd_client import Client
from kvd_llm.model import TinyConfig, TinyLlama
from kvd_llm.runner import PagedRunner, greedy

from .support import POOL, run_worker, tokens

BS = 16


def reference(model: TinyLlama, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Reference logits rows that chose each of ``out`` after ``prompt`` (no kvd)."""
    return model.forward_reference(torch.tensor(prompt + out[:-1]))[len(prompt) - 1 :]


def test_b_computes_only_what_a_did_not_commit_and_matches_recompute(
    kv: Client, daemon: str, model: TinyLlama
) -> None:
    system = tokens(5 * BS, seed=10)  # a shared system prompt of exactly 5 blocks
    prompt_a, prompt_b = system + tokens(7, seed=11), system + tokens(9, seed=12)
    a = run_worker(
        {
            "address": daemon,
            "pool": POOL,
            "name": "A",
            "prompt": prompt_a,
            "max_new": 4,
            "check": True,
        }
    )
    assert (a["cached_tokens"], a["prefill_tokens"]) == (0, len(prompt_a))
    assert a["matches_reference"] and a["max_logit_diff"] <= 1e-5

    runner = PagedRunner(kv, model)
    b = runner.prefill("B", prompt_b, reserve=len(prompt_b) + 8)
    assert b.cached == len(system)
    assert b.computed == len(prompt_b) - len(system)
    out = runner.generate(b, 8)
    rows = reference(model, prompt_b, out)
    assert out == [greedy(r) for r in rows]
    torch.testing.assert_close(torch.stack(b.history), rows, rtol=0, atol=1e-5)


def test_a_fully_cached_prompt_still_computes_its_last_block(kv: Client, model: TinyLlama) -> None:
    runner = PagedRunner(kv, model)
    prompt = tokens(3 * BS, seed=20)
    runner.prefill("first", prompt).seq.free()
    again = runner.prefill("again", prompt)
    assert (again.cached, again.computed) == (2 * BS, BS)
    torch.testing.assert_close(
        again.logits, model.forward_reference(torch.tensor(prompt))[-1], rtol=0, atol=1e-5
    )


def test_forks_share_the_prefix_and_continue_independently(kv: Client, model: TinyLlama) -> None:
    runner = PagedRunner(kv, model)
    prompt = tokens(2 * BS + 5, seed=30)
    parent = runner.prefill("parent", prompt, reserve=len(prompt) + 16)
    children = [runner.fork(parent, f"parent.{i}") for i in range(3)]
    for child in children:
        assert list(child.seq.block_table) == list(parent.seq.block_table)
    firsts = [3, 77, 200]  # force different continuations into the shared partial block
    outs = []
    for child, first in zip(children, firsts, strict=True):
        runner.step(child, first)
        outs.append([first, *runner.generate(child, 6)])
    assert len({tuple(o) for o in outs}) == 3
    for child, out in zip(children, outs, strict=True):
        assert child.seq.block_table[:2].tolist() == parent.seq.block_table[:2].tolist()
        expected = model.forward_reference(torch.tensor(prompt + out[:-1]))[len(prompt) :]
        torch.testing.assert_close(torch.stack(child.history), expected, rtol=0, atol=1e-5)
    # The parent's own continuation is untouched by its children's writes.
    parent_out = runner.generate(parent, 5)
    rows = reference(model, prompt, parent_out)
    assert parent_out == [greedy(r) for r in rows]
    torch.testing.assert_close(torch.stack(parent.history), rows, rtol=0, atol=1e-5)


def test_parallel_samples_are_reproducible_and_leave_no_sequences(
    kv: Client, model: TinyLlama
) -> None:
    runner = PagedRunner(kv, model)
    parent = runner.prefill("sampled", tokens(BS + 3, seed=40))
    first = runner.sample_parallel(parent, n=3, max_new=6, temperature=2.0, seed=7)
    second = runner.sample_parallel(parent, n=3, max_new=6, temperature=2.0, seed=7)
    assert first == second
    assert len({tuple(s) for s in first}) > 1
    assert kv.stats()["pools"][POOL]["sequences"] == 1  # only the parent remains


def test_truncate_then_append_equals_never_appending(kv: Client, model: TinyLlama) -> None:
    runner = PagedRunner(kv, model)
    prompt = tokens(BS + 10, seed=50)
    req = runner.prefill("spec", prompt, reserve=len(prompt) + 16)
    kept, rejected, correct = [5, 6], [7, 8, 9, 10, 11, 12, 13, 14], [42]
    runner.extend(req, kept + rejected)  # crosses into a new block, then rolled back
    runner.truncate(req, len(prompt) + len(kept), req.logits)
    assert len(req.seq.block_table) == -(-(len(prompt) + len(kept)) // BS)
    logits = runner.extend(req, correct)
    expected = model.forward_reference(torch.tensor(prompt + kept + correct))[-1]
    torch.testing.assert_close(logits[-1], expected, rtol=0, atol=1e-5)


def test_speculative_decoding_gives_exactly_the_greedy_tokens(kv: Client, model: TinyLlama) -> None:
    runner = PagedRunner(kv, model)
    prompt = tokens(BS + 1, seed=60)
    plain = runner.prefill("plain", prompt, reserve=len(prompt) + 12)
    want = runner.generate(plain, 12)

    calls = 0

    def draft(seq: list[int], k: int) -> list[int]:
        """Right for two tokens, then wrong: every round accepts some and rejects some."""
        nonlocal calls
        calls += 1
        done = len(seq) - len(prompt)
        good = want[done : done + min(k, 2)]
        return good + [(t + 1) % 256 for t in want[done + len(good) : done + k]]

    spec = runner.prefill("spec", prompt, reserve=len(prompt) + 16)
    got = runner.speculate(spec, 12, draft, k=4)
    assert got == want
    assert calls < 12  # fewer verification rounds than tokens
    torch.testing.assert_close(
        torch.stack(spec.history), torch.stack(plain.history), atol=1e-5, rtol=0
    )


def test_runner_refuses_a_model_of_another_layout(kv: Client) -> None:
    with pytest.raises(ValueError, match="layout"):
        PagedRunner(kv, TinyLlama(TinyConfig(num_layers=3)))
