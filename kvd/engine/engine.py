"""The engine: the sequence operations of one pool over its blocks, accounts and prefix cache."""

from __future__ import annotations

import itertools
import operator
from typing import Any

import numpy as np
from kvd_client.wire.hashing import BlockHasher

from kvd.engine.accounts import Accounts, SessionAccount, pin_refs
from kvd.engine.adaptive import AdaptivePool
from kvd.engine.block import Block, idle, ids
from kvd.engine.checks import TokensLike, as_tokens, count, sequence_id
from kvd.engine.config import EngineConfig
from kvd.engine.errors import ExistsError, InvalidError, InvariantError, NotFoundError
from kvd.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvd.engine.frequency import FrequencyPool
from kvd.engine.holds import HoldTable, keys_of
from kvd.engine.invariants import check_invariants
from kvd.engine.pool import BlockPool
from kvd.engine.results import (
    Allocation,
    Appended,
    Committed,
    Forked,
    Granted,
    Looked,
    Pinned,
    Refusal,
    Truncated,
)
from kvd.engine.sequence import SequenceState
from kvd.engine.stats import EngineStats, NamespaceStats
from kvd.engine.tier import Promotion, chain

__all__ = ["Engine"]

_KEY = operator.attrgetter("key")
#: The pool class of each ``EngineConfig.eviction`` setting.
_POOLS: dict[str, type[BlockPool]] = {
    pool.policy: pool for pool in (BlockPool, FrequencyPool, AdaptivePool)
}


class Engine:
    """The block engine and prefix cache of one pool (see docs/architecture.md).

    Synchronous, metadata only: block ids, ref counts, keys and token ids.
    Every operation validates its arguments (raising an `EngineError`
    subclass) and checks capacity (returning a `Refusal`) before it changes
    anything. Side effects on the prefix cache are queued as events that
    the caller takes with `drain_events`.

    Reservations: a sequence promised growth to ``reserve`` tokens holds
    ``ceil(reserve / bs) - len(table)`` blocks in reserve, plus one for a
    private copy while its partial last block may be shared or cached. That
    flag is set by the sequence's own operations and by forks of it, and is
    cleared only by its own next write, so it may over-reserve one block
    after another holder lets go; it never under-reserves, which is why
    growth within a reservation cannot be refused.

    Duplicates: when a committed block's key is already in the index
    (another sequence computed the same block at the same time), the new
    block stays private, without a key; the index keeps one block per key.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self._pool = _POOLS[config.eviction](config.num_blocks)
        self._hasher = BlockHasher(config.block_size, config.hash_seed)
        self._accounts = Accounts(self._pool, config.watermark_blocks, config.max_held_per_session)
        #: The accounts' session table, looked up by every call.
        self._sessions = self._accounts.sessions
        self._emit = config.events
        self._events: list[Event] = []
        self._holds = HoldTable(
            self._pool,
            self._accounts,
            config.block_size,
            self._queue_event if config.events else None,
        )
        #: The first tier's metadata (None: no tier; `Tier.below`: the next of a
        #: chain); the server copies the bytes.
        self.tier = chain(
            [config.tier_blocks, config.remote_blocks],
            self._accounts,
            self._holds,
            config.block_size,
            self._queue_event if config.events else None,
            level=config.tier_level,
        )
        if self.tier is not None:
            self._holds.on_evict = self.tier.void
            self._holds.on_stored = self.tier.note
        self._pin_ids = itertools.count(1)
        #: Pinned block -> its pins (few blocks are pinned: no slot on every block).
        self._pins: dict[Block, int] = {}
        self._queries = 0
        self._query_tokens = 0
        self._hit_tokens = 0

    # ------------------------------------------------------------------
    # Sessions and namespaces

    def open_session(
        self,
        sid: int,
        namespace: str = "",
        adapter: str | None = None,
        quota: int | None = None,
        minimum: int = 0,
    ) -> None:
        """Register a client session in ``namespace`` with an adapter identity,
        a hard quota and a guaranteed minimum (in blocks)."""
        self._accounts.open(sid, namespace, adapter, quota, minimum)

    def set_namespace_limits(
        self, namespace: str, quota: int | None = None, minimum: int = 0
    ) -> None:
        """Set a namespace's hard quota and guaranteed minimum (in blocks).

        A quota below the namespace's current usage is refused (INVALID):
        quotas are never exceeded.
        """
        self._accounts.set_limits(namespace, quota, minimum)

    def close_session(self, sid: int) -> None:
        """Free the session's sequences and release its pins and holds;
        committed blocks stay cached."""
        sess = self._session(sid)
        for seq_id in list(sess.seqs):
            self.free(sid, seq_id)
        for pin_id in list(sess.pins):
            self.unpin(sid, pin_id)
        self._holds.close(sess)
        self._accounts.close(sess)

    def sequences_of(self, sid: int) -> int:
        """How many sequences session ``sid`` holds (NOT_FOUND for an unknown session).

        A query, not a call of the session's own: it settles nothing (the
        daemon asks it about quarantined sessions too)."""
        return len(self._accounts.find(sid).seqs)

    def _session(self, sid: int) -> SessionAccount:
        """The session of a call made by ``sid`` itself, its pending copy
        sources released (see `_settle`)."""
        sess = self._accounts.find(sid)
        if sess.pending:
            self._settle(sess)
        return sess

    def _seq(self, sid: int, seq_id: str) -> tuple[SessionAccount, SequenceState]:
        """Like `_session`, for a call naming one of the session's sequences."""
        try:
            sess = self._sessions[sid]
            seq = sess.seqs[seq_id]
        except (KeyError, TypeError):
            self._session(sid)
            raise NotFoundError(f"no sequence {seq_id!r} in session {sid}") from None
        if sess.pending:
            self._settle(sess)
        return sess, seq

    def _settle(self, sess: SessionAccount) -> None:
        """Release the sources of the copies named in the session's last reply.

        The client performs a reply's copies before its call returns and a
        session's calls are serialised, so any later call of the session
        proves them done. Every call of the session settles first, before it
        validates anything: a call that then raises or is refused changes
        nothing else (the settlement belongs to the previous call).
        """
        pending = sess.pending
        self._pool.release(pending)
        self._accounts.charge(sess, -len(pending), 0)
        pending.clear()

    def can_allocate(
        self, sid: int, num_tokens: int, reserve: int | None = None
    ) -> tuple[bool, int]:
        """Would an allocation of ``num_tokens`` tokens reserving room for
        ``reserve`` be admitted now (ignoring prefix hits, which only help)?
        Also: how many blocks ``sess`` could take now. Changes nothing but
        the settlement every call of the session makes (see `_settle`)."""
        sess = self._session(sid)
        n = count(num_tokens, "num_tokens")
        target = n if reserve is None else max(n, count(reserve, "reserve"))
        need = -(-target // self.block_size)
        avail = self._accounts.room(sess)
        return need <= avail, avail

    # ------------------------------------------------------------------
    # Sequences

    def allocate(
        self,
        sid: int,
        seq_id: str,
        tokens: TokensLike,
        reserve: int | None = None,
        keys: list[bytes] | None = None,
    ) -> Allocation | Refusal:
        """Create sequence ``seq_id`` for ``tokens``: match the longest cached
        prefix (capped so the last token is always computed), allocate the
        rest and hold blocks in reserve for growth to ``reserve`` tokens
        (None, or no more than the prompt: no reservation). Prefix hits
        count as committed.

        ``keys``: the caller's keys of every full block of ``tokens`` (the
        daemon's clients compute them, so its request thread never hashes);
        None: the engine hashes what it needs."""
        sess = self._session(sid)
        if sequence_id(seq_id) in sess.seqs:
            raise ExistsError(f"sequence {seq_id!r} already exists in session {sid}")
        arr = as_tokens(tokens)
        length = arr.shape[0]
        target = length if reserve is None else max(length, count(reserve, "reserve"))
        bs = self.block_size
        num_blocks = -(-length // bs)
        reserve_blocks = -(-target // bs)
        out = reserve_blocks - num_blocks
        ns = sess.namespace
        cap = (length - 1) // bs if length else 0
        if keys is None:
            keys = (
                self._hasher.keys(arr[: cap * bs], None, namespace=ns.name, adapter=sess.adapter)
                if cap
                else []
            )
            hits = ns.index.match(keys)
        else:
            keys = keys_of(keys, "keys")
            if len(keys) != length // bs:
                raise InvalidError(
                    f"{length} tokens have {length // bs} full blocks, got {len(keys)} keys"
                )
            hits = ns.index.match(keys, cap)
        num_hits = len(hits)
        idle_hits = idle(hits)
        refusal = self._accounts.admit(
            sess, num_blocks + out, num_blocks - num_hits + idle_hits + out, True
        )
        if refusal is not None:
            return refusal

        pool = self._pool
        pool.match(hits)
        removed: list[bytes] = []
        table = hits
        table += pool.take(num_blocks - num_hits, removed)
        if removed:
            if self._emit:
                self._events.append(BlockRemoved(removed))
            self._accounts.forget_emptied()
            if self.tier is not None:
                self.tier.void(table[num_hits:])
        buf = np.empty(max(target + bs, 64), dtype=np.int32)
        buf[:length] = arr
        seq = SequenceState(
            seq_id,
            ns.epoch,
            tokens=buf,
            length=length,
            table=table,
            keys=keys,
            num_cached=num_hits,
            reserve=target,
            reserve_blocks=reserve_blocks,
            out=out,
        )
        hit_tokens = num_hits * bs
        seq.committed = hit_tokens
        sess.seqs[seq_id] = seq
        self._accounts.charge(sess, num_blocks + out, out)
        ns.queries += 1
        ns.query_tokens += length
        ns.hit_tokens += hit_tokens
        self._queries += 1
        self._query_tokens += length
        self._hit_tokens += hit_tokens
        return Allocation(ids(table), hit_tokens, out)

    def commit(self, sid: int, seq_id: str, n: int | None = None) -> Committed:
        """The first ``n`` tokens (all when None) are written. Full blocks
        among them become matchable, unless their key is already cached (the
        block then stays private: one block per key) or the sequence
        predates a flush of its namespace."""
        sess, seq = self._seq(sid, seq_id)
        if n is None:
            n = seq.length
        else:
            n = count(n, "n")
            if n > seq.length:
                raise InvalidError(f"cannot commit {n} tokens of a {seq.length}-token sequence")
        if n <= seq.committed:
            return Committed(seq.committed, 0)
        seq.committed = n
        bs = self.block_size
        full = n // bs
        start = seq.num_cached
        if full <= start:
            return Committed(n, 0)
        seq.num_cached = full
        ns = sess.namespace
        if seq.epoch != ns.epoch:
            return Committed(n, 0)
        keys = seq.keys
        have = len(keys)
        if have < full:
            keys += self._hasher.keys(
                seq.tokens[have * bs : full * bs],
                keys[have - 1] if have else None,
                first_block=have,
                namespace=ns.name,
                adapter=sess.adapter,
            )
        index = ns.index
        blocks = seq.table[start:full]
        new_keys = keys[start:full]
        if not any(map(_KEY, blocks)) and index.keys().isdisjoint(new_keys):
            # The usual case: every block is new to the cache; one C-level update.
            index.update(zip(new_keys, blocks, strict=True))
            for block, key in zip(blocks, new_keys, strict=True):
                block.key = key
                block.index = index
            self._pool.publish(blocks)
            self._stored(sess, seq, start, full)
            stored = blocks
        else:
            stored, runs = index.insert(blocks, new_keys, start)
            for run in runs:
                self._stored(sess, seq, *run)
            self._pool.publish(stored)
        if self.tier is not None:
            self.tier.note(stored)
        return Committed(n, len(stored))

    def _stored(self, sess: SessionAccount, seq: SequenceState, start: int, end: int) -> None:
        if self._emit:
            bs = self.block_size
            self._events.append(
                BlockStored(
                    seq.keys[start:end],
                    seq.keys[start - 1] if start else None,
                    seq.tokens[start * bs : end * bs].copy(),
                    block_size=bs,
                    namespace=sess.namespace.name,
                    adapter=sess.adapter,
                )
            )

    def append(
        self, sid: int, seq_id: str, tokens: TokensLike, keys: list[bytes] | None = None
    ) -> Appended | Refusal:
        """Grow the sequence by ``tokens``. Writing into a partial last block
        that is shared or cached first moves the sequence to a private copy,
        named in ``copies``; the copy's source stays held, charged to the
        session, until the session's next call (the client copies in
        between). Growth within the reservation is never refused; beyond it,
        appends may use the watermark. ``keys``: the caller's keys of the
        blocks this append fills (see `allocate`)."""
        sess, seq = self._seq(sid, seq_id)
        arr = as_tokens(tokens)
        k = arr.shape[0]
        table = seq.table
        num_blocks = len(table)
        length = seq.length
        bs = self.block_size
        new_length = length + k
        if keys is not None:
            keys = keys_of(keys, "keys")
            want = new_length // bs - len(seq.keys)
            if len(keys) != want:
                raise InvalidError(
                    f"the append fills {want} blocks without keys, got {len(keys)} keys"
                )
        if k == 0:
            return Appended(num_blocks, [], [], length)
        new_blocks = -(-new_length // bs) - num_blocks
        cow = 0
        if length % bs:
            last = table[-1]
            if last.ref > 1 or last.key is not None:
                cow = 1
        new_out = seq.reserve_blocks - num_blocks - new_blocks if new_length < seq.reserve else 0
        d_out = new_out - seq.out
        # The copy's source stays held (and charged) until the session's next
        # call: within the reservation that is the copy block it reserved.
        usage = new_blocks + cow + d_out
        demand = new_blocks + cow + d_out
        if usage > 0 or demand > 0:
            refusal = self._accounts.admit(sess, usage, demand, False)
            if refusal is not None:
                return refusal

        seq.write(arr)
        if keys:
            seq.keys += keys
        seq.cow = False
        if not (cow or new_blocks):
            # The common decode step: the token lands in the private last block.
            if d_out:
                seq.out = new_out
                self._accounts.charge(sess, usage, d_out)
            return Appended(num_blocks, [], [], new_length)

        copies: list[tuple[int, int]] = []
        start = num_blocks
        pool = self._pool
        removed: list[bytes] = []
        taken = pool.take(new_blocks + cow, removed)
        if removed:
            if self._emit:
                self._events.append(BlockRemoved(removed))
            self._accounts.forget_emptied()
            if self.tier is not None:
                self.tier.void(taken)
        if cow:
            src = table[-1]
            dst = taken[0]
            table[-1] = dst
            # Not released yet: the client copies from it after the reply,
            # and a block released now could be taken and overwritten first.
            sess.pending.append(src)
            copies.append((src.block_id, dst.block_id))
            start -= 1
            taken = taken[1:]
        table += taken
        seq.out = new_out
        self._accounts.charge(sess, usage, d_out)
        return Appended(start, ids(table[start:]), copies, new_length)

    def fork(
        self, sid: int, seq_id: str, child_id: str, reserve: int | None = None
    ) -> Forked | Refusal:
        """Create ``child_id`` sharing every block of ``seq_id`` (ref + 1
        each), its tokens and commit state; reserve room for the child to
        grow to ``reserve`` tokens."""
        sess, seq = self._seq(sid, seq_id)
        if sequence_id(child_id) in sess.seqs:
            raise ExistsError(f"sequence {child_id!r} already exists in session {sid}")
        length = seq.length
        target = length if reserve is None else max(length, count(reserve, "reserve"))
        bs = self.block_size
        table = seq.table
        num_blocks = len(table)
        partial = length % bs != 0
        child_reserve_blocks = -(-target // bs)
        child_out = child_reserve_blocks - num_blocks + partial if length < target else 0
        parent_out = (
            seq.reserve_blocks - num_blocks + (seq.cow or partial) if length < seq.reserve else 0
        )
        d_parent = parent_out - seq.out
        demand = child_out + d_parent
        refusal = self._accounts.admit(sess, num_blocks + demand, demand, True)
        if refusal is not None:
            return refusal

        self._pool.touch(table)
        seq.cow = seq.cow or partial
        seq.out = parent_out
        # The token buffer is shared until either side writes (n-way sampling
        # forks a long prompt many times; a copy each was 80% of a fork's heap).
        seq.shared = True
        child = SequenceState(
            child_id,
            seq.epoch,
            tokens=seq.tokens,
            length=length,
            table=table[:],
            keys=seq.keys[:],
            num_cached=seq.num_cached,
            reserve=target,
            reserve_blocks=child_reserve_blocks,
            out=child_out,
        )
        child.committed = seq.committed
        child.cow = partial
        child.shared = True
        sess.seqs[child_id] = child
        self._accounts.charge(sess, num_blocks + demand, demand)
        return Forked(ids(table))

    def truncate(self, sid: int, seq_id: str, n: int) -> Truncated:
        """Keep the first ``n`` tokens: whole blocks past the new end are
        released (tail first); every block keeps its full capacity. A
        shared or cached block that becomes the partial last block is
        copied before the next write into it (see `append`).

        Growing back to the reservation may need more blocks than the
        sequence held (blocks it released were shared, or its last block
        now needs a copy); when the pool or a quota cannot back that, the
        reservation shrinks to what can be backed.
        """
        sess, seq = self._seq(sid, seq_id)
        n = count(n, "n")
        length = seq.length
        if n > length:
            raise InvalidError(f"cannot truncate a {length}-token sequence to {n} tokens")
        bs = self.block_size
        table = seq.table
        if n == length:
            return Truncated(length, len(table))
        num_blocks = -(-n // bs)
        released = table[num_blocks:]
        freed = [b.ref for b in released].count(1)
        last = table[num_blocks - 1] if num_blocks else None
        cow = n % bs != 0 and last is not None and (last.ref > 1 or last.key is not None)
        reserve, reserve_blocks = seq.reserve, seq.reserve_blocks
        out = reserve_blocks - num_blocks + cow if n < reserve else 0
        d_out = out - seq.out
        # Held blocks drop by len(released); the pool gets `freed` back.
        if d_out > 0:
            allowed = freed + self._accounts.available(sess, False)
            for account in (sess, sess.namespace):
                if account.quota is not None:
                    allowed = min(allowed, len(released) + account.quota - account.usage)
            if d_out > allowed:
                # Shrink the reservation to the most that can be backed.
                budget = seq.out + max(allowed, 0)
                reserve = min(reserve, (num_blocks + budget - cow) * bs) if budget >= cow else n
                reserve_blocks = -(-reserve // bs)
                out = reserve_blocks - num_blocks + cow if n < reserve else 0
                d_out = out - seq.out

        del table[num_blocks:]
        self._pool.release(reversed(released))
        seq.length = n
        seq.committed = min(seq.committed, n)
        del seq.keys[n // bs :]
        seq.num_cached = min(seq.num_cached, n // bs)
        seq.cow = cow
        seq.reserve, seq.reserve_blocks, seq.out = reserve, reserve_blocks, out
        self._accounts.charge(sess, d_out - len(released), d_out)
        return Truncated(n, num_blocks)

    def free(self, sid: int, seq_id: str) -> None:
        """Release the sequence; its blocks are released tail first, so a
        chain's tail is evicted before its head. Committed blocks stay cached."""
        sess, seq = self._seq(sid, seq_id)
        del sess.seqs[seq_id]
        table = seq.table
        self._pool.release(reversed(table))
        self._accounts.charge(sess, -len(table) - seq.out, -seq.out)

    # ------------------------------------------------------------------
    # Pins

    def pin(self, sid: int, seq_id: str, n: int | None = None) -> Pinned | Refusal:
        """Pin the cached full blocks among the first ``n`` committed tokens
        (all committed when None): the leading run of the sequence's blocks
        that are in the prefix cache. Pinned blocks are never evicted and
        count against the session's quota until `unpin`."""
        sess, seq = self._seq(sid, seq_id)
        if n is None:
            n = seq.committed
        else:
            n = count(n, "n")
            if n > seq.committed:
                raise InvalidError(f"cannot pin {n} tokens: only {seq.committed} are committed")
        blocks = []
        for block in seq.table[: n // self.block_size]:
            if block.key is None:
                break
            blocks.append(block)
        accounts = self._accounts
        refs = pin_refs(blocks)
        refusal = accounts.over_held(sess, refs) or accounts.admit(sess, len(blocks), 0, False)
        if refusal is not None:
            return refusal
        pins = self._pins
        for block in blocks:
            block.ref += 1
            pins[block] = pins.get(block, 0) + 1
        pin_id = next(self._pin_ids)
        sess.pins[pin_id] = blocks
        sess.held += refs
        accounts.charge(sess, len(blocks), 0)
        return Pinned(pin_id, len(blocks))

    def unpin(self, sid: int, pin_id: int) -> None:
        """Release a pin of this session."""
        sess = self._session(sid)
        try:
            blocks = sess.pins.pop(pin_id)
        except (KeyError, TypeError):
            raise NotFoundError(f"no pin {pin_id!r} in session {sid}") from None
        pins = self._pins
        for block in blocks:
            left = pins[block] - 1
            if left:
                pins[block] = left
            else:
                del pins[block]
        self._pool.release(reversed(blocks))
        sess.held -= pin_refs(blocks)
        self._accounts.charge(sess, -len(blocks), 0)

    # ------------------------------------------------------------------
    # Holds (the block-level mode, `kvd.engine.holds`)

    def lookup(self, sid: int, keys: list[bytes], hold: bool = False) -> Looked | Refusal:
        """How many leading ``keys`` are cached in the session's namespace; with
        ``hold``, those blocks held (refused like an allocation when they cannot be)."""
        return self._holds.lookup(self._session(sid), keys, hold)

    def grant(self, sid: int, n: int) -> Granted | Refusal:
        """``n`` fresh blocks held for the session to write and then `publish`."""
        return self._holds.grant(self._session(sid), n)

    def publish(
        self,
        sid: int,
        hold_id: int,
        blocks: list[int],
        keys: list[bytes],
        *,
        tokens: TokensLike,
        parent: bytes | None = None,
    ) -> int:
        """Granted ``blocks`` are written: cache them under ``keys``; how many were."""
        sess = self._session(sid)
        return self._holds.publish(
            sess, hold_id, blocks, keys, tokens=as_tokens(tokens), parent=parent
        )

    def release(self, sid: int, hold_id: int, blocks: list[int] | None = None) -> int:
        """Let go of a hold's blocks (all when None), made by any session of the
        namespace; how many were released (0 for a hold that is gone)."""
        return self._holds.release(self._session(sid), hold_id, blocks)

    # ------------------------------------------------------------------
    # Cache control

    def flush(self, namespace: str | None = None) -> int:
        """Drop every cached block (of ``namespace``, or of all): evictable
        ones become free at once, blocks in use lose their keys; the
        namespace's epoch moves on, so sequences from before the flush never
        publish. Returns how many blocks left the cache."""
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidError(f"namespace must be a str or None, got {type(namespace).__name__}")
        targets = (
            list(self._accounts.namespaces.values())
            if namespace is None
            else [ns for ns in (self._accounts.namespaces.get(namespace),) if ns is not None]
        )
        removed: list[bytes] = []
        drop_key = self._pool.drop_key
        for ns in targets:
            removed += ns.index
            for block in ns.index.values():
                drop_key(block)
            ns.index.clear()
            ns.epoch += 1
            self._accounts.forget_if_unused(ns)
        tier_removed = self.tier.flush_chain(namespace) if self.tier is not None else []
        if self._emit:
            if namespace is None:
                self._events.append(AllBlocksCleared())
            elif removed:
                self._events.append(BlockRemoved(removed))
            self._events += tier_removed
        return len(removed)

    # ------------------------------------------------------------------
    # Tier 1 (`kvd.engine.tier`)

    def promote(
        self, sid: int, seq_id: str, tokens: TokensLike, keys: list[bytes] | None = None
    ) -> Promotion | None:
        """Tier 1's continuation of the prefix an allocate of ``seq_id`` for
        ``tokens`` would match, held for copying into the pool before that
        allocate runs; None (nothing changed) when there is no tier, no
        continuation, the pool cannot take it or the allocate would fail
        (a sequence that exists, keys that do not fit the tokens)."""
        tier = self.tier
        sess = self._accounts.find(sid)
        if tier is None or not isinstance(seq_id, str) or seq_id in sess.seqs:
            return None
        arr = as_tokens(tokens)
        length = arr.shape[0]
        bs = self.block_size
        cap = (length - 1) // bs if length else 0
        ns = sess.namespace
        if keys is None:
            keys = (
                self._hasher.keys(arr[: cap * bs], None, namespace=ns.name, adapter=sess.adapter)
                if cap
                else []
            )
        elif len(keys_of(keys, "keys")) != length // bs:
            return None
        return self._promote(sess, keys[:cap], arr)

    def promote_keys(self, sid: int, keys: list[bytes]) -> Promotion | None:
        """Tier 1's continuation of the run a held `lookup` of ``keys`` would
        find, held for copying into the pool before that lookup runs (no token
        ids: the promoted blocks' stored events carry none); None as `promote`."""
        sess = self._accounts.find(sid)
        if self.tier is None:
            return None
        return self._promote(sess, keys_of(keys, "keys"), None)

    def _promote(
        self, sess: SessionAccount, keys: list[bytes], tokens: np.ndarray[Any, Any] | None
    ) -> Promotion | None:
        tier = self.tier
        assert tier is not None
        ns = sess.namespace
        hits = ns.index.match(keys)
        entries = tier.continuation(ns.name, keys, len(hits))
        return tier.promote(sess, hits, entries, keys, tokens) if entries else None

    def _queue_event(self, event: Event) -> None:
        self._events.append(event)

    def drain_events(self) -> list[Event]:
        """Take the events queued since the last call, oldest first."""
        events = self._events
        self._events = []
        return events

    # ------------------------------------------------------------------
    # Observation

    def born(self) -> int:
        """Block records created so far: the pool creates them on first use
        and keeps them for its life."""
        return len(self._pool.blocks)

    def stats(self) -> EngineStats:
        """A snapshot of the counters (plain data)."""
        pool = self._pool
        free = pool.num_free()
        evictable = pool.evictable
        return EngineStats(
            blocks_total=pool.num_blocks,
            blocks_free=free,
            blocks_evictable=evictable,
            blocks_in_use=pool.num_blocks - free - evictable,
            blocks_pinned=len(self._pins),
            reserved=self._accounts.outstanding,
            sequences=sum(len(s.seqs) for s in self._sessions.values()),
            sessions=len(self._sessions),
            holds=len(self._holds.holds),
            held_blocks=sum(len(h.blocks) for h in self._holds.holds.values()),
            prefix_queries=self._queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            evictions=pool.evictions,
            refusals={str(code): n for code, n in self._accounts.refusals.items()},
            namespaces={
                name: NamespaceStats(
                    queries=ns.queries,
                    query_tokens=ns.query_tokens,
                    hit_tokens=ns.hit_tokens,
                    usage=ns.usage,
                    cached_blocks=len(ns.index),
                    epoch=ns.epoch,
                )
                for name, ns in self._accounts.namespaces.items()
            },
            session_usage={sid: s.usage for sid, s in self._sessions.items()},
            tier=self.tier.snapshot() if self.tier is not None else None,
            tier_below=self.tier.below.snapshot() if self.tier and self.tier.below else None,
        )

    def check_invariants(self) -> None:
        """Recompute every derived quantity from scratch and compare; raise
        `InvariantError` listing every problem found (see `kvd.engine.invariants`)."""
        check_invariants(self._pool, self._accounts, self._pins, self._holds.holds, self.block_size)
        if self.tier is not None:
            problems: list[str] = []
            self.tier.check(problems)
            if problems:
                raise InvariantError(problems)
