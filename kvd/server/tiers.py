"""Tier 1's bytes on the server side: demotion and promotion copies, off the request path.

The engine (`kvd.engine.tier`) decides what moves; this module moves it,
in worker threads, and tells the engine under the request lock:

- *Demotion*: woken by a commit or publish that cached blocks (`noted`),
  the loop takes the engine's pending demotions, copies them pool -> tier in
  a worker thread without the lock, then records them (`Tier.demoted`), and
  goes on while there are more. A block an allocation took while its copy
  ran does not count: the engine voided it when it handed the block out,
  before the taker's reply left.
- *Promotion*: an allocate or a held lookup (not in a batch) whose prefix
  continues into the tier is not answered at once. The handler asks the
  engine to hold that part (`Engine.promote`, `promote_keys`) and queues a
  `PendingPromotion`; the request thread goes on serving everyone else. A
  loop task copies tier -> pool in a worker thread, then, under the lock,
  publishes the promoted blocks and runs the request itself
  (`Dispatcher.finish_promotion`), whose whole prefix is then a pool hit;
  the reply is sent through the loop's outbox. So no reply names a block
  whose bytes are not in place, and no other session waits for a copy. The
  client sees one reply, a little later.

A copy that raises counts as an error (`TierStats.errors`): a failed
demotion leaves the block uncopied, a failed promotion publishes nothing
(the client then computes that part itself).

- *Discovery* (remote tier only): a loop task reads, every
  ``tiers.remote.poll_s``, the names the nodes sharing the store stored
  (`RedisTier.poll`, a worker thread) and indexes them (`Tier.learn`), so
  an allocate finds another node's blocks without a network call on the
  request path; a name stored since the last read is a miss until the next.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import anyio
import structlog
from kvd_client import wire

from kvd.engine.tier import Demotion, Promotion
from kvd.memory.remote import RedisTier, RemoteError
from kvd.memory.tier import object_name, split_name
from kvd.server.context import Outcome, ServerState, SessionCall
from kvd.server.pools import ServedPool

__all__ = ["PendingPromotion", "Tiers"]

log = structlog.get_logger("kvd.server")

#: How long the loop's tasks sleep without a wake-up before looking anyway (seconds).
_IDLE: Final = 0.25
#: Most blocks copied per demotion batch (bounds the time a batch holds a worker).
_DEMOTE_BATCH: Final = 256


#: The handler that answers a request once its promotion is done.
_Run = Callable[[Any, SessionCall], Outcome]


class PendingPromotion:
    """An allocate (or held lookup) waiting for its tier blocks to be copied into
    the pool; ``run`` answers it then."""

    __slots__ = ("call", "pool", "promotion", "req", "run")

    def __init__(
        self,
        req: wire.AllocateRequest | wire.LookupRequest,
        call: SessionCall,
        pool: ServedPool,
        promo: Promotion,
        run: _Run,
    ) -> None:
        self.req = req
        self.call = call
        self.pool = pool
        self.promotion = promo
        self.run = run


class _Wake:
    """A wake-up for a loop task, set from any thread without blocking it (the
    request thread holds the request lock, which the loop may be waiting for)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._set = False

    def bind(self) -> None:
        """Wake tasks of the running event loop from now on (`Tiers.serve`'s start)."""
        self._loop, self._event, self._set = asyncio.get_running_loop(), asyncio.Event(), False

    def set(self) -> None:
        """Wake the task (any thread; once until it runs)."""
        if self._loop is not None and not self._set:
            self._set = True
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        """Until `set` (or `_IDLE` passes)."""
        assert self._event is not None, "bind first"
        with anyio.move_on_after(_IDLE):
            await self._event.wait()
        # Flag first: a `set` from here on schedules a callback that runs after
        # this step, so it is never lost.
        self._set = False
        self._event.clear()


class Tiers:
    """The server's tier copies over ``state``'s pools; ``on_events`` gets their
    engine events, ``finish`` makes a promoted allocate's reply (under the lock)."""

    def __init__(
        self,
        state: ServerState,
        on_events: Callable[[str, list[Any]], None] | None,
        finish: Callable[[PendingPromotion], list[bytes]],
    ) -> None:
        self._state = state
        self._on_events = on_events
        self._finish = finish
        #: Promotions queued by the request thread, taken by the loop (deque: thread-safe ends).
        self.jobs: collections.deque[PendingPromotion] = collections.deque()
        #: Bytes moved and copies failed, by pool.
        self._moved: collections.Counter[str] = collections.Counter()
        self._failed: collections.Counter[str] = collections.Counter()
        #: Seconds of the last promotions' copies by pool (for the stats' median).
        self._promote_s: collections.defaultdict[str, collections.deque[float]] = (
            collections.defaultdict(lambda: collections.deque(maxlen=256))
        )
        self._counts_lock = threading.Lock()
        self._promote_wake = _Wake()
        self._demote_wake = _Wake()

    # ------------------------------------------------------------------
    # Request thread (under the request lock)

    def ask(
        self, req: wire.AllocateRequest | wire.LookupRequest, call: SessionCall, run: _Run
    ) -> PendingPromotion | None:
        """The promotion an allocate or a held lookup needs first, queued (``run``
        answers the request once it is done); None: answer it now."""
        pool = self._state.pools.get(call.session.pool)
        if pool is None or pool.tier is None or call.batch:
            return None
        engine, sid = call.engine, call.session.id
        promo = (
            engine.promote_keys(sid, req.keys)
            if isinstance(req, wire.LookupRequest)
            else engine.promote(sid, req.seq, req.tokens, req.keys)
        )
        if promo is None:
            return None
        job = PendingPromotion(req, call, pool, promo, run)
        self.jobs.append(job)
        self._promote_wake.set()
        return job

    def noted(self, call: SessionCall) -> None:
        """A commit or publish of ``call`` may have cached blocks: copy them soon."""
        tier = call.engine.tier
        if tier is not None and tier.fresh:
            self._demote_wake.set()

    # ------------------------------------------------------------------
    # Event loop

    async def serve(self, lock: threading.Lock, send: Callable[[bytes, list[bytes]], None]) -> None:
        """Run demotions and queued promotions until cancelled (engines under
        ``lock``); ``send`` sends a promoted allocate's reply (the loop's outbox).
        Returns at once when no pool has a tier (runtime pools never do)."""
        if not any(pool.tier is not None for pool in self._state.pools):
            return
        self._promote_wake.bind()
        self._demote_wake.bind()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._demote_all, lock)
            if any(isinstance(pool.tier, RedisTier) for pool in self._state.pools):
                tg.start_soon(self._learn_all, lock)
            jobs = self.jobs
            while True:
                while jobs:
                    tg.start_soon(self._promote, jobs.popleft(), lock, send)
                await self._promote_wake.wait()

    async def _demote_all(self, lock: threading.Lock) -> None:
        while True:
            busy = False
            for pool in list(self._state.pools):
                if pool.tier is not None:
                    busy |= await self._demote(pool, lock)
            if not busy:
                await self._demote_wake.wait()

    async def _demote(self, pool: ServedPool, lock: threading.Lock) -> bool:
        """Copy one batch of ``pool``'s demotions; whether there was any."""
        tier, store = pool.engine.tier, pool.tier
        assert tier is not None and store is not None
        with lock:
            batch = tier.demotions(_DEMOTE_BATCH)
        if not batch:
            return False
        ok = await anyio.to_thread.run_sync(self._copy_out, pool, batch)
        with lock:
            tier.demoted(batch, ok)
            self._publish(pool)
        return True

    async def _learn_all(self, lock: threading.Lock) -> None:
        """Index what the nodes sharing each remote store stored, every ``poll_s``."""
        pause = self._state.config.tiers.remote.poll_s
        while True:
            for pool in list(self._state.pools):
                if isinstance(pool.tier, RedisTier):
                    await self._learn(pool, pool.tier, lock)
            await anyio.sleep(pause)

    async def _learn(self, pool: ServedPool, store: RedisTier, lock: threading.Lock) -> None:
        try:
            names = await anyio.to_thread.run_sync(store.poll)
        except Exception as exc:  # counted by the store; the next poll retries
            log.debug("tier_poll_failed", pool=pool.name, error=str(exc))
            return
        by_namespace: dict[str, list[bytes]] = {}
        for name in names:
            namespace, key = split_name(name)
            by_namespace.setdefault(namespace, []).append(key)
        tier = pool.engine.tier
        assert tier is not None
        with lock:
            for namespace, keys in by_namespace.items():
                tier.learn(namespace, keys)
            self._publish(pool)

    def _copy_out(self, pool: ServedPool, batch: list[Demotion]) -> bool:
        assert pool.tier is not None
        blocks = [d.block_id for d in batch]
        return self._copy(pool, pool.tier.store, blocks, [d.slot for d in batch], batch)

    def _copy_in(self, pool: ServedPool, promo: Promotion) -> bool:
        assert pool.tier is not None
        slots = [s for s, _ in promo.pairs]
        return self._copy(pool, pool.tier.load, slots, [b for _, b in promo.pairs], promo)

    def _copy(
        self,
        pool: ServedPool,
        move: Callable[[list[int], list[int], list[bytes]], int],
        src: list[int],
        dst: list[int],
        what: list[Demotion] | Promotion,
    ) -> bool:
        """One copy (worker thread): True when every byte moved."""
        if isinstance(what, Promotion):
            namespace = what.session.namespace.name
            names = [object_name(namespace, key) for key in what.keys]
        else:
            names = [object_name(d.namespace, d.key) for d in what]
        try:
            moved = move(src, dst, names)
        except RemoteError as exc:  # expected when a store fails: no traceback, its code
            log.warning("tier_copy_failed", pool=pool.name, blocks=len(src), error=str(exc))
            with self._counts_lock:
                self._failed[pool.name] += 1
            return False
        except Exception:
            log.exception("tier_copy_failed", pool=pool.name, blocks=len(src))
            with self._counts_lock:
                self._failed[pool.name] += 1
            return False
        with self._counts_lock:
            self._moved[pool.name] += moved
        return True

    async def _promote(
        self,
        job: PendingPromotion,
        lock: threading.Lock,
        send: Callable[[bytes, list[bytes]], None],
    ) -> None:
        t0 = time.perf_counter()
        ok = await anyio.to_thread.run_sync(self._copy_in, job.pool, job.promotion)
        self._promote_s[job.pool.name].append(time.perf_counter() - t0)
        with lock:
            tier = job.pool.engine.tier
            assert tier is not None
            tier.promoted(job.promotion, ok)
            frames = self._finish(job)
        send(job.call.identity, frames)

    def _publish(self, pool: ServedPool) -> None:
        """Hand ``pool``'s engine events to the publisher (under the lock)."""
        if self._on_events is not None:
            events = pool.engine.drain_events()
            if events:
                self._on_events(pool.name, events)

    # ------------------------------------------------------------------
    # Stats (under the request lock)

    def stats(self) -> dict[str, Any]:
        """The ``tiers`` stats section: per pool with a tier, its counters in
        blocks and bytes (``bytes_moved``: both directions)."""
        out: dict[str, Any] = {}
        for pool in self._state.pools:
            if pool.tier is None or pool.engine.tier is None:
                continue
            timings = sorted(self._promote_s[pool.name])
            counts = pool.engine.tier.snapshot()
            per_block = pool.tier.block_bytes
            out[pool.name] = {
                "tier": pool.tier.level,
                **pool.tier.info(),
                **counts.to_dict(),
                "bytes": counts.blocks * per_block,
                "capacity_bytes": counts.capacity * per_block,
                "bytes_moved": self._moved[pool.name],
                "copy_failures": self._failed[pool.name],
                "promotion_ms_p50": (
                    round(timings[len(timings) // 2] * 1e3, 3) if timings else 0.0
                ),
            }
        return out
