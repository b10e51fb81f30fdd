"""bench/replay.py's tier-1 replay on tiny traces."""

from __future__ import annotations

from bench.cache_sim import PER_ID, Trace, TraceRequest
from bench.replay import replay_kvd, replay_kvd_tier


def test_a_prefix_pushed_out_of_the_pool_is_a_hit_from_the_tier() -> None:
    # Prefix (1, 2), another prompt that fills the whole pool, then prefix (1, 2) again.
    reqs = [
        TraceRequest(1030, (1, 2, 3)),
        TraceRequest(1030, (7, 8, 9)),
        TraceRequest(1030, (1, 2, 4)),
    ]
    trace = Trace.from_requests(reqs)
    pool = 2 * PER_ID + 1  # one prompt's 65 blocks
    assert replay_kvd(trace, pool).hit_tokens == 0
    assert replay_kvd_tier(trace, pool, factor=4).hit_tokens == 2 * 512
