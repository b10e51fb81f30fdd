"""Fault-injection fixtures: worker processes (``worker.py``) with counters that survive SIGKILL.

The daemon comes from the shared ``start_kvd`` fixture (tests/conftest.py):
a real ``kvd`` subprocess with a 64-block pool on a private ipc socket.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq.auth
from kvd_client import wire

from .worker import COUNTERS, make_counter_file

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[2]
#: Slots in the counter file (workers a test may start, restarts reuse a slot).
SLOTS = 32


class WorkerProcess:
    """One ``worker.py`` process; its counters are row ``slot`` of the shared file."""

    def __init__(self, address: str, slot: int, stats: Path, env: dict[str, str], *args: str):
        self.slot = slot
        self._stats = stats
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "--address",
                address,
                "--slot",
                str(slot),
                "--seed",
                str(slot * 7919 + time.monotonic_ns() % 1000),
                "--stats",
                str(stats),
                *args,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines: list[dict[str, Any]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_event(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the next stdout line of ``event`` (skipping others)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if not ready:
                if self.proc.poll() is not None:
                    break
                continue
            line = self.proc.stdout.readline()
            if not line:
                break
            msg = json.loads(line)
            self.lines.append(msg)
            if msg["event"] == event:
                return msg
        raise AssertionError(f"worker {self.slot} gave no {event!r} line: {self.lines}")

    def counts(self) -> dict[str, int]:
        return read_counts(self._stats, self.slot)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)


def read_counts(stats: Path, slot: int) -> dict[str, int]:
    """The counters of ``slot``, by name (zeros left out)."""
    row = np.fromfile(stats, dtype=np.int64).reshape(-1, len(COUNTERS))[slot]
    return {name: int(v) for name, v in zip(COUNTERS, row, strict=True) if v}


def total_counts(stats: Path) -> dict[str, int]:
    """Every slot's counters added up, by name."""
    rows = np.fromfile(stats, dtype=np.int64).reshape(-1, len(COUNTERS)).sum(axis=0)
    return {name: int(v) for name, v in zip(COUNTERS, rows, strict=True) if v}


def sessions(daemon: Any) -> list[dict[str, Any]]:
    """The daemon's session listing (CLIENTS)."""
    reply = daemon.call(wire.ClientsRequest(id=1))
    assert isinstance(reply, wire.OkReply), reply
    listing: list[dict[str, Any]] = reply.result["info"]["sessions"]
    return listing


def wait_for(cond: Callable[[], bool], timeout: float, what: str, period: float = 0.02) -> float:
    """Poll ``cond`` until true; returns the seconds it took (AssertionError after timeout)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(period)
    return time.monotonic() - t0


SpawnWorker = Callable[..., WorkerProcess]


@pytest.fixture
def kvd_daemon(start_kvd: Callable[..., Any]) -> Any:
    """The shared tiny-pool daemon (default pressure thresholds: notices go out)."""
    return start_kvd()


@pytest.fixture
def curve_files(tmp_path: Path) -> dict[str, Path]:
    """CURVE certificates: the server's secret file (0600), an allowed client's, and the
    directory of allowed client keys (only that client's public certificate)."""
    keys = tmp_path / "keys"
    allowed = keys / "allowed"
    allowed.mkdir(parents=True)
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    public, client_secret = zmq.auth.create_certificates(keys, "client")
    Path(server_secret).chmod(0o600)
    (allowed / "client.key").write_bytes(Path(public).read_bytes())
    return {
        "server_secret": Path(server_secret),
        "server_public": keys / "server.key",
        "client_secret": Path(client_secret),
        "clients_dir": allowed,
    }


def curve_overrides(files: dict[str, Path]) -> dict[str, str]:
    """The daemon's config keys for ``curve_files``."""
    return {
        "server.curve_secret_key_file": str(files["server_secret"]),
        "server.curve_clients_dir": str(files["clients_dir"]),
    }


@pytest.fixture
def worker_stats(kvd_workdir: Path) -> Path:
    """The counter file shared by this test's workers."""
    path = kvd_workdir / "counters.bin"
    make_counter_file(path, SLOTS)
    return path


@pytest.fixture
def spawn_worker(kvd_env: dict[str, str], worker_stats: Path) -> Iterator[SpawnWorker]:
    """``spawn_worker(address, *args, slot=None)``; every worker is SIGKILLed at teardown."""
    workers: list[WorkerProcess] = []
    env = {**kvd_env, "PYTHONUNBUFFERED": "1"}

    def spawn(address: str, *args: str, slot: int | None = None) -> WorkerProcess:
        worker = WorkerProcess(
            address, len(workers) if slot is None else slot, worker_stats, env, *args
        )
        workers.append(worker)
        return worker

    yield spawn
    for worker in workers:
        if worker.proc.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()
        if worker.proc.stdout is not None:
            worker.proc.stdout.close()
