"""Soak: random client work with random client kills and daemon restarts, then a leak check.

    .venv/bin/python tests/soak/soak.py --duration 600 [--workers 8] [--seed 1] [--json OUT]

A real daemon (a 64-block pool on a private ipc socket) serves ``--workers``
processes of ``tests/faults/worker.py``, each looping random valid operations
(allocate, commit, append, fork, truncate, free, pin, unpin, can_allocate,
heartbeat) and checking that the KV it reads back is what the token prefix
determines. The driver SIGKILLs a random worker about ``--kill-rate`` times
a second and starts a new one in its place, and restarts the daemon twice:
once gracefully (SIGTERM, drain, new daemon) at 40 % of the run, once by
SIGKILL (the next daemon removes the stale socket and segment) at 70 %.
Workers re-attach on their own. CHECK runs every second.

At the end every worker is killed, and the run passes when:

- CHECK passed every time, and the last daemon holds no session, no
  sequence, no reservation, and ``free + evictable + pinned == total``
  (``leaked blocks``, the difference, is 0; pinned is 0 once pins are gone);
- no worker saw an error that valid operations must never get (INTERNAL,
  INVALID, NOT_FOUND, EXISTS, TOO_LARGE, ...) nor an integrity mismatch;
- no request timed out outside the restart windows (a daemon that stops
  answering while alive);
- the anonymous RSS of each daemon grew by at most ``--rss-bound-mib``
  between its warm-up sample and its last sample (see docs/reliability.md
  for why 16 MiB), and its open file descriptors by at most one per worker
  (a live session holds a pidfd; a leaked pidfd or socket shows here).
  The warm-up sample is the first one taken once every worker holds a
  session on that daemon: each attached worker adds a socket and a pidfd,
  so a baseline taken while slow-starting workers were still importing
  would count their attachment as growth.

Prints a summary (operations, kills, restarts, errors by code, leaked blocks,
RSS) and exits 0 on a pass, 1 otherwise. The daemon runs with its default
pressure thresholds, so notices go out throughout the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from kvd_client import wire

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "faults"))
from worker import COUNTERS, make_counter_file  # noqa: E402

WORKER = ROOT / "tests" / "faults" / "worker.py"
#: Codes a worker doing valid operations may meet: capacity, restarts, drains, a dead daemon.
EXPECTED = {"OUT_OF_BLOCKS", "SESSION_LOST", "SHUTTING_DOWN", "UNAVAILABLE"}
POOL = {
    "pools.0.num_blocks": "64",
    "pools.0.num_layers": "2",
    "pools.0.num_kv_heads": "2",
    "pools.0.head_dim": "16",
    "pools.0.block_size": "16",
    "metrics.enabled": "false",
    "server.drain_timeout_s": "2",
}
#: Worker request time-out (s); a restart window lasts until this long after the new daemon is up.
WORKER_TIMEOUT = 3.0


def call(address: str, req: wire.Request, timeout_ms: int = 5000) -> Any:
    """One request on a fresh DEALER; the decoded reply, None on time-out."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(req.encode())
        if not sock.poll(timeout_ms):
            return None
        return wire.decode_reply(sock.recv_multipart())
    finally:
        sock.close(0)


def rss_anon_kib(pid: int) -> int | None:
    """The process's anonymous resident memory (heap; not the mapped pool file)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    """How many file descriptors the process holds (sockets, pidfds, the pool file)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class Daemon:
    """One kvd subprocess."""

    def __init__(
        self, address: str, workdir: Path, overrides: dict[str, str], n: int, workers: int
    ) -> None:
        args = ["--address", address, "--log-format", "json"]
        for key, value in overrides.items():
            args += ["--set", f"{key}={value}"]
        self.address = address
        self.log_path = workdir / f"kvd-{n}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvd.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={k: v for k, v in os.environ.items() if not k.startswith("KVD_")},
            )
        self.workers = workers
        #: Samples taken once every worker held a session here (see `sample_rss`).
        self.rss: list[tuple[float, int]] = []
        self.fds: list[tuple[float, int]] = []
        self.attached = False
        self.started = time.monotonic()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvd exited with {self.proc.returncode}: {self.log_path}")
            if isinstance(call(self.address, wire.PingRequest(id=1), 200), wire.OkReply):
                self.started = time.monotonic()
                return
        raise RuntimeError(f"kvd did not answer within {timeout} s: {self.log_path}")

    def info(self, req: wire.Request) -> dict[str, Any]:
        reply = call(self.address, req)
        if not isinstance(reply, wire.OkReply):
            raise RuntimeError(f"{type(req).__name__}: {reply}")
        return reply.result

    def sample_rss(self) -> None:
        """Sample the anonymous RSS and the open file descriptors.

        Nothing is recorded until every worker has held a session here at once:
        until then the count grows by the workers' own sockets and pidfds.
        """
        if not self.attached:
            reply = call(self.address, wire.ClientsRequest(id=1), 1000)
            if not isinstance(reply, wire.OkReply):
                return
            self.attached = len(reply.result["info"]["sessions"]) >= self.workers
            if not self.attached:
                return
        at = time.monotonic() - self.started
        kib, fds = rss_anon_kib(self.proc.pid), open_fds(self.proc.pid)
        if kib is not None:
            self.rss.append((at, kib))
        if fds is not None:
            self.fds.append((at, fds))

    @staticmethod
    def growth(samples: list[tuple[float, int]], warmup_s: float) -> tuple[int, int, int] | None:
        """(warm-up sample, last sample, growth); None when it never warmed up."""
        warm = [v for t, v in samples if t >= warmup_s]
        if len(warm) < 2:
            return None
        return warm[0], warm[-1], warm[-1] - warm[0]


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="kvd-soak-", dir="/tmp"))
        self.address = f"ipc://{self.workdir / 'kvd.sock'}"
        self.stats = self.workdir / "counters.bin"
        self.slots = args.workers
        make_counter_file(self.stats, self.slots)
        self.overrides = dict(POOL)
        self.daemons: list[Daemon] = []
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.kills = 0
        self.client_starts = 0
        self.restarts: Counter[str] = Counter()
        self.checks = 0
        self.failed_checks: list[Any] = []
        #: Time-outs and slow requests during restarts (expected there).
        self.in_windows: Counter[str] = Counter()
        self.daemon_exits: list[int] = []

    # -- processes ------------------------------------------------------------

    @property
    def daemon(self) -> Daemon:
        return self.daemons[-1]

    def start_daemon(self) -> None:
        daemon = Daemon(self.address, self.workdir, self.overrides, len(self.daemons), self.slots)
        self.daemons.append(daemon)
        daemon.wait_ready()

    def start_worker(self, slot: int) -> None:
        self.workers[slot] = subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "--address",
                self.address,
                "--slot",
                str(slot),
                "--seed",
                str(self.rng.randrange(2**31)),
                "--stats",
                str(self.stats),
                "--timeout",
                str(WORKER_TIMEOUT),
            ],
            stdout=subprocess.DEVNULL,
            cwd=ROOT,
        )
        self.client_starts += 1

    def kill_worker(self, slot: int) -> None:
        proc = self.workers[slot]
        proc.kill()
        proc.wait()

    def counts(self) -> dict[str, int]:
        rows = np.fromfile(self.stats, dtype=np.int64).reshape(-1, len(COUNTERS))
        return {n: int(v) for n, v in zip(COUNTERS, rows.sum(axis=0), strict=True) if v}

    def restart_daemon(self, how: str) -> None:
        """Restart the daemon (``term``: graceful, ``kill``: SIGKILL), counting the time-outs."""
        before = self.counts()
        old = self.daemon
        if how == "term":
            old.proc.send_signal(signal.SIGTERM)
            self.daemon_exits.append(old.proc.wait(60))
        else:
            old.proc.kill()
            old.proc.wait()
        self.start_daemon()
        self.restarts[how] += 1
        self.settle(WORKER_TIMEOUT + 1.0)
        after = self.counts()
        for name in ("err.UNAVAILABLE", "slow"):
            self.in_windows[name] += after.get(name, 0) - before.get(name, 0)

    def settle(self, seconds: float) -> None:
        """Keep sampling while the workers run on (no kills)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.daemon.sample_rss()
            time.sleep(0.25)

    def check(self) -> None:
        self.checks += 1
        result = self.daemon.info(wire.CheckRequest(id=1))
        if not result["ok"]:
            self.failed_checks.append(result["problems"])

    # -- the run --------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        args = self.args
        self.start_daemon()
        for slot in range(self.slots):
            self.start_worker(slot)
        # The run starts once every worker is attached (starting one takes seconds
        # on a loaded machine), so the first daemon gets its warm-up sample too.
        deadline = time.monotonic() + 60
        while not self.daemon.attached:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.slots} workers did not all attach within 60 s")
            self.daemon.sample_rss()
            time.sleep(0.1)
        t0 = time.monotonic()
        end = t0 + args.duration
        restarts = [(t0 + 0.4 * args.duration, "term"), (t0 + 0.7 * args.duration, "kill")]
        next_kill = t0 + self.rng.expovariate(args.kill_rate)
        next_check = t0 + 1.0
        while (now := time.monotonic()) < end:
            if restarts and now >= restarts[0][0]:
                self.restart_daemon(restarts.pop(0)[1])
                continue
            if now >= next_kill:
                slot = self.rng.randrange(self.slots)
                self.kill_worker(slot)
                self.kills += 1
                self.start_worker(slot)
                next_kill = now + self.rng.expovariate(args.kill_rate)
            if now >= next_check:
                self.check()
                self.daemon.sample_rss()
                next_check = now + 1.0
            time.sleep(0.02)
        for slot in list(self.workers):
            self.kill_worker(slot)
        return self.finish(time.monotonic() - t0)

    def finish(self, elapsed: float) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while self.daemon.info(wire.ClientsRequest(id=1))["info"]["sessions"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.check()
        self.daemon.sample_rss()
        stats = self.daemon.info(wire.StatsRequest(id=1))["info"]
        blocks = stats["blocks"]["default"]
        counts = self.counts()
        errors = {k[4:]: v for k, v in counts.items() if k.startswith("err.")}
        ops = {k[3:]: v for k, v in counts.items() if k.startswith("ok.")}
        warmup = min(5.0, self.args.duration / 10)
        rss = [d.growth(d.rss, warmup) for d in self.daemons]
        fds = [d.growth(d.fds, warmup) for d in self.daemons]
        growth = [g[2] for g in rss if g is not None]
        fd_growth = [g[2] for g in fds if g is not None]
        summary = {
            "duration_s": round(elapsed, 1),
            "workers": self.slots,
            "operations": sum(ops.values()),
            "operations_by_kind": ops,
            "clients_killed": self.kills,
            "client_starts": self.client_starts,
            "connects": counts.get("connects", 0),
            "daemon_restarts": dict(self.restarts),
            "errors_by_code": errors,
            "unexpected_errors": {k: v for k, v in errors.items() if k not in EXPECTED},
            "timeouts_outside_restarts": errors.get("UNAVAILABLE", 0)
            - self.in_windows["err.UNAVAILABLE"],
            "slow_outside_restarts": counts.get("slow", 0) - self.in_windows["slow"],
            "integrity_failures": counts.get("integrity", 0),
            "checks": self.checks,
            "failed_checks": self.failed_checks,
            "final_blocks": blocks,
            "final_sessions": stats["clients"]["sessions"],
            "final_sequences": stats["pools"]["default"]["sequences"],
            "leaked_blocks": blocks["total"]
            - blocks["free"]
            - blocks["evictable"]
            - blocks["pinned"],
            "daemon_requests": stats["rpc"]["requests"],
            "hit_ratio": stats["prefix"]["default"]["hit_ratio"],
            "graceful_exit_codes": self.daemon_exits,
            "rss_anon_kib": [
                None if g is None else {"warm": g[0], "last": g[1], "growth": g[2]} for g in rss
            ],
            "rss_bound_kib": self.args.rss_bound_mib * 1024,
            "open_fds": [
                None if g is None else {"warm": g[0], "last": g[1], "growth": g[2]} for g in fds
            ],
            "fd_bound": self.slots,
        }
        summary["passed"] = (
            not summary["unexpected_errors"]
            and summary["timeouts_outside_restarts"] == 0
            and summary["integrity_failures"] == 0
            and not self.failed_checks
            and summary["leaked_blocks"] == 0
            and blocks["in_use"] == blocks["pinned"] == blocks["reserved"] == 0
            and summary["final_sessions"] == summary["final_sequences"] == 0
            and all(code == 0 for code in self.daemon_exits)
            and all(g <= summary["rss_bound_kib"] for g in growth)
            and all(g <= summary["fd_bound"] for g in fd_growth)
        )
        return summary

    def close(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for daemon in self.daemons:
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGTERM)
                try:
                    daemon.proc.wait(30)
                except subprocess.TimeoutExpired:
                    daemon.proc.kill()
                    daemon.proc.wait()
        if not self.args.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


def render(s: dict[str, Any]) -> str:
    lines = [
        f"soak: {s['duration_s']} s, {s['workers']} workers",
        f"operations performed:   {s['operations']} ({s['daemon_requests']} requests on the "
        f"last daemon, hit ratio {s['hit_ratio']})",
        "  by kind:              "
        + ", ".join(f"{k} {v}" for k, v in sorted(s["operations_by_kind"].items())),
        f"clients killed:         {s['clients_killed']} (client starts {s['client_starts']}, "
        f"connects {s['connects']})",
        f"daemon restarts:        {s['daemon_restarts']} (graceful exit codes "
        f"{s['graceful_exit_codes']})",
        f"errors by code:         {s['errors_by_code']}",
        f"unexpected errors:      {s['unexpected_errors']}",
        f"time-outs outside restarts: {s['timeouts_outside_restarts']} (requests over 1 s: "
        f"{s['slow_outside_restarts']})",
        f"integrity failures:     {s['integrity_failures']}",
        f"CHECK:                  {s['checks']} runs, {len(s['failed_checks'])} failed",
        f"final blocks:           {s['final_blocks']}, sessions {s['final_sessions']}, "
        f"sequences {s['final_sequences']}",
        f"leaked blocks:          {s['leaked_blocks']}",
        f"daemon RssAnon (KiB):   {s['rss_anon_kib']} (bound on growth {s['rss_bound_kib']})",
        f"daemon open fds:        {s['open_fds']} (bound on growth {s['fd_bound']})",
        f"result:                 {'PASS' if s['passed'] else 'FAIL'}",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="kvd soak test (see the module docstring)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kill-rate", type=float, default=1.0, help="client kills per second")
    parser.add_argument("--rss-bound-mib", type=float, default=16.0)
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soak = Soak(args)
    try:
        summary = soak.run()
    finally:
        soak.close()
    print(render(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
