"""A long batch run a slice at a time (`Dispatcher.handle_sliced`, `BatchRun`):
the same results as at once, other sessions served between slices, a session
closed meanwhile fails the rest with SESSION_LOST."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvd_client import wire

from kvd.server import dispatch
from kvd.server.dispatch import BatchRun
from tests.server.test_dispatch import Harness, _config


@pytest.fixture
def pair() -> Iterator[tuple[Harness, Harness]]:
    a, b = (
        Harness(_config(**{"pools.0.num_blocks": "4096"})),
        Harness(_config(**{"pools.0.num_blocks": "4096"})),
    )
    yield a, b
    a.close()
    b.close()


def _batch(n: int) -> list[bytes]:
    ops: list[wire.Request] = []
    for j in range(n):
        tokens = np.arange(j, j + 17, dtype=np.int32)
        ops.append(wire.AllocateRequest(id=0, seq=f"s{j}", tokens=tokens))
        ops.append(wire.CommitRequest(id=0, seq=f"s{j}", n=None))
        if j % 3 == 0:
            ops.append(wire.FreeRequest(id=0, seq=f"s{j}"))
    ops.append(wire.FreeRequest(id=0, seq="missing"))  # fails alone, NOT_FOUND
    return wire.encode_batch(99, ops)


def _run_out(h: Harness, run: BatchRun | list[bytes], between: Any = None) -> Any:
    steps = 0
    while isinstance(run, BatchRun):
        if between is not None:
            between()
        with_reply = run.step()
        steps += 1
        if with_reply is not None:
            run = with_reply
    return wire.decode_reply(run), steps


def test_a_sliced_batch_answers_as_one_run(
    pair: tuple[Harness, Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, sliced = pair
    whole.hello()
    sliced.hello()
    frames = _batch(300)
    expect = whole.send(frames)
    monkeypatch.setattr(dispatch, "BATCH_SLICE_NS", 0)  # one operation per slice
    run = sliced.d.handle_sliced(b"A", frames)
    assert isinstance(run, BatchRun)
    got, steps = _run_out(sliced, run)
    assert steps > 100
    assert got == expect
    assert sliced.state() == whole.state()
    sliced.pools["default"].engine.check_invariants()


def test_other_sessions_run_between_slices(
    pair: tuple[Harness, Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, _ = pair
    h.hello()
    h.hello(who=b"B")
    monkeypatch.setattr(dispatch, "BATCH_SLICE_NS", 0)
    run = h.d.handle_sliced(b"A", _batch(50))
    pings = []

    def ping() -> None:
        pings.append(h.ok(wire.PingRequest(id=h.nid()), who=b"B"))

    reply, steps = _run_out(h, run, ping)
    assert len(pings) == steps and isinstance(reply, wire.OkReply)
    assert all(r["ok"] for r in reply.result["results"][:-1])


def test_a_session_closed_between_slices_fails_the_rest(
    pair: tuple[Harness, Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, _ = pair
    h.hello()
    monkeypatch.setattr(dispatch, "BATCH_SLICE_NS", 0)
    run = h.d.handle_sliced(b"A", _batch(40))
    assert isinstance(run, BatchRun)
    run.step()
    h.ok(wire.GoodbyeRequest(id=h.nid()))
    reply, _ = _run_out(h, run)
    results = reply.result["results"]
    assert results[0]["ok"] and results[1]["ok"]
    assert {r["code"] for r in results[2:]} == {"SESSION_LOST"}
    assert h.state()["sessions"] == 0


def test_short_batches_are_answered_at_once(pair: tuple[Harness, Harness]) -> None:
    h, _ = pair
    h.hello()
    frames = wire.encode_batch(5, [wire.FreeRequest(id=0, seq="x")])
    reply = h.d.handle_sliced(b"A", frames)
    assert isinstance(reply, list)
    assert wire.decode_reply(reply).result["results"][0]["code"] == "NOT_FOUND"
