"""Capture a real vLLM's KV events into tests/vllm/data/ (the fixture of kvd's event tests).

    $(scripts/vllm-env.sh | tail -1)/bin/python tests/vllm/capture_events.py

Runs the tiny Llama in vLLM with ``kv_events_config`` publishing to a
tcp://127.0.0.1 port that a zmq SUB bound before the engine started, and
saves every message (three frames: topic, 8-byte sequence number, msgpack
payload) as ``vllm-<version>-kv-events.msgpack`` (a msgpack array of
``[topic, seq, payload]`` byte triples), beside a JSON description of the
decoded events (field names in wire order). Requests: 2 full blocks + 1
token plain, the same with ``cache_salt="tenant-a"`` (extra keys), then a
prefix-cache reset (``AllBlocksCleared``).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack
import zmq

from tests.vllm.support import DATA, prompt_tokens, run_vllm, tiny_llama

BLOCK_SIZE = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def capture() -> tuple[list[list[bytes]], dict[str, Any]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # vLLM 0.32 binds only wildcard (tcp://*:port), ipc:// and inproc://
    # endpoints; it *connects* its PUB to any other (ZmqEventPublisher._is_bind_endpoint),
    # so the subscriber binds the loopback port.
    sub.bind(endpoint)
    frames: list[list[bytes]] = []
    done = threading.Event()

    def receive() -> None:
        while not done.is_set():
            if sub.poll(100):
                frames.append(sub.recv_multipart())

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    prompt = prompt_tokens(2 * BLOCK_SIZE + 1)
    result = run_vllm(
        tiny_llama(),
        [prompt, prompt],
        cache_salts=[None, "tenant-a"],
        max_tokens=1,
        block_size=BLOCK_SIZE,
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "topic": "kv@capture@tiny-llama",
        },
        reset_prefix_cache=True,
        linger_s=1.0,
    )
    time.sleep(0.5)
    done.set()
    thread.join()
    sub.close(0)
    ctx.term()
    result.pop("stderr")
    return frames, {"prompt": prompt, "block_size": BLOCK_SIZE, "run": result}


def main() -> None:
    import vllm

    frames, info = capture()
    stem = f"vllm-{vllm.__version__}-kv-events"
    DATA.mkdir(exist_ok=True)
    (DATA / f"{stem}.msgpack").write_bytes(msgpack.packb(frames))
    batches = []
    for topic, seq, payload in frames:
        ts, events, rank = msgpack.unpackb(payload)
        batches.append(
            {
                "topic": topic.decode(),
                "seq": int.from_bytes(seq, "big"),
                "ts": ts,
                "data_parallel_rank": rank,
                "events": events,
                "event_fields": [list(e) if isinstance(e, dict) else None for e in events],
            }
        )
    description = {
        "what": "KV events of a real vLLM process, captured by tests/vllm/capture_events.py",
        "vllm": vllm.__version__,
        "prefix_caching_hash_algo": "sha256_cbor",
        "frames_file": f"{stem}.msgpack (msgpack array of [topic, seq, payload] byte triples)",
        "requests": [
            "65 tokens (2 full blocks of 32), no salt",
            "the same 65 tokens with cache_salt='tenant-a'",
            "reset_prefix_cache(), then a 3-token request",
        ],
        **info,
        "batches": batches,
    }
    (DATA / f"{stem}.json").write_text(json.dumps(description, indent=1) + "\n")
    print(DATA / f"{stem}.json")


if __name__ == "__main__":
    main()
