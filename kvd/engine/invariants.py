"""The engine's invariants, recomputed from scratch over its state.

O(state): for tests and the daemon's ``check`` command, never the hot
path. Each check appends a problem line instead of stopping, so one run
lists everything that is wrong.
"""

from __future__ import annotations

from kvd.engine.accounts import Accounts, HoldState, SessionAccount, pin_refs
from kvd.engine.block import Block
from kvd.engine.errors import InvariantError
from kvd.engine.pool import BlockPool
from kvd.engine.sequence import SequenceState

__all__ = ["check_invariants"]


def check_invariants(
    pool: BlockPool,
    accounts: Accounts,
    pins: dict[Block, int],
    holds: dict[int, HoldState],
    block_size: int,
) -> None:
    """Raise `InvariantError` listing every problem of the engine state made of
    ``pool``, ``accounts``, ``pins`` (pinned block -> its pins) and ``holds``
    (every hold by id)."""
    problems: list[str] = []
    holders = [0] * pool.num_blocks
    pinned = [0] * pool.num_blocks
    outstanding = 0
    ns_usage = dict.fromkeys(accounts.namespaces, 0)
    for sid, sess in accounts.sessions.items():
        usage, reserved = _session_problems(
            sid, sess, accounts, bs=block_size, holders=holders, pinned=pinned, problems=problems
        )
        outstanding += reserved
        ns_usage[sess.namespace.name] += usage
    _hold_problems(accounts, holds, problems)
    _buffer_problems(accounts, problems)
    _namespace_problems(accounts, ns_usage, problems)
    if outstanding != accounts.outstanding:
        problems.append(
            f"outstanding reservations {accounts.outstanding}, recomputed {outstanding}"
        )
    minimums = sum(s.minimum > 0 for s in accounts.sessions.values()) + sum(
        ns.minimum > 0 for ns in accounts.namespaces.values()
    )
    if minimums != accounts.minimums:
        problems.append(f"{accounts.minimums} accounts with minimums, recomputed {minimums}")
    _pool_problems(pool, accounts, pins, holders=holders, pinned=pinned, problems=problems)
    if problems:
        raise InvariantError(problems)


def _reserved(seq: SequenceState) -> int:
    """Blocks still needed for ``seq`` to grow to its reservation."""
    if seq.length >= seq.reserve:
        return 0
    return seq.reserve_blocks - len(seq.table) + seq.cow


def _session_problems(
    sid: int,
    sess: SessionAccount,
    accounts: Accounts,
    *,
    bs: int,
    holders: list[int],
    pinned: list[int],
    problems: list[str],
) -> tuple[int, int]:
    """Check one session and its sequences, counting their holders and pins;
    returns the session's recomputed usage and reserved blocks."""
    ns = sess.namespace
    if accounts.namespaces.get(ns.name) is not ns:
        problems.append(f"session {sid}: namespace {ns.name!r} not registered")
    if sess not in ns.sessions:
        problems.append(f"session {sid}: missing from its namespace's sessions")
    usage = 0
    reserved = 0
    for seq_id, seq in sess.seqs.items():
        where = f"session {sid} sequence {seq_id!r}"
        if seq.seq_id != seq_id:
            problems.append(f"{where}: filed under the wrong id")
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
        if seq.epoch == ns.epoch and len(seq.keys) < seq.num_cached:
            problems.append(f"{where}: fewer keys than cached blocks")
        if len(seq.keys) > seq.length // bs:
            problems.append(f"{where}: keys past its last full block")
        for i, block in enumerate(table):
            holders[block.block_id] += 1
            if block.key is not None and i < len(seq.keys) and block.key != seq.keys[i]:
                problems.append(f"{where}: block {i} cached under another key")
        last = table[-1] if table else None
        needs_copy = (
            last is not None and seq.length % bs != 0 and (last.ref > 1 or last.key is not None)
        )
        if needs_copy and not seq.cow:
            problems.append(f"{where}: shared partial last block not marked for copy")
        if seq.reserve_blocks != -(-seq.reserve // bs):
            problems.append(f"{where}: reserve_blocks does not match reserve")
        out = _reserved(seq)
        if out != seq.out:
            problems.append(f"{where}: holds {seq.out} reserved blocks, recomputed {out}")
        if out < 0:
            problems.append(f"{where}: negative reservation {out}")
        reserved += out
        usage += len(table) + out
    for pin_id, pin_blocks in sess.pins.items():
        for block in pin_blocks:
            holders[block.block_id] += 1
            pinned[block.block_id] += 1
        if len({id(b) for b in pin_blocks}) != len(pin_blocks):
            problems.append(f"session {sid} pin {pin_id}: a block appears twice")
        usage += len(pin_blocks)
    for hold_id, hold in sess.holds.items():
        if hold.hold_id != hold_id or hold.owner is not sess:
            problems.append(f"session {sid} hold {hold_id}: filed under the wrong id or owner")
        if not hold.blocks:
            problems.append(f"session {sid} hold {hold_id}: empty but kept")
        for bid, block in hold.blocks.items():
            if block.block_id != bid:
                problems.append(f"session {sid} hold {hold_id}: block {bid} filed as another")
            holders[block.block_id] += 1
        for bid in hold.granted:
            if bid not in hold.blocks or hold.blocks[bid].key is not None:
                problems.append(f"session {sid} hold {hold_id}: granted block {bid} not unkeyed")
        usage += len(hold.blocks)
    held = sum(map(pin_refs, sess.pins.values()))
    held += sum(len(h.blocks) for h in sess.holds.values())
    if held != sess.held:
        problems.append(f"session {sid}: {sess.held} block references held, recomputed {held}")
    for block in sess.pending:
        holders[block.block_id] += 1
    usage += len(sess.pending)
    if usage != sess.usage:
        problems.append(f"session {sid}: usage {sess.usage}, recomputed {usage}")
    if sess.quota is not None and usage > sess.quota:
        problems.append(f"session {sid}: usage {usage} exceeds quota {sess.quota}")
    return usage, reserved


def _buffer_problems(accounts: Accounts, problems: list[str]) -> None:
    """A token buffer that several sequences have is marked shared in each
    (else a write by one would change the others' tokens)."""
    owners: dict[int, list[str]] = {}
    unshared: set[int] = set()
    for sid, sess in accounts.sessions.items():
        for seq_id, seq in sess.seqs.items():
            owners.setdefault(id(seq.tokens), []).append(f"{sid}/{seq_id}")
            if not seq.shared:
                unshared.add(id(seq.tokens))
    for buf, names in owners.items():
        if len(names) > 1 and buf in unshared:
            problems.append(f"sequences {names} share a token buffer not marked shared")


def _hold_problems(accounts: Accounts, holds: dict[int, HoldState], problems: list[str]) -> None:
    """Every hold is its owner's, and the owner is a live session."""
    owned = {hold_id for sess in accounts.sessions.values() for hold_id in sess.holds}
    if owned != holds.keys():
        problems.append(f"holds {sorted(holds)} differ from the sessions' {sorted(owned)}")
    for hold_id, hold in holds.items():
        if accounts.sessions.get(hold.owner.sid) is not hold.owner:
            problems.append(f"hold {hold_id}: its owner session {hold.owner.sid} is gone")


def _namespace_problems(accounts: Accounts, ns_usage: dict[str, int], problems: list[str]) -> None:
    """Check each namespace against its sessions' recomputed usage and its index."""
    for name, ns in accounts.namespaces.items():
        if ns.name != name:
            problems.append(f"namespace {name!r} filed under another name")
        if not (ns.sessions or ns.index or ns.usage or ns.quota is not None or ns.minimum):
            problems.append(f"namespace {name!r} is unused but still registered")
        if ns.index.owner != name:
            problems.append(f"namespace {name!r}: its index belongs to {ns.index.owner!r}")
        if ns_usage[name] != ns.usage:
            problems.append(f"namespace {name!r}: usage {ns.usage}, recomputed {ns_usage[name]}")
        if ns.quota is not None and ns.usage > ns.quota:
            problems.append(f"namespace {name!r}: usage {ns.usage} exceeds quota {ns.quota}")
        for key, block in ns.index.items():
            if block.key != key or block.index is not ns.index:
                problems.append(
                    f"namespace {name!r}: index entry for block "
                    f"{block.block_id} disagrees with the block's key"
                )


def _pool_problems(
    pool: BlockPool,
    accounts: Accounts,
    pins: dict[Block, int],
    *,
    holders: list[int],
    pinned: list[int],
    problems: list[str],
) -> None:
    """Check the free stack, the eviction queues and every block against the
    holders and pins counted from the sessions."""
    blocks = pool.blocks
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
    num_pinned = 0
    for block in blocks:
        bid = block.block_id
        if block.ref != holders[bid]:
            problems.append(f"block {bid}: ref {block.ref}, holders {holders[bid]}")
        if pins.get(block, 0) != pinned[bid]:
            problems.append(f"block {bid}: pins {pins.get(block, 0)}, recomputed {pinned[bid]}")
        num_pinned += pinned[bid] > 0
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
    if indexed != sum(len(ns.index) for ns in accounts.namespaces.values()):
        problems.append("prefix index size differs from the number of keyed blocks")
    if num_pinned != len(pins):
        problems.append(f"{len(pins)} pinned blocks counted, recomputed {num_pinned}")
    in_use = sum(1 for b in blocks if b.ref > 0)
    if len(blocks) + pool.unborn != pool.num_blocks:
        problems.append(f"{len(blocks)} blocks created + {pool.unborn} unborn != total")
    if any(b.block_id != i for i, b in enumerate(blocks)):
        problems.append("a created block is not at its id's place")
    if len(free_ids) + pool.unborn + len(lru_ids) + in_use != pool.num_blocks:
        problems.append(
            f"free {len(free_ids)} + unborn {pool.unborn} + evictable {len(lru_ids)} "
            f"+ in use {in_use} != total {pool.num_blocks}"
        )
