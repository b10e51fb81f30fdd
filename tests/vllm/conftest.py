"""tests/vllm run only in the vLLM venv (``make test-vllm``).

Without vLLM, the dev suite's plain ``pytest`` (``make test``) does not collect
this directory at all. Naming it (``pytest tests/vllm``) collects it, and
every module then skips with the reason (``pytest.importorskip``).

No ``__init__.py`` here: a package named ``vllm`` would shadow vLLM itself.
Modules import each other as ``tests.vllm.support`` (the repository root is
on ``pythonpath``); ``make test-vllm`` runs pytest with ``--import-mode=importlib``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _have_vllm() -> bool:
    """vLLM itself, not this directory (a namespace package "vllm" when tests/ is on sys.path)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


HAVE_VLLM = _have_vllm()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if HAVE_VLLM:
        return None
    for arg in config.args:
        target = Path(arg.split("::", 1)[0]).resolve()
        if target == HERE or HERE in target.parents:
            return None  # asked for by name: collect, and skip with the reason
    return True
