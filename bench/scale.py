"""How kvd scales with the pool's size: per-operation time, memory per block, start-up.

1. Per-operation time, in process: an engine of 10,000 and one of 1,000,000 blocks,
   each first filled with cached blocks (every block keyed and evictable, the
   state a busy daemon lives in), then timed on the same cycle: ``allocate`` a
   256-token prompt of new tokens (16 blocks, no hit: 16 evictions), ``commit``,
   ``free``. Batches of cycles alternate between the two engines; the figure is the
   median time per cycle. Target: at 1M <= 1.3x at 10k.
2. Daemon memory per block: a daemon (``python -m kvd.cli``) with a pool of each size,
   filled the same way by a client over ipc://, then its private memory
   (``RssAnon`` from ``/proc``: everything but the pool's shared segment, which is
   ``RssShmem``). The figure is the difference between the two daemons divided by
   the difference in blocks: what one more block costs. The anchor is the bare
   floor of any Python prefix index: a dict of 1M 32-byte keys to ints, measured
   in a child process the same way. Target: <= 128 bytes per block.
3. Start-up of a 1M-block pool: from spawning the daemon to its ``ready`` log event
   (pool created, reserved and prefaulted, engine built, socket bound), median of
   ``--repeat``; beside it, the interpreter and imports alone (``python -c "import
   kvd.cli"``). Target: ready within 2 s.

The pools use a tiny layout (1 layer, 1 head, head_dim 1: 64 bytes a block) so that
the pool's bytes stay small; the engine's metadata does not depend on the layout.

Run: ``.venv/bin/python -m bench.scale [--cycles 2000] [--repeat 3] [--json]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import Figure, machine, print_table, run_daemon, write_results
from kvd.engine import Allocation, Engine, EngineConfig

__all__ = ["fill_client", "fill_engine", "main", "private_bytes"]

SIZES = (10_000, 1_000_000)
BLOCK_SIZE = 16
PROMPT = 256
FILL = 4096 * BLOCK_SIZE
TINY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1}
TARGET_OP = 1.3
#: Daemon heap per cached block (issue #15: 128 B; it was 200 B before).
BUDGET_BYTES = 128.0
BUDGET_READY = 2.0


class Tokens:
    """Never-repeating token ids, so every block is new (no prefix hits)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.int64) % (2**31 - 1)
        self.next += n
        return out.astype(np.int32)


def fill_engine(eng: Engine, tokens: Tokens, num_blocks: int) -> None:
    """Allocate, commit and free new prompts until every block is cached."""
    cached = 0
    while cached < num_blocks:
        n = min(FILL, (num_blocks - cached) * BLOCK_SIZE)
        r = eng.allocate(1, "fill", tokens.take(n))
        assert isinstance(r, Allocation), r
        eng.commit(1, "fill")
        eng.free(1, "fill")
        cached += n // BLOCK_SIZE


def fill_client(kv: Any, tokens: Tokens, num_blocks: int) -> None:
    """`fill_engine` through a daemon: new prompts allocated, committed and
    freed by ``kv`` (a `kvd_client.Client`) until ``num_blocks`` blocks were used."""
    used = 0
    while used < num_blocks:
        n = min(FILL, (num_blocks - used) * BLOCK_SIZE)
        seq = kv.allocate("fill", tokens.take(n))
        seq.commit()
        seq.free()
        used += n // BLOCK_SIZE


def cycle_seconds(eng: Engine, tokens: Tokens, cycles: int) -> float:
    """Seconds per allocate/commit/free cycle of a new 256-token prompt."""
    prompts = [tokens.take(PROMPT) for _ in range(cycles)]
    allocate, commit, free = eng.allocate, eng.commit, eng.free
    t0 = time.perf_counter()
    for prompt in prompts:
        allocate(1, "c", prompt)
        commit(1, "c")
        free(1, "c")
    return (time.perf_counter() - t0) / cycles


def per_op(cycles: int, rounds: int) -> dict[int, float]:
    """Median seconds per cycle for each pool size."""
    engines = {}
    for size in SIZES:
        eng = Engine(EngineConfig(num_blocks=size, block_size=BLOCK_SIZE, events=False))
        eng.open_session(1)
        tokens = Tokens()
        fill_engine(eng, tokens, size)
        engines[size] = (eng, tokens)
    times: dict[int, list[float]] = {size: [] for size in SIZES}
    for _ in range(rounds):
        for size, (eng, tokens) in engines.items():
            times[size].append(cycle_seconds(eng, tokens, cycles))
    for eng, _ in engines.values():
        eng.check_invariants()
    return {size: statistics.median(t) for size, t in times.items()}


def private_bytes(pid: int) -> int:
    """``RssAnon`` of ``pid``: resident memory that is not a shared segment or a file."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for pid {pid}")


def daemon_memory(size: int) -> tuple[int, float]:
    """(private bytes of a daemon whose ``size``-block pool is all cached, its ready s)."""
    from kvd_client import Client

    with (
        run_daemon({**TINY, "num_blocks": size}, timeout=120) as daemon,
        Client.connect(daemon.address, pool="default", name="scale") as kv,
    ):
        fill_client(kv, Tokens(), size)
        kv.heartbeat()
        return private_bytes(daemon.pid), daemon.ready_seconds


_DICT_FLOOR = """
import hashlib, sys
from pathlib import Path
def anon():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
n = int(sys.argv[1])
before = anon()
index = {hashlib.sha256(i.to_bytes(8, "little")).digest(): i for i in range(n)}
print((anon() - before) / n)
"""


def dict_floor(n: int) -> float:
    """Bytes per entry of a dict of ``n`` 32-byte keys to ints, in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", _DICT_FLOOR, str(n)], capture_output=True, text=True, check=True
    )
    return float(out.stdout)


def ready_times(size: int, repeat: int) -> tuple[float, float]:
    """Median seconds to ``ready`` of a fresh ``size``-block daemon, and its pool's share."""
    ready, pool = [], []
    for _ in range(repeat):
        with run_daemon({**TINY, "num_blocks": size}, timeout=120) as daemon:
            ready.append(daemon.ready_seconds)
            pool.append(daemon.event("pool_ready")["startup_ms"] / 1e3)
    return statistics.median(ready), statistics.median(pool)


def import_seconds(repeat: int) -> float:
    """Median seconds for a fresh interpreter to import the daemon's code."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import kvd.cli"], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=2000, help="cycles per timed batch")
    parser.add_argument("--rounds", type=int, default=7, help="timed batches per size")
    parser.add_argument("--repeat", type=int, default=3, help="daemon starts to time")
    parser.add_argument("--json", action="store_true", help="also write bench/results/")
    args = parser.parse_args()
    small, large = SIZES
    ops = per_op(args.cycles, args.rounds)
    memory = {size: daemon_memory(size)[0] for size in SIZES}
    per_block = (memory[large] - memory[small]) / (large - small)
    floor = dict_floor(large)
    ready, pool_share = ready_times(large, args.repeat)
    imports = import_seconds(args.repeat)
    print(
        f"per cycle: {1e6 * ops[small]:.1f} us at {small:,} blocks, "
        f"{1e6 * ops[large]:.1f} us at {large:,}; daemon private memory (pool all cached): "
        f"{memory[small] / 2**20:.0f} MiB at {small:,}, {memory[large] / 2**20:.0f} MiB at "
        f"{large:,}; a dict of {large:,} 32-byte keys: {floor:.0f} B/entry; 1M-block "
        f"start: {ready:.2f} s to ready, of which pool creation {pool_share:.2f} s, "
        f"interpreter + imports alone {imports:.2f} s"
    )
    figures = [
        Figure(
            "allocate/commit/free at 1M blocks",
            1e6 * ops[large],
            "us",
            "same at 10k blocks",
            1e6 * ops[small],
            TARGET_OP,
            higher_is_better=False,
        ),
        Figure(
            "daemon private memory per block",
            per_block,
            "B",
            "budget",
            BUDGET_BYTES,
            1.0,
            higher_is_better=False,
            note=f"floor of any Python index (dict of 32-byte keys): {floor:.0f} B",
        ),
        Figure(
            "1M-block daemon, spawn to ready",
            ready,
            "s",
            "budget",
            BUDGET_READY,
            1.0,
            higher_is_better=False,
            note=f"pool creation {pool_share:.2f} s; interpreter + imports {imports:.2f} s",
        ),
    ]
    print_table(f"scale: 10k vs 1M blocks ({machine()})", figures)
    if args.json:
        write_results("scale", figures, {"cycles": args.cycles, "rounds": args.rounds})


if __name__ == "__main__":
    main()
