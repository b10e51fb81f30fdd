"""Engine: random operation sequences against a model of what clients write.

A Hypothesis state machine drives allocate / commit / append / fork /
truncate / free / pin / unpin / flush / close_session (and rewinds and
exhausting the pool, made of these) over three sessions
in two namespaces (one with an adapter) on a small pool with a tiny token
alphabet, so hits, duplicates, copies, refusals and evictions all happen.
After every step: `check_invariants`, plus the model's checks (for
every eviction policy):

- the simulated client writes each token into its block slot, and only
  ever into a block it alone holds that is not cached (copy-on-write);
- it performs a reply's copies and writes lazily, just before its session's
  next call, as late as the real client may (other sessions' calls come in
  between), and no block is ever written while it is the source of a copy
  still to come;
- every prefix hit hands out blocks holding exactly the prompt's tokens;
- a refusal changes nothing; growth within a reservation is never refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvd.engine import (
    Allocation,
    Appended,
    Engine,
    EngineConfig,
    Forked,
    Pinned,
    Refusal,
)

from .support import snapshot

BS = 4
#: (session id, namespace, adapter, quota)
SESSIONS = [(1, "", None, None), (2, "", "lora", 14), (3, "t", None, None)]

token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=10)
prompts = st.tuples(
    st.sampled_from([[], [0, 1, 2, 0], [0, 1, 2, 0, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, 2, 2]]),
    st.lists(st.integers(0, 2), min_size=0, max_size=6),
)


class EngineMachine(RuleBasedStateMachine):
    #: The engine's eviction policy (the default; the subclasses run the others).
    eviction = "adaptive"
    #: Tier 1's slots (`TierEngineMachine` has some), and a tier 2's below it.
    tier_blocks = 0
    remote_blocks = 0

    def __init__(self) -> None:
        super().__init__()
        self.eng = Engine(
            EngineConfig(
                num_blocks=12,
                block_size=BS,
                watermark_blocks=1,
                eviction=self.eviction,
                tier_blocks=self.tier_blocks,
                remote_blocks=self.remote_blocks,
            )
        )
        self.eng.set_namespace_limits("t", quota=10, minimum=2)
        for sid, ns, adapter, quota in SESSIONS:
            self.eng.open_session(sid, namespace=ns, adapter=adapter, quota=quota)
        #: What the simulated clients wrote into each block's slots.
        self.content: dict[int, list[int | None]] = {}
        #: (sid, seq id) -> the sequence's tokens, as the client knows them.
        self.seqs: dict[tuple[int, str], list[int]] = {}
        self.pins: list[tuple[int, int]] = []
        self.counter = 0
        #: sid -> the copies (src, dst) and writes (seq, start, tokens) of its
        #: last reply, done by the client before its next call.
        self.todo: dict[int, tuple[list[tuple[int, int]], list[tuple[str, int, list[int]]]]] = {}

    # --- the model of client writes -------------------------------------------

    def table(self, key: tuple[int, str]) -> list[int]:
        return [b.block_id for b in self.eng._sessions[key[0]].seqs[key[1]].table]

    def write(self, key: tuple[int, str], start: int, tokens: list[int]) -> None:
        table = self.table(key)
        blocks = self.eng._pool.blocks
        sources = {src for copies, _ in self.todo.values() for src, _ in copies}
        for pos, tok in enumerate(tokens, start):
            bid = table[pos // BS]
            block = blocks[bid]
            assert block.ref == 1, f"write into block {bid} held {block.ref} times"
            assert block.key is None, f"write into cached block {bid}"
            assert bid not in sources, f"write into block {bid} before it was copied from"
            slots = self.content.setdefault(bid, [None] * BS)
            slots[pos % BS] = tok

    def settle(self, sid: int) -> None:
        """The client of ``sid`` finishes its last reply: copies, then writes."""
        copies, writes = self.todo.pop(sid, ([], []))
        for src, dst in copies:
            self.content[dst] = list(self.content[src])
        for seq_id, start, tokens in writes:
            self.write((sid, seq_id), start, tokens)

    def settled_snapshot(self, sid: int) -> dict[str, Any]:
        """The state before a call of ``sid`` that may be refused, once the
        call's settlement of the previous reply is done (a harmless query of
        the same session settles it), so that only the call's effect shows."""
        self.settle(sid)
        self.eng.can_allocate(sid, 0)
        return snapshot(self.eng)

    def check_hits(self, tokens: list[int], table: list[int], cached: int) -> None:
        assert cached % BS == 0
        assert cached <= max(0, (len(tokens) - 1) // BS * BS)
        for i in range(cached // BS):
            assert self.content.get(table[i]) == tokens[i * BS : (i + 1) * BS], (
                f"hit block {table[i]} holds other tokens"
            )

    def refused_cleanly(self, before: dict[str, Any], result: object) -> bool:
        if isinstance(result, Refusal):
            assert snapshot(self.eng) == before, "a refusal changed the state"
            event(f"refused {result.code}")
            return True
        return False

    def pick(self, data: st.DataObject) -> tuple[int, str]:
        return data.draw(st.sampled_from(sorted(self.seqs)))

    def new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    # --- rules ---------------------------------------------------------------------

    @rule(
        sid=st.sampled_from([1, 2, 3]),
        prompt=prompts,
        extra=st.none() | st.integers(0, 12),
        commit=st.booleans(),
    )
    def allocate(
        self, sid: int, prompt: tuple[list[int], list[int]], extra: int | None, commit: bool
    ) -> None:
        tokens = prompt[0] + prompt[1]
        reserve = None if extra is None else len(tokens) + extra
        self.allocate_as(sid, self.new_id(), tokens, reserve, commit)

    def allocate_as(
        self, sid: int, seq: str, tokens: list[int], reserve: int | None, commit: bool
    ) -> None:
        """Allocate ``seq`` for ``tokens`` and check what comes back."""
        before = self.settled_snapshot(sid)
        r = self.eng.allocate(sid, seq, np.array(tokens, dtype=np.int32), reserve=reserve)
        if self.refused_cleanly(before, r):
            return
        assert isinstance(r, Allocation)
        self.seqs[(sid, seq)] = tokens
        self.check_hits(tokens, r.table, r.num_cached_tokens)
        if r.num_cached_tokens:
            event("prefix hit")
        self.write((sid, seq), r.num_cached_tokens, tokens[r.num_cached_tokens :])
        if commit:
            self.eng.commit(sid, seq)

    @rule(first=st.sampled_from([1, 2, 3]))
    def exhaust(self, first: int) -> None:
        """The clients, ``first`` first, take every block they can, evicting
        as they go: the moment a block released too early would be handed
        out and written. (One session alone may not get the last blocks: a
        guaranteed minimum or a quota holds them back.)"""
        for sid in sorted({1, 2, 3}, key=lambda s: s != first):
            self.fill(sid)

    def fill(self, sid: int) -> None:
        """Session ``sid`` allocates one sequence and grows it until refused."""
        seq = self.new_id()
        before = self.settled_snapshot(sid)
        a = self.eng.allocate(sid, seq, np.array([2, 1, 0], dtype=np.int32))
        if self.refused_cleanly(before, a):
            return
        assert isinstance(a, Allocation)
        self.seqs[(sid, seq)] = [2, 1, 0]
        self.write((sid, seq), 0, [2, 1, 0])
        # Growth is not held back by the watermark: it takes the last blocks.
        while True:
            before = self.settled_snapshot(sid)
            r = self.eng.append(sid, seq, [1] * BS)
            if self.refused_cleanly(before, r):
                return
            assert isinstance(r, Appended)
            length = len(self.seqs[(sid, seq)])
            self.seqs[(sid, seq)] += [1] * BS
            self.write((sid, seq), length, [1] * BS)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), frac=st.floats(0, 1) | st.none())
    def commit(self, data: st.DataObject, frac: float | None) -> None:
        key = self.pick(data)
        self.settle(key[0])
        n = None if frac is None else int(len(self.seqs[key]) * frac)
        self.eng.commit(*key, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tokens=token_lists)
    def append(
        self, data: st.DataObject, tokens: list[int], key: tuple[int, str] | None = None
    ) -> None:
        if key is None:
            key = self.pick(data)
        seq = self.eng._sessions[key[0]].seqs[key[1]]
        length = len(self.seqs[key])
        within = length + len(tokens) <= seq.reserve
        before = self.settled_snapshot(key[0])
        r = self.eng.append(*key, tokens)
        if self.refused_cleanly(before, r):
            assert not within, "growth within the reservation was refused"
            return
        assert isinstance(r, Appended)
        assert r.length == length + len(tokens)
        if r.copies:
            event("copy-on-write")
        self.seqs[key] = self.seqs[key] + tokens
        self.todo[key[0]] = (r.copies, [(key[1], length, tokens)])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), back=st.integers(1, BS), tokens=token_lists)
    def rewind(self, data: st.DataObject, back: int, tokens: list[int]) -> None:
        """A client rolls back a few tokens (often into a cached block) and
        decodes again: the usual way a sole holder copies a cached block."""
        key = self.pick(data)
        self.settle(key[0])
        n = max(0, len(self.seqs[key]) - back)
        self.eng.truncate(*key, n)
        self.seqs[key] = self.seqs[key][:n]
        self.append(data, tokens, key)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.none() | st.integers(0, 8))
    def fork(self, data: st.DataObject, extra: int | None) -> None:
        key = self.pick(data)
        child = self.new_id()
        reserve = None if extra is None else len(self.seqs[key]) + extra
        before = self.settled_snapshot(key[0])
        r = self.eng.fork(*key, child, reserve=reserve)
        if self.refused_cleanly(before, r):
            return
        assert isinstance(r, Forked)
        self.seqs[(key[0], child)] = list(self.seqs[key])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), frac=st.floats(0, 1))
    def truncate(self, data: st.DataObject, frac: float) -> None:
        key = self.pick(data)
        n = int(len(self.seqs[key]) * frac)
        self.settle(key[0])
        self.eng.truncate(*key, n)
        self.seqs[key] = self.seqs[key][:n]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        key = self.pick(data)
        self.settle(key[0])
        self.eng.free(*key)
        del self.seqs[key]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = self.pick(data)
        before = self.settled_snapshot(key[0])
        r = self.eng.pin(*key)
        if self.refused_cleanly(before, r):
            return
        assert isinstance(r, Pinned)
        self.pins.append((key[0], r.pin_id))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pin = data.draw(st.sampled_from(self.pins))
        self.pins.remove(pin)
        self.settle(pin[0])
        self.eng.unpin(*pin)

    # Flushes and closes take a 1-in-4 coin so they don't wipe the cache too often.
    @rule(namespace=st.sampled_from([None, "", "t"]), coin=st.integers(0, 3))
    def flush(self, namespace: str | None, coin: int) -> None:
        if coin == 0:
            self.eng.flush(namespace)

    @rule(sid=st.sampled_from([1, 2, 3]), coin=st.integers(0, 3))
    def close_and_reopen(self, sid: int, coin: int) -> None:
        if coin:
            return
        self.settle(sid)
        self.eng.close_session(sid)
        self.seqs = {k: v for k, v in self.seqs.items() if k[0] != sid}
        self.pins = [p for p in self.pins if p[0] != sid]
        _, ns, adapter, quota = SESSIONS[sid - 1]
        self.eng.open_session(sid, namespace=ns, adapter=adapter, quota=quota)

    # --- after every step ---------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.eng.check_invariants()
        if self.eng._pool.evictions:
            event("evicted")
        self.eng.drain_events()
        for (sid, seq_id), tokens in self.seqs.items():
            seq = self.eng._sessions[sid].seqs[seq_id]
            assert seq.tokens[: seq.length].tolist() == tokens
            if sid in self.todo:
                continue  # its client has not copied and written yet
            for i, block in enumerate(seq.table[: len(tokens) // BS]):
                assert self.content.get(block.block_id) == tokens[i * BS : (i + 1) * BS]


EngineMachine.TestCase.settings = settings(
    max_examples=450,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngineMachine = EngineMachine.TestCase


class FrequencyEngineMachine(EngineMachine):
    eviction = "frequency"


FrequencyEngineMachine.TestCase.settings = settings(
    EngineMachine.TestCase.settings, max_examples=200
)
TestFrequencyEngineMachine = FrequencyEngineMachine.TestCase


class LruEngineMachine(EngineMachine):
    eviction = "lru"


LruEngineMachine.TestCase.settings = settings(EngineMachine.TestCase.settings, max_examples=250)
TestLruEngineMachine = LruEngineMachine.TestCase
