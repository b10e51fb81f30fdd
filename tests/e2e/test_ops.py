"""Running kvd as a service, end to end: sd_notify, KV events, metrics beside kvd-ctl."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from kvd_client import Client
from kvd_client.errors import OutOfBlocks
from kvd_client.wire.hashing import DEFAULT_HASH_SEED, BlockHasher, event_id
from prometheus_client.parser import text_string_to_metric_families

from kvd.memory.shm import remove_stale
from kvd.server.transport import instance_id

ROOT = Path(__file__).resolve().parents[2]
#: The tiny pool of tests/conftest.py: 64 blocks of 16 tokens.
SETTINGS = {
    "pools.0.num_blocks": "64",
    "pools.0.num_layers": "2",
    "pools.0.num_kv_heads": "2",
    "pools.0.head_dim": "16",
    "metrics.enabled": "false",
    "server.drain_timeout_s": "3",
}
BS = 16


class Daemon:
    """A ``python -m kvd.cli`` subprocess with its own environment and log file."""

    def __init__(self, workdir: Path, overrides: dict[str, str], env: dict[str, str]) -> None:
        self.address = f"ipc://{workdir / 'kvd.sock'}"
        self.log_path = workdir / f"kvd-{time.monotonic_ns()}.log"
        args = ["--address", self.address, "--log-format", "json"]
        for key, value in (SETTINGS | overrides).items():
            args += ["--set", f"{key}={value}"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvd.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_event(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        """The first log line of ``event`` (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                if f'"event": "{event}"' in line:
                    found: dict[str, Any] = json.loads(line)
                    return found
            assert self.proc.poll() is None, self.log()
            time.sleep(0.01)
        raise AssertionError(f"no {event} line:\n{self.log()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("KVD_", "NOTIFY_"))} | extra


@pytest.fixture
def start(kvd_workdir: Path) -> Iterator[Callable[..., Daemon]]:
    daemons: list[Daemon] = []

    def run(overrides: dict[str, str] | None = None, **env: str) -> Daemon:
        daemon = Daemon(kvd_workdir, overrides or {}, _env(**env))
        daemons.append(daemon)
        return daemon

    yield run
    for daemon in daemons:
        daemon.stop()
        remove_stale("/dev/shm", instance_id(daemon.address))


_CTL = "import sys; from kvd_client.ctl import main; sys.exit(main())"


def _ctl(address: str, *args: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-c", _CTL, "--address", address, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=_env(),
        timeout=60,
    )
    return json.loads(out.stdout)


# --------------------------------------------------------------------------
# sd_notify


def test_notify_socket_sees_ready_watchdog_status_then_stopping(
    start: Callable[..., Daemon], kvd_workdir: Path
) -> None:
    path = str(kvd_workdir / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    try:
        daemon = start(NOTIFY_SOCKET=path, WATCHDOG_USEC="100000")
        seen: list[str] = []

        def until(prefix: str) -> None:
            while not any(m.startswith(prefix) for m in seen):
                seen.extend(sock.recv(4096).decode().splitlines())

        until("READY=1")
        until("WATCHDOG=1")
        until("STATUS=")
        daemon.proc.send_signal(signal.SIGTERM)
        until("STOPPING=1")
        assert daemon.proc.wait(20) == 0
        first = {
            key: next(i for i, m in enumerate(seen) if m.startswith(key))
            for key in ("READY=1", "WATCHDOG=1", "STOPPING=1")
        }
        assert first["READY=1"] < first["WATCHDOG=1"] < first["STOPPING=1"]
        status = [m for m in seen if m.startswith("STATUS=")]
        assert any("blocks in use 0/64" in m for m in status), status
    finally:
        sock.close()


# --------------------------------------------------------------------------
# KV events


def _batches(frames_list: list[list[bytes]]) -> list[tuple[int, list[dict[str, Any]]]]:
    out = []
    for topic, seq, payload in frames_list:
        assert topic == b""
        _, events, rank = msgpack.unpackb(payload)
        assert rank == 0
        out.append((int.from_bytes(seq, "big"), events))
    return out


def _replay(endpoint: str, start_seq: int) -> list[tuple[int, list[dict[str, Any]]]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        frames: list[list[bytes]] = []
        while True:
            assert sock.poll(10_000), "replay did not answer"
            msg = sock.recv_multipart()
            if msg[0] == b"":  # vLLM clients' empty delimiter
                msg = msg[1:]
            if msg[1] == (-1).to_bytes(8, "big", signed=True):
                return _batches(frames)
            frames.append(msg)
    finally:
        sock.close(0)


def test_kv_events_carry_exactly_the_keys_clients_stored(
    start: Callable[..., Daemon], kvd_workdir: Path
) -> None:
    pub, replay = f"ipc://{kvd_workdir / 'ev.sock'}", f"ipc://{kvd_workdir / 'replay.sock'}"
    daemon = start(
        {"events.enabled": "true", "events.endpoint": pub, "events.replay_endpoint": replay}
    )
    daemon.log_event("ready")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    live: list[list[bytes]] = []
    rng = np.random.default_rng(7)
    system = rng.integers(0, 50_000, 48, dtype=np.int32)  # 3 shared blocks
    prompts: list[np.ndarray[Any, np.dtype[np.int32]]] = []
    try:
        with Client.connect(daemon.address) as kv:
            # PUB drops batches sent before the subscription lands: store
            # prompts until one arrives live; the replay has them all anyway.
            for i in range(200):
                tail = rng.integers(0, 50_000, 16 * (1 + i % 3) + 5, dtype=np.int32)
                prompt = np.concatenate((system, tail))
                prompts.append(prompt)
                seq = kv.allocate(f"r{i}", prompt)
                seq.commit()
                seq.free()
                while sub.poll(20):
                    live.append(sub.recv_multipart())
                if live and i >= 4:
                    break
            assert live, "no event batch reached the subscriber"
            hasher = BlockHasher(BS, DEFAULT_HASH_SEED)
            expected: dict[int, tuple[int | None, list[int]]] = {}
            for prompt in prompts:
                parent: int | None = None
                for b, key in enumerate(hasher.keys(prompt, None)):
                    expected[event_id(key)] = (parent, prompt[b * BS : (b + 1) * BS].tolist())
                    parent = event_id(key)
            time.sleep(0.05)  # the publisher flushes every 10 ms
            history = _replay(replay, 0)
            assert [seq for seq, _ in history] == list(range(len(history)))
            stored: dict[int, tuple[int | None, list[int]]] = {}
            for _, events in history:
                for ev in events:
                    if ev["type"] != "BlockStored":
                        continue
                    parent = ev["parent_block_hash"]
                    for i, h in enumerate(ev["block_hashes"]):
                        stored[h] = (parent, ev["token_ids"][i * BS : (i + 1) * BS])
                        parent = h
            assert stored == expected
            assert history[0][1] == [{"type": "AllBlocksCleared"}]  # a new pool: start clean
            # The replay from a later number returns exactly the batches from it.
            later = _replay(replay, len(history) - 2)
            assert later == history[-2:]
            kv.flush()
            cleared = False
            deadline = time.monotonic() + 10
            while not cleared and time.monotonic() < deadline:
                if sub.poll(100):
                    ((_, events),) = _batches([sub.recv_multipart()])
                    cleared = {"type": "AllBlocksCleared"} in events
            assert cleared
    finally:
        sub.close(0)


# --------------------------------------------------------------------------
# Metrics beside kvd-ctl


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_match_kvd_ctl_stats_at_the_same_moment(start: Callable[..., Daemon]) -> None:
    daemon = start({"metrics.enabled": "true", "metrics.port": "0"})
    url = daemon.log_event("metrics_listening")["url"]
    daemon.log_event("ready")
    prompt = np.arange(100, dtype=np.int32)
    with Client.connect(daemon.address) as kv:
        kv.allocate("a", prompt).commit()
        kv.allocate("b", prompt)  # a prefix hit
        with pytest.raises(OutOfBlocks):
            kv.allocate("huge", np.arange(70 * BS, dtype=np.int32))
        stats = _ctl(daemon.address, "stats", "--json")
        metrics = _scrape(url)
    blocks = stats["blocks"]["default"]
    for state in ("free", "evictable", "in_use"):
        key = ("kvd_pool_blocks", (("pool", "default"), ("state", state)))
        assert metrics[key] == blocks[state], state
    prefix = stats["prefix"]["default"]
    labels = (("namespace", ""), ("pool", "default"))
    assert metrics[("kvd_prefix_queries_total", labels)] == prefix["queries"] >= 2
    assert metrics[("kvd_prefix_hit_tokens_total", labels)] == prefix["hit_tokens"] == 96
    refusals = stats["admission"]["refusals"]
    assert refusals["OUT_OF_BLOCKS"] == 1
    for code, count in refusals.items():
        assert metrics[("kvd_admission_refusals_total", (("code", code),))] == count
    assert metrics[("kvd_sessions", ())] == stats["clients"]["sessions"] == 1
