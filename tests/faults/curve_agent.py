"""tests/e2e/agent.py whose ``connect`` also takes CURVE keys (the daemon's tcp endpoint).

``{"op": "connect", "address": ..., "curve": [server_public, public, secret]}``
with z85 keys as text. Run as a script, like agent.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from kvd_client import Client

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import agent  # found through the path above


class CurveAgent(agent.Agent):
    def connect(
        self,
        address: str,
        pool: str = "default",
        timeout: float = 10.0,
        curve: list[str] | None = None,
    ) -> dict[str, Any]:
        keys = None
        if curve is not None:
            server, public, secret = (k.encode() for k in curve)
            keys = (server, public, secret)
        self.kv = Client.connect(
            address, pool=pool, name=f"agent-{os.getpid()}", timeout=timeout, curve=keys
        )
        return {"pid": os.getpid(), "epoch": self.kv.epoch, "session": self.kv.session_id}


if __name__ == "__main__":
    agent.Agent = CurveAgent  # type: ignore[misc] (main() builds agent.Agent)
    agent.main()
