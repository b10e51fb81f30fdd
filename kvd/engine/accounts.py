"""Accounts: sessions and namespaces, their quotas and minimums, and admission.

A session's or namespace's *usage* counts the blocks it holds (once per
holder: a block shared by two of its sequences counts twice), the blocks
held in reserve for its sequences' growth, and its pinned blocks. A quota
caps usage; a guaranteed minimum keeps that many blocks available to the
account whatever the others do: admission subtracts the unmet minimums of
everyone else from what a request may take.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvd.engine.block import Block
from kvd.engine.checks import adapter_name, limits, namespace_name
from kvd.engine.errors import Code, ExistsError, InvalidError, NotFoundError
from kvd.engine.pool import BlockPool
from kvd.engine.prefix_index import PrefixIndex
from kvd.engine.results import Refusal
from kvd.engine.sequence import SequenceState

__all__ = [
    "Account",
    "Accounts",
    "HoldState",
    "NamespaceAccount",
    "SessionAccount",
    "pin_refs",
    "unmet_minimums",
]


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


class NamespaceAccount(Account):
    """A tenant, adapter family or model revision: blocks of different
    namespaces never match (the name salts block 0's hash *and* each
    namespace has its own index). ``epoch`` is bumped by a flush; sequences
    of an older epoch never publish. Also counts its prefix queries."""

    __slots__ = ("epoch", "hit_tokens", "index", "name", "queries", "query_tokens", "sessions")

    def __init__(self, name: str, quota: int | None = None, minimum: int = 0) -> None:
        super().__init__(quota, minimum)
        self.name = name
        self.index = PrefixIndex(name)
        self.epoch = 0
        self.sessions: set[SessionAccount] = set()
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    def __repr__(self) -> str:
        return f"NamespaceAccount({self.name!r}, cached={len(self.index)}, epoch={self.epoch})"


class SessionAccount(Account):
    """A client's sequences (ids scoped to the session), pins and holds, in
    one namespace and with one adapter identity, fixed at open.

    ``pending`` holds the sources of copies named in the session's last
    reply: each keeps one ref (and one block of usage) until the session's
    next engine call, by which time the client has copied from it. ``held``
    counts the block references in its pins (`pin_refs`) and holds
    (`Accounts.over_held`)."""

    __slots__ = ("adapter", "held", "holds", "namespace", "pending", "pins", "seqs", "sid")

    def __init__(
        self,
        sid: int,
        namespace: NamespaceAccount,
        adapter: str | None,
        quota: int | None,
        minimum: int,
    ) -> None:
        super().__init__(quota, minimum)
        self.sid = sid
        self.namespace = namespace
        self.adapter = adapter
        self.seqs: dict[str, SequenceState] = {}
        self.pins: dict[int, list[Block]] = {}
        #: The holds this session made (`kvd.engine.holds`), by id.
        self.holds: dict[int, HoldState] = {}
        self.held = 0
        self.pending: list[Block] = []

    def __repr__(self) -> str:
        return (
            f"SessionAccount({self.sid}, namespace={self.namespace.name!r}, seqs={len(self.seqs)})"
        )


class HoldState:
    """One hold: its blocks by id, which of them were granted fresh, and its owner."""

    __slots__ = ("blocks", "epoch", "granted", "hold_id", "owner")

    def __init__(
        self, hold_id: int, owner: SessionAccount, blocks: list[Block], granted: bool
    ) -> None:
        self.hold_id = hold_id
        self.owner = owner
        #: The owner's namespace epoch when the hold was made: after a flush it never publishes.
        self.epoch = owner.namespace.epoch
        self.blocks = {b.block_id: b for b in blocks}
        #: Ids of blocks granted fresh and not yet published (the only publishable ones).
        self.granted = set(self.blocks) if granted else set()


def pin_refs(blocks: list[Block]) -> int:
    """What a pin of ``blocks`` counts in `SessionAccount.held`: its blocks, and
    one for an empty pin (a record all the same)."""
    return len(blocks) or 1


def unmet_minimums(namespaces: Iterable[NamespaceAccount], requester: SessionAccount) -> int:
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


class Accounts:
    """Every session and namespace of one pool, and admission against them.

    ``outstanding`` is the sum of every sequence's blocks held in reserve;
    ``minimums`` counts the accounts with a guaranteed minimum (none: the
    minimums cost admission nothing); ``refusals`` counts admission's
    refusals by code; ``max_held``: block references a session may have in
    pins and holds (0: no limit).
    """

    __slots__ = (
        "max_held",
        "minimums",
        "namespaces",
        "outstanding",
        "pool",
        "refusals",
        "sessions",
        "watermark",
    )

    def __init__(self, pool: BlockPool, watermark: int, max_held: int = 0) -> None:
        self.pool = pool
        self.watermark = watermark
        self.max_held = max_held
        self.sessions: dict[int, SessionAccount] = {}
        self.namespaces: dict[str, NamespaceAccount] = {}
        self.outstanding = 0
        self.minimums = 0
        self.refusals: dict[Code, int] = {Code.OUT_OF_BLOCKS: 0, Code.QUOTA_EXCEEDED: 0}

    # ------------------------------------------------------------------
    # Registration

    def open(
        self, sid: int, namespace: object, adapter: object, quota: object, minimum: object
    ) -> None:
        """Register session ``sid`` (EXISTS if open, INVALID on a bad argument)."""
        if sid in self.sessions:
            raise ExistsError(f"session {sid} is already open")
        name = namespace_name(namespace)
        adapter = adapter_name(adapter)
        q, m = limits(quota, minimum)
        ns = self.namespace(name)
        sess = SessionAccount(sid, ns, adapter, q, m)
        self.sessions[sid] = sess
        ns.sessions.add(sess)
        self.minimums += m > 0

    def close(self, sess: SessionAccount) -> None:
        """Drop ``sess`` (which holds nothing any more)."""
        del self.sessions[sess.sid]
        sess.namespace.sessions.discard(sess)
        self.minimums -= sess.minimum > 0
        self.forget_if_unused(sess.namespace)

    def set_limits(self, namespace: object, quota: object, minimum: object) -> None:
        """Set a namespace's quota and minimum; a quota below its usage is INVALID."""
        name = namespace_name(namespace)
        q, m = limits(quota, minimum)
        existing = self.namespaces.get(name)
        if existing is not None and q is not None and q < existing.usage:
            raise InvalidError(
                f"quota {q} is below namespace {name!r}'s usage of {existing.usage} blocks"
            )
        ns = self.namespace(name)
        self.minimums += (m > 0) - (ns.minimum > 0)
        ns.quota = q
        ns.minimum = m
        self.forget_if_unused(ns)

    def find(self, sid: int) -> SessionAccount:
        """Session ``sid`` (NOT_FOUND when there is none)."""
        try:
            return self.sessions[sid]
        except (KeyError, TypeError):
            raise NotFoundError(f"no session {sid!r}") from None

    def namespace(self, name: str) -> NamespaceAccount:
        """Namespace ``name``, registered on first use."""
        ns = self.namespaces.get(name)
        if ns is None:
            ns = self.namespaces[name] = NamespaceAccount(name)
        return ns

    def forget_if_unused(self, ns: NamespaceAccount) -> None:
        """Drop ``ns`` once nothing refers to it: no session, no cached block,
        no usage and no limits. Otherwise every namespace a client ever named
        would stay registered (hostile or cycling clients grow memory without
        bound); a dropped one starts afresh (epoch 0, zero counters)."""
        if (
            not ns.sessions
            and not ns.index
            and not ns.usage
            and ns.quota is None
            and not ns.minimum
            and self.namespaces.get(ns.name) is ns
        ):
            del self.namespaces[ns.name]

    def forget_emptied(self) -> None:
        """Forget the namespaces whose last cached block an eviction just took."""
        emptied = self.pool.emptied
        while emptied:
            ns = self.namespaces.get(emptied.pop().owner)
            if ns is not None:
                self.forget_if_unused(ns)

    # ------------------------------------------------------------------
    # Admission

    def refuse(self, code: Code, message: str) -> Refusal:
        """A counted refusal."""
        self.refusals[code] += 1
        return Refusal(code, message)

    def available(self, sess: SessionAccount, new: bool) -> int:
        """Blocks ``sess`` may take now: free + evictable, less everyone's
        reservations, the watermark (for new allocations) and the unmet
        minimums of other accounts."""
        avail = self.pool.available() - self.outstanding
        if new:
            avail -= self.watermark
        if self.minimums:
            avail -= unmet_minimums(self.namespaces.values(), sess)
        return avail

    def room(self, sess: SessionAccount) -> int:
        """Blocks a new allocation of ``sess`` may take now, quotas included (>= 0)."""
        avail = self.available(sess, True)
        for account in (sess, sess.namespace):
            headroom = account.headroom()
            if headroom is not None:
                avail = min(avail, headroom)
        return max(avail, 0)

    def admit(self, sess: SessionAccount, usage: int, demand: int, new: bool) -> Refusal | None:
        """Refusal unless ``sess`` may grow its usage by ``usage`` blocks and
        the pool may commit ``demand`` more blocks (taken or reserved)."""
        if usage > 0:
            if sess.quota is not None and sess.usage + usage > sess.quota:
                return self.refuse(
                    Code.QUOTA_EXCEEDED,
                    f"session {sess.sid} would use {sess.usage + usage} blocks "
                    f"(quota {sess.quota})",
                )
            ns = sess.namespace
            if ns.quota is not None and ns.usage + usage > ns.quota:
                return self.refuse(
                    Code.QUOTA_EXCEEDED,
                    f"namespace {ns.name!r} would use {ns.usage + usage} blocks (quota {ns.quota})",
                )
        if demand > 0:
            avail = self.available(sess, new)
            if demand > avail:
                return self.refuse(
                    Code.OUT_OF_BLOCKS,
                    f"needs {demand} blocks, {max(avail, 0)} available",
                )
        return None

    def over_held(self, sess: SessionAccount, more: int) -> Refusal | None:
        """TOO_LARGE when ``more`` block references in pins and holds would take
        ``sess`` past ``max_held``. Not an admission refusal (the pool may have
        room): the limit bounds what one client makes the daemon remember."""
        cap = self.max_held
        if cap and sess.held + more > cap:
            return Refusal(
                Code.TOO_LARGE,
                f"session {sess.sid} would hold {sess.held + more} block references in pins "
                f"and holds (limit {cap}); unpin or release some",
            )
        return None

    def charge(self, sess: SessionAccount, usage: int, out: int) -> None:
        """Add ``usage`` blocks to ``sess`` and its namespace, ``out`` to the reservations."""
        sess.usage += usage
        sess.namespace.usage += usage
        self.outstanding += out
