"""A real kvd daemon's KV events decode with vLLM's own ``KVEventBatch`` and equal vLLM's.

The daemon runs with a 32-token block pool and events on a loopback port; a
client in namespace "tenant-a" commits the 65-token prompt that
tests/vllm/data/vllm-0.32.0-kv-events.* captured from a real vLLM process
(with ``cache_salt="tenant-a"``). vLLM's msgspec decoder reads kvd's batch,
and its BlockStored equals vLLM's own (medium aside: kvd's shm pool says CPU).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import zmq

# A submodule, not "vllm": tests/vllm itself is a namespace package "vllm" when
# tests/ is on sys.path (the dev run), and would satisfy a plain importorskip.
pytest.importorskip(
    "vllm.distributed.kv_events", reason="needs vLLM: run `make test-vllm` (its own venv)"
)

from kvd_client import Client
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

DATA = Path(__file__).resolve().parent / "data"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _captured() -> tuple[list[Any], dict[str, Any]]:
    frames = msgpack.unpackb((DATA / "vllm-0.32.0-kv-events.msgpack").read_bytes())
    return frames, json.loads((DATA / "vllm-0.32.0-kv-events.json").read_text())


def test_kvd_events_decode_with_vllms_kv_event_batch(start_kvd: Any) -> None:
    frames, description = _captured()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    vllm_salted = decoder.decode(frames[1][2]).events[0]
    assert isinstance(vllm_salted, BlockStored)

    replay = f"tcp://127.0.0.1:{_free_port()}"
    daemon = start_kvd(
        overrides={
            "pools.0.block_size": "32",
            "events.enabled": "true",
            "events.endpoint": f"tcp://127.0.0.1:{_free_port()}",
            "events.replay_endpoint": replay,
        }
    )
    prompt = np.array(description["prompt"], dtype=np.int32)
    with Client.connect(daemon.address, name="vllm-events", namespace="tenant-a") as kv:
        seq = kv.allocate("r0", prompt, reserve=len(prompt) + 1)
        seq.commit()
        seq.free()
    # Every batch from the first, through replay (no slow-joiner race of a SUB),
    # until the BlockStored is there (the daemon flushes every 10 ms).
    ctx = zmq.Context()
    batches: list[KVEventBatch] = []
    try:
        for _ in range(50):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            batches = []
            while dealer.poll(5000):
                _, _topic, seq_no, payload = dealer.recv_multipart()
                if seq_no == (-1).to_bytes(8, "big", signed=True):
                    break
                batches.append(decoder.decode(payload))
            dealer.close(0)
            if any(isinstance(e, BlockStored) for b in batches for e in b.events):
                break
            time.sleep(0.1)
    finally:
        ctx.term()
    events = [e for b in batches for e in b.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 1, events
    (kvd_stored,) = stored
    assert all(isinstance(e, AllBlocksCleared) for e in events if e is not kvd_stored)
    assert kvd_stored.medium == "CPU"
    kvd_stored.medium = vllm_salted.medium
    assert kvd_stored == vllm_salted
    assert kvd_stored.extra_keys == [("tenant-a",), None]
    assert kvd_stored.group_idx == 0
    assert kvd_stored.kv_cache_spec_kind == "full_attention"
