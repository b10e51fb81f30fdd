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
