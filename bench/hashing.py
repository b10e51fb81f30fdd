"""Block hashing: kvd's C loop beside its Python path, hashlib's floor and cbor2.

Workload: 2,000 prompts of 256-2,048 tokens (uniform lengths, fixed seed),
block size 16, token ids uniform below the vocabulary size; every prompt is
hashed from the root in one call. Then the same for exactly 2,048-token
prompts (128 blocks per call), and for single-block calls chained to a parent
(what decoding does every 16 tokens).

Columns, microseconds per block, all on the same blocks in the same process:

- ``C array`` / ``C list`` / ``C blob``: ``BlockHasher.keys`` (the C loop of
  ``_keys.c``) on int32 arrays (the wire's form), on lists (vLLM keeps token ids
  in lists), and ``keys_blob`` on int32 arrays (one bytes object per call).
- ``Python``: ``BlockHasher.keys_python`` on int32 arrays, the reference path
  (what ``keys`` runs where the extension is not built).
- ``floor``: hashlib alone, one ``sha256()`` object, update and digest per
  block over the block's CBOR encoded before the clock: the least any Python
  loop over blocks can cost.
- ``cbor2``: one Python tuple, ``cbor2.dumps(..., canonical=True)`` and
  ``sha256`` per block, the way vLLM 0.33.0's ``hash_block_tokens`` does it with
  ``sha256_cbor`` (vLLM adds its request bookkeeping around that).

``cbor2/C`` is the cbor2 form's time over the C loop's on arrays. Each figure is
the best of ``--repeat`` passes, timed in process CPU time (the work is
single-threaded) with the cyclic GC off, so that other processes on a shared
machine disturb it less.
Every path's keys are checked against the cbor2 form's.

Run: ``.venv/bin/python bench/hashing.py [--prompts N] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import numpy as np
import numpy.typing as npt
from kvd_client.wire.hashing import IMPLEMENTATION, BlockHasher, root_digest

BLOCK_SIZE = 16
# Llama 2 / Mistral, Llama 3, Qwen 2: the share of ids of each CBOR width differs.
VOCABS = (32_000, 128_256, 151_936)


def reference(prompts: Sequence[list[int]], root: bytes) -> list[list[bytes]]:
    """One tuple, one cbor2 call and one sha256 per block, as vLLM."""
    out = []
    for tokens in prompts:
        parent = root
        keys = []
        for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
            block = tuple(tokens[start : start + BLOCK_SIZE])
            parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
            keys.append(parent)
        out.append(keys)
    return out


def encodings(
    prompts: Sequence[list[int]], keys: Sequence[list[bytes]], root: bytes
) -> list[bytes]:
    """The CBOR of every block (its parent from ``keys``), for the floor."""
    out = []
    for tokens, prompt_keys in zip(prompts, keys, strict=True):
        for i, parent in enumerate([root, *prompt_keys[:-1]]):
            block = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            out.append(cbor2.dumps((parent, block, None), canonical=True))
    return out


def floor(blocks: Sequence[bytes]) -> list[bytes]:
    """hashlib alone: one sha256 object, update and digest per block."""
    sha256 = hashlib.sha256
    out = []
    for data in blocks:
        h = sha256()
        h.update(data)
        out.append(h.digest())
    return out


def best_of(repeat: int, run: Callable[[], Any]) -> tuple[float, Any]:
    """Least CPU time of ``repeat`` runs, and the last run's result.

    The cyclic GC is off while timing (as in timeit): its passes over the
    benchmark's own objects would land on whichever column is running."""
    best, result = float("inf"), None
    for _ in range(repeat):
        result = None
        gc.collect()
        gc.disable()
        try:
            t0 = time.process_time()
            result = run()
            best = min(best, time.process_time() - t0)
        finally:
            gc.enable()
    return best, result


def measure(
    label: str, arrays: Sequence[npt.NDArray[np.int32]], repeat: int, parent: bytes | None = None
) -> None:
    hasher = BlockHasher(BLOCK_SIZE)
    lists = [a.tolist() for a in arrays]
    blocks = sum(len(a) // BLOCK_SIZE for a in arrays)
    first = 0 if parent is None else 1
    root = parent or root_digest()
    t_ref, want = best_of(repeat, lambda: reference(lists, root))
    encoded = encodings(lists, want, root)
    times = {}
    for name, run in [
        ("C array", lambda: [hasher.keys(a, parent, first_block=first) for a in arrays]),
        ("C list", lambda: [hasher.keys(t, parent, first_block=first) for t in lists]),
        ("C blob", lambda: [hasher.keys_blob(a, parent, first_block=first) for a in arrays]),
        ("Python", lambda: [hasher.keys_python(a, parent, first_block=first) for a in arrays]),
    ]:
        times[name], got = best_of(repeat, run)
        if name == "C blob":
            got = [[b[i : i + 32] for i in range(0, len(b), 32)] for b in got]
        if got != want:
            raise SystemExit(f"{label}: {name}'s keys differ from the cbor2 form's")
    times["floor"], got = best_of(repeat, lambda: floor(encoded))
    if got != [key for keys in want for key in keys]:
        raise SystemExit(f"{label}: the floor's keys differ from the cbor2 form's")
    times["cbor2"] = t_ref
    us = 1e6 / blocks
    cells = " ".join(f"{t * us:7.3f}" for t in times.values())
    print(f"  {label:<34} {cells}   x{t_ref / times['C array']:5.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    print(
        f"block size {BLOCK_SIZE}; CPU microseconds per block (best of {args.repeat});"
        f" BlockHasher.keys runs {IMPLEMENTATION!r}"
    )
    columns = ("C array", "C list", "C blob", "Python", "floor", "cbor2")
    print(f"  {'workload':<34} {' '.join(f'{c:>7}' for c in columns)}   cbor2/C")
    for vocab in VOCABS:
        lengths = rng.integers(256, 2049, args.prompts)
        prompts = [rng.integers(0, vocab, n, dtype=np.int32) for n in lengths]
        measure(f"{args.prompts} prompts 256-2048, vocab {vocab}", prompts, args.repeat)
        full = [rng.integers(0, vocab, 2048, dtype=np.int32) for _ in range(args.prompts // 4)]
        measure(f"{len(full)} prompts of 2048, vocab {vocab}", full, args.repeat)
        single = [
            rng.integers(0, vocab, BLOCK_SIZE, dtype=np.int32) for _ in range(args.prompts * 4)
        ]
        parent = hashlib.sha256(b"a block before").digest()
        measure(f"{len(single)} single blocks, vocab {vocab}", single, args.repeat, parent)


if __name__ == "__main__":
    main()
