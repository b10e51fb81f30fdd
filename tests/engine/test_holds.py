"""kvd.engine.holds: lookup with holds, grants, publish after write, release."""

from __future__ import annotations

import pytest
from kvd_client.wire.hashing import BlockHasher

from kvd.engine import Code, Engine, EngineConfig, Granted, InvalidError, Looked, Refusal

from .support import BS, Checked, snapshot, toks


@pytest.fixture
def eng() -> Checked:
    e = Checked(Engine(EngineConfig(num_blocks=8, block_size=BS)))
    e.open_session(1)
    e.open_session(2)
    e.open_session(3, namespace="other")
    return e


def keys(n: int) -> list[bytes]:
    return BlockHasher(BS).keys(toks(n * BS), None)


def test_granted_blocks_published_are_found_by_another_session(eng: Checked) -> None:
    g = eng.grant(1, 2)
    assert isinstance(g, Granted)
    assert eng.publish(1, g.hold_id, g.blocks, keys(2), tokens=toks(2 * BS)) == 2
    eng.release(1, g.hold_id)
    found = eng.lookup(2, keys(3), hold=True)
    assert isinstance(found, Looked)
    assert (found.cached, found.blocks) == (2, g.blocks)
    assert eng.release(2, found.hold_id) == 2


def test_a_lookup_without_hold_changes_no_ref(eng: Checked) -> None:
    g = eng.grant(1, 1)
    assert isinstance(g, Granted)
    eng.publish(1, g.hold_id, g.blocks, keys(1), tokens=toks(BS))
    found = eng.lookup(2, keys(1))
    assert isinstance(found, Looked)
    assert (found.cached, found.blocks, found.hold_id) == (1, [], 0)


def test_another_namespace_never_sees_the_blocks_or_the_hold(eng: Checked) -> None:
    g = eng.grant(1, 1)
    assert isinstance(g, Granted)
    eng.publish(1, g.hold_id, g.blocks, keys(1), tokens=toks(BS))
    found = eng.lookup(3, keys(1), hold=True)
    assert isinstance(found, Looked)
    assert found.cached == 0
    assert eng.release(3, g.hold_id) == 0  # not found from another namespace


def test_a_hold_is_released_by_another_session_of_its_namespace(eng: Checked) -> None:
    g = eng.grant(1, 3)
    assert isinstance(g, Granted)
    assert eng.release(2, g.hold_id) == 3
    assert eng.release(1, g.hold_id) == 0  # gone already: not an error
    assert eng.stats().session_usage[1] == 0


def test_a_grant_beyond_the_pool_is_refused_and_changes_nothing(eng: Checked) -> None:
    assert isinstance(eng.grant(1, 9), Refusal)
    assert eng.stats().blocks_free == 8


def test_publish_checks_everything_before_it_changes_anything(eng: Checked) -> None:
    g = eng.grant(1, 2)
    assert isinstance(g, Granted)
    with pytest.raises(InvalidError):
        eng.publish(1, g.hold_id, g.blocks, keys(1), tokens=toks(2 * BS))
    with pytest.raises(InvalidError):
        eng.publish(1, g.hold_id, [*g.blocks[:1], 7], keys(2), tokens=toks(2 * BS))
    with pytest.raises(InvalidError):
        eng.publish(1, g.hold_id, g.blocks, keys(2), tokens=toks(BS))
    assert eng.stats().namespaces[""].cached_blocks == 0


def test_closing_a_session_releases_its_holds(eng: Checked) -> None:
    g = eng.grant(1, 4)
    assert isinstance(g, Granted)
    eng.close_session(1)
    assert eng.stats().blocks_free == 8


def test_client_keys_on_allocate_match_the_engine_s_own(eng: Checked) -> None:
    prompt = toks(3 * BS + 1)
    a = eng.allocate(1, "a", prompt, keys=BlockHasher(BS).keys(prompt, None))
    assert not isinstance(a, Refusal)
    eng.commit(1, "a")
    b = eng.allocate(2, "b", prompt)
    assert not isinstance(b, Refusal)
    assert b.num_cached_tokens == 3 * BS


def test_allocate_refuses_a_wrong_number_of_keys(eng: Checked) -> None:
    with pytest.raises(InvalidError, match="full blocks"):
        eng.allocate(1, "a", toks(2 * BS), keys=keys(1))


def test_holds_past_the_held_limit_are_refused_and_change_nothing() -> None:
    eng = Checked(Engine(EngineConfig(num_blocks=8, block_size=BS, max_held_per_session=3)))
    eng.open_session(1)
    g = eng.grant(1, 2)
    assert isinstance(g, Granted)
    eng.publish(1, g.hold_id, g.blocks, keys(2), tokens=toks(2 * BS))
    before = snapshot(eng)
    del before["stats"]  # a refused lookup still counts as a prefix query
    for refused in (eng.lookup(1, keys(2), hold=True), eng.grant(1, 2)):
        assert isinstance(refused, Refusal) and refused.code is Code.TOO_LARGE
        assert "would hold 4 block references" in refused.message
    after = snapshot(eng)
    del after["stats"]
    assert after == before
    assert isinstance(eng.grant(1, 1), Granted)  # within the limit


def test_a_release_makes_room_under_the_held_limit() -> None:
    eng = Checked(Engine(EngineConfig(num_blocks=8, block_size=BS, max_held_per_session=2)))
    eng.open_session(1)
    g = eng.grant(1, 2)
    assert isinstance(g, Granted)
    assert isinstance(eng.grant(1, 1), Refusal)
    assert eng.release(1, g.hold_id, [g.blocks[0]]) == 1
    assert isinstance(eng.grant(1, 1), Granted)


def test_a_lookup_without_hold_ignores_the_held_limit() -> None:
    eng = Checked(Engine(EngineConfig(num_blocks=8, block_size=BS, max_held_per_session=1)))
    eng.open_session(1)
    g = eng.grant(1, 1)
    assert isinstance(g, Granted)
    eng.publish(1, g.hold_id, g.blocks, keys(1), tokens=toks(BS))
    found = eng.lookup(1, keys(1))
    assert isinstance(found, Looked) and found.cached == 1
