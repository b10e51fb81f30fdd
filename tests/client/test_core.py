"""kvd_client.core: the operations, driven by hand with real request/reply frames."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvd_client import wire
from kvd_client.core import Admission, ClientSession, Deferred, Identity, SeqState
from kvd_client.errors import (
    AlreadyExists,
    InternalError,
    InvalidRequest,
    NotFound,
    OutOfBlocks,
    SessionLost,
    TooLarge,
)
from kvd_client.wire import PoolLayout

from .support import LAYOUT, Wire, blocks, hello_result, shm_handle

PoolFile = Callable[[PoolLayout], Path]


def attached(pool_file: PoolFile | None = None, **hello: Any) -> tuple[ClientSession, Wire]:
    """A session after a hello answered with LAYOUT (and a real pool file when given)."""
    session = ClientSession(Identity(pool="default", name="test"))
    peer = Wire(session)
    memory = shm_handle(pool_file(LAYOUT), LAYOUT) if pool_file else {"backend": "none"}
    peer.start(session.hello())
    peer.ok(hello_result(LAYOUT, memory, **hello))
    return session, peer


def allocated(
    session: ClientSession, peer: Wire, tokens: int = 10, table: tuple[int, ...] = (0, 1, 2)
) -> SeqState:
    peer.start(session.allocate("r", np.arange(tokens)))
    state = peer.ok(wire.AllocateResult(table=blocks(*table), cached=4, reserved=0))
    assert isinstance(state, SeqState)
    return state


# -- hello and sessions --------------------------------------------------------


def test_hello_sends_identity_and_stores_the_session() -> None:
    session = ClientSession(
        Identity(pool="p", name="worker", namespace="tenant-a", adapter="lora1")
    )
    peer = Wire(session)
    req = peer.start(session.hello())
    assert isinstance(req, wire.HelloRequest)
    assert (req.version, req.pool, req.name, req.namespace, req.adapter) == (
        wire.PROTOCOL_VERSION,
        "p",
        "worker",
        "tenant-a",
        "lora1",
    )
    assert req.pid > 0
    assert req.layout is None
    peer.ok(hello_result(LAYOUT, {"backend": "none"}, lease_ms=1234))
    assert session.attached
    assert session.layout == LAYOUT
    assert session.info is not None and session.info.lease_ms == 1234


def test_a_required_layout_is_sent_in_the_hello() -> None:
    session = ClientSession(Identity(pool="p", name="w", layout=LAYOUT, hash_seed="seed"))
    req = Wire(session).start(session.hello())
    assert isinstance(req, wire.HelloRequest)
    assert req.layout == LAYOUT.to_dict()
    assert req.hash_seed == "seed"


def test_session_lost_raises_and_kills_older_sequences() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    peer.start(session.heartbeat())
    with pytest.raises(SessionLost):
        peer.error(wire.Code.SESSION_LOST)
    assert not session.attached
    assert not seq.alive
    with pytest.raises(SessionLost, match="'r'"):
        next(seq.commit())


def test_ensure_reattaches_with_the_layout_of_the_first_session() -> None:
    session, peer = attached()
    session.lose()
    req = peer.start(session.ensure())
    assert isinstance(req, wire.HelloRequest)
    assert req.layout == LAYOUT.to_dict()
    assert req.hash_seed == "vllm-none-hash"
    peer.ok(hello_result(LAYOUT, {"backend": "none"}, session=8))
    assert session.info is not None and session.info.session == 8


def test_ensure_does_nothing_while_attached() -> None:
    session, _ = attached()
    with pytest.raises(StopIteration):
        next(session.ensure())


def test_operator_connection_refuses_session_operations() -> None:
    session = ClientSession(Identity(pool=None, name="kvd-ctl"))
    with pytest.raises(InvalidRequest, match="no pool"):
        next(session.allocate("r", [1]))
    req = Wire(session).start(session.stats(["server"]))
    assert isinstance(req, wire.StatsRequest) and req.sections == ["server"]


def test_goodbye_closes_the_session() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    assert isinstance(peer.start(session.goodbye()), wire.GoodbyeRequest)
    peer.ok(wire.Empty())
    assert not session.attached and not seq.alive


# -- replies -------------------------------------------------------------------


def test_stale_replies_are_skipped() -> None:
    session, peer = attached()
    req = peer.start(session.ping())
    assert session.accept(wire.encode_ok(req.id - 1, {"epoch": 1, "version": 1}), req.id) is None
    assert session.accept(wire.encode_error(req.id - 1, wire.Code.BUSY, "old"), req.id) is None


def test_error_without_an_id_answers_the_request_in_flight() -> None:
    session, peer = attached()
    req = peer.start(session.ping())
    with pytest.raises(InvalidRequest, match="garbled"):
        session.accept(wire.encode_error(None, wire.Code.INVALID, "garbled"), req.id)


def test_notices_wait_for_delivery_after_the_call() -> None:
    seen: list[wire.Notice] = []
    session, peer = attached()
    session.on_notice = seen.append
    req = peer.start(session.ping())
    assert session.accept(wire.encode_notice("pressure", {"usage": 0.91}), req.id) is None
    assert seen == []
    session.deliver_notices()
    assert seen == [wire.Notice("pressure", {"usage": 0.91})]


def test_malformed_reply_is_an_internal_error() -> None:
    session, peer = attached()
    req = peer.start(session.ping())
    with pytest.raises(InternalError, match="malformed"):
        session.accept([b"\x80", b"\xc1"], req.id)


def test_result_fields_added_by_newer_daemons_are_ignored() -> None:
    session, peer = attached()
    peer.start(session.ping())
    res = peer.ok({"epoch": 5, "version": 1, "build": "future"})
    assert res == wire.PingResult(epoch=5, version=1)


def test_result_missing_a_field_is_an_internal_error() -> None:
    session, peer = attached()
    peer.start(session.ping())
    with pytest.raises(InternalError, match="PingResult"):
        peer.ok({"epoch": 5})


def test_request_above_the_daemons_limit_is_refused_before_sending() -> None:
    session, _ = attached(max_message_bytes=1000)
    op = session.allocate("r", np.arange(1000))
    with pytest.raises(TooLarge, match="exceeds 1000"):
        session.encode(next(op))


# -- sequence operations ------------------------------------------------------


def test_allocate_sends_int32_tokens_and_builds_the_table() -> None:
    session, peer = attached()
    req = peer.start(session.allocate("req-7", [5, 6, 7, 8, 9], reserve=32))
    assert isinstance(req, wire.AllocateRequest)
    assert req.tokens.dtype == np.int32 and req.tokens.tolist() == [5, 6, 7, 8, 9]
    assert (req.seq, req.reserve) == ("req-7", 32)
    seq = peer.ok(wire.AllocateResult(table=blocks(3, 4), cached=4, reserved=6))
    assert seq.table.tolist() == [3, 4]
    assert (seq.length, seq.cached, seq.committed) == (5, 4, 0)
    assert not seq.table.flags.writeable


@pytest.mark.parametrize(
    ("tokens", "match"),
    [([[1, 2]], "1-D"), ([1.5], "integers"), ([-1], r"\[0, 2\*\*31\)"), ([2**31], "2")],
)
def test_bad_tokens_are_refused_before_anything_is_sent(tokens: Any, match: str) -> None:
    session, peer = attached()
    with pytest.raises(InvalidRequest, match=match):
        peer.start(session.allocate("r", tokens))
    assert len(peer.sent) == 1  # only the hello


def test_bad_names_and_counts_are_refused() -> None:
    session, _ = attached()
    with pytest.raises(InvalidRequest, match="sequence id"):
        next(session.allocate("", [1]))
    with pytest.raises(TooLarge, match="sequence id"):
        next(session.allocate("x" * (wire.MAX_NAME_LEN + 1), [1]))
    with pytest.raises(InvalidRequest, match="reserve"):
        next(session.allocate("r", [1], reserve=-1))
    with pytest.raises(InvalidRequest, match="reserve"):
        next(session.allocate("r", [1], reserve=True))


def test_refused_allocate_raises_out_of_blocks() -> None:
    session, peer = attached()
    peer.start(session.allocate("r", [1, 2]))
    with pytest.raises(OutOfBlocks):
        peer.error(wire.Code.OUT_OF_BLOCKS, "no room")


def test_commit_records_the_committed_count() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    req = peer.start(seq.commit(8))
    assert isinstance(req, wire.CommitRequest) and (req.seq, req.n) == ("r", 8)
    assert peer.ok(wire.CommitResult(committed=8, cached_blocks=2)).cached_blocks == 2
    assert seq.committed == 8


def test_append_replaces_the_table_tail() -> None:
    session, peer = attached()
    seq = allocated(session, peer, tokens=12, table=(0, 1, 2))
    req = peer.start(seq.append([1, 2, 3, 4, 5]))
    assert isinstance(req, wire.AppendRequest) and req.tokens.tolist() == [1, 2, 3, 4, 5]
    peer.ok(wire.AppendResult(start=3, blocks=blocks(6, 7), copies=blocks(), length=17))
    assert seq.table.tolist() == [0, 1, 2, 6, 7]
    assert seq.length == 17


def test_append_copy_on_write_moves_the_last_block_and_copies_it(pool_file: PoolFile) -> None:
    session, peer = attached(pool_file)
    seq = allocated(session, peer, tokens=10, table=(0, 1, 2))
    pool = session.pool()
    for i, layer in enumerate(pool.np_layers()):
        layer[:, 2] = i + 1.0
    peer.start(seq.append([9]))
    peer.ok(wire.AppendResult(start=2, blocks=blocks(5), copies=blocks(2, 5), length=11))
    assert seq.table.tolist() == [0, 1, 5]
    for i, layer in enumerate(pool.np_layers()):
        assert (layer[:, 5] == i + 1.0).all()  # K and V of every layer


def test_inconsistent_append_result_is_an_internal_error() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    peer.start(seq.append([1]))
    with pytest.raises(InternalError, match="inconsistent"):
        peer.ok(wire.AppendResult(start=9, blocks=blocks(), copies=blocks(), length=11))
    assert seq.table.tolist() == [0, 1, 2]


def test_fork_shares_the_parent_state() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    req = peer.start(seq.fork("r.1", reserve=20))
    assert isinstance(req, wire.ForkRequest) and (req.seq, req.child, req.reserve) == (
        "r",
        "r.1",
        20,
    )
    child = peer.ok(wire.ForkResult(table=blocks(0, 1, 2)))
    assert (child.seq_id, child.table.tolist(), child.length) == ("r.1", [0, 1, 2], 10)


def test_truncate_keeps_the_head_of_the_table() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    peer.start(seq.commit())
    peer.ok(wire.CommitResult(committed=10, cached_blocks=2))
    peer.start(seq.truncate(5))
    peer.ok(wire.TruncateResult(length=5, num_blocks=2))
    assert seq.table.tolist() == [0, 1]
    assert (seq.length, seq.committed) == (5, 5)


def test_free_marks_the_sequence_and_later_use_is_not_found_locally() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    assert isinstance(peer.start(seq.free()), wire.FreeRequest)
    peer.ok(wire.Empty())
    sent = len(peer.sent)
    with pytest.raises(NotFound, match="freed"):
        next(seq.append([1]))
    assert len(peer.sent) == sent


def test_failed_free_leaves_the_sequence_alive() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    peer.start(seq.free())
    with pytest.raises(NotFound):
        peer.error(wire.Code.NOT_FOUND)
    assert seq.alive


def test_pin_and_unpin() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    peer.start(seq.pin(8))
    pin = peer.ok(wire.PinResult(pin=3, blocks=2))
    req = peer.start(pin.unpin())
    assert isinstance(req, wire.UnpinRequest) and req.pin == 3
    peer.ok(wire.Empty())
    with pytest.raises(NotFound, match="released"):
        next(pin.unpin())


def test_can_allocate_is_a_truthy_value() -> None:
    session, peer = attached()
    peer.start(session.can_allocate(100, reserve=200))
    no = peer.ok(wire.CanAllocateResult(ok=False, available=3))
    assert no == Admission(False, 3) and not no
    assert Admission(True, 9)


def test_admin_results() -> None:
    session, peer = attached()
    peer.start(session.flush("tenant-a"))
    assert peer.ok(wire.FlushResult(dropped=12)) == 12
    peer.start(session.check())
    assert peer.ok(wire.CheckResult(ok=False, problems=["x"])).problems == ["x"]
    peer.start(session.clients())
    assert peer.ok(wire.InfoResult(info={"sessions": []})) == {"sessions": []}


# -- batches --------------------------------------------------------------------


def test_batch_settles_each_operation_on_its_own() -> None:
    session, peer = attached()
    seq = allocated(session, peer)
    items = [
        Deferred(session.allocate("a", [1, 2])),
        Deferred(seq.commit(4)),
        Deferred(session.allocate("r", [1])),
    ]
    req = peer.start(session.run_batch(items, session.generation))
    assert isinstance(req, wire.BatchRequest)
    assert [op[0] for op in req.ops] == [wire.Kind.ALLOCATE, wire.Kind.COMMIT, wire.Kind.ALLOCATE]
    results = [
        wire.OpResult(
            ok=True, r=wire.AllocateResult(table=blocks(5), cached=0, reserved=0).to_map([])
        ),
        wire.OpResult(ok=True, r={"committed": 4, "cached_blocks": 1}),
        wire.OpResult(ok=False, code="EXISTS", msg="sequence 'r' exists"),
    ]
    peer.ok(wire.BatchResult(results=[r.to_map([]) for r in results]))
    assert items[0].result().table.tolist() == [5]
    assert items[1].result() == wire.CommitResult(committed=4, cached_blocks=1)
    assert seq.committed == 4
    assert isinstance(items[2].exception(), AlreadyExists)
    with pytest.raises(AlreadyExists):
        items[2].result()


def test_batch_refused_as_a_whole_fails_every_item() -> None:
    session, peer = attached()
    items = [Deferred(session.allocate("a", [1])), Deferred(session.can_allocate(4))]
    peer.start(session.run_batch(items, session.generation))
    with pytest.raises(OutOfBlocks):
        peer.error(wire.Code.OUT_OF_BLOCKS)
    assert all(isinstance(item.exception(), OutOfBlocks) for item in items)


def test_batch_built_before_a_session_loss_is_not_sent() -> None:
    session, peer = attached()
    generation = session.generation
    items = [Deferred(session.allocate("a", [1]))]
    session.lose()
    with pytest.raises(SessionLost, match="batch"):
        peer.start(session.run_batch(items, generation))
    assert isinstance(items[0].exception(), SessionLost)


def test_batch_result_count_mismatch_is_an_internal_error() -> None:
    session, peer = attached()
    items = [Deferred(session.can_allocate(1)), Deferred(session.can_allocate(2))]
    peer.start(session.run_batch(items, session.generation))
    with pytest.raises(InternalError, match="1 batch results for 2"):
        peer.ok(wire.BatchResult(results=[{"ok": True, "r": {"ok": True, "available": 1}}]))


def test_unbatchable_operation_is_refused() -> None:
    session, _ = attached()
    with pytest.raises(InvalidRequest, match="PingRequest cannot be batched"):
        Deferred(session.ping())


def test_deferred_has_no_result_before_the_send() -> None:
    session, _ = attached()
    item = Deferred(session.can_allocate(1))
    assert not item.done
    with pytest.raises(RuntimeError, match="not been sent"):
        item.result()
