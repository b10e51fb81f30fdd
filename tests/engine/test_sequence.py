"""Sequence state."""

from __future__ import annotations

import numpy as np

from kvd.engine.sequence import SequenceState


def make(capacity: int) -> SequenceState:
    return SequenceState(
        "s",
        0,
        tokens=np.zeros(capacity, dtype=np.int32),
        length=0,
        table=[],
        keys=[],
        num_cached=0,
        reserve=0,
        reserve_blocks=0,
        out=0,
    )


def test_write_appends_after_the_length() -> None:
    seq = make(8)
    seq.write(np.array([1, 2], dtype=np.int32))
    seq.write(np.array([3], dtype=np.int32))
    assert seq.length == 3
    assert seq.tokens[:3].tolist() == [1, 2, 3]


def test_write_grows_the_buffer_keeping_the_tokens() -> None:
    seq = make(2)
    seq.write(np.array([5, 6], dtype=np.int32))
    seq.write(np.arange(100, dtype=np.int32))
    assert seq.length == 102
    assert seq.tokens.shape[0] >= 102
    assert seq.tokens[:102].tolist() == [5, 6, *range(100)]
