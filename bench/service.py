"""The request thread's service time of long operations, in process.

`bench.hol` measures what a neighbour's 65,536-token prompts cost another
client's ping through a real daemon; on 2 shared cores its ratio swings by a
third between runs. This times the work behind it alone: a `Dispatcher` over a
real shm pool, in this process (no sockets, no other process), handling the
encoded messages a client sends for 65,536-token prompts (4,096 blocks, with
their keys) on a pool of two prompts' blocks and 64 more, flushed before each round:

- allocate with no hit, from the free stack (the hol prefiller's prompt), and its
  free (unkeyed blocks);
- allocate with 4,095 of 4,096 blocks hit (the last token is always computed),
  and its free (a cached chain back to the eviction order);
- commit of a fresh prompt's 4,096 blocks (published into the prefix index);
- allocate with no hit when only 64 blocks are free (4,032 cached blocks evicted).

Each beside the same call on the engine alone (`Engine.allocate`/`commit`/`free`,
an engine of the same config, in the same run, the keys handed over as the
request path hands them: a `KeyList` freshly cut from a keys frame before the
clock, so no key's hash is cached and none is the very object the index holds):
the difference is what the request path adds (decoding the message and cutting
its keys frame, the reply's block ids). Medians of ``--repeat`` timings, wall clock; compare ratios.

Run: ``.venv/bin/python -m bench.service [--repeat 200] [--json]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from kvd_client import wire

from bench._common import Figure, machine, print_table, write_results
from kvd.config import load_config
from kvd.engine import Engine
from kvd.server.dispatch import Dispatcher
from kvd.server.pools import Pools
from kvd.server.sessions import SessionTable

__all__ = ["main"]

PROMPT_TOKENS = 65_536
#: Two prompts' blocks and 64 more (`one_round`).
NUM_BLOCKS = 2 * 4_096 + 64


class Served:
    """One pool behind a `Dispatcher`, and one session on it (``call``: a reply's map)."""

    def __init__(self) -> None:
        self.config = load_config(
            env={},
            overrides={
                "pools.0.num_blocks": str(NUM_BLOCKS),
                "pools.0.num_layers": "1",
                "pools.0.num_kv_heads": "1",
                "pools.0.head_dim": "8",
                "metrics.enabled": "false",
            },
        )
        self.pools = Pools(self.config, instance=f"bench{uuid.uuid4().hex[:10]}")
        self.pools.add(self.pools.create(self.config.pools[0]))
        self.dispatcher = Dispatcher(
            self.config,
            self.pools,
            SessionTable(self.config.server.lease_ms / 1e3, watch_pids=False),
            epoch=1,
            addresses=["ipc:///bench-service"],
        )
        self._ids = iter(range(1, 1 << 62))
        self.call(wire.HelloRequest, version=wire.PROTOCOL_VERSION, pool="default", name="s", pid=1)

    def frames(self, kind: type[wire.Request], **fields: Any) -> list[bytes]:
        return kind(id=next(self._ids), **fields).encode()

    def handle(self, frames: list[bytes]) -> Any:
        """The decoded reply; RuntimeError on an error reply (the bench's own bug)."""
        reply = wire.decode_reply(self.dispatcher.handle(b"bench", frames))
        if not isinstance(reply, wire.OkReply):
            raise RuntimeError(f"unexpected reply {reply!r}")
        return reply.result

    def call(self, kind: type[wire.Request], **fields: Any) -> Any:
        return self.handle(self.frames(kind, **fields))


#: The timed operations, in the order each round runs them (module docstring).
OPS = (
    "allocate, no hit",
    "free, unkeyed",
    "allocate, 4,095 hits",
    "free, cached",
    "commit",
    "allocate, evicting 4,032",
)


Prepare = Callable[[str, str, "list[bytes] | None"], Callable[[], object]]


def one_round(prepare: Prepare, keys: list[list[bytes]], times: list[list[int]]) -> None:
    """One round on a flushed pool. ``prepare(op, seq, keys)`` makes the call of
    ``op`` ("allocate" with ``keys``, "commit", "free") on sequence ``seq``,
    before the clock; the ``OPS`` append their ns to ``times`` (in ``OPS`` order)."""
    cached, miss, fresh = keys
    # A cached chain to hit: 4,096 of the pool's 8,256 blocks evictable.
    for op in ("allocate", "commit", "free"):
        prepare(op, "c", cached)()
    timed = iter(times)
    for op, seq, k in (
        ("allocate", "m", miss),  # from the free stack
        ("free", "m", None),
        ("allocate", "c", cached),
        ("free", "c", None),
    ):
        next(timed).append(_ns(prepare(op, seq, k)))
    prepare("allocate", "f", fresh)()
    next(timed).append(_ns(prepare("commit", "f", None)))
    prepare("free", "f", None)()  # now 8,192 blocks evictable, 64 free
    next(timed).append(_ns(prepare("allocate", "m", miss)))
    prepare("free", "m", None)()


def _ns(call: Callable[[], object]) -> int:
    t0 = time.perf_counter_ns()
    call()
    return time.perf_counter_ns() - t0


def measure(repeat: int) -> dict[str, tuple[float, float]]:
    """(through the dispatcher, engine alone): median µs of each of ``OPS``, ``repeat`` rounds."""
    served = Served()
    served_engine = served.pools["default"].engine
    eng = Engine(served_engine.config)  # the same config, on its own
    eng.open_session(1)
    tokens = np.random.default_rng(0).integers(0, 50_000, PROMPT_TOKENS, dtype=np.int32)
    nkeys = PROMPT_TOKENS // served.config.pools[0].block_size
    # The keys are all the daemon sees of a prompt's content: one token array serves.
    key_sets = [[[os.urandom(32) for _ in range(nkeys)] for _ in range(3)] for _ in range(4)]
    kinds = {"allocate": wire.AllocateRequest, "commit": wire.CommitRequest}

    def through(op: str, seq: str, keys: list[bytes] | None) -> Callable[[], object]:
        fields = {"tokens": tokens, "keys": keys} if op == "allocate" else {}
        return partial(
            served.handle, served.frames(kinds.get(op, wire.FreeRequest), seq=seq, **fields)
        )

    def alone(op: str, seq: str, keys: list[bytes] | None) -> Callable[[], object]:
        if op == "allocate":
            assert keys is not None  # every allocate of `one_round` has its keys
            fresh = wire.keys_from_bytes(b"".join(keys))
            return partial(eng.allocate, 1, seq, tokens, None, fresh)
        return partial(eng.commit if op == "commit" else eng.free, 1, seq)

    times: tuple[list[list[int]], list[list[int]]] = ([[] for _ in OPS], [[] for _ in OPS])
    for n in range(repeat):
        keys = key_sets[n % len(key_sets)]
        served_engine.flush()
        one_round(through, keys, times[0])
        eng.flush()
        one_round(alone, keys, times[1])
    eng.check_invariants()
    served_engine.check_invariants()
    served.pools.close()
    return {
        op: (statistics.median(d) / 1e3, statistics.median(e) / 1e3)
        for op, d, e in zip(OPS, *times, strict=True)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="also write bench/results/")
    args = parser.parse_args()
    results = measure(args.repeat)
    figures = [
        Figure(
            f"{name} (4,096 blocks), Dispatcher.handle",
            daemon,
            "us",
            "the engine's call alone",
            engine,
            float("inf"),
            higher_is_better=False,
        )
        for name, (daemon, engine) in results.items()
    ]
    print_table(f"service time of one 65,536-token prompt's requests ({machine()})", figures)
    if args.json:
        write_results("service", figures, {"repeat": args.repeat, "tokens": PROMPT_TOKENS})


if __name__ == "__main__":
    main()
