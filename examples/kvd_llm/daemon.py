"""Start a private kvd daemon whose one pool fits a model's layout.

Used by the demo (when no daemon with a matching pool is running) and by
the example tests: a real ``kvd`` process on an ``ipc://`` socket in a
fresh temporary directory, stopped (SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvd_client import Client, KvdError
from kvd_client.wire import PoolLayout

__all__ = ["kvd_command", "pool_matches", "private_daemon"]


def kvd_command() -> list[str]:
    """The ``kvd`` executable of this interpreter's environment (else the one on PATH)."""
    beside = Path(sys.executable).with_name("kvd")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("kvd")
    if found is None:
        raise FileNotFoundError("no kvd executable beside the interpreter or on PATH")
    return [found]


def _config(address: str, pool: str, layout: PoolLayout) -> str:
    return f"""\
[server]
address = "{address}"
drain_timeout_s = 1.0

[metrics]
enabled = false

[[pools]]
name = "{pool}"
backend = "shm"
num_layers = {layout.num_layers}
num_kv_heads = {layout.num_kv_heads}
head_dim = {layout.head_dim}
dtype = "{layout.dtype}"
block_size = {layout.block_size}
num_blocks = {layout.num_blocks}
order = "{layout.order}"
"""


def pool_matches(address: str, pool: str, layout: PoolLayout, timeout: float = 0.5) -> bool:
    """Whether a daemon answers at ``address`` and hosts ``pool`` with exactly ``layout``."""
    try:
        with Client.connect(address, pool=pool, name="kvd-llm-probe", timeout=timeout) as kv:
            return bool(kv.layout == layout)
    except KvdError:  # nothing there (DaemonUnavailable), no such pool, another layout
        return False


@contextmanager
def private_daemon(
    layout: PoolLayout, pool: str = "default", *, startup_timeout: float = 20.0
) -> Iterator[str]:
    """Run ``kvd`` with one pool of ``layout``; yields its address.

    Raises RuntimeError with the daemon's log when it exits or does not
    answer within ``startup_timeout`` seconds.
    """
    tmp = Path(tempfile.mkdtemp(prefix="kvd-llm-"))
    address = f"ipc://{tmp / 'kvd.sock'}"
    config = tmp / "kvd.toml"
    config.write_text(_config(address, pool, layout))
    log = (tmp / "kvd.log").open("wb")
    proc = subprocess.Popen(
        [*kvd_command(), "--config", str(config), "--log-format", "json"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        # KVD_* variables override the config file: none of the caller's may leak in.
        env={k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
    )
    try:
        deadline = time.monotonic() + startup_timeout
        while not pool_matches(address, pool, layout, timeout=0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError(
                    f"kvd did not come up at {address} (exit {proc.poll()}):\n"
                    + (tmp / "kvd.log").read_text(errors="replace")[-4000:]
                )
            time.sleep(0.05)
        yield address
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
