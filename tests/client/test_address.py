"""kvd_client.wire.address: the default daemon address."""

from __future__ import annotations

from pathlib import Path

from kvd_client.wire import default_address, ipc_path, runtime_dir


def test_root_uses_run_kvd() -> None:
    assert runtime_dir({"XDG_RUNTIME_DIR": "/run/user/0"}, euid=0) == Path("/run/kvd")


def test_user_uses_xdg_runtime_dir() -> None:
    assert runtime_dir({"XDG_RUNTIME_DIR": "/run/user/1000"}, euid=1000) == Path(
        "/run/user/1000/kvd"
    )


def test_user_without_xdg_uses_tmp_per_uid() -> None:
    assert runtime_dir({}, euid=1000) == Path("/tmp/kvd-1000")


def test_default_address_is_the_ipc_socket_in_the_runtime_dir() -> None:
    assert default_address({}, euid=0) == "ipc:///run/kvd/kvd.sock"


def test_kvd_address_overrides() -> None:
    assert default_address({"KVD_ADDRESS": "tcp://127.0.0.1:5555"}, euid=0) == (
        "tcp://127.0.0.1:5555"
    )


def test_ipc_path_of_each_transport() -> None:
    assert ipc_path("ipc:///run/kvd/kvd.sock") == Path("/run/kvd/kvd.sock")
    assert ipc_path("ipc://@abstract") is None
    assert ipc_path("tcp://127.0.0.1:1") is None
