"""Engine: reservations, quotas, minimums, watermark (DESIGN.md section 6)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.engine import Allocation, Appended, Code, Forked, InvalidError, Refusal, Truncated

from .support import Checked, MakeEngine, toks


def alloc(
    eng: Checked, seq: str, tokens: np.ndarray, reserve: int | None = None, sid: int = 1
) -> Allocation:
    r = eng.allocate(sid, seq, tokens, reserve=reserve)
    assert isinstance(r, Allocation), r
    return r


def refused(result: object, code: Code = Code.OUT_OF_BLOCKS) -> bool:
    return isinstance(result, Refusal) and result.code == code


def grow(eng: Checked, seq: str, n: int, sid: int = 1) -> None:
    """Append ``n`` tokens one at a time; each must be served."""
    for i in range(n):
        r = eng.append(sid, seq, [1000 + i])
        assert isinstance(r, Appended), r


# --- Reservations ------------------------------------------------------------------


def test_a_reservation_is_reported_in_blocks(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    assert alloc(eng, "a", toks(3), reserve=16).reserved_blocks == 3


def test_growth_within_a_reservation_is_never_refused(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    alloc(eng, "a", toks(3), reserve=16)
    alloc(eng, "b", toks(16, start=100))
    assert refused(eng.allocate(1, "c", toks(1, start=200)))
    grow(eng, "a", 13)
    assert eng.stats().reserved == 0


def test_a_reservation_that_cannot_be_given_is_refused_now(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=4)
    assert refused(eng.allocate(1, "a", toks(3), reserve=20))


def test_reserved_blocks_are_not_available_to_others(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    alloc(eng, "a", toks(3), reserve=16)
    assert eng.can_allocate(1, 16) == (True, 4)
    assert eng.can_allocate(1, 17) == (False, 4)


def test_growth_past_the_reservation_is_refused_when_the_pool_is_full(
    make_engine: MakeEngine,
) -> None:
    eng = make_engine(num_blocks=4)
    alloc(eng, "a", toks(3), reserve=8)
    alloc(eng, "b", toks(8, start=100))
    grow(eng, "a", 5)
    assert refused(eng.append(1, "a", [1]))


def test_freeing_returns_the_reservation(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    alloc(eng, "a", toks(3), reserve=32)
    eng.free(1, "a")
    assert eng.stats().reserved == 0
    assert eng.can_allocate(1, 32) == (True, 8)


def test_a_copy_within_the_reservation_is_never_refused(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    alloc(eng, "a", toks(6), reserve=8)
    f = eng.fork(1, "a", "b", reserve=8)
    assert isinstance(f, Forked)
    assert eng.stats().reserved == 2  # one copy each: the partial last block is shared
    alloc(eng, "c", toks(16, start=100))
    grow(eng, "b", 2)
    grow(eng, "a", 2)


def test_regrowing_after_a_truncate_is_never_refused(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=6)
    alloc(eng, "a", toks(3), reserve=12)
    alloc(eng, "b", toks(12, start=100))
    grow(eng, "a", 9)
    assert eng.truncate(1, "a", 2) == Truncated(2, 1)
    grow(eng, "a", 10)


def test_a_truncate_into_a_shared_block_keeps_the_reservation_backed(
    make_engine: MakeEngine,
) -> None:
    eng = make_engine(num_blocks=4)
    alloc(eng, "a", toks(8), reserve=12)  # 2 blocks + 1 reserved
    eng.fork(1, "a", "b")  # full blocks: no copy needed, nothing reserved
    alloc(eng, "c", toks(4, start=100))  # the pool is now fully committed
    eng.truncate(1, "a", 6)  # growing back to 12 would need a copy + 1 block
    s = eng.stats()
    assert s.reserved == 1
    assert s.blocks_free + s.blocks_evictable >= s.reserved
    grow(eng, "a", 2)  # 8 tokens: the copy, from the reservation


# --- Quotas --------------------------------------------------------------------------


def test_a_session_quota_caps_its_blocks(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    eng.open_session(1, quota=3)
    alloc(eng, "a", toks(8))
    assert refused(eng.allocate(1, "b", toks(5, start=100)), Code.QUOTA_EXCEEDED)
    alloc(eng, "c", toks(4, start=100))


def test_a_session_quota_counts_reservations(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    eng.open_session(1, quota=3)
    assert refused(eng.allocate(1, "a", toks(1), reserve=13), Code.QUOTA_EXCEEDED)


def test_a_session_quota_counts_shared_blocks_once_per_holder(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    eng.open_session(1, quota=5)
    alloc(eng, "a", toks(9))
    eng.commit(1, "a")
    assert refused(eng.allocate(1, "b", toks(9)), Code.QUOTA_EXCEEDED)
    assert refused(eng.fork(1, "a", "c"), Code.QUOTA_EXCEEDED)


def test_a_namespace_quota_caps_all_its_sessions(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    eng.set_namespace_limits("t", quota=4)
    eng.open_session(1, namespace="t")
    eng.open_session(2, namespace="t")
    alloc(eng, "a", toks(12), sid=1)
    assert refused(eng.allocate(2, "b", toks(8, start=100)), Code.QUOTA_EXCEEDED)
    alloc(eng, "b", toks(4, start=100), sid=2)


def test_appends_past_the_reservation_respect_the_quota(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    eng.open_session(1, quota=2)
    alloc(eng, "a", toks(8))
    assert refused(eng.append(1, "a", [1]), Code.QUOTA_EXCEEDED)


def test_a_quota_below_current_usage_is_invalid(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    eng.open_session(1, namespace="t")
    alloc(eng, "a", toks(12))
    with pytest.raises(InvalidError):
        eng.set_namespace_limits("t", quota=2)


def test_a_minimum_above_the_quota_is_invalid(make_engine: MakeEngine) -> None:
    eng = make_engine(session=False)
    with pytest.raises(InvalidError):
        eng.open_session(1, quota=2, minimum=3)


def test_refusals_are_counted_by_code(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=2, session=False)
    eng.open_session(1, quota=1)
    eng.allocate(1, "a", toks(8))
    eng.open_session(2)
    eng.allocate(2, "a", toks(12))
    assert eng.stats().refusals == {"OUT_OF_BLOCKS": 1, "QUOTA_EXCEEDED": 1}


# --- Guaranteed minimums -------------------------------------------------------------


def test_another_sessions_minimum_stays_available(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    eng.open_session(2, minimum=4)
    assert refused(eng.allocate(1, "a", toks(17)))
    alloc(eng, "a", toks(16))
    alloc(eng, "b", toks(16, start=100), sid=2)


def test_a_used_minimum_no_longer_holds_blocks_back(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    eng.open_session(2, minimum=4)
    alloc(eng, "b", toks(8, start=100), sid=2)
    assert eng.can_allocate(1, 0) == (True, 4)


def test_another_namespaces_minimum_stays_available(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    eng.set_namespace_limits("t", minimum=6)
    assert eng.can_allocate(1, 8) == (True, 2)
    assert eng.can_allocate(1, 9) == (False, 2)


def test_a_namespaces_minimum_serves_its_own_sessions(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8, session=False)
    eng.set_namespace_limits("t", minimum=6)
    eng.open_session(1, namespace="t")
    assert eng.can_allocate(1, 32) == (True, 8)


# --- Watermark --------------------------------------------------------------------------


def test_new_allocations_keep_off_the_watermark(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8, watermark_blocks=2)
    assert refused(eng.allocate(1, "a", toks(25)))
    alloc(eng, "a", toks(24))


def test_forks_keep_off_the_watermark(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8, watermark_blocks=2)
    alloc(eng, "a", toks(20))
    assert refused(eng.fork(1, "a", "b", reserve=28))
    assert isinstance(eng.fork(1, "a", "b", reserve=24), Forked)


def test_running_sequences_may_grow_into_the_watermark(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8, watermark_blocks=2)
    alloc(eng, "a", toks(24))
    grow(eng, "a", 8)
    assert refused(eng.append(1, "a", [1]))


# --- can_allocate ------------------------------------------------------------------------


def test_can_allocate_changes_nothing(make_engine: MakeEngine) -> None:
    from .support import snapshot

    eng = make_engine(num_blocks=8)
    alloc(eng, "a", toks(5), reserve=12)
    before = snapshot(eng)
    eng.can_allocate(1, 100, reserve=200)
    eng.can_allocate(1, 4)
    assert snapshot(eng) == before
    assert eng.stats().refusals == {"OUT_OF_BLOCKS": 0, "QUOTA_EXCEEDED": 0}


def test_can_allocate_agrees_with_allocate(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8)
    alloc(eng, "a", toks(5), reserve=12)
    assert eng.can_allocate(1, 20) == (True, 5)
    assert eng.can_allocate(1, 21) == (False, 5)
    assert refused(eng.allocate(1, "b", toks(21, start=100)))
    alloc(eng, "c", toks(20, start=100))


def test_can_allocate_reports_the_quota_headroom(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=8, session=False)
    eng.open_session(1, quota=3)
    assert eng.can_allocate(1, 4, reserve=12) == (True, 3)
    assert eng.can_allocate(1, 4, reserve=13) == (False, 3)
