"""Builds kvd's compiled parts; every other setting is in pyproject.toml.

- ``kvd_client.wire._keys``, C: block keys. ``optional=True``: where no C
  compiler or no OpenSSL headers are found the install still succeeds, and
  ``kvd_client.wire.hashing`` warns at import that it computes block keys in
  Python.
- The engine's per-block modules, compiled by mypyc (`ENGINE`): the loops
  over blocks of a long prompt run as C (4-5x the interpreter's speed on
  them), the same source and semantics. Not optional: a failed compile fails
  the install. Run from a checkout without it, ``kvd.engine`` warns at import.

mypyc type-checks what it compiles on its own, with no config file: the
project's strict mypy run (`make typecheck`) is the type check; here the
other packages are not installed (build isolation) and count as ``Any``.
"""

from mypyc.build import mypycify
from setuptools import Extension, setup

#: The modules of kvd/engine that mypyc compiles (kvd.engine.COMPILED_MODULES
#: lists the same; tests/engine/test_compiled.py keeps the two equal).
ENGINE = ("block", "block_queue", "pool", "frequency", "adaptive")

setup(
    ext_modules=[
        Extension(
            "kvd_client.wire._keys",
            sources=["client/kvd_client/wire/_keys.c"],
            libraries=["crypto"],
            optional=True,
        ),
        *mypycify(
            [
                "--config-file=",
                "--ignore-missing-imports",
                "--follow-imports=silent",
                *(f"kvd/engine/{name}.py" for name in ENGINE),
            ],
            group_name="kvd.engine._compiled",
        ),
    ]
)
