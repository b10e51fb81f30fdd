"""Shared fixtures: a real daemon subprocess on a private ipc socket with a tiny pool.

``kvd_daemon`` starts ``python -m kvd.cli`` on ``ipc:///tmp/kvd-t-XXXX/kvd.sock``
(short: Unix socket paths are limited to 107 bytes), waits until it answers
PING, and stops it at teardown: SIGTERM, then SIGKILL if it does not exit,
then removes whatever it left (socket, shm segments). ``start_kvd`` starts
more (or restarts one on the same address).
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvd_client import wire

from kvd.memory.shm import remove_stale
from kvd.server.transport import instance_id

ROOT = Path(__file__).resolve().parents[1]

#: A pool of 64 blocks of 16 tokens, 2 layers x 2 heads x 16 dims of float16 (2 MiB file).
TINY_POOL = {
    "pools.0.num_blocks": "64",
    "pools.0.num_layers": "2",
    "pools.0.num_kv_heads": "2",
    "pools.0.head_dim": "16",
    "pools.0.block_size": "16",
}
#: How long a daemon may take to answer its first PING (the machine is shared).
READY_TIMEOUT_S = 30.0


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop before any test when a compiled engine module of this interpreter
    is older than its source (edited since the last build): the tests would run
    the old code. Another Python's builds (another venv's) are not this run's."""
    engine = ROOT / "kvd" / "engine"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    stale = [
        so.name
        for so in engine.glob(f"*{suffix}")
        if (src := engine / f"{so.name.split('.')[0]}.py").exists()
        and src.stat().st_mtime > so.stat().st_mtime
    ]
    if stale:
        pytest.exit(
            f"compiled engine modules older than their source: {', '.join(sorted(stale))};"
            " `make venv` (or `.venv/bin/pip install -e .`) compiles them again",
            returncode=2,
        )


def clean_env() -> dict[str, str]:
    """The environment without KVD_* settings of whoever runs the tests."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}


def raw_call(address: str, frames: list[bytes], timeout_ms: int = 5000) -> Any:
    """One request on a fresh DEALER; the decoded reply (None on timeout)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(timeout_ms):
            return None
        return wire.decode_reply(sock.recv_multipart())
    finally:
        sock.close(0)


class KvdProcess:
    """A daemon subprocess and its files."""

    def __init__(self, address: str, workdir: Path, args: list[str], env: dict[str, str]):
        self.address = address
        self.workdir = workdir
        self.args = args
        self.instance = instance_id(address)
        self.log_path = workdir / f"kvd-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> int:
        """Wait for the first PING answer; returns the epoch."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"kvd exited with {self.proc.returncode}:\n{self.log()}")
            reply = raw_call(self.address, wire.PingRequest(id=1).encode(), timeout_ms=200)
            if isinstance(reply, wire.OkReply):
                return int(reply.result["epoch"])
        raise AssertionError(f"kvd did not answer within {READY_TIMEOUT_S} s:\n{self.log()}")

    def call(self, req: wire.Request | list[bytes]) -> Any:
        frames = req if isinstance(req, list) else req.encode()
        return raw_call(self.address, frames)

    def stats(self) -> dict[str, Any]:
        reply = self.call(wire.StatsRequest(id=1))
        assert isinstance(reply, wire.OkReply), reply
        info: dict[str, Any] = reply.result["info"]
        return info

    def check(self) -> dict[str, Any]:
        reply = self.call(wire.CheckRequest(id=1))
        assert isinstance(reply, wire.OkReply), reply
        return reply.result

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; SIGKILL when it does not exit. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def kvd_env() -> dict[str, str]:
    """Environment for daemon and client subprocesses (no KVD_* of the caller)."""
    return clean_env()


@pytest.fixture
def kvd_workdir() -> Iterator[Path]:
    """A short private directory for sockets and logs."""
    path = Path(tempfile.mkdtemp(prefix="kvd-t-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


StartKvd = Callable[..., KvdProcess]


@pytest.fixture
def start_kvd(kvd_workdir: Path) -> Iterator[StartKvd]:
    """``start_kvd(*args, address=None, overrides=None, wait=True)`` -> a running `KvdProcess`."""
    started: list[KvdProcess] = []
    default_address = f"ipc://{kvd_workdir / 'kvd.sock'}"

    def start(
        *extra: str,
        address: str | None = None,
        overrides: dict[str, str] | None = None,
        wait: bool = True,
    ) -> KvdProcess:
        address = address or default_address
        settings = TINY_POOL | {"metrics.enabled": "false", "server.drain_timeout_s": "3"}
        settings |= overrides or {}
        args = ["--address", address, "--log-format", "json"]
        for key, value in settings.items():
            args += ["--set", f"{key}={value}"]
        daemon = KvdProcess(address, kvd_workdir, [*args, *extra], clean_env())
        started.append(daemon)
        if wait:
            daemon.wait_ready()
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
        remove_stale("/dev/shm", daemon.instance)


@pytest.fixture
def kvd_daemon(start_kvd: StartKvd) -> KvdProcess:
    """A running daemon with the tiny pool."""
    return start_kvd()


class RedisServer:
    """A real redis-server on a free loopback port, for the remote tier's tests."""

    def __init__(self, workdir: Path) -> None:
        # Here, not at the top: tests/vllm share this conftest in vLLM's venv, which has
        # no redis-py (only the remote tier needs it).
        import redis

        binary = shutil.which("redis-server")
        if binary is None:  # CI must not pass without the remote tier's tests
            pytest.fail("redis-server is not installed: `make venv` installs it (apt-get)")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(workdir)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, socket_timeout=1.0)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.02)
        self.client = client

    def kill(self) -> None:
        """SIGKILL the server (as a crash would) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def redis_server(kvd_workdir: Path) -> Iterator[RedisServer]:
    """A running redis-server, killed at teardown."""
    server = RedisServer(kvd_workdir)
    yield server
    server.client.close()
    server.kill()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class MooncakeMaster:
    """A real mooncake_master (its HTTP metadata server in process) on loopback ports."""

    def __init__(self) -> None:
        binary = Path(sys.executable).parent / "mooncake_master"
        if not binary.exists():  # CI must not pass without the Mooncake tier's tests
            pytest.fail("mooncake_master is not installed: `make venv` installs it (kvd[mooncake])")
        self.rpc_port, self.http_port, metrics = _free_port(), _free_port(), _free_port()
        self.url = (
            f"mooncake://127.0.0.1:{self.rpc_port}"
            f"?metadata=http://127.0.0.1:{self.http_port}/metadata&segment_mb=32&buffer_mb=16"
        )
        args = [str(binary), "-rpc_port", str(self.rpc_port), "-metrics_port", str(metrics)]
        args += ["-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1"]
        args += ["-http_metadata_server_port", str(self.http_port)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._listening():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                pytest.fail(f"mooncake_master did not start on port {self.rpc_port}")
            time.sleep(0.05)

    def _listening(self) -> bool:
        for port in (self.rpc_port, self.http_port):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) != 0:
                    return False
        return True

    def kill(self) -> None:
        """SIGKILL the master (as a crash would) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A running mooncake_master, killed at teardown."""
    master = MooncakeMaster()
    yield master
    master.kill()
