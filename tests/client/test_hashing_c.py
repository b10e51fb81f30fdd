"""The C loop of BlockHasher.keys (``_keys.c``) against the Python reference."""

from __future__ import annotations

import array
import hashlib
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_client.wire import hashing
from kvd_client.wire.hashing import IMPLEMENTATION, BlockHasher, event_id

from .test_hashing import EDGES, REPO, token_ids

VECTOR_0_15 = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"


def test_the_c_extension_is_built_and_computes_keys() -> None:
    # Fails where the build silently stopped producing it: `pip install -e .`
    # needs a C compiler and OpenSSL's headers (libssl-dev).
    assert IMPLEMENTATION == "c"


def test_without_the_extension_keys_are_computed_in_python_with_one_warning() -> None:
    script = (
        "import json, sys, warnings\n"
        "sys.modules['kvd_client.wire._keys'] = None  # its import raises ImportError\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from kvd_client.wire import hashing\n"
        "hasher = hashing.BlockHasher(16)\n"
        "print(json.dumps({\n"
        "    'implementation': hashing.IMPLEMENTATION,\n"
        "    'warnings': [(w.category.__name__, str(w.message)) for w in caught],\n"
        "    'key': hasher.keys(list(range(16)), None)[0].hex(),\n"
        "    'blob': hasher.keys_blob(list(range(16)), None).hex(),\n"
        "}))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    got = json.loads(child.stdout)
    assert got["implementation"] == "python"
    ((category, message),) = got["warnings"]
    assert category == "RuntimeWarning"
    assert "not built" in message and "libssl-dev" in message
    assert got["key"] == got["blob"] == VECTOR_0_15


@pytest.mark.parametrize("method", ["keys", "keys_python"])
def test_both_paths_give_the_vllm_vectors(method: str) -> None:
    (key,) = getattr(BlockHasher(16), method)(np.arange(16, dtype=np.int32), None)
    assert key.hex() == VECTOR_0_15
    assert event_id(key) == 2233398808101521225


def test_keys_blob_gives_the_vllm_vector() -> None:
    assert BlockHasher(16).keys_blob(np.arange(16, dtype=np.int32), None).hex() == VECTOR_0_15


# ------------------------------------------------------- equality with Python

# How token ids reach keys(): int32 frames from the wire are the common case.
FORMS = ["list", "tuple", "int32", "int64", "uint32", "uint64", "strided uint64"]


def as_form(values: list[int], form: str) -> Any:
    if form == "list":
        return values
    if form == "tuple":
        return tuple(values)
    if form == "strided uint64":  # a view with a stride of two items
        return np.repeat(np.array(values, dtype=np.uint64), 2)[::2]
    if form == "int32":
        values = [v % 2**31 for v in values]
    return np.array(values, dtype=form)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    form=st.sampled_from(FORMS),
    start=st.one_of(
        st.just((None, 0)),
        st.tuples(st.binary(min_size=32, max_size=32), st.integers(0, 5)),
    ),
    namespace=st.one_of(st.sampled_from(["", "tenant-a", "é" * 40]), st.text(max_size=30)),
    adapter=st.one_of(st.none(), st.text(min_size=1, max_size=300)),
)
def test_c_keys_equal_the_python_reference(
    data: st.DataObject,
    form: str,
    start: tuple[bytes | None, int],
    namespace: str,
    adapter: str | None,
) -> None:
    block_size = data.draw(st.integers(1, 64), label="block_size")
    # Up to five full blocks and a partial tail; every width class mixed.
    values = data.draw(st.lists(token_ids, max_size=6 * block_size - 1))
    tokens = as_form(values, form)
    parent, first_block = start
    hasher = BlockHasher(block_size)
    call = {"first_block": first_block, "namespace": namespace, "adapter": adapter}
    want = hasher.keys_python(tokens, parent, **call)
    assert hasher.keys(tokens, parent, **call) == want
    assert hasher.keys_blob(tokens, parent, **call) == b"".join(want)


def test_a_call_of_many_blocks_equals_the_python_reference() -> None:
    # 70,000 tokens: more than one pass of the Python path's encoder.
    tokens = np.random.default_rng(3).choice(np.array(EDGES), size=70_000).astype(np.uint32)
    hasher = BlockHasher(16)
    want = hasher.keys_python(tokens, None, namespace="t", adapter="a")
    assert hasher.keys(tokens, None, namespace="t", adapter="a") == want


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16])
def test_narrow_dtypes_of_mixed_widths_equal_the_python_reference(
    dtype: type[np.integer],
) -> None:
    tokens = np.array([0, 23, 24, 127] * 8, dtype=dtype)
    hasher = BlockHasher(16)
    assert hasher.keys(tokens, None) == hasher.keys_python(tokens, None)


class Ids(list[int]):
    """A list subclass: the C loop declines it; keys() still computes in C."""


UNUSUAL_INPUTS: list[tuple[str, Any]] = [
    ("list of numpy ints", [np.int64(v) for v in range(40)]),
    ("list subclass", Ids(range(40))),
    ("list of bools and ints", [True, False, *range(38)]),
    ("range", range(40)),
    ("array.array", array.array("I", range(40))),
    ("big-endian array", np.arange(40, dtype=">u4")),
    ("empty float array", np.array([], dtype=np.float64)),
]


@pytest.mark.parametrize(
    "tokens", [case[1] for case in UNUSUAL_INPUTS], ids=[case[0] for case in UNUSUAL_INPUTS]
)
def test_unusual_token_inputs_give_the_reference_keys(tokens: Any) -> None:
    hasher = BlockHasher(16)
    want = hasher.keys_python(tokens, None)
    assert hasher.keys(tokens, None) == want
    assert hasher.keys_blob(tokens, None) == b"".join(want)


def test_keys_blob_is_the_keys_joined() -> None:
    hasher = BlockHasher(16)
    tokens = np.random.default_rng(5).integers(0, 150_000, 10 * 16 + 3, dtype=np.int32)
    parent = hashlib.sha256(b"before").digest()
    blob = hasher.keys_blob(tokens, parent, first_block=4, adapter="a")
    assert blob == b"".join(hasher.keys(tokens, parent, first_block=4, adapter="a"))
    assert len(blob) == 10 * 32
    assert hasher.keys_blob(tokens[:15], None) == b""


def test_the_c_loop_refuses_bad_arguments_from_a_caller_but_hashing_py() -> None:
    # hashing.py checks every argument before calling it; a direct call gets TypeError.
    c = hashing._c
    with pytest.raises(TypeError, match="6 arguments"):
        c.keys([1, 2], 16)
    with pytest.raises(TypeError, match="bad arguments"):
        c.keys([1, 2], 16, b"short", b"\x90", b"\xf6", None)
