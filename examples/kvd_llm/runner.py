"""Inference on kvd sequences: prefill with prefix hits, decode, fork, speculate.

`PagedRunner` drives `TinyLlama` through a kvd client the way a serving
engine would:

1. ``allocate`` the prompt: the daemon returns the longest prefix any
   process committed, and only ``prompt[num_cached_tokens:]`` is computed;
2. every forward writes its K/V into the sequence's blocks, then
   ``commit`` makes full blocks visible to the node;
3. decode ``append``s one token at a time (greedy by default);
4. ``fork`` shares the whole sequence with children for parallel sampling;
5. speculative decoding appends draft tokens, verifies them in one
   forward, and ``truncate``s the rejected ones away.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvd_llm.model import TinyLlama

if TYPE_CHECKING:
    from kvd_client import Client
    from kvd_client import Sequence as KvSequence

__all__ = ["Draft", "PagedRunner", "Request", "greedy"]

#: A draft model: given the sequence so far, propose up to ``k`` next tokens.
Draft = Callable[[list[int], int], list[int]]


def greedy(logits: torch.Tensor) -> int:
    """The most likely token of a ``[vocab]`` logits row."""
    return int(torch.argmax(logits).item())


@dataclass(slots=True)
class Request:
    """One sequence in flight: its kvd handle, tokens and next-token logits."""

    seq: KvSequence
    tokens: list[int]
    #: Logits ``[vocab]`` for the token after ``tokens``.
    logits: torch.Tensor
    #: Tokens served from the prefix cache at allocation.
    cached: int
    #: Tokens whose K/V this process computed for the sequence.
    computed: int
    #: Every logits row computed for the sequence's generated tokens, in order.
    history: list[torch.Tensor] = field(default_factory=list)


class PagedRunner:
    """Runs `TinyLlama` with its K/V in a kvd pool shared by the whole node."""

    def __init__(self, kv: Client, model: TinyLlama) -> None:
        layout = kv.pool.layout
        expected = model.cfg.layout(layout.num_blocks, layout.block_size)
        if layout != expected:
            raise ValueError(f"the pool's layout {layout} is not the model's {expected}")
        self.kv = kv
        self.model = model
        self.layers = [kv.pool.layer(i) for i in range(layout.num_layers)]

    def _forward(self, req: Request, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` to the sequence, compute and commit them; their logits."""
        start = len(req.tokens)
        req.seq.append(list(tokens))
        req.tokens.extend(tokens)
        logits = self.model.forward_paged(
            torch.tensor(tokens, dtype=torch.long), start, self.layers, req.seq.block_table
        )
        req.seq.commit(len(req.tokens))
        req.computed += len(tokens)
        return logits

    def prefill(self, seq_id: str, prompt: Sequence[int], *, reserve: int | None = None) -> Request:
        """Allocate ``prompt``, compute its uncached tail, commit it."""
        tokens = [int(t) for t in prompt]
        seq = self.kv.allocate(seq_id, tokens, reserve=reserve)
        start = seq.num_cached_tokens
        logits = self.model.forward_paged(
            torch.tensor(tokens[start:], dtype=torch.long), start, self.layers, seq.block_table
        )
        seq.commit(len(tokens))
        return Request(seq, tokens, logits[-1], cached=start, computed=len(tokens) - start)

    def step(self, req: Request, token: int) -> torch.Tensor:
        """Append one token and compute it; the next-token logits."""
        req.logits = self._forward(req, [token])[-1]
        return req.logits

    def extend(self, req: Request, tokens: Sequence[int]) -> torch.Tensor:
        """Append several tokens in one forward; their logits ``[n, vocab]``."""
        logits = self._forward(req, tokens)
        req.logits = logits[-1]
        return logits

    def truncate(self, req: Request, n: int, logits: torch.Tensor) -> None:
        """Keep the first ``n`` tokens; ``logits`` are the next-token logits after them."""
        req.seq.truncate(n)
        del req.tokens[n:]
        req.logits = logits

    def fork(self, req: Request, child_id: str) -> Request:
        """A child sharing every block of ``req``; both continue independently."""
        child = req.seq.fork(child_id)
        return Request(
            child, list(req.tokens), req.logits.clone(), cached=len(req.tokens), computed=0
        )

    def generate(
        self,
        req: Request,
        max_new: int,
        sample: Callable[[torch.Tensor], int] = greedy,
    ) -> list[int]:
        """Decode ``max_new`` tokens; the last one is chosen but not fed back."""
        out: list[int] = []
        while len(out) < max_new:
            req.history.append(req.logits)
            out.append(sample(req.logits))
            if len(out) < max_new:
                self.step(req, out[-1])
        return out

    def sample_parallel(
        self, req: Request, n: int, max_new: int, *, temperature: float = 1.0, seed: int = 0
    ) -> list[list[int]]:
        """``n`` samples of ``max_new`` tokens, each on a fork of ``req`` (freed after)."""
        results = []
        for i in range(n):
            child = self.fork(req, f"{req.seq.seq_id}.{i}")
            gen = torch.Generator().manual_seed(seed + i)

            def draw(logits: torch.Tensor, gen: torch.Generator = gen) -> int:
                probs = torch.softmax(logits / temperature, dim=-1)
                return int(torch.multinomial(probs, 1, generator=gen).item())

            results.append(self.generate(child, max_new, draw))
            child.seq.free()
        return results

    def speculate(self, req: Request, max_new: int, draft: Draft, k: int = 4) -> list[int]:
        """Greedy decoding accelerated by ``draft``: the same tokens as `generate`.

        Each round appends the draft's proposals, verifies them in one
        forward, keeps the longest prefix the model agrees with plus the
        model's own next token, and truncates the rejected rest.
        """
        out: list[int] = []
        while len(out) < max_new:
            proposal = draft(list(req.tokens), min(k, max_new - len(out)))
            if not proposal:
                req.history.append(req.logits)
                out.append(greedy(req.logits))
                if len(out) < max_new:
                    self.step(req, out[-1])
                continue
            base, before = len(req.tokens), req.logits
            logits = self.extend(req, proposal)
            rows = [before, *logits]
            accepted = 0
            while accepted < len(proposal) and greedy(rows[accepted]) == proposal[accepted]:
                accepted += 1
            if accepted < len(proposal):
                self.truncate(req, base + accepted, rows[accepted])
            req.history.extend(rows[: accepted + 1])
            out.extend(proposal[:accepted])
            out.append(greedy(rows[accepted]))
            del out[max_new:], req.history[max_new:]
            if len(out) < max_new:
                self.step(req, out[-1])
        return out
