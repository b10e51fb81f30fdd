"""SIGHUP on a real daemon: re-read the file, apply what can change, report the rest."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvd_client import Client, ctl
from kvd_client.errors import QuotaExceeded

from kvd.config import reload_keys

#: The fixtures' types (tests/conftest.py): a daemon process and its starter.
KvdProcess = Any
StartKvd = Any

#: Tokens filling ``n`` blocks of the tiny pool (16 tokens each).
_BLOCK = 16


def _tokens(blocks: int, base: int = 0) -> np.ndarray[Any, np.dtype[np.int32]]:
    return np.arange(base, base + blocks * _BLOCK, dtype=np.int32)


def _reload(daemon: KvdProcess, path: Path, text: str) -> dict[str, Any]:
    """Rewrite the config file, SIGHUP, and return the daemon's next reload log line."""
    before = daemon.log().count('"reload')
    path.write_text(text)
    daemon.signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [ln for ln in daemon.log().splitlines() if '"reload' in ln]
        if len(lines) > before:
            line: dict[str, Any] = json.loads(lines[before])
            return line
        assert daemon.proc.poll() is None, daemon.log()
        time.sleep(0.01)
    raise AssertionError(f"no reload line:\n{daemon.log()}")


@pytest.fixture
def config_file(kvd_workdir: Path) -> Path:
    path = kvd_workdir / "kvd.toml"
    path.write_text("[admission]\nsession_quota_blocks = 0\n")
    return path


def test_session_quota_applies_to_new_sessions(start_kvd: StartKvd, config_file: Path) -> None:
    daemon = start_kvd("--config", str(config_file))
    line = _reload(daemon, config_file, "[admission]\nsession_quota_blocks = 4\n")
    assert line["event"] == "reloaded"
    assert line["applied"] == ["admission.session_quota_blocks"]
    assert line["needs_restart"] == []
    with Client.connect(daemon.address) as kv:
        kv.allocate("fits", _tokens(4)).free()
        with pytest.raises(QuotaExceeded, match=r"quota 4\)"):
            kv.allocate("over", _tokens(5))
    assert daemon.stats()["admission"]["refusals"]["QUOTA_EXCEEDED"] == 1


def test_namespace_quota_applies_to_open_sessions(start_kvd: StartKvd, config_file: Path) -> None:
    daemon = start_kvd("--config", str(config_file))
    with Client.connect(daemon.address, namespace="tenant-a") as kv:
        kv.allocate("before", _tokens(6)).free()
        line = _reload(daemon, config_file, "[admission.namespaces.tenant-a]\nquota_blocks = 3\n")
        assert line["applied"] == ["admission.namespaces"]
        with pytest.raises(QuotaExceeded, match="namespace 'tenant-a'"):
            kv.allocate("after", _tokens(4, base=1000))
        kv.allocate("small", _tokens(3, base=2000)).free()
        # Dropping the namespace's table lifts its quota again.
        line = _reload(daemon, config_file, "[admission]\nsession_quota_blocks = 0\n")
        assert line["applied"] == ["admission.namespaces"]
        kv.allocate("lifted", _tokens(4, base=1000)).free()


def test_a_quota_below_usage_is_refused_and_the_old_limits_stay(
    start_kvd: StartKvd, config_file: Path
) -> None:
    daemon = start_kvd("--config", str(config_file))
    with Client.connect(daemon.address, namespace="tenant-b") as kv:
        held = kv.allocate("held", _tokens(5))
        line = _reload(
            daemon,
            config_file,
            "[admission]\nsession_quota_blocks = 8\n"
            "[admission.namespaces.tenant-b]\nquota_blocks = 2\n",
        )
        assert line["applied"] == ["admission.session_quota_blocks"]
        assert "below its usage of 5 blocks" in line["refused"]["admission.namespaces"]
        kv.allocate("more", _tokens(5, base=1000)).free()  # no namespace quota in force
        held.free()


def test_restart_only_keys_are_reported_not_applied(start_kvd: StartKvd, config_file: Path) -> None:
    daemon = start_kvd("--config", str(config_file))
    line = _reload(
        daemon,
        config_file,
        "[admission]\nwatermark_blocks = 60\npressure_thresholds = [0.5]\n"
        "[memory]\nmax_runtime_pools = 0\n[events]\nbuffer = 5\n",
    )
    assert line["applied"] == ["admission.pressure_thresholds", "memory.max_runtime_pools"]
    assert line["needs_restart"] == ["events", "admission.watermark_blocks"]
    with Client.connect(daemon.address) as kv:
        kv.allocate("no-watermark", _tokens(10)).free()  # a watermark of 60 would refuse it


def test_a_broken_file_keeps_the_running_config(start_kvd: StartKvd, config_file: Path) -> None:
    daemon = start_kvd("--config", str(config_file))
    _reload(daemon, config_file, "[admission]\nsession_quota_blocks = 2\n")
    line = _reload(daemon, config_file, "[admission\nsession_quota_blocks = 0\n")
    assert line["event"] == "reload_failed"
    with Client.connect(daemon.address) as kv, pytest.raises(QuotaExceeded):
        kv.allocate("over", _tokens(3))
    assert daemon.check()["ok"] is True


def test_kvd_ctl_config_marks_what_sighup_applies(
    start_kvd: StartKvd, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    daemon = start_kvd("--config", str(config_file))
    _reload(daemon, config_file, "[admission]\nsession_quota_blocks = 7\n")
    assert ctl.main(["--address", daemon.address, "config"]) == ctl.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    # The reloaded value is the running one, and each key says how it changes.
    assert "admission.session_quota_blocks:7  # reload" in lines
    assert "admission.watermark_blocks:0  # restart" in lines
    assert "server.lease_ms:5000  # restart" in lines
    marked = {ln.split(":", 1)[0] for ln in lines if ln.endswith("# reload")}
    assert marked == reload_keys()
