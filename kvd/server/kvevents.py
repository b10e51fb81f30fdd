"""KV events for cluster routers (llm-d, NVIDIA Dynamo) in vLLM's exact wire format.

A router built for vLLM's ``ZmqEventPublisher`` consumes kvd unchanged:

PUB socket (bound at ``endpoint``), one ZeroMQ message per batch::

    frame 0  topic (utf-8; vLLM's default is "", llm-d uses "kv@<pod>@<model>")
    frame 1  sequence number: 8 bytes, big-endian, from 0, +1 per batch
    frame 2  msgpack KVEventBatch: [ts, [event, ...], data_parallel_rank]

Events are tagged maps (vLLM >= 0.24, msgspec ``tag=True`` without
``array_like``; the batch itself stays an array), keys in vLLM's order and
fields with defaults omitted, field for field what vLLM 0.32 publishes
(``tests/vllm/data/vllm-0.32.0-kv-events.*``, captured from a real vLLM
process; kvd's payload for the same blocks is byte-identical)::

    {"type": "BlockStored", "block_hashes": [u64, ...], "parent_block_hash": u64 | None,
     "token_ids": [int, ...], "block_size": int, "lora_id": None, "medium": "CPU" | "GPU",
     "lora_name": str | None, "extra_keys": [[str, ...] | None, ...], "group_idx": 0,
     "kv_cache_spec_kind": "full_attention"}
    {"type": "BlockRemoved", "block_hashes": [u64, ...], "medium": "CPU" | "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

``extra_keys`` has one entry per block, in vLLM's untagged event form
(``to_event_extra_keys``): the adapter's name (on every block of a LoRA
session), then the namespace (vLLM's ``cache_salt``: on the sequence's block 0
only, the block whose ``parent_block_hash`` is None), or None for a block
with neither; so a router tells namespaces and adapters apart as it does
vLLM's salts and LoRAs. kvd's pools hold one full-attention layout each: one
KV cache group, ``group_idx`` 0.

``wire_format="vllm-legacy"`` emits what vLLM <= 0.23 emitted instead: each
event a tagged array (``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name]``, ``["BlockRemoved",
block_hashes, medium]``, ``["AllBlocksCleared"]``) and replies without the
topic frame (and none of the
fields added after 0.23: no extra keys, no group).

Replay (ROUTER bound at ``replay_endpoint``): a DEALER (or REQ) sends one
frame, the first sequence number wanted as 8 bytes big-endian (after an empty
delimiter frame, as vLLM's clients send). The reply is one message per
buffered batch from that number on, ``[topic, seq, payload]``, then the end
marker ``[b"", -1 as 8 signed bytes, b""]`` (legacy: ``[seq, payload]`` and
``[-1, b""]``). Batches older than the ring buffer are gone; a subscriber sees
the gap in the numbers.

Block hashes are the 64-bit event form of kvd's keys, the last 8 bytes of the
32-byte key read big-endian (``kvd_client.wire.hashing.event_id``), so they equal
vLLM's for the same tokens and hash seed.

Wiring (everything runs on the event loop; sockets are used by that thread only)::

    pub = KVEventPublisher("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558",
                           buffer=10_000)
    channel = pub.channel(topic="", medium=MEDIUM_CPU)   # one per pool; queues AllBlocksCleared
    tg.start_soon(pub.run)         # flushes every 10 ms, answers replays
    ...
    channel.extend(engine.drain_events())               # request path: list.extend only
    ...
    pub.close()                    # at shutdown, after the task group is cancelled

The request path never encodes or sends: ``extend`` keeps the engine's own
event objects. `KVEventPublisher.flush` converts them (duck-typed by class
name: ``BlockStored(keys, parent, token_ids, block_size, namespace, adapter)``,
``BlockRemoved(keys)``, ``AllBlocksCleared()``), merges consecutive removals
into one event and consecutive stores that continue the same chain into one,
and sends one batch per channel. A PUB send never blocks: a subscriber that
falls a high-water mark behind loses batches (only that subscriber), sees the
gap in the sequence numbers and asks for a replay, as with vLLM.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import Any, Final, Literal

import anyio
import msgpack
import zmq

from kvd.log import get_logger

__all__ = [
    "END_SEQ",
    "MAX_REPLAYS",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_HOST_TIER",
    "MEDIUM_REMOTE_TIER",
    "EventChannel",
    "KVEventPublisher",
    "WireFormat",
]

_log = get_logger(__name__)

#: The sequence number of the replay end marker: -1 as 8 signed big-endian bytes.
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
#: ``medium`` of blocks in host memory (the shm backend).
MEDIUM_CPU: Final = "CPU"
#: ``medium`` of blocks in device memory (the cuda backend).
MEDIUM_GPU: Final = "GPU"
#: ``medium`` of tier 1's copies (`kvd.engine.tier`) of a pool in host memory; a
#: device pool's tier 1 is vLLM's "CPU" (host memory under device memory).
MEDIUM_HOST_TIER: Final = "CPU_TIER1"
#: ``medium`` of tier 2's copies: the remote store shared by several nodes
#: (`kvd.memory.remote`; LMCache and Dynamo call such a tier remote).
MEDIUM_REMOTE_TIER: Final = "REMOTE"

WireFormat = Literal["vllm", "vllm-legacy"]

_WIRE_FORMATS: Final = ("vllm", "vllm-legacy")
#: ``group_idx`` of every event: a kvd pool is one KV cache group.
_GROUP_IDX: Final = 0
#: ``kv_cache_spec_kind`` of every ``BlockStored`` (vLLM's ``KVCacheSpecKind``).
_SPEC_KIND: Final = "full_attention"
#: vLLM <= 0.23's array fields, in declaration order (after the tag).
_LEGACY_FIELDS: Final = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}
#: Most events per channel one flush of `KVEventPublisher.run` takes: about
#: 0.5 ms of encoding (about 1 µs per block).
_FLUSH_CHUNK: Final = 256
#: Most replay requests read per `KVEventPublisher.serve_replay` call.
_MAX_REQUESTS_PER_CALL: Final = 64
#: Most replays in progress at once (one per peer: a peer's new request
#: replaces its unfinished one); a request past it is refused and counted.
MAX_REPLAYS: Final = 64


class EventChannel:
    """The events of one pool, published under one topic with one medium (and
    ``tier_medium`` for its tier 1's events)."""

    __slots__ = ("_pending", "medium", "tier_medium", "topic")

    def __init__(self, topic: bytes, medium: str) -> None:
        self.topic = topic
        self.medium = medium
        self.tier_medium = MEDIUM_CPU if medium == MEDIUM_GPU else MEDIUM_HOST_TIER
        self._pending: list[Any] = []

    def extend(self, events: Iterable[Any]) -> None:
        """Queue engine events (``Engine.drain_events()``) for the next flush; no encoding."""
        self._pending.extend(events)

    def append(self, event: Any) -> None:
        """Queue one engine event for the next flush."""
        self._pending.append(event)

    def append_cleared(self) -> None:
        """Queue an ``AllBlocksCleared`` (a new pool, or a restart: nothing is cached)."""
        self._pending.append(_CLEARED)

    @property
    def pending(self) -> int:
        """Events queued since the last flush."""
        return len(self._pending)

    def _take(self, limit: int | None) -> list[Any]:
        if limit is None or len(self._pending) <= limit:
            events, self._pending = self._pending, []
        else:
            events = self._pending[:limit]
            del self._pending[:limit]
        return events


class _Cleared:
    """The ``AllBlocksCleared`` a channel queues by itself (`EventChannel.append_cleared`)."""

    __slots__ = ()


_CLEARED: Final = _Cleared()


class _Replay:
    """One replay in progress: the batches ``next`` up to ``end`` (sequence
    numbers; ``end`` the first not yet published when it was asked for) still
    to send to one peer, read from the buffer as they are sent (a batch the
    buffer dropped meanwhile is skipped, as if it had been dropped before)."""

    __slots__ = ("end", "envelope", "next")

    def __init__(self, envelope: list[bytes], first: int, end: int) -> None:
        self.envelope = envelope
        self.next = first
        self.end = end


class KVEventPublisher:
    """ZeroMQ PUB of kvd's KV event batches, with a ROUTER replaying a ring buffer of them.

    ``buffer`` batches (and at most ``buffer_bytes`` of payload) are kept for
    replay. Endpoints are bound, never connected (the daemon is the stable
    side); binding failures raise `zmq.ZMQError` from the constructor.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        buffer: int = 10_000,
        buffer_bytes: int = 256 * 1024 * 1024,
        data_parallel_rank: int = 0,
        hwm: int = 100_000,
        wire_format: WireFormat = "vllm",
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if buffer < 1:
            raise ValueError(f"buffer must be >= 1 batch, got {buffer}")
        if buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be >= 1, got {buffer_bytes}")
        if wire_format not in _WIRE_FORMATS:
            raise ValueError(f"wire_format must be one of {_WIRE_FORMATS}, got {wire_format!r}")
        self._legacy = wire_format == "vllm-legacy"
        self._rank = data_parallel_rank
        self._clock = clock
        self._buffer_max = buffer
        self._buffer_bytes_max = buffer_bytes
        self._buffer: collections.deque[tuple[int, bytes, bytes]] = collections.deque()
        self._buffer_bytes = 0
        self._seq = 0
        self._channels: list[EventChannel] = []
        #: Replays in progress by peer (routing id), oldest first.
        self._replays: dict[bytes, _Replay] = {}
        self._packer = msgpack.Packer()
        self._counts = {"batches": 0, "events": 0, "replays": 0, "replays_refused": 0, "invalid": 0}
        self._warned_replays = False
        self._warned_invalid = False

        ctx = context if context is not None else zmq.Context.instance()
        self._pub: zmq.Socket[bytes] = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 200)
            _bind(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                # Unknown or full peers raise instead of silently losing replies.
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.SNDHWM, hwm)
                self._replay.setsockopt(zmq.LINGER, 0)
                _bind(self._replay, replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        _log.info(
            "kv_events_listening",
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            wire_format=wire_format,
        )

    @property
    def endpoint(self) -> str:
        """The bound PUB endpoint (with the real port when ``*`` or 0 was asked for)."""
        return _last_endpoint(self._pub)

    @property
    def replay_endpoint(self) -> str | None:
        """The bound replay endpoint, or None without replay."""
        return None if self._replay is None else _last_endpoint(self._replay)

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._seq

    def channel(
        self, topic: str | bytes = "", medium: str = MEDIUM_CPU, *, clear: bool = True
    ) -> EventChannel:
        """A channel for one pool's events (``medium``: `MEDIUM_CPU` or `MEDIUM_GPU`).

        With ``clear`` (the default) its first batch is an ``AllBlocksCleared``:
        a new pool holds nothing, and routers must forget what an earlier run
        of the daemon published under this topic.
        """
        channel = EventChannel(topic.encode() if isinstance(topic, str) else topic, medium)
        if clear:
            channel.append_cleared()
        self._channels.append(channel)
        return channel

    def flush(self, max_events: int | None = None) -> int:
        """Encode and send what the channels queued, one batch per channel; the batches sent.

        ``max_events`` caps the events taken from each channel (the rest stay
        queued for the next call), which bounds the time one call holds the
        event loop.
        """
        sent = 0
        for channel in self._channels:
            if not channel._pending:
                continue
            events = self._convert(channel._take(max_events), channel.medium, channel.tier_medium)
            if not events:
                continue
            seq = self._seq
            self._seq += 1
            payload = self._packer.pack([self._clock(), events, self._rank])
            self._remember(seq, channel.topic, payload)
            # A PUB socket never blocks: a subscriber whose queue is at the
            # high-water mark misses the batch (libzmq drops it for that
            # subscriber only), sees the gap in the numbers and asks for a replay.
            self._pub.send_multipart(
                (channel.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
            sent += 1
            self._counts["batches"] += 1
            self._counts["events"] += len(events)
        return sent

    def serve_replay(self, budget: int = 1000) -> int:
        """Read waiting replay requests and send up to ``budget`` replies; the replies sent.

        A long replay is spread over several calls so the event loop is never
        held for long; replays are served in order of arrival.
        """
        if self._replay is None:
            return 0
        for _ in range(_MAX_REQUESTS_PER_CALL):
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._accept_replay(frames)
        sent = 0
        buffer = self._buffer
        while self._replays and sent < budget:
            peer, replay = next(iter(self._replays.items()))
            try:
                while sent < budget:
                    oldest = buffer[0][0] if buffer else self._seq
                    replay.next = max(replay.next, oldest)
                    if replay.next >= replay.end:
                        break
                    seq, topic, payload = buffer[replay.next - oldest]
                    self._send_replay(replay.envelope, topic, seq.to_bytes(8, "big"), payload)
                    replay.next += 1
                    sent += 1
                if replay.next >= replay.end and sent < budget:
                    self._send_replay(replay.envelope, b"", END_SEQ, b"")
                    sent += 1
                    del self._replays[peer]
            except zmq.Again:
                break  # the peer's queue is full: carry on at the next call
            except zmq.ZMQError as exc:
                # EHOSTUNREACH: the peer went away. Anything else: give up on this
                # replay rather than on publishing.
                if exc.errno != zmq.EHOSTUNREACH:
                    _log.warning("kv_events_replay_failed", error=str(exc))
                del self._replays[peer]
        return sent

    async def run(self, interval: float = 0.01) -> None:
        """Flush and serve replays every ``interval`` seconds until cancelled.

        A backlog is sent `_FLUSH_CHUNK` events per channel at a time, giving
        the event loop back between chunks.
        """
        try:
            while True:
                self.flush(max_events=_FLUSH_CHUNK)
                self.serve_replay()
                await anyio.sleep(0 if self.pending else interval)
        finally:
            self.flush()

    @property
    def pending(self) -> int:
        """Events queued on all channels since the last flush."""
        return sum(len(channel._pending) for channel in self._channels)

    def stats(self) -> dict[str, int]:
        """Counters for ``kvd-ctl stats`` and the ``events`` metrics section."""
        return {
            **self._counts,
            "buffered": len(self._buffer),
            "buffered_bytes": self._buffer_bytes,
            "pending": self.pending,
            "next_seq": self._seq,
        }

    def close(self) -> None:
        """Send what is pending, then close the sockets (pending replays are abandoned)."""
        self.flush()
        self._replays.clear()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()

    def _remember(self, seq: int, topic: bytes, payload: bytes) -> None:
        self._buffer.append((seq, topic, payload))
        self._buffer_bytes += len(payload)
        while len(self._buffer) > self._buffer_max or (
            self._buffer_bytes > self._buffer_bytes_max and len(self._buffer) > 1
        ):
            self._buffer_bytes -= len(self._buffer.popleft()[2])

    def _accept_replay(self, frames: list[bytes]) -> None:
        # [identity, b"", seq] from REQ/DEALER clients that send a delimiter, as
        # vLLM's do; [identity, seq] from a bare DEALER.
        if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
            envelope, start = frames[:2], frames[2]
        elif len(frames) == 2 and len(frames[1]) == 8:
            envelope, start = frames[:1], frames[1]
        else:
            self._counts["invalid"] += 1
            _log.warning("kv_events_bad_replay_request", frames=len(frames))
            return
        peer = frames[0]
        # A peer's new request replaces its unfinished one (moved to the back).
        if self._replays.pop(peer, None) is None and len(self._replays) >= MAX_REPLAYS:
            self._counts["replays_refused"] += 1
            if not self._warned_replays:
                self._warned_replays = True
                _log.warning("kv_events_replays_refused", limit=MAX_REPLAYS)
            return
        first = min(int.from_bytes(start, "big"), self._seq)
        self._replays[peer] = _Replay(envelope, first, self._seq)
        self._counts["replays"] += 1

    def _send_replay(self, envelope: list[bytes], topic: bytes, seq: bytes, payload: bytes) -> None:
        frames = [*envelope, seq, payload] if self._legacy else [*envelope, topic, seq, payload]
        assert self._replay is not None
        self._replay.send_multipart(frames, flags=zmq.NOBLOCK)

    def _convert(self, events: list[Any], pool_medium: str, tier_medium: str) -> list[Any]:
        """Engine events to vLLM's event maps (or arrays), merging where the meaning allows."""
        out: list[Any] = []
        last: dict[str, Any] | None = None
        for event in events:
            kind = type(event).__name__
            tier = getattr(event, "tier", 0)
            medium = pool_medium if not tier else tier_medium if tier == 1 else MEDIUM_REMOTE_TIER
            if kind == "BlockRemoved":
                hashes = [int.from_bytes(key[-8:], "big") for key in event.keys]
                if last is not None and last["type"] == "BlockRemoved" and last["medium"] == medium:
                    last["block_hashes"].extend(hashes)
                    continue
                last = {
                    "type": "BlockRemoved",
                    "block_hashes": hashes,
                    "medium": medium,
                    "group_idx": _GROUP_IDX,
                }
            elif kind == "BlockStored":
                hashes = [int.from_bytes(key[-8:], "big") for key in event.keys]
                parent = None if event.parent is None else int.from_bytes(event.parent[-8:], "big")
                extra_keys = _extra_keys(len(hashes), event.parent is None, event)
                if (
                    last is not None
                    and last["type"] == "BlockStored"
                    and last["block_hashes"]
                    and last["block_hashes"][-1] == parent
                    and last["block_size"] == event.block_size
                    and last["lora_name"] == event.adapter
                    and last["medium"] == medium
                ):
                    # The next blocks of the same chain: one event, as vLLM sends per step.
                    last["block_hashes"].extend(hashes)
                    last["token_ids"].extend(event.token_ids)
                    last["extra_keys"].extend(extra_keys)
                    continue
                last = {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": parent,
                    "token_ids": list(event.token_ids),
                    "block_size": event.block_size,
                    "lora_id": None,
                    "medium": medium,
                    "lora_name": event.adapter,
                    "extra_keys": extra_keys,
                    "group_idx": _GROUP_IDX,
                    "kv_cache_spec_kind": _SPEC_KIND,
                }
            elif kind == "AllBlocksCleared" or event is _CLEARED:
                last = {"type": "AllBlocksCleared"}
            else:
                self._counts["invalid"] += 1
                if not self._warned_invalid:
                    self._warned_invalid = True
                    _log.error("kv_events_unknown_event", detail=repr(event))
                continue
            out.append(last)
        if self._legacy:
            # msgspec's array_like form: the tag, then vLLM 0.23's fields in declaration order.
            return [
                [event["type"], *(event[name] for name in _LEGACY_FIELDS[event["type"]])]
                for event in out
            ]
        return out


def _extra_keys(n: int, first_is_block0: bool, event: Any) -> list[list[str] | None]:
    """The ``n`` blocks' extra keys in vLLM's untagged event form (``to_event_extra_keys``).

    vLLM's order is the LoRA name, then the cache salt (kvd's namespace), which
    only the sequence's block 0 carries.
    """
    adapter: str | None = event.adapter
    every: list[str] | None = None if adapter is None else [adapter]
    keys: list[list[str] | None] = [every] * n
    namespace = getattr(event, "namespace", "")
    if first_is_block0 and namespace and n:
        keys[0] = [namespace] if adapter is None else [adapter, namespace]
    return keys


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> None:
    if endpoint.startswith("tcp://") and ("[" in endpoint or "::" in endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(endpoint)


def _last_endpoint(sock: zmq.Socket[bytes]) -> str:
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)
