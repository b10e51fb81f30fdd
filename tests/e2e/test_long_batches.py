"""Long batches through a real daemon: sliced between other connections'
messages, yet in order on their own connection and answered in full."""

from __future__ import annotations

import os

import numpy as np
import zmq
from kvd_client import Client, wire


def _hello(sock: zmq.Socket[bytes]) -> None:
    req = wire.HelloRequest(
        id=1, version=wire.PROTOCOL_VERSION, pool="default", name="raw", pid=os.getpid()
    )
    sock.send_multipart(req.encode())
    assert isinstance(wire.decode_reply(sock.recv_multipart()), wire.OkReply)


def test_a_pipelined_message_waits_for_its_own_long_batch(kvd_daemon) -> None:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(kvd_daemon.address)
    try:
        _hello(sock)
        n = 30  # the tiny pool's 64 blocks: one each, and 600 admission queries
        ops: list[wire.Request] = []
        for j in range(n):
            ops.append(wire.AllocateRequest(id=0, seq=f"s{j}", tokens=np.arange(3, dtype=np.int32)))
            ops += [wire.CanAllocateRequest(id=0, tokens=16)] * 20
        # Sent right behind the batch on the same connection: it must see the batch done.
        sock.send_multipart(wire.encode_batch(2, ops))
        sock.send_multipart(wire.FreeRequest(id=3, seq=f"s{n - 1}").encode())
        with Client.connect(kvd_daemon.address) as other:
            assert other.ping().version == wire.PROTOCOL_VERSION
        first = wire.decode_reply(sock.recv_multipart())
        second = wire.decode_reply(sock.recv_multipart())
        assert (first.id, second.id) == (2, 3)
        assert all(r["ok"] for r in first.result["results"])
        assert isinstance(second, wire.OkReply)
    finally:
        sock.close(0)


def test_a_long_batch_of_the_client_library(kvd_daemon) -> None:
    with Client.connect(kvd_daemon.address) as kv:
        with kv.batch() as b:
            made = []
            for j in range(30):
                made.append(b.allocate(f"r{j}", np.arange(j, j + 20, dtype=np.int32)))
                for _ in range(20):
                    b.can_allocate(16)
        seqs = [d.result() for d in made]
        assert len({int(s.block_table[0]) for s in seqs}) == 30
        with kv.batch() as b:
            for s in seqs:
                b.free(s)
        assert kv.check().ok
