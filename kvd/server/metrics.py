"""Prometheus metrics on a localhost HTTP endpoint, from the same figures as ``kvd-ctl stats``.

Wiring::

    server = start_metrics_server("127.0.0.1", 9464, loop_snapshot(daemon.stats))
    ...
    t0 = time.perf_counter()                    # per request
    ...handle...
    server.observe("allocate", time.perf_counter() - t0)
    ...
    await anyio.to_thread.run_sync(server.close)  # at shutdown (returns within 0.05 s)

The server runs in its own thread on its own registry (never the global one),
so a scrape never waits on the event loop except for the snapshot itself.
Gauges and counters are read at scrape time from ``snapshot()``, the nested
dict that ``kvd-ctl stats --json`` shows, so both report the same figures for
the same moment. ``snapshot`` is called on the metrics thread: wrap a function
of the event loop with `loop_snapshot` (it runs it on the loop and waits).
A snapshot that raises is logged and reported as ``kvd_stats_up 0``.

The snapshot shape read here (absent sections or keys are skipped, extra ones
ignored; numbers are ints or floats)::

    {
      "pools": {
        "<pool>": {
          "blocks": {"total": n, "free": n, "evictable": n, "in_use": n, "pinned": n},
          "prefix": {
            "queries": n, "query_tokens": n, "hit_tokens": n, "evictions": n,
            "namespaces": {"<namespace>": {"queries": n, "query_tokens": n, "hit_tokens": n}},
          },
        },
      },
      "admission": {"refusals": {"<CODE>": n}},
      "clients": {"sessions": n},
      "events": {"batches": n, "events": n, "replays": n, "replays_refused": n},  # optional
      "tiers": {"<pool>": {"pool": "<pool>", "tier": 1, "blocks": n, "capacity": n,
                           "bytes": n, "hits": n, "promotions": n, "demotions": n,
                           "lost": n, "evictions": n, "errors": n,
                           "bytes_moved": n,                  # optional: kvd.server.tiers
                           "store_errors": {"<CODE>": n}},    # tier 2 (remote) only
                "<pool>@tier2": {"pool": "<pool>", "tier": 2, ...}},  # a chain's tier 2
    }

Prefix counters are per namespace from ``prefix.namespaces``; a pool without
that map reports its pool-wide totals under ``namespace=""``.

Metric names (all ``kvd_``; counters end in ``_total``):

=========================================  =========  =======================================
name                                       type       labels / meaning
=========================================  =========  =======================================
kvd_pool_blocks                            gauge      pool, state=free|evictable|in_use
kvd_pool_pinned_blocks                     gauge      pool (pinned blocks are also in_use)
kvd_pool_capacity_blocks                   gauge      pool
kvd_prefix_queries_total                   counter    pool, namespace: prefix lookups
kvd_prefix_query_tokens_total              counter    pool, namespace: tokens looked up
kvd_prefix_hit_tokens_total                counter    pool, namespace: tokens served from cache
kvd_evictions_total                        counter    pool: cached blocks evicted
kvd_admission_refusals_total               counter    code: refused requests
kvd_sessions                               gauge      connected client sessions
kvd_events_total                           counter    KV events published
kvd_event_batches_total                    counter    KV event batches published
kvd_event_replays_total                    counter    replay requests served
kvd_event_replays_refused_total            counter    replay requests refused (too many at once)
kvd_tier_blocks                            gauge      pool, tier: block copies a tier holds
kvd_tier_capacity_blocks                   gauge      pool, tier: a tier's slots
kvd_tier_bytes                             gauge      pool, tier: bytes of the copies held
kvd_tier_hits_total                        counter    pool, tier: blocks found there past the pool
kvd_tier_promotions_total                  counter    pool, tier: blocks copied back into the pool
kvd_tier_demotions_total                   counter    pool, tier: blocks copied in from the pool
kvd_tier_lost_total                        counter    pool, tier: copies voided by an eviction
kvd_tier_evictions_total                   counter    pool, tier: copies dropped for room
kvd_tier_errors_total                      counter    pool, tier: blocks whose copy failed
kvd_tier_bytes_moved_total                 counter    pool, tier: bytes copied, both ways
kvd_tier_store_errors_total                counter    pool, tier, code: a store's failed calls
kvd_request_duration_seconds               histogram  kind: request handling time
kvd_stats_up                               gauge      1 when the last snapshot was read
kvd_build_info                             gauge      version
process_*                                  various    CPU, memory, file descriptors
=========================================  =========  =======================================

`MetricsServer.observe` costs about 0.7 µs (prometheus_client's histogram,
its per-kind child cached here).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any, Final, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import anyio.from_thread
import anyio.lowlevel
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvd import __version__
from kvd.log import get_logger

__all__ = [
    "LATENCY_BUCKETS",
    "Metrics",
    "MetricsServer",
    "Snapshot",
    "loop_snapshot",
    "snapshot_of",
    "start_metrics_server",
]

_log = get_logger(__name__)

T = TypeVar("T")

#: What the collector reads at each scrape.
Snapshot = Callable[[], Mapping[str, Any]]

#: Request latency buckets (seconds): ipc round trips are 0.1-0.3 ms, a batch
#: for a whole scheduler step can take milliseconds.
LATENCY_BUCKETS: Final = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
)

_BLOCK_STATES: Final = ("free", "evictable", "in_use")
_PREFIX_COUNTERS: Final = (
    ("queries", "kvd_prefix_queries", "Prefix-cache lookups."),
    ("query_tokens", "kvd_prefix_query_tokens", "Tokens looked up in the prefix cache."),
    ("hit_tokens", "kvd_prefix_hit_tokens", "Tokens served from the prefix cache."),
)
_EVENT_COUNTERS: Final = (
    ("events", "kvd_events", "KV events published."),
    ("batches", "kvd_event_batches", "KV event batches published."),
    ("replays", "kvd_event_replays", "KV event replay requests served."),
    (
        "replays_refused",
        "kvd_event_replays_refused",
        "KV event replay requests refused: as many replays were in progress as allowed.",
    ),
)

_TIER_GAUGES: Final = (
    ("blocks", "kvd_tier_blocks", "Block copies a tier holds."),
    ("capacity", "kvd_tier_capacity_blocks", "Slots of a tier."),
    ("bytes", "kvd_tier_bytes", "Bytes of the block copies a tier holds."),
)
_TIER_COUNTERS: Final = (
    ("hits", "kvd_tier_hits", "Blocks an allocate found in a tier past the pool's prefix."),
    ("promotions", "kvd_tier_promotions", "Blocks copied from a tier back into the pool."),
    ("demotions", "kvd_tier_demotions", "Blocks copied from the pool into a tier."),
    ("lost", "kvd_tier_lost", "Copies into a tier voided by an eviction before they counted."),
    ("evictions", "kvd_tier_evictions", "Block copies a tier dropped for room."),
    ("errors", "kvd_tier_errors", "Blocks whose copy to or from a tier failed."),
    ("bytes_moved", "kvd_tier_bytes_moved", "Bytes copied between the pool and a tier."),
)


class Metrics:
    """kvd's metrics on a private registry: the snapshot collector and the latency histogram."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._latency = Histogram(
            "kvd_request_duration_seconds",
            "Time to handle one request, by kind.",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._by_kind: dict[str, Any] = {}
        self.registry.register(_SnapshotCollector(snapshot))
        ProcessCollector(registry=self.registry)

    def observe(self, kind: str, seconds: float) -> None:
        """Record one request of ``kind`` that took ``seconds``."""
        child = self._by_kind.get(kind)
        if child is None:
            child = self._by_kind[kind] = self._latency.labels(kind)
        child.observe(seconds)

    def exposition(self) -> bytes:
        """The text exposition a scrape returns (also handy for tests and dumps)."""
        return generate_latest(self.registry)


class MetricsServer:
    """The HTTP endpoint serving `Metrics` from its own thread."""

    def __init__(self, metrics: Metrics, httpd: WSGIServer, thread: threading.Thread) -> None:
        self.metrics = metrics
        self._httpd = httpd
        self._thread = thread
        self.host: str = str(httpd.server_address[0])
        #: The bound port (the ephemeral one when 0 was asked for).
        self.port: int = httpd.server_port
        self.observe = metrics.observe

    @property
    def url(self) -> str:
        """Where to scrape."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (blocks up to `_POLL_INTERVAL`)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def start_metrics_server(host: str, port: int, snapshot: Snapshot) -> MetricsServer:
    """Serve kvd's metrics on ``http://host:port/metrics`` (port 0: an ephemeral port).

    Raises `OSError` when the address cannot be bound (port in use).
    """
    metrics = Metrics(snapshot)
    family, address = _bind_address(host, port)
    server_class = type("_MetricsHTTPServer", (_ThreadingWSGIServer,), {"address_family": family})
    httpd: WSGIServer = make_server(
        address[0],
        address[1],
        make_wsgi_app(metrics.registry),
        server_class=server_class,
        handler_class=_QuietHandler,
    )
    thread = threading.Thread(
        target=httpd.serve_forever,
        kwargs={"poll_interval": _POLL_INTERVAL},
        name="kvd-metrics",
        daemon=True,
    )
    thread.start()
    server = MetricsServer(metrics, httpd, thread)
    _log.info("metrics_listening", url=server.url)
    return server


def snapshot_of(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The daemon's stats (`Info.stats`) reshaped as the collector reads them:
    each pool's blocks and prefix figures nested under ``pools``."""
    pools = {
        name: {"blocks": stats["blocks"][name], "prefix": stats["prefix"][name]}
        for name in stats["pools"]
    }
    optional = ("admission", "clients", "events", "tiers")
    return {"pools": pools} | {key: stats[key] for key in optional if key in stats}


def loop_snapshot(func: Callable[[], T]) -> Callable[[], T]:
    """Make ``func`` callable from other threads by running it on the current event loop.

    Call this from inside the anyio event loop that owns the state ``func``
    reads; the returned callable blocks its (metrics) thread until the loop
    has run ``func``, so the figures are never read mid-update.
    """
    token = anyio.lowlevel.current_token()

    def call() -> T:
        return anyio.from_thread.run_sync(func, token=token)

    return call


#: How often the serving thread checks for `MetricsServer.close`.
_POLL_INTERVAL: Final = 0.05


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """One thread per scrape, so a slow scraper never holds up another."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        # One access line per scrape (every few seconds) would flood the journal.
        return


def _bind_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    """The address family and address to bind ``host`` (a name, IPv4 or IPv6) on."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return family, (str(sockaddr[0]), int(sockaddr[1]))


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        # Nothing to describe ahead: the families depend on the snapshot.
        return ()

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("kvd_build_info", "kvd's version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        up = GaugeMetricFamily("kvd_stats_up", "1 when the daemon's statistics were read.")
        try:
            snap = self._snapshot()
        except Exception:
            _log.exception("metrics_snapshot_failed")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _families(snap)


def _families(snap: Mapping[str, Any]) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(
        "kvd_pool_blocks", "Blocks of a pool by state.", labels=["pool", "state"]
    )
    pinned = GaugeMetricFamily(
        "kvd_pool_pinned_blocks", "Pinned blocks of a pool (also in use).", labels=["pool"]
    )
    capacity = GaugeMetricFamily("kvd_pool_capacity_blocks", "Blocks in a pool.", labels=["pool"])
    prefix = {
        key: CounterMetricFamily(name, doc, labels=["pool", "namespace"])
        for key, name, doc in _PREFIX_COUNTERS
    }
    evictions = CounterMetricFamily(
        "kvd_evictions", "Cached blocks evicted from a pool.", labels=["pool"]
    )
    for pool, stats in _section(snap, "pools").items():
        if not isinstance(stats, Mapping):
            continue
        pool_blocks = _section(stats, "blocks")
        for state in _BLOCK_STATES:
            _add(blocks, [str(pool), state], pool_blocks.get(state))
        _add(pinned, [str(pool)], pool_blocks.get("pinned"))
        _add(capacity, [str(pool)], pool_blocks.get("total"))
        pool_prefix = _section(stats, "prefix")
        namespaces = pool_prefix.get("namespaces")
        if not isinstance(namespaces, Mapping):
            namespaces = {"": pool_prefix}
        for namespace, counts in namespaces.items():
            if isinstance(counts, Mapping):
                for key, family in prefix.items():
                    _add(family, [str(pool), str(namespace)], counts.get(key))
        _add(evictions, [str(pool)], pool_prefix.get("evictions"))
    yield from (blocks, pinned, capacity, *prefix.values(), evictions)

    refusals = CounterMetricFamily(
        "kvd_admission_refusals", "Requests refused, by error code.", labels=["code"]
    )
    for code, count in _section(_section(snap, "admission"), "refusals").items():
        _add(refusals, [str(code)], count)
    yield refusals

    sessions = GaugeMetricFamily("kvd_sessions", "Connected client sessions.")
    _add(sessions, [], _section(snap, "clients").get("sessions"))
    yield sessions

    events = _section(snap, "events")
    if events:
        for key, name, doc in _EVENT_COUNTERS:
            family = CounterMetricFamily(name, doc)
            _add(family, [], events.get(key))
            yield family

    tiers = _section(snap, "tiers")
    if tiers:
        labels = ["pool", "tier"]
        families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [
            (key, GaugeMetricFamily(name, doc, labels=labels)) for key, name, doc in _TIER_GAUGES
        ] + [
            (key, CounterMetricFamily(name, doc, labels=labels))
            for key, name, doc in _TIER_COUNTERS
        ]
        # Keyed by pool, a chain's lower tier by "<pool>@tier<n>": the pool label is its "pool".
        for pool, stats in tiers.items():
            if isinstance(stats, Mapping):
                where = [str(stats.get("pool", pool)), str(stats.get("tier", 1))]
                for key, tier_family in families:
                    _add(tier_family, where, stats.get(key))
        yield from (tier_family for _, tier_family in families)
        # A remote store's failed calls by code (kvd.memory.remote): why its copies failed.
        store_errors = CounterMetricFamily(
            "kvd_tier_store_errors",
            "Failed calls to a tier's store, by error code.",
            labels=[*labels, "code"],
        )
        for pool, stats in tiers.items():
            codes = stats.get("store_errors") if isinstance(stats, Mapping) else None
            for code, count in (codes or {}).items():
                where = [str(stats.get("pool", pool)), str(stats.get("tier", 1))]
                _add(store_errors, [*where, str(code)], count)
        yield store_errors


def _section(mapping: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = mapping.get(key)
    return value if isinstance(value, Mapping) else {}


def _add(family: GaugeMetricFamily | CounterMetricFamily, labels: list[str], value: Any) -> None:
    # bool is an int subclass but never a figure.
    if isinstance(value, int | float) and not isinstance(value, bool):
        family.add_metric(labels, value)
