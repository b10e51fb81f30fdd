"""The engine modules compiled by mypyc (setup.py)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import kvd.engine
from kvd.engine import COMPILED_MODULES

ROOT = Path(__file__).resolve().parents[2]


def _setup_engine() -> tuple[str, ...]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "ENGINE" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple)
            return value
    raise AssertionError("setup.py has no ENGINE")


def test_setup_compiles_the_modules_the_engine_lists() -> None:
    assert _setup_engine() == COMPILED_MODULES


def test_make_rebuilds_when_a_compiled_module_changes() -> None:
    makefile = (ROOT / "Makefile").read_text()
    found = re.search(r"^COMPILED := \$\(foreach m,([\w ]+),", makefile, re.MULTILINE)
    assert found is not None
    assert tuple(found.group(1).split()) == COMPILED_MODULES


def test_the_tests_run_the_compiled_modules() -> None:
    """`make test` builds them: the suite must not pass on the Python source alone."""
    for name in COMPILED_MODULES:
        module = importlib.import_module(f"kvd.engine.{name}")
        assert module.__file__ is not None and module.__file__.endswith(".so"), module.__file__
    assert kvd.engine.COMPILED
