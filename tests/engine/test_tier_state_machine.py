"""Engine with tier 1: the state machine of `test_engine_state_machine` plus tier moves.

The simulated server copies a demotion's block into its tier slot as late
as a real copy could read it (when the copy is recorded, after any other
steps in between) and a promotion's slots into its pool blocks; every
prefix hit must still hand out blocks holding exactly the prompt's tokens,
so a copy counted after its block was taken and rewritten, or a promoted
block handed out before its copy, fails the run.
"""

from __future__ import annotations

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvd.engine.tier import Demotion, Promotion

from .test_engine_state_machine import BS, EngineMachine, prompts


class TierEngineMachine(EngineMachine):
    tier_blocks = 5
    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        #: What each tier slot holds, as the simulated copies left it.
        self.tier_content: dict[int, list[int | None]] = {}
        self.copying: list[Demotion] = []
        #: Promotions in flight with the allocate each is for: (promotion, sid, seq, tokens).
        self.promoting: list[tuple[Promotion, int, str, list[int]]] = []

    @rule(limit=st.integers(1, 4))
    def start_demotions(self, limit: int) -> None:
        self.copying += self.eng.tier.demotions(limit)

    @precondition(lambda self: self.copying)
    @rule(data=st.data(), ok=st.integers(0, 5))
    def finish_some_demotions(self, data: st.DataObject, ok: int) -> None:
        self.finish_demotions(ok, data.draw(st.integers(1, len(self.copying))))

    def finish_demotions(self, ok: int, n: int) -> None:
        """The first ``n`` copies in flight are done (``ok`` 0: they failed)."""
        done, self.copying = self.copying[:n], self.copying[n:]
        for d in done:  # read at the last moment a real copy could
            self.tier_content[d.slot] = list(self.content.get(d.block_id, [None] * BS))
        if self.eng.tier.demoted(done, ok > 0):
            event("demoted")

    @rule(sid=st.sampled_from([1, 2, 3]))
    def churn(self, sid: int) -> None:
        """A one-off prompt that is computed, committed and freed: it pushes
        older cached blocks out of the pool (and so into the tier's reach)."""
        seq = self.new_id()
        self.allocate_as(sid, seq, [3 + self.counter] * (2 * BS + 1), None, True)
        if (sid, seq) in self.seqs:
            self.settle(sid)
            self.eng.free(sid, seq)
            del self.seqs[(sid, seq)]

    @rule(sid=st.sampled_from([1, 2, 3]), prompt=prompts, early=st.booleans())
    def come_back(self, sid: int, prompt: tuple[list[int], list[int]], early: bool) -> None:
        """A prompt computed and freed, copied to the tier, pushed out of the
        pool by others (``early``: while the copy runs), then asked again (the
        path a promotion takes)."""
        seq = self.new_id()
        self.allocate_as(sid, seq, prompt[0] + prompt[1], None, True)
        if (sid, seq) in self.seqs:
            self.settle(sid)
            self.eng.free(sid, seq)
            del self.seqs[(sid, seq)]
        self.start_demotions(4)
        if early:
            self.churn(sid)
        self.finish_demotions(1, len(self.copying))
        self.churn(sid)
        self.churn(sid)
        self.promote(sid, prompt)

    @rule(sid=st.sampled_from([1, 2, 3]), prompt=prompts)
    def promote(self, sid: int, prompt: tuple[list[int], list[int]]) -> None:
        tokens = prompt[0] + prompt[1]
        seq = self.new_id()
        p = self.eng.promote(sid, seq, np.array(tokens, dtype=np.int32))
        if p is None:
            self.allocate_as(sid, seq, tokens, None, True)
            return
        event("promotion")
        self.promoting.append((p, sid, seq, tokens))

    @precondition(lambda self: self.promoting)
    @rule(ok=st.integers(0, 5))
    def finish_promotion(self, ok: int) -> None:
        p, sid, seq, tokens = self.promoting.pop(0)
        if ok:
            for slot, bid in p.pairs:
                self.content[bid] = list(self.tier_content[slot])
        self.eng.tier.promoted(p, ok > 0)
        # The allocate the promotion was for, as the server runs it next.
        self.allocate_as(sid, seq, tokens, None, True)


TierEngineMachine.TestCase.settings = settings(EngineMachine.TestCase.settings, max_examples=300)
TestTierEngineMachine = TierEngineMachine.TestCase
