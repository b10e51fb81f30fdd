"""A client process for end-to-end tests, driven line by line over stdin/stdout.

Each stdin line is a JSON command ``{"op": ..., ...}``; each answer one JSON
line: ``{"ok": true, ...}`` or ``{"ok": false, "error": "<KvdError class>",
"code": "<wire code>"}``. It uses the real client library (`kvd_client.Client`)
and writes/reads KV through its own mapping of the pool. Run as a script:
``python tests/e2e/agent.py``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
from kvd_client import Client, KvdError, Sequence


class Agent:
    def __init__(self) -> None:
        self.kv: Client | None = None
        self.seqs: dict[str, Sequence[Client]] = {}

    @property
    def client(self) -> Client:
        assert self.kv is not None, "connect first"
        return self.kv

    def _slots(self, seq: str, start: int, stop: int) -> list[tuple[int, int]]:
        table = self.seqs[seq].block_table
        bs = self.client.pool.layout.block_size
        return [(int(table[p // bs]), p % bs) for p in range(start, stop)]

    # -- commands ----------------------------------------------------------

    def connect(self, address: str, pool: str = "default", timeout: float = 10.0) -> dict[str, Any]:
        self.kv = Client.connect(address, pool=pool, name=f"agent-{os.getpid()}", timeout=timeout)
        return {"pid": os.getpid(), "epoch": self.kv.epoch, "session": self.kv.session_id}

    def allocate(self, seq: str, tokens: list[int], reserve: int | None = None) -> dict[str, Any]:
        s = self.client.allocate(seq, np.asarray(tokens, dtype=np.int32), reserve=reserve)
        self.seqs[seq] = s
        return {"table": s.block_table.tolist(), "cached": s.num_cached_tokens}

    def allocate_batch(self, prompts: dict[str, list[int]]) -> dict[str, Any]:
        """Allocate each ``seq: tokens`` of ``prompts`` in one batch (one round trip)."""
        with self.client.batch() as b:
            ops = {s: b.allocate(s, np.asarray(t, dtype=np.int32)) for s, t in prompts.items()}
        out = {}
        for seq, op in ops.items():
            s = self.seqs[seq] = op.result()
            out[seq] = {"table": s.block_table.tolist(), "cached": s.num_cached_tokens}
        return out

    def fill(self, seq: str, start: int, stop: int, value: float) -> dict[str, Any]:
        """Write ``value`` into K and V of every layer for token positions [start, stop)."""
        pool = self.client.pool
        for layer in pool.np_layers():
            for block, off in self._slots(seq, start, stop):
                layer[:, block, off] = value
        return {}

    def read(self, seq: str, start: int, stop: int) -> dict[str, Any]:
        """The value at each position [start, stop), or None where K/V/layers disagree."""
        pool = self.client.pool
        values: list[float | None] = []
        for block, off in self._slots(seq, start, stop):
            cells = np.stack([layer[:, block, off] for layer in pool.np_layers()])
            first = float(cells.flat[0])
            values.append(first if bool((cells == first).all()) else None)
        return {"values": values}

    def commit(self, seq: str, n: int | None = None) -> dict[str, Any]:
        r = self.seqs[seq].commit(n)
        return {"committed": r.committed, "cached_blocks": r.cached_blocks}

    def append(self, seq: str, tokens: list[int]) -> dict[str, Any]:
        self.seqs[seq].append(np.asarray(tokens, dtype=np.int32))
        return {"table": self.seqs[seq].block_table.tolist()}

    def fork(self, seq: str, child: str) -> dict[str, Any]:
        self.seqs[child] = self.seqs[seq].fork(child)
        return {"table": self.seqs[child].block_table.tolist()}

    def truncate(self, seq: str, n: int) -> dict[str, Any]:
        self.seqs[seq].truncate(n)
        return {"table": self.seqs[seq].block_table.tolist()}

    def free(self, seq: str) -> dict[str, Any]:
        self.seqs.pop(seq).free()
        return {}

    def table(self, seq: str) -> dict[str, Any]:
        return {"table": self.seqs[seq].block_table.tolist()}

    def close(self) -> dict[str, Any]:
        self.client.close()
        return {}


def main() -> None:
    agent = Agent()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            out = {"ok": True, **getattr(agent, op)(**cmd)}
        except KvdError as exc:
            out = {"ok": False, "error": type(exc).__name__, "code": getattr(exc, "code", None)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
