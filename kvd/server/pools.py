"""The daemon's pools: one owner that budgets, creates, serves and retires them.

`Pools` holds every pool the daemon serves, configured at start or created
at runtime by a client's hello, each as a `ServedPool` (config, engine,
memory). It decides and never encodes a reply: a runtime creation it will
not make is a `PoolRefusal` value (or, for a malformed ask, `RequestError`
raised before anything is recorded), and the dispatcher answers.

Creating memory blocks (it is reserved and prefaulted), so `create` and
`create_runtime` run in a worker thread, one at a time, without the
request lock; `add` serves the result and is called under it. Every other
method is called under the request lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvd_client import wire

from kvd.config import AdmissionConfig, Config, PoolConfig
from kvd.engine import Engine, EngineConfig
from kvd.errors import (
    BackendUnavailableError,
    ConfigError,
    DaemonError,
    NoSuchDeviceError,
    RequestError,
    StartupError,
)
from kvd.memory import BACKENDS, PoolMemory, backend_capacity, create_pool_memory
from kvd.memory.budget import BudgetDecision, MemoryBudget, PoolRequest, format_bytes
from kvd.memory.cuda import CudaAllocation
from kvd.memory.cuda_tier import PinnedHostTier
from kvd.memory.mooncake import MooncakeTier
from kvd.memory.remote import RedisTier, RemoteStore
from kvd.memory.shm import ShmSegment
from kvd.memory.tier import HostTier, TierStore, tier_layout

__all__ = ["PoolRefusal", "Pools", "ServedPool"]


@dataclass(slots=True)
class ServedPool:
    """One pool as the daemon serves it: its config, engine, memory and tier store."""

    config: PoolConfig
    engine: Engine
    memory: PoolMemory
    #: Created by a client's hello (not in the config file).
    runtime: bool = False
    #: Where the first tier's copies live (None: no tier; `kvd.server.tiers` moves them).
    tier: TierStore | None = None
    #: Where the copies of the tier below it live (a chain: the remote store under
    #: the host tier; None: none).
    below: TierStore | None = None

    @property
    def name(self) -> str:
        """The pool's name."""
        return self.config.name

    @property
    def layout(self) -> wire.PoolLayout:
        """The pool's layout."""
        return self.memory.layout

    @property
    def reserved_bytes(self) -> int:
        """Bytes the pool holds of the node's budget: its memory and its tier's."""
        tier = self.config.tier_blocks
        return self.layout.total_bytes + (tier_layout(self.layout, tier).total_bytes if tier else 0)


@dataclass(frozen=True, slots=True)
class PoolRefusal:
    """Why a runtime pool was not created: the reply's code and message. Nothing changed."""

    code: wire.Code
    message: str


class Pools:
    """Every pool of one daemon instance, by name (iterating yields the served pools)."""

    def __init__(self, config: Config, *, instance: str) -> None:
        self.config = config
        self.instance = instance
        self._pools: dict[str, ServedPool] = {}
        #: Runtime pools asked for and not yet created or refused (counted against the cap).
        self._creating: set[str] = set()

    # ------------------------------------------------------------------
    # Lookup

    def born(self) -> int:
        """Block records made so far in every pool (`Engine.born`)."""
        return sum(pool.engine.born() for pool in self._pools.values())

    def __iter__(self) -> Iterator[ServedPool]:
        return iter(self._pools.values())

    def __len__(self) -> int:
        return len(self._pools)

    def __contains__(self, name: object) -> bool:
        return name in self._pools

    def __getitem__(self, name: str) -> ServedPool:
        return self._pools[name]

    def get(self, name: str) -> ServedPool | None:
        """The pool called ``name``, or None."""
        return self._pools.get(name)

    def names(self) -> list[str]:
        """The served pools' names, in the order they were added."""
        return list(self._pools)

    @property
    def runtime_count(self) -> int:
        """Pools created at runtime."""
        return sum(p.runtime for p in self._pools.values())

    # ------------------------------------------------------------------
    # Configured pools (start-up)

    def check_budget(self) -> None:
        """Refuse the configured pool set before allocating any of it (StartupError)."""
        refused = [d.message for d in self._plan(self.config.pools) if not d.ok]
        if refused:
            raise StartupError("; ".join(refused))

    def _plan(self, pools: Sequence[PoolConfig], held: int = 0) -> list[BudgetDecision]:
        """Would ``pools`` (each with its host tier) fit the memory that is there
        and the node budget, ``held`` bytes being taken already? (blocking reads)"""
        mem = self.config.memory
        budget = MemoryBudget(headroom_bytes=mem.headroom_bytes, cap_bytes=mem.budget_bytes or None)
        free: dict[str, int] = {}
        requests = []
        for pool in pools:
            cap = backend_capacity(pool.backend, shm_dir=mem.shm_dir, device=pool.device)
            place = f"{pool.backend} ({cap.where})"
            free[place] = cap.bytes
            requests.append(PoolRequest(pool.name, place, pool.layout.total_bytes))
            if pool.tier_blocks:  # host memory, whatever the pool's backend
                host = backend_capacity("shm", shm_dir=mem.shm_dir)
                size = tier_layout(pool.layout, pool.tier_blocks).total_bytes
                free[f"shm ({host.where})"] = host.bytes
                requests.append(PoolRequest(f"{pool.name} tier 1", f"shm ({host.where})", size))
        return budget.plan(requests, free, held=held)

    def create(self, pool: PoolConfig, *, runtime: bool = False) -> ServedPool:
        """Make ``pool``'s memory and engine (blocking; DaemonError from the backend)."""
        mem = self.config.memory
        opts = {"instance": self.instance, "shm_dir": mem.shm_dir, "prefault": pool.prefault}
        memory = create_pool_memory(
            pool.backend,
            pool.name,
            pool.layout,
            **opts,
            hugepages=pool.hugepages,
            device=pool.device,
            headroom_bytes=mem.headroom_bytes,
        )
        tier: TierStore | None = None
        remote: RemoteStore | None = None
        try:
            if pool.tier_blocks and isinstance(memory, CudaAllocation):
                tier = PinnedHostTier.create(memory, pool.tier_blocks)
            elif pool.tier_blocks:
                assert isinstance(memory, ShmSegment)
                tier = HostTier.create(
                    pool.name, pool.layout, memory.buffer(), pool.tier_blocks, **opts
                )
            if pool.remote_tier:
                assert isinstance(memory, ShmSegment)  # PoolConfig refuses a cuda one
                cfg = self.config.tiers.remote
                # Under a host tier it writes through from that tier's copies.
                source = tier.view() if isinstance(tier, HostTier) else None
                if cfg.url.startswith("mooncake://"):
                    remote = MooncakeTier(
                        pool.layout,
                        memory.buffer(),
                        cfg.url,
                        retry_after_s=cfg.retry_after_s,
                        source=source,
                    )
                else:
                    remote = RedisTier(
                        pool.layout,
                        memory.buffer(),
                        cfg.url,
                        timeout_s=cfg.timeout_s,
                        retry_after_s=cfg.retry_after_s,
                        ttl_s=cfg.ttl_s,
                        source=source,
                    )
        except BaseException:
            if tier is not None:
                tier.close()
            memory.close()
            raise
        if tier is None:
            return ServedPool(pool, self._engine(pool), memory, runtime=runtime, tier=remote)
        return ServedPool(
            pool, self._engine(pool), memory, runtime=runtime, tier=tier, below=remote
        )

    def _engine(self, pool: PoolConfig) -> Engine:
        adm = self.config.admission
        remote = self._remote_blocks(pool) if pool.remote_tier else 0
        engine = Engine(
            EngineConfig(
                num_blocks=pool.num_blocks,
                block_size=pool.block_size,
                hash_seed=self.config.cache.hash_seed,
                watermark_blocks=min(adm.watermark_blocks, pool.num_blocks),
                events=self.config.events.enabled,
                eviction=self.config.cache.eviction,
                # A host tier comes first; the remote one is first only without it.
                tier_blocks=pool.tier_blocks or remote,
                tier_level=1 if pool.tier_blocks else 2,
                remote_blocks=remote if pool.tier_blocks else 0,
                max_held_per_session=self.config.security.max_held_blocks_per_session,
            )
        )
        for ns, limits in adm.namespaces.items():
            engine.set_namespace_limits(
                ns, quota=limits.quota_blocks or None, minimum=limits.minimum_blocks
            )
        return engine

    def _remote_blocks(self, pool: PoolConfig) -> int:
        """Slots of ``pool``'s remote tier index: the blocks ``max_bytes`` holds."""
        layout = pool.layout
        return max(1, self.config.tiers.remote.max_bytes // (layout.num_layers * layout.page_bytes))

    def add(self, pool: ServedPool) -> None:
        """Serve ``pool`` (under the request lock)."""
        self._pools[pool.name] = pool
        self._creating.discard(pool.name)

    def close(self) -> None:
        """Release every pool's memory (at exit; idempotent)."""
        while self._pools:
            _, pool = self._pools.popitem()
            # Below first, then the first tier: their views keep the mappings above them.
            for store in (pool.below, pool.tier):
                if store is not None:
                    store.close()
            pool.memory.close()

    # ------------------------------------------------------------------
    # Runtime pools

    def ask(self, req: wire.HelloRequest) -> PoolConfig:
        """Check a hello's request to create pool ``req.pool`` and record it; its config.

        Raises `RequestError` and records nothing: FORBIDDEN when runtime pools
        are off, INVALID for a bad layout, backend or device, MISMATCH for
        another hash seed, QUOTA_EXCEEDED above the operator's count or size
        cap. A second ask for a pool being created joins it (no cap counted
        twice). The memory itself is judged by `create_runtime`.
        """
        mem = self.config.memory
        if not mem.runtime_pools:
            raise RequestError(
                wire.Code.FORBIDDEN,
                f"no pool {req.pool!r} and runtime pools are disabled (memory.runtime_pools)",
            )
        if req.layout is None:
            raise RequestError(wire.Code.INVALID, "field 'layout' is required to create a pool")
        layout = parse_layout(req.layout)
        check_hash_seed(req.hash_seed, self.config.cache.hash_seed)
        backend = mem.runtime_pool_backend if req.backend is None else req.backend
        if backend not in BACKENDS:
            raise RequestError(
                wire.Code.INVALID, f"field 'backend': {backend!r} is not one of {list(BACKENDS)}"
            )
        try:
            config = PoolConfig.of_layout(
                req.pool,
                layout,
                backend=backend,
                device=0 if req.device is None else req.device,
                tier_blocks=mem.runtime_pool_tier_factor * layout.num_blocks,
            )
        except ConfigError as exc:
            raise RequestError(wire.Code.INVALID, f"pool {exc.key}: {exc.message}") from None
        if req.pool in self._creating:
            return config
        count = self.runtime_count + len(self._creating)
        if count >= mem.max_runtime_pools:
            raise RequestError(
                wire.Code.QUOTA_EXCEEDED,
                f"no pool {req.pool!r} and {count} runtime pools exist "
                f"(memory.max_runtime_pools = {mem.max_runtime_pools})",
            )
        cap = mem.runtime_pool_max_bytes
        if cap and layout.total_bytes > cap:
            raise RequestError(
                wire.Code.QUOTA_EXCEEDED,
                f"pool {req.pool!r} asked {format_bytes(layout.total_bytes)}, "
                f"runtime pools are capped at {format_bytes(cap)} "
                f"(memory.runtime_pool_max_bytes)",
            )
        self._creating.add(req.pool)
        return config

    def create_runtime(self, pool: PoolConfig) -> ServedPool | PoolRefusal:
        """Judge ``pool`` against the memory that is there and the node budget, then make it.

        Blocking (worker thread, one creation at a time). Every failure is a
        refusal, never an exception: OUT_OF_BLOCKS when the memory place is
        short, QUOTA_EXCEEDED above the node budget, UNSUPPORTED when the
        backend cannot run on this host (no CUDA), INVALID for a device that
        does not exist. The caller passes a refusal to `abandon`.
        """
        held = sum(p.reserved_bytes for p in self._pools.values())
        try:
            for decision in self._plan([pool], held):  # the pool, then its tier
                if not decision.ok:
                    code = (
                        wire.Code.OUT_OF_BLOCKS
                        if decision.limit == "free"
                        else wire.Code.QUOTA_EXCEEDED
                    )
                    return PoolRefusal(code, decision.message)
            return self.create(pool, runtime=True)
        except DaemonError as exc:
            return PoolRefusal(_refusal_code(exc), str(exc))

    def abandon(self, name: str) -> None:
        """Forget the ask for ``name`` after its creation was refused (under the lock)."""
        self._creating.discard(name)

    # ------------------------------------------------------------------
    # Reload

    def namespace_problem(self, admission: AdmissionConfig) -> str | None:
        """Why ``admission``'s namespace quotas cannot apply now (None: they can)."""
        for pool in self._pools.values():
            usage = pool.engine.stats().namespaces
            for ns, limits in admission.namespaces.items():
                used = usage[ns].usage if ns in usage else 0
                if limits.quota_blocks and limits.quota_blocks < used:
                    return (
                        f"quota {limits.quota_blocks} of namespace {ns!r} is below its usage "
                        f"of {used} blocks in pool {pool.name!r}"
                    )
        return None

    def set_namespace_limits(self, old: AdmissionConfig, new: AdmissionConfig) -> None:
        """Give every engine ``new``'s namespace limits; namespaces it dropped lose theirs."""
        for pool in self._pools.values():
            for ns in old.namespaces.keys() - new.namespaces.keys():
                pool.engine.set_namespace_limits(ns, quota=None, minimum=0)
            for ns, limits in new.namespaces.items():
                pool.engine.set_namespace_limits(
                    ns, quota=limits.quota_blocks or None, minimum=limits.minimum_blocks
                )


def parse_layout(raw: dict[str, object]) -> wire.PoolLayout:
    """A hello's ``layout`` map as a `PoolLayout`; INVALID when it is not one."""
    try:
        return wire.PoolLayout.from_dict(raw)
    except (ValueError, TypeError) as exc:
        raise RequestError(wire.Code.INVALID, f"field 'layout': {exc}") from None


def check_hash_seed(theirs: str | None, ours: str) -> None:
    """MISMATCH when a client expects another hash seed than the daemon's."""
    if theirs is not None and theirs != ours:
        raise RequestError(
            wire.Code.MISMATCH, f"hash seed {theirs!r} differs from the daemon's {ours!r}"
        )


def _refusal_code(exc: DaemonError) -> wire.Code:
    """The reply code of a backend's refusal to create a pool."""
    if isinstance(exc, BackendUnavailableError):
        return wire.Code.UNSUPPORTED
    if isinstance(exc, NoSuchDeviceError):
        return wire.Code.INVALID
    return wire.Code.OUT_OF_BLOCKS
