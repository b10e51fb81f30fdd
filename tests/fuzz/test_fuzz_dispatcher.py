"""Hostile messages through the daemon's dispatcher in process (real engine, real shm pool).

Every message must get an error reply with a known code other than INTERNAL
(or a valid reply), leave the engine's invariants intact, change nothing when
rejected, and never touch the victim session's sequences or pins (see
``harness.py``). ``KVD_FUZZ_SECONDS`` runs rounds of fresh random examples
for that long instead of the fixed, derandomized CI round (lift pytest-timeout's
limit: ``KVD_FUZZ_SECONDS=600 pytest -s --timeout=0 tests/fuzz/test_fuzz_dispatcher.py``).
"""

from __future__ import annotations

import os
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .harness import ATTACKER, NOBODY, Target
from .strategies import messages

#: Examples (each a list of messages on a fresh target) in the CI round.
CI_EXAMPLES = 400


def _run(examples: int, derandomize: bool) -> tuple[int, int]:
    sent = [0, 0]

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(
        batch=st.lists(messages, min_size=4, max_size=16),
        who=st.sampled_from([ATTACKER, ATTACKER, ATTACKER, NOBODY]),
    )
    def fuzz(batch: list[list[bytes]], who: bytes) -> None:
        target = Target()
        try:
            for frames in batch:
                target.send(frames, who)
        finally:
            sent[0] += target.messages
            sent[1] += target.rejected
            target.close()

    fuzz()
    return sent[0], sent[1]


def test_hostile_messages_are_answered_and_rejected_ones_change_nothing() -> None:
    budget = float(os.environ.get("KVD_FUZZ_SECONDS", "0"))
    if not budget:
        messages_sent, rejected = _run(CI_EXAMPLES, derandomize=True)
    else:
        messages_sent = rejected = 0
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            m, r = _run(200, derandomize=False)
            messages_sent, rejected = messages_sent + m, rejected + r
        print(f"\nfuzzed {messages_sent} messages through the dispatcher, {rejected} rejected")
    assert messages_sent > 1000
    assert messages_sent // 4 < rejected < messages_sent  # both paths well exercised
