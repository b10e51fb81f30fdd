"""kvd.server.dispatch: every request kind against a real engine and a real shm pool."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import structlog.testing
from kvd_client import wire
from kvd_client.wire import hashing

from kvd.config import Config, load_config
from kvd.engine import Engine, EngineConfig
from kvd.memory.shm import ShmSegment
from kvd.server import info
from kvd.server.dispatch import Dispatcher
from kvd.server.pools import PoolRefusal, Pools, ServedPool
from kvd.server.reload import reload_config
from kvd.server.sessions import PeerCred, SessionTable

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _config(**overrides: str) -> Config:
    base = {
        "pools.0.num_blocks": "16",
        "pools.0.num_layers": "2",
        "pools.0.num_kv_heads": "1",
        "pools.0.head_dim": "16",
    }
    return load_config(env={}, overrides=base | overrides)


class Harness:
    """A dispatcher over real pools, with helpers to talk to it like a client."""

    def __init__(self, config: Config, events: list[tuple[str, list[Any]]] | None = None):
        self.instance = f"test{uuid.uuid4().hex[:10]}"
        self.pools = Pools(config, instance=self.instance)
        for pc in config.pools:
            memory = ShmSegment.create(pc.name, pc.layout, instance=self.instance, prefault=False)
            engine = Engine(
                EngineConfig(
                    num_blocks=pc.num_blocks,
                    block_size=pc.block_size,
                    hash_seed=config.cache.hash_seed,
                    watermark_blocks=config.admission.watermark_blocks,
                    events=events is not None,
                )
            )
            self.pools.add(ServedPool(pc, engine, memory))
        self.clock = Clock()
        self.observed: list[tuple[str, float]] = []
        self.d = Dispatcher(
            config,
            self.pools,
            SessionTable(config.server.lease_ms / 1e3, clock=self.clock, watch_pids=False),
            epoch=12345,
            addresses=["ipc:///test.sock"],
            on_events=(lambda pool, evs: events.append((pool, evs)))
            if events is not None
            else None,
            observe=lambda kind, s: self.observed.append((kind, s)),
            clock=self.clock,
        )
        self._ids = iter(range(1, 1 << 30))

    def close(self) -> None:
        self.pools.close()

    def send(self, frames: list[bytes], who: bytes = b"A", peer: PeerCred | None = None) -> Any:
        return wire.decode_reply(self.d.handle(who, frames, peer))

    def call(self, req: wire.Request, who: bytes = b"A") -> Any:
        return self.send(req.encode(), who)

    def nid(self) -> int:
        return next(self._ids)

    def hello(self, who: bytes = b"A", **kw: Any) -> Any:
        fields = {"version": wire.PROTOCOL_VERSION, "pool": "default", "name": "t", "pid": 1} | kw
        return self.call(wire.HelloRequest(id=self.nid(), **fields), who)

    def ok(self, req: wire.Request, who: bytes = b"A") -> dict[str, Any]:
        reply = self.call(req, who)
        assert isinstance(reply, wire.OkReply), reply
        return reply.result

    def err(self, req: wire.Request | list[bytes], who: bytes = b"A") -> wire.ErrorReply:
        reply = self.send(req if isinstance(req, list) else req.encode(), who)
        assert isinstance(reply, wire.ErrorReply), reply
        return reply

    def state(self) -> dict[str, Any]:
        s = self.d.info.stats()
        return {"blocks": s["blocks"], "pools": s["pools"], "sessions": s["clients"]["sessions"]}


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness(_config())
    yield harness
    harness.close()


def toks(n: int, start: int = 0) -> np.ndarray[Any, Any]:
    return np.arange(start, start + n, dtype=np.int32)


def table(result: dict[str, Any], key: str = "table") -> list[int]:
    return list(wire.blocks_from_bytes(result[key]))


# --------------------------------------------------------------------------
# Sessions and handshake


def test_ping_needs_no_session(h: Harness) -> None:
    assert h.ok(wire.PingRequest(id=7)) == {"epoch": 12345, "version": wire.PROTOCOL_VERSION}


def test_request_without_hello_is_session_lost(h: Harness) -> None:
    e = h.err(wire.AllocateRequest(id=5, seq="s", tokens=toks(4)))
    assert (e.id, e.code) == (5, wire.Code.SESSION_LOST)


def test_hello_returns_layout_memory_and_lease(h: Harness) -> None:
    reply = h.hello()
    assert isinstance(reply, wire.OkReply)
    r = wire.HelloResult.from_map(reply.result, [])
    pool = h.pools["default"]
    assert r.epoch == 12345
    assert r.layout == pool.layout.to_dict()
    assert r.memory == pool.memory.handle()
    assert os.path.exists(r.memory["path"])
    assert r.lease_ms == 5000
    assert r.hash_seed == "vllm-none-hash"
    assert r.max_message_bytes == wire.MAX_MESSAGE_BYTES


def test_hello_with_matching_layout_and_seed_is_accepted(h: Harness) -> None:
    layout = h.pools["default"].layout.to_dict()
    assert isinstance(h.hello(layout=layout, hash_seed="vllm-none-hash"), wire.OkReply)


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"version": wire.PROTOCOL_VERSION + 1}, wire.Code.VERSION),
        ({"pool": "absent"}, wire.Code.NOT_FOUND),
        ({"hash_seed": "other"}, wire.Code.MISMATCH),
        ({"layout": {"num_layers": 2}}, wire.Code.INVALID),
    ],
)
def test_bad_hello_is_refused_and_opens_nothing(
    h: Harness, fields: dict[str, Any], code: wire.Code
) -> None:
    reply = h.hello(**fields)
    assert isinstance(reply, wire.ErrorReply)
    assert reply.code == code
    assert len(h.d.state.sessions) == 0


def test_hello_with_other_layout_names_the_difference(h: Harness) -> None:
    layout = h.pools["default"].layout.to_dict() | {"block_size": 32}
    reply = h.hello(layout=layout)
    assert isinstance(reply, wire.ErrorReply)
    assert reply.code == wire.Code.MISMATCH
    assert "block_size" in reply.msg


def test_max_sessions_gives_busy() -> None:
    harness = Harness(_config(**{"server.max_sessions": "1"}))
    try:
        assert isinstance(harness.hello(b"A"), wire.OkReply)
        reply = harness.hello(b"B")
        assert isinstance(reply, wire.ErrorReply)
        assert reply.code == wire.Code.BUSY
        # the existing connection may still say hello again
        assert isinstance(harness.hello(b"A"), wire.OkReply)
    finally:
        harness.close()


def test_a_hello_while_the_connections_pool_is_being_created_gets_busy(h: Harness) -> None:
    layout = h.pools["default"].layout.to_dict()

    def create(who: bytes) -> list[bytes]:
        fields = {"version": wire.PROTOCOL_VERSION, "pool": "rt", "name": "t", "pid": 1}
        req = wire.HelloRequest(id=h.nid(), create=True, layout=layout, **fields)
        return h.d.handle(who, req.encode())

    assert create(b"A") == []  # waits for the pool
    again = wire.decode_reply(create(b"A"))
    assert isinstance(again, wire.ErrorReply) and again.code == wire.Code.BUSY
    assert "previous hello is still being answered" in again.msg
    assert create(b"B") == []  # another connection may wait too
    first, _ = h.d.take_pending()
    refused = PoolRefusal(wire.Code.QUOTA_EXCEEDED, "no room")
    assert wire.decode_reply(h.d.finish_hello(first, refused)).code == wire.Code.QUOTA_EXCEEDED
    assert create(b"A") == []  # answered: its next hello is taken again
    assert h.d.state.rpc.errors[wire.Code.BUSY] == 1


def test_second_hello_replaces_the_session_and_frees_its_sequences(h: Harness) -> None:
    h.hello()
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(40)))
    h.hello()
    assert h.state()["blocks"]["default"]["in_use"] == 0
    assert len(h.d.state.sessions) == 1
    assert h.err(wire.FreeRequest(id=2, seq="s")).code == wire.Code.NOT_FOUND


def test_goodbye_closes_the_session(h: Harness) -> None:
    h.hello()
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(40)))
    assert h.ok(wire.GoodbyeRequest(id=2)) == {}
    assert h.state()["blocks"]["default"]["in_use"] == 0
    assert h.err(wire.HeartbeatRequest(id=3)).code == wire.Code.SESSION_LOST


def test_heartbeat_renews_the_lease(h: Harness) -> None:
    h.hello()
    h.clock.now += 4.0
    h.ok(wire.HeartbeatRequest(id=1))
    h.clock.now += 4.0
    assert h.d.state.sessions.expired() == []


def test_close_session_frees_sequences_and_keeps_committed_blocks_cached(h: Harness) -> None:
    h.hello(b"A")
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(40)), b"A")
    h.ok(wire.CommitRequest(id=2, seq="s"), b"A")
    session = h.d.state.sessions.peek(b"A")
    assert session is not None
    h.d.handshake.close(session, "test")
    blocks = h.state()["blocks"]["default"]
    assert (blocks["in_use"], blocks["evictable"]) == (0, 2)
    assert h.d.info.stats()["clients"]["closed"] == {"test": 1}


def test_hello_records_peer_credentials(h: Harness) -> None:
    peer = PeerCred(0, 0, os.getpid())
    reply = h.send(
        wire.HelloRequest(
            id=1, version=wire.PROTOCOL_VERSION, pool="default", name="t", pid=99
        ).encode(),
        b"A",
        peer,
    )
    assert isinstance(reply, wire.OkReply)
    session = h.d.state.sessions.peek(b"A")
    assert session is not None
    assert (session.pid, session.watched_pid) == (99, os.getpid())


# --------------------------------------------------------------------------
# Sequences


def test_prefix_is_shared_between_sessions(h: Harness) -> None:
    h.hello(b"A")
    h.hello(b"B")
    a = h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(40)), b"A")
    assert (a["cached"], len(table(a))) == (0, 3)
    assert h.ok(wire.CommitRequest(id=2, seq="s"), b"A") == {"committed": 40, "cached_blocks": 2}
    b = h.ok(wire.AllocateRequest(id=3, seq="s", tokens=toks(50)), b"B")
    assert b["cached"] == 32
    assert table(b)[:2] == table(a)[:2]


def test_hit_is_capped_below_the_last_token(h: Harness) -> None:
    h.hello(b"A")
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(32)))
    h.ok(wire.CommitRequest(id=2, seq="s"))
    b = h.ok(wire.AllocateRequest(id=3, seq="t", tokens=toks(32)))
    assert b["cached"] == 16


def test_append_fork_truncate_pin_unpin_free(h: Harness) -> None:
    h.hello()
    a = h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(20), reserve=64))
    assert a["reserved"] > 0
    ap = h.ok(wire.AppendRequest(id=2, seq="s", tokens=toks(20, 20)))
    assert (ap["start"], ap["length"]) == (2, 40)
    assert len(table(ap, "blocks")) == 1
    f = h.ok(wire.ForkRequest(id=3, seq="s", child="c"))
    assert len(table(f)) == 3
    # the child's last block is shared: appending copies it first
    cow = h.ok(wire.AppendRequest(id=4, seq="c", tokens=toks(1, 40)))
    copies = table(cow, "copies")
    assert len(copies) == 2
    assert copies[0] == table(f)[2]
    assert h.ok(wire.TruncateRequest(id=5, seq="s", n=17)) == {"length": 17, "num_blocks": 2}
    h.ok(wire.CommitRequest(id=6, seq="s"))
    pin = h.ok(wire.PinRequest(id=7, seq="s"))
    assert pin["blocks"] == 1
    assert h.state()["blocks"]["default"]["pinned"] == 1
    assert h.ok(wire.UnpinRequest(id=8, pin=pin["pin"])) == {}
    assert h.ok(wire.FreeRequest(id=9, seq="s")) == {}
    assert h.ok(wire.FreeRequest(id=10, seq="c")) == {}
    assert h.state()["blocks"]["default"]["in_use"] == 0


def test_can_allocate(h: Harness) -> None:
    h.hello()
    assert h.ok(wire.CanAllocateRequest(id=1, tokens=16 * BS)) == {"ok": True, "available": 16}
    assert h.ok(wire.CanAllocateRequest(id=2, tokens=17 * BS))["ok"] is False


def test_out_of_blocks_changes_nothing(h: Harness) -> None:
    h.hello()
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(10 * BS)))
    before = h.state()
    e = h.err(wire.AllocateRequest(id=2, seq="t", tokens=toks(7 * BS)))
    assert (e.id, e.code) == (2, wire.Code.OUT_OF_BLOCKS)
    assert h.state() == before
    assert h.d.info.stats()["admission"]["refusals"]["OUT_OF_BLOCKS"] == 1


def test_quota_exceeded_per_session() -> None:
    harness = Harness(_config(**{"admission.session_quota_blocks": "2"}))
    try:
        harness.hello()
        e = harness.err(wire.AllocateRequest(id=1, seq="s", tokens=toks(3 * BS)))
        assert e.code == wire.Code.QUOTA_EXCEEDED
    finally:
        harness.close()


@pytest.mark.parametrize(
    ("req", "code"),
    [
        (wire.FreeRequest(id=1, seq="nope"), wire.Code.NOT_FOUND),
        (wire.CommitRequest(id=1, seq="nope"), wire.Code.NOT_FOUND),
        (wire.UnpinRequest(id=1, pin=999), wire.Code.NOT_FOUND),
        (wire.TruncateRequest(id=1, seq="s", n=-1), wire.Code.INVALID),
        (wire.AllocateRequest(id=1, seq="s", tokens=toks(4)), wire.Code.EXISTS),
        (wire.AllocateRequest(id=1, seq="t", tokens=toks(4), reserve=-1), wire.Code.INVALID),
    ],
)
def test_engine_errors_carry_their_code_and_change_nothing(
    h: Harness, req: wire.Request, code: wire.Code
) -> None:
    h.hello()
    h.ok(wire.AllocateRequest(id=0, seq="s", tokens=toks(20)))
    before = h.state()
    e = h.err(req)
    assert (e.id, e.code) == (1, code)
    assert h.state() == before
    assert h.d.info.stats()["rpc"]["errors"] == {str(code): 1}


def test_another_sessions_sequence_is_not_found(h: Harness) -> None:
    h.hello(b"A")
    h.hello(b"B")
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(20)), b"A")
    assert h.err(wire.FreeRequest(id=2, seq="s"), b"B").code == wire.Code.NOT_FOUND
    assert h.err(wire.ForkRequest(id=3, seq="s", child="c"), b"B").code == wire.Code.NOT_FOUND
    assert h.ok(wire.FreeRequest(id=4, seq="s"), b"A") == {}


def test_unexpected_exception_is_internal_and_logged(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h.hello()
    before = h.state()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    # Fault injection: the engine has no bug to trigger on purpose.
    monkeypatch.setattr(h.pools["default"].engine, "allocate", broken)
    with structlog.testing.capture_logs() as logs:
        e = h.err(wire.AllocateRequest(id=3, seq="s", tokens=toks(4)))
    assert (e.id, e.code) == (3, wire.Code.INTERNAL)
    assert [entry["event"] for entry in logs] == ["internal_error"]
    assert logs[0]["exc_info"] is True
    assert h.state() == before
    assert h.ok(wire.PingRequest(id=4))["epoch"] == 12345


# --------------------------------------------------------------------------
# Batch


def test_batch_runs_in_order_with_one_result_each(h: Harness) -> None:
    h.hello()
    frames = wire.encode_batch(
        9,
        [
            wire.AllocateRequest(id=0, seq="s", tokens=toks(20)),
            wire.FreeRequest(id=0, seq="nope"),
            wire.AppendRequest(id=0, seq="s", tokens=toks(4, 20)),
            wire.AllocateRequest(id=0, seq="big", tokens=toks(100 * BS)),
            wire.CommitRequest(id=0, seq="s"),
        ],
    )
    reply = h.send(frames)
    assert isinstance(reply, wire.OkReply)
    assert reply.id == 9
    results = reply.result["results"]
    assert [r["ok"] for r in results] == [True, False, True, False, True]
    assert results[1]["code"] == wire.Code.NOT_FOUND
    assert results[2]["r"]["length"] == 24
    assert results[3]["code"] == wire.Code.OUT_OF_BLOCKS
    assert results[4]["r"] == {"committed": 24, "cached_blocks": 1}
    rpc = h.d.info.stats()["rpc"]
    assert rpc["errors"] == {"NOT_FOUND": 1, "OUT_OF_BLOCKS": 1}
    assert rpc["ops"] >= 5


def test_batch_refuses_non_batchable_and_unknown_ops(h: Harness) -> None:
    h.hello()
    body = msgpack.packb(
        {"id": 4, "ops": [[int(wire.Kind.HELLO), {}], [0x7E, {}], "junk", [int(wire.Kind.FREE), 5]]}
    )
    reply = h.send([bytes((wire.Kind.BATCH,)), body])
    assert isinstance(reply, wire.OkReply)
    codes = [r["code"] for r in reply.result["results"]]
    assert codes == [
        wire.Code.INVALID,
        wire.Code.UNKNOWN_KIND,
        wire.Code.INVALID,
        wire.Code.INVALID,
    ]


def test_batch_needs_a_session(h: Harness) -> None:
    e = h.err(wire.encode_batch(3, [wire.FreeRequest(id=0, seq="s")]))
    assert (e.id, e.code) == (3, wire.Code.SESSION_LOST)


# --------------------------------------------------------------------------
# Malformed input


@pytest.mark.parametrize(
    ("frames", "code", "req_id"),
    [
        ([b"\x25"], wire.Code.INVALID, None),
        ([b"\x25\x25", b"\x80"], wire.Code.INVALID, None),
        ([b"\x7e", msgpack.packb({"id": 4})], wire.Code.UNKNOWN_KIND, 4),
        ([b"\x10", b"\xc1"], wire.Code.INVALID, None),
        ([b"\x10", msgpack.packb([1, 2])], wire.Code.INVALID, None),
        (
            [b"\x10", msgpack.packb({"id": 6, "seq": 5, "tokens": 0}), b"\0" * 4],
            wire.Code.INVALID,
            6,
        ),
        ([b"\x10", msgpack.packb({"id": 6, "seq": "s", "tokens": 3})], wire.Code.INVALID, 6),
        (
            [b"\x10", msgpack.packb({"id": 6, "seq": "s", "tokens": 0}), b"\0" * 5],
            wire.Code.INVALID,
            6,
        ),
        (
            [b"\x10", msgpack.packb({"id": 6, "seq": "x" * 300, "tokens": 0}), b""],
            wire.Code.TOO_LARGE,
            6,
        ),
        ([b"\x25", msgpack.packb({"id": 2, "extra": 1})], wire.Code.INVALID, 2),
        ([b"\x25", b"\x80"] * 3000, wire.Code.TOO_LARGE, None),
    ],
)
def test_malformed_frames_get_an_error_with_a_code(
    h: Harness, frames: list[bytes], code: wire.Code, req_id: int | None
) -> None:
    before = h.state()
    e = h.err(frames)
    assert (e.code, e.id) == (code, req_id)
    assert h.state() == before


def test_message_above_the_limit_is_too_large(h: Harness) -> None:
    big = b"\0" * (wire.MAX_MESSAGE_BYTES // 2 + 8)
    e = h.err([b"\x25", msgpack.packb({"id": 1}), big, big])
    assert e.code == wire.Code.TOO_LARGE


# --------------------------------------------------------------------------
# Draining


def test_draining_refuses_new_work_and_lets_running_sequences_finish(h: Harness) -> None:
    h.hello()
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(20), reserve=40))
    h.d.state.draining = True
    assert (
        h.err(wire.AllocateRequest(id=2, seq="t", tokens=toks(4))).code == wire.Code.SHUTTING_DOWN
    )
    assert h.err(wire.ForkRequest(id=3, seq="s", child="c")).code == wire.Code.SHUTTING_DOWN
    assert h.hello(b"B").code == wire.Code.SHUTTING_DOWN
    assert h.ok(wire.AppendRequest(id=4, seq="s", tokens=toks(4, 20)))["length"] == 24
    assert h.ok(wire.CommitRequest(id=5, seq="s"))["committed"] == 24
    assert h.d.info.in_flight() == 1
    assert h.ok(wire.FreeRequest(id=6, seq="s")) == {}
    assert h.d.info.in_flight() == 0
    assert h.ok(wire.PingRequest(id=7))["epoch"] == 12345


# --------------------------------------------------------------------------
# Admin


def test_check_passes(h: Harness) -> None:
    h.hello()
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(40)))
    assert h.ok(wire.CheckRequest(id=2)) == {"ok": True, "problems": []}


def test_a_check_waits_twenty_times_the_last_ones_run(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = iter([100.0, 100.0, 101.0, 110.0, 121.5, 121.5, 121.6])  # the clock at each read
    monkeypatch.setattr(info.time, "monotonic", lambda: next(now))
    assert h.ok(wire.CheckRequest(id=h.nid()))["ok"] is True  # ran 1 s: none until 121
    early = h.err(wire.CheckRequest(id=h.nid()))
    assert early.code == wire.Code.RATE_LIMITED
    assert (
        early.msg == "the last check held every request for 1000 ms; the next may run in 11000 ms"
    )
    assert h.ok(wire.CheckRequest(id=h.nid()))["ok"] is True


def test_flush_drops_cached_blocks(h: Harness) -> None:
    h.hello()
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(40)))
    h.ok(wire.CommitRequest(id=2, seq="s"))
    h.ok(wire.FreeRequest(id=3, seq="s"))
    assert h.ok(wire.FlushRequest(id=4)) == {"dropped": 2}
    assert h.state()["blocks"]["default"]["evictable"] == 0


def test_stats_sections(h: Harness) -> None:
    h.hello()
    info = h.ok(wire.StatsRequest(id=1))["info"]
    assert set(info) == {"server", "pools", "blocks", "prefix", "clients", "admission", "rpc", "gc"}
    assert info["server"]["epoch"] == 12345
    assert info["server"]["pid"] == os.getpid()
    assert info["blocks"]["default"]["total"] == 16
    assert info["clients"]["sessions"] == 1
    only = h.ok(wire.StatsRequest(id=2, sections=["blocks"]))["info"]
    assert set(only) == {"blocks"}
    assert h.err(wire.StatsRequest(id=3, sections=["nope"])).code == wire.Code.INVALID


def test_stats_say_what_runs_compiled(h: Harness) -> None:
    """The suite runs the compiled build (`make test`): the stats say so."""
    h.hello()
    info = h.ok(wire.StatsRequest(id=1, sections=["server"]))["info"]
    assert info["server"]["compiled"] == {
        "engine": True,
        "block_keys": hashing.IMPLEMENTATION == "c",
    }


def test_clients_and_pools_listings(h: Harness) -> None:
    h.hello(b"A", name="worker-1")
    h.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(40)))
    (client,) = h.ok(wire.ClientsRequest(id=2))["info"]["sessions"]
    assert client["name"] == "worker-1"
    assert client["usage_blocks"] == 3
    pools = h.ok(wire.PoolsRequest(id=3))["info"]["pools"]
    assert pools["default"]["blocks"]["in_use"] == 3
    assert pools["default"]["memory"]["backend"] == "shm"
    assert pools["default"]["sessions"] == 1


def test_two_pools_sessions_pick_by_name(tmp_path: Any) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text(
        '[[pools]]\nname = "a"\nnum_blocks = 8\nnum_layers = 1\n'
        '[[pools]]\nname = "b"\nnum_blocks = 4\nnum_layers = 1\nblock_size = 32\n'
    )
    harness = Harness(load_config(path, env={}))
    try:
        ra = harness.hello(b"A", pool="a")
        rb = harness.hello(b"B", pool="b")
        assert ra.result["layout"]["block_size"] == 16
        assert rb.result["layout"]["block_size"] == 32
        assert ra.result["memory"]["path"] != rb.result["memory"]["path"]
        harness.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(64)), b"B")
        blocks = harness.d.info.stats()["blocks"]
        assert (blocks["a"]["in_use"], blocks["b"]["in_use"]) == (0, 2)
    finally:
        harness.close()


def test_events_reach_the_publisher() -> None:
    events: list[tuple[str, list[Any]]] = []
    harness = Harness(_config(), events=events)
    try:
        harness.hello()
        harness.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(40)))
        harness.ok(wire.CommitRequest(id=2, seq="s"))
        assert [(pool, type(e).__name__) for pool, evs in events for e in evs] == [
            ("default", "BlockStored")
        ]
    finally:
        harness.close()


def test_service_time_is_observed_per_kind(h: Harness) -> None:
    h.ok(wire.PingRequest(id=1))
    h.err([b"\x7e", b"\x80"])
    assert [kind for kind, _ in h.observed] == ["ping", "invalid"]
    assert all(s >= 0 for _, s in h.observed)


def test_pressure_notices_on_crossing_up_and_down() -> None:
    harness = Harness(_config(**{"admission.pressure_thresholds": "[0.5, 0.75]"}))
    try:
        harness.hello(b"A")
        harness.hello(b"B")
        assert harness.d.info.pressure_notices() == []
        harness.ok(wire.AllocateRequest(id=1, seq="s", tokens=toks(8 * BS), reserve=13 * BS), b"A")
        notices = harness.d.info.pressure_notices()
        assert sorted(who for who, _ in notices) == [b"A", b"B"]
        notice = wire.decode_reply(notices[0][1])
        assert isinstance(notice, wire.Notice)
        assert notice.event == "pressure"
        assert notice.data == {
            "pool": "default",
            "usage": 13 / 16,
            "level": 2,
            "thresholds": [0.5, 0.75],
        }
        assert harness.d.info.pressure_notices() == []  # no crossing, no notice
        harness.ok(wire.FreeRequest(id=2, seq="s"), b"A")
        (_, frames), _ = harness.d.info.pressure_notices()
        down = wire.decode_reply(frames)
        assert isinstance(down, wire.Notice)
        assert down.data["level"] == 0
    finally:
        harness.close()


# --------------------------------------------------------------------------
# Security and quarantine


def _expire(h: Harness, reason: str = "lease_expired") -> None:
    for session in h.d.state.sessions:
        h.d.handshake.close(session, reason)


def test_a_lease_expiry_without_a_pid_quarantines_the_sessions_blocks(h: Harness) -> None:
    h.hello()
    h.ok(wire.AllocateRequest(id=h.nid(), seq="s", tokens=toks(40)))
    h.clock.now += h.d.state.sessions.lease_s * 2
    _expire(h)
    assert h.err(wire.CommitRequest(id=h.nid(), seq="s")).code == wire.Code.SESSION_LOST
    assert h.d.info.stats()["blocks"]["default"]["in_use"] == 3  # still out of circulation
    assert (h.d.info.in_flight(), h.d.handshake.release_quarantined()) == (0, 0)
    h.clock.now += h.d.state.sessions.lease_s * h.d.state.config.server.quarantine_leases
    assert h.d.handshake.release_quarantined() == 1
    assert h.d.info.stats()["blocks"]["default"]["in_use"] == 0
    assert h.ok(wire.CheckRequest(id=h.nid()))["ok"] is True


@pytest.mark.parametrize(
    ("reason", "leases"), [("goodbye", "4"), ("pid_exited", "4"), ("lease_expired", "0")]
)
def test_other_closes_free_the_blocks_at_once(reason: str, leases: str) -> None:
    h = Harness(_config(**{"server.quarantine_leases": leases}))
    try:
        h.hello()
        h.ok(wire.AllocateRequest(id=h.nid(), seq="s", tokens=toks(40)))
        _expire(h, reason)
        assert h.d.state.quarantined == []
        assert h.d.info.stats()["blocks"]["default"]["in_use"] == 0
    finally:
        h.close()


def test_a_forbidden_namespace_opens_nothing() -> None:
    h = Harness(
        _config(
            **{"security.enforce_namespaces": "true", "security.namespaces": '{"uid:7" = ["a*"]}'}
        )
    )
    try:
        hello = wire.HelloRequest(
            id=1, version=wire.PROTOCOL_VERSION, pool="default", name="t", pid=1, namespace="ab"
        ).encode()
        reply = h.send(hello, peer=PeerCred(uid=8, gid=8, pid=1))
        assert isinstance(reply, wire.ErrorReply) and reply.code == wire.Code.FORBIDDEN
        assert len(h.d.state.sessions) == 0
        ok = h.send(hello, peer=PeerCred(uid=7, gid=8, pid=1))
        assert isinstance(ok, wire.OkReply)
    finally:
        h.close()


def test_a_session_beyond_its_rate_is_rate_limited_and_its_bucket_refills() -> None:
    h = Harness(_config(**{"security.rate_limit": "10", "security.rate_burst": "2"}))
    try:
        h.hello()  # the shared bucket
        h.ok(wire.HeartbeatRequest(id=h.nid()))
        h.ok(wire.HeartbeatRequest(id=h.nid()))
        assert h.err(wire.HeartbeatRequest(id=h.nid())).code == wire.Code.RATE_LIMITED
        h.clock.now += 0.1
        h.ok(wire.HeartbeatRequest(id=h.nid()))
    finally:
        h.close()


def test_a_queued_message_at_exit_gets_shutting_down_with_its_id(h: Harness) -> None:
    reply = wire.decode_reply(h.d.refuse_shutting_down(wire.PingRequest(id=41).encode()))
    assert isinstance(reply, wire.ErrorReply)
    assert (reply.id, reply.code) == (41, wire.Code.SHUTTING_DOWN)
    garbage = wire.decode_reply(h.d.refuse_shutting_down([b"\xff"]))
    assert garbage.code == wire.Code.SHUTTING_DOWN


def test_a_reload_reports_security_changes_as_needing_a_restart(h: Harness) -> None:
    fresh = _config(**{"security.rate_limit": "5"})
    report = reload_config(h.d.state, fresh)
    assert "security" in report.needs_restart
    assert h.d.state.config.security.rate_limit == 0.0 and h.d.limiter is None
