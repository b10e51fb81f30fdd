"""The node-wide memory budget: does a pool (or a pool's growth) fit?

Pure arithmetic over plain numbers, the same for every backend: the caller
reads the free bytes of the place a pool lives in (a GPU through NVML, the
host's shared-memory filesystem) and asks. A pool fits when

- what is free there, less what is asked, still leaves the headroom (the
  memory other processes need: weights, activations, the CUDA context), and
- the bytes held by every pool under this budget, plus what is asked, stay
  within the operator's cap (when one is set).

"Does not fit" is an expected outcome, so it is a `BudgetDecision` value
with ``ok=False`` and a one-line message, never an exception. Exceptions
are kept for caller mistakes (a negative size, a name held twice), raised
before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "BudgetDecision",
    "Holding",
    "Limit",
    "MemoryBudget",
    "PoolRequest",
    "decide",
    "format_bytes",
]

#: What refused an allocation: free memory less headroom, or the operator's cap.
Limit = Literal["free", "cap"]

_UNITS: Final = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_bytes(n: int) -> str:
    """``n`` bytes for a log line: ``"100.0 GiB"``, ``"512.0 MiB"``, ``"-3.0 GiB"``, ``"10 B"``."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _check_size(name: str, value: object, *, positive: bool = False) -> int:
    if type(value) is not int or value < 0 or (positive and value == 0):
        kind = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {kind} integer number of bytes, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class BudgetDecision:
    """Whether ``asked`` bytes fit at ``place``, with every number that decided it.

    ``ok`` is true when both the headroom and the cap hold; ``limit`` names the
    first one that failed (``"free"`` before ``"cap"``), ``None`` when it fits.
    """

    ok: bool
    limit: Limit | None
    pool: str
    place: str
    asked: int
    free: int
    headroom: int
    cap: int | None
    held: int

    @property
    def left(self) -> int:
        """Free bytes at ``place`` after the allocation (negative when it cannot be made)."""
        return self.free - self.asked

    @property
    def short(self) -> int:
        """Bytes missing for the allocation to fit (0 when it fits)."""
        by_free = self.headroom - self.left
        by_cap = 0 if self.cap is None else self.held + self.asked - self.cap
        return max(0, by_free, by_cap)

    @property
    def message(self) -> str:
        """One line for a log or an error reply: asked, free, headroom (and the cap)."""
        numbers = (
            f"asked {format_bytes(self.asked)}, free {format_bytes(self.free)}, "
            f"headroom {format_bytes(self.headroom)}"
        )
        if self.cap is not None:
            numbers += f", cap {format_bytes(self.cap)} with {format_bytes(self.held)} held"
        where = f"pool {self.pool!r} on {self.place}"
        if self.ok:
            return f"{where} fits: {numbers} (leaves {format_bytes(self.left)} free)"
        why = "free memory less headroom" if self.limit == "free" else "the node's cap"
        return f"{where} does not fit {why}: {numbers} (short by {format_bytes(self.short)})"


def decide(
    pool: str,
    place: str,
    asked: int,
    free: int,
    *,
    headroom: int = 0,
    cap: int | None = None,
    held: int = 0,
) -> BudgetDecision:
    """Decide whether ``asked`` bytes fit; pure, raises ValueError on bad numbers.

    ``free`` is what ``place`` has free now (the pools already allocated
    there are not in it); ``held`` is what every pool under the same cap
    holds already, wherever it lives.
    """
    _check_size("asked", asked, positive=True)
    _check_size("free", free)
    _check_size("headroom", headroom)
    _check_size("held", held)
    if cap is not None:
        _check_size("cap", cap, positive=True)
    limit: Limit | None = None
    if free - asked < headroom:
        limit = "free"
    elif cap is not None and held + asked > cap:
        limit = "cap"
    return BudgetDecision(
        ok=limit is None,
        limit=limit,
        pool=pool,
        place=place,
        asked=asked,
        free=free,
        headroom=headroom,
        cap=cap,
        held=held,
    )


@dataclass(frozen=True, slots=True)
class Holding:
    """The bytes one pool holds under the budget, and where."""

    place: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class PoolRequest:
    """A pool to plan for: its name, place, size and (optionally) its own headroom."""

    pool: str
    place: str
    nbytes: int
    headroom: int | None = None


class MemoryBudget:
    """Every pool of the node under one cap, each place keeping its headroom.

    ``headroom_bytes`` is the default headroom of every place; a pool may ask
    for another (a GPU that also runs a large model). ``cap_bytes`` bounds
    the sum of every pool held, across places; ``None`` means no cap.
    """

    def __init__(self, *, headroom_bytes: int = 0, cap_bytes: int | None = None) -> None:
        self._headroom = _check_size("headroom_bytes", headroom_bytes)
        if cap_bytes is not None:
            _check_size("cap_bytes", cap_bytes, positive=True)
        self._cap = cap_bytes
        self._held: dict[str, Holding] = {}

    @property
    def headroom_bytes(self) -> int:
        """The default headroom of every place."""
        return self._headroom

    @property
    def cap_bytes(self) -> int | None:
        """The operator's cap on the sum of all pools, or None."""
        return self._cap

    @property
    def held_bytes(self) -> int:
        """Bytes held by every pool admitted and not released."""
        return sum(h.nbytes for h in self._held.values())

    @property
    def pools(self) -> Mapping[str, Holding]:
        """A copy of the pools held, by name."""
        return dict(self._held)

    def check(
        self, pool: str, place: str, asked: int, free: int, *, headroom: int | None = None
    ) -> BudgetDecision:
        """Would a new pool of ``asked`` bytes fit? Changes nothing."""
        return decide(
            pool,
            place,
            asked,
            free,
            headroom=self._headroom if headroom is None else headroom,
            cap=self._cap,
            held=self.held_bytes,
        )

    def admit(
        self, pool: str, place: str, asked: int, free: int, *, headroom: int | None = None
    ) -> BudgetDecision:
        """`check`, and hold the bytes when it fits; a refusal changes nothing.

        Raises ValueError when ``pool`` is already held (grow it instead).
        """
        if pool in self._held:
            raise ValueError(f"pool {pool!r} is already held under the budget")
        decision = self.check(pool, place, asked, free, headroom=headroom)
        if decision.ok:
            self._held[pool] = Holding(place, asked)
        return decision

    def grow(
        self, pool: str, extra: int, free: int, *, headroom: int | None = None
    ) -> BudgetDecision:
        """Would ``extra`` more bytes for a held pool fit? Holds them when they do.

        Raises KeyError when ``pool`` is not held.
        """
        holding = self._held.get(pool)
        if holding is None:
            raise KeyError(f"pool {pool!r} is not held under the budget")
        decision = self.check(pool, holding.place, extra, free, headroom=headroom)
        if decision.ok:
            self._held[pool] = Holding(holding.place, holding.nbytes + extra)
        return decision

    def release(self, pool: str) -> int:
        """Stop holding ``pool``; returns the bytes it held. KeyError when not held."""
        holding = self._held.pop(pool, None)
        if holding is None:
            raise KeyError(f"pool {pool!r} is not held under the budget")
        return holding.nbytes

    def plan(
        self, requests: Sequence[PoolRequest], free: Mapping[str, int], *, held: int = 0
    ) -> list[BudgetDecision]:
        """Decide a whole configuration before allocating any of it. Changes nothing.

        Requests are decided in order, each seeing the free bytes of its place
        and the held bytes as the earlier fitting requests would leave them,
        so a daemon can refuse at startup, listing every pool that does not
        fit, instead of failing halfway through allocating. ``held``: bytes
        held under the cap besides this budget's own (pools made before).
        Raises KeyError when ``free`` lacks a request's place, ValueError on a
        repeated or already held pool name.
        """
        left = dict(free)
        held += self.held_bytes
        seen: set[str] = set()
        decisions: list[BudgetDecision] = []
        for req in requests:
            if req.pool in seen or req.pool in self._held:
                raise ValueError(f"pool {req.pool!r} is planned or held twice")
            seen.add(req.pool)
            if req.place not in left:
                raise KeyError(f"no free-memory reading for {req.place!r} (pool {req.pool!r})")
            decision = decide(
                req.pool,
                req.place,
                req.nbytes,
                left[req.place],
                headroom=self._headroom if req.headroom is None else req.headroom,
                cap=self._cap,
                held=held,
            )
            if decision.ok:
                left[req.place] -= req.nbytes
                held += req.nbytes
            decisions.append(decision)
        return decisions
