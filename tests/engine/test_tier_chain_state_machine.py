"""Engine with a chain of tiers: `test_tier_state_machine` plus tier 2 below tier 1.

Tier 2's copies read tier 1's slots as late as a real copy could (when
recorded); a promotion copies each block from the tier its entry is in, and
the copies of a random set of levels fail. Every prefix hit must still hand
out blocks holding exactly the prompt's tokens, so a tier-1 slot reused
while tier 2 read it, or a block published after a failed copy, fails the run.
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvd.engine.tier import Demotion, Tier

from .test_engine_state_machine import EngineMachine, prompts
from .test_tier_state_machine import TierEngineMachine

#: A promotion's failed levels by the drawn outcome (0: every copy failed).
_FAILED = {0: {1, 2}, 1: {2}, 2: {1}}


class ChainEngineMachine(TierEngineMachine):
    tier_blocks = 3
    remote_blocks = 12

    def __init__(self) -> None:
        super().__init__()
        #: What each tier-2 slot holds, as the simulated copies left it.
        self.remote_content: dict[int, list[int | None]] = {}
        self.copying_down: list[Demotion] = []

    @property
    def below(self) -> Tier:
        tier = self.eng.tier
        assert tier is not None and tier.below is not None
        return tier.below

    @rule(limit=st.integers(1, 4))
    def start_copies_down(self, limit: int) -> None:
        self.copying_down += self.below.demotions(limit)

    @precondition(lambda self: self.copying_down)
    @rule(data=st.data(), ok=st.integers(0, 5))
    def finish_copies_down(self, data: st.DataObject, ok: int) -> None:
        n = data.draw(st.integers(1, len(self.copying_down)))
        done, self.copying_down = self.copying_down[:n], self.copying_down[n:]
        for d in done:  # read tier 1's slot at the last moment a real copy could
            self.remote_content[d.slot] = list(self.tier_content[d.src])
        if self.below.demoted(done, ok > 0):
            event("copied down")

    @rule(sid=st.sampled_from([1, 2, 3]), prompt=prompts, keep=st.integers(0, 3))
    def come_back_down_the_chain(
        self, sid: int, prompt: tuple[list[int], list[int]], keep: int
    ) -> None:
        """A prompt copied to both tiers, then pushed out of the pool and (but
        for up to ``keep`` blocks) out of tier 1 by others, then asked again."""
        seq = self.new_id()
        self.allocate_as(sid, seq, prompt[0] + prompt[1], None, True)
        if (sid, seq) in self.seqs:
            self.settle(sid)
            self.eng.free(sid, seq)
            del self.seqs[(sid, seq)]
        self.start_demotions(4)
        self.finish_demotions(1, len(self.copying))
        self.start_copies_down(4)
        self.copying_down, done = [], self.copying_down
        for d in done:
            self.remote_content[d.slot] = list(self.tier_content[d.src])
        self.below.demoted(done, True)
        for _ in range(3 - keep):
            self.churn(sid)
            self.start_demotions(2)
            self.finish_demotions(1, len(self.copying))
        for _ in range(4):  # the pool's 12 blocks over
            self.churn(sid)
        self.promote(sid, prompt)

    @precondition(lambda self: self.promoting)
    @rule(ok=st.integers(0, 5))
    def finish_promotion(self, ok: int) -> None:
        p, sid, seq, tokens = self.promoting.pop(0)
        failed = _FAILED.get(ok, set())
        levels = p.by_level()
        if len(levels) > 1:
            event("promotion from both tiers")
        for level, at in levels.items():
            if level in failed:
                continue
            source = self.tier_content if level == 1 else self.remote_content
            for i in at:
                slot, bid = p.pairs[i]
                self.content[bid] = list(source[slot])
        assert self.eng.tier is not None
        self.eng.tier.promoted(p, True, failed)
        self.allocate_as(sid, seq, tokens, None, True)


ChainEngineMachine.TestCase.settings = settings(EngineMachine.TestCase.settings, max_examples=300)
TestChainEngineMachine = ChainEngineMachine.TestCase
