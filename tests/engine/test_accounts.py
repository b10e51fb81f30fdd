"""Quota and minimum accounting."""

from __future__ import annotations

from kvd.engine.admission import Account, unmet_minimums
from kvd.engine.namespace import Namespace
from kvd.engine.session import Session


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


def _session(sid: int, ns: Namespace, minimum: int, usage: int = 0) -> Session:
    s = Session(sid, ns, None, None, minimum)
    s.usage = usage
    ns.sessions.add(s)
    return s


def test_other_sessions_minimums_count_against_a_requester() -> None:
    ns = Namespace("")
    me = _session(1, ns, 4)
    _session(2, ns, 3, usage=1)
    assert unmet_minimums([ns], me) == 2


def test_own_namespace_minimum_does_not_count_against_its_sessions() -> None:
    ns = Namespace("", minimum=10)
    me = _session(1, ns, 0)
    assert unmet_minimums([ns], me) == 0


def test_another_namespace_keeps_the_larger_of_its_minimums() -> None:
    mine, other = Namespace("a"), Namespace("b", minimum=5)
    me = _session(1, mine, 0)
    _session(2, other, 3)
    assert unmet_minimums([mine, other], me) == 5
    _session(3, other, 4)
    assert unmet_minimums([mine, other], me) == 7
