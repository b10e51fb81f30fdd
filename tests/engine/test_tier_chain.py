"""A chain of tiers (`kvd.engine.tier.chain`): tier 1 (host) written through to tier 2 (remote)."""

from __future__ import annotations

import pytest

from kvd.engine import Allocation, BlockStored, EngineConfig, InvalidError
from kvd.engine.tier import Demotion, Tier

from .support import BS, Checked, MakeEngine, toks

#: Session 1's namespace.
NS = ""


@pytest.fixture
def chained(make_engine: MakeEngine) -> Checked:
    """A 6-block pool over a 2-slot tier 1 over an 8-name tier 2, LRU eviction."""
    return make_engine(num_blocks=6, tier_blocks=2, remote_blocks=8, eviction="lru")


def below(eng: Checked) -> Tier:
    tier = eng.tier.below
    assert tier is not None and tier.level == 2 and tier.above is eng.tier
    return tier


def cached(eng: Checked, seq: str, blocks: int, start: int = 0) -> None:
    """``blocks`` full blocks of ids from ``start`` (and one token more) cached, then freed."""
    r = eng.allocate(1, seq, toks(blocks * BS + 1, start))
    assert isinstance(r, Allocation)
    eng.commit(1, seq)
    eng.free(1, seq)


def down(eng: Checked, tier: Tier, ok: bool = True) -> list[Demotion]:
    """Run ``tier``'s demotions to the end (each copy ``ok``); the copies made."""
    done = tier.demotions(100)
    tier.demoted(done, ok)
    eng.check_invariants()
    return done


def evict_pool(eng: Checked) -> None:
    eng.allocate(1, "x", toks(6 * BS, 9000))
    eng.free(1, "x")


def test_what_tier_1_records_is_copied_to_tier_2_from_tier_1s_slots(chained: Checked) -> None:
    cached(chained, "a", 2)
    chained.drain_events()
    first = down(chained, chained.tier)
    entries = list(chained.tier.entries.values())
    assert [e.ref for e in entries] == [1, 1]  # tier 1 keeps them until they went down
    copies = below(chained).demotions(100)
    assert [d.entry for d in copies] == entries
    assert [d.src for d in copies] == [e.slot for e in entries] == [d.slot for d in first]
    assert [e.ref for e in entries] == [1, 1]
    assert below(chained).demoted(copies, True) == 2
    assert [e.ref for e in entries] == [0, 0]
    stored = [(e.tier, len(e.keys)) for e in chained.drain_events() if isinstance(e, BlockStored)]
    assert stored == [(1, 2), (2, 2)]
    chained.check_invariants()


def test_a_tier_1_entry_not_yet_copied_down_is_not_dropped_for_room(chained: Checked) -> None:
    cached(chained, "a", 2)
    down(chained, chained.tier)
    cached(chained, "b", 2, start=500)
    assert chained.tier.demotions(100) == []  # not copied down yet: the new blocks wait
    copies = below(chained).demotions(100)
    assert chained.tier.demotions(100) == []  # being copied down: still waiting
    below(chained).demoted(copies, True)
    assert len(down(chained, chained.tier)) == 2  # room again: the oldest went
    assert chained.stats().tier.evictions == 2
    assert chained.stats().tier_below.blocks == 2


def test_a_flush_while_copying_down_loses_the_copy_and_frees_the_slot(chained: Checked) -> None:
    cached(chained, "a", 2)
    down(chained, chained.tier)
    copies = below(chained).demotions(100)
    chained.flush(NS)
    assert len(chained.tier.free) == 0  # still read
    assert below(chained).demoted(copies, True) == 0
    assert chained.stats().tier_below.lost == 2
    assert len(chained.tier.free) == 2
    chained.check_invariants()


def test_a_flush_before_the_copy_down_gives_tier_1_its_slots_back(chained: Checked) -> None:
    cached(chained, "a", 2)
    down(chained, chained.tier)
    chained.flush(NS)
    assert len(chained.tier.free) == 0  # still fed
    assert below(chained).demotions(100) == []
    assert len(chained.tier.free) == 2
    chained.check_invariants()


def test_a_failed_copy_down_is_counted_and_tier_1_keeps_its_copy(chained: Checked) -> None:
    cached(chained, "a", 2)
    down(chained, chained.tier)
    down(chained, below(chained), ok=False)
    assert chained.stats().tier_below.errors == 2
    assert chained.stats().tier.blocks == 2 and chained.stats().tier_below.blocks == 0


def in_both_then_head_only_in_tier_1(eng: Checked) -> None:
    """4 blocks of ids from 0 in tier 2, their first 2 in tier 1, none in the pool."""
    cached(eng, "a", 4)
    for _ in range(2):  # tier 1 has 2 slots: it records 2 blocks per round
        down(eng, eng.tier)
        down(eng, below(eng))
    assert eng.stats().tier_below.blocks == 4
    evict_pool(eng)
    # Blocks 0 and 1 back through tier 1's LRU order: the last tier 1 took were 2 and 3.
    p = eng.promote(1, "head", toks(2 * BS + 1))
    assert p is not None and p.by_level() == {2: [0, 1]}
    eng.tier.promoted(p, True)
    down(eng, eng.tier)
    evict_pool(eng)
    assert eng.tier.continuation(NS, p.keys, 0)[0].level == 1


def test_a_promotion_takes_each_block_from_tier_1_where_it_is_else_tier_2(
    chained: Checked,
) -> None:
    in_both_then_head_only_in_tier_1(chained)
    p = chained.promote(1, "all", toks(4 * BS + 1))
    assert p is not None and p.by_level() == {1: [0, 1], 2: [2, 3]}
    assert chained.tier.promoted(p, True) == 4
    r = chained.allocate(1, "all", toks(4 * BS + 1))
    assert isinstance(r, Allocation) and r.num_cached_tokens == 4 * BS
    t1, t2 = chained.stats().tier, chained.stats().tier_below
    assert (t1.hits, t1.promotions) == (2, 2)
    assert (t2.hits, t2.promotions) == (4, 4)  # 2 in the head's promotion before


def test_a_failed_remote_part_still_promotes_the_tier_1_part(chained: Checked) -> None:
    in_both_then_head_only_in_tier_1(chained)
    p = chained.promote(1, "all", toks(4 * BS + 1))
    assert p is not None
    assert chained.tier.promoted(p, True, {2}) == 2
    r = chained.allocate(1, "all", toks(4 * BS + 1))
    assert isinstance(r, Allocation) and r.num_cached_tokens == 2 * BS
    t2 = chained.stats().tier_below
    assert t2.errors == 2
    # The names it could not read are forgotten; tier 1 keeps its copies.
    assert [e.level for e in chained.tier.continuation(NS, p.keys, 0)] == [1, 1]
    chained.check_invariants()


def test_a_failed_tier_1_part_publishes_nothing_after_it(chained: Checked) -> None:
    in_both_then_head_only_in_tier_1(chained)
    p = chained.promote(1, "all", toks(4 * BS + 1))
    assert p is not None
    assert chained.tier.promoted(p, True, {1}) == 0
    t1, t2 = chained.stats().tier, chained.stats().tier_below
    assert (t1.errors, t2.errors, t2.blocks) == (2, 0, 4)  # copied fine, dropped after the gap
    assert len(chained.tier.continuation(NS, p.keys, 0)) == 4
    chained.check_invariants()


def test_a_flush_empties_every_tier_of_the_chain(chained: Checked) -> None:
    cached(chained, "a", 2)
    down(chained, chained.tier)
    down(chained, below(chained))
    chained.drain_events()
    chained.flush(NS)
    removed = [(e.tier, len(e.keys)) for e in chained.drain_events() if e.tier]
    assert removed == [(1, 2), (2, 2)]
    assert chained.stats().tier.blocks == 0 and chained.stats().tier_below.blocks == 0


@pytest.mark.parametrize("extra", [{}, {"tier_blocks": 4, "tier_level": 2}])
def test_a_remote_tier_below_needs_a_host_tier_above(extra: dict[str, int]) -> None:
    with pytest.raises(InvalidError):
        EngineConfig(num_blocks=4, remote_blocks=8, **extra)
