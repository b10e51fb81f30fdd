"""Issue #14's hostile families in process: msgpack bombs, multi-frame messages, session floods.

- Bombs (finding 3) through `wire.decode_request`: a request or a ProtocolError,
  and the decoder's peak allocation (tracemalloc) within `DECODE_BUDGET`
  whatever the body. Failed before the total budget per body
  (`wire.frames.MAX_DECODED_OBJECTS`): with limits per container only, a
  1 MiB body of empty arrays decoded into ~64 MiB of lists.
- Bombs and multi-frame messages through the dispatcher (`harness.Target`):
  answered with a known code other than INTERNAL, state unchanged when
  refused, the victim untouched.
- Session floods (finding 2) through the dispatcher, with a descriptor budget
  that has room for fewer sessions than ``server.max_sessions``: never more
  sessions than the budget admits, the rest refused with BUSY. Fails on main
  until the hello handler asks `SessionTable.refusal`.

Small CI rounds (derandomized, no shrinking: a failure on today's main is
reported at once); ``KVD_FUZZ_EXAMPLES`` raises the example counts.
"""

from __future__ import annotations

import os
import tracemalloc

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kvd_client import wire

from kvd.server.sessions import DescriptorBudget

from .harness import ATTACKER, VICTIM, Target
from .strategies import bomb_messages, flood_frames, msgpack_bomb, multi_frame, session_flood

SCALE = max(1, int(os.environ.get("KVD_FUZZ_EXAMPLES", "600")) // 600)
#: Most the decoder may allocate (at its peak) for one message, whatever it holds.
DECODE_BUDGET = 16 << 20


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


@_settings(40)
@given(frames=bomb_messages())
def test_a_msgpack_bomb_decodes_within_the_budget_or_is_refused(frames: list[bytes]) -> None:
    tracemalloc.start()
    try:
        try:
            wire.decode_request(frames)
        except wire.ProtocolError as exc:
            assert exc.code in (wire.Code.INVALID, wire.Code.TOO_LARGE, wire.Code.UNKNOWN_KIND)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    body = len(frames[1])
    assert peak <= DECODE_BUDGET, f"a {body} B body peaked at {peak >> 20} MiB while decoding"


@_settings(60)
@given(batch=st.lists(st.one_of(multi_frame(), bomb_messages(max_bytes=64 << 10)), max_size=4))
def test_multi_frame_messages_and_bombs_are_answered_and_change_nothing(
    batch: list[list[bytes]],
) -> None:
    target = Target()
    try:
        for frames in batch:
            target.send(frames, ATTACKER)  # FuzzFailure on any broken rule
    finally:
        target.close()


#: Sessions the flood's descriptor budget has room for (``max_sessions`` is 8).
FD_ROOM = 5


@_settings(15)
@given(ops=session_flood(identities=24))
def test_a_session_flood_is_refused_with_busy_within_the_descriptor_budget(
    ops: list[tuple[str, bytes]],
) -> None:
    target = Target()  # the victim and the attacker hold two sessions
    fds = [0]
    per = 2
    # Every session holds `per` descriptors; the budget has room for FD_ROOM of them.
    target.sessions.descriptors = DescriptorBudget(
        limit=FD_ROOM * per, reserve=0, per_session=per, count=lambda: fds[0]
    )
    try:
        for action, identity in ops:
            fds[0] = per * len(target.sessions)
            reply = target.send(flood_frames(action, identity), identity)
            assert len(target.sessions) <= FD_ROOM, f"{len(target.sessions)} sessions"
            if action == "hello" and isinstance(reply, wire.ErrorReply):
                assert reply.code == wire.Code.BUSY, reply
        assert {VICTIM, ATTACKER} <= {s.identity for s in target.sessions}
        target.engine.check_invariants()
    finally:
        target.close()


def test_bomb_strategy_builds_bodies_of_the_sizes_asked() -> None:
    sizes: list[int] = []

    @settings(max_examples=30, derandomize=True, database=None, deadline=None)
    @given(body=msgpack_bomb(max_bytes=1 << 16))
    def collect(body: bytes) -> None:
        sizes.append(len(body))

    collect()
    assert max(sizes) <= (1 << 16) + 16
    assert max(sizes) > 1 << 12
