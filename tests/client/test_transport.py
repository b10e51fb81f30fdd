"""kvd_client.transport: time-outs and stale replies on a real socket."""

from __future__ import annotations

import re
from collections.abc import Callable

import anyio
import pytest
import zmq
from kvd_client import wire
from kvd_client.core import ClientSession, Identity
from kvd_client.errors import DaemonUnavailable
from kvd_client.transport import AsyncTransport, BlockingTransport, dealer

from .support import Router

StartRouter = Callable[..., Router]


def late_replies(req: wire.Request) -> list[list[bytes]]:
    """Ping 1 gets no reply; ping 2 gets ping 1's late reply first, then its own."""
    assert isinstance(req, wire.PingRequest)
    if req.id == 1:
        return []
    return [
        wire.encode_ok(1, wire.PingResult(epoch=1, version=1)),
        wire.encode_ok(2, wire.PingResult(epoch=2, version=1)),
    ]


def test_blocking_timeout_then_the_late_reply_is_dropped(router: StartRouter) -> None:
    r = router(late_replies)
    session = ClientSession(Identity(pool=None, name="t"))
    transport = BlockingTransport(r.address)
    try:
        with pytest.raises(DaemonUnavailable, match=re.escape(r.address)):
            transport.roundtrip(wire.PingRequest(id=1).encode(), 1, session.accept, 0.2)
        reply = transport.roundtrip(wire.PingRequest(id=2).encode(), 2, session.accept, 5.0)
    finally:
        transport.close()
    assert (reply.id, reply.result["epoch"]) == (2, 2)


def test_async_timeout_then_the_late_reply_is_dropped(router: StartRouter) -> None:
    r = router(late_replies)
    session = ClientSession(Identity(pool=None, name="t"))

    async def main() -> wire.OkReply:
        transport = AsyncTransport(r.address)
        try:
            with pytest.raises(DaemonUnavailable, match=re.escape(r.address)):
                await transport.roundtrip(wire.PingRequest(id=1).encode(), 1, session.accept, 0.2)
            return await transport.roundtrip(
                wire.PingRequest(id=2).encode(), 2, session.accept, 5.0
            )
        finally:
            transport.close()

    reply = anyio.run(main)
    assert (reply.id, reply.result["epoch"]) == (2, 2)


def test_malformed_address_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot connect"):
        BlockingTransport("nonsense")


def test_a_dealer_given_curve_keys_is_a_curve_client() -> None:
    server_public, _ = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    sock = dealer("tcp://127.0.0.1:1", (server_public, public, secret))
    try:
        assert sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        assert sock.getsockopt(zmq.CURVE_SERVER) == 0
    finally:
        sock.close(0)


def test_bad_curve_keys_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="cannot connect"):
        dealer("tcp://127.0.0.1:1", (b"short", b"short", b"short"))
