"""Coverage-guided fuzzing of the dispatcher with atheris (libFuzzer); not part of the test run.

    .venv/bin/pip install atheris          # 3.0.0 has a wheel for CPython 3.11 on x86-64
    .venv/bin/python tests/fuzz/atheris_dispatch.py -max_total_time=300 /tmp/kvd-corpus

Each input is one message: byte 0 picks the connection (even: ``A``, with a
session; odd: ``C``, without), then frames as ``<u16 little-endian length>
<bytes>`` (a short last frame takes what is left). The rules are the
Hypothesis fuzzer's (``harness.py``): a reply with a known code, never
INTERNAL, invariants intact, rejected messages change nothing, the victim's
sequences untouched; a broken rule is a crash with the input saved by
libFuzzer. An empty corpus directory is seeded with valid messages.
"""

from __future__ import annotations

import logging
import struct
import sys
from pathlib import Path

import atheris
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with atheris.instrument_imports(include=["kvd", "kvd_client"]):
    from fuzz.harness import ATTACKER, NOBODY, Target
    from fuzz.strategies import TEMPLATES


def encode_input(frames: list[bytes], who: bytes = ATTACKER) -> bytes:
    """The fuzz input for ``frames`` sent by ``who`` (the seed corpus form)."""
    out = bytearray(b"\x00" if who == ATTACKER else b"\x01")
    for frame in frames:
        out += struct.pack("<H", len(frame)) + frame
    return bytes(out)


def decode_input(data: bytes) -> tuple[list[bytes], bytes]:
    """Frames and sender of a fuzz input."""
    if not data:
        return [], ATTACKER
    who = ATTACKER if data[0] % 2 == 0 else NOBODY
    frames, i = [], 1
    while i < len(data):
        if i + 2 > len(data):
            frames.append(data[i:])
            break
        (n,) = struct.unpack_from("<H", data, i)
        frames.append(data[i + 2 : i + 2 + n])
        i += 2 + n
    return frames, who


def one_input(data: bytes) -> None:
    frames, who = decode_input(data)
    target = Target()
    try:
        target.send(frames, who)
    finally:
        target.close()


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    if corpus and Path(corpus[0]).is_dir() and not any(Path(corpus[0]).iterdir()):
        for i, frames in enumerate(TEMPLATES):
            (Path(corpus[0]) / f"seed-{i}").write_bytes(encode_input(frames))
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
