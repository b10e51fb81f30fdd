"""Tier 2: a pool's block copies in a Redis (or Valkey) server shared by several nodes.

`RedisTier` is a `TierStore` whose slots are only the engine's bookkeeping:
its objects are named by the block's namespace and key under the pool
layout's fingerprint (``kvd:<fingerprint>:<namespace>:<key hex>``), so pools
of different models or layouts never read each other's bytes, and tenants
never read each other's prompts. Each value is a header (magic, fingerprint,
key, payload length, blake2b of the payload) and the block's bytes; `load`
checks all of it before it writes a byte into the pool.

Discovery: every `store` also appends the stored names to one stream per
fingerprint (``kvd:<fingerprint>:stored``, capped); each daemon reads it
(`poll`) and lets its engine index what other nodes stored, so a lookup
never waits for the network (`kvd.server.tiers`).

Failure: every call has a socket timeout; a failed call opens a breaker
for ``retry_after_s`` in which calls fail at once without touching the
network, so a dead store costs one timeout per window, not one per request.
Every failure raises `RemoteError` with a stable code, counted in `errors`.
"""

from __future__ import annotations

import collections
import hashlib
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, Final, Protocol, runtime_checkable

import numpy as np
from kvd_client.wire import PoolLayout

from kvd.memory.tier import TierStore, block_view, split_name

try:
    import redis

    _HAVE_REDIS = True
except ImportError:  # only a remote tier needs redis-py: vLLM's test venv runs kvd without it
    _HAVE_REDIS = False

__all__ = [
    "REMOTE_CORRUPT",
    "REMOTE_MISSING",
    "REMOTE_UNAVAILABLE",
    "RedisTier",
    "RemoteError",
    "RemoteStore",
    "decode_block",
    "encode_block",
    "join_names",
    "layout_fingerprint",
    "split_names",
]

#: The store did not answer in time or refused the connection (the breaker opens).
REMOTE_UNAVAILABLE: Final = "REMOTE_UNAVAILABLE"
#: A block the index named is not in the store (evicted by its maxmemory or TTL).
REMOTE_MISSING: Final = "REMOTE_MISSING"
#: A value failed its check (length, fingerprint, key or checksum): never promoted.
REMOTE_CORRUPT: Final = "REMOTE_CORRUPT"

_MAGIC: Final = b"KVD2"
#: magic, fingerprint (16), key length, payload length, blake2b-16 of the payload.
_HEADER: Final = struct.Struct("<4s16sBQ16s")
#: Most names one discovery read takes.
_POLL_COUNT: Final = 512


class RemoteError(Exception):
    """A remote tier call failed; ``code`` says how."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def layout_fingerprint(layout: PoolLayout) -> bytes:
    """16 bytes naming where a block's bytes sit in ``layout`` (the block count aside)."""
    fields = (
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.dtype,
        layout.block_size,
        layout.order,
        layout.format,
    )
    return hashlib.blake2b(repr(fields).encode(), digest_size=16).digest()


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode_block(fingerprint: bytes, key: bytes, payload: bytes) -> bytes:
    """One stored value: the header, then ``payload`` (a block's bytes)."""
    return (
        _HEADER.pack(_MAGIC, fingerprint, len(key), len(payload), _digest(payload)) + key + payload
    )


def decode_block(fingerprint: bytes, key: bytes, size: int, value: bytes) -> memoryview:
    """The payload of ``value`` when it is a ``size``-byte block of ``key`` under
    ``fingerprint`` with a matching checksum; RemoteError(REMOTE_CORRUPT) otherwise."""
    head = _HEADER.size + len(key)
    if len(value) != head + size:
        raise RemoteError(REMOTE_CORRUPT, f"value of {len(value)} bytes, expected {head + size}")
    magic, fp, key_len, length, digest = _HEADER.unpack_from(value)
    payload = memoryview(value)[head:]
    if magic != _MAGIC or fp != fingerprint or length != size or key_len != len(key):
        raise RemoteError(REMOTE_CORRUPT, "header names another layout or length")
    if value[_HEADER.size : head] != key:
        raise RemoteError(REMOTE_CORRUPT, "value of another key")
    if _digest(payload) != digest:
        raise RemoteError(REMOTE_CORRUPT, "checksum mismatch")
    return payload


@runtime_checkable
class RemoteStore(TierStore, Protocol):
    """A tier store shared by nodes: `RedisTier`, `kvd.memory.mooncake.MooncakeTier`."""

    def poll(self) -> list[bytes]:
        """`object_name`s other nodes stored since the last poll (RemoteError on failure)."""
        ...


class RedisTier:
    """One pool's remote tier in the Redis server at ``url`` (blocking calls: worker threads)."""

    level = 2

    def __init__(
        self,
        pool_layout: PoolLayout,
        pool_buffer: memoryview,
        url: str,
        *,
        timeout_s: float,
        retry_after_s: float,
        ttl_s: int = 0,
        stream_max: int = 100_000,
        source: tuple[PoolLayout, memoryview] | None = None,
    ) -> None:
        if not _HAVE_REDIS:
            raise RuntimeError("a remote tier needs redis-py (pip install redis==8.1.0)")
        self._pool = block_view(pool_layout, pool_buffer)
        #: Where `store` reads: the pool, or (a chain) the host tier above (`HostTier.view`).
        self._source = self._pool if source is None else block_view(*source)
        self.block_bytes = pool_layout.num_layers * pool_layout.page_bytes
        self.fingerprint = layout_fingerprint(pool_layout)
        self._prefix = f"kvd:{self.fingerprint.hex()}:"
        self._stream = f"{self._prefix}stored"
        self._url = url
        self._ttl = ttl_s or None
        self._stream_max = stream_max
        self._retry_after = retry_after_s
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=None,
        )
        #: The stream position `poll` has read up to ("0": from its start).
        self._cursor = "0"
        self._lock = threading.Lock()
        self._open_until = 0.0
        #: Failed calls by code.
        self.errors: collections.Counter[str] = collections.Counter()

    def _name(self, name: bytes) -> str:
        namespace, key = split_name(name)
        return f"{self._prefix}{namespace}:{key.hex()}"

    def _fail(self, code: str, message: str, *, trip: bool) -> RemoteError:
        with self._lock:
            self.errors[code] += 1
            if trip:
                self._open_until = time.monotonic() + self._retry_after
        return RemoteError(code, message)

    def _check_open(self) -> None:
        if time.monotonic() < self._open_until:
            raise self._fail(REMOTE_UNAVAILABLE, "store failed lately; retrying later", trip=False)

    def store(self, blocks: Sequence[int], slots: Sequence[int], keys: Sequence[bytes]) -> int:
        """Source ``blocks`` (pool blocks, or a chain's host-tier slots) -> the
        store under ``keys`` (`object_name`s), and their names -> the discovery
        stream; the bytes moved."""
        self._check_open()
        pipe = self._redis.pipeline(transaction=False)
        for block, name in zip(blocks, keys, strict=True):
            _, key = split_name(name)
            payload = self._source[..., block, :].tobytes()
            pipe.set(self._name(name), encode_block(self.fingerprint, key, payload), ex=self._ttl)
        pipe.xadd(self._stream, {b"n": join_names(keys)}, maxlen=self._stream_max, approximate=True)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            raise self._fail(REMOTE_UNAVAILABLE, str(exc), trip=True) from exc
        return len(blocks) * self.block_bytes

    def load(self, slots: Sequence[int], blocks: Sequence[int], keys: Sequence[bytes]) -> int:
        """The store's values of ``keys`` -> pool ``blocks``, each checked first
        (none is written unless all pass); the bytes moved."""
        self._check_open()
        try:
            values: list[bytes | None] = self._redis.mget([self._name(n) for n in keys])  # type: ignore[assignment]
        except redis.RedisError as exc:
            raise self._fail(REMOTE_UNAVAILABLE, str(exc), trip=True) from exc
        payloads = []
        for name, value in zip(keys, values, strict=True):
            if value is None:
                raise self._fail(REMOTE_MISSING, self._name(name), trip=False)
            try:
                payloads.append(
                    decode_block(self.fingerprint, split_name(name)[1], self.block_bytes, value)
                )
            except RemoteError as exc:
                raise self._fail(exc.code, f"{self._name(name)}: {exc}", trip=False) from exc
        pool = self._pool
        for block, payload in zip(blocks, payloads, strict=True):
            dst = pool[..., block, :]
            dst[...] = np.frombuffer(payload, dtype=np.uint8).reshape(dst.shape)
        return len(blocks) * self.block_bytes

    def poll(self) -> list[bytes]:
        """`object_name`s other nodes (and this one) stored since the last poll."""
        self._check_open()
        try:
            reply: Any = self._redis.xread({self._stream: self._cursor}, count=_POLL_COUNT)
        except redis.RedisError as exc:
            raise self._fail(REMOTE_UNAVAILABLE, str(exc), trip=True) from exc
        names: list[bytes] = []
        for _, records in reply or ():
            for record_id, fields in records:
                self._cursor = record_id.decode()
                names += split_names(fields.get(b"n", b""))
        return names

    def info(self) -> dict[str, Any]:
        """The store's facts and its failures by code."""
        with self._lock:
            errors = dict(self.errors)
        return {
            "kind": "redis",
            "url": self._url,
            "fingerprint": self.fingerprint.hex(),
            "store_errors": errors,
        }

    def close(self) -> None:
        """Drop the connections and the pool's (and source's) views."""
        self._pool = self._source = np.empty((0, 0), dtype=np.uint8)
        self._redis.close()


def join_names(names: Sequence[bytes]) -> bytes:
    """``names`` as one stream field: each after its length (2 bytes, little-endian)."""
    return b"".join(len(n).to_bytes(2, "little") + n for n in names)


def split_names(joined: bytes) -> list[bytes]:
    """The names `join_names` joined (a truncated tail is dropped)."""
    out, i = [], 0
    while i + 2 <= len(joined):
        end = i + 2 + int.from_bytes(joined[i : i + 2], "little")
        if end > len(joined):
            break
        out.append(joined[i + 2 : end])
        i = end
    return out
