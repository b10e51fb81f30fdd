"""Helpers of the integration tests: ``examples/`` on the path (the tiny model, the daemon)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

#: The pool the test daemon serves, and its size in blocks.
POOL = "tiny-hf"
NUM_BLOCKS = 128


def tokens(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    """``[1, n]`` random token ids, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=gen)


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (examples/ importable); its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
