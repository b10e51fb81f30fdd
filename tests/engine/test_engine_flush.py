"""Engine: flush, namespace epochs and isolation."""

from __future__ import annotations

import numpy as np
from kvd_client.wire.hashing import BlockHasher

from kvd.engine import AllBlocksCleared, Allocation, BlockRemoved, Committed

from .support import BS, Checked, toks


def alloc(eng: Checked, seq: str, tokens: np.ndarray, sid: int = 1) -> Allocation:
    r = eng.allocate(sid, seq, tokens)
    assert isinstance(r, Allocation), r
    return r


def cache(eng: Checked, seq: str, tokens: np.ndarray, sid: int = 1) -> Allocation:
    r = alloc(eng, seq, tokens, sid)
    eng.commit(sid, seq)
    return r


def test_flush_frees_evictable_blocks_at_once(eng: Checked) -> None:
    cache(eng, "a", toks(9))
    eng.free(1, "a")
    assert eng.flush() == 2
    s = eng.stats()
    assert (s.blocks_evictable, s.blocks_free) == (0, 16)


def test_flush_of_everything_is_one_all_cleared_event(eng: Checked) -> None:
    cache(eng, "a", toks(9))
    eng.drain_events()
    eng.flush()
    assert eng.drain_events() == [AllBlocksCleared()]


def test_blocks_in_use_at_a_flush_never_match_again(eng: Checked) -> None:
    cache(eng, "a", toks(9))
    eng.flush()
    assert alloc(eng, "b", toks(9)).num_cached_tokens == 0
    eng.free(1, "a")
    assert eng.stats().blocks_evictable == 0


def test_sequences_from_before_a_flush_never_publish(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    eng.flush()
    eng.drain_events()
    assert eng.commit(1, "a") == Committed(9, 0)
    assert eng.drain_events() == []
    assert alloc(eng, "b", toks(9)).num_cached_tokens == 0


def test_a_fork_of_a_sequence_from_before_a_flush_never_publishes(eng: Checked) -> None:
    alloc(eng, "a", toks(9))
    eng.flush()
    eng.fork(1, "a", "b")
    assert eng.commit(1, "b") == Committed(9, 0)


def test_sequences_after_a_flush_publish_again(eng: Checked) -> None:
    eng.flush()
    cache(eng, "a", toks(9))
    assert alloc(eng, "b", toks(9)).num_cached_tokens == 8


def test_a_namespace_flush_spares_other_namespaces(eng: Checked) -> None:
    eng.open_session(2, namespace="t")
    cache(eng, "a", toks(9))
    cache(eng, "b", toks(9), sid=2)
    eng.flush("t")
    assert alloc(eng, "c", toks(9)).num_cached_tokens == 8
    assert alloc(eng, "d", toks(9), sid=2).num_cached_tokens == 0


def test_a_namespace_flush_reports_its_keys_removed(eng: Checked) -> None:
    eng.open_session(2, namespace="t")
    cache(eng, "b", toks(9), sid=2)
    keys = list(eng._accounts.namespaces["t"].index)
    eng.drain_events()
    assert eng.flush("t") == 2
    assert eng.drain_events() == [BlockRemoved(keys)]


def test_a_namespace_flush_bumps_only_that_epoch(eng: Checked) -> None:
    eng.open_session(2, namespace="t")
    eng.flush("t")
    assert (eng.stats().namespaces[""].epoch, eng.stats().namespaces["t"].epoch) == (0, 1)


def test_flushing_an_unknown_namespace_drops_nothing(eng: Checked) -> None:
    assert eng.flush("nobody") == 0
    assert eng.drain_events() == []


def test_different_namespaces_never_match(eng: Checked) -> None:
    eng.open_session(2, namespace="t")
    cache(eng, "a", toks(9))
    assert alloc(eng, "b", toks(9), sid=2).num_cached_tokens == 0


def test_sessions_of_one_namespace_share_the_cache(eng: Checked) -> None:
    eng.open_session(2)
    a = cache(eng, "a", toks(9))
    b = alloc(eng, "b", toks(9), sid=2)
    assert b.table[:2] == a.table[:2]


def test_different_adapters_never_match(eng: Checked) -> None:
    eng.open_session(2, adapter="lora-a")
    eng.open_session(3, adapter="lora-b")
    cache(eng, "a", toks(9), sid=2)
    assert alloc(eng, "b", toks(9), sid=3).num_cached_tokens == 0
    assert alloc(eng, "c", toks(9)).num_cached_tokens == 0


def test_namespaces_are_isolated_even_when_keys_collide(eng: Checked) -> None:
    class Unsalted(BlockHasher):
        def keys(self, tokens, parent, *, first_block=0, namespace="", adapter=None):  # type: ignore[no-untyped-def]
            return super().keys(tokens, parent, first_block=first_block, adapter=adapter)

    eng.engine._hasher = Unsalted(BS)
    eng.open_session(2, namespace="t")
    cache(eng, "a", toks(9))
    assert alloc(eng, "b", toks(9), sid=2).num_cached_tokens == 0
