"""Helpers shared by the benchmarks: the figure-beside-anchor table, percentiles, a daemon.

Every benchmark reports `Figure` rows: a measured value, the anchor measured in the
same run, their ratio (or difference, for percentages) and whether the target is met.
Nothing here asserts on time; the table is the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "RESULTS_DIR",
    "DaemonProcess",
    "Figure",
    "machine",
    "percentile",
    "print_table",
    "run_daemon",
    "write_results",
]


#: Where ``--json`` results go (git-ignored); the committed plots live here too.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured figure beside its anchor.

    ``compare="ratio"``: the score is ``value / anchor`` and the target a ratio
    (``>= 3.0`` for throughput, ``<= 1.5`` for latency). ``compare="points"``: both
    are fractions in [0, 1] and the score is their difference in percentage points
    (``>= 0.0``: at least the anchor; ``>= -5.0``: within 5 points below it).
    """

    name: str
    value: float
    unit: str
    anchor_name: str
    anchor: float
    target: float
    higher_is_better: bool = True
    compare: Literal["ratio", "points"] = "ratio"
    note: str = field(default="", compare=False)

    @property
    def score(self) -> float:
        """``value / anchor`` (ratio) or ``100 * (value - anchor)`` (points)."""
        if self.compare == "points":
            return 100.0 * (self.value - self.anchor)
        return self.value / self.anchor if self.anchor else float("inf")

    @property
    def met(self) -> bool:
        """Whether the score is on the right side of the target."""
        return self.score >= self.target if self.higher_is_better else self.score <= self.target

    def describe_target(self) -> str:
        """The target as printed, e.g. ``>= 3.00x`` or ``>= -5.0 pt``."""
        op = ">=" if self.higher_is_better else "<="
        if self.compare == "points":
            return f"{op} {self.target:+.1f} pt"
        return f"{op} {self.target:.2f}x"

    def describe_score(self) -> str:
        """The score as printed, e.g. ``3.41x`` or ``-2.3 pt``."""
        if self.compare == "points":
            return f"{self.score:+.1f} pt"
        return f"{self.score:.2f}x"


def _fmt(value: float, unit: str) -> str:
    if unit == "%":
        return f"{100 * value:.2f} %"
    if abs(value) >= 100:
        return f"{value:,.0f} {unit}"
    return f"{value:.3g} {unit}"


def print_table(title: str, figures: Sequence[Figure]) -> None:
    """Print ``figures`` as an aligned table: figure, anchor, score, target, met."""
    header = ("figure", "value", "anchor", "anchor value", "score", "target", "met")
    rows = [
        (
            f.name,
            _fmt(f.value, f.unit),
            f.anchor_name,
            _fmt(f.anchor, f.unit),
            f.describe_score(),
            f.describe_target(),
            "yes" if f.met else "NO",
        )
        for f in figures
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    for f in figures:
        if f.note:
            print(f"  note ({f.name}): {f.note}")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated like numpy's default."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError("q must lie in [0, 100]")
    return _interpolate(sorted(values), q)


def _interpolate(ordered: Sequence[float], q: float) -> float:
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def machine() -> str:
    """One line naming the machine: CPU model, cores, Python, date."""
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.CalledProcessError):
        pass
    cores = os.cpu_count() or 0
    today = time.strftime("%Y-%m-%d")
    return f"{model}, {cores} cores, Python {platform.python_version()}, {today}"


def write_results(name: str, figures: Sequence[Figure], extra: dict[str, object]) -> Path:
    """Write ``figures`` and ``extra`` to ``bench/results/<name>.json``; return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    data = {
        "machine": machine(),
        "figures": [{**asdict(f), "score": f.score, "met": f.met} for f in figures],
        **extra,
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


@dataclass(slots=True)
class DaemonProcess:
    """A ``kvd`` daemon started by `run_daemon`.

    ``ready_seconds``: from spawning the process to its ``ready`` log event (pools
    allocated, socket bound); ``events``: the JSON log events read until then.
    """

    address: str
    proc: subprocess.Popen[str]
    ready_seconds: float
    events: list[dict[str, Any]]

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self.proc.pid

    def event(self, name: str) -> dict[str, Any]:
        """The first start-up log event called ``name``."""
        for ev in self.events:
            if ev.get("event") == name:
                return ev
        raise KeyError(name)


def _toml(value: object) -> str:
    """``value`` (bool, int, float or str) as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


@contextlib.contextmanager
def run_daemon(
    pool: Mapping[str, object],
    *,
    timeout: float = 60.0,
    sections: Mapping[str, Mapping[str, object]] | None = None,
) -> Iterator[DaemonProcess]:
    """Run ``kvd`` with one pool on a fresh ipc:// socket until the block ends.

    ``pool`` holds the ``[[pools]]`` keys of ``config/kvd.toml`` that differ from the
    defaults (e.g. ``{"num_blocks": 8192}``), and ``sections`` other tables by dotted
    name (e.g. ``{"tiers.remote": {"url": ...}}``), written with metrics off (no port to
    collide on) to a config file in a temporary directory that also holds the
    socket. The daemon is this interpreter's ``python -m kvd.cli``, logging JSON to a
    pipe that is read until its ``ready`` event and drained after. On leaving,
    SIGTERM (a graceful drain), then SIGKILL after 15 s, then any pool file the
    daemon reported is removed if it is still there. Raises RuntimeError with the
    daemon's last lines if it dies or is not ready within ``timeout`` seconds.
    """
    tmp = Path(tempfile.mkdtemp(prefix="kvd-bench-"))
    address = f"ipc://{tmp}/kvd.sock"
    config = tmp / "kvd.toml"
    lines_toml = ["[metrics]", "enabled = false", "", "[[pools]]", 'name = "default"']
    lines_toml += [f"{k} = {_toml(v)}" for k, v in pool.items() if k != "name"]
    for table, keys in (sections or {}).items():
        lines_toml += ["", f"[{table}]", *(f"{k} = {_toml(v)}" for k, v in keys.items())]
    config.write_text("\n".join(lines_toml) + "\n")
    args = [sys.executable, "-m", "kvd.cli", "--config", str(config), "--address", address]
    args += ["--log-format", "json"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    events: list[dict[str, Any]] = []
    tail: list[str] = []
    try:
        deadline = t0 + timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                raise RuntimeError(f"kvd not ready after {timeout} s: {tail[-5:]}") from None
            if line is None:
                raise RuntimeError(f"kvd exited with {proc.wait()}: {tail[-5:]}")
            tail.append(line.rstrip())
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            events.append(ev)
            if ev.get("event") == "ready":
                break
        ready = time.perf_counter() - t0
        yield DaemonProcess(address, proc, ready, events)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # A daemon that was killed leaves its pool files: remove the ones it reported.
        for ev in events:
            if ev.get("event") == "pool_ready" and isinstance(ev.get("path"), str):
                Path(ev["path"]).unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
