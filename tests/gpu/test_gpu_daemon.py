"""A real daemon with a cuda pool, and two client processes sharing its blocks.

The daemon runs as ``python -m kvd.cli`` with a configuration whose pool
is ``backend = "cuda"``; the ``clients`` fixture's processes connect with
`kvd_client.Client`, write K/V into their blocks on the GPU, commit, and
read what the other one wrote through the prefix cache.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_workers import Worker

from kvd.memory.gpuinfo import device_memory

pytestmark = pytest.mark.cuda

GiB = 1 << 30
BLOCK_SIZE = 16
POOL = """
[metrics]
enabled = false

[memory]
headroom_bytes = {headroom}

[[pools]]
name = "{name}"
backend = "cuda"
num_layers = 4
num_kv_heads = 4
head_dim = 64
dtype = "float32"
block_size = 16
num_blocks = {num_blocks}
"""
#: Bytes of one block over all layers of `POOL`: 4 layers x K,V x 16 x 4 x 64 x 4 bytes.
BLOCK_BYTES = 4 * 2 * 16 * 4 * 64 * 4


def start_daemon(
    tmp: Path, name: str, num_blocks: int, headroom: int = GiB
) -> tuple[subprocess.Popen[bytes], str]:
    config = tmp / f"{name}.toml"
    config.write_text(POOL.format(name=name, num_blocks=num_blocks, headroom=headroom))
    address = f"ipc://{tmp}/{name}.sock"
    log = (tmp / f"{name}.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvd.cli",
            "--config",
            str(config),
            "--address",
            address,
            "--log-format",
            "json",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return proc, address


def daemon_log(tmp: Path, name: str) -> str:
    return (tmp / f"{name}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def daemon() -> Iterator[tuple[str, Path]]:
    # Short: a Unix socket path holds at most 107 bytes, whatever TMPDIR is.
    tmp = Path(tempfile.mkdtemp(prefix="kvdg-", dir="/tmp"))
    proc, address = start_daemon(tmp, "gpu", num_blocks=2048)
    try:
        yield address, tmp
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def connected(
    daemon: tuple[str, Path], clients: tuple[Worker, Worker]
) -> Iterator[tuple[Worker, Worker]]:
    address, tmp = daemon
    try:
        for c in clients:
            assert c.call("connect", address, "gpu")["backend"] == "cuda"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\ndaemon log:\n{daemon_log(tmp, 'gpu')}") from None
    yield clients
    for c in clients:
        c.call("close", "gpu")


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 32000 for i in range(n)]


def test_two_clients_read_each_others_kv_through_the_prefix_cache(
    connected: tuple[Worker, Worker],
) -> None:
    a, b = connected
    prompt = tokens(20 * BLOCK_SIZE + 5, seed=1)
    first = a.call("prefill", "gpu", "a-1", prompt, True)
    assert first["cached"] == 0
    seen = b.call("verify", "gpu", "b-1", prompt)
    assert seen["cached"] == 20 * BLOCK_SIZE
    assert seen["bad"] == 0
    assert seen["table"][:20] == first["table"][:20]


def test_a_longer_prompt_extends_what_the_other_client_wrote(
    connected: tuple[Worker, Worker],
) -> None:
    a, b = connected
    prompt = tokens(40 * BLOCK_SIZE + 1, seed=2)
    a.call("prefill", "gpu", "a-2", prompt[: 10 * BLOCK_SIZE + 1], True)
    grown = b.call("prefill", "gpu", "b-2", prompt, True)
    assert grown["cached"] == 10 * BLOCK_SIZE
    back = a.call("verify", "gpu", "a-3", prompt)
    assert back["cached"] == 40 * BLOCK_SIZE
    assert back["bad"] == 0


def test_a_pool_larger_than_free_memory_is_refused_and_nobody_fails(
    daemon: tuple[str, Path], connected: tuple[Worker, Worker]
) -> None:
    _, tmp = daemon
    free = device_memory(0).free
    proc, _ = start_daemon(tmp, "too-big", num_blocks=(free + GiB) // BLOCK_BYTES)
    try:
        status = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(
            f"a daemon with a pool larger than the GPU kept running:\n{daemon_log(tmp, 'too-big')}"
        )
    log = daemon_log(tmp, "too-big")
    assert status == 1, log
    assert "Traceback" not in log, log
    assert "too-big" in log
    assert "free" in log and "headroom" in log, log
    assert device_memory(0).free >= free - GiB // 4
    # The daemon already running and its clients carry on.
    a, b = connected
    prompt = tokens(8 * BLOCK_SIZE + 3, seed=3)
    a.call("prefill", "gpu", "a-4", prompt, True)
    assert b.call("verify", "gpu", "b-4", prompt)["bad"] == 0
