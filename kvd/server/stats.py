"""Cheap request accounting for the ``rpc`` stats section.

Per request the server adds one to a few counters and records its service
time (receive to reply, inside the daemon) in a log-linear histogram:
eight sub-buckets per power of two of nanoseconds, so a quantile is off by
at most 1/16 of its value, with no allocation per request. Quantiles and
the rate cover the last one to two windows (``window_s``), so they follow
the current load rather than the daemon's whole life.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

__all__ = ["LatencyHistogram", "RpcStats"]

_SUB: Final = 8  # sub-buckets per power of two
_SUB_BITS: Final = 3
_MASK: Final = _SUB - 1
_BUCKETS: Final = 64 * _SUB


class LatencyHistogram:
    """Durations in nanoseconds, bucketed log-linearly."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS

    @property
    def count(self) -> int:
        """How many durations it holds (summed when read: recording stays one increment)."""
        return sum(self.counts)

    @staticmethod
    def _index(ns: int) -> int:
        if ns < _SUB:
            return max(ns, 0)
        bits = ns.bit_length()
        return (bits - _SUB_BITS) * _SUB + ((ns >> (bits - 1 - _SUB_BITS)) & _MASK)

    @staticmethod
    def _midpoint(index: int) -> float:
        if index < _SUB:
            return float(index)
        exp, sub = divmod(index, _SUB)
        low = (_SUB + sub) << (exp - 1)
        return low + (1 << (exp - 1)) / 2

    def record(self, ns: int) -> None:
        """Add one duration."""
        self.counts[self._index(ns)] += 1

    def merge(self, other: LatencyHistogram) -> LatencyHistogram:
        """A new histogram holding both."""
        out = LatencyHistogram()
        out.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        return out

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile in nanoseconds (None when empty)."""
        count = self.count
        if not count:
            return None
        rank = q * (count - 1)
        seen = 0
        for index, n in enumerate(self.counts):
            seen += n
            if n and seen > rank:
                return self._midpoint(index)
        return self._midpoint(_BUCKETS - 1)


class RpcStats:
    """Requests, operations, errors by code and service time.

    `record` runs once per request in the request thread, so it is kept to a
    few increments and one clock read: the request count is the sum of the
    per-kind counts, and the histogram's bucket is computed inline.
    """

    def __init__(self, *, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self.ops = 0
        self.errors: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self._window_start = clock()
        self._window_end = self._window_start + window_s
        self._current = LatencyHistogram()
        self._counts = self._current.counts
        self._previous = LatencyHistogram()
        self._ops_current = 0
        self._ops_previous = 0
        self._previous_span = 0.0

    @property
    def requests(self) -> int:
        """Requests recorded since start."""
        return sum(self.kinds.values())

    def _rotate(self, now: float) -> None:
        span = now - self._window_start
        if span < self.window_s:
            return
        if span >= 2 * self.window_s:  # idle for a whole window: the old one is stale
            self._previous, self._ops_previous, self._previous_span = LatencyHistogram(), 0, 0.0
        else:
            self._previous, self._ops_previous = self._current, self._ops_current
            self._previous_span = span
        self._current, self._ops_current = LatencyHistogram(), 0
        self._counts = self._current.counts
        self._window_start = now
        self._window_end = now + self.window_s

    def record(self, kind: str, ns: int, ops: int = 1) -> None:
        """One request of ``kind`` that carried ``ops`` operations took ``ns``."""
        self.kinds[kind] += 1
        self.ops += ops
        if self.clock() >= self._window_end:
            self._rotate(self.clock())
        if ns < _SUB:
            self._counts[max(ns, 0)] += 1
        else:
            bits = ns.bit_length()
            self._counts[(bits - _SUB_BITS) * _SUB + ((ns >> (bits - 1 - _SUB_BITS)) & _MASK)] += 1
        self._ops_current += ops

    def error(self, code: str) -> None:
        """One error reply (or failed batch operation) with ``code``."""
        self.errors[code] += 1

    def section(self) -> dict[str, Any]:
        """The ``rpc`` stats section."""
        now = self.clock()
        self._rotate(now)
        hist = self._current.merge(self._previous)
        span = (now - self._window_start) + self._previous_span
        p50 = hist.quantile(0.5)
        p99 = hist.quantile(0.99)
        return {
            "requests": self.requests,
            "ops": self.ops,
            "ops_per_s": round((self._ops_current + self._ops_previous) / span, 1) if span else 0.0,
            "latency_p50_us": None if p50 is None else round(p50 / 1e3, 1),
            "latency_p99_us": None if p99 is None else round(p99 / 1e3, 1),
            "errors": dict(sorted(self.errors.items())),
            "kinds": dict(sorted(self.kinds.items())),
        }
