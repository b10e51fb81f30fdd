"""Block hashing: kvd's BlockHasher beside the per-block cbor2 form vLLM uses.

Workload: 2,000 prompts of 256-2,048 tokens (uniform lengths, fixed seed),
block size 16, token ids uniform below the vocabulary size; every prompt is
hashed from the root in one ``keys()`` call. The anchor is the
straightforward form, run on the same blocks in the same process: one Python
tuple per block, ``cbor2.dumps(..., canonical=True)`` and ``sha256``, the way
vLLM 0.33.0's ``hash_block_tokens`` does it with ``sha256_cbor`` (vLLM itself
adds its request bookkeeping around that, so this anchor is its floor).

Figures: microseconds per block for kvd with numpy input (the wire's form),
kvd with a list input (vLLM keeps token ids in lists), and the anchor, with
the anchor/kvd ratio; then the same for exactly 2,048-token prompts (128
blocks per call), and for single-block calls chained to a parent (what
decoding does every 16 tokens). Each figure is the best of ``--repeat`` passes, timed in
process CPU time (the work is single-threaded), so that other processes on a
shared machine disturb it less. Every kvd key is checked against the anchor's.

Run: ``.venv/bin/python bench/hashing.py [--prompts N] [--repeat R]``.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import numpy as np
import numpy.typing as npt
from kvd_client.wire.hashing import BlockHasher, root_digest

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


def best_of(repeat: int, run: Callable[[], Any]) -> tuple[float, Any]:
    """Least CPU time of ``repeat`` runs, and the last run's result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        result = run()
        best = min(best, time.process_time() - t0)
    return best, result


def measure(
    label: str, arrays: Sequence[npt.NDArray[np.int64]], repeat: int, parent: bytes | None = None
) -> None:
    hasher = BlockHasher(BLOCK_SIZE)
    lists = [a.tolist() for a in arrays]
    blocks = sum(len(a) // BLOCK_SIZE for a in arrays)
    first = 0 if parent is None else 1
    t_array, got = best_of(
        repeat, lambda: [hasher.keys(a, parent, first_block=first) for a in arrays]
    )
    t_list, got_list = best_of(
        repeat, lambda: [hasher.keys(t, parent, first_block=first) for t in lists]
    )
    t_ref, want = best_of(repeat, lambda: reference(lists, parent or root_digest()))
    if got != want or got_list != want:
        raise SystemExit(f"{label}: kvd's keys differ from the reference")
    us = 1e6 / blocks
    print(
        f"  {label:<34} {t_array * us:6.3f} {t_list * us:6.3f} {t_ref * us:9.3f}"
        f"   x{t_ref / t_array:4.1f} / x{t_ref / t_list:4.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    print(
        f"block size {BLOCK_SIZE}; CPU microseconds per block (best of {args.repeat});"
        " ratio = reference / kvd (array / list input)"
    )
    print(f"  {'workload':<34} {'array':>6} {'list':>6} {'reference':>9}   ratio")
    for vocab in VOCABS:
        lengths = rng.integers(256, 2049, args.prompts)
        prompts = [rng.integers(0, vocab, n) for n in lengths]
        measure(f"{args.prompts} prompts 256-2048, vocab {vocab}", prompts, args.repeat)
        full = [rng.integers(0, vocab, 2048) for _ in range(args.prompts // 4)]
        measure(f"{len(full)} prompts of 2048, vocab {vocab}", full, args.repeat)
        single = [rng.integers(0, vocab, BLOCK_SIZE) for _ in range(args.prompts * 4)]
        parent = hashlib.sha256(b"a block before").digest()
        measure(f"{len(single)} single blocks, vocab {vocab}", single, args.repeat, parent)


if __name__ == "__main__":
    main()
