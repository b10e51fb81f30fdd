"""The node-wide memory budget, on plain numbers."""

from __future__ import annotations

import pytest

from kvd.memory.budget import (
    BudgetDecision,
    Holding,
    MemoryBudget,
    PoolRequest,
    decide,
    format_bytes,
)

GiB = 1 << 30
MiB = 1 << 20


def test_format_bytes_picks_the_largest_unit() -> None:
    assert format_bytes(100 * GiB) == "100.0 GiB"
    assert format_bytes(512 * MiB) == "512.0 MiB"
    assert format_bytes(3 * (1 << 40)) == "3.0 TiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(10) == "10 B"
    assert format_bytes(-2 * GiB) == "-2.0 GiB"


def test_fits_when_headroom_is_left() -> None:
    d = decide("llama", "cuda:0", 10 * GiB, 80 * GiB, headroom=4 * GiB)
    assert d.ok
    assert d.limit is None
    assert d.left == 70 * GiB
    assert d.short == 0


def test_fits_when_exactly_the_headroom_is_left() -> None:
    assert decide("p", "cuda:0", 76 * GiB, 80 * GiB, headroom=4 * GiB).ok


def test_refused_one_byte_past_the_headroom() -> None:
    d = decide("p", "cuda:0", 76 * GiB + 1, 80 * GiB, headroom=4 * GiB)
    assert not d.ok
    assert d.limit == "free"
    assert d.short == 1


def test_refused_when_larger_than_free() -> None:
    d = decide("big", "cuda:0", 200 * GiB, 139 * GiB, headroom=2 * GiB)
    assert not d.ok
    assert d.limit == "free"
    assert d.left == -61 * GiB
    assert d.short == 63 * GiB


def test_refusal_message_is_one_line_with_asked_free_headroom() -> None:
    d = decide("big", "cuda:0", 200 * GiB, 139 * GiB, headroom=2 * GiB)
    assert d.message == (
        "pool 'big' on cuda:0 does not fit free memory less headroom: "
        "asked 200.0 GiB, free 139.0 GiB, headroom 2.0 GiB (short by 63.0 GiB)"
    )
    assert "\n" not in d.message


def test_fitting_message_says_what_is_left() -> None:
    d = decide("p", "shm", 1 * GiB, 8 * GiB, headroom=1 * GiB)
    assert d.message == (
        "pool 'p' on shm fits: asked 1.0 GiB, free 8.0 GiB, headroom 1.0 GiB (leaves 7.0 GiB free)"
    )


def test_cap_refuses_what_free_memory_allows() -> None:
    d = decide("p", "cuda:0", 30 * GiB, 100 * GiB, cap=64 * GiB, held=40 * GiB)
    assert not d.ok
    assert d.limit == "cap"
    assert d.short == 6 * GiB
    assert d.message == (
        "pool 'p' on cuda:0 does not fit the node's cap: asked 30.0 GiB, free 100.0 GiB, "
        "headroom 0 B, cap 64.0 GiB with 40.0 GiB held (short by 6.0 GiB)"
    )


def test_free_is_named_before_the_cap_when_both_fail() -> None:
    d = decide("p", "cuda:0", 50 * GiB, 40 * GiB, cap=10 * GiB)
    assert d.limit == "free"
    assert d.short == 40 * GiB


def test_cap_reached_exactly_fits() -> None:
    assert decide("p", "cuda:0", 24 * GiB, 100 * GiB, cap=64 * GiB, held=40 * GiB).ok


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("asked", {"asked": 0}),
        ("asked", {"asked": -1}),
        ("asked", {"asked": 1.5}),
        ("asked", {"asked": True}),
        ("free", {"free": -1}),
        ("headroom", {"headroom": -1}),
        ("held", {"held": -1}),
        ("cap", {"cap": 0}),
    ],
)
def test_decide_rejects_bad_numbers(field: str, kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"asked": GiB, "free": 2 * GiB}
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        decide("p", "cuda:0", **args)  # type: ignore[arg-type]


def test_budget_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="headroom_bytes"):
        MemoryBudget(headroom_bytes=-1)
    with pytest.raises(ValueError, match="cap_bytes"):
        MemoryBudget(cap_bytes=0)


def test_check_changes_nothing() -> None:
    budget = MemoryBudget(headroom_bytes=GiB)
    assert budget.check("p", "cuda:0", GiB, 10 * GiB).ok
    assert budget.held_bytes == 0
    assert budget.pools == {}


def test_admit_holds_a_fitting_pool() -> None:
    budget = MemoryBudget(headroom_bytes=GiB, cap_bytes=100 * GiB)
    d = budget.admit("a", "cuda:0", 10 * GiB, 80 * GiB)
    assert d.ok
    assert budget.pools == {"a": Holding("cuda:0", 10 * GiB)}
    assert budget.held_bytes == 10 * GiB


def test_refused_admit_changes_nothing() -> None:
    budget = MemoryBudget(headroom_bytes=GiB)
    budget.admit("a", "cuda:0", 10 * GiB, 80 * GiB)
    d = budget.admit("b", "cuda:0", 70 * GiB, 70 * GiB)
    assert not d.ok
    assert budget.pools == {"a": Holding("cuda:0", 10 * GiB)}


def test_admit_twice_is_a_caller_error_that_changes_nothing() -> None:
    budget = MemoryBudget()
    budget.admit("a", "cuda:0", GiB, 80 * GiB)
    with pytest.raises(ValueError, match="already held"):
        budget.admit("a", "cuda:0", GiB, 80 * GiB)
    assert budget.held_bytes == GiB


def test_pools_on_several_places_share_one_cap() -> None:
    budget = MemoryBudget(headroom_bytes=2 * GiB, cap_bytes=100 * GiB)
    assert budget.admit("gpu0", "cuda:0", 60 * GiB, 139 * GiB).ok
    assert budget.admit("host", "shm", 30 * GiB, 64 * GiB).ok
    d = budget.admit("gpu1", "cuda:1", 20 * GiB, 139 * GiB)
    assert not d.ok
    assert d.limit == "cap"
    assert d.held == 90 * GiB
    assert budget.admit("gpu1", "cuda:1", 10 * GiB, 139 * GiB).ok
    assert budget.held_bytes == 100 * GiB


def test_pool_headroom_overrides_the_default() -> None:
    budget = MemoryBudget(headroom_bytes=GiB)
    assert not budget.check("p", "cuda:0", 8 * GiB, 10 * GiB, headroom=4 * GiB).ok
    assert budget.check("p", "cuda:0", 8 * GiB, 10 * GiB).ok


def test_grow_holds_the_extra_bytes() -> None:
    budget = MemoryBudget(cap_bytes=20 * GiB)
    budget.admit("a", "cuda:0", 10 * GiB, 80 * GiB)
    d = budget.grow("a", 5 * GiB, 70 * GiB)
    assert d.ok
    assert d.place == "cuda:0"
    assert budget.pools["a"] == Holding("cuda:0", 15 * GiB)


def test_refused_growth_changes_nothing() -> None:
    budget = MemoryBudget(cap_bytes=20 * GiB)
    budget.admit("a", "cuda:0", 10 * GiB, 80 * GiB)
    d = budget.grow("a", 11 * GiB, 70 * GiB)
    assert not d.ok
    assert d.limit == "cap"
    assert budget.pools["a"] == Holding("cuda:0", 10 * GiB)


def test_grow_of_an_unknown_pool_is_a_caller_error() -> None:
    with pytest.raises(KeyError, match="not held"):
        MemoryBudget().grow("nope", GiB, 10 * GiB)


def test_release_returns_the_bytes_and_frees_the_cap() -> None:
    budget = MemoryBudget(cap_bytes=10 * GiB)
    budget.admit("a", "cuda:0", 10 * GiB, 80 * GiB)
    assert not budget.check("b", "cuda:0", GiB, 70 * GiB).ok
    assert budget.release("a") == 10 * GiB
    assert budget.check("b", "cuda:0", GiB, 80 * GiB).ok
    with pytest.raises(KeyError, match="not held"):
        budget.release("a")


def test_plan_sees_the_memory_earlier_pools_take() -> None:
    budget = MemoryBudget(headroom_bytes=2 * GiB)
    decisions = budget.plan(
        [
            PoolRequest("a", "cuda:0", 60 * GiB),
            PoolRequest("b", "cuda:0", 60 * GiB),
            PoolRequest("c", "cuda:1", 60 * GiB),
            PoolRequest("d", "cuda:0", 10 * GiB),
        ],
        {"cuda:0": 139 * GiB, "cuda:1": 50 * GiB},
    )
    assert [d.ok for d in decisions] == [True, True, False, True]
    assert [d.free for d in decisions] == [139 * GiB, 79 * GiB, 50 * GiB, 19 * GiB]
    assert budget.held_bytes == 0


def test_plan_counts_the_cap_across_places_and_held_pools() -> None:
    budget = MemoryBudget(cap_bytes=100 * GiB)
    budget.admit("held", "shm", 30 * GiB, 64 * GiB)
    decisions = budget.plan(
        [PoolRequest("a", "cuda:0", 50 * GiB), PoolRequest("b", "cuda:1", 30 * GiB)],
        {"cuda:0": 139 * GiB, "cuda:1": 139 * GiB},
    )
    assert [d.limit for d in decisions] == [None, "cap"]
    assert decisions[1].held == 80 * GiB


def test_plan_uses_each_pools_own_headroom() -> None:
    decisions = MemoryBudget(headroom_bytes=GiB).plan(
        [PoolRequest("a", "cuda:0", 8 * GiB, headroom=4 * GiB)], {"cuda:0": 10 * GiB}
    )
    assert decisions[0].headroom == 4 * GiB
    assert not decisions[0].ok


def test_plan_rejects_a_place_without_a_reading() -> None:
    with pytest.raises(KeyError, match="cuda:3"):
        MemoryBudget().plan([PoolRequest("a", "cuda:3", GiB)], {"cuda:0": 10 * GiB})


def test_plan_rejects_repeated_names() -> None:
    budget = MemoryBudget()
    budget.admit("a", "shm", GiB, 10 * GiB)
    with pytest.raises(ValueError, match="twice"):
        budget.plan([PoolRequest("a", "cuda:0", GiB)], {"cuda:0": 10 * GiB})
    with pytest.raises(ValueError, match="twice"):
        budget.plan(
            [PoolRequest("b", "cuda:0", GiB), PoolRequest("b", "cuda:0", GiB)],
            {"cuda:0": 10 * GiB},
        )


def test_decision_is_plain_data() -> None:
    d = decide("p", "cuda:0", GiB, 2 * GiB)
    assert d == BudgetDecision(
        ok=True,
        limit=None,
        pool="p",
        place="cuda:0",
        asked=GiB,
        free=2 * GiB,
        headroom=0,
        cap=None,
        held=0,
    )
