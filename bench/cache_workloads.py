"""Constructed workloads for the eviction comparison: shapes the two real traces lack.

The real traces in ``/work/shared/traces`` reward a policy that protects reused
prefixes; a held-out conversation trace punished one that protected them too long.
These generators build the shapes that tell the two apart, as Mooncake-format
requests (512-token ``hash_ids`` with their whole prefix, as in the real traces), so
they run through every simulator of ``cache_sim.py`` and through kvd's engine alike.
Each is deterministic for its seed and its ids stay below 4,194,303 (``cache_sim``'s
token expansion keeps them distinct).

- ``chat-recency``: multi-turn conversations, the newest turn is what comes back;
  long conversations end, leaving prefixes with many uses that are never used again
  (the trap for a frequency policy).
- ``loop``: one-turn documents read in a cycle slightly larger than a small cache
  (LRU's worst case; nothing should lose to it).
- ``shifting-zipf``: Zipf-popular documents with a fresh question each, whose
  popularity is reshuffled every phase (stale counts).
- ``scan-hot``: a small hot set of system prompts and documents under a stream of
  one-off long prompts (where counting uses pays off).
- ``agent-sessions``: agent sessions that reuse their own growing context many times
  in a burst, then stop (bursty frequency, then dead).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from bench.cache_sim import TRACE_BLOCK, TraceRequest

__all__ = ["WORKLOADS", "Workload"]

Workload = Callable[[int], list[TraceRequest]]


class _Ids:
    """Fresh 512-token block ids (each names a new prefix chain position)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        start = self.next
        self.next += n
        return list(range(start, start + n))


def _request(rng: random.Random, ids: list[int]) -> TraceRequest:
    # The last trace block is partial, as in the real traces.
    return TraceRequest(len(ids) * TRACE_BLOCK - rng.randrange(1, TRACE_BLOCK), tuple(ids))


def chat_recency(seed: int) -> list[TraceRequest]:
    """Conversations: each turn is the previous prompt plus the answer and a new
    message; a turn usually continues one of the few most recent conversations."""
    rng, ids = random.Random(seed), _Ids()
    system = ids.take(1)
    active: list[list[int]] = []
    turns_left: list[int] = []
    out: list[TraceRequest] = []
    while len(out) < 2500:
        if not active or rng.random() < 0.15:
            active.append(system + ids.take(rng.randint(1, 3)))
            # Geometric lengths: most conversations are short, a few run long.
            turns_left.append(1 + int(rng.expovariate(1 / 6)))
            i = len(active) - 1
        else:
            # Recency: the most recent conversations are the likeliest to continue.
            i = len(active) - 1 - min(int(rng.expovariate(1 / 3)), len(active) - 1)
            active[i] = active[i] + ids.take(rng.randint(1, 2))
        out.append(_request(rng, active[i]))
        turns_left[i] -= 1
        if turns_left[i] <= 0:
            del active[i], turns_left[i]
    return out


def loop(seed: int) -> list[TraceRequest]:
    """200 documents of 4 trace blocks read in a cycle, 15 times over."""
    rng, ids = random.Random(seed), _Ids()
    docs = [ids.take(4) for _ in range(200)]
    return [_request(rng, doc) for _ in range(15) for doc in docs]


def shifting_zipf(seed: int) -> list[TraceRequest]:
    """1,000 documents of 1-8 blocks under Zipf(1) popularity, reshuffled every 600
    requests; each request adds a one-block question of its own."""
    rng, ids = random.Random(seed), _Ids()
    docs = [ids.take(rng.randint(1, 8)) for _ in range(1000)]
    weights = [1 / (r + 1) for r in range(len(docs))]
    out: list[TraceRequest] = []
    for _ in range(6):
        rng.shuffle(docs)
        for doc in rng.choices(docs, weights, k=600):
            out.append(_request(rng, doc + ids.take(1)))
    return out


def scan_hot(seed: int) -> list[TraceRequest]:
    """Half the requests reuse one of 20 hot prefixes (2-6 blocks, Zipf); the other
    half are one-off prompts of 4-16 blocks."""
    rng, ids = random.Random(seed), _Ids()
    hot = [ids.take(rng.randint(2, 6)) for _ in range(20)]
    weights = [1 / (r + 1) for r in range(len(hot))]
    out: list[TraceRequest] = []
    for _ in range(3000):
        if rng.random() < 0.5:
            (doc,) = rng.choices(hot, weights)
            out.append(_request(rng, doc + ids.take(1)))
        else:
            out.append(_request(rng, ids.take(rng.randint(4, 16))))
    return out


def agent_sessions(seed: int) -> list[TraceRequest]:
    """Sessions of 5-30 tool-call steps, each step the session's whole context plus one
    block; three sessions interleave at a time, then each is done for good."""
    rng, ids = random.Random(seed), _Ids()
    tools = ids.take(2)
    sessions: list[tuple[list[int], int]] = []
    out: list[TraceRequest] = []
    while len(out) < 2000:
        while len(sessions) < 3:
            sessions.append((tools + ids.take(rng.randint(1, 4)), rng.randint(5, 30)))
        i = rng.randrange(len(sessions))
        context, left = sessions[i]
        context = context + ids.take(1)
        out.append(_request(rng, context))
        if left > 1:
            sessions[i] = (context, left - 1)
        else:
            del sessions[i]
    return out


#: Workloads by name (seeded: ``WORKLOADS[name](seed)``).
WORKLOADS: dict[str, Workload] = {
    "chat-recency": chat_recency,
    "loop": loop,
    "shifting-zipf": shifting_zipf,
    "scan-hot": scan_hot,
    "agent-sessions": agent_sessions,
}
