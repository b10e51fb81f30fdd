"""kvd.server.kvevents: real SUB and DEALER sockets receive what it publishes, in vLLM's format."""

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgpack
import numpy as np
import pytest
import zmq
from kvd_client.wire.hashing import BlockHasher, event_id

from kvd.engine.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvd.server.kvevents import (
    END_SEQ,
    MAX_REPLAYS,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_HOST_TIER,
    MEDIUM_REMOTE_TIER,
    EventChannel,
    KVEventPublisher,
)

BS = 16
#: DESIGN.md section 5: block 0 of tokens 0..15, vLLM 0.33.0's sha256_cbor, no extras.
BLOCK0_EVENT_ID = 2233398808101521225


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _publisher(ctx: zmq.Context[zmq.Socket[bytes]], **kwargs: Any) -> KVEventPublisher:
    return KVEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", context=ctx, **kwargs
    )


def _subscribe(ctx: zmq.Context[zmq.Socket[bytes]], pub: KVEventPublisher) -> zmq.Socket[bytes]:
    """A SUB that is known to receive: probe batches until one arrives, then drain them."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    probe = pub.channel(clear=False, topic="probe")
    for _ in range(500):
        probe.append_cleared()
        pub.flush()
        if sub.poll(10):
            break
    else:
        pytest.fail("the subscriber never connected")
    last = (pub.next_seq - 1).to_bytes(8, "big")
    while sub.recv_multipart()[1] != last:
        pass
    return sub


def _recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(5000), "nothing received"
    return sock.recv_multipart()


def _replay(
    pub: KVEventPublisher, ctx: zmq.Context[zmq.Socket[bytes]], start: int, **kw: Any
) -> list[list[bytes]]:
    """Ask for a replay as vLLM's subscribers do (DEALER, empty delimiter); all replies."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(str(pub.replay_endpoint))
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies: list[list[bytes]] = []
    for _ in range(2000):
        pub.serve_replay(**kw)
        while dealer.poll(1):
            frames = dealer.recv_multipart()
            replies.append(frames)
            if END_SEQ in frames:
                dealer.close()
                return replies
    pytest.fail(f"no end marker after {len(replies)} replies")


def _keys(tokens: range, parent: bytes | None = None, first_block: int = 0) -> list[bytes]:
    return BlockHasher(BS).keys(np.array(tokens, dtype=np.int32), parent, first_block=first_block)


def _stored(
    keys: list[bytes], parent: bytes | None, tokens: range, adapter: str | None = None
) -> BlockStored:
    tokens_array = np.array(tokens, dtype=np.int32)
    return BlockStored(keys, parent, tokens_array, block_size=BS, namespace="", adapter=adapter)


def _decode(payload: bytes) -> Any:
    return msgpack.unpackb(payload)


def test_sub_receives_three_frames_in_vllm_format(ctx: Any) -> None:
    pub = _publisher(ctx, clock=lambda: 1234.5)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False, topic="kv@node-1@llama")
    keys = _keys(range(32))
    channel.extend([_stored(keys, None, range(32))])
    seq = pub.next_seq
    assert pub.flush() == 1

    topic, seq_bytes, payload = _recv(sub)
    assert topic == b"kv@node-1@llama"
    assert seq_bytes == seq.to_bytes(8, "big")
    assert _decode(payload) == [
        1234.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [BLOCK0_EVENT_ID, event_id(keys[1])],
                "parent_block_hash": None,
                "token_ids": list(range(32)),
                "block_size": BS,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
                "extra_keys": [None, None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ],
        0,
    ]
    pub.close()


def test_removed_and_cleared_events(ctx: Any) -> None:
    pub = _publisher(ctx, data_parallel_rank=3)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False, medium=MEDIUM_GPU)
    keys = _keys(range(32))
    channel.extend([BlockRemoved(keys), AllBlocksCleared()])
    pub.flush()
    _, _, payload = _recv(sub)
    _, events, rank = _decode(payload)
    assert rank == 3
    assert events == [
        {
            "type": "BlockRemoved",
            "block_hashes": [event_id(k) for k in keys],
            "medium": "GPU",
            "group_idx": 0,
        },
        {"type": "AllBlocksCleared"},
    ]
    pub.close()


def test_payload_is_byte_identical_to_vllms_msgspec_encoding(ctx: Any) -> None:
    msgspec = pytest.importorskip("msgspec", reason="msgspec encodes vLLM's own structs")

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class Stored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class Removed(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class Cleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[Stored | Removed | Cleared]

    pub = _publisher(ctx, clock=lambda: 7.25)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    head = _keys(range(16))
    tail = _keys(range(16, 48), parent=head[0], first_block=1)
    channel.extend(
        [
            _stored(head, None, range(16), adapter="sql-lora"),
            BlockRemoved(tail),
            _stored(tail, head[0], range(16, 48)),
            AllBlocksCleared(),
        ]
    )
    pub.flush()
    payload = _recv(sub)[2]

    decoded = msgspec.msgpack.decode(payload, type=KVEventBatch)
    expected = KVEventBatch(
        ts=7.25,
        events=[
            Stored(
                [event_id(head[0])],
                None,
                list(range(16)),
                BS,
                None,
                "CPU",
                "sql-lora",
                extra_keys=[("sql-lora",)],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            Removed([event_id(k) for k in tail], "CPU", group_idx=0),
            Stored(
                [event_id(k) for k in tail],
                event_id(head[0]),
                list(range(16, 48)),
                BS,
                None,
                "CPU",
                None,
                extra_keys=[None, None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            Cleared(),
        ],
        data_parallel_rank=0,
    )
    assert decoded == expected
    assert msgspec.msgpack.encode(expected) == payload
    pub.close()


def test_legacy_format_is_byte_identical_to_vllm_0_23(ctx: Any) -> None:
    msgspec = pytest.importorskip("msgspec", reason="msgspec encodes vLLM's own structs")

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStoredV(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemovedV(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksClearedV(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStoredV | BlockRemovedV | AllBlocksClearedV]

    pub = _publisher(ctx, clock=lambda: 1.0, wire_format="vllm-legacy")
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    keys = _keys(range(32))
    channel.extend([_stored(keys, None, range(32)), BlockRemoved(keys[1:]), AllBlocksCleared()])
    pub.flush()
    payload = _recv(sub)[2]
    expected = KVEventBatch(
        ts=1.0,
        events=[
            BlockStoredV([event_id(k) for k in keys], None, list(range(32)), BS, None, "CPU", None),
            BlockRemovedV([event_id(keys[1])], "CPU"),
            AllBlocksClearedV(),
        ],
        data_parallel_rank=0,
    )
    assert msgspec.msgpack.decode(payload, type=KVEventBatch) == expected
    assert msgspec.msgpack.encode(expected) == payload
    pub.close()


def test_consecutive_removals_become_one_event(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    a, b = _keys(range(32)), _keys(range(100, 132))
    channel.extend([BlockRemoved(a[:1]), BlockRemoved(a[1:]), BlockRemoved(b)])
    pub.flush()
    (event,) = _decode(_recv(sub)[2])[1]
    assert event["block_hashes"] == [event_id(k) for k in a + b]
    pub.close()


def test_stores_that_continue_a_chain_become_one_event(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    keys = _keys(range(48))
    other = _keys(range(500, 516))
    channel.extend(
        [
            _stored(keys[:1], None, range(16)),
            _stored(keys[1:], keys[0], range(16, 48)),
            _stored(other, None, range(500, 516)),  # a new chain: its own event
        ]
    )
    pub.flush()
    first, second = _decode(_recv(sub)[2])[1]
    assert first["block_hashes"] == [event_id(k) for k in keys]
    assert first["parent_block_hash"] is None
    assert first["token_ids"] == list(range(48))
    assert second["block_hashes"] == [event_id(other[0])]
    pub.close()


def test_stores_with_different_adapters_stay_apart(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    keys = _keys(range(32))
    channel.extend(
        [_stored(keys[:1], None, range(16)), _stored(keys[1:], keys[0], range(16, 32), "lora-a")]
    )
    pub.flush()
    events = _decode(_recv(sub)[2])[1]
    assert [e["lora_name"] for e in events] == [None, "lora-a"]
    pub.close()


def test_order_between_removal_and_store_is_kept(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    keys = _keys(range(16))
    channel.extend([BlockRemoved(keys), _stored(keys, None, range(16)), BlockRemoved(keys)])
    pub.flush()
    events = _decode(_recv(sub)[2])[1]
    assert [e["type"] for e in events] == ["BlockRemoved", "BlockStored", "BlockRemoved"]
    pub.close()


def test_sequence_numbers_increase_by_one_per_batch_across_channels(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    first, second = (
        pub.channel(clear=False, topic="pool-a"),
        pub.channel(clear=False, topic="pool-b"),
    )
    start = pub.next_seq
    for _ in range(3):
        first.append_cleared()
        second.append_cleared()
        assert pub.flush() == 2
    received = [_recv(sub) for _ in range(6)]
    assert [int.from_bytes(f[1], "big") for f in received] == list(range(start, start + 6))
    assert [f[0] for f in received] == [b"pool-a", b"pool-b"] * 3
    pub.close()


def test_nothing_pending_sends_nothing(ctx: Any) -> None:
    pub = _publisher(ctx)
    pub.channel(clear=False)
    before = pub.next_seq
    assert pub.flush() == 0
    assert pub.next_seq == before
    pub.close()


def test_request_path_only_queues(ctx: Any) -> None:
    pub = _publisher(ctx)
    channel = pub.channel(clear=False)
    channel.extend([BlockRemoved(_keys(range(16)))])
    channel.append(AllBlocksCleared())
    assert channel.pending == 2
    assert pub.stats()["batches"] == 0
    pub.flush()
    assert channel.pending == 0
    assert pub.stats()["batches"] == 1
    pub.close()


def test_replay_returns_missed_batches_with_topic_then_end_marker(ctx: Any) -> None:
    pub = _publisher(ctx)
    channel = pub.channel(clear=False, topic="kv")
    start = pub.next_seq
    for _ in range(5):
        channel.append_cleared()
        pub.flush()
    replies = _replay(pub, ctx, start + 2)
    assert replies[-1] == [b"", b"", END_SEQ, b""]
    batches = replies[:-1]
    assert [f[0] for f in batches] == [b""] * 3  # the delimiter frame
    assert [f[1] for f in batches] == [b"kv"] * 3
    assert [int.from_bytes(f[2], "big") for f in batches] == [start + 2, start + 3, start + 4]
    assert all(_decode(f[3])[1] == [{"type": "AllBlocksCleared"}] for f in batches)
    assert pub.stats()["replays"] == 1
    pub.close()


def test_replayed_payloads_equal_the_published_ones(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    start = pub.next_seq
    channel.extend([_stored(_keys(range(32)), None, range(32))])
    pub.flush()
    live = _recv(sub)
    (replayed, _) = _replay(pub, ctx, start)
    assert replayed[1:] == live
    pub.close()


def test_legacy_replay_has_no_topic_frame(ctx: Any) -> None:
    pub = _publisher(ctx, wire_format="vllm-legacy")
    channel = pub.channel(clear=False, topic="kv")
    start = pub.next_seq
    channel.append_cleared()
    pub.flush()
    replies = _replay(pub, ctx, start)
    assert [f[:2] for f in replies[:-1]] == [[b"", start.to_bytes(8, "big")]]
    assert replies[-1] == [b"", END_SEQ, b""]
    pub.close()


def test_ring_buffer_keeps_the_newest_batches(ctx: Any) -> None:
    pub = _publisher(ctx, buffer=3)
    channel = pub.channel(clear=False)
    for _ in range(5):
        channel.append_cleared()
        pub.flush()
    seqs = [int.from_bytes(f[2], "big") for f in _replay(pub, ctx, 0)[:-1]]
    assert seqs == [2, 3, 4]
    assert pub.stats()["buffered"] == 3
    pub.close()


def test_ring_buffer_is_bounded_in_bytes(ctx: Any) -> None:
    pub = _publisher(ctx, buffer_bytes=1000)
    channel = pub.channel(clear=False)
    keys = _keys(range(16 * 20))
    for _ in range(10):
        channel.extend([BlockRemoved(keys)])  # about 200 bytes per batch
        pub.flush()
    stats = pub.stats()
    assert stats["buffered_bytes"] <= 1000
    assert 0 < stats["buffered"] < 10
    seqs = [int.from_bytes(f[2], "big") for f in _replay(pub, ctx, 0)[:-1]]
    assert seqs == list(range(10 - stats["buffered"], 10))
    pub.close()


def test_replay_from_the_future_returns_only_the_end_marker(ctx: Any) -> None:
    pub = _publisher(ctx)
    channel = pub.channel(clear=False)
    channel.append_cleared()
    pub.flush()
    assert _replay(pub, ctx, pub.next_seq + 100) == [[b"", b"", END_SEQ, b""]]
    pub.close()


def test_long_replay_is_spread_over_calls(ctx: Any) -> None:
    pub = _publisher(ctx)
    channel = pub.channel(clear=False)
    for _ in range(10):
        channel.append_cleared()
        pub.flush()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(str(pub.replay_endpoint))
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    sent = []
    for _ in range(2000):
        sent.append(pub.serve_replay(budget=4))
        if sum(sent) == 11:
            break
        dealer.poll(1)
    assert [n for n in sent if n] == [4, 4, 3]
    replies = [dealer.recv_multipart() for _ in range(11)]
    assert replies[-1][2] == END_SEQ
    dealer.close()
    pub.close()


def test_bad_replay_request_is_ignored_and_counted(ctx: Any) -> None:
    pub = _publisher(ctx)
    channel = pub.channel(clear=False)
    channel.append_cleared()
    pub.flush()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(str(pub.replay_endpoint))
    dealer.send_multipart([b"", b"short"])
    for _ in range(2000):
        pub.serve_replay()
        if pub.stats()["invalid"]:
            break
        dealer.poll(1)
    assert pub.stats()["invalid"] == 1
    assert not dealer.poll(20)
    dealer.close()
    # The socket keeps serving good requests.
    assert _replay(pub, ctx, 0)[-1][2] == END_SEQ
    pub.close()


def _published(ctx: Any, batches: int, **kw: Any) -> tuple[KVEventPublisher, EventChannel]:
    """A publisher that has published ``batches`` batches (sequence numbers 0 on)."""
    pub = _publisher(ctx, **kw)
    channel = pub.channel(clear=False)
    _publish(pub, channel, batches)
    return pub, channel


def _publish(pub: KVEventPublisher, channel: EventChannel, batches: int) -> None:
    for _ in range(batches):
        channel.append_cleared()
        pub.flush()


def _ask(ctx: Any, pub: KVEventPublisher, start: int) -> zmq.Socket[bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(str(pub.replay_endpoint))
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    return dealer


def _accept_all(pub: KVEventPublisher, asked: int) -> None:
    """Read replay requests without sending, until ``asked`` were read (accepted or refused)."""
    for _ in range(2000):
        pub.serve_replay(budget=0)
        stats = pub.stats()
        if stats["replays"] + stats["replays_refused"] >= asked:
            return
        time.sleep(0.001)
    raise AssertionError(f"only {pub.stats()} of {asked} replay requests read")


def _replies(dealer: zmq.Socket[bytes], pub: KVEventPublisher) -> list[int]:
    """The sequence numbers a peer gets until its end marker."""
    seqs: list[int] = []
    for _ in range(2000):
        pub.serve_replay()
        while dealer.poll(1):
            seqs.append(int.from_bytes(dealer.recv_multipart()[2], "big", signed=True))
        if seqs and seqs[-1] == -1:
            return seqs
    raise AssertionError(f"no end marker after {seqs}")


def test_a_peers_new_replay_request_replaces_its_unfinished_one(ctx: Any) -> None:
    pub, _ = _published(ctx, 4)
    dealer = _ask(ctx, pub, 0)
    dealer.send_multipart([b"", (2).to_bytes(8, "big")])
    _accept_all(pub, 2)
    assert _replies(dealer, pub) == [2, 3, -1]
    assert not dealer.poll(20)
    dealer.close()
    pub.close()


def test_replays_past_the_limit_are_refused_and_counted(ctx: Any) -> None:
    pub, _ = _published(ctx, 1)
    dealers = [_ask(ctx, pub, 0) for _ in range(MAX_REPLAYS + 1)]
    _accept_all(pub, MAX_REPLAYS + 1)
    assert (pub.stats()["replays"], pub.stats()["replays_refused"]) == (MAX_REPLAYS, 1)
    answered = 0
    for dealer in dealers:
        pub.serve_replay()
        if dealer.poll(200):
            answered += 1
        dealer.close()
    assert answered == MAX_REPLAYS
    pub.close()


def test_a_replay_holds_no_batch_the_buffer_dropped(ctx: Any) -> None:
    pub, channel = _published(ctx, 4, buffer=4)
    dealer = _ask(ctx, pub, 0)
    _accept_all(pub, 1)
    _publish(pub, channel, 3)  # batches 0..2 leave the buffer before they are sent
    assert _replies(dealer, pub) == [3, -1]  # and nothing published after the request
    dealer.close()
    pub.close()


def test_unknown_event_is_skipped_and_counted(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    channel.extend([object(), AllBlocksCleared()])
    pub.flush()
    assert _decode(_recv(sub)[2])[1] == [{"type": "AllBlocksCleared"}]
    assert pub.stats()["invalid"] == 1
    pub.close()


def test_run_flushes_periodically_and_on_cancel(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pub.run, 0.001)
            channel.append_cleared()
            while not sub.poll(0):
                await anyio.sleep(0.001)
            sub.recv_multipart()
            channel.append_cleared()
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert _decode(_recv(sub)[2])[1] == [{"type": "AllBlocksCleared"}]
    assert channel.pending == 0
    pub.close()


def test_close_sends_what_is_pending(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    channel.append_cleared()
    pub.close()
    assert _decode(_recv(sub)[2])[1] == [{"type": "AllBlocksCleared"}]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buffer": 0}, "buffer"),
        ({"buffer_bytes": 0}, "buffer_bytes"),
        ({"wire_format": "x"}, "wire_format"),
    ],
)
def test_bad_arguments_are_refused(ctx: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _publisher(ctx, **kwargs)


def test_endpoint_in_use_raises_and_leaks_no_socket(ctx: Any) -> None:
    pub = _publisher(ctx)
    with pytest.raises(zmq.ZMQError):
        KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint=pub.endpoint, context=ctx)
    pub.close()
    # Every socket is closed, so the context terminates at once.
    ctx.term()


def test_channel_topic_accepts_bytes(ctx: Any) -> None:
    pub = _publisher(ctx)
    assert isinstance(pub.channel(clear=False, topic=b"raw"), EventChannel)
    assert pub.channel(clear=False, topic=b"raw").topic == b"raw"
    pub.close()


def test_flush_cap_splits_a_backlog_into_ordered_batches(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    keys = _keys(range(16 * 5))
    channel.extend([BlockRemoved([key]) for key in keys])
    assert pub.flush(max_events=2) == 1
    assert pub.pending == 3
    while pub.pending:
        pub.flush(max_events=2)
    batches = [_decode(_recv(sub)[2])[1] for _ in range(3)]
    hashes = [event["block_hashes"] for batch in batches for event in batch]
    assert hashes == [
        [event_id(k) for k in keys[:2]],
        [event_id(k) for k in keys[2:4]],
        [event_id(keys[4])],
    ]
    pub.close()


def test_a_new_channel_first_tells_routers_to_forget(ctx: Any) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(topic="pool")
    channel.extend([BlockRemoved(_keys(range(16)))])
    pub.flush()
    topic, _, payload = _recv(sub)
    assert topic == b"pool"
    assert [e["type"] for e in _decode(payload)[1]] == ["AllBlocksCleared", "BlockRemoved"]
    pub.close()


def test_replay_waits_for_a_slow_peer_instead_of_dropping(ctx: Any) -> None:
    # inproc queues hold exactly SNDHWM + RCVHWM messages, so the ROUTER fills up.
    pub = KVEventPublisher(
        "inproc://kv-events-slow", replay_endpoint="inproc://kv-replay-slow", hwm=2, context=ctx
    )
    channel = pub.channel(clear=False)
    for _ in range(10):
        channel.append_cleared()
        pub.flush()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.connect("inproc://kv-replay-slow")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replies: list[list[bytes]] = []
    stalled = False
    for _ in range(2000):
        sent = pub.serve_replay()
        stalled = stalled or (0 < sent < 11 and not replies)
        while dealer.poll(1):
            replies.append(dealer.recv_multipart())
        if replies and replies[-1][2] == END_SEQ:
            break
    assert stalled, "the peer's queue never filled up"
    assert [int.from_bytes(r[2], "big", signed=True) for r in replies] == [*range(10), -1]
    dealer.close()
    pub.close()


#: KV events of a real vLLM 0.32 process (tests/vllm/capture_events.py): 2 blocks of 32
#: tokens plain, the same with cache_salt "tenant-a", then a prefix-cache reset.
VLLM_CAPTURE = Path(__file__).resolve().parents[1] / "vllm" / "data"


def _captured() -> tuple[list[list[bytes]], dict[str, Any]]:
    frames = msgpack.unpackb((VLLM_CAPTURE / "vllm-0.32.0-kv-events.msgpack").read_bytes())
    description = json.loads((VLLM_CAPTURE / "vllm-0.32.0-kv-events.json").read_text())
    return frames, description


def test_captured_vllm_block_stored_has_the_fields_kvd_sends() -> None:
    frames, description = _captured()
    stored = [e for _, _, p in frames for e in _decode(p)[1] if e["type"] == "BlockStored"]
    assert len(stored) == 2
    assert [list(e) for e in stored] == [
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
        ]
    ] * 2
    # One entry per block: None without extras; the salt (untagged) on block 0 only.
    assert stored[0]["extra_keys"] == [None, None]
    assert stored[1]["extra_keys"] == [["tenant-a"], None]
    assert description["vllm"] == "0.32.0"


@pytest.mark.parametrize("batch", [0, 1, 2])
def test_payload_is_byte_identical_to_a_captured_vllm_0_32_batch(ctx: Any, batch: int) -> None:
    """kvd publishing the blocks vLLM stored sends vLLM's payload, byte for byte."""
    frames, description = _captured()
    topic, _, payload = frames[batch]
    ts, (event,), rank = _decode(payload)
    block_size = description["block_size"]
    tokens = np.array(description["prompt"][: 2 * block_size], dtype=np.int32)
    namespace = ["", "tenant-a", None][batch]
    pub = _publisher(ctx, clock=lambda: ts, data_parallel_rank=rank)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(topic, medium=MEDIUM_GPU, clear=False)  # vLLM's own medium
    if namespace is None:
        channel.append(AllBlocksCleared())
    else:
        keys = BlockHasher(block_size).keys(tokens, None, namespace=namespace)
        channel.append(
            BlockStored(
                keys, None, tokens, block_size=block_size, namespace=namespace, adapter=None
            )
        )
    pub.flush()
    got_topic, _, got_payload = _recv(sub)
    assert got_topic == topic
    assert _decode(got_payload) == [ts, [event], rank]
    assert got_payload == payload
    pub.close()


def test_extra_keys_carry_the_adapter_on_every_block_and_the_namespace_on_block_0(
    ctx: Any,
) -> None:
    """vLLM's order (``to_event_extra_keys``): LoRA name, then cache salt (block 0 only)."""
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    hasher = BlockHasher(BS)
    head = hasher.keys(np.arange(32, dtype=np.int32), None, namespace="t1", adapter="sql")
    tail = hasher.keys(
        np.arange(32, 48, dtype=np.int32),
        head[-1],
        first_block=2,
        namespace="t1",
        adapter="sql",
    )

    def stored(keys: list[bytes], parent: bytes | None, tokens: range) -> BlockStored:
        array = np.array(tokens, dtype=np.int32)
        return BlockStored(keys, parent, array, block_size=BS, namespace="t1", adapter="sql")

    # A commit of blocks 0-1, then block 2 of the same chain: one event, as vLLM sends.
    channel.extend([stored(head, None, range(32)), stored(tail, head[-1], range(32, 48))])
    # A store that starts mid-chain carries no salt.
    channel.append(stored(tail, head[-1], range(32, 48)))
    channel.append(BlockRemoved(tail))
    channel.append(stored(tail, head[-1], range(32, 48)))
    pub.flush()
    events = _decode(_recv(sub)[2])[1]
    assert events[0]["extra_keys"] == [["sql", "t1"], ["sql"], ["sql"]]
    assert events[0]["lora_name"] == "sql"
    assert events[0]["block_hashes"] == [event_id(k) for k in head + tail]
    assert [e["type"] for e in events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "BlockStored",
    ]
    assert events[1]["extra_keys"] == events[3]["extra_keys"] == [["sql"]]
    assert events[1]["parent_block_hash"] == event_id(head[-1])
    pub.close()


def test_legacy_format_leaves_out_the_fields_added_after_0_23(ctx: Any) -> None:
    pub = _publisher(ctx, wire_format="vllm-legacy")
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    keys = _keys(range(16))
    channel.extend([_stored(keys, None, range(16), adapter="a"), BlockRemoved(keys)])
    pub.flush()
    stored, removed = _decode(_recv(sub)[2])[1]
    assert stored == [
        "BlockStored",
        [event_id(keys[0])],
        None,
        list(range(16)),
        BS,
        None,
        "CPU",
        "a",
    ]
    assert removed == ["BlockRemoved", [event_id(keys[0])], "CPU"]
    pub.close()


@pytest.mark.parametrize(
    ("tiers", "mediums"),
    [((0, 1), [MEDIUM_CPU, MEDIUM_HOST_TIER]), ((1, 2), [MEDIUM_HOST_TIER, MEDIUM_REMOTE_TIER])],
)
def test_tier_moves_carry_their_tier_medium_and_stay_apart(
    ctx: Any, tiers: tuple[int, int], mediums: list[str]
) -> None:
    pub = _publisher(ctx)
    sub = _subscribe(ctx, pub)
    channel = pub.channel(clear=False)
    a = _keys(range(32))
    channel.extend([BlockRemoved(a[:1], tier=tiers[0]), BlockRemoved(a[1:], tier=tiers[1])])
    pub.flush()
    events = _decode(_recv(sub)[2])[1]
    assert [e["medium"] for e in events] == mediums
    pub.close()
