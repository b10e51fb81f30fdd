"""kvd.server.metrics: scraped over real HTTP and parsed with prometheus_client's parser."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anyio
import anyio.to_thread
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvd import __version__
from kvd.server.metrics import MetricsServer, loop_snapshot, snapshot_of, start_metrics_server

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _snapshot() -> dict[str, Any]:
    return {
        "pools": {
            "llama": {
                "blocks": {"total": 100, "free": 60, "evictable": 25, "in_use": 15, "pinned": 4},
                "prefix": {
                    "queries": 7,
                    "query_tokens": 700,
                    "hit_tokens": 320,
                    "evictions": 11,
                    "namespaces": {
                        "": {"queries": 5, "query_tokens": 500, "hit_tokens": 300},
                        "tenant-a": {"queries": 2, "query_tokens": 200, "hit_tokens": 20},
                    },
                },
            },
            "qwen": {
                "blocks": {"total": 50, "free": 50, "evictable": 0, "in_use": 0, "pinned": 0},
                "prefix": {"queries": 3, "query_tokens": 48, "hit_tokens": 16, "evictions": 0},
            },
        },
        "admission": {"refusals": {"OUT_OF_BLOCKS": 9, "QUOTA_EXCEEDED": 2}},
        "clients": {"sessions": 3},
    }


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[], Mapping[str, Any]]], MetricsServer]]:
    servers: list[MetricsServer] = []

    def start(snapshot: Callable[[], Mapping[str, Any]]) -> MetricsServer:
        server = start_metrics_server("127.0.0.1", 0, snapshot)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _scrape(server: MetricsServer) -> Samples:
    with urllib.request.urlopen(server.url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_block_gauges_per_pool_and_state(serve: Any) -> None:
    samples = _scrape(serve(_snapshot))
    for state, value in (("free", 60), ("evictable", 25), ("in_use", 15)):
        assert samples[("kvd_pool_blocks", (("pool", "llama"), ("state", state)))] == value
    assert samples[("kvd_pool_pinned_blocks", (("pool", "llama"),))] == 4
    assert samples[("kvd_pool_capacity_blocks", (("pool", "llama"),))] == 100
    assert samples[("kvd_pool_blocks", (("pool", "qwen"), ("state", "free")))] == 50


def test_prefix_counters_per_namespace(serve: Any) -> None:
    samples = _scrape(serve(_snapshot))
    llama_a = (("namespace", "tenant-a"), ("pool", "llama"))
    llama_default = (("namespace", ""), ("pool", "llama"))
    assert samples[("kvd_prefix_queries_total", llama_a)] == 2
    assert samples[("kvd_prefix_query_tokens_total", llama_a)] == 200
    assert samples[("kvd_prefix_hit_tokens_total", llama_a)] == 20
    assert samples[("kvd_prefix_hit_tokens_total", llama_default)] == 300
    assert samples[("kvd_evictions_total", (("pool", "llama"),))] == 11


def test_pool_without_namespaces_reports_its_totals_under_the_default_namespace(
    serve: Any,
) -> None:
    samples = _scrape(serve(_snapshot))
    qwen = (("namespace", ""), ("pool", "qwen"))
    assert samples[("kvd_prefix_queries_total", qwen)] == 3
    assert samples[("kvd_prefix_hit_tokens_total", qwen)] == 16


def test_refusals_per_code_and_sessions(serve: Any) -> None:
    samples = _scrape(serve(_snapshot))
    assert samples[("kvd_admission_refusals_total", (("code", "OUT_OF_BLOCKS"),))] == 9
    assert samples[("kvd_admission_refusals_total", (("code", "QUOTA_EXCEEDED"),))] == 2
    assert samples[("kvd_sessions", ())] == 3
    assert samples[("kvd_stats_up", ())] == 1
    assert samples[("kvd_build_info", (("version", __version__),))] == 1


def test_event_counters_only_when_the_section_exists(serve: Any) -> None:
    assert not any(name.startswith("kvd_event") for name, _ in _scrape(serve(_snapshot)))

    def with_events() -> dict[str, Any]:
        return {"events": {"events": 40, "batches": 6, "replays": 2, "replays_refused": 1}}

    samples = _scrape(serve(with_events))
    assert samples[("kvd_events_total", ())] == 40
    assert samples[("kvd_event_batches_total", ())] == 6
    assert samples[("kvd_event_replays_total", ())] == 2
    assert samples[("kvd_event_replays_refused_total", ())] == 1


def test_each_scrape_reads_one_fresh_snapshot(serve: Any) -> None:
    calls = 0

    def snapshot() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return {"clients": {"sessions": calls}}

    server = serve(snapshot)
    assert _scrape(server)[("kvd_sessions", ())] == 1
    assert _scrape(server)[("kvd_sessions", ())] == 2
    assert calls == 2


def test_latency_histogram_per_kind(serve: Any) -> None:
    server = serve(_snapshot)
    server.observe("allocate", 0.00004)
    server.observe("allocate", 0.0003)
    server.observe("commit", 0.002)
    samples = _scrape(server)
    allocate = (("kind", "allocate"),)
    assert samples[("kvd_request_duration_seconds_count", allocate)] == 2
    assert samples[("kvd_request_duration_seconds_sum", allocate)] == pytest.approx(0.00034)
    le_50us = (("kind", "allocate"), ("le", "5e-05"))
    le_500us = (("kind", "allocate"), ("le", "0.0005"))
    assert samples[("kvd_request_duration_seconds_bucket", le_50us)] == 1
    assert samples[("kvd_request_duration_seconds_bucket", le_500us)] == 2
    assert samples[("kvd_request_duration_seconds_count", (("kind", "commit"),))] == 1


def test_failing_snapshot_reports_stats_down_and_still_serves(serve: Any) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("engine busy")

    server = serve(broken)
    server.observe("ping", 0.0001)
    samples = _scrape(server)
    assert samples[("kvd_stats_up", ())] == 0
    assert samples[("kvd_request_duration_seconds_count", (("kind", "ping"),))] == 1
    assert not any(name.startswith("kvd_pool") for name, _ in samples)


def test_malformed_values_are_skipped(serve: Any) -> None:
    def odd() -> dict[str, Any]:
        return {
            "pools": {
                "p": {"blocks": {"free": "many", "evictable": True, "in_use": 2}, "prefix": []},
                "q": "not a pool",
            },
            "admission": {"refusals": None},
            "clients": {"sessions": None},
        }

    samples = _scrape(serve(odd))
    assert samples[("kvd_pool_blocks", (("pool", "p"), ("state", "in_use")))] == 2
    assert ("kvd_pool_blocks", (("pool", "p"), ("state", "free"))) not in samples
    assert ("kvd_pool_blocks", (("pool", "p"), ("state", "evictable"))) not in samples
    assert ("kvd_sessions", ()) not in samples
    assert samples[("kvd_stats_up", ())] == 1


def test_process_metrics_are_served(serve: Any) -> None:
    samples = _scrape(serve(_snapshot))
    assert samples[("process_resident_memory_bytes", ())] > 0


def test_metrics_stay_off_the_global_registry(serve: Any) -> None:
    serve(_snapshot).observe("allocate", 0.001)
    global_text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "kvd_" not in global_text


def test_ephemeral_port_and_close_releases_it() -> None:
    server = start_metrics_server("127.0.0.1", 0, _snapshot)
    assert server.port > 0
    assert _scrape(server)[("kvd_sessions", ())] == 3
    server.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)


def test_port_in_use_raises_oserror(serve: Any) -> None:
    server = serve(_snapshot)
    with pytest.raises(OSError):
        start_metrics_server("127.0.0.1", server.port, _snapshot)


def test_loop_snapshot_runs_on_the_event_loop_thread() -> None:
    seen: list[threading.Thread] = []

    def stats() -> dict[str, Any]:
        seen.append(threading.current_thread())
        return {"clients": {"sessions": 5}}

    async def main() -> Samples:
        server = start_metrics_server("127.0.0.1", 0, loop_snapshot(stats))
        try:
            return await anyio.to_thread.run_sync(_scrape, server)
        finally:
            await anyio.to_thread.run_sync(server.close)

    loop_thread = threading.current_thread()
    samples = anyio.run(main)
    assert samples[("kvd_sessions", ())] == 5
    assert seen == [loop_thread]


def test_tier_figures_per_pool_and_tier(serve: Any) -> None:
    def with_tier() -> dict[str, Any]:
        tier = {"tier": 1, "blocks": 12, "capacity": 64, "promotions": 5, "bytes_moved": 4096}
        return {"tiers": {"llama": tier}}

    samples = _scrape(serve(with_tier))
    labels = (("pool", "llama"), ("tier", "1"))
    assert samples[("kvd_tier_blocks", labels)] == 12
    assert samples[("kvd_tier_capacity_blocks", labels)] == 64
    assert samples[("kvd_tier_promotions_total", labels)] == 5
    assert samples[("kvd_tier_bytes_moved_total", labels)] == 4096


def test_a_remote_stores_failures_by_code(serve: Any) -> None:
    def with_remote() -> dict[str, Any]:
        tier = {"tier": 2, "blocks": 3, "store_errors": {"REMOTE_UNAVAILABLE": 4}}
        return {"tiers": {"llama": tier}}

    samples = _scrape(serve(with_remote))
    labels = (("code", "REMOTE_UNAVAILABLE"), ("pool", "llama"), ("tier", "2"))
    assert samples[("kvd_tier_store_errors_total", labels)] == 4


def test_a_chains_tier_2_is_labelled_with_its_pool(serve: Any) -> None:
    def with_chain() -> dict[str, Any]:
        host = {"pool": "llama", "tier": 1, "blocks": 4, "hits": 2}
        remote = {"pool": "llama", "tier": 2, "blocks": 9, "hits": 7, "store_errors": {"X": 1}}
        return {"tiers": {"llama": host, "llama@tier2": remote}}

    samples = _scrape(serve(with_chain))
    assert samples[("kvd_tier_hits_total", (("pool", "llama"), ("tier", "1")))] == 2
    assert samples[("kvd_tier_hits_total", (("pool", "llama"), ("tier", "2")))] == 7
    errors = (("code", "X"), ("pool", "llama"), ("tier", "2"))
    assert samples[("kvd_tier_store_errors_total", errors)] == 1
    assert not [key for key in samples if ("pool", "llama@tier2") in key[1]]


def test_the_snapshot_nests_each_pools_blocks_and_prefix_and_keeps_the_optional_sections() -> None:
    stats = {
        "pools": {"default": {}},
        "blocks": {"default": {"in_use": 1}},
        "prefix": {"default": {"hits": 2}},
        "clients": {"sessions": 3},
        "uptime_s": 9.0,
    }
    assert snapshot_of(stats) == {
        "pools": {"default": {"blocks": {"in_use": 1}, "prefix": {"hits": 2}}},
        "clients": {"sessions": 3},
    }
