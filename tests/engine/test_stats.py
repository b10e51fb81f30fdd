"""The stats snapshot."""

from __future__ import annotations

import json

from kvd.engine import EngineStats, NamespaceStats


def make(query_tokens: int, hit_tokens: int) -> EngineStats:
    return EngineStats(
        blocks_total=8,
        blocks_free=5,
        blocks_evictable=2,
        blocks_in_use=1,
        blocks_pinned=0,
        reserved=1,
        sequences=1,
        sessions=1,
        holds=0,
        held_blocks=0,
        prefix_queries=1,
        query_tokens=query_tokens,
        hit_tokens=hit_tokens,
        evictions=0,
        refusals={"OUT_OF_BLOCKS": 2},
        namespaces={"": NamespaceStats(1, query_tokens, hit_tokens, 2, 2, 0)},
        session_usage={7: 2},
    )


def test_hit_ratio_is_hit_over_query_tokens() -> None:
    assert make(40, 10).hit_ratio == 0.25
    assert make(0, 0).hit_ratio == 0.0


def test_to_dict_is_json_ready_with_ratios() -> None:
    d = make(40, 10).to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["hit_ratio"] == 0.25
    assert d["namespaces"][""]["hit_ratio"] == 0.25
    assert d["session_usage"] == {"7": 2}
    assert d["refusals"] == {"OUT_OF_BLOCKS": 2}
