"""Tier 2 on Mooncake Store: a pool's block copies in the distributed store SGLang
HiCache and vLLM's MooncakeStoreConnector use.

`MooncakeTier` is `RedisTier`'s twin behind the same calls (`store`, `load`,
`poll`, `info`, `close`): the same object names (the pool layout's
fingerprint, the block's namespace and key), the same values (header with
magic, fingerprint, key, length and blake2b checksum, then the bytes;
`kvd.memory.remote.decode_block` checks them before a byte reaches the pool)
and the same failure rules (a failed call opens a breaker for
``retry_after_s``; every failure is a `RemoteError` with a stable code).

Each daemon is a Mooncake client that lends the store ``segment_mb`` (default
64) of its own memory (Mooncake's embedded mode), plus a ``buffer_mb``
(default 16) transfer buffer: a block may live in any node's segment, and
goes when that node goes (a miss, `REMOTE_MISSING`). That memory is the
daemon's anonymous memory as it fills, so the config requires it below
``server.memory_guard_bytes``.

Discovery. Mooncake has no listing, so each node keeps an append-only log
of the names it stored, in the store itself: one object per `store` call,
``<prefix>log:<node>:<n>``, n = 0, 1, ... (one writer per log, so no race).
Nodes find each other's logs through a registry of `NODE_SLOTS` objects
``<prefix>node:<k>``: a node claims the first free slot (Mooncake's put
keeps the first value of a name, so the slot is ours when reading it back
gives our id) and claims one again when the master forgets it (a master
restart loses every object). `poll` reads each known log from its cursor;
an entry the store evicted while a later one exists is skipped.

URL: ``mooncake://MASTER_HOST:PORT?metadata=URL&segment_mb=N&buffer_mb=N&hostname=H``
(``metadata`` defaults to the master's HTTP metadata server on port 8080,
``hostname`` to this host's address, as other nodes reach it; TCP transport).
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

import numpy as np
from kvd_client.wire import PoolLayout

from kvd.memory.remote import (
    REMOTE_MISSING,
    REMOTE_UNAVAILABLE,
    RemoteError,
    decode_block,
    encode_block,
    join_names,
    layout_fingerprint,
    split_names,
)
from kvd.memory.tier import block_view, split_name

__all__ = ["NODE_SLOTS", "MooncakeTier", "MooncakeUrl", "parse_url"]

#: Nodes one store can list (registry slots).
NODE_SLOTS: Final = 64
#: Log entries one `poll` reads ahead per node (a gap this long ends the read).
_READ_AHEAD: Final = 8
#: Most names one `poll` returns (the rest at the next).
_POLL_NAMES: Final = 4096


class MooncakeUrl:
    """The parts of a ``mooncake://`` URL (ValueError when malformed)."""

    __slots__ = ("buffer_bytes", "hostname", "master", "metadata", "segment_bytes")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "mooncake" or not parts.hostname or parts.port is None:
            raise ValueError(f"not a mooncake://HOST:PORT URL: {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parts.query, strict_parsing=False).items()}
        unknown = set(query) - {"metadata", "segment_mb", "buffer_mb", "hostname"}
        if unknown:
            raise ValueError(f"unknown mooncake URL parameters: {sorted(unknown)}")
        self.master = f"{parts.hostname}:{parts.port}"
        self.metadata = query.get("metadata", f"http://{parts.hostname}:8080/metadata")
        #: This node's address for the other nodes ("": found when the tier starts).
        self.hostname = query.get("hostname", "")
        try:
            self.segment_bytes = int(query.get("segment_mb", "64")) << 20
            self.buffer_bytes = int(query.get("buffer_mb", "16")) << 20
        except ValueError:
            raise ValueError(f"segment_mb and buffer_mb must be integers: {url!r}") from None
        if self.segment_bytes <= 0 or self.buffer_bytes <= 0:
            raise ValueError(f"segment_mb and buffer_mb must be > 0: {url!r}")


def parse_url(url: str) -> MooncakeUrl:
    """`MooncakeUrl` of ``url`` (ValueError when malformed)."""
    return MooncakeUrl(url)


def _own_address(master_host: str) -> str:
    """This host's address as the master sees it (the source of a route to it)."""
    if master_host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_host, 9))  # no packet: only picks the route
        return str(s.getsockname()[0])


class MooncakeTier:
    """One pool's remote tier in a Mooncake Store (blocking calls: worker threads)."""

    level = 2

    def __init__(
        self,
        pool_layout: PoolLayout,
        pool_buffer: memoryview,
        url: str,
        *,
        retry_after_s: float,
        source: tuple[PoolLayout, memoryview] | None = None,
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415
        except ImportError as exc:
            raise RuntimeError(
                f"a mooncake:// remote tier needs Mooncake (pip install "
                f"'kvd[mooncake]'; its libibverbs.so.1: apt install libibverbs1): {exc}"
            ) from None
        self._url = url
        self._where = parse_url(url)
        self._pool = block_view(pool_layout, pool_buffer)
        self._source = self._pool if source is None else block_view(*source)
        self.block_bytes = pool_layout.num_layers * pool_layout.page_bytes
        self.fingerprint = layout_fingerprint(pool_layout)
        self._prefix = f"kvd:{self.fingerprint.hex()}:"
        self._retry_after = retry_after_s
        self._store = MooncakeDistributedStore()
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._ready = False
        #: This node's log: its id, its registry slot (None: to claim), next entry.
        self._node = os.urandom(8).hex()
        self._slot: int | None = None
        self._seq = 0
        #: Other nodes' logs: id -> the next entry to read.
        self._cursors: dict[str, int] = {}
        #: Failed calls by code.
        self.errors: collections.Counter[str] = collections.Counter()

    def _fail(self, code: str, message: str, *, trip: bool) -> RemoteError:
        with self._lock:
            self.errors[code] += 1
            if trip:
                self._open_until = time.monotonic() + self._retry_after
        return RemoteError(code, message)

    def _check_open(self) -> None:
        if time.monotonic() < self._open_until:
            raise self._fail(REMOTE_UNAVAILABLE, "store failed lately; retrying later", trip=False)
        if not self._ready:
            w = self._where
            try:
                host = w.hostname or _own_address(w.master.rpartition(":")[0])
            except OSError as exc:
                raise self._fail(
                    REMOTE_UNAVAILABLE, f"no route to {w.master}: {exc}", trip=True
                ) from exc
            rc = self._store.setup(
                host, w.metadata, w.segment_bytes, w.buffer_bytes, "tcp", "", w.master
            )
            if rc != 0:
                raise self._fail(REMOTE_UNAVAILABLE, f"setup with {w.master}: {rc}", trip=True)
            self._ready = True

    def _name(self, name: bytes) -> str:
        namespace, key = split_name(name)
        return f"{self._prefix}{namespace}:{key.hex()}"

    def _put(self, names: list[str], values: list[bytes]) -> None:
        rc = self._store.put_batch(names, values)
        if rc != 0:
            raise self._fail(REMOTE_UNAVAILABLE, f"put of {len(names)} objects: {rc}", trip=True)

    def _claim(self) -> None:
        """Take the first free registry slot for this node's log."""
        slots = [f"{self._prefix}node:{k}" for k in range(NODE_SLOTS)]
        for k, found in enumerate(self._store.batch_is_exist(slots)):
            if found == 1:
                continue
            self._put([slots[k]], [self._node.encode()])
            if bytes(self._store.get(slots[k])) == self._node.encode():
                self._slot = k
                return
        raise self._fail(REMOTE_UNAVAILABLE, f"all {NODE_SLOTS} node slots are taken", trip=True)

    def store(self, blocks: Sequence[int], slots: Sequence[int], keys: Sequence[bytes]) -> int:
        """Source ``blocks`` -> the store under ``keys`` (`object_name`s), then
        their names -> this node's log; the bytes moved."""
        self._check_open()
        values = []
        for block, name in zip(blocks, keys, strict=True):
            payload = self._source[..., block, :].tobytes()
            values.append(encode_block(self.fingerprint, split_name(name)[1], payload))
        self._put([self._name(n) for n in keys], values)
        if self._slot is None:
            self._claim()
        self._put([f"{self._prefix}log:{self._node}:{self._seq}"], [join_names(keys)])
        self._seq += 1
        return len(blocks) * self.block_bytes

    def load(self, slots: Sequence[int], blocks: Sequence[int], keys: Sequence[bytes]) -> int:
        """The store's values of ``keys`` -> pool ``blocks``, each checked first
        (none is written unless all pass); the bytes moved."""
        self._check_open()
        values = self._store.get_batch([self._name(n) for n in keys])
        payloads = []
        for name, value in zip(keys, values, strict=True):
            if not value:  # Mooncake answers a missing (or unreachable) object with b""
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
        """`object_name`s other nodes stored since the last poll."""
        self._check_open()
        slots = [f"{self._prefix}node:{k}" for k in range(NODE_SLOTS)]
        present = self._store.batch_is_exist(slots)
        if any(p < 0 for p in present):
            raise self._fail(REMOTE_UNAVAILABLE, "registry read failed", trip=True)
        if self._slot is not None and present[self._slot] != 1:
            self._slot = None  # the master forgot it (restarted): claim again at the next store
        nodes = {
            bytes(v).decode()
            for v in self._store.get_batch(
                [s for s, p in zip(slots, present, strict=True) if p == 1]
            )
            if v
        }
        names: list[bytes] = []
        for node in sorted(nodes - {self._node}):
            names += self._read_log(node, _POLL_NAMES - len(names))
            if len(names) >= _POLL_NAMES:
                break
        return names

    def _read_log(self, node: str, limit: int) -> list[bytes]:
        """Up to ``limit`` names of ``node``'s log from its cursor (gaps skipped)."""
        at = self._cursors.get(node, 0)
        names: list[bytes] = []
        while len(names) < limit:
            entries = self._store.get_batch(
                [f"{self._prefix}log:{node}:{n}" for n in range(at, at + _READ_AHEAD)]
            )
            last = max((i for i, e in enumerate(entries) if e), default=-1)
            if last < 0:
                break
            for entry in entries[: last + 1]:
                if entry:
                    names += split_names(bytes(entry))
            at += last + 1
        self._cursors[node] = at
        return names

    def info(self) -> dict[str, Any]:
        """The store's facts and its failures by code."""
        with self._lock:
            errors = dict(self.errors)
        return {
            "kind": "mooncake",
            "url": self._url,
            "fingerprint": self.fingerprint.hex(),
            "node": self._node,
            "nodes_seen": len(self._cursors),
            "store_errors": errors,
        }

    def close(self) -> None:
        """Leave the store (this node's segment goes with it) and drop the views."""
        self._pool = self._source = np.empty((0, 0), dtype=np.uint8)
        if self._ready:
            self._store.close()
            self._ready = False
