"""The soak (``soak.py``) for a short while: random work, kills and restarts leave no leak.

``KVD_SOAK_SECONDS`` sets the duration (default 20 s, which keeps CI short);
longer runs: ``.venv/bin/python tests/soak/soak.py --duration 600``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).with_name("soak.py")
ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_passes_with_no_leaked_block(tmp_path: Path) -> None:
    seconds = float(os.environ.get("KVD_SOAK_SECONDS", "20"))
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            str(SOAK),
            "--duration",
            str(seconds),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=seconds + 120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    s = json.loads(out.read_text())
    assert s["passed"] is True
    assert s["leaked_blocks"] == 0 and s["final_blocks"]["in_use"] == 0
    assert s["daemon_restarts"] == {"term": 1, "kill": 1}
    assert s["clients_killed"] > 0 and s["operations"] > 1000
    assert s["errors_by_code"].get("SESSION_LOST", 0) > 0  # the restarts were noticed
    assert s["unexpected_errors"] == {} and s["integrity_failures"] == 0
