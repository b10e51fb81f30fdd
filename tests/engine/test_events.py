"""Event records."""

from __future__ import annotations

import numpy as np

from kvd.engine import AllBlocksCleared, BlockRemoved, BlockStored


def test_block_stored_reads_token_ids_as_ints() -> None:
    ev = BlockStored(
        [b"k" * 32],
        None,
        np.arange(4, dtype=np.int32),
        block_size=4,
        namespace="",
        adapter=None,
    )
    assert ev.token_ids == [0, 1, 2, 3]
    assert all(type(t) is int for t in ev.token_ids)


def test_events_compare_by_value() -> None:
    def stored(tokens: list[int]) -> BlockStored:
        return BlockStored(
            [b"k" * 32],
            b"p" * 32,
            np.array(tokens, dtype=np.int32),
            block_size=2,
            namespace="ns",
            adapter="lora",
        )

    assert stored([1, 2]) == stored([1, 2])
    assert stored([1, 2]) != stored([1, 3])
    assert BlockRemoved([b"a"]) == BlockRemoved([b"a"])
    assert BlockRemoved([b"a"]) != BlockRemoved([b"b"])
    assert AllBlocksCleared() == AllBlocksCleared()
    assert AllBlocksCleared() != BlockRemoved([])
