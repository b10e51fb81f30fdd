"""The connectors of `bench.vllm_connector`, each step's own time logged (vLLM venv only).

`TimedKvd` and `TimedExample` are `KvdConnector` and vLLM's `ExampleConnector`
unchanged but for one log line per step with loads: the milliseconds of
``start_load_kv`` (the load) and of ``wait_for_save`` (the save), so the
benchmark can put each connector's own cost in B's step beside the other's,
apart from the forward pass (which the machine's load swings by 4x).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvd_client.integrations.vllm import KvdConnector
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

__all__ = ["STEP_LINE", "TimedExample", "TimedKvd"]

log = logging.getLogger("vllm.kvd")

#: The line's prefix, then ``load <ms> save <ms>``.
STEP_LINE = "connector step:"


class _Timed:
    """Times ``start_load_kv`` and ``wait_for_save`` of the connector it is mixed into."""

    _load_s = 0.0

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        t = time.perf_counter()
        super().start_load_kv(forward_context, **kwargs)  # type: ignore[misc]
        self._load_s = time.perf_counter() - t

    def wait_for_save(self) -> None:
        t = time.perf_counter()
        super().wait_for_save()  # type: ignore[misc]
        save_s, load_s = time.perf_counter() - t, self._load_s
        self._load_s = 0.0
        if load_s > 1e-3:  # a step that loaded something (B's measured steps)
            log.info("%s load %.2f save %.2f", STEP_LINE, load_s * 1e3, save_s * 1e3)


class TimedKvd(_Timed, KvdConnector):  # type: ignore[misc]
    """`KvdConnector`, its steps timed."""


class TimedExample(_Timed, ExampleConnector):  # type: ignore[misc]
    """vLLM's ``ExampleConnector``, its steps timed."""
