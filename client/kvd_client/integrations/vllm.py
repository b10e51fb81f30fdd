"""A vLLM KV connector: separate vLLM processes on one node share prefixes through a kvd pool.

Select it with::

    kv_transfer_config={
        "kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd_client.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvd_address": "ipc:///run/kvd/kvd.sock"},
    }

Extra config keys (all optional):

- ``kvd_address``: the daemon (default: like every kvd client, ``$KVD_ADDRESS``
  or the runtime socket).
- ``kvd_pool``: the pool's name (default ``vllm-<12 hex>`` of the layout
  without its size, so every vLLM of one model and dtype shares it).
- ``kvd_num_blocks`` / ``kvd_pool_bytes``: the pool's size when this process
  creates it (default 1 GiB); an existing pool of the same layout is used
  whatever its size.
- ``kvd_timeout_s`` (default 1.0): the client time-out; ``kvd_retry_s``
  (default 10): how long an unreachable daemon is not asked again.
- ``kvd_namespace``: the kvd namespace (default ``""``); holds and cached
  blocks never cross namespaces.

The pool is ``order="paged"`` (`kvd_client.wire.layout`): one page per
(layer, block) holding vLLM's own block bytes, its format
``vllm/<version>/cpu/LBHNC/<dtype>`` part of the layout, so only the same
engine attaches. Keys are kvd's (`Client.block_keys` over the token ids),
whatever vLLM's ``prefix_caching_hash_algo``. Requests with a ``cache_salt``
or a LoRA adapter bypass kvd (counted as ``bypassed``). CPU only (vLLM's CPU
KV layout); one full-attention KV cache group.

Scheduler side (engine core): `SchedulerPlan` holds a request's cached
leading blocks at the first ``get_num_new_matched_tokens`` (why then: see
`SchedulerPlan`), hands the hold to the worker in the step's metadata and
releases holds of requests that finish, abort or are preempted. Worker side:
``start_load_kv`` copies the held pages into vLLM's blocks for every layer
(then the hold is released), ``wait_for_save`` copies the step's new full
blocks into granted pages and publishes them. A full pool skips the save; an
unreachable daemon is a logged miss; a load that cannot be done (daemon
restarted between lookup and load) is reported to vLLM as failed blocks
(``kv_load_failure_policy="recompute"`` recomputes them, vLLM's default
``"fail"`` fails the request).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index

from kvd_client.client import Client
from kvd_client.errors import LayoutMismatch, SessionLost
from kvd_client.integrations.vllm_plan import (
    Link,
    ReqView,
    SchedulerPlan,
    StepPlan,
    WorkerSide,
    as_pages,
    create_or_attach,
    describe,
    model_digest,
    paged_layout,
    pool_name,
    same_but_size,
)
from kvd_client.integrations.vllm_shared import KvdAsyncScheduler, KvdScheduler, SharedWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvdAsyncScheduler", "KvdConnector", "KvdConnectorMetadata", "KvdScheduler"]

#: A child of vLLM's logger, so these lines show with vLLM's own (its handler, its level).
log = logging.getLogger("vllm.kvd")


def _model(vllm_config: VllmConfig) -> str:
    m = vllm_config.model_config
    return model_digest(m.model, m.revision, m.dtype)


class KvdConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's `StepPlan`, sent from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class _Port:
    """`SchedulerPlan`'s view of kvd through a `Link`."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def keys(self, tokens: npt.NDArray[np.int32], parent: bytes | None, first: int) -> list[bytes]:
        keys = self.link.call("hash", lambda c: c.block_keys(tokens, parent, first))
        if keys is None:
            raise SessionLost("kvd unreachable: no session to compute keys with")
        return keys

    def lookup_hold(self, keys: Sequence[bytes]) -> tuple[int, list[int], int, int] | None:
        def op(c: Client) -> tuple[int, list[int], int, int]:
            res = c.lookup(keys, hold=True)
            return res.cached, [int(b) for b in res.blocks.tolist()], res.hold, c.epoch or 0

        return self.link.call("lookup", op)

    def release(self, hold: int) -> None:
        self.link.call("release", lambda c: c.release(hold))


class KvdConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's ``KVConnectorBase_V1`` over a kvd pool (see the module's docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.get_from_extra_config
        mode = extra("mode", "copy")
        if mode not in ("copy", "shared"):
            raise ValueError(f'KvdConnector "mode" is "copy" (default) or "shared", not {mode!r}')
        #: Shared mode: the pool is vLLM's KV buffer (`vllm_shared`); nothing to copy.
        self._shared: SharedWorker | None = None
        self._plan: SchedulerPlan | None = None
        self._worker: WorkerSide | None = None
        self._load_errors: set[int] = set()
        self._mode = mode
        if mode == "shared":
            if role != KVConnectorRole.SCHEDULER:
                self._shared = SharedWorker(vllm_config, kv_cache_config)
            return
        device = vllm_config.device_config.device_type
        if device != "cpu":
            raise ValueError(f"KvdConnector runs on vLLM's CPU backend only, not {device!r}")
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"KvdConnector needs one KV cache group, the model has {len(groups)}")
        spec = groups[0].kv_cache_spec
        self._layer_names = sorted(groups[0].layer_names, key=extract_layer_index)
        num_blocks = extra("kvd_num_blocks", None)
        pool_bytes = extra("kvd_pool_bytes", None)
        self.layout = paged_layout(
            num_layers=len(self._layer_names),
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=str(spec.dtype).removeprefix("torch."),
            block_size=spec.block_size,
            engine=f"vllm/{vllm.__version__}/cpu/LBHNC/{_model(vllm_config)}",
            num_blocks=None if num_blocks is None else int(num_blocks),
            pool_bytes=None if pool_bytes is None else int(pool_bytes),
        )
        self.pool = str(extra("kvd_pool", None) or pool_name(self.layout))
        self._address = extra("kvd_address", None)
        self._namespace = str(extra("kvd_namespace", ""))
        self._timeout = float(extra("kvd_timeout_s", 1.0))
        is_scheduler = role == KVConnectorRole.SCHEDULER
        self.link = Link(
            lambda: self._connect("vllm-scheduler" if is_scheduler else "vllm-worker"),
            retry_s=float(extra("kvd_retry_s", 10.0)),
        )
        self._bs = spec.block_size
        self._plan = SchedulerPlan(_Port(self.link), self._bs) if is_scheduler else None
        self._requests: dict[str, Request] = {}
        log.info("kvd connector (%s): pool %r, layout %s", role.name, self.pool, self.layout)

    def _connect(self, name: str) -> Client:
        """Create or attach the pool; an existing pool of this layout in another size is used."""
        kv, theirs = create_or_attach(
            self._address,
            pool=self.pool,
            name=name,
            namespace=self._namespace,
            layout=self.layout,
            timeout=self._timeout,
        )
        if theirs is not None:
            if not same_but_size(self.layout, theirs):
                kv.close()
                raise LayoutMismatch(
                    f"kvd pool {self.pool!r} is {theirs}, not {self.layout} in another size"
                )
            self.layout = theirs
            log.info("kvd pool %r exists with %d blocks: using it", self.pool, theirs.num_blocks)
        return kv

    # -- scheduler side ----------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._plan is None:  # shared mode: vLLM's own prefix cache is kvd's
            return 0, False
        if request.cache_salt is not None or request.lora_request is not None:
            self._plan.counters["bypassed"] += 1
            return 0, False
        self._requests[request.request_id] = request
        n = self._plan.matched(
            request.request_id,
            lambda: request.all_token_ids,
            request.num_tokens,
            num_computed_tokens,
        )
        if n:
            log.info("kvd hit: %s loads %d tokens from kvd", request.request_id, n)
        return n, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._plan is not None and request.request_id in self._requests:
            self._plan.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._plan is None:
            return KvdConnectorMetadata(StepPlan())
        counts = scheduler_output.num_scheduled_tokens
        views = [
            ReqView(r.req_id, r.num_computed_tokens, counts[r.req_id], list(r.block_ids[0]), True)
            for r in scheduler_output.scheduled_new_reqs
            if r.req_id in self._requests
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._requests:
                continue
            new = cached.new_block_ids[i]
            views.append(
                ReqView(
                    req_id,
                    cached.num_computed_tokens[i],
                    counts[req_id],
                    [] if new is None else list(new[0]),
                    req_id in cached.resumed_req_ids,
                )
            )
        plan = self._plan.step(views, scheduler_output.preempted_req_ids or ())
        return KvdConnectorMetadata(plan)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._plan is not None and self._requests.pop(request.request_id, None) is not None:
            self._plan.finished(request.request_id)
        return False, None

    def shutdown(self) -> None:
        if self._mode == "shared":
            if self._shared is not None:
                self._shared.close()
            return
        if self._plan is not None:
            self._plan.forget_all()
            log.info("kvd scheduler: %s", describe(self._plan.counters + self.link.counters))
        if self._worker is not None:
            log.info("kvd worker: %s", describe(self._worker.counters + self.link.counters))
        if self.link.client is not None:
            self.link.client.close()

    # -- worker side -------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[None] | None:
        """Shared mode: vLLM's KV allocation is the kvd pool's mapping."""
        return None if self._shared is None else self._shared.context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._shared is not None:
            self._shared.check(kv_caches)
            return
        layers = [kv_caches[name] for name in self._layer_names]
        lay = self.layout
        want = (lay.num_kv_heads, lay.block_size, 2 * lay.head_dim)
        for name, t in zip(self._layer_names, layers, strict=True):
            if tuple(t.shape[1:]) != want or str(t.dtype) != f"torch.{lay.dtype}":
                raise ValueError(
                    f"KvdConnector: layer {name} is {tuple(t.shape)} {t.dtype}, "
                    f"not [num_blocks, {want[0]}, {want[1]}, {want[2]}] {lay.dtype} "
                    "(vLLM's CPU layout LBHNC)"
                )
        self._worker = WorkerSide(self.link, [as_pages(t) for t in layers])
        self._worker.pages()  # attach now, so the first step does not pay for it

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvdConnectorMetadata):
            self._load_errors |= self._worker.load(meta.plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: `start_load_kv` copies every layer before the forward."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: `wait_for_save` copies whole blocks once every layer is written."""

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvdConnectorMetadata):
            self._worker.save(meta.plan.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
