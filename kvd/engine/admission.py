"""Admission accounting: hard quotas and guaranteed minimums.

A session's or namespace's *usage* counts the blocks it holds (once per
holder: a block shared by two of its sequences counts twice), the blocks
held in reserve for its sequences' growth, and its pinned blocks. A quota
caps usage; a guaranteed minimum keeps that many blocks available to the
account whatever the others do: the engine subtracts the unmet minimums
of everyone else from what a request may take.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvd.engine.namespace import Namespace
    from kvd.engine.session import Session

__all__ = ["Account", "unmet_minimums"]


class Account:
    """Usage, hard quota (None: unlimited) and guaranteed minimum, in blocks."""

    __slots__ = ("minimum", "quota", "usage")

    def __init__(self, quota: int | None, minimum: int) -> None:
        self.usage = 0
        self.quota = quota
        self.minimum = minimum

    def headroom(self) -> int | None:
        """How many more blocks the quota allows (None: unlimited)."""
        return None if self.quota is None else self.quota - self.usage

    def unmet(self) -> int:
        """Blocks of the guaranteed minimum not used yet."""
        return max(0, self.minimum - self.usage)


def unmet_minimums(namespaces: Iterable[Namespace], requester: Session) -> int:
    """Blocks that must stay available for other accounts' minimums.

    Within the requester's own namespace only the other sessions' unmet
    minimums count (the namespace's own minimum covers the requester too).
    For another namespace, its sessions' unmet minimums and its own unmet
    minimum overlap, so the larger of the two is kept.
    """
    total = 0
    for ns in namespaces:
        sessions = sum(s.unmet() for s in ns.sessions if s is not requester)
        if ns is requester.namespace:
            total += sessions
        else:
            total += max(ns.unmet(), sessions)
    return total
