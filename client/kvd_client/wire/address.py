"""Where the daemon listens by default (shared by the daemon, clients and kvd-ctl)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ADDRESS_ENV", "default_address", "ipc_path", "runtime_dir"]

#: Environment variable that overrides the default address.
ADDRESS_ENV = "KVD_ADDRESS"


def runtime_dir(env: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    """``/run/kvd`` for root, else ``$XDG_RUNTIME_DIR/kvd``, else ``/tmp/kvd-$UID``."""
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        return Path("/run/kvd")
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvd"
    return Path(f"/tmp/kvd-{euid}")  # noqa: S108 - per-user directory, the daemon creates it 0700


def default_address(env: Mapping[str, str] | None = None, euid: int | None = None) -> str:
    """``$KVD_ADDRESS`` when set, else ``ipc://<runtime_dir>/kvd.sock``."""
    env = os.environ if env is None else env
    explicit = env.get(ADDRESS_ENV)
    if explicit:
        return explicit
    return f"ipc://{runtime_dir(env, euid) / 'kvd.sock'}"


def ipc_path(address: str) -> Path | None:
    """The socket file of an ``ipc://`` address (None for other transports or abstract ones)."""
    if not address.startswith("ipc://"):
        return None
    rest = address[len("ipc://") :]
    if not rest or rest.startswith("@"):
        return None
    return Path(rest)
