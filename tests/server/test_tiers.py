"""kvd.server.tiers: demotions and promotions over a real pool and tier, driven by `Tiers.serve`."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from kvd_client import wire
from kvd_client.wire.hashing import DEFAULT_HASH_SEED, BlockHasher

from kvd.config import load_config
from kvd.server.dispatch import BatchRun, Dispatcher
from kvd.server.pools import Pools
from kvd.server.sessions import SessionTable

BS = 16
#: How long a background copy may take on a loaded machine (a bound, not a measure).
BOUND_S = 30.0


class TierHarness:
    """A dispatcher over one 8-block pool with a 16-block tier, made by `Pools.create`."""

    def __init__(self) -> None:
        config = load_config(
            env={},
            overrides={
                "pools.0.num_blocks": "8",
                "pools.0.tier_blocks": "16",
                "pools.0.num_layers": "2",
                "pools.0.num_kv_heads": "1",
                "pools.0.head_dim": "16",
                "pools.0.prefault": "false",
            },
        )
        self.pools = Pools(config, instance=f"test{uuid.uuid4().hex[:10]}")
        self.pools.add(self.pools.create(config.pools[0]))
        self.d = Dispatcher(
            config,
            self.pools,
            SessionTable(5.0, watch_pids=False),
            epoch=1,
            addresses=["ipc:///test.sock"],
        )
        self.lock = threading.Lock()
        self.sent: list[tuple[bytes, list[bytes]]] = []
        #: Batch runs handed back by the loop (the daemon's request thread goes on with them).
        self.resumed: list[tuple[bytes, BatchRun]] = []
        self._ids = iter(range(1, 1 << 30))
        self.call(
            wire.HelloRequest(id=0, version=wire.PROTOCOL_VERSION, pool="default", name="t", pid=1)
        )

    @property
    def tier(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.d.info.stats()["tiers"]["default"]
        return stats

    def call(self, req: wire.Request) -> list[bytes]:
        with self.lock:
            return self.d.handle(b"A", req.encode())

    def allocate(self, seq: str, tokens: np.ndarray[Any, Any]) -> list[bytes]:
        return self.call(wire.AllocateRequest(id=next(self._ids), seq=seq, tokens=tokens))

    def serve_until(self, done: Callable[[], bool]) -> None:
        """Run `Tiers.serve` (demotions, promotions) until ``done()``."""

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    self.d.tiers.serve,
                    self.lock,
                    lambda *sent: self.sent.append(sent),
                    lambda *run: self.resumed.append(run),
                )
                with anyio.fail_after(BOUND_S):
                    while not done():
                        await anyio.sleep(0.005)
                tg.cancel_scope.cancel()

        anyio.run(run)

    def in_tier_only(self, tokens: np.ndarray[Any, Any]) -> None:
        """``tokens`` computed, copied to the tier, then pushed out of the pool."""
        self.allocate("a", tokens)
        self.call(wire.CommitRequest(id=next(self._ids), seq="a"))
        self.call(wire.FreeRequest(id=next(self._ids), seq="a"))
        blocks = len(tokens) // BS
        self.serve_until(lambda: self.tier["demotions"] >= blocks)
        self.allocate("other", np.arange(5000, 5000 + 8 * BS, dtype=np.int32))
        self.call(wire.FreeRequest(id=next(self._ids), seq="other"))


@pytest.fixture
def th() -> Iterator[TierHarness]:
    harness = TierHarness()
    yield harness
    harness.pools.close()


PROMPT = np.arange(3 * BS + 1, dtype=np.int32)


def test_a_prefix_in_the_tier_is_answered_after_its_promotion(th: TierHarness) -> None:
    th.in_tier_only(PROMPT)
    assert th.allocate("b", PROMPT) == []  # deferred: nothing is sent yet
    th.serve_until(lambda: bool(th.sent))
    ((who, frames),) = th.sent
    reply = wire.decode_reply(frames)
    assert who == b"A" and isinstance(reply, wire.OkReply)
    assert reply.result["cached"] == 3 * BS
    assert th.tier["promotions"] == 3


def test_an_allocate_in_a_batch_answered_in_one_go_matches_the_pool_only(
    th: TierHarness,
) -> None:
    th.in_tier_only(PROMPT)
    frames = wire.encode_batch(9, [wire.AllocateRequest(id=0, seq="b", tokens=PROMPT)])
    with th.lock:
        reply = wire.decode_reply(th.d.handle(b"A", frames))
    assert isinstance(reply, wire.OkReply)
    assert reply.result["results"][0]["r"]["cached"] == 0
    assert not th.d.tiers.jobs


def _paused_batch(th: TierHarness) -> list[bytes] | BatchRun:
    """A batch of three, its second op an allocate of a prefix in the tier only:
    what `handle_sliced` answers once the run paused there (``[]``)."""
    th.in_tier_only(PROMPT)
    ops: list[wire.Request] = [
        wire.AllocateRequest(id=0, seq="x", tokens=np.arange(9000, 9000 + BS, dtype=np.int32)),
        wire.AllocateRequest(id=0, seq="b", tokens=PROMPT),
        wire.CommitRequest(id=0, seq="x"),
    ]
    with th.lock:
        reply = th.d.handle_sliced(b"A", wire.encode_batch(9, ops))
        # On a loaded machine the first op may outlast a slice (BATCH_SLICE_NS):
        # the run then comes back unpaused, and its next slice reaches the pause.
        if isinstance(reply, BatchRun) and not reply.paused:
            assert reply.step() is None
            return [] if reply.paused else reply
        return reply


def _finish(th: TierHarness) -> list[dict[str, Any]]:
    """Serve until the loop hands the run back, then run the rest; its results."""
    th.serve_until(lambda: bool(th.resumed))
    ((who, run),) = th.resumed
    assert who == b"A" and not run.paused
    with th.lock:
        frames = run.step()
        while frames is None:
            frames = run.step()
    reply = wire.decode_reply(frames)
    assert isinstance(reply, wire.OkReply) and reply.id == 9
    results: list[dict[str, Any]] = reply.result["results"]
    return results


def test_a_batch_run_in_slices_waits_for_its_allocates_promotion(th: TierHarness) -> None:
    assert _paused_batch(th) == []  # paused at its second op: nothing is sent yet
    assert th.d.tiers.jobs
    first, promoted, third = _finish(th)
    assert first["ok"] and first["r"]["cached"] == 0
    assert promoted["ok"] and promoted["r"]["cached"] == 3 * BS
    assert third["ok"] and third["r"]["committed"] == BS  # ran after the promotion
    assert th.tier["promotions"] == 3 and not th.sent
    th.pools["default"].engine.check_invariants()


def test_a_batch_whose_session_closed_while_it_waited_gets_session_lost(
    th: TierHarness,
) -> None:
    assert _paused_batch(th) == []
    with th.lock:
        session = th.d.state.sessions.peek(b"A")
        assert session is not None
        th.d.handshake.close(session, "goodbye")
    first, promoted, third = _finish(th)
    assert first["ok"]
    assert (promoted["code"], third["code"]) == ("SESSION_LOST", "SESSION_LOST")
    th.pools["default"].engine.check_invariants()
    assert th.pools["default"].engine.stats().sessions == 0


def test_a_session_closed_during_its_promotion_gets_session_lost(th: TierHarness) -> None:
    th.in_tier_only(PROMPT)
    th.allocate("b", PROMPT)
    with th.lock:
        session = th.d.state.sessions.peek(b"A")
        assert session is not None
        th.d.handshake.close(session, "goodbye")
    th.serve_until(lambda: bool(th.sent))
    reply = wire.decode_reply(th.sent[0][1])
    assert isinstance(reply, wire.ErrorReply) and reply.code == wire.Code.SESSION_LOST
    th.pools["default"].engine.check_invariants()
    assert th.pools["default"].engine.stats().sessions == 0


def test_a_held_lookup_continuing_into_the_tier_is_answered_after_its_promotion(
    th: TierHarness,
) -> None:
    th.in_tier_only(PROMPT)
    keys = BlockHasher(BS, DEFAULT_HASH_SEED).keys(PROMPT[: 3 * BS], None)
    assert th.call(wire.LookupRequest(id=5, keys=keys, hold=True)) == []
    th.serve_until(lambda: bool(th.sent))
    reply = wire.decode_reply(th.sent[0][1])
    assert isinstance(reply, wire.OkReply)
    assert reply.result["cached"] == 3 and reply.result["hold"]
    assert th.tier["promotions"] == 3
