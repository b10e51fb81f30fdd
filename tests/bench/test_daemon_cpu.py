"""bench.daemon's CPU split: the daemon's threads read from /proc."""

from __future__ import annotations

import os
import threading
import time

from bench.daemon import thread_cpu


def _spin_then_wait(seconds: float, spun: threading.Event, leave: threading.Event) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    spun.set()
    leave.wait()  # alive while measured: an ended thread leaves /proc/PID/task


def test_thread_cpu_counts_the_cpu_of_a_live_thread() -> None:
    before = thread_cpu(os.getpid())
    assert set(before) == {"python", "zmq"}
    spun, leave = threading.Event(), threading.Event()
    worker = threading.Thread(target=_spin_then_wait, args=(0.1, spun, leave))
    worker.start()
    try:
        assert spun.wait(timeout=30)
        assert thread_cpu(os.getpid())["python"] - before["python"] >= 0.05
    finally:
        leave.set()
        worker.join()
