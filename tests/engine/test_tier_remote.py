"""Tier 2's metadata (`kvd.engine.tier`, level 2): learned names, failures forgotten."""

from __future__ import annotations

import pytest

from kvd.engine import Allocation, BlockRemoved, BlockStored

from .support import BS, Checked, MakeEngine, toks

#: Two "nodes": engines of 8 blocks, each indexing 4 names of the shared store.
Nodes = tuple[Checked, Checked]


@pytest.fixture
def nodes(make_engine: MakeEngine) -> Nodes:
    def node() -> Checked:
        return make_engine(num_blocks=8, tier_blocks=4, tier_level=2, eviction="lru")

    return node(), node()


def stored_on(eng: Checked, tokens: int) -> list[tuple[str, bytes]]:
    """``tokens`` ids from 0 cached on ``eng`` and copied to the store; the names copied."""
    r = eng.allocate(1, "a", toks(tokens))
    assert isinstance(r, Allocation)
    eng.commit(1, "a")
    eng.free(1, "a")
    assert eng.tier.demoted(eng.tier.demotions(100), True)
    return list(eng.tier.entries)


def learned(nodes: Nodes, tokens: int) -> Checked:
    """Node B after learning what node A stored of ``tokens`` ids."""
    a, b = nodes
    names = stored_on(a, tokens)
    assert b.tier.learn(names[0][0], [key for _, key in names]) == len(names)
    return b


def test_demotions_are_announced_as_tier_2(nodes: Nodes) -> None:
    a, _ = nodes
    a.drain_events()
    stored_on(a, 2 * BS + 1)
    tiers = [(e.tier, len(e.keys)) for e in a.drain_events() if isinstance(e, BlockStored)]
    assert tiers == [(0, 2), (2, 2)]


def test_names_another_node_stored_are_promoted(nodes: Nodes) -> None:
    b = learned(nodes, 2 * BS + 1)
    promo = b.promote(1, "c", toks(2 * BS + 1))
    assert promo is not None and len(promo.pairs) == 2
    assert b.tier.promoted(promo, True) == 2
    r = b.allocate(1, "c", toks(2 * BS + 1))
    assert isinstance(r, Allocation) and r.num_cached_tokens == 2 * BS


def test_a_name_learned_twice_is_indexed_once(nodes: Nodes) -> None:
    a, b = nodes
    names = stored_on(a, 2 * BS + 1)
    keys = [key for _, key in names]
    b.tier.learn(names[0][0], keys)
    assert b.tier.learn(names[0][0], keys) == 0
    assert b.stats().tier.blocks == 2


def test_a_failed_promotion_forgets_its_names(nodes: Nodes) -> None:
    b = learned(nodes, 2 * BS + 1)
    promo = b.promote(1, "c", toks(2 * BS + 1))
    assert promo is not None
    assert b.tier.promoted(promo, False) == 0
    assert b.stats().tier.blocks == 0 and b.stats().tier.errors == 2
    assert b.promote(1, "c", toks(2 * BS + 1)) is None


def test_a_learned_name_leaves_the_index_without_an_event(nodes: Nodes) -> None:
    b = learned(nodes, 4 * BS + 1)
    b.drain_events()
    b.tier.learn("other", [bytes(32)])  # the index is full: the oldest name goes
    assert not [e for e in b.drain_events() if isinstance(e, BlockRemoved)]
    assert b.stats().tier.evictions == 1


def test_a_flush_announces_the_remote_copies_as_tier_2(nodes: Nodes) -> None:
    a, _ = nodes
    names = stored_on(a, 2 * BS + 1)
    a.drain_events()
    a.flush(names[0][0])
    removed = [e for e in a.drain_events() if isinstance(e, BlockRemoved) and e.tier]
    assert [(e.tier, len(e.keys)) for e in removed] == [(2, 2)]
