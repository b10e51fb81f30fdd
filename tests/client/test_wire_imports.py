"""kvd_client.wire stands alone: the daemon can import it without the client."""

from __future__ import annotations

import subprocess
import sys

import kvd_client
from kvd_client import wire


def test_wire_loads_no_client_and_no_framework() -> None:
    code = (
        "import sys, kvd_client.wire\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'cupy', 'zmq', 'anyio')\n"
        "       or (m.startswith('kvd_client.') and not m.startswith('kvd_client.wire'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_wire_exports_what_it_lists() -> None:
    assert len(set(wire.__all__)) == len(wire.__all__)
    for name in wire.__all__:
        assert getattr(wire, name) is not None


def test_package_names_load_on_first_use() -> None:
    for name in kvd_client.__all__:
        assert getattr(kvd_client, name) is not None
    assert kvd_client.PoolLayout is wire.PoolLayout
