"""Helpers of the example tests: ``examples/`` on the path, worker processes, prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

#: The pool the test daemon serves, and its size in blocks.
POOL = "tiny"
NUM_BLOCKS = 128


def tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    """``n`` random token ids, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=gen)]


def run_worker(request: dict[str, Any]) -> dict[str, Any]:
    """Run ``python -m kvd_llm.worker`` as its own process; its JSON result."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-m", "kvd_llm.worker"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=EXAMPLES,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
