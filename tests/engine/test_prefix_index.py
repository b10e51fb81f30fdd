"""The per-namespace prefix index."""

from __future__ import annotations

from kvd.engine.block import Block
from kvd.engine.prefix_index import PrefixIndex


def test_match_returns_the_longest_leading_run() -> None:
    index = PrefixIndex()
    a, b = Block(0), Block(1)
    index[b"a"] = a
    index[b"b"] = b
    assert index.match([b"a", b"b"]) == [a, b]


def test_match_stops_at_the_first_miss() -> None:
    index = PrefixIndex()
    index[b"a"] = Block(0)
    index[b"c"] = Block(2)
    assert [blk.block_id for blk in index.match([b"a", b"b", b"c"])] == [0]


def test_match_of_nothing_is_empty() -> None:
    assert PrefixIndex().match([]) == []
    assert PrefixIndex().match([b"x"]) == []


def test_match_looks_no_further_than_stop() -> None:
    """A bound inside a chunk and past the keys alike (40 keys: three chunks)."""
    index = PrefixIndex()
    keys = [bytes([i]) for i in range(40)]
    for i, key in enumerate(keys):
        index[key] = Block(i)
    for stop in (0, 1, 15, 16, 17, 39, 40, 41):
        assert [blk.block_id for blk in index.match(keys, stop)] == list(range(min(stop, 40)))
    assert len(index.match(keys, None)) == 40
