"""kvd.cli: flags over config, one-line errors with exit status 1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth

from kvd.cli import main, parse_args


def test_print_config_applies_flags_over_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text('[server]\nlease_ms = 1500\n[log]\nlevel = "debug"\n')
    status = main(
        [
            "--config",
            str(path),
            "--address",
            "ipc:///tmp/x.sock",
            "--log-level",
            "warning",
            "--set",
            "pools.0.num_blocks=32",
            "--print-config",
        ]
    )
    assert status == 0
    config = json.loads(capsys.readouterr().out)
    assert config["server"]["address"] == "ipc:///tmp/x.sock"
    assert config["server"]["lease_ms"] == 1500
    assert config["log"]["level"] == "warning"
    assert config["pools"][0]["num_blocks"] == 32


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "server.nope=1"], "kvd: config server.nope: unknown key"),
        (["--set", "novalue"], "kvd: --set expects KEY=VALUE, got 'novalue'"),
        (["--log-level", "loud"], "kvd: config log.level: must be one of"),
        (["--config", "/nonexistent/kvd.toml"], "kvd: config: cannot read /nonexistent/kvd.toml"),
    ],
)
def test_config_errors_are_one_line_and_exit_1(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--print-config"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message)
    assert err.count("\n") == 1


def test_config_defaults_to_kvd_config_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kvd.toml"
    monkeypatch.setenv("KVD_CONFIG", str(path))
    assert parse_args([]).config == str(path)


def test_startup_failure_exits_1_with_one_line(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # A tcp endpoint already taken: a real start-up failure, in a real process.
    # tcp is served only with CURVE: the daemon needs its key pair and a client key.
    keys = tmp_path_factory.mktemp("keys")
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    Path(server_secret).chmod(0o600)
    (keys / "clients").mkdir()
    zmq.auth.create_certificates(keys / "clients", "client")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvd.cli",
                "--address",
                f"tcp://127.0.0.1:{port}",
                "--set",
                "metrics.enabled=false",
                "--set",
                "pools.0.num_blocks=8",
                "--set",
                f"memory.shm_dir={tmp_path}",
                "--set",
                f"server.curve_secret_key_file={server_secret}",
                "--set",
                f"server.curve_clients_dir={keys / 'clients'}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        taken.close()
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvd: ")]
    assert lines == [f"kvd: cannot bind tcp://127.0.0.1:{port}: Address already in use"]
    assert not list(tmp_path.iterdir())  # the pool file was removed again
