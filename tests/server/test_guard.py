"""guard.next_check: the guard wakes often only when memory nears its budget."""

from __future__ import annotations

from kvd.server.guard import GUARD_IDLE, GUARD_INTERVAL, MAX_GROWTH, next_check


def test_idle_checks_come_at_the_time_memory_needs_to_reach_the_budget() -> None:
    assert next_check(MAX_GROWTH // 16) == 1 / 16


def test_near_or_past_the_budget_checks_come_every_interval() -> None:
    assert next_check(0) == GUARD_INTERVAL
    assert next_check(-(1 << 30)) == GUARD_INTERVAL


def test_checks_are_never_further_apart_than_idle() -> None:
    assert next_check(100 * MAX_GROWTH) == GUARD_IDLE
    assert next_check(None) == GUARD_IDLE
