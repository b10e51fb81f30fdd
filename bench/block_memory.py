"""What a cached block costs in Python memory: kvd's `Block` records vs a struct of arrays.

    .venv/bin/python -m bench.block_memory [--blocks N]

Context for ``scale.py``'s memory row (no anchor: both layouts hold the same
state). Each layout builds ``N`` cached blocks with 32-byte keys and a
key -> block index, and the figure is `tracemalloc`'s traced growth per block:
the Python heap only, without the allocator's slack that a daemon's RSS adds.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import tracemalloc
from array import array
from collections.abc import Callable
from typing import Any

from kvd.engine.block import Block


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def records(n: int) -> Any:
    """The engine's layout: one `Block` per block, its key, one index dict."""
    blocks = [Block(i) for i in range(n)]
    index: dict[bytes, Block] = {}
    for block in blocks:
        block.key = key = _key(block.block_id)
        index[key] = block
    return blocks, index


def struct_of_arrays(n: int) -> Any:
    """The same state as arrays indexed by block id: ids, ref counts, links, keys."""
    ids = list(range(n))
    ref = [0] * n
    links = array("i", bytes(8 * n))  # prev and next
    keys: list[bytes | None] = [None] * n
    uses = bytearray(n)
    index: dict[bytes, int] = {}
    for i in ids:
        keys[i] = key = _key(i)
        index[key] = i
    return ids, ref, links, keys, uses, index


def per_block(build: Callable[[int], Any], n: int) -> float:
    """Traced bytes per block that ``build(n)`` holds."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    state = build(n)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del state
    return (after - before) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    for name, build in (("Block records", records), ("struct of arrays", struct_of_arrays)):
        print(f"{name:17} {per_block(build, args.blocks):6.0f} B per cached block")


if __name__ == "__main__":
    main()
