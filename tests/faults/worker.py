"""A client process doing random valid operations until it is told to stop (or killed).

Used by the fault-injection suite and the soak (``tests/soak/soak.py``)::

    python tests/faults/worker.py --address ipc:///tmp/x/kvd.sock --seed 3 \
        [--stats FILE --slot N] [--seconds S] [--exit-on-shutdown] [--max-seqs 6] [--max-len 80]

Operations: allocate (prompts sharing a few prefixes, so other workers hit
the cache; sometimes with a reservation), commit, append, fork, truncate,
free, pin, unpin, can_allocate, heartbeat; each picked at random among the
ones that are valid for the worker's sequences. Capacity refusals
(OUT_OF_BLOCKS) make it free something.

KV content: after every allocate/append the worker writes, for each new
token position ``p``, the value ``kv_value(token, p)`` into its blocks
(layer 0, K, head 0, dim 0) through its own mapping of the pool. KV is a
function of the token prefix, and so is this value, so every position of
every live sequence, prefix hits included, must read back as
``kv_value``; a block handed to two holders that write it would break
that. Mismatches count as ``integrity``; operations slower than `SLOW_S`
(time-outs included) as ``slow``.

Counters: with ``--stats FILE --slot N``, counts live in row N of an int64
array memory-mapped from FILE (no locks: one writer per row), so they
survive SIGKILL; names are `COUNTERS`. Standard output gets one JSON line
``{"event": "ready", ...}`` after each connect and ``{"event": "exit",
"counts": {...}}`` when the worker stops on its own.

Daemon gone or restarting: a request that times out (UNAVAILABLE) leaves
the worker unsure what happened to it, so it drops its client (goodbye
if possible) and connects anew; SESSION_LOST drops every local sequence
(the daemon forgot them). ``--exit-on-shutdown``: on SHUTTING_DOWN free
everything held and exit 0, as a well-behaved client does (and exit on
UNAVAILABLE: the daemon is gone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from kvd_client import Client, KvdError
from kvd_client.errors import DaemonUnavailable, OutOfBlocks, SessionLost, ShuttingDown
from kvd_client.wire import Code

OPS = (
    "allocate",
    "commit",
    "append",
    "fork",
    "truncate",
    "free",
    "pin",
    "unpin",
    "can_allocate",
    "heartbeat",
)
ERROR_CODES = (*(str(c) for c in Code), "UNAVAILABLE")
COUNTERS = (
    *(f"ok.{op}" for op in OPS),
    *(f"err.{code}" for code in ERROR_CODES),
    "integrity",
    "connects",
    "slow",
)
#: A request slower than this (s) counts as ``slow``.
SLOW_S = 1.0
INDEX = {name: i for i, name in enumerate(COUNTERS)}
#: Shared prompt heads: several workers allocate prompts starting with these.
PREFIXES = [list(range(1000 + 100 * k, 1000 + 100 * k + 48)) for k in range(4)]


def kv_value(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The KV the worker writes for ``tokens`` at ``positions`` (exact in float16)."""
    return ((tokens.astype(np.int64) * 7 + positions * 13) % 2039 + 1).astype(np.float16)


def open_counters(path: str | None, slot: int) -> np.ndarray:
    """Row ``slot`` of the shared counter file (a private row without a file)."""
    if path is None:
        return np.zeros(len(COUNTERS), dtype=np.int64)
    table = np.memmap(path, dtype=np.int64, mode="r+")
    return table.reshape(-1, len(COUNTERS))[slot]


class Seq:
    """The worker's view of one sequence: its handle and its token ids."""

    def __init__(self, handle: Any, tokens: list[int]) -> None:
        self.handle = handle
        self.tokens = tokens


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.counts = open_counters(args.stats, args.slot)
        self.kv: Client | None = None
        self.seqs: dict[str, Seq] = {}
        self.pins: list[Any] = []
        self.next_id = 0

    # -- bookkeeping -------------------------------------------------------

    def count(self, name: str) -> None:
        self.counts[INDEX[name]] += 1

    def emit(self, event: str, **data: Any) -> None:
        print(json.dumps({"event": event, **data}), flush=True)

    def forget_all(self) -> None:
        self.seqs.clear()
        self.pins.clear()

    def connect(self) -> None:
        while True:
            try:
                self.kv = Client.connect(
                    self.args.address,
                    name=f"worker-{self.args.slot}",
                    namespace=self.args.namespace,
                    timeout=self.args.timeout,
                )
            except DaemonUnavailable:
                self.count("err.UNAVAILABLE")
                self.emit("unavailable", op="hello")
                time.sleep(0.1)
                continue
            except ShuttingDown:
                self.count("err.SHUTTING_DOWN")
                time.sleep(0.1)
                continue
            self.count("connects")
            self.emit("ready", pid=os.getpid(), session=self.kv.session_id, epoch=self.kv.epoch)
            return

    def reconnect(self) -> None:
        if self.kv is not None:
            with contextlib.suppress(KvdError):
                self.kv.close()
        self.kv = None
        self.forget_all()
        self.connect()

    # -- KV content ---------------------------------------------------------

    def _cells(self, seq: Seq, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, Any]:
        assert self.kv is not None
        bs = self.kv.pool.layout.block_size
        table = seq.handle.block_table
        pos = np.arange(start, stop)
        layer = self.kv.pool.np_layers()[0]
        return table[pos // bs], pos % bs, layer

    def write(self, seq: Seq, start: int) -> None:
        stop = len(seq.tokens)
        if stop <= start:
            return
        blocks, offs, layer = self._cells(seq, start, stop)
        tokens = np.asarray(seq.tokens[start:stop])
        layer[0, blocks, offs, 0, 0] = kv_value(tokens, np.arange(start, stop))

    def verify(self, seq: Seq) -> None:
        n = len(seq.tokens)
        if not n:
            return
        blocks, offs, layer = self._cells(seq, 0, n)
        want = kv_value(np.asarray(seq.tokens), np.arange(n))
        if not np.array_equal(layer[0, blocks, offs, 0, 0], want):
            self.count("integrity")
            bad = int(np.flatnonzero(layer[0, blocks, offs, 0, 0] != want)[0])
            self.emit("integrity", seq=seq.handle.seq_id, position=bad, table=blocks.tolist())

    # -- operations ---------------------------------------------------------

    def prompt(self) -> list[int]:
        head = self.rng.choice(PREFIXES)[: self.rng.randrange(0, 49)]
        tail = [self.rng.randrange(0, 1000) for _ in range(self.rng.randrange(1, 24))]
        return (head + tail)[: self.args.max_len]

    def pick(self) -> tuple[str, Seq] | None:
        if not self.seqs:
            return None
        key = self.rng.choice(list(self.seqs))
        return key, self.seqs[key]

    def choose(self) -> str:
        weights = {
            "allocate": 4 if len(self.seqs) < self.args.max_seqs else 0,
            "commit": 3,
            "append": 4,
            "fork": 1 if len(self.seqs) < self.args.max_seqs else 0,
            "truncate": 1,
            "free": 2,
            "pin": 1 if len(self.pins) < 2 else 0,
            "unpin": 1 if self.pins else 0,
            "can_allocate": 1,
            "heartbeat": 1,
        }
        if not self.seqs:
            for op in ("commit", "append", "fork", "truncate", "free", "pin"):
                weights[op] = 0
        ops = [op for op, w in weights.items() if w]
        return self.rng.choices(ops, [weights[op] for op in ops])[0]

    def run_op(self, op: str) -> None:
        kv = self.kv
        assert kv is not None
        if op == "allocate":
            tokens = self.prompt()
            reserve = len(tokens) + self.rng.randrange(0, 32) if self.rng.random() < 0.3 else None
            self.next_id += 1
            seq_id = f"w{self.args.slot}-{self.next_id}"
            handle = kv.allocate(seq_id, np.asarray(tokens, dtype=np.int32), reserve=reserve)
            seq = self.seqs[seq_id] = Seq(handle, tokens)
            self.write(seq, handle.num_cached_tokens)
        elif op == "can_allocate":
            kv.can_allocate(self.rng.randrange(1, 64))
        elif op == "heartbeat":
            kv.heartbeat()
        elif op == "unpin":
            pin = self.pins.pop(self.rng.randrange(len(self.pins)))
            pin.unpin()
        else:
            picked = self.pick()
            assert picked is not None
            key, seq = picked
            self.seq_op(op, key, seq)
        self.count(f"ok.{op}")

    def seq_op(self, op: str, key: str, seq: Seq) -> None:
        handle = seq.handle
        if op == "commit":
            n = len(seq.tokens)
            handle.commit(self.rng.randrange(handle.num_committed, n + 1) if n else None)
        elif op == "append":
            room = self.args.max_len - len(seq.tokens)
            if room <= 0:
                handle.truncate(len(seq.tokens) // 2)
                del seq.tokens[len(seq.tokens) // 2 :]
                return
            new = [
                self.rng.randrange(0, 1000) for _ in range(self.rng.randrange(1, min(20, room) + 1))
            ]
            start = len(seq.tokens)
            handle.append(np.asarray(new, dtype=np.int32))
            seq.tokens.extend(new)
            self.write(seq, start)
        elif op == "fork":
            self.next_id += 1
            child_id = f"w{self.args.slot}-{self.next_id}"
            child = handle.fork(child_id)
            self.seqs[child_id] = Seq(child, list(seq.tokens))
        elif op == "truncate":
            n = self.rng.randrange(0, len(seq.tokens) + 1)
            handle.truncate(n)
            del seq.tokens[n:]
        elif op == "free":
            self.verify(seq)
            handle.free()
            del self.seqs[key]
        elif op == "pin":
            if handle.num_committed < 16:
                handle.commit()
            self.pins.append(handle.pin())
        if self.rng.random() < 0.1 and key in self.seqs:
            self.verify(seq)

    def step(self) -> bool:
        """One random operation; False when the worker should stop."""
        op = self.choose()
        t0 = time.monotonic()
        try:
            self.run_op(op)
        except OutOfBlocks:
            self.count("err.OUT_OF_BLOCKS")
            picked = self.pick()
            if picked is not None and self.rng.random() < 0.5:
                self.free_one(*picked)
        except SessionLost:
            self.count("err.SESSION_LOST")
            self.forget_all()
        except ShuttingDown:
            self.count("err.SHUTTING_DOWN")
            if self.args.exit_on_shutdown:
                self.release_all()
                return False
            time.sleep(0.05)
        except DaemonUnavailable:
            self.count("err.UNAVAILABLE")
            self.emit("unavailable", op=op, t=time.time())
            if self.args.exit_on_shutdown:
                self.kv = None  # the daemon is gone: nothing to say goodbye to
                return False
            self.reconnect()
        except KvdError as exc:
            self.count(f"err.{exc.code}" if f"err.{exc.code}" in INDEX else "err.INTERNAL")
            self.emit("error", op=op, code=exc.code, message=exc.message)
        if time.monotonic() - t0 > SLOW_S:
            self.count("slow")
        return True

    def free_one(self, key: str, seq: Seq) -> None:
        try:
            seq.handle.free()
            self.count("ok.free")
        except KvdError as exc:
            self.count(f"err.{exc.code}")
        self.seqs.pop(key, None)

    def release_all(self) -> None:
        """Free and unpin everything (a well-behaved client leaving a draining daemon)."""
        for pin in self.pins:
            try:
                pin.unpin()
                self.count("ok.unpin")
            except KvdError as exc:
                self.count(f"err.{exc.code}")
        self.pins.clear()
        for key, seq in list(self.seqs.items()):
            self.free_one(key, seq)

    def run(self) -> None:
        self.connect()
        deadline = time.monotonic() + self.args.seconds if self.args.seconds else None
        while deadline is None or time.monotonic() < deadline:
            if not self.step():
                break
        if deadline is not None:
            self.release_all()
        if self.kv is not None:
            with contextlib.suppress(KvdError):
                self.kv.close()
        counts = {name: int(v) for name, v in zip(COUNTERS, self.counts, strict=True) if v}
        self.emit("exit", counts=counts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stats", help="counter file (int64 rows of len(COUNTERS))")
    parser.add_argument("--slot", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0, help="0: until killed")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--namespace", default="")
    parser.add_argument("--max-seqs", type=int, default=6)
    parser.add_argument("--max-len", type=int, default=80)
    parser.add_argument("--exit-on-shutdown", action="store_true")
    return parser.parse_args(argv)


def make_counter_file(path: str | os.PathLike[str], slots: int) -> None:
    """A zeroed counter file for ``slots`` workers."""
    Path(path).write_bytes(bytes(8 * len(COUNTERS) * slots))


if __name__ == "__main__":
    Worker(parse_args()).run()
    sys.exit(0)
