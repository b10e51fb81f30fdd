"""What operators and clients read: the admin kinds, the stats sections, pressure notices.

Admin kinds (STATS, CHECK, FLUSH, CLIENTS, POOLS, PING) need no session.
`Info.stats` is the one source of every stats section: the STATS reply,
``kvd-ctl stats``, the metrics endpoint and the systemd status line. The
``config`` section (the running config, and which keys a SIGHUP applies)
is sent only when a STATS request names it. The CLIENTS listing stops at
`CLIENTS_LISTED` sessions (oldest first) and says how many there are: its
reply stays bounded however many sessions the daemon serves (issue #14).
A CHECK holds the request thread while it recounts every block (~1 µs a
block: 1 s for a 1M-block pool), so the next one may start only
`CHECK_SPACING` times that long after it ended (RATE_LIMITED before): however
often they are sent, checks take at most 1/21 of the request thread.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import structlog
from kvd_client import wire
from kvd_client.wire import hashing

import kvd
from kvd.config import reload_keys
from kvd.engine import COMPILED, EngineStats, InvariantError
from kvd.errors import RequestError
from kvd.server.context import Call, Outcome, ServerState
from kvd.server.freezer import gc_stats

__all__ = ["CHECK_SPACING", "CLIENTS_LISTED", "Info"]

#: Most sessions one CLIENTS reply lists (~250 bytes each).
CLIENTS_LISTED: Final = 1024
#: After a CHECK that ran t seconds, no other starts for CHECK_SPACING * t seconds.
CHECK_SPACING: Final = 20

log = structlog.get_logger("kvd.server")


def compiled() -> dict[str, bool]:
    """Which hot paths run compiled: the engine's per-block modules (mypyc) and
    the block-key hasher (C). False means an install without its build: the
    daemon is correct, and several times slower on long prompts."""
    return {"engine": COMPILED, "block_keys": hashing.IMPLEMENTATION == "c"}


def block_counts(stats: EngineStats) -> dict[str, int]:
    """A pool's blocks by state (the ``blocks`` section)."""
    return {
        "free": stats.blocks_free,
        "evictable": stats.blocks_evictable,
        "in_use": stats.blocks_in_use,
        "pinned": stats.blocks_pinned,
        "reserved": stats.reserved,
        "total": stats.blocks_total,
    }


class Info:
    """The admin kinds' handlers and the stats sections over ``state``."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        #: More stats sections by name (the daemon adds ``events`` when publishing).
        self.sections: dict[str, Callable[[], dict[str, Any]]] = {}
        #: Each pool's pressure level at the last notice.
        self._pressure: dict[str, int] = {}
        #: When (monotonic) the next CHECK may start, and how long the last one ran.
        self._check_after = 0.0
        self._check_took = 0.0

    def ping(self, req: wire.PingRequest, call: Call) -> Outcome:
        return {"epoch": self.state.epoch, "version": wire.PROTOCOL_VERSION}

    def check(self, req: wire.CheckRequest, call: Call) -> Outcome:
        wait = self._check_after - time.monotonic()
        if wait > 0:
            raise RequestError(
                wire.Code.RATE_LIMITED,
                f"the last check held every request for {self._check_took * 1e3:.0f} ms; "
                f"the next may run in {wait * 1e3:.0f} ms",
            )
        t0 = time.monotonic()
        problems: list[str] = []
        for pool in self.state.pools:
            try:
                pool.engine.check_invariants()
            except InvariantError as exc:
                problems.extend(f"{pool.name}: {p}" for p in exc.problems)
        end = time.monotonic()
        self._check_took = end - t0
        self._check_after = end + CHECK_SPACING * self._check_took
        if problems:
            log.error("invariants_violated", problems=problems)
        return wire.CheckResult(ok=not problems, problems=problems)

    def flush(self, req: wire.FlushRequest, call: Call) -> Outcome:
        dropped = sum(pool.engine.flush(req.namespace) for pool in self.state.pools)
        log.info("flushed", namespace=req.namespace, dropped=dropped)
        return wire.FlushResult(dropped=dropped)

    def clients(self, req: wire.ClientsRequest, call: Call) -> Outcome:
        state = self.state
        now = state.sessions.clock()
        usage = {pool.name: pool.engine.stats().session_usage for pool in state.pools}
        listing = [
            s.info(now) | {"usage_blocks": usage[s.pool].get(s.id, 0)}
            for s in itertools.islice(state.sessions, CLIENTS_LISTED)
        ]
        return wire.InfoResult(info={"sessions": listing, "total": len(state.sessions)})

    def pools(self, req: wire.PoolsRequest, call: Call) -> Outcome:
        by_pool = Counter(s.pool for s in self.state.sessions)
        info = {
            pool.name: {
                "backend": pool.config.backend,
                "runtime": pool.runtime,
                "layout": pool.layout.to_dict(),
                "memory": pool.memory.info(),
                "blocks": block_counts(pool.engine.stats()),
                "sessions": by_pool.get(pool.name, 0),
            }
            for pool in self.state.pools
        }
        return wire.InfoResult(info={"pools": info})

    def stats_request(self, req: wire.StatsRequest, call: Call) -> Outcome:
        sections = self.stats()
        if req.sections is not None:
            wanted = {str(s) for s in req.sections}
            if "config" in wanted:  # only on request: a listing, not a statistic
                sections["config"] = self.config_section()
            unknown = wanted - sections.keys()
            if unknown:
                raise RequestError(
                    wire.Code.INVALID,
                    f"unknown stats sections {sorted(unknown)} (have: {', '.join(sections)})",
                )
            sections = {k: v for k, v in sections.items() if k in wanted}
        return wire.InfoResult(info=sections)

    def stats(self) -> dict[str, Any]:
        """Every stats section (the STATS reply and kvd-ctl's source)."""
        state = self.state
        now = state.clock()
        engine = {pool.name: pool.engine.stats() for pool in state.pools}
        by_pool = Counter(s.pool for s in state.sessions)
        refusals: Counter[str] = Counter()
        for es in engine.values():
            refusals.update(es.refusals)
        return {
            "server": {
                "version": kvd.__version__,
                "protocol": wire.PROTOCOL_VERSION,
                "pid": os.getpid(),
                "epoch": state.epoch,
                "uptime_s": round(now - state.started, 3),
                "address": state.addresses[0],
                "addresses": state.addresses,
                "state": "draining" if state.draining else "serving",
                "compiled": compiled(),
            },
            "pools": {
                pool.name: {
                    "backend": pool.config.backend,
                    "runtime": pool.runtime,
                    "num_blocks": pool.layout.num_blocks,
                    "block_size": pool.layout.block_size,
                    "bytes": pool.memory.size,
                    "bytes_per_block": pool.layout.kv_bytes_per_block,
                    "sequences": engine[pool.name].sequences,
                    "holds": engine[pool.name].holds,
                    "held_blocks": engine[pool.name].held_blocks,
                }
                for pool in state.pools
            },
            "blocks": {name: block_counts(es) for name, es in engine.items()},
            "prefix": {
                name: {
                    "queries": es.prefix_queries,
                    "query_tokens": es.query_tokens,
                    "hit_tokens": es.hit_tokens,
                    "hit_ratio": round(es.hit_ratio, 4),
                    "evictions": es.evictions,
                    "eviction_policy": state.pools[name].engine.config.eviction,
                }
                for name, es in engine.items()
            },
            "clients": {
                "sessions": len(state.sessions),
                "by_pool": {name: by_pool.get(name, 0) for name in engine},
                "closed": dict(sorted(state.closed_sessions.items())),
                "quarantined": len(state.quarantined),
            },
            "admission": {
                "refusals": dict(sorted(refusals.items())),
                "by_pool": {name: dict(sorted(es.refusals.items())) for name, es in engine.items()},
            },
            "rpc": state.rpc.section(),
            "gc": gc_stats(),
        } | {name: section() for name, section in self.sections.items()}

    def config_section(self) -> dict[str, Any]:
        """The running config and which of its keys a SIGHUP applies (``kvd-ctl config``)."""
        return {"values": self.state.config.to_dict(), "reloadable": sorted(reload_keys())}

    def in_flight(self) -> int:
        """Sequences held by live sessions (what a graceful drain waits for; not quarantined)."""
        state = self.state
        held = sum(pool.engine.stats().sequences for pool in state.pools)
        return held - sum(
            state.pools[s.pool].engine.sequences_of(s.id) for _, s in state.quarantined
        )

    def pressure_notices(self) -> list[tuple[bytes, list[bytes]]]:
        """Notices for the sessions of each pool whose usage crossed a threshold since last call.

        Usage is (blocks in use + reserved) / blocks: what running sequences
        hold or are promised (evictable cached blocks count as available).
        A crossing up or down sends ``pressure`` with the pool, the usage, the
        level (how many of ``admission.pressure_thresholds`` are reached) and
        those thresholds, to every session of the pool. Called periodically
        by the daemon, never per request.
        """
        state = self.state
        thresholds = state.config.admission.pressure_thresholds
        out: list[tuple[bytes, list[bytes]]] = []
        for pool in state.pools:
            es = pool.engine.stats()
            usage = (es.blocks_in_use + es.reserved) / es.blocks_total
            level = sum(usage >= t for t in thresholds)
            if level == self._pressure.get(pool.name, 0):
                continue
            self._pressure[pool.name] = level
            log.info("pressure", pool=pool.name, usage=round(usage, 4), level=level)
            frames = wire.encode_notice(
                "pressure",
                {
                    "pool": pool.name,
                    "usage": round(usage, 4),
                    "level": level,
                    "thresholds": list(thresholds),
                },
            )
            out.extend((s.identity, frames) for s in state.sessions if s.pool == pool.name)
        return out
