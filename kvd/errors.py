"""Daemon-side exceptions: each is reported as one clear line and exit code 1.

Wire-level errors live in `kvd_client.wire` (`ProtocolError`, `Code`);
the engine's own caller mistakes in `kvd.engine.errors`. These are the
daemon's failures to *start*: a bad configuration, a pool that does not
fit, a live daemon already serving the address.
"""

from __future__ import annotations

__all__ = ["ConfigError", "KvdError", "PoolTooLargeError", "StartupError"]


class KvdError(Exception):
    """Base of the daemon's own errors; ``str()`` is the one-line message."""


class ConfigError(KvdError):
    """A configuration key is unknown or its value is invalid.

    ``key`` is the dotted name (``server.lease_ms``) so the message points
    at the exact line to fix.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config {key}: {message}" if key else f"config: {message}")
        self.key = key
        self.message = message


class StartupError(KvdError):
    """The daemon cannot start (address in use by a live daemon, bind failure...)."""


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
