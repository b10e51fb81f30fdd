"""Helpers for the client tests: pool files, hand-built replies, a real ROUTER thread.

`Router` is the real transport (a zmq ROUTER socket in a thread) answering
with the real protocol encoders; it stands in for the daemon only in driver
tests. End-to-end tests against the daemon live in tests/e2e.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from kvd_client import wire
from kvd_client.core import ClientSession, Op
from kvd_client.errors import KvdError
from kvd_client.wire import PoolLayout

#: 3 layers, 2 KV heads of 4 dims, float16, blocks of 4 tokens, 8 blocks.
LAYOUT = PoolLayout(
    num_layers=3, num_kv_heads=2, head_dim=4, dtype="float16", block_size=4, num_blocks=8
)


def make_pool_file(layout: PoolLayout, directory: str = "/dev/shm") -> Path:
    """A zeroed file of ``layout.total_bytes`` (mode 0660), like the daemon's."""
    path = Path(directory) / f"kvd-test-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
    try:
        os.ftruncate(fd, layout.total_bytes)
    finally:
        os.close(fd)
    return path


def shm_handle(path: Path, layout: PoolLayout) -> dict[str, Any]:
    return {"backend": "shm", "path": str(path), "size": layout.total_bytes, "offset": 0}


def hello_result(layout: PoolLayout, memory: dict[str, Any], **over: Any) -> wire.HelloResult:
    fields: dict[str, Any] = {
        "session": 7,
        "epoch": 99,
        "pool": "default",
        "layout": layout.to_dict(),
        "memory": memory,
        "lease_ms": 5000,
        "hash_seed": "vllm-none-hash",
        "namespace": "",
        "max_message_bytes": wire.MAX_MESSAGE_BYTES,
    }
    fields.update(over)
    return wire.HelloResult(**fields)


def blocks(*ids: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    return np.asarray(ids, dtype=np.int32)


class Wire:
    """Drives core operations by hand: each request is decoded by the real decoder,
    each reply is built with the real encoders and passed through `ClientSession.accept`."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session
        self.sent: list[wire.Request] = []

    def start(self, op: Op[Any]) -> wire.Request:
        """Run ``op`` to its first request; returns that request as the daemon decodes it."""
        self._op = op
        return self._decode(op.send(None))  # type: ignore[arg-type]

    def _decode(self, out: Any) -> wire.Request:
        req = wire.decode_request(self.session.encode(out))
        self.sent.append(req)
        return req

    def reply(self, frames: list[bytes]) -> Any:
        """Feed reply frames; returns the op's value, or the next request (a `wire.Request`)."""
        req = self.sent[-1]
        try:
            try:
                ok = self.session.accept(frames, req.id)  # type: ignore[attr-defined]
            except KvdError as exc:
                return self._decode(self._op.throw(exc))
            assert ok is not None, "the reply was not taken as the answer"
            return self._decode(self._op.send(ok))
        except StopIteration as stop:
            return stop.value

    def ok(self, result: wire.Result | dict[str, Any]) -> Any:
        return self.reply(wire.encode_ok(self.sent[-1].id, result))  # type: ignore[attr-defined]

    def error(self, code: wire.Code, msg: str = "refused") -> Any:
        return self.reply(wire.encode_error(self.sent[-1].id, code, msg))  # type: ignore[attr-defined]


Handler = Callable[[wire.Request], Iterable[list[bytes]]]


class Router:
    """A real ROUTER socket in a thread: decodes each request, sends ``handler``'s replies."""

    def __init__(self, address: str, handler: Handler) -> None:
        self.address = address
        self.handler = handler
        self.requests: list[wire.Request] = []
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(20):
                continue
            ident, *frames = sock.recv_multipart()
            req = wire.decode_request(frames)
            self.requests.append(req)
            for reply in self.handler(req):
                sock.send_multipart([ident, *reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
