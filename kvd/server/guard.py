"""What no client may do to the daemon's memory and descriptors (issue #14).

`guard_connections` runs on the event loop, as often as memory could reach
the budget (`next_check`: every `GUARD_INTERVAL` near it, ~16 times a
second when idle, so an idle daemon does not steal the cores of the
inference processes beside it): it follows the ROUTER's connections
through its monitor socket, shuts down those that sent no hello within
``server.hello_timeout_ms`` and, when the daemon's anonymous memory (less
what queued replies hold) grew by ``server.memory_guard_bytes``, those
that sent no complete message meanwhile: libzmq buffers an unfinished
multipart message without bound, so this bounds it from outside (see
`transport.ConnectionWatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, NoReturn

import anyio
import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvd.server import transport

__all__ = ["GUARD_INTERVAL", "guard_connections", "next_check"]

log = structlog.get_logger("kvd.server")

#: The shortest time between two checks of connections and memory (seconds).
GUARD_INTERVAL: Final = 0.01
#: The longest (seconds): also how late an accept or close is followed.
GUARD_IDLE: Final = 0.25
#: The fastest a peer can grow the daemon's memory (bytes/s): an unfinished
#: message over ipc grows it by ~1 GB/s here; twice that, for a faster machine.
MAX_GROWTH: Final = 2 << 30
#: Seconds between two looks for connections past their hello deadline.
_HELLO_CHECK_S: Final = 0.5


def next_check(headroom: int | None) -> float:
    """Seconds until the next check, ``headroom`` bytes below the memory budget.

    The time memory needs to grow by ``headroom`` at `MAX_GROWTH`, within
    [`GUARD_INTERVAL`, `GUARD_IDLE`] (None: no budget, `GUARD_IDLE`): checks
    come often only when memory nears the budget, so the budget holds as with
    a fixed 10 ms while an idle daemon wakes ~16 times a second, not 100.
    """
    if headroom is None:
        return GUARD_IDLE
    return min(max(headroom / MAX_GROWTH, GUARD_INTERVAL), GUARD_IDLE)


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
    delay, hellos_due = GUARD_INTERVAL, anyio.current_time() + _HELLO_CHECK_S
    while True:
        await anyio.sleep(delay)
        _follow(monitor, watch)
        # What libzmq holds for peers that do not read is bounded on its own.
        queued = replies.queued()
        silent: list[int] = []
        anon = transport.anon_rss() - queued
        past = watch.memory(anon)
        delay = next_check(watch.headroom(anon))
        if past:
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
        if anyio.current_time() >= hellos_due:
            hellos_due = anyio.current_time() + _HELLO_CHECK_S
            overdue = watch.overdue()
            if overdue:
                shut = watch.shutdown(overdue, "no_hello")
                log.info("no_hello", shut=shut, timeout_ms=hello_timeout_ms)
