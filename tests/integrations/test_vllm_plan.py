"""kvd_client.integrations.vllm_plan: the vLLM connector's logic without vLLM (fake kvd)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest
import torch
from kvd_client.errors import DaemonUnavailable, InvalidRequest, LayoutMismatch
from kvd_client.integrations.vllm_plan import (
    Link,
    ReqView,
    SchedulerPlan,
    copy_pages,
    paged_layout,
    paired_runs,
    pool_name,
    same_but_size,
)

BS = 4


class FakeKvd:
    """Keys are token tuples; ``cached`` leading blocks of any lookup are in kvd."""

    def __init__(self, cached: int) -> None:
        self.cached = cached
        self.holds: set[int] = set()
        self.lookups = 0
        self._next = 100

    def keys(self, tokens: npt.NDArray[np.int32], parent: bytes | None, first: int) -> list[bytes]:
        return [bytes(tokens[i : i + BS].tobytes()) for i in range(0, len(tokens) // BS * BS, BS)]

    def lookup_hold(self, keys: Sequence[bytes]) -> tuple[int, list[int], int, int] | None:
        self.lookups += 1
        n = min(self.cached, len(keys))
        if not n:
            return 0, [], 0, 1
        self._next += 1
        self.holds.add(self._next)
        return n, list(range(50, 50 + n)), self._next, 1

    def release(self, hold: int) -> None:
        self.holds.discard(hold)


def _tokens(n: int) -> list[int]:
    return list(range(10, 10 + n))


def test_layout_and_pool_name() -> None:
    lay = paged_layout(
        num_layers=8,
        num_kv_heads=8,
        head_size=128,
        dtype="bfloat16",
        block_size=32,
        engine="vllm/0.32.0/cpu/LBHNC",
        pool_bytes=1 << 30,
    )
    assert lay.order == "paged" and lay.format == "vllm/0.32.0/cpu/LBHNC/bfloat16"
    assert lay.page_bytes == 8 * 32 * 2 * 128 * 2  # vLLM's [H, N, 2C] block of one layer
    assert lay.num_blocks == (1 << 30) // (8 * lay.page_bytes)
    bigger = paged_layout(
        num_layers=8,
        num_kv_heads=8,
        head_size=128,
        dtype="bfloat16",
        block_size=32,
        engine="vllm/0.32.0/cpu/LBHNC",
        num_blocks=7,
    )
    assert pool_name(lay) == pool_name(bigger) and same_but_size(lay, bigger)
    with pytest.raises(ValueError, match="holds no block"):
        paged_layout(
            num_layers=8,
            num_kv_heads=8,
            head_size=128,
            dtype="bfloat16",
            block_size=32,
            engine="e",
            pool_bytes=10,
        )


def test_a_hit_is_held_once_loaded_by_the_worker_and_the_rest_saved() -> None:
    kvd = FakeKvd(cached=3)
    plan = SchedulerPlan(kvd, BS)
    tokens = _tokens(22)  # 5 full blocks, cap (22 - 1) // 4 = 5
    assert plan.matched("r", lambda: tokens, 22, 0) == 12
    assert plan.matched("r", lambda: tokens, 22, 0) == 12  # asked again: same answer
    assert kvd.lookups == 1 and len(kvd.holds) == 1
    plan.allocated("r", [7, 8, 9, 10, 11, 12], 12)
    step = plan.step([ReqView("r", 12, 10, [7, 8, 9, 10, 11, 12], True)], ())
    (load,) = step.loads
    assert load.kvd_blocks == [50, 51, 52] and load.vllm_blocks == [7, 8, 9]
    assert plan.held() == []  # the hold is the worker's now
    (save,) = step.saves  # tokens 12..21 computed: blocks 3 and 4 are new and full
    assert save.vllm_blocks == [10, 11]
    assert save.parent == np.asarray(tokens[8:12], np.int32).tobytes()  # block 2's key
    assert save.tokens.tolist() == tokens[12:20]
    # Decode: the next full block (tokens 20..23) is saved when it is computed.
    tokens += [1, 2]
    assert plan.step([ReqView("r", 22, 1, [], False)], ()).saves == []
    tokens += [3]
    (late,) = plan.step([ReqView("r", 23, 1, [], False)], ()).saves
    assert late.vllm_blocks == [12] and late.tokens.tolist() == tokens[20:24]


def test_a_local_hit_covering_kvds_loads_nothing_and_releases() -> None:
    kvd = FakeKvd(cached=2)
    plan = SchedulerPlan(kvd, BS)
    assert plan.matched("r", lambda: _tokens(22), 22, 8) == 0
    plan.allocated("r", [1, 2, 3, 4, 5, 6], 0)
    assert kvd.holds == set()
    (save,) = plan.step([ReqView("r", 8, 14, [1, 2, 3, 4, 5, 6], True)], ()).saves
    assert save.vllm_blocks == [3, 4, 5]  # blocks 2..4: missing in kvd


def test_the_hit_leaves_the_last_token_to_compute() -> None:
    plan = SchedulerPlan(FakeKvd(cached=10), BS)
    assert plan.matched("r", lambda: _tokens(16), 16, 0) == 12  # not 16


def test_finish_abort_and_preemption_release_the_schedulers_holds() -> None:
    kvd = FakeKvd(cached=3)
    plan = SchedulerPlan(kvd, BS)
    for r in ("done", "preempted"):
        plan.matched(r, lambda: _tokens(22), 22, 0)
    assert len(kvd.holds) == 2
    plan.finished("done")  # waiting, never scheduled, then aborted
    plan.step([], ["preempted"])
    assert kvd.holds == set() and plan.held() == []
    # Resumed: asked again, held again.
    assert plan.matched("preempted", lambda: _tokens(22), 22, 0) == 12
    assert len(kvd.holds) == 1
    plan.forget_all()
    assert kvd.holds == set() and len(plan) == 0


def test_a_kvd_miss_is_no_hit() -> None:
    class Down(FakeKvd):
        def lookup_hold(self, keys: Sequence[bytes]) -> None:
            return None

    plan = SchedulerPlan(Down(cached=3), BS)
    assert plan.matched("r", lambda: _tokens(22), 22, 0) == 0
    assert plan.counters["lookup_miss"] == 1


def test_paired_runs_and_copy_pages() -> None:
    assert paired_runs([5, 6, 7, 1], [0, 1, 3, 4]) == [(5, 0, 2), (7, 3, 1), (1, 4, 1)]
    with pytest.raises(ValueError):
        paired_runs([1], [])
    src = [torch.randn(9, 6) for _ in range(2)]
    dst = [torch.zeros(9, 6) for _ in range(2)]
    assert copy_pages(src, [5, 6, 1], dst, [0, 1, 8]) == 2 * 3 * 6 * 4
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[0, 1, 8]], s[[5, 6, 1]])


def test_link_waits_out_an_outage_and_counts_misses() -> None:
    now = [0.0]
    calls = []

    def connect() -> object:
        calls.append(now[0])
        raise DaemonUnavailable("ipc:///x", 0.1)

    link = Link(connect, retry_s=10.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert link.call("lookup", lambda c: 1) is None
    now[0] = 5.0
    assert link.call("lookup", lambda c: 1) is None  # not asked again
    now[0] = 11.0
    assert link.call("lookup", lambda c: 1) is None
    assert calls == [0.0, 11.0]
    assert link.counters == {"unreachable": 2, "skipped_unreachable": 1}


def test_link_logs_errors_but_raises_a_layout_mismatch() -> None:
    link = Link(object, retry_s=1.0)  # type: ignore[arg-type]

    def bad(c: object) -> None:
        raise InvalidRequest("no")

    def mismatch(c: object) -> None:
        raise LayoutMismatch("other layout")

    assert link.call("publish", bad) is None
    assert link.counters["error_InvalidRequest"] == 1
    with pytest.raises(LayoutMismatch):
        link.call("attach", mismatch)
