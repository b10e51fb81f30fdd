"""A sequence's state: a client's request, its tokens and its block table."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvd.engine.block import Block

__all__ = ["SequenceState"]


class SequenceState:
    """A request's state (metadata only), filed under its session's ``seqs``
    (the session, and through it the namespace, is the owner: no back link).

    - ``tokens[:length]`` are its token ids, in a growing int32 buffer;
      ``shared`` says the buffer may be another sequence's too (a fork
      shares its parent's): `write` copies it first.
    - ``table`` holds exactly ``ceil(length / block_size)`` blocks.
    - ``committed`` tokens are written; ``num_cached`` leading full blocks
      have been offered to the prefix cache (published, or left private as
      duplicates or because the sequence predates a flush).
    - ``keys[i]`` is the hash key of full block ``i``, computed lazily and
      never twice; ``len(keys) >= num_cached``.
    - ``epoch`` is its namespace's epoch at creation: after a flush bumps
      the namespace's epoch the sequence never publishes again.
    - ``reserve`` (tokens) and ``reserve_blocks = ceil(reserve / bs)`` are
      the growth it was promised; ``cow`` says its partial last block may be
      shared or cached (so growing needs a private copy first); ``out`` is
      the number of blocks still held in reserve for it.
    """

    __slots__ = (
        "committed",
        "cow",
        "epoch",
        "keys",
        "length",
        "num_cached",
        "out",
        "reserve",
        "reserve_blocks",
        "seq_id",
        "shared",
        "table",
        "tokens",
    )

    def __init__(
        self,
        seq_id: str,
        epoch: int,
        *,
        tokens: npt.NDArray[np.int32],
        length: int,
        table: list[Block],
        keys: list[bytes],
        num_cached: int,
        reserve: int,
        reserve_blocks: int,
        out: int,
    ) -> None:
        self.seq_id = seq_id
        self.epoch = epoch
        self.tokens = tokens
        self.length = length
        self.table = table
        self.committed = 0
        self.keys = keys
        self.num_cached = num_cached
        self.reserve = reserve
        self.reserve_blocks = reserve_blocks
        self.cow = False
        self.out = out
        self.shared = False

    def write(self, tokens: npt.NDArray[np.int32]) -> None:
        """Append ``tokens`` to the buffer, doubling its capacity as needed
        (and copying a shared buffer first: its other owners keep theirs)."""
        start = self.length
        n = tokens.shape[0]
        end = start + n
        buf = self.tokens
        capacity = buf.shape[0]
        if end > capacity or self.shared:
            grown = np.empty(max(end, 2 * capacity, 64) if end > capacity else capacity, np.int32)
            grown[:start] = buf[:start]
            self.tokens = buf = grown
            self.shared = False
        if n == 1:
            buf[start] = tokens[0]  # a scalar store is several times cheaper than a slice
        else:
            buf[start:end] = tokens
        self.length = end

    def __repr__(self) -> str:
        return (
            f"SequenceState({self.seq_id!r}, length={self.length}, blocks={len(self.table)}, "
            f"committed={self.committed}, reserve={self.reserve})"
        )
