"""Tier 1's metadata (`kvd.engine.tier`): demotion ahead of eviction, promotion, LRU, flush."""

from __future__ import annotations

import pytest

from kvd.engine import Allocation, BlockRemoved, BlockStored, InvalidError

from .support import BS, Checked, MakeEngine, toks


@pytest.fixture
def tiered(make_engine: MakeEngine) -> Checked:
    """A 4-block pool with a 4-slot tier, session 1 open, LRU eviction."""
    return make_engine(num_blocks=4, tier_blocks=4, eviction="lru")


def cached(eng: Checked, seq: str, tokens: int, start: int = 0) -> None:
    """Allocate ``seq`` for ``tokens`` ids from ``start``, commit all, free it."""
    r = eng.allocate(1, seq, toks(tokens, start))
    assert isinstance(r, Allocation)
    eng.commit(1, seq)
    eng.free(1, seq)


def demote_all(eng: Checked) -> int:
    """Copy every noted block (the server's worker, its copy succeeding)."""
    done = eng.tier.demotions(100)
    return int(eng.tier.demoted(done, True))


def pushed_out(eng: Checked, tokens: int) -> None:
    """``tokens`` ids from 0 cached, copied to the tier, then evicted from the
    4-block pool by another prompt that takes all of it."""
    cached(eng, "a", tokens)
    demote_all(eng)
    eng.allocate(1, "b", toks(4 * BS, 100))
    eng.free(1, "b")


def test_committed_blocks_are_offered_for_demotion(tiered: Checked) -> None:
    cached(tiered, "a", 2 * BS + 1)
    assert demote_all(tiered) == 2
    assert tiered.stats().tier.blocks == 2
    assert tiered.stats().tier.demotions == 2


def test_a_block_in_the_tier_is_not_copied_again(tiered: Checked) -> None:
    cached(tiered, "a", 2 * BS + 1)
    demote_all(tiered)
    cached(tiered, "b", 2 * BS + 1)
    assert tiered.tier.demotions(100) == []


def test_a_copy_whose_block_was_evicted_meanwhile_does_not_count(tiered: Checked) -> None:
    cached(tiered, "a", 2 * BS + 1)
    done = tiered.tier.demotions(100)
    tiered.allocate(1, "b", toks(4 * BS, 100))  # evicts both blocks mid-copy
    assert tiered.tier.demoted(done, True) == 0
    stats = tiered.stats().tier
    assert (stats.blocks, stats.lost, len(tiered.tier.free)) == (0, 2, 4)


def test_a_failed_copy_counts_an_error_and_frees_its_slot(tiered: Checked) -> None:
    cached(tiered, "a", BS + 1)
    done = tiered.tier.demotions(100)
    tiered.tier.demoted(done, False)
    assert (tiered.stats().tier.errors, len(tiered.tier.free)) == (1, 4)


def test_demotion_emits_a_tier_stored_event(tiered: Checked) -> None:
    cached(tiered, "a", BS + 1)
    tiered.drain_events()
    demote_all(tiered)
    (ev,) = tiered.drain_events()
    assert isinstance(ev, BlockStored) and ev.tier == 1 and len(ev.keys) == 1


def test_an_evicted_prefix_continues_into_the_tier(tiered: Checked) -> None:
    pushed_out(tiered, 2 * BS + 1)
    promo = tiered.promote(1, "c", toks(2 * BS + 1))
    assert promo is not None and len(promo.pairs) == 2
    assert tiered.tier.promoted(promo, True) == 2
    r = tiered.allocate(1, "c", toks(2 * BS + 1))
    assert isinstance(r, Allocation) and r.num_cached_tokens == 2 * BS
    assert [b for _, b in promo.pairs] == r.table[:2]


def test_promotion_continues_after_the_pool_hits(tiered: Checked) -> None:
    cached(tiered, "a", 3 * BS + 1)
    demote_all(tiered)
    # Evict the two oldest-released blocks (the chain's tail goes first: blocks 1, 2).
    tiered.allocate(1, "b", toks(3 * BS, 100))
    tiered.free(1, "b")
    tiered.allocate(1, "x", toks(1, 500))
    promo = tiered.promote(1, "c", toks(3 * BS + 1))
    assert promo is not None
    assert promo.parent is not None  # it chains from the pool's part


def test_nothing_to_promote_without_a_continuation(tiered: Checked) -> None:
    cached(tiered, "a", 2 * BS + 1)
    assert tiered.promote(1, "c", toks(2 * BS + 1)) is None  # all in the pool still
    assert tiered.promote(1, "d", toks(2 * BS + 1, 50)) is None  # nowhere


def test_promotion_of_bad_keys_changes_nothing(tiered: Checked) -> None:
    cached(tiered, "a", 2 * BS + 1)
    demote_all(tiered)
    with pytest.raises(InvalidError):
        tiered.promote(1, "c", toks(2 * BS + 1), keys=[b"short"])
    assert tiered.promote(1, "c", toks(2 * BS + 1), keys=[b"k" * 32]) is None


def test_promoting_blocks_outlive_a_session_that_closes(tiered: Checked) -> None:
    pushed_out(tiered, 2 * BS + 1)
    promo = tiered.promote(1, "c", toks(2 * BS + 1))
    assert promo is not None
    tiered.close_session(1)
    held = [tiered._pool.blocks[b].ref for _, b in promo.pairs]
    assert held == [1, 1]  # still the copy's: no allocation can take them
    tiered.tier.promoted(promo, True)
    assert tiered.stats().sessions == 0


def test_entries_being_read_are_not_evicted(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=4, tier_blocks=2, eviction="lru")
    pushed_out(eng, 2 * BS + 1)
    promo = eng.promote(1, "c", toks(2 * BS + 1))
    assert promo is not None
    eng.allocate(1, "d", toks(BS + 1, 300))
    eng.commit(1, "d")
    assert eng.tier.demotions(100) == []  # both slots are being read
    eng.tier.promoted(promo, True)
    assert eng.tier.demotions(100)  # read no more: evictable again


def test_a_full_tier_drops_its_least_recently_used_copy(make_engine: MakeEngine) -> None:
    eng = make_engine(num_blocks=4, tier_blocks=1, eviction="lru")
    cached(eng, "a", BS + 1)
    demote_all(eng)
    cached(eng, "b", BS + 1, 100)
    eng.drain_events()
    demote_all(eng)
    removed = [e for e in eng.drain_events() if isinstance(e, BlockRemoved)]
    assert [e.tier for e in removed] == [1]
    assert eng.stats().tier.evictions == 1


def test_flush_drops_the_tier_copies(tiered: Checked) -> None:
    cached(tiered, "a", 2 * BS + 1)
    demote_all(tiered)
    tiered.drain_events()
    tiered.flush("")
    assert tiered.stats().tier.blocks == 0
    assert any(isinstance(e, BlockRemoved) and e.tier == 1 for e in tiered.drain_events())


def test_a_copy_made_before_a_flush_does_not_count(tiered: Checked) -> None:
    cached(tiered, "a", BS + 1)
    done = tiered.tier.demotions(100)
    tiered.flush()
    assert tiered.tier.demoted(done, True) == 0
    assert tiered.stats().tier.lost == 1


def test_a_copy_of_a_namespace_flushed_and_forgotten_meanwhile_does_not_count(
    make_engine: MakeEngine,
) -> None:
    eng = make_engine(num_blocks=4, tier_blocks=4, eviction="lru", session=False)
    eng.open_session(1, namespace="x")
    cached(eng, "a", BS + 1)
    done = eng.tier.demotions(100)
    eng.close_session(1)
    eng.flush("x")  # the namespace is gone; a new one of that name starts at epoch 0
    eng.open_session(1, namespace="x")
    assert eng.tier.demoted(done, True) == 0
