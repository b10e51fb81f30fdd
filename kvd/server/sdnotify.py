"""A tiny sd_notify(3) client: readiness, status, watchdog and stop/reload notices.

Outside systemd (``NOTIFY_SOCKET`` unset) every call is a no-op, so the daemon
calls it unconditionally::

    notifier = Notifier.from_env()
    ...                                   # pools allocated, socket bound
    notifier.ready(status="serving 2 pools")
    interval = notifier.watchdog_interval()  # seconds between pings, or None
    ...                                   # every `interval` s: notifier.watchdog()
    notifier.status("blocks in use 812/8192, 3 clients")
    notifier.reloading()                  # on SIGHUP, then ready() when done
    notifier.stopping()                   # when draining starts
    notifier.close()

Each call sends one datagram on a non-blocking ``AF_UNIX`` socket (a few
microseconds, fine on the event loop) and returns whether it was delivered.
A failure is logged once per notifier and never raised: losing a status line
must not take the daemon down (a lost watchdog ping is what the watchdog is
for). Abstract socket names (``@name``) are supported; other address families
(``vsock:``) are reported once and the notifier stays silent.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

from kvd.log import get_logger

__all__ = ["Notifier"]

_log = get_logger(__name__)


class Notifier:
    """Sends sd_notify messages to ``address`` (None: a no-op notifier)."""

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
    ) -> None:
        self._address = _socket_address(address) if address else None
        self._watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._warned = False
        if address and self._address is None:
            self._warn("unsupported NOTIFY_SOCKET address; notifications disabled", address)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """The notifier systemd set up for this process (a no-op outside systemd).

        Reads ``NOTIFY_SOCKET``, and ``WATCHDOG_USEC`` when ``WATCHDOG_PID`` is
        unset or names this process (systemd's rule).
        """
        env = os.environ if env is None else env
        watchdog: int | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            watchdog = int(usec)
        return cls(env.get("NOTIFY_SOCKET") or None, watchdog_usec=watchdog)

    @property
    def enabled(self) -> bool:
        """True when messages go somewhere (running under systemd with a usable socket)."""
        return self._address is not None

    def watchdog_interval(self) -> float | None:
        """Seconds between `watchdog` pings (half the configured timeout), or None."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2_000_000

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: startup (or a reload) is complete."""
        return self.notify("READY=1", *_status(status))

    def status(self, text: str) -> bool:
        """``STATUS=``: one line shown by ``systemctl status``."""
        return self.notify(*_status(text))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the service is alive."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: shutdown (draining) has begun."""
        return self.notify("STOPPING=1", *_status(status))

    def reloading(self, status: str | None = None) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC``; send `ready` once the reload is done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", *_status(status))

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC``: ask for more time to start or stop (long prefaults)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False when not delivered."""
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            self._warn("sd_notify failed", f"{exc.__class__.__name__}: {exc}")
            return False
        return True

    def close(self) -> None:
        """Close the socket; later calls reopen it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _warn(self, event: str, detail: str) -> None:
        if not self._warned:
            self._warned = True
            _log.warning(event, detail=detail, note="reported once per notifier")


def _socket_address(address: str) -> str | bytes | None:
    if address.startswith("@"):
        # Linux abstract namespace: a leading NUL byte instead of "@".
        return b"\0" + address[1:].encode()
    if address.startswith("/"):
        return address
    return None


def _status(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    # One assignment per line: a newline would end the value early.
    return ("STATUS=" + " ".join(text.splitlines()),)
