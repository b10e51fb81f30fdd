"""Accounts: quota and minimum bookkeeping."""

from __future__ import annotations

from kvd.engine.accounts import (
    Account,
    Accounts,
    NamespaceAccount,
    SessionAccount,
    unmet_minimums,
)
from kvd.engine.pool import BlockPool


def test_headroom_is_quota_minus_usage() -> None:
    acct = Account(quota=10, minimum=0)
    acct.usage = 4
    assert acct.headroom() == 6
    assert Account(quota=None, minimum=0).headroom() is None


def test_unmet_minimum_never_goes_negative() -> None:
    acct = Account(quota=None, minimum=5)
    acct.usage = 2
    assert acct.unmet() == 3
    acct.usage = 9
    assert acct.unmet() == 0


def _session(sid: int, ns: NamespaceAccount, minimum: int, usage: int = 0) -> SessionAccount:
    s = SessionAccount(sid, ns, None, None, minimum)
    s.usage = usage
    ns.sessions.add(s)
    return s


def test_other_sessions_minimums_count_against_a_requester() -> None:
    ns = NamespaceAccount("")
    me = _session(1, ns, 4)
    _session(2, ns, 3, usage=1)
    assert unmet_minimums([ns], me) == 2


def test_own_namespace_minimum_does_not_count_against_its_sessions() -> None:
    ns = NamespaceAccount("", minimum=10)
    me = _session(1, ns, 0)
    assert unmet_minimums([ns], me) == 0


def test_another_namespace_keeps_the_larger_of_its_minimums() -> None:
    mine, other = NamespaceAccount("a"), NamespaceAccount("b", minimum=5)
    me = _session(1, mine, 0)
    _session(2, other, 3)
    assert unmet_minimums([mine, other], me) == 5
    _session(3, other, 4)
    assert unmet_minimums([mine, other], me) == 7


def test_room_is_the_least_of_the_pool_and_both_quota_headrooms() -> None:
    accounts = Accounts(BlockPool(10), watermark=2)
    accounts.open(1, "t", None, 6, 0)
    sess = accounts.sessions[1]
    assert accounts.room(sess) == 6
    accounts.set_limits("t", 4, 0)
    assert accounts.room(sess) == 4
    accounts.charge(sess, 5, 0)  # over the namespace quota: no room, not negative
    assert accounts.room(sess) == 0


def test_an_unused_namespace_is_forgotten_with_its_last_session() -> None:
    accounts = Accounts(BlockPool(4), watermark=0)
    accounts.open(1, "t", None, None, 0)
    accounts.close(accounts.sessions[1])
    assert "t" not in accounts.namespaces
