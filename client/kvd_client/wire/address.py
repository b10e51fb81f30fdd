"""Where the daemon listens by default: one resolution for the daemon, clients and kvd-ctl.

The runtime directory is, in order: ``$RUNTIME_DIRECTORY`` (systemd's
``RuntimeDirectory=``; the first entry when it lists several, ``a:b``),
``/run/kvd`` for root, ``$XDG_RUNTIME_DIR/kvd``, ``/tmp/kvd-$EUID``. The
effective uid decides, as it decides who may open the socket. The default
socket is ``ipc://<runtime dir>/kvd.sock``; clients also honour
``$KVD_ADDRESS`` (the daemon takes its address from its config instead).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["ADDRESS_ENV", "default_address", "default_socket", "ipc_path", "runtime_dir"]

#: Environment variable that overrides a client's default address.
ADDRESS_ENV = "KVD_ADDRESS"
#: systemd's ``RuntimeDirectory=`` of the unit (a client run under the unit sees it too).
_SYSTEMD_ENV = "RUNTIME_DIRECTORY"


def runtime_dir(env: Mapping[str, str] | None = None, euid: int | None = None) -> Path:
    """The directory of the default socket (the order is in the module docstring)."""
    env = os.environ if env is None else env
    systemd = env.get(_SYSTEMD_ENV)
    if systemd:
        return Path(systemd.split(":")[0])  # kvd's unit asks for one; take the first
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        return Path("/run/kvd")
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvd"
    return Path(f"/tmp/kvd-{euid}")  # noqa: S108 - per-user directory, the daemon creates it 0700


def default_socket(env: Mapping[str, str] | None = None, euid: int | None = None) -> str:
    """``ipc://<runtime_dir>/kvd.sock``: the daemon's address when its config names none."""
    return f"ipc://{runtime_dir(env, euid) / 'kvd.sock'}"


def default_address(env: Mapping[str, str] | None = None, euid: int | None = None) -> str:
    """A client's default: ``$KVD_ADDRESS`` when set, else `default_socket`."""
    env = os.environ if env is None else env
    return env.get(ADDRESS_ENV) or default_socket(env, euid)


def ipc_path(address: str) -> Path | None:
    """The socket file of an ``ipc://`` address.

    None when there is no file: another transport (tcp) or an abstract
    socket (``ipc://@name``), which no file mode protects.
    """
    if not address.startswith("ipc://"):
        return None
    rest = address[len("ipc://") :]
    if not rest or rest.startswith("@"):
        return None
    return Path(rest)
