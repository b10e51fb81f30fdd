"""Engine configuration."""

from __future__ import annotations

from typing import Any

import pytest

from kvd.engine import EngineConfig, InvalidError


def test_defaults_match_vllm() -> None:
    cfg = EngineConfig(num_blocks=8)
    assert (cfg.block_size, cfg.hash_seed, cfg.watermark_blocks, cfg.events) == (
        16,
        "vllm-none-hash",
        0,
        True,
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 0},
        {"num_blocks": True},
        {"num_blocks": 8, "block_size": 0},
        {"num_blocks": 8, "block_size": 2.0},
        {"num_blocks": 8, "hash_seed": b"seed"},
        {"num_blocks": 8, "watermark_blocks": -1},
        {"num_blocks": 8, "watermark_blocks": 9},
        {"num_blocks": 8, "events": 1},
        {"num_blocks": 8, "eviction": "lfu"},
        {"num_blocks": 8, "max_held_per_session": -1},
    ],
)
def test_bad_settings_are_invalid(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidError):
        EngineConfig(**kwargs)


def test_the_default_eviction_is_adaptive() -> None:
    assert EngineConfig(num_blocks=8).eviction == "adaptive"
