"""bench/_common.py: figures beside anchors, percentiles, results files, the daemon runner."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from bench import _common
from bench._common import Figure, percentile, run_daemon, write_results


def test_ratio_figure_scores_value_over_anchor() -> None:
    fig = Figure("e2e", 3300.0, "req/s", "vLLM", 1000.0, 3.0)
    assert fig.score == pytest.approx(3.3)
    assert fig.met
    assert (fig.describe_score(), fig.describe_target()) == ("3.30x", ">= 3.00x")


def test_lower_is_better_figure_is_met_below_its_target() -> None:
    fast = Figure("p50", 140.0, "us", "bare", 100.0, 1.5, higher_is_better=False)
    slow = Figure("p50", 160.0, "us", "bare", 100.0, 1.5, higher_is_better=False)
    assert fast.met
    assert not slow.met


def test_points_figure_scores_the_difference_in_points() -> None:
    fig = Figure("hit", 0.362, "%", "optimum", 0.421, -5.0, compare="points")
    assert fig.score == pytest.approx(-5.9)
    assert not fig.met
    assert fig.describe_score() == "-5.9 pt"


def test_percentile_matches_numpy() -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 37.5, 50, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="q must lie"):
        percentile([1.0], 101)


def test_write_results_records_figures_and_extras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_common, "RESULTS_DIR", tmp_path)
    path = write_results("x", [Figure("f", 2.0, "s", "a", 1.0, 3.0)], {"n": 5})
    data = json.loads(path.read_text())
    assert data["n"] == 5
    assert data["figures"][0]["score"] == 2.0
    assert data["figures"][0]["met"] is False


def test_run_daemon_serves_until_the_block_ends() -> None:
    from kvd_client import Client

    with run_daemon({"num_blocks": 32, "num_layers": 1, "order": "block_major"}) as daemon:
        socket = Path(daemon.address.removeprefix("ipc://"))
        with Client.connect(daemon.address, pool="default") as kv:
            assert kv.layout is not None
            assert (kv.layout.num_blocks, kv.layout.order) == (32, "block_major")
        assert daemon.event("pool_ready")["blocks"] == 32
    assert daemon.proc.returncode == 0
    assert not socket.parent.exists()
    assert not Path(daemon.event("pool_ready")["path"]).exists()
    with pytest.raises(ProcessLookupError):
        os.kill(daemon.pid, 0)


def test_block_memory_layouts_index_every_key_to_its_block() -> None:
    from bench.block_memory import records, struct_of_arrays

    blocks, by_key = records(5)
    _, _, _, keys, _, by_id = struct_of_arrays(5)
    assert [by_key[k].block_id for k in keys] == [by_id[k] for k in keys] == list(range(5))
    assert [b.key for b in blocks] == keys
