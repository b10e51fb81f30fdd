"""kvd_client.client: both drivers against a real ROUTER socket answering real frames."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from kvd_client import AsyncClient, Client, Sequence, wire
from kvd_client.client import ClientBase
from kvd_client.errors import DaemonUnavailable, InvalidRequest, OutOfBlocks, SessionLost

from .support import LAYOUT, Router, blocks, hello_result, shm_handle

StartRouter = Callable[..., Router]


def daemon_like(
    memory: dict[str, Any] | None = None,
) -> Callable[[wire.Request], list[list[bytes]]]:
    """Scripted replies built with the real encoders; each hello opens a new session id."""
    ids = iter(range(1, 100))
    memory = memory or {"backend": "none"}

    def handle(req: wire.Request) -> list[list[bytes]]:
        rid = req.id  # type: ignore[attr-defined]
        match req:
            case wire.HelloRequest():
                return [wire.encode_ok(rid, hello_result(LAYOUT, memory, session=next(ids)))]
            case wire.AllocateRequest():
                n = (len(req.tokens) + 3) // 4
                return [
                    wire.encode_ok(
                        rid, wire.AllocateResult(table=blocks(*range(n)), cached=0, reserved=0)
                    )
                ]
            case wire.CommitRequest():
                return [
                    wire.encode_ok(rid, wire.CommitResult(committed=req.n or 0, cached_blocks=0))
                ]
            case wire.BatchRequest():
                ok = {"ok": True, "r": {"committed": 1, "cached_blocks": 0}}
                return [wire.encode_ok(rid, wire.BatchResult(results=[ok] * len(req.ops)))]
            case wire.PingRequest():
                return [wire.encode_ok(rid, wire.PingResult(epoch=99, version=1))]
            case wire.ForkRequest():
                return [wire.encode_ok(rid, wire.ForkResult(table=blocks(0, 1, 2)))]
            case wire.AppendRequest():
                # The last block (2) is shared: move to a private copy (5).
                result = wire.AppendResult(
                    start=2, blocks=blocks(5), copies=blocks(2, 5), length=11
                )
                return [wire.encode_ok(rid, result)]
            case wire.TruncateRequest():
                return [
                    wire.encode_ok(
                        rid, wire.TruncateResult(length=req.n, num_blocks=(req.n + 3) // 4)
                    )
                ]
            case wire.PinRequest():
                return [wire.encode_ok(rid, wire.PinResult(pin=4, blocks=2))]
            case wire.CanAllocateRequest():
                return [
                    wire.encode_ok(rid, wire.CanAllocateResult(ok=req.tokens <= 32, available=8))
                ]
            case _:
                return [wire.encode_ok(rid, wire.Empty())]

    return handle


def test_blocking_client_runs_a_request_lifecycle(router: StartRouter) -> None:
    r = router(daemon_like())
    with Client.connect(r.address, pool="default", name="unit") as kv:
        assert (kv.session_id, kv.epoch, kv.layout) == (1, 99, LAYOUT)
        seq = kv.allocate("req-1", np.arange(10), reserve=20)
        assert seq.block_table.tolist() == [0, 1, 2]
        assert seq.commit(8).committed == 8
        seq.free()
        assert not seq.alive
    kinds = [type(q).__name__ for q in r.requests]
    assert kinds == [
        "HelloRequest",
        "AllocateRequest",
        "CommitRequest",
        "FreeRequest",
        "GoodbyeRequest",
    ]
    assert r.requests[0].name == "unit"  # type: ignore[attr-defined]


def test_async_client_runs_the_same_lifecycle(router: StartRouter) -> None:
    r = router(daemon_like())

    async def main() -> None:
        async with AsyncClient.connect(r.address, pool="default") as kv:
            seq = await kv.allocate("req-1", np.arange(10))
            assert (await seq.commit(8)).committed == 8
            await seq.free()
            assert (await kv.ping()).epoch == 99

    anyio.run(main)
    kinds = [type(q).__name__ for q in r.requests]
    assert kinds == [
        "HelloRequest",
        "AllocateRequest",
        "CommitRequest",
        "FreeRequest",
        "PingRequest",
        "GoodbyeRequest",
    ]


def test_both_clients_share_one_definition_of_each_operation() -> None:
    for name in ("allocate", "can_allocate", "stats", "flush", "check", "ping", "heartbeat"):
        assert getattr(Client, name) is getattr(AsyncClient, name) is ClientBase.__dict__[name]
    assert Sequence.__dict__["commit"] is Sequence.commit


def test_session_lost_raises_once_then_reattaches(router: StartRouter) -> None:
    lost = iter([True])

    base = daemon_like()

    def handle(req: wire.Request) -> list[list[bytes]]:
        if isinstance(req, wire.AllocateRequest) and next(lost, False):
            return [wire.encode_error(req.id, wire.Code.SESSION_LOST, "daemon restarted")]
        return base(req)

    r = router(handle)
    with Client.connect(r.address, pool="default") as kv:
        with pytest.raises(SessionLost):
            kv.allocate("a", [1, 2])
        assert not kv.attached
        seq = kv.allocate("a", [1, 2])
        assert kv.session_id == 2 and seq.alive
    kinds = [type(q).__name__ for q in r.requests]
    assert kinds == [
        "HelloRequest",
        "AllocateRequest",
        "HelloRequest",
        "AllocateRequest",
        "GoodbyeRequest",
    ]
    assert r.requests[2].layout == LAYOUT.to_dict()  # type: ignore[attr-defined]


def test_batch_is_one_round_trip(router: StartRouter) -> None:
    r = router(daemon_like())
    with Client.connect(r.address) as kv:
        seqs = [kv.allocate(f"s{i}", [1, 2, 3]) for i in range(3)]
        with kv.batch() as b:
            items = [b.commit(s, 1) for s in seqs]
        assert [item.result().committed for item in items] == [1, 1, 1]
    batch = r.requests[-2]
    assert isinstance(batch, wire.BatchRequest) and len(batch.ops) == 3


def test_async_batch(router: StartRouter) -> None:
    r = router(daemon_like())

    async def main() -> None:
        async with AsyncClient.connect(r.address) as kv:
            seq = await kv.allocate("s", [1, 2, 3])
            async with kv.batch() as b:
                item = b.commit(seq, 1)
            assert item.result().committed == 1

    anyio.run(main)
    assert isinstance(r.requests[-2], wire.BatchRequest)


def test_batch_context_must_match_the_client_kind(router: StartRouter) -> None:
    r = router(daemon_like())
    with Client.connect(r.address) as kv:
        b = kv.batch()

        async def enter() -> None:
            async with b:
                pass

        with pytest.raises(TypeError, match="'with'"):
            anyio.run(enter)


def test_batch_refuses_a_sequence_of_another_client(router: StartRouter) -> None:
    r = router(daemon_like())
    with Client.connect(r.address) as one, Client.connect(r.address) as two:
        seq = one.allocate("s", [1])
        with pytest.raises(InvalidRequest, match="another client"):
            two.batch().commit(seq)


def test_refusal_reaches_the_caller_as_its_class(router: StartRouter) -> None:
    def handle(req: wire.Request) -> list[list[bytes]]:
        if isinstance(req, wire.AllocateRequest):
            return [wire.encode_error(req.id, wire.Code.OUT_OF_BLOCKS, "pool full")]
        return daemon_like()(req)

    r = router(handle)
    with Client.connect(r.address) as kv, pytest.raises(OutOfBlocks, match="pool full"):
        kv.allocate("a", [1])


def test_notices_reach_the_callback(router: StartRouter) -> None:
    base = daemon_like()

    def handle(req: wire.Request) -> list[list[bytes]]:
        if isinstance(req, wire.PingRequest):
            return [wire.encode_notice("pressure", {"pool": "default", "usage": 0.9}), *base(req)]
        return base(req)

    r = router(handle)
    seen: list[wire.Notice] = []
    with Client.connect(r.address, on_notice=seen.append) as kv:
        kv.ping()
    assert seen == [wire.Notice("pressure", {"pool": "default", "usage": 0.9})]


def test_connect_with_nothing_listening_names_the_address(ipc_dir: Path) -> None:
    address = f"ipc://{ipc_dir}/nobody.sock"
    with pytest.raises(DaemonUnavailable, match=re.escape(f"at {address} within 0.2 s")) as err:
        Client.connect(address, timeout=0.2)
    assert err.value.address == address


def test_async_connect_with_nothing_listening_names_the_address(ipc_dir: Path) -> None:
    address = f"ipc://{ipc_dir}/nobody.sock"

    async def main() -> None:
        await AsyncClient.connect(address, timeout=0.2)

    with pytest.raises(DaemonUnavailable, match=r"nobody\.sock"):
        anyio.run(main)


def test_close_does_not_fail_when_the_daemon_is_gone(router: StartRouter) -> None:
    r = router(daemon_like())
    kv = Client.connect(r.address, timeout=0.3)
    r.close()
    kv.close()
    with pytest.raises(InvalidRequest, match="closed"):
        kv.ping()


def test_operator_connection_sends_no_hello(router: StartRouter) -> None:
    r = router(daemon_like())
    with Client.connect(r.address, pool=None) as kv:
        assert kv.ping().epoch == 99
        with pytest.raises(InvalidRequest, match="no pool"):
            kv.allocate("a", [1])
    assert [type(q).__name__ for q in r.requests] == ["PingRequest"]


def test_bad_identity_is_refused_before_connecting() -> None:
    with pytest.raises(InvalidRequest, match="pool"):
        Client.connect("ipc:///nonexistent", pool="")


def test_sequence_operations_through_the_blocking_client(
    router: StartRouter, pool_file: Callable[..., Path]
) -> None:
    r = router(daemon_like(shm_handle(pool_file(LAYOUT), LAYOUT)))
    with Client.connect(r.address) as kv:
        assert kv.can_allocate(16) and not kv.can_allocate(64)
        kv.heartbeat()
        seq = kv.allocate("a", np.arange(10))
        kv.pool.layer(1)[:, 2].fill_(6.0)
        child = seq.fork("a.1")
        child.append([1])
        assert child.block_table.tolist() == [0, 1, 5]
        assert (kv.pool.layer(1)[:, 5] == 6.0).all()  # copied before append returned
        child.truncate(6)
        assert (child.num_tokens, child.block_table.tolist()) == (6, [0, 1])
        pin = seq.pin()
        assert (pin.pin_id, pin.num_blocks) == (4, 2)
        pin.unpin()
    kinds = [type(q).__name__ for q in r.requests]
    assert kinds[1:] == [
        "CanAllocateRequest",
        "CanAllocateRequest",
        "HeartbeatRequest",
        "AllocateRequest",
        "ForkRequest",
        "AppendRequest",
        "TruncateRequest",
        "PinRequest",
        "UnpinRequest",
        "GoodbyeRequest",
    ]


def test_slots_map_token_positions_into_blocks(router: StartRouter) -> None:
    r = router(daemon_like())
    with Client.connect(r.address) as kv:
        seq = kv.allocate("a", np.arange(10))  # blocks 0, 1, 2 of 4 tokens
        seq.truncate(9)
        assert seq.slots(2, 6).tolist() == [2, 3, 4, 5]
        assert seq.slots().tolist() == list(range(9))
        with pytest.raises(InvalidRequest, match="outside"):
            seq.slots(5, 10)


def test_a_client_can_be_shared_by_threads(router: StartRouter) -> None:
    r = router(daemon_like())
    errors: list[BaseException] = []
    with Client.connect(r.address) as kv:

        def work() -> None:
            try:
                for _ in range(50):
                    assert kv.ping().epoch == 99
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert sum(isinstance(q, wire.PingRequest) for q in r.requests) == 200


def test_an_async_client_can_be_shared_by_tasks(router: StartRouter) -> None:
    r = router(daemon_like())

    async def main() -> None:
        async with AsyncClient.connect(r.address) as kv:

            async def work() -> None:
                for _ in range(30):
                    assert (await kv.ping()).epoch == 99

            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(work)

    anyio.run(main)
    assert sum(isinstance(q, wire.PingRequest) for q in r.requests) == 120
