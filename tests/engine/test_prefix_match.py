"""PrefixIndex.match: the longest leading run, whatever the chunk boundaries."""

from __future__ import annotations

import pytest

from kvd.engine.block import Block
from kvd.engine.prefix_index import PrefixIndex


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.mark.parametrize("hits", [0, 1, 15, 16, 17, 47, 48, 49, 200, 500])
@pytest.mark.parametrize("total", [0, 1, 16, 48, 500])
def test_match_stops_at_the_first_miss(hits: int, total: int) -> None:
    index = PrefixIndex()
    blocks = [Block(i) for i in range(total)]
    for i, block in enumerate(blocks[:hits]):
        index[_key(i)] = block
    # Keys present after the miss never count.
    for i in range(hits + 1, total):
        index[_key(i)] = blocks[i]
    got = index.match([_key(i) for i in range(total)])
    assert got == blocks[: min(hits, total)]
