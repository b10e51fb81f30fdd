"""The engine: sequences, block tables, prefix cache and admission of one pool."""

from __future__ import annotations

import itertools
import operator

import numpy as np
import numpy.typing as npt

from kvd.engine.admission import unmet_minimums
from kvd.engine.block import Block
from kvd.engine.config import EngineConfig
from kvd.engine.errors import (
    Code,
    ExistsError,
    InvalidError,
    InvariantError,
    NotFoundError,
)
from kvd.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvd.engine.frequency import FrequencyPool
from kvd.engine.hashing import BlockHasher
from kvd.engine.namespace import Namespace
from kvd.engine.pool import BlockPool
from kvd.engine.results import (
    Allocation,
    Appended,
    Committed,
    Forked,
    Pinned,
    Refusal,
    Truncated,
)
from kvd.engine.sequence import Sequence
from kvd.engine.session import Session
from kvd.engine.stats import EngineStats, NamespaceStats

__all__ = ["Engine", "TokensLike"]

#: Token ids: any 1-D integer sequence; int32 arrays take the fast path.
TokensLike = npt.ArrayLike

_INT32 = np.dtype(np.int32)
_MAX_TOKEN = 2**31 - 1
_EMPTY = np.empty(0, dtype=np.int32)
_EMPTY.flags.writeable = False
#: Small arrays are checked through a list: numpy's reductions cost more.
_SMALL = 16
_KEY = operator.attrgetter("key")
#: The pool class of each ``EngineConfig.eviction`` setting.
_POOLS: dict[str, type[BlockPool]] = {pool.policy: pool for pool in (BlockPool, FrequencyPool)}
_BLOCK_ID = operator.attrgetter("block_id")


def _as_tokens(tokens: TokensLike) -> npt.NDArray[np.int32]:
    """``tokens`` as a 1-D int32 array (no copy when it already is one)."""
    if type(tokens) is np.ndarray and tokens.dtype is _INT32 and tokens.ndim == 1:
        # The wire decoder's form: only the sign needs checking.
        n = tokens.shape[0]
        if n and (min(tokens.tolist()) if n <= _SMALL else int(tokens.min())) < 0:
            raise InvalidError("token ids must lie in [0, 2**31)")
        return tokens
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as exc:
            raise InvalidError(f"token ids must be a 1-D integer sequence: {exc}") from None
    if arr.ndim != 1:
        raise InvalidError(f"token ids must be a 1-D sequence, got {arr.ndim} dimensions")
    n = arr.shape[0]
    if n == 0:
        return _EMPTY
    if arr.dtype.kind not in "iu":
        raise InvalidError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise InvalidError("token ids must lie in [0, 2**31)")
    return arr.astype(np.int32)


def _count(value: object, what: str) -> int:
    """A non-negative int argument (numpy integers accepted, bools not)."""
    if type(value) is not int:
        if isinstance(value, bool):
            raise InvalidError(f"{what} must be an int, got bool")
        try:
            value = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidError(f"{what} must be an int, got {type(value).__name__}") from None
    assert isinstance(value, int)
    if value < 0:
        raise InvalidError(f"{what} must be >= 0, got {value}")
    return value


def _limits(quota: object, minimum: object) -> tuple[int | None, int]:
    q = None if quota is None else _count(quota, "quota")
    m = _count(minimum, "minimum")
    if q is not None and m > q:
        raise InvalidError(f"minimum ({m}) exceeds quota ({q})")
    return q, m


def _out(seq: Sequence) -> int:
    """Blocks still needed for ``seq`` to grow to its reservation."""
    if seq.length >= seq.reserve:
        return 0
    return seq.reserve_blocks - len(seq.table) + seq.cow


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
        self._sessions: dict[int, Session] = {}
        self._namespaces: dict[str, Namespace] = {}
        self._outstanding = 0
        self._watermark = config.watermark_blocks
        self._emit = config.events
        self._events: list[Event] = []
        self._pin_ids = itertools.count(1)
        #: Pinned block -> its pins (few blocks are pinned: no slot on every block).
        self._pins: dict[Block, int] = {}
        #: Accounts (sessions and namespaces) with a guaranteed minimum.
        self._minimums = 0
        self._queries = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._refusals: dict[str, int] = {Code.OUT_OF_BLOCKS: 0, Code.QUOTA_EXCEEDED: 0}

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
        if sid in self._sessions:
            raise ExistsError(f"session {sid} is already open")
        if not isinstance(namespace, str):
            raise InvalidError(f"namespace must be a str, got {type(namespace).__name__}")
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            raise InvalidError(f"adapter must be a non-empty str or None, got {adapter!r}")
        q, m = _limits(quota, minimum)
        ns = self._namespace(namespace)
        sess = Session(sid, ns, adapter, q, m)
        self._sessions[sid] = sess
        ns.sessions.add(sess)
        self._minimums += m > 0

    def set_namespace_limits(
        self, namespace: str, quota: int | None = None, minimum: int = 0
    ) -> None:
        """Set a namespace's hard quota and guaranteed minimum (in blocks).

        A quota below the namespace's current usage is refused (INVALID):
        quotas are never exceeded.
        """
        if not isinstance(namespace, str):
            raise InvalidError(f"namespace must be a str, got {type(namespace).__name__}")
        q, m = _limits(quota, minimum)
        existing = self._namespaces.get(namespace)
        if existing is not None and q is not None and q < existing.usage:
            raise InvalidError(
                f"quota {q} is below namespace {namespace!r}'s usage of {existing.usage} blocks"
            )
        ns = self._namespace(namespace)
        self._minimums += (m > 0) - (ns.minimum > 0)
        ns.quota = q
        ns.minimum = m
        self._forget_if_unused(ns)

    def close_session(self, sid: int) -> None:
        """Free the session's sequences and release its pins; committed
        blocks stay cached."""
        sess = self._session(sid)
        for seq_id in list(sess.seqs):
            self.free(sid, seq_id)
        for pin_id in list(sess.pins):
            self.unpin(sid, pin_id)
        del self._sessions[sid]
        sess.namespace.sessions.discard(sess)
        self._minimums -= sess.minimum > 0
        self._forget_if_unused(sess.namespace)

    def sequences_of(self, sid: int) -> int:
        """How many sequences session ``sid`` holds (NOT_FOUND for an unknown session).

        A query, not a call of the session's own: it settles nothing (the
        daemon asks it about quarantined sessions too)."""
        return len(self._find(sid).seqs)

    def _namespace(self, name: str) -> Namespace:
        ns = self._namespaces.get(name)
        if ns is None:
            ns = self._namespaces[name] = Namespace(name)
        return ns

    def _forget_if_unused(self, ns: Namespace) -> None:
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
            and self._namespaces.get(ns.name) is ns
        ):
            del self._namespaces[ns.name]

    def _forget_emptied(self) -> None:
        """Forget the namespaces whose last cached block an eviction just took."""
        emptied = self._pool.emptied
        while emptied:
            ns = self._namespaces.get(emptied.pop().owner)
            if ns is not None:
                self._forget_if_unused(ns)

    def _find(self, sid: int) -> Session:
        try:
            return self._sessions[sid]
        except (KeyError, TypeError):
            raise NotFoundError(f"no session {sid!r}") from None

    def _session(self, sid: int) -> Session:
        """The session of a call made by ``sid`` itself, its pending copy
        sources released (see `_settle`)."""
        sess = self._find(sid)
        if sess.pending:
            self._settle(sess)
        return sess

    def _seq(self, sid: int, seq_id: str) -> Sequence:
        """Like `_session`, for a call naming one of the session's sequences."""
        try:
            sess = self._sessions[sid]
            seq = sess.seqs[seq_id]
        except (KeyError, TypeError):
            self._session(sid)
            raise NotFoundError(f"no sequence {seq_id!r} in session {sid}") from None
        if sess.pending:
            self._settle(sess)
        return seq

    def _settle(self, sess: Session) -> None:
        """Release the sources of the copies named in the session's last reply.

        The client performs a reply's copies before its call returns and a
        session's calls are serialised, so any later call of the session
        proves them done. Every call of the session settles first, before it
        validates anything: a call that then raises or is refused changes
        nothing else (the settlement belongs to the previous call).
        """
        pending = sess.pending
        self._pool.release(pending)
        self._charge(sess, -len(pending), 0)
        pending.clear()

    # ------------------------------------------------------------------
    # Admission

    def _refuse(self, code: Code, message: str) -> Refusal:
        self._refusals[code] += 1
        return Refusal(code, message)

    def _available(self, sess: Session, new: bool) -> int:
        """Blocks ``sess`` may take now: free + evictable, less everyone's
        reservations, the watermark (for new allocations) and the unmet
        minimums of other accounts."""
        avail = self._pool.available() - self._outstanding
        if new:
            avail -= self._watermark
        if self._minimums:
            avail -= unmet_minimums(self._namespaces.values(), sess)
        return avail

    def _admit(self, sess: Session, usage: int, demand: int, new: bool) -> Refusal | None:
        """Refusal unless ``sess`` may grow its usage by ``usage`` blocks and
        the pool may commit ``demand`` more blocks (taken or reserved)."""
        if usage > 0:
            if sess.quota is not None and sess.usage + usage > sess.quota:
                return self._refuse(
                    Code.QUOTA_EXCEEDED,
                    f"session {sess.sid} would use {sess.usage + usage} blocks "
                    f"(quota {sess.quota})",
                )
            ns = sess.namespace
            if ns.quota is not None and ns.usage + usage > ns.quota:
                return self._refuse(
                    Code.QUOTA_EXCEEDED,
                    f"namespace {ns.name!r} would use {ns.usage + usage} blocks (quota {ns.quota})",
                )
        if demand > 0:
            avail = self._available(sess, new)
            if demand > avail:
                return self._refuse(
                    Code.OUT_OF_BLOCKS,
                    f"needs {demand} blocks, {max(avail, 0)} available",
                )
        return None

    def _charge(self, sess: Session, usage: int, out: int) -> None:
        sess.usage += usage
        sess.namespace.usage += usage
        self._outstanding += out

    def can_allocate(
        self, sid: int, num_tokens: int, reserve: int | None = None
    ) -> tuple[bool, int]:
        """Would an allocation of ``num_tokens`` tokens reserving room for
        ``reserve`` be admitted now (ignoring prefix hits, which only help)?
        Also: how many blocks ``sess`` could take now. Changes nothing but
        the settlement every call of the session makes (see `_settle`)."""
        sess = self._session(sid)
        n = _count(num_tokens, "num_tokens")
        target = n if reserve is None else max(n, _count(reserve, "reserve"))
        need = -(-target // self.block_size)
        avail = self._available(sess, True)
        for account in (sess, sess.namespace):
            if account.quota is not None:
                avail = min(avail, account.quota - account.usage)
        avail = max(avail, 0)
        return need <= avail, avail

    # ------------------------------------------------------------------
    # Sequences

    def allocate(
        self, sid: int, seq_id: str, tokens: TokensLike, reserve: int | None = None
    ) -> Allocation | Refusal:
        """Create sequence ``seq_id`` for ``tokens``: match the longest cached
        prefix (capped so the last token is always computed), allocate the
        rest and hold blocks in reserve for growth to ``reserve`` tokens
        (None, or no more than the prompt: no reservation). Prefix hits
        count as committed."""
        sess = self._session(sid)
        if type(seq_id) is not str:
            raise InvalidError(f"sequence id must be a str, got {type(seq_id).__name__}")
        if seq_id in sess.seqs:
            raise ExistsError(f"sequence {seq_id!r} already exists in session {sid}")
        arr = _as_tokens(tokens)
        length = arr.shape[0]
        target = length if reserve is None else max(length, _count(reserve, "reserve"))
        bs = self.block_size
        num_blocks = -(-length // bs)
        reserve_blocks = -(-target // bs)
        out = reserve_blocks - num_blocks
        ns = sess.namespace
        cap = (length - 1) // bs if length else 0
        keys = (
            self._hasher.keys(arr[: cap * bs], None, namespace=ns.name, adapter=sess.adapter)
            if cap
            else []
        )
        hits = ns.index.match(keys)
        num_hits = len(hits)
        idle_hits = [b.ref for b in hits].count(0)
        refusal = self._admit(sess, num_blocks + out, num_blocks - num_hits + idle_hits + out, True)
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
            self._forget_emptied()
        buf = np.empty(max(target + bs, 64), dtype=np.int32)
        buf[:length] = arr
        seq = Sequence(
            seq_id,
            sess,
            ns,
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
        self._charge(sess, num_blocks + out, out)
        ns.queries += 1
        ns.query_tokens += length
        ns.hit_tokens += hit_tokens
        self._queries += 1
        self._query_tokens += length
        self._hit_tokens += hit_tokens
        return Allocation(list(map(_BLOCK_ID, table)), hit_tokens, out)

    def commit(self, sid: int, seq_id: str, n: int | None = None) -> Committed:
        """The first ``n`` tokens (all when None) are written. Full blocks
        among them become matchable, unless their key is already cached (the
        block then stays private: one block per key) or the sequence
        predates a flush of its namespace."""
        seq = self._seq(sid, seq_id)
        if n is None:
            n = seq.length
        else:
            n = _count(n, "n")
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
        ns = seq.namespace
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
                adapter=seq.session.adapter,
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
            self._stored(seq, start, full)
            return Committed(n, full - start)
        stored: list[Block] = []
        run = -1
        for i, block in enumerate(blocks, start):
            if block.key is None:
                key = keys[i]
                if key not in index:
                    index[key] = block
                    block.key = key
                    block.index = index
                    stored.append(block)
                    if run < 0:
                        run = i
                    continue
            if run >= 0:
                self._stored(seq, run, i)
                run = -1
        if run >= 0:
            self._stored(seq, run, full)
        self._pool.publish(stored)
        return Committed(n, len(stored))

    def _stored(self, seq: Sequence, start: int, end: int) -> None:
        if self._emit:
            bs = self.block_size
            self._events.append(
                BlockStored(
                    seq.keys[start:end],
                    seq.keys[start - 1] if start else None,
                    seq.tokens[start * bs : end * bs].copy(),
                    block_size=bs,
                    namespace=seq.namespace.name,
                    adapter=seq.session.adapter,
                )
            )

    def append(self, sid: int, seq_id: str, tokens: TokensLike) -> Appended | Refusal:
        """Grow the sequence by ``tokens``. Writing into a partial last block
        that is shared or cached first moves the sequence to a private copy,
        named in ``copies``; the copy's source stays held, charged to the
        session, until the session's next call (the client copies in
        between). Growth within the reservation is never refused; beyond it,
        appends may use the watermark."""
        seq = self._seq(sid, seq_id)
        arr = _as_tokens(tokens)
        k = arr.shape[0]
        table = seq.table
        num_blocks = len(table)
        length = seq.length
        if k == 0:
            return Appended(num_blocks, [], [], length)
        bs = self.block_size
        new_length = length + k
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
            refusal = self._admit(seq.session, usage, demand, False)
            if refusal is not None:
                return refusal

        seq.write(arr)
        seq.cow = False
        if not (cow or new_blocks):
            # The common decode step: the token lands in the private last block.
            if d_out:
                seq.out = new_out
                self._charge(seq.session, usage, d_out)
            return Appended(num_blocks, [], [], new_length)

        copies: list[tuple[int, int]] = []
        start = num_blocks
        pool = self._pool
        removed: list[bytes] = []
        taken = pool.take(new_blocks + cow, removed)
        if removed:
            if self._emit:
                self._events.append(BlockRemoved(removed))
            self._forget_emptied()
        if cow:
            src = table[-1]
            dst = taken[0]
            table[-1] = dst
            # Not released yet: the client copies from it after the reply,
            # and a block released now could be taken and overwritten first.
            seq.session.pending.append(src)
            copies.append((src.block_id, dst.block_id))
            start -= 1
            taken = taken[1:]
        table += taken
        seq.out = new_out
        self._charge(seq.session, usage, d_out)
        return Appended(start, list(map(_BLOCK_ID, table[start:])), copies, new_length)

    def fork(
        self, sid: int, seq_id: str, child_id: str, reserve: int | None = None
    ) -> Forked | Refusal:
        """Create ``child_id`` sharing every block of ``seq_id`` (ref + 1
        each), its tokens and commit state; reserve room for the child to
        grow to ``reserve`` tokens."""
        seq = self._seq(sid, seq_id)
        sess = seq.session
        if type(child_id) is not str:
            raise InvalidError(f"sequence id must be a str, got {type(child_id).__name__}")
        if child_id in sess.seqs:
            raise ExistsError(f"sequence {child_id!r} already exists in session {sid}")
        length = seq.length
        target = length if reserve is None else max(length, _count(reserve, "reserve"))
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
        refusal = self._admit(sess, num_blocks + demand, demand, True)
        if refusal is not None:
            return refusal

        self._pool.touch(table)
        seq.cow = seq.cow or partial
        seq.out = parent_out
        child = Sequence(
            child_id,
            sess,
            seq.namespace,
            tokens=seq.tokens.copy(),
            length=length,
            table=table[:],
            keys=seq.keys[:],
            num_cached=seq.num_cached,
            reserve=target,
            reserve_blocks=child_reserve_blocks,
            out=child_out,
        )
        child.epoch = seq.epoch
        child.committed = seq.committed
        child.cow = partial
        sess.seqs[child_id] = child
        self._charge(sess, num_blocks + demand, demand)
        return Forked(list(map(_BLOCK_ID, table)))

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
        seq = self._seq(sid, seq_id)
        n = _count(n, "n")
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
        sess = seq.session
        reserve, reserve_blocks = seq.reserve, seq.reserve_blocks
        out = reserve_blocks - num_blocks + cow if n < reserve else 0
        d_out = out - seq.out
        # Held blocks drop by len(released); the pool gets `freed` back.
        if d_out > 0:
            allowed = freed + self._available(sess, False)
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
        self._charge(sess, d_out - len(released), d_out)
        return Truncated(n, num_blocks)

    def free(self, sid: int, seq_id: str) -> None:
        """Release the sequence; its blocks are released tail first, so a
        chain's tail is evicted before its head. Committed blocks stay cached."""
        seq = self._seq(sid, seq_id)
        sess = seq.session
        del sess.seqs[seq_id]
        table = seq.table
        self._pool.release(reversed(table))
        self._charge(sess, -len(table) - seq.out, -seq.out)

    # ------------------------------------------------------------------
    # Pins

    def pin(self, sid: int, seq_id: str, n: int | None = None) -> Pinned | Refusal:
        """Pin the cached full blocks among the first ``n`` committed tokens
        (all committed when None): the leading run of the sequence's blocks
        that are in the prefix cache. Pinned blocks are never evicted and
        count against the session's quota until `unpin`."""
        seq = self._seq(sid, seq_id)
        if n is None:
            n = seq.committed
        else:
            n = _count(n, "n")
            if n > seq.committed:
                raise InvalidError(f"cannot pin {n} tokens: only {seq.committed} are committed")
        blocks = []
        for block in seq.table[: n // self.block_size]:
            if block.key is None:
                break
            blocks.append(block)
        sess = seq.session
        refusal = self._admit(sess, len(blocks), 0, False)
        if refusal is not None:
            return refusal
        pins = self._pins
        for block in blocks:
            block.ref += 1
            pins[block] = pins.get(block, 0) + 1
        pin_id = next(self._pin_ids)
        sess.pins[pin_id] = blocks
        self._charge(sess, len(blocks), 0)
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
        self._charge(sess, -len(blocks), 0)

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
            list(self._namespaces.values())
            if namespace is None
            else [ns for ns in (self._namespaces.get(namespace),) if ns is not None]
        )
        removed: list[bytes] = []
        drop_key = self._pool.drop_key
        for ns in targets:
            removed += ns.index
            for block in ns.index.values():
                drop_key(block)
            ns.index.clear()
            ns.epoch += 1
            self._forget_if_unused(ns)
        if self._emit:
            if namespace is None:
                self._events.append(AllBlocksCleared())
            elif removed:
                self._events.append(BlockRemoved(removed))
        return len(removed)

    def drain_events(self) -> list[Event]:
        """Take the events queued since the last call, oldest first."""
        events = self._events
        self._events = []
        return events

    # ------------------------------------------------------------------
    # Observation

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
            reserved=self._outstanding,
            sequences=sum(len(s.seqs) for s in self._sessions.values()),
            sessions=len(self._sessions),
            prefix_queries=self._queries,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            evictions=pool.evictions,
            refusals={str(code): count for code, count in self._refusals.items()},
            namespaces={
                name: NamespaceStats(
                    queries=ns.queries,
                    query_tokens=ns.query_tokens,
                    hit_tokens=ns.hit_tokens,
                    usage=ns.usage,
                    cached_blocks=len(ns.index),
                    epoch=ns.epoch,
                )
                for name, ns in self._namespaces.items()
            },
            session_usage={sid: s.usage for sid, s in self._sessions.items()},
        )

    def check_invariants(self) -> None:
        """Recompute every derived quantity from scratch and compare; raise
        `InvariantError` listing every problem found. O(state): for tests
        and the daemon's ``check`` command, not the hot path."""
        problems: list[str] = []
        pool = self._pool
        bs = self.block_size
        blocks = pool.blocks
        holders = [0] * pool.num_blocks
        pins = [0] * pool.num_blocks
        outstanding = 0
        ns_usage = dict.fromkeys(self._namespaces, 0)
        num_sequences = 0
        for sid, sess in self._sessions.items():
            if self._namespaces.get(sess.namespace.name) is not sess.namespace:
                problems.append(f"session {sid}: namespace {sess.namespace.name!r} not registered")
            if sess not in sess.namespace.sessions:
                problems.append(f"session {sid}: missing from its namespace's sessions")
            usage = 0
            for seq_id, seq in sess.seqs.items():
                num_sequences += 1
                where = f"session {sid} sequence {seq_id!r}"
                if seq.session is not sess or seq.seq_id != seq_id:
                    problems.append(f"{where}: filed under the wrong session or id")
                table = seq.table
                if len(table) != -(-seq.length // bs):
                    problems.append(
                        f"{where}: {len(table)} blocks for {seq.length} tokens (block size {bs})"
                    )
                if len({id(b) for b in table}) != len(table):
                    problems.append(f"{where}: a block appears twice in its table")
                if seq.tokens.shape[0] < seq.length:
                    problems.append(f"{where}: token buffer shorter than its length")
                if not 0 <= seq.committed <= seq.length:
                    problems.append(f"{where}: committed {seq.committed} of {seq.length} tokens")
                if not seq.num_cached <= seq.committed // bs:
                    problems.append(f"{where}: {seq.num_cached} blocks cached past its commit")
                if seq.epoch == seq.namespace.epoch and len(seq.keys) < seq.num_cached:
                    problems.append(f"{where}: fewer keys than cached blocks")
                if len(seq.keys) > seq.length // bs:
                    problems.append(f"{where}: keys past its last full block")
                for i, block in enumerate(table):
                    holders[block.block_id] += 1
                    if block.key is not None and i < len(seq.keys) and block.key != seq.keys[i]:
                        problems.append(f"{where}: block {i} cached under another key")
                last = table[-1] if table else None
                needs_copy = (
                    last is not None
                    and seq.length % bs != 0
                    and (last.ref > 1 or last.key is not None)
                )
                if needs_copy and not seq.cow:
                    problems.append(f"{where}: shared partial last block not marked for copy")
                if seq.reserve_blocks != -(-seq.reserve // bs):
                    problems.append(f"{where}: reserve_blocks does not match reserve")
                out = _out(seq)
                if out != seq.out:
                    problems.append(f"{where}: holds {seq.out} reserved blocks, recomputed {out}")
                if out < 0:
                    problems.append(f"{where}: negative reservation {out}")
                outstanding += out
                usage += len(table) + out
            for pin_id, pin_blocks in sess.pins.items():
                for block in pin_blocks:
                    holders[block.block_id] += 1
                    pins[block.block_id] += 1
                if len({id(b) for b in pin_blocks}) != len(pin_blocks):
                    problems.append(f"session {sid} pin {pin_id}: a block appears twice")
                usage += len(pin_blocks)
            for block in sess.pending:
                holders[block.block_id] += 1
            usage += len(sess.pending)
            if usage != sess.usage:
                problems.append(f"session {sid}: usage {sess.usage}, recomputed {usage}")
            if sess.quota is not None and usage > sess.quota:
                problems.append(f"session {sid}: usage {usage} exceeds quota {sess.quota}")
            ns_usage[sess.namespace.name] += usage
        for name, ns in self._namespaces.items():
            if ns.name != name:
                problems.append(f"namespace {name!r} filed under another name")
            if not (ns.sessions or ns.index or ns.usage or ns.quota is not None or ns.minimum):
                problems.append(f"namespace {name!r} is unused but still registered")
            if ns.index.owner != name:
                problems.append(f"namespace {name!r}: its index belongs to {ns.index.owner!r}")
            if ns_usage[name] != ns.usage:
                problems.append(
                    f"namespace {name!r}: usage {ns.usage}, recomputed {ns_usage[name]}"
                )
            if ns.quota is not None and ns.usage > ns.quota:
                problems.append(f"namespace {name!r}: usage {ns.usage} exceeds quota {ns.quota}")
            for key, block in ns.index.items():
                if block.key != key or block.index is not ns.index:
                    problems.append(
                        f"namespace {name!r}: index entry for block "
                        f"{block.block_id} disagrees with the block's key"
                    )
        if outstanding != self._outstanding:
            problems.append(
                f"outstanding reservations {self._outstanding}, recomputed {outstanding}"
            )
        minimums = sum(s.minimum > 0 for s in self._sessions.values()) + sum(
            ns.minimum > 0 for ns in self._namespaces.values()
        )
        if minimums != self._minimums:
            problems.append(f"{self._minimums} accounts with minimums, recomputed {minimums}")

        free_ids = [b.block_id for b in pool.free]
        lru_ids = [b.block_id for q in pool.queues() for b in q]
        if len(set(free_ids)) != len(free_ids):
            problems.append("a block is twice on the free stack")
        if len(set(lru_ids)) != len(lru_ids):
            problems.append("a block is twice in the eviction queues")
        if len(lru_ids) != pool.evictable:
            problems.append(f"eviction queues link {len(lru_ids)} blocks, counts {pool.evictable}")
        for queue in pool.queues():
            prev = queue.head
            for block in queue:
                if block.prev is not prev:
                    problems.append(f"block {block.block_id}: broken back link in its queue")
                prev = block
            if queue.tail.prev is not prev:
                problems.append("an eviction queue's tail does not link back to its last block")
        pool.check(problems)
        free_set, lru_set = set(free_ids), set(lru_ids)
        indexed = 0
        pinned = 0
        for block in blocks:
            bid = block.block_id
            if block.ref != holders[bid]:
                problems.append(f"block {bid}: ref {block.ref}, holders {holders[bid]}")
            if self._pins.get(block, 0) != pins[bid]:
                problems.append(
                    f"block {bid}: pins {self._pins.get(block, 0)}, recomputed {pins[bid]}"
                )
            pinned += pins[bid] > 0
            if block.key is not None:
                indexed += 1
                if block.index is None or block.index.get(block.key) is not block:
                    problems.append(f"block {bid}: keyed but not in its namespace's index")
            elif block.index is not None:
                problems.append(f"block {bid}: unkeyed but linked to an index")
            is_free = block.ref == 0 and block.key is None
            is_lru = block.ref == 0 and block.key is not None
            if is_free != (bid in free_set):
                problems.append(f"block {bid}: free={is_free} but on free stack={bid in free_set}")
            if is_lru != (bid in lru_set):
                problems.append(f"block {bid}: evictable={is_lru} but queued={bid in lru_set}")
        if indexed != sum(len(ns.index) for ns in self._namespaces.values()):
            problems.append("prefix index size differs from the number of keyed blocks")
        if pinned != len(self._pins):
            problems.append(f"{len(self._pins)} pinned blocks counted, recomputed {pinned}")
        in_use = sum(1 for b in blocks if b.ref > 0)
        if len(blocks) + pool.unborn != pool.num_blocks:
            problems.append(f"{len(blocks)} blocks created + {pool.unborn} unborn != total")
        if any(b.block_id != i for i, b in enumerate(blocks)):
            problems.append("a created block is not at its id's place")
        if len(free_ids) + pool.unborn + len(lru_ids) + in_use != pool.num_blocks:
            problems.append(
                f"free {len(free_ids)} + unborn {pool.unborn} + evictable {len(lru_ids)} "
                f"+ in use {in_use} "
                f"!= total {pool.num_blocks}"
            )
        if problems:
            raise InvariantError(problems)
