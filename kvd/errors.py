"""Daemon-side exceptions: each is reported as one clear line and exit code 1.

Wire-level errors live in `kvd_client.wire` (`ProtocolError`, `Code`);
the engine's own caller mistakes in `kvd.engine.errors`. These are the
daemon's failures to *start*: a bad configuration, a pool that does not
fit, a live daemon already serving the address (each also refuses a
runtime pool, as a reply), and `RequestError`, a handler's refusal of one
request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvd_client.wire import Code

__all__ = [
    "BackendUnavailableError",
    "ConfigError",
    "DaemonError",
    "NoSuchDeviceError",
    "PoolTooLargeError",
    "RequestError",
    "StartupError",
]


class DaemonError(Exception):
    """Base of the daemon's own errors; ``str()`` is the one-line message."""


class ConfigError(DaemonError):
    """A configuration key is unknown or its value is invalid.

    ``key`` is the dotted name (``server.lease_ms``) so the message points
    at the exact line to fix.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config {key}: {message}" if key else f"config: {message}")
        self.key = key
        self.message = message


class StartupError(DaemonError):
    """The daemon cannot start (address in use by a live daemon, bind failure...)."""


class BackendUnavailableError(StartupError):
    """A pool's memory backend cannot run on this host (no CUDA runtime, no cupy)."""


class NoSuchDeviceError(StartupError):
    """A pool names a device this host does not have."""


class PoolTooLargeError(StartupError):
    """A pool (or the pool set) does not fit the memory that is really there."""

    def __init__(self, what: str, asked: int, available: int, where: str) -> None:
        super().__init__(
            f"{what} needs {_fmt_bytes(asked)} ({asked} bytes) but {where} "
            f"has {_fmt_bytes(available)} ({available} bytes)"
        )
        self.asked = asked
        self.available = available


def _fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{value:.1f} TiB"


class RequestError(Exception):
    """A handler's refusal of one request (not a bug), answered with ``code``.

    Raised before anything changes, like the engine's own caller errors.
    """

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
