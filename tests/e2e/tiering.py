"""What the tier tests share: a prompt's computed values, eviction, waiting for the copies."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "BS",
    "SETTLE_S",
    "AgentProcess",
    "KvdProcess",
    "compute",
    "evict_everything",
    "wait_for",
]

BS = 16  # the tiny pool's block size
#: A daemon (tests/conftest.KvdProcess), a client process (tests/e2e/conftest.AgentProcess).
KvdProcess = AgentProcess = Any
#: How long the background copies may take on a loaded machine (a bound, not a measure).
SETTLE_S = 30.0


def wait_for(
    daemon: KvdProcess, what: Callable[[dict[str, Any]], bool], tier_key: str = "default"
) -> dict[str, Any]:
    """The ``tiers`` stats of ``tier_key`` (the pool's first tier; a chain's
    tier 2: ``default@tier2``) once ``what`` holds for them (copies run in
    the background)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        tier: dict[str, Any] = daemon.stats()["tiers"][tier_key]
        if what(tier) or time.monotonic() > deadline:
            return tier
        time.sleep(0.01)


def compute(agent: AgentProcess, seq: str, prompt: list[int]) -> list[float]:
    """Allocate ``prompt``, write a distinct value per position, commit, free; the values."""
    agent.ok("allocate", seq=seq, tokens=prompt)
    # Integers below 2048: exact in the pool's float16.
    values = [float((prompt[pos] * 7 + pos) % 2000) for pos in range(len(prompt))]
    for pos, value in enumerate(values):
        agent.ok("fill", seq=seq, start=pos, stop=pos + 1, value=value)
    agent.ok("commit", seq=seq)
    agent.ok("free", seq=seq)
    return values


def evict_everything(agent: AgentProcess) -> None:
    """Fill the whole 8-block pool with another prompt, then let it go."""
    agent.ok("allocate", seq="other", tokens=list(range(5000, 5000 + 8 * BS)))
    agent.ok("free", seq="other")
