"""Holds: blocks a session keeps by id, outside any sequence (the block-level mode).

An engine that keeps its own block tables (vLLM's scheduler and workers, a
KV connector) uses kvd through holds instead of sequences:

- ``lookup(keys, hold=True)`` finds the longest run of leading keys cached
  in the session's namespace and holds those blocks (ref + 1 each), so no
  eviction can take them before the caller has read them;
- ``grant(n)`` holds ``n`` fresh, unkeyed blocks for the caller to write;
- ``publish(hold, blocks, keys, tokens)``, once the bytes are written, puts
  granted blocks into the prefix cache under the caller's keys (a key
  already cached leaves its block private: one block per key);
- ``release(hold, blocks)`` lets go; cached blocks become evictable, the
  others free.

A hold is charged to the session that made it (its quota, its namespace's)
and released with it. Its id is a random 63-bit capability: another
session of the same namespace may release it (vLLM's scheduler holds what
its worker process reads and releases), and a hold of another namespace is
never found.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
from kvd_client.wire.hashing import KEY_SIZE, KeyList

from kvd.engine.accounts import Accounts, HoldState, SessionAccount
from kvd.engine.block import Block, idle, ids
from kvd.engine.errors import InvalidError
from kvd.engine.events import BlockRemoved, BlockStored, Event
from kvd.engine.pool import BlockPool
from kvd.engine.results import Granted, Looked, Refusal

__all__ = ["HoldTable", "keys_of"]

_NO_TOKENS: npt.NDArray[np.int32] = np.empty(0, dtype=np.int32)


def keys_of(value: object, name: str) -> list[bytes]:
    """``value`` as a list of block keys; INVALID unless each is a ``KEY_SIZE``-byte bytes.

    A `KeyList` (keys cut from a wire frame, fresh per request) is taken as it is."""
    if type(value) is KeyList:
        return value
    if not isinstance(value, list | tuple):
        raise InvalidError(f"{name} must be a list of {KEY_SIZE}-byte keys")
    for key in value:
        if type(key) is not bytes or len(key) != KEY_SIZE:
            raise InvalidError(f"{name} must be a list of {KEY_SIZE}-byte keys")
    return list(value)


class HoldTable:
    """Every hold of one engine, by id (the owner also lists its own)."""

    def __init__(
        self,
        pool: BlockPool,
        accounts: Accounts,
        block_size: int,
        events: Callable[[Event], None] | None,
    ) -> None:
        self._pool = pool
        self._accounts = accounts
        self._block_size = block_size
        self._emit = events
        self.holds: dict[int, HoldState] = {}
        #: Told the blocks an eviction hands out (tier 1 voids their copies in flight).
        self.on_evict: Callable[[list[Block]], None] | None = None
        #: Told the blocks a publish caches (tier 1 copies them).
        self.on_stored: Callable[[Sequence[Block]], None] | None = None

    def _new(self, owner: SessionAccount, blocks: list[Block], granted: bool) -> HoldState:
        hold_id = secrets.randbits(63)
        while not hold_id or hold_id in self.holds:
            hold_id = secrets.randbits(63)
        hold = HoldState(hold_id, owner, blocks, granted)
        self.holds[hold_id] = owner.holds[hold_id] = hold
        owner.held += len(blocks)
        self._accounts.charge(owner, len(blocks), 0)
        return hold

    def lookup(self, sess: SessionAccount, keys: Sequence[bytes], hold: bool) -> Looked | Refusal:
        """The longest run of leading ``keys`` cached in the session's namespace
        (no cap: the caller decides what to compute); with ``hold``, those blocks
        held under a new hold (none when nothing matched)."""
        keys = keys_of(keys, "keys")
        ns = sess.namespace
        hits = ns.index.match(keys)
        bs = self._block_size
        ns.queries += 1
        ns.query_tokens += len(keys) * bs
        ns.hit_tokens += len(hits) * bs
        if not hold or not hits:
            return Looked(len(hits), [], 0)
        accounts = self._accounts
        refusal = accounts.over_held(sess, len(hits)) or accounts.admit(
            sess, len(hits), idle(hits), True
        )
        if refusal is not None:
            return refusal
        self._pool.match(hits)
        made = self._new(sess, hits, granted=False)
        return Looked(len(hits), ids(hits), made.hold_id)

    def grant(self, sess: SessionAccount, n: int) -> Granted | Refusal:
        """``n`` fresh, unkeyed blocks held for the session to write (all or nothing)."""
        if type(n) is not int or n < 1:
            raise InvalidError(f"n must be a positive integer, got {n!r}")
        accounts = self._accounts
        refusal = accounts.over_held(sess, n) or accounts.admit(sess, n, n, True)
        if refusal is not None:
            return refusal
        blocks = self._take(n)
        made = self._new(sess, blocks, granted=True)
        return Granted(made.hold_id, ids(blocks))

    def _take(self, n: int) -> list[Block]:
        """``n`` fresh blocks from the pool (admitted already), evictions told."""
        removed: list[bytes] = []
        blocks = self._pool.take(n, removed)
        if removed:
            if self._emit is not None:
                self._emit(BlockRemoved(removed))
            self._accounts.forget_emptied()
            if self.on_evict is not None:
                self.on_evict(blocks)
        return blocks

    def hold_fresh(
        self, sess: SessionAccount, hits: list[Block], n: int
    ) -> tuple[int, list[int]] | None:
        """One hold of ``sess`` on cached ``hits`` and ``n`` fresh blocks to
        write (the ids of those); None, nothing changed, when it cannot be
        admitted. Neither a query nor a refusal is counted: the allocate that
        asked counts its own. ``sess`` has no quota of its own (a tier session)."""
        idle_hits = idle(hits)
        headroom = sess.namespace.headroom()
        if (headroom is not None and headroom < len(hits) + n) or self._accounts.available(
            sess, True
        ) < idle_hits + n:
            return None
        self._pool.match(hits)
        fresh = self._take(n)
        made = self._new(sess, hits + fresh, granted=False)
        fresh_ids = ids(fresh)
        made.granted.update(fresh_ids)
        return made.hold_id, fresh_ids

    def find(self, sess: SessionAccount, hold_id: object) -> HoldState | None:
        """The hold ``hold_id`` if it exists in the session's namespace."""
        hold = self.holds.get(hold_id) if type(hold_id) is int else None
        if hold is None or hold.owner.namespace is not sess.namespace:
            return None
        return hold

    def _members(self, hold: HoldState, block_ids: Sequence[int], what: str) -> list[Block]:
        blocks = []
        for bid in block_ids:
            block = hold.blocks.get(int(bid))
            if block is None:
                raise InvalidError(f"block {int(bid)} is not in hold {hold.hold_id} ({what})")
            blocks.append(block)
        if len({id(b) for b in blocks}) != len(blocks):
            raise InvalidError(f"a block appears twice ({what})")
        return blocks

    def publish(
        self,
        sess: SessionAccount,
        hold_id: int,
        block_ids: Sequence[int],
        keys: Sequence[bytes],
        *,
        tokens: npt.NDArray[np.int32] | None,
        parent: bytes | None,
    ) -> int:
        """Put granted blocks of a hold into the prefix cache under ``keys`` (in
        chain order, ``parent`` the key before the first); how many were published.
        ``tokens`` None (tier 1's promotion for a lookup): the stored events carry
        no token ids.

        Every argument is checked before anything changes (INVALID): the hold
        must exist in the session's namespace, each block be granted by it and
        not yet published, one key per block, ``len(blocks) * block_size``
        tokens (for the KV events). A key already cached leaves its block
        private; a hold made before a flush of its namespace publishes nothing.
        """
        hold = self.find(sess, hold_id)
        if hold is None:
            raise InvalidError(f"no hold {hold_id!r} in this namespace")
        keys = keys_of(keys, "keys")
        blocks = self._members(hold, block_ids, "publish")
        if len(keys) != len(blocks):
            raise InvalidError(f"{len(blocks)} blocks but {len(keys)} keys")
        bs = self._block_size
        if tokens is not None and tokens.shape[0] != len(blocks) * bs:
            raise InvalidError(
                f"{len(blocks)} blocks need {len(blocks) * bs} token ids, got {tokens.shape[0]}"
            )
        if parent is not None and (type(parent) is not bytes or len(parent) != KEY_SIZE):
            raise InvalidError(f"parent must be a {KEY_SIZE}-byte key")
        for block in blocks:
            if block.block_id not in hold.granted:
                raise InvalidError(f"block {block.block_id} was not granted or is published")
        if hold.epoch != sess.namespace.epoch:
            return 0
        index = hold.owner.namespace.index
        hold.granted.difference_update(b.block_id for b in blocks)
        stored, runs = index.insert(blocks, keys)
        for run in runs:
            self._stored(hold, keys, tokens, parent, run)
        self._pool.publish(stored)
        if self.on_stored is not None:
            self.on_stored(stored)
        return len(stored)

    def _stored(
        self,
        hold: HoldState,
        keys: Sequence[bytes],
        tokens: npt.NDArray[np.int32] | None,
        parent: bytes | None,
        run: tuple[int, int],
    ) -> None:
        start, end = run
        if self._emit is not None:
            bs = self._block_size
            self._emit(
                BlockStored(
                    list(keys[start:end]),
                    keys[start - 1] if start else parent,
                    _NO_TOKENS if tokens is None else tokens[start * bs : end * bs].copy(),
                    block_size=bs,
                    namespace=hold.owner.namespace.name,
                    adapter=hold.owner.adapter,
                )
            )

    def release(self, sess: SessionAccount, hold_id: int, block_ids: Sequence[int] | None) -> int:
        """Let go of a hold's blocks (all when ``block_ids`` is None); how many.

        A hold that does not exist (released already, or by the other side)
        releases nothing and is not an error; naming a block the hold does not
        have is INVALID and releases nothing.
        """
        hold = self.find(sess, hold_id)
        if hold is None:
            return 0
        if block_ids is None:
            blocks = list(hold.blocks.values())
        else:
            blocks = self._members(hold, block_ids, "release")
        for block in blocks:
            del hold.blocks[block.block_id]
            hold.granted.discard(block.block_id)
        if not hold.blocks:
            del self.holds[hold.hold_id]
            del hold.owner.holds[hold.hold_id]
        self._pool.release(reversed(blocks))
        hold.owner.held -= len(blocks)
        self._accounts.charge(hold.owner, -len(blocks), 0)
        return len(blocks)

    def close(self, sess: SessionAccount) -> None:
        """Release every hold ``sess`` made (its session closes)."""
        for hold_id in list(sess.holds):
            self.release(sess, hold_id, None)
