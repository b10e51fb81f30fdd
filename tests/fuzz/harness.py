"""The fuzz target: the daemon's dispatcher in process, over a real engine and shm pool.

`Target.send` hands one message to `Dispatcher.handle` (as connection ``A``,
which has a session, or ``C``, which has none) and checks, after every
message:

- the reply decodes, and an error carries a known code other than INTERNAL;
- the engine's invariants hold;
- a rejected message (an error reply, or a batch whose every operation
  failed) changed nothing: the full engine state (every object reachable
  from it, compared field by field; only the refusal counters may move) and
  the sessions table (less lease renewal) are as before;
- the victim's session (connection ``B``: two sequences, one forked from
  the other, and a pin) is untouched whatever ``A`` sends, success or not.

Any other exception, or a failed check, raises `FuzzFailure` naming the
frames. Used by the Hypothesis tests (``test_fuzz_dispatcher.py``) and by the
atheris harness (``atheris_dispatch.py``).
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import numpy as np
from kvd_client import wire

from kvd.config import load_config
from kvd.engine import Engine, EngineConfig
from kvd.engine.errors import InvariantError
from kvd.memory.shm import ShmSegment
from kvd.server.dispatch import Dispatcher
from kvd.server.pools import Pools, ServedPool
from kvd.server.sessions import PeerCred, SessionTable

BS = 16
NUM_BLOCKS = 16
CODES = frozenset(str(c) for c in wire.Code)
#: Engine fields (at any depth) that count outcomes rather than hold state (a refusal is counted).
COUNTER_FIELDS = frozenset({"refusals"})
#: Session fields a request renews by design (the lease) or counts.
LEASE_FIELDS = ("last_seen", "requests")
ATTACKER, VICTIM, NOBODY = b"A", b"B", b"C"
VICTIM_SEQS = ("victim", "victim.1")


class FuzzFailure(AssertionError):
    """A fuzzed message broke a rule; the message names the frames."""


def _short(frames: list[bytes]) -> str:
    return f"{len(frames)} frames: {[f[:48] for f in frames[:4]]!r}"


def deep_state(
    obj: Any, memo: dict[int, int] | None = None, skip: frozenset[str] = frozenset()
) -> Any:
    """Every value reachable from ``obj`` as nested tuples (shared objects by reference)."""
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return obj
    memo = {} if memo is None else memo
    key = id(obj)
    if key in memo:
        return ("ref", memo[key])
    memo[key] = len(memo)
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, dict):
        return ("dict", tuple((deep_state(k, memo), deep_state(v, memo)) for k, v in obj.items()))
    if isinstance(obj, list | tuple):
        return (type(obj).__name__, tuple(deep_state(v, memo) for v in obj))
    if isinstance(obj, set | frozenset):
        return ("set", tuple(sorted(repr(deep_state(v, memo)) for v in obj)))
    fields: dict[str, Any] = {}
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                fields[name] = getattr(obj, name)
    fields.update(getattr(obj, "__dict__", {}))
    if not fields:  # a C object (itertools.count, a hash state): its repr
        return ("opaque", type(obj).__name__, repr(obj))
    return (
        type(obj).__name__,
        tuple((n, deep_state(v, memo, skip)) for n, v in sorted(fields.items()) if n not in skip),
    )


class Target:
    """A dispatcher with a victim session, an attacker session and a sessionless connection."""

    def __init__(self) -> None:
        self.config = load_config(
            env={},
            overrides={
                "pools.0.num_blocks": str(NUM_BLOCKS),
                "pools.0.num_layers": "1",
                "pools.0.num_kv_heads": "1",
                "pools.0.head_dim": "8",
                "server.max_sessions": "8",
            },
        )
        pc = self.config.pools[0]
        self.memory = ShmSegment.create(
            pc.name, pc.layout, instance=f"fuzz{uuid.uuid4().hex[:10]}", prefault=False
        )
        # No client ever attaches by name here, so the name can go at once: a
        # fuzzer killed mid-run (libFuzzer's -timeout, OOM) leaves no segment.
        self.memory.path.unlink()
        self.engine = Engine(
            EngineConfig(
                num_blocks=NUM_BLOCKS, block_size=BS, hash_seed=self.config.cache.hash_seed
            )
        )
        self.sessions = SessionTable(5.0, clock=lambda: 1000.0, watch_pids=False)
        pools = Pools(self.config, instance="fuzz")
        pools.add(ServedPool(pc, self.engine, self.memory))
        self.dispatcher = Dispatcher(
            self.config,
            pools,
            self.sessions,
            epoch=7,
            addresses=["ipc:///fuzz.sock"],
            clock=lambda: 1000.0,
        )
        self._ids = itertools.count(1)
        self.messages = 0
        self.rejected = 0
        for who in (VICTIM, ATTACKER):
            self._ok(
                wire.HelloRequest(
                    id=0, version=wire.PROTOCOL_VERSION, pool="default", name="t", pid=1
                ),
                who,
            )
        tokens = np.arange(100, 100 + 2 * BS + 5, dtype=np.int32)
        self._ok(wire.AllocateRequest(id=0, seq="victim", tokens=tokens), VICTIM)
        self._ok(wire.CommitRequest(id=0, seq="victim", n=2 * BS), VICTIM)
        self.victim_pin = int(self._ok(wire.PinRequest(id=0, seq="victim"), VICTIM)["pin"])
        self._ok(wire.ForkRequest(id=0, seq="victim", child="victim.1"), VICTIM)
        self._ok(
            wire.AllocateRequest(id=0, seq="mine", tokens=np.arange(BS + 3, dtype=np.int32)),
            ATTACKER,
        )
        self._ok(wire.CommitRequest(id=0, seq="mine", n=BS), ATTACKER)
        self.attacker_pin = int(self._ok(wire.PinRequest(id=0, seq="mine"), ATTACKER)["pin"])

    def _ok(self, req: wire.Request, who: bytes) -> dict[str, Any]:
        reply = wire.decode_reply(self.dispatcher.handle(who, req.encode(), PeerCred(1, 1, 1)))
        if not isinstance(reply, wire.OkReply):
            raise RuntimeError(f"setup {req}: {reply}")
        return reply.result

    def close(self) -> None:
        self.memory.close()

    # -- snapshots -----------------------------------------------------------

    def snapshot(self) -> Any:
        """The engine's whole state and the sessions table (lease renewal left out)."""
        table = tuple(
            (s.id, s.identity, s.pool, s.name, s.pid, s.namespace, s.adapter, s.peer)
            for s in self.sessions
        )
        return deep_state(self.engine, skip=COUNTER_FIELDS), table, self.sessions._next_id

    def _settle(self, who: bytes) -> None:
        """Settle what ``who``'s previous reply left pending (`Engine._settle`).

        Every call of a session releases its last reply's copy sources first,
        whether it then succeeds or is refused: that change belongs to the
        previous call, so the "rejected ones change nothing" rule is checked
        from the settled state.
        """
        session = self.sessions.peek(who)
        sess = None if session is None else self.engine._sessions.get(session.id)
        if sess is not None and sess.pending:
            self.engine._settle(sess)

    def victim_view(self) -> Any:
        """What the victim holds: its sequences' tables, lengths and commits, and its pins."""
        session = self.sessions.peek(VICTIM)
        if session is None:
            return None
        sess = self.engine._sessions[session.id]
        seqs = {
            name: ([b.block_id for b in seq.table], seq.length, seq.committed)
            for name, seq in sess.seqs.items()
        }
        pins = {pid: [b.block_id for b in blocks] for pid, blocks in sess.pins.items()}
        return session.id, seqs, pins

    # -- one message ----------------------------------------------------------

    def send(self, frames: list[bytes], who: bytes = ATTACKER) -> wire.OkReply | wire.ErrorReply:
        """Dispatch ``frames`` from ``who`` and check every rule (FuzzFailure)."""
        self._settle(who)
        before = self.snapshot()
        victim = self.victim_view()
        try:
            raw = self.dispatcher.handle(who, frames, PeerCred(1, 1, 1) if who != NOBODY else None)
            reply = wire.decode_reply(raw)
        except Exception as exc:
            raise FuzzFailure(f"{type(exc).__name__}: {exc} on {_short(frames)}") from exc
        self.messages += 1
        if isinstance(reply, wire.Notice):
            raise FuzzFailure(f"a notice as the reply to {_short(frames)}")
        try:
            self.engine.check_invariants()
        except InvariantError as exc:
            raise FuzzFailure(f"invariants broken by {_short(frames)}: {exc.problems}") from None
        rejected = isinstance(reply, wire.ErrorReply)
        if rejected:
            assert isinstance(reply, wire.ErrorReply)
            if reply.code not in CODES or reply.code == wire.Code.INTERNAL:
                raise FuzzFailure(f"{reply.code}: {reply.msg} on {_short(frames)}")
        elif frames and frames[0] == bytes((wire.Kind.BATCH,)):
            results = reply.result.get("results", [])
            rejected = all(not r["ok"] for r in results)
            for r in results:
                if not r["ok"] and (r["code"] not in CODES or r["code"] == wire.Code.INTERNAL):
                    raise FuzzFailure(f"batch op {r} on {_short(frames)}")
        if rejected:
            self.rejected += 1
            if self.snapshot() != before:
                raise FuzzFailure(f"rejected but changed the state: {_short(frames)} -> {reply}")
        if who != VICTIM and self.victim_view() != victim:
            raise FuzzFailure(f"the victim's sequences changed: {_short(frames)} -> {reply}")
        return reply
