"""kvd.server.stats: histogram quantiles within their error bound, windows that follow load."""

from __future__ import annotations

import random

from kvd.server.stats import LatencyHistogram, RpcStats


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_quantiles_within_one_sixteenth() -> None:
    rng = random.Random(7)
    values = sorted(rng.randint(1, 10_000_000) for _ in range(20_000))
    hist = LatencyHistogram()
    for v in values:
        hist.record(v)
    for q in (0.5, 0.9, 0.99):
        exact = values[int(q * (len(values) - 1))]
        got = hist.quantile(q)
        assert got is not None
        assert abs(got - exact) <= exact / 16


def test_small_values_are_exact() -> None:
    hist = LatencyHistogram()
    for v in (0, 1, 2, 3):
        hist.record(v)
    assert hist.quantile(0.0) == 0.0
    assert hist.quantile(1.0) == 3.0


def test_empty_histogram_has_no_quantile() -> None:
    assert LatencyHistogram().quantile(0.5) is None


def test_merge_adds_counts() -> None:
    a, b = LatencyHistogram(), LatencyHistogram()
    a.record(100)
    b.record(100_000)
    merged = a.merge(b)
    assert merged.count == 2
    assert a.count == 1


def test_section_counts_requests_ops_errors_and_kinds() -> None:
    clock = Clock()
    rpc = RpcStats(clock=clock)
    rpc.record("PING", 50_000)
    rpc.record("BATCH", 80_000, ops=10)
    rpc.error("NOT_FOUND")
    clock.now = 2.0
    s = rpc.section()
    assert (s["requests"], s["ops"]) == (2, 11)
    assert s["errors"] == {"NOT_FOUND": 1}
    assert s["kinds"] == {"BATCH": 1, "PING": 1}
    assert s["ops_per_s"] == 5.5
    assert 45 <= s["latency_p50_us"] <= 85


def test_latency_follows_the_recent_window() -> None:
    clock = Clock()
    rpc = RpcStats(window_s=10.0, clock=clock)
    for _ in range(100):
        rpc.record("PING", 1_000_000)  # 1 ms, long ago
    clock.now = 25.0  # more than two windows later
    for _ in range(100):
        rpc.record("PING", 10_000)  # 10 µs now
    s = rpc.section()
    assert s["latency_p99_us"] is not None
    assert s["latency_p99_us"] < 20
    assert s["requests"] == 200


def test_idle_daemon_reports_no_latency() -> None:
    clock = Clock()
    rpc = RpcStats(window_s=10.0, clock=clock)
    rpc.record("PING", 10_000)
    clock.now = 30.0
    s = rpc.section()
    assert s["latency_p50_us"] is None
    assert s["ops_per_s"] == 0.0
