"""Tier 1's bytes on the server side: demotion and promotion copies, off the request path.

The engine (`kvd.engine.tier`) decides what moves; this module moves it,
in worker threads, and tells the engine under the request lock:

- *Demotion*: woken by a commit or publish that cached blocks (`noted`),
  the loop takes the engine's pending demotions, copies them pool -> tier in
  a worker thread without the lock, then records them (`Tier.demoted`), and
  goes on while there are more. A block an allocation took while its copy
  ran does not count: the engine voided it when it handed the block out,
  before the taker's reply left.
- *Promotion*: an allocate or a held lookup whose prefix continues into
  the tier is not answered at once. The handler asks the engine to hold
  that part (`Engine.promote`, `promote_keys`) and queues a
  `PendingPromotion`; the request thread goes on serving everyone else. A
  loop task copies tier -> pool in a worker thread, then, under the lock,
  publishes the promoted blocks and runs the request itself
  (`Dispatcher.finish_promotion`), whose whole prefix is then a pool hit;
  the reply is sent through the loop's outbox. So no reply names a block
  whose bytes are not in place, and no other session waits for a copy. The
  client sees one reply, a little later. An operation of a batch run in
  slices (a `BatchRun`: every batch of a pool with a tier) pauses its
  batch the same way: once the operation has run, the loop hands the batch
  back to the request thread (``resume``), which runs the rest in slices.

A copy that raises counts as an error (`TierStats.errors`): a failed
demotion leaves the block uncopied, a failed promotion publishes nothing
(the client then computes that part itself).

- *Discovery* (remote tier only): a loop task reads, every
  ``tiers.remote.poll_s``, the names the nodes sharing the store stored
  (`RemoteStore.poll`, a worker thread) and indexes them (`Tier.learn`), so
  an allocate finds another node's blocks without a network call on the
  request path; a name stored since the last read is a miss until the next.

- *Chain* (a host tier with the remote one below it): each level has its
  own demotion task, so a slow store never delays tier 1's copies; tier 2's
  are fed by what tier 1 recorded and read tier 1's slots. A promotion
  copies its tier-1 part from host memory, then its tier-2 part from the
  store; when the store fails, the tier-1 part before the first remote
  block is still published (`Tier.promoted` with the failed levels).
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

from kvd.engine.tier import Demotion, Promotion, Tier
from kvd.memory.remote import RemoteError, RemoteStore
from kvd.memory.tier import TierStore, object_name, split_name
from kvd.server.context import Outcome, ServerState, SessionCall
from kvd.server.pools import ServedPool

__all__ = ["PendingPromotion", "Tiers", "chain"]

log = structlog.get_logger("kvd.server")

#: How long the loop's tasks sleep without a wake-up before looking anyway (seconds).
_IDLE: Final = 0.25
#: Most blocks copied per demotion batch (bounds the time a batch holds a worker).
_DEMOTE_BATCH: Final = 256


#: The handler that answers a request once its promotion is done.
_Run = Callable[[Any, SessionCall], Outcome]
#: Counters are kept by (pool, tier level).
_Where = tuple[str, int]


def chain(pool: ServedPool) -> list[tuple[Tier, TierStore]]:
    """``pool``'s tiers from the first down, each with its store."""
    tier, out = pool.engine.tier, []
    for store in (pool.tier, pool.below):
        if tier is None or store is None:
            break
        out.append((tier, store))
        tier = tier.below
    return out


class PendingPromotion:
    """An allocate (or held lookup) waiting for its tier blocks to be copied into
    the pool; ``run`` answers it then. ``batch``: the paused batch run it is an
    operation of (None: a request of its own)."""

    __slots__ = ("batch", "call", "pool", "promotion", "req", "run")

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
        self.batch: Any = None


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
        #: Bytes moved and copies failed, by pool and tier.
        self._moved: collections.Counter[_Where] = collections.Counter()
        self._failed: collections.Counter[_Where] = collections.Counter()
        #: Seconds of each tier's part of the last promotions (for the stats' median).
        self._promote_s: collections.defaultdict[_Where, collections.deque[float]] = (
            collections.defaultdict(lambda: collections.deque(maxlen=256))
        )
        self._counts_lock = threading.Lock()
        self._promote_wake = _Wake()
        #: Wake-ups of the demotion tasks, by depth in the chain (first tier, below it).
        self._demote_wakes = (_Wake(), _Wake())

    # ------------------------------------------------------------------
    # Request thread (under the request lock)

    def ask(
        self, req: wire.AllocateRequest | wire.LookupRequest, call: SessionCall, run: _Run
    ) -> PendingPromotion | None:
        """The promotion an allocate or a held lookup needs first, queued (``run``
        answers the request once it is done); None: answer it now."""
        pool = self._state.pools.get(call.session.pool)
        if pool is None or pool.tier is None or not call.defer:
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
            self._demote_wakes[0].set()

    # ------------------------------------------------------------------
    # Event loop

    async def serve(
        self,
        lock: threading.Lock,
        send: Callable[[bytes, list[bytes]], None],
        resume: Callable[[bytes, Any], None],
    ) -> None:
        """Run demotions and queued promotions until cancelled (engines under
        ``lock``); ``send`` sends a promoted allocate's reply (the loop's outbox),
        ``resume`` hands a batch run whose promoted operation ran back to the
        request thread. Returns at once when no pool has a tier and runtime pools
        get none (``memory.runtime_pool_tier_factor``)."""
        runtime = 1 if self._state.config.memory.runtime_pool_tier_factor else 0
        depth = max([runtime, *(len(chain(pool)) for pool in self._state.pools)])
        if not depth:
            return
        self._promote_wake.bind()
        for wake in self._demote_wakes:
            wake.bind()
        async with anyio.create_task_group() as tg:
            for level in range(depth):
                tg.start_soon(self._demote_all, lock, level)
            if any(self._remote(pool) for pool in self._state.pools):
                tg.start_soon(self._learn_all, lock)
            jobs = self.jobs
            while True:
                while jobs:
                    tg.start_soon(self._promote, jobs.popleft(), lock, send, resume)
                await self._promote_wake.wait()

    async def _demote_all(self, lock: threading.Lock, depth: int) -> None:
        """Run the demotions of every pool's tier at ``depth`` of its chain."""
        wake = self._demote_wakes[depth]
        while True:
            busy = False
            for pool in list(self._state.pools):
                links = chain(pool)
                if len(links) > depth:
                    busy |= await self._demote(pool, *links[depth], lock)
            if not busy:
                await wake.wait()

    async def _demote(
        self, pool: ServedPool, tier: Tier, store: TierStore, lock: threading.Lock
    ) -> bool:
        """Copy one batch of the demotions of ``pool``'s ``tier``; whether there was any."""
        with lock:
            waiting = len(tier.fed)
            batch = tier.demotions(_DEMOTE_BATCH)
            # Fed entries skipped (the store has them already) were unpinned in tier 1.
            skipped = not batch and len(tier.fed) < waiting
        if skipped:
            self._demote_wakes[0].set()
        if not batch:
            return False
        ok = await anyio.to_thread.run_sync(self._copy_out, pool, store, batch)
        with lock:
            tier.demoted(batch, ok)
            self._publish(pool)
            fed = tier.below is not None and bool(tier.below.fed)
        if fed:  # what tier 1 recorded goes down the chain
            self._demote_wakes[1].set()
        if tier.above is not None:  # the copies read tier 1's slots: room there again
            self._demote_wakes[0].set()
        return True

    @staticmethod
    def _remote(pool: ServedPool) -> tuple[Tier, RemoteStore] | None:
        """``pool``'s remote tier and store, if it has one."""
        for tier, store in chain(pool):
            if isinstance(store, RemoteStore):
                return tier, store
        return None

    async def _learn_all(self, lock: threading.Lock) -> None:
        """Index what the nodes sharing each remote store stored, every ``poll_s``."""
        pause = self._state.config.tiers.remote.poll_s
        while True:
            for pool in list(self._state.pools):
                remote = self._remote(pool)
                if remote is not None:
                    await self._learn(pool, *remote, lock)
            await anyio.sleep(pause)

    async def _learn(
        self, pool: ServedPool, tier: Tier, store: RemoteStore, lock: threading.Lock
    ) -> None:
        try:
            names = await anyio.to_thread.run_sync(store.poll)
        except Exception as exc:  # counted by the store; the next poll retries
            log.debug("tier_poll_failed", pool=pool.name, error=str(exc))
            return
        by_namespace: dict[str, list[bytes]] = {}
        for name in names:
            namespace, key = split_name(name)
            by_namespace.setdefault(namespace, []).append(key)
        with lock:
            for namespace, keys in by_namespace.items():
                tier.learn(namespace, keys)
            self._publish(pool)

    def _copy_out(self, pool: ServedPool, store: TierStore, batch: list[Demotion]) -> bool:
        names = [object_name(d.namespace, d.key) for d in batch]
        src, dst = [d.src for d in batch], [d.slot for d in batch]
        return self._copy((pool.name, store.level), store.store, src, dst, names)

    def _copy_in(self, pool: ServedPool, promo: Promotion) -> set[int]:
        """Copy ``promo``'s blocks in, tier 1's part first (worker thread); the
        levels whose copies failed."""
        stores = {store.level: store for _, store in chain(pool)}
        namespace = promo.session.namespace.name
        failed: set[int] = set()
        for level, at in sorted(promo.by_level().items()):
            store = stores[level]
            t0 = time.perf_counter()
            ok = self._copy(
                (pool.name, level),
                store.load,
                [promo.pairs[i][0] for i in at],
                [promo.pairs[i][1] for i in at],
                [object_name(namespace, promo.keys[i]) for i in at],
            )
            self._promote_s[pool.name, level].append(time.perf_counter() - t0)
            if not ok:
                failed.add(level)
        return failed

    def _copy(
        self,
        where: _Where,
        move: Callable[[list[int], list[int], list[bytes]], int],
        src: list[int],
        dst: list[int],
        names: list[bytes],
    ) -> bool:
        """One copy (worker thread): True when every byte moved."""
        pool, level = where
        try:
            moved = move(src, dst, names)
        except RemoteError as exc:  # expected when a store fails: no traceback, its code
            log.warning("tier_copy_failed", pool=pool, tier=level, blocks=len(src), error=str(exc))
            with self._counts_lock:
                self._failed[where] += 1
            return False
        except Exception:
            log.exception("tier_copy_failed", pool=pool, tier=level, blocks=len(src))
            with self._counts_lock:
                self._failed[where] += 1
            return False
        with self._counts_lock:
            self._moved[where] += moved
        return True

    async def _promote(
        self,
        job: PendingPromotion,
        lock: threading.Lock,
        send: Callable[[bytes, list[bytes]], None],
        resume: Callable[[bytes, Any], None],
    ) -> None:
        failed = await anyio.to_thread.run_sync(self._copy_in, job.pool, job.promotion)
        with lock:
            tier = job.pool.engine.tier
            assert tier is not None
            tier.promoted(job.promotion, True, failed)
            frames = self._finish(job)
        if job.batch is None:
            send(job.call.identity, frames)
        else:  # its operation ran: the request thread runs the rest of the batch
            resume(job.call.identity, job.batch)

    def _publish(self, pool: ServedPool) -> None:
        """Hand ``pool``'s engine events to the publisher (under the lock)."""
        if self._on_events is not None:
            events = pool.engine.drain_events()
            if events:
                self._on_events(pool.name, events)

    # ------------------------------------------------------------------
    # Stats (under the request lock)

    def stats(self) -> dict[str, Any]:
        """The ``tiers`` stats section: per pool with a tier, its first tier's
        counters in blocks and bytes (``bytes_moved``: both directions) under
        the pool's name, the tier below it (a chain) under ``<pool>@tier<level>``
        (``@`` is not allowed in pool names), each naming its ``pool``."""
        out: dict[str, Any] = {}
        for pool in self._state.pools:
            for depth, (tier, store) in enumerate(chain(pool)):
                where = (pool.name, store.level)
                timings = sorted(self._promote_s[where])
                counts = tier.snapshot()
                per_block = store.block_bytes
                out[pool.name if not depth else f"{pool.name}@tier{store.level}"] = {
                    "pool": pool.name,
                    "tier": store.level,
                    **store.info(),
                    **counts.to_dict(),
                    "bytes": counts.blocks * per_block,
                    "capacity_bytes": counts.capacity * per_block,
                    "bytes_moved": self._moved[where],
                    "copy_failures": self._failed[where],
                    "promotion_ms_p50": (
                        round(timings[len(timings) // 2] * 1e3, 3) if timings else 0.0
                    ),
                }
        return out
