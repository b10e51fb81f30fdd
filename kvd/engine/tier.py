"""Tier 1: which committed blocks also have a copy in the pool's host-memory tier.

Metadata only, like the rest of the engine: tier slots, the (namespace,
key) index of the copies and their LRU order. The bytes are copied by the
server (`kvd.server.tiers`) in worker threads; the engine says what to copy
and records what was copied.

Demotion (pool -> tier) is a copy made *ahead* of eviction: every block
that becomes cached (commit, publish) is noted, `demotions` hands out
(pool block, tier slot) pairs, and `demoted` records those whose copy
finished. A copy counts only if its block was not taken by an allocation
while it ran (`void` is called on every eviction, under the engine's lock,
before the taker's reply can let anyone write), its namespace was not
flushed and the block still holds the key it was copied under: the pool
slot an eviction frees is reused at once, so waiting for the eviction to
copy would be too late. A cached block is immutable (writes
into shared or cached blocks copy first), so the copy can read it while it
is in use.

Promotion (tier -> pool) is asked by an allocate whose prefix continues
into the tier: `promote` holds the pool's part of the prefix and fresh
blocks for the tier's part under a hold of the namespace's tier session
(an engine session of its own, so a client that leaves mid-copy cannot
free blocks a copy still writes), and pins the tier entries; the server
copies, then `promoted` publishes the fresh blocks under their keys and
lets the hold go, and the allocate runs (all of its prefix now a pool hit).

The same metadata serves tier 2, a store shared by several nodes
(``level`` 2, `kvd.memory.remote`): its slots only bound how many remote
names the node indexes, `learn` indexes what other nodes stored (no event:
they announced it), and a promotion that fails forgets its entries (the
store lost or spoiled them; asking again would fail again).

A chain (`chain`: tier 1 with tier 2 ``below`` it) writes through: every
copy tier 1 records is fed to tier 2 (`Tier.fed`), whose demotion reads
tier 1's slot and never the pool, so a pool eviction cannot void it and a
slow store never holds a pool block. The entry is pinned from the moment it
is fed until tier 2 has copied it (or skipped it, or failed): tier 1 never
drops a copy before it went down, so a store slower than the commits slows
tier 1's demotions instead of losing blocks. A promotion takes each block of the continuation from
tier 1 where it is there, else from tier 2, in one hold; when the copies
of one level fail, the blocks before the first failed one are still
published (the tier-1 part of a prefix survives a dead store).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence, Set
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvd.engine.accounts import Accounts, SessionAccount
from kvd.engine.block import Block
from kvd.engine.events import BlockRemoved, BlockStored, Event
from kvd.engine.holds import HoldTable
from kvd.engine.prefix_index import PrefixIndex

__all__ = ["Demotion", "Promotion", "Tier", "TierEntry", "TierStats", "chain"]

#: Where a tier's entries are named: (namespace, key).
_Name = tuple[str, bytes]
_NO_TOKENS: npt.NDArray[np.int32] = np.empty(0, dtype=np.int32)


class TierEntry:
    """One tier slot holding a copy of the block cached under ``key`` in ``namespace``.

    ``ref`` counts promotions and copies to the tier below reading it (it is
    not evicted meanwhile); ``dead``: flushed while read, its slot goes back
    when the last reader is done; ``learned``: stored by another node
    (`Tier.learn`), so its removal is not announced; ``level``: its tier's."""

    __slots__ = ("dead", "key", "learned", "level", "namespace", "ref", "slot")

    def __init__(
        self, slot: int, namespace: str, key: bytes, learned: bool = False, level: int = 1
    ) -> None:
        self.slot = slot
        self.namespace = namespace
        self.key = key
        self.ref = 0
        self.dead = False
        self.learned = learned
        self.level = level


class Demotion:
    """A copy into tier slot ``slot``, in flight: of pool block ``block``, or
    (a tier fed by the one above it) of that tier's ``entry``. ``src`` is
    what the copy reads: the block's id or the entry's slot."""

    __slots__ = (
        "block",
        "block_id",
        "entry",
        "epoch",
        "key",
        "namespace",
        "slot",
        "source",
        "src",
        "void",
    )

    def __init__(
        self,
        block: Block | None,
        slot: int,
        namespace: str,
        epoch: int,
        *,
        entry: TierEntry | None = None,
    ) -> None:
        self.block = block
        self.entry = entry
        #: What the copy reads (its key in `Tier.pending`).
        self.source: Block | TierEntry
        if block is not None:
            self.source, self.block_id, self.src = block, block.block_id, block.block_id
            self.key: bytes = block.key  # type: ignore[assignment]  # noted blocks are keyed
        else:
            assert entry is not None, "a demotion reads a block or an entry"
            self.source, self.block_id, self.src, self.key = entry, -1, entry.slot, entry.key
        self.namespace = namespace
        self.epoch = epoch
        self.slot = slot
        #: The block was taken by an allocation before the copy was recorded.
        self.void = False


class Promotion:
    """Tier slots to copy into fresh pool blocks (``pairs``: (slot, block id)), in flight.

    ``keys`` are the promoted blocks' keys, ``parent`` the key before the
    first, ``tokens`` their token ids for the stored event (None: unknown, a
    lookup's promotion)."""

    __slots__ = ("entries", "hold_id", "keys", "pairs", "parent", "session", "tokens")

    def __init__(
        self,
        session: SessionAccount,
        hold_id: int,
        *,
        entries: list[TierEntry],
        blocks: list[int],
        parent: bytes | None,
        tokens: npt.NDArray[np.int32] | None,
    ) -> None:
        self.session = session
        self.hold_id = hold_id
        self.entries = entries
        self.keys = [e.key for e in entries]
        self.pairs = [(e.slot, b) for e, b in zip(entries, blocks, strict=True)]
        self.parent = parent
        self.tokens = tokens

    def by_level(self) -> dict[int, list[int]]:
        """The positions in ``pairs`` by the level of the tier each is copied from."""
        out: dict[int, list[int]] = {}
        for i, entry in enumerate(self.entries):
            out.setdefault(entry.level, []).append(i)
        return out


@dataclass(slots=True)
class TierStats:
    """A tier's counters, in blocks (the server turns blocks into bytes).

    ``hits``: blocks an allocate found in the tier past the pool's prefix;
    ``promotions``/``demotions``: blocks copied back/in; ``lost``: copies
    voided because their block was evicted (or flushed) before the copy was
    recorded; ``errors``: copies that failed; ``evictions``: entries the
    tier dropped for room."""

    capacity: int
    blocks: int
    pending: int
    hits: int = 0
    promotions: int = 0
    demotions: int = 0
    lost: int = 0
    evictions: int = 0
    errors: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the stats reply."""
        return asdict(self)


class Tier:
    """Tier ``level`` of one engine: ``num_slots`` slots in the server's tier store.

    ``below``: the tier this one feeds (a chain, `chain`); ``above``: the
    tier feeding this one, whose recorded copies it copies (`fed`)."""

    def __init__(
        self,
        num_slots: int,
        accounts: Accounts,
        holds: HoldTable,
        block_size: int,
        events: Callable[[Event], None] | None,
        *,
        level: int = 1,
    ) -> None:
        self.num_slots = num_slots
        self.level = level
        self._accounts = accounts
        self._holds = holds
        self._bs = block_size
        self._emit = events
        self.below: Tier | None = None
        self.above: Tier | None = None
        #: Free slots (a stack).
        self.free = list(range(num_slots - 1, -1, -1))
        #: Every live entry by name, least recently used first.
        self.entries: OrderedDict[_Name, TierEntry] = OrderedDict()
        #: Entries flushed while a promotion read them (their slots come back at the end).
        self.dead: list[TierEntry] = []
        #: Blocks that became cached, to consider for demotion (oldest first).
        self.fresh: deque[Block] = deque()
        #: Entries the tier above recorded, to copy from it (oldest first).
        self.fed: deque[TierEntry] = deque()
        #: Copies in flight by what they read.
        self.pending: dict[Block | TierEntry, Demotion] = {}
        #: Promotions in flight by (namespace, adapter), with their tier session
        #: (of that adapter: the stored events name it).
        self._sessions: dict[tuple[str, str | None], tuple[SessionAccount, int]] = {}
        self._sids = itertools.count(-1, -1)
        self.stats = TierStats(num_slots, 0, 0)

    # ------------------------------------------------------------------
    # Demotion

    def note(self, blocks: Sequence[Block]) -> None:
        """``blocks`` just became cached: copy them to the tier."""
        self.fresh.extend(blocks)

    def void(self, taken: Sequence[Block]) -> None:
        """``taken`` were just handed to an allocation: copies of them in flight do not count."""
        pending = self.pending
        if pending:
            for block in taken:
                d = pending.pop(block, None)
                if d is not None:
                    d.void = True

    def demotions(self, limit: int) -> list[Demotion]:
        """Up to ``limit`` copies to make now (each with its reserved slot).

        A noted block that lost its key since, or whose key the tier holds
        already, is skipped (so is a fed entry that left the tier above);
        when every slot is taken the least recently used entry that no
        promotion reads is dropped for it; none: it waits."""
        fresh, entries, pending = self.fresh, self.entries, self.pending
        out: list[Demotion] = []
        while fresh and len(out) < limit:
            block = fresh[0]
            index = block.index
            if block.key is None or not isinstance(index, PrefixIndex) or block in pending:
                fresh.popleft()
                continue
            if (index.owner, block.key) in entries:
                fresh.popleft()
                entries.move_to_end((index.owner, block.key))
                continue
            if not self.free and not self._evict_one():
                break
            fresh.popleft()
            ns = self._accounts.namespaces.get(index.owner)
            d = Demotion(block, self.free.pop(), index.owner, ns.epoch if ns else -1)
            pending[block] = d
            out.append(d)
        if self.fed and self.above is not None:
            self._fed_demotions(self.above, limit, out)
        self.stats.pending = len(pending)
        return out

    def _fed_demotions(self, above: Tier, limit: int, out: list[Demotion]) -> None:
        """Copies of the entries the tier ``above`` fed (each pinned there since,
        the pin going to its copy), appended to ``out``."""
        fed, entries, pending = self.fed, self.entries, self.pending
        while fed and len(out) < limit:
            entry = fed[0]
            name = (entry.namespace, entry.key)
            if above.entries.get(name) is not entry:  # flushed since
                above._unpin(fed.popleft())
                continue
            if name in entries:
                entries.move_to_end(name)
                above._unpin(fed.popleft())
                continue
            if not self.free and not self._evict_one():
                break
            fed.popleft()
            d = Demotion(None, self.free.pop(), entry.namespace, -1, entry=entry)
            pending[entry] = d
            out.append(d)

    def _evict_one(self) -> bool:
        """Drop the least recently used unread entry for room; False when every one is read."""
        for name, entry in self.entries.items():
            if not entry.ref:
                del self.entries[name]
                self.free.append(entry.slot)
                self.stats.evictions += 1
                if self._emit is not None and not entry.learned:
                    self._emit(BlockRemoved([entry.key], tier=self.level))
                return True
        return False

    def _unpin(self, entry: TierEntry) -> None:
        """One reader of ``entry`` is done: a dead entry's slot comes back with the last."""
        entry.ref -= 1
        if entry.dead and not entry.ref:
            self.dead.remove(entry)
            self.free.append(entry.slot)

    def _valid(self, d: Demotion) -> bool:
        """Whether copy ``d`` (not voided) still copies what it was made for."""
        if d.void:
            return False
        if d.entry is not None:
            # A flushed or dropped entry left the tier above (its slot kept while read).
            above = self.above
            return above is not None and above.entries.get((d.namespace, d.key)) is d.entry
        ns = self._accounts.namespaces.get(d.namespace)
        # Still cached under the same key object: never dropped since (a flush
        # frees a block without an eviction, and a forgotten namespace comes
        # back at epoch 0, so neither the void nor the epoch alone proves it).
        return (
            d.block is not None and d.block.key is d.key and ns is not None and ns.epoch == d.epoch
        )

    def demoted(self, done: Sequence[Demotion], ok: bool) -> int:
        """The copies ``done`` finished (``ok``) or failed; how many now count
        (each recorded one is fed to the tier below, if any, and pinned until
        it was copied there)."""
        stats, pending, entries = self.stats, self.pending, self.entries
        stored: dict[str, list[bytes]] = {}
        recorded: list[TierEntry] = []
        for d in done:
            if pending.get(d.source) is d:
                del pending[d.source]
            else:
                d.void = True
            valid = self._valid(d)
            if d.entry is not None and self.above is not None:
                self.above._unpin(d.entry)
            name = (d.namespace, d.key)
            if not ok or not valid or name in entries:
                self.free.append(d.slot)
                stats.errors += not ok
                stats.lost += ok and not valid
                continue
            entry = entries[name] = TierEntry(d.slot, d.namespace, d.key, level=self.level)
            recorded.append(entry)
            stored.setdefault(d.namespace, []).append(d.key)
        if self._emit is not None:
            for namespace, keys in stored.items():
                self._emit(
                    BlockStored(
                        keys,
                        None,
                        _NO_TOKENS,
                        block_size=self._bs,
                        namespace=namespace,
                        adapter=None,
                        tier=self.level,
                    )
                )
        if self.below is not None:
            for entry in recorded:  # kept until the tier below has copied it
                entry.ref += 1
            self.below.fed.extend(recorded)
        stats.demotions += len(recorded)
        stats.blocks = len(entries)
        stats.pending = len(pending)
        return len(recorded)

    def learn(self, namespace: str, keys: Sequence[bytes]) -> int:
        """Index ``keys`` of ``namespace`` that another node stored (slots as a
        demotion takes them); how many were new."""
        entries, added = self.entries, 0
        for key in keys:
            name = (namespace, key)
            if name in entries:
                continue
            if not self.free and not self._evict_one():
                break
            entries[name] = TierEntry(self.free.pop(), namespace, key, True, self.level)
            added += 1
        self.stats.blocks = len(entries)
        return added

    # ------------------------------------------------------------------
    # Promotion

    def continuation(self, namespace: str, keys: Sequence[bytes], start: int) -> list[TierEntry]:
        """The entries of the run of ``keys[start:]`` the tier (or, for each key
        it lacks, the tier below) holds, in order."""
        entries, below = self.entries, self.below
        found = []
        for key in keys[start:]:
            entry = entries.get((namespace, key))
            if entry is None and below is not None:
                entry = below.entries.get((namespace, key))
            if entry is None:
                break
            found.append(entry)
        return found

    def _tier_of(self, entry: TierEntry) -> Tier:
        """The tier of the chain ``entry`` belongs to (this one or the one below)."""
        if entry.level == self.level or self.below is None:
            return self
        return self.below

    def promote(
        self,
        sess: SessionAccount,
        hits: list[Block],
        entries: list[TierEntry],
        keys: Sequence[bytes],
        tokens: npt.NDArray[np.int32] | None,
    ) -> Promotion | None:
        """Hold ``hits`` (the pool's part of the prefix) and fresh blocks for
        ``entries`` (the chain's part, after ``keys[len(hits) - 1]``), pin the
        entries; None (nothing changed) when the pool cannot give the blocks.
        ``tokens``: the prompt's token ids (None: unknown)."""
        who = (sess.namespace.name, sess.adapter)
        owner, inflight = self._sessions.get(who, (None, 0))
        if owner is None:
            owner = self._open(*who)
        made = self._holds.hold_fresh(owner, hits, len(entries))
        if made is None:
            if not inflight:
                self._accounts.close(owner)
            return None
        hold_id, blocks = made
        self._sessions[who] = (owner, inflight + 1)
        for entry in entries:
            entry.ref += 1
            self._tier_of(entry).stats.hits += 1
        first, bs = len(hits), self._bs
        if tokens is not None:
            tokens = tokens[first * bs : (first + len(entries)) * bs].copy()
        return Promotion(
            owner,
            hold_id,
            entries=entries,
            blocks=blocks,
            parent=keys[first - 1] if first else None,
            tokens=tokens,
        )

    def _open(self, namespace: str, adapter: str | None) -> SessionAccount:
        sid = next(self._sids)
        self._accounts.open(sid, namespace, adapter, None, 0)
        return self._accounts.sessions[sid]

    def promoted(self, promo: Promotion, ok: bool, failed: Set[int] = frozenset()) -> int:
        """Promotion ``promo``'s copies finished: all of them failed (not ``ok``),
        or those from the tiers of levels ``failed``. Publish the fresh blocks
        before the first failed one, release the hold, unpin the entries (a
        remote one that failed is forgotten); how many were published."""
        owner = promo.session
        bad = {e.level for e in promo.entries} if not ok else failed
        good = next((i for i, e in enumerate(promo.entries) if e.level in bad), len(promo.entries))
        published = 0
        if good:
            blocks = [b for _, b in promo.pairs[:good]]
            tokens = promo.tokens
            published = self._holds.publish(
                owner,
                promo.hold_id,
                blocks,
                promo.keys[:good],
                tokens=None if tokens is None else tokens[: good * self._bs],
                parent=promo.parent,
            )
        self._holds.release(owner, promo.hold_id, None)
        for i, entry in enumerate(promo.entries):
            tier = self._tier_of(entry)
            name = (entry.namespace, entry.key)
            if i < good:
                tier.stats.promotions += 1
            elif entry.level in bad:
                # A block copied fine after a failed one is dropped, not an error.
                tier.stats.errors += 1
                if tier.level > 1 and tier.entries.get(name) is entry:
                    del tier.entries[name]
                    entry.dead = True
                    tier.dead.append(entry)
                    if tier._emit is not None and not entry.learned:
                        tier._emit(BlockRemoved([entry.key], tier=tier.level))
            tier._unpin(entry)
            if not entry.dead:
                tier.entries.move_to_end(name)
        who = (owner.namespace.name, owner.adapter)
        left = self._sessions[who][1] - 1
        if left:
            self._sessions[who] = (owner, left)
        else:
            del self._sessions[who]
            self._accounts.close(owner)
        return published

    # ------------------------------------------------------------------
    # Flush and checks

    def flush(self, namespace: str | None) -> None:
        """Drop the entries of ``namespace`` (all when None); entries being read
        keep their slots until read. The caller emits the events."""
        entries = self.entries
        for name in [n for n in entries if namespace is None or n[0] == namespace]:
            entry = entries.pop(name)
            if entry.ref:
                entry.dead = True
                self.dead.append(entry)
            else:
                self.free.append(entry.slot)
        self.stats.blocks = len(entries)

    def flush_chain(self, namespace: str | None) -> list[BlockRemoved]:
        """`flush` this tier and the ones below; the events of a flush of
        ``namespace`` (none for a flush of all: AllBlocksCleared says it for every tier)."""
        events: list[BlockRemoved] = []
        tier: Tier | None = self
        while tier is not None:
            keys = tier.removed_keys(namespace) if namespace is not None else []
            tier.flush(namespace)
            if keys:
                events.append(BlockRemoved(keys, tier=tier.level))
            tier = tier.below
        return events

    def removed_keys(self, namespace: str) -> list[bytes]:
        """The keys of ``namespace``'s entries (for the event of a flush)."""
        return [key for ns, key in self.entries if ns == namespace]

    def snapshot(self) -> TierStats:
        """A copy of the counters."""
        self.stats.blocks = len(self.entries)
        self.stats.pending = len(self.pending)
        return TierStats(**asdict(self.stats))

    def check(self, problems: list[str]) -> None:
        """Append what is wrong with the tier's state (and the tiers' below) to ``problems``."""
        slots = [e.slot for e in self.entries.values()] + [e.slot for e in self.dead]
        slots += [d.slot for d in self.pending.values()] + self.free
        # Voided copies still in flight hold slots the server gives back on completion.
        if len(set(slots)) != len(slots) or len(slots) > self.num_slots:
            problems.append(f"tier slots: {len(slots)} accounted, {len(set(slots))} distinct")
        for (ns, key), entry in self.entries.items():
            if (
                entry.namespace != ns
                or entry.key != key
                or entry.dead
                or entry.ref < 0
                or entry.level != self.level
            ):
                problems.append(f"tier entry {key.hex()[:12]} of {ns!r} is inconsistent")
        for source, d in self.pending.items():
            if d.source is not source or d.void:
                problems.append(f"tier copy of {d.key.hex()[:12]} is inconsistent")
        for owner, inflight in self._sessions.values():
            held = len(owner.holds)
            if held != inflight or self._accounts.sessions.get(owner.sid) is not owner:
                problems.append(f"tier session {owner.sid}: {held} holds, {inflight} promotions")
        # Every entry of the tier above waiting for (or in) a copy down is pinned there.
        reading = [d.entry for d in self.pending.values() if d.entry is not None]
        if any(entry.ref < 1 for entry in [*self.fed, *reading]):
            problems.append("a tier entry fed to the tier below is not pinned")
        if self.below is not None:
            self.below.check(problems)


def chain(
    slots: Sequence[int],
    accounts: Accounts,
    holds: HoldTable,
    block_size: int,
    events: Callable[[Event], None] | None,
    *,
    level: int = 1,
) -> Tier | None:
    """The tiers of ``slots``: the i-th (none where it is 0) at level ``level + i``,
    each feeding the next; the first, or None when there is none."""
    tiers = [
        Tier(n, accounts, holds, block_size, events, level=level + i)
        for i, n in enumerate(slots)
        if n
    ]
    for upper, lower in itertools.pairwise(tiers):
        upper.below, lower.above = lower, upper
    return tiers[0] if tiers else None
