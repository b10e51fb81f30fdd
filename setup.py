"""Builds kvd's one C extension; every other setting is in pyproject.toml.

``optional=True``: where no C compiler or no OpenSSL headers are found the
install still succeeds, and ``kvd_client.wire.hashing`` warns at import that it
computes block keys in Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvd_client.wire._keys",
            sources=["client/kvd_client/wire/_keys.c"],
            libraries=["crypto"],
            optional=True,
        )
    ]
)
