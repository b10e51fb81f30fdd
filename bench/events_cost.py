"""What KV events cost: requests/s through the daemon with events on beside events off.

Two daemons run side by side, identical but for ``events.enabled`` (the
events one has a live subscriber draining its PUB socket, as a router
would). One client process drives each in turn, round after round, so both
see the same machine load: per prompt it allocates (a shared system prompt
plus a unique tail: prefix hits and misses), commits and frees, three round
trips. When the pool is full, evictions add ``BlockRemoved`` events. The
figure is the median requests/s over the rounds, events on beside off.

    .venv/bin/python -m bench.events_cost [--rounds 5] [--prompts 300]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import zmq
from kvd_client import Client
from kvd_client.errors import DaemonUnavailable

from bench._common import Figure, print_table

ROOT = Path(__file__).resolve().parents[1]
#: A small model layout (the cost measured is the control path, not the bytes).
POOL = {
    "pools.0.num_layers": "2",
    "pools.0.num_kv_heads": "2",
    "pools.0.head_dim": "64",
    "pools.0.num_blocks": "2048",
}


@contextlib.contextmanager
def _daemon(workdir: Path, name: str, events: bool) -> Iterator[str]:
    """A kvd daemon with events on or off; yields its address."""
    address = f"ipc://{workdir / name}.sock"
    settings = POOL | {
        "metrics.enabled": "false",
        "events.enabled": "true" if events else "false",
        "events.endpoint": f"ipc://{workdir / name}-ev.sock",
        "events.replay_endpoint": f"ipc://{workdir / name}-replay.sock",
    }
    args = [sys.executable, "-m", "kvd.cli", "--address", address, "--log-format", "json"]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVD_", "NOTIFY_"))}
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with Client.connect(address, pool=None, timeout=0.5) as kv:
                    kv.ping()
                break
            except DaemonUnavailable:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvd ({name}) did not start") from None
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _subscriber(endpoint: str, stop: threading.Event, counts: list[int]) -> None:
    """Drain a PUB endpoint like a router would, counting batches."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    try:
        while not stop.is_set():
            if sock.poll(50):
                sock.recv_multipart()
                counts[0] += 1
    finally:
        sock.close(0)


def _round(kv: Client, prompts: list[np.ndarray], tag: str) -> float:
    """Requests/s of allocate + commit + free for every prompt."""
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        seq = kv.allocate(f"{tag}-{i}", prompt)
        seq.commit()
        seq.free()
    return 3 * len(prompts) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print both figures and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=300, help="prompts per round")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    systems = [rng.integers(0, 50_000, 512, dtype=np.int32) for _ in range(4)]
    workdir = Path(tempfile.mkdtemp(prefix="kvd-evb-", dir="/tmp"))
    stop = threading.Event()
    batches = [0]
    try:
        with _daemon(workdir, "on", True) as on, _daemon(workdir, "off", False) as off:
            sub = threading.Thread(
                target=_subscriber, args=(f"ipc://{workdir / 'on'}-ev.sock", stop, batches)
            )
            sub.start()
            rates: dict[str, list[float]] = {"on": [], "off": []}
            with (
                Client.connect(on, name="bench-on") as kv_on,
                Client.connect(off, name="bench-off") as kv_off,
            ):
                for r in range(args.rounds + 1):  # round 0 warms both up
                    prompts = [
                        np.concatenate(
                            (systems[i % 4], rng.integers(0, 50_000, 96, dtype=np.int32))
                        )
                        for i in range(args.prompts)
                    ]
                    order = [("on", kv_on), ("off", kv_off)]
                    for name, kv in order if r % 2 else order[::-1]:
                        rate = _round(kv, prompts, f"r{r}")
                        if r:
                            rates[name].append(rate)
            stop.set()
            sub.join()
    finally:
        stop.set()
        shutil.rmtree(workdir, ignore_errors=True)
    on_rate, off_rate = statistics.median(rates["on"]), statistics.median(rates["off"])
    print_table(
        f"KV events cost ({args.rounds} rounds x {args.prompts} prompts, allocate+commit+free)",
        [
            Figure(
                name="events on (requests/s)",
                value=on_rate,
                unit="req/s",
                anchor_name="events off",
                anchor=off_rate,
                target=0.9,
            )
        ],
    )
    print(
        f"events on {on_rate:.0f} req/s, off {off_rate:.0f} req/s, "
        f"ratio on/off {on_rate / off_rate:.3f}; subscriber received {batches[0]} batches"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
