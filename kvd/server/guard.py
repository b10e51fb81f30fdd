"""What no client may do to the daemon's memory and descriptors (issue #14).

`guard_connections` runs on the event loop every `GUARD_INTERVAL`: it
follows the ROUTER's connections through its monitor socket, shuts down
those that sent no hello within ``server.hello_timeout_ms`` and, when the
daemon's anonymous memory (less what queued replies hold) grew by
``server.memory_guard_bytes``, those that sent no complete message
meanwhile: libzmq buffers an unfinished multipart message without bound,
so this bounds it from outside (see `transport.ConnectionWatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, NoReturn

import anyio
import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvd.server import transport

__all__ = ["GUARD_INTERVAL", "guard_connections"]

log = structlog.get_logger("kvd.server")

#: How often the loop checks connections and the daemon's memory (seconds): an
#: unfinished message over ipc grows memory by ~1 GB/s, ~10 MB per check.
GUARD_INTERVAL: Final = 0.01
#: Guard checks between two looks for connections past their hello deadline.
_HELLO_CHECK_EVERY: Final = 50


def _follow(monitor: zmq.Socket[bytes], watch: transport.ConnectionWatch) -> None:
    """Apply the monitor's queued accept/close events to ``watch``."""
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        if event["event"] == zmq.EVENT_ACCEPTED:
            watch.accepted(int(event["value"]))
        else:
            watch.closed(int(event["value"]))


async def guard_connections(
    monitor: zmq.Socket[bytes],
    watch: transport.ConnectionWatch,
    replies: transport.ReplyQueues,
    wake: Callable[[], None],
    hello_timeout_ms: int,
) -> NoReturn:
    """Shut down the silent connections the limits name, until cancelled.

    ``wake`` has the request thread look at its queue (it may be blocked in a
    receive since before the memory guard asked it to).
    """
    checks = 0
    while True:
        await anyio.sleep(GUARD_INTERVAL)
        _follow(monitor, watch)
        # What libzmq holds for peers that do not read is bounded on its own.
        queued = replies.queued()
        silent: list[int] = []
        if watch.memory(transport.anon_rss() - queued):
            if not watch.waiting:
                wake()
            # Freed heap kept by the allocator is not a peer's: give it back first.
            await anyio.to_thread.run_sync(transport.malloc_trim)
            anon = transport.anon_rss() - queued
            silent = watch.silent(anon)
        if silent:
            shut = watch.shutdown(silent, "memory_guard")
            log.warning(
                "memory_guard",
                anon_rss=anon,
                limit=watch.memory_budget,
                shut=shut,
                note="connections that sent no complete message while memory grew",
            )
            await anyio.to_thread.run_sync(transport.malloc_trim)
        checks += 1
        if checks % _HELLO_CHECK_EVERY == 0:
            overdue = watch.overdue()
            if overdue:
                shut = watch.shutdown(overdue, "no_hello")
                log.info("no_hello", shut=shut, timeout_ms=hello_timeout_ms)
