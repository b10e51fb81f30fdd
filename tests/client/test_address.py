"""kvd_client.wire.address: one default address for the daemon and its clients."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvd_client.wire import ADDRESS_ENV, default_address, default_socket, ipc_path, runtime_dir

from kvd.config import load_config
from kvd.server.daemon import Daemon

#: (environment, effective uid, the runtime directory both sides must pick).
CASES = [
    pytest.param({"RUNTIME_DIRECTORY": "/run/kvd-x"}, 1000, "/run/kvd-x", id="systemd"),
    pytest.param({"RUNTIME_DIRECTORY": "/run/kvd-x"}, 0, "/run/kvd-x", id="systemd-root"),
    pytest.param({"RUNTIME_DIRECTORY": "/run/a:/run/b"}, 0, "/run/a", id="systemd-list"),
    pytest.param(
        {"RUNTIME_DIRECTORY": "/run/a", "XDG_RUNTIME_DIR": "/run/user/7"},
        7,
        "/run/a",
        id="over-xdg",
    ),
    pytest.param({"XDG_RUNTIME_DIR": "/run/user/0"}, 0, "/run/kvd", id="root-ignores-xdg"),
    pytest.param({}, 0, "/run/kvd", id="root"),
    pytest.param({"XDG_RUNTIME_DIR": "/run/user/1000"}, 1000, "/run/user/1000/kvd", id="xdg"),
    pytest.param(
        {"RUNTIME_DIRECTORY": "", "XDG_RUNTIME_DIR": ""}, 1000, "/tmp/kvd-1000", id="empty"
    ),
    pytest.param({}, 1000, "/tmp/kvd-1000", id="tmp"),
]


@pytest.mark.parametrize(("env", "euid", "expected"), CASES)
def test_runtime_dir(env: dict[str, str], euid: int, expected: str) -> None:
    assert runtime_dir(env, euid) == Path(expected)
    assert default_socket(env, euid) == f"ipc://{expected}/kvd.sock"
    assert default_address(env, euid) == f"ipc://{expected}/kvd.sock"


@pytest.mark.parametrize(("env", "euid", "expected"), CASES)
def test_daemon_and_client_resolve_identically(
    env: dict[str, str], euid: int, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The effective uid decides on both sides, read when the address is resolved.
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    daemon = Daemon(load_config(env={}), env=env, handle_signals=False)
    assert daemon.addresses == [default_address(env)] == [f"ipc://{expected}/kvd.sock"]


def test_the_effective_uid_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getuid", lambda: 0)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert runtime_dir({}) == Path("/tmp/kvd-1000")


def test_kvd_address_overrides_for_clients_only() -> None:
    env = {ADDRESS_ENV: "tcp://127.0.0.1:5555", "RUNTIME_DIRECTORY": "/run/kvd"}
    assert default_address(env, euid=0) == "tcp://127.0.0.1:5555"
    # The daemon takes its address from server.address, not from a client's variable.
    daemon = Daemon(load_config(env={}), env=env, handle_signals=False)
    assert daemon.addresses == [default_socket(env)] == ["ipc:///run/kvd/kvd.sock"]


def test_daemon_config_address_wins() -> None:
    config = load_config(env={}, overrides={"server.address": "ipc:///tmp/kvd-t/x.sock"})
    daemon = Daemon(config, env={"RUNTIME_DIRECTORY": "/run/kvd"}, handle_signals=False)
    assert daemon.addresses == ["ipc:///tmp/kvd-t/x.sock"]


@pytest.mark.parametrize(
    ("address", "path"),
    [
        ("ipc:///run/kvd/kvd.sock", Path("/run/kvd/kvd.sock")),
        ("ipc://relative.sock", Path("relative.sock")),
        ("ipc://@abstract", None),
        ("ipc://", None),
        ("tcp://127.0.0.1:1", None),
        ("inproc://x", None),
    ],
)
def test_ipc_path_of_each_transport(address: str, path: Path | None) -> None:
    assert ipc_path(address) == path
