"""Block keys: vLLM's sha256_cbor chain, cross-checked against cbor2."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_client.wire.hashing import DEFAULT_HASH_SEED, KEY_SIZE, BlockHasher, event_id, root_digest

REPO = Path(__file__).resolve().parents[2]

# Every edge of CBOR's unsigned-int widths, and the largest token id allowed.
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**32 - 1]


def reference_keys(
    tokens: Any,
    block_size: int,
    parent: bytes | None,
    *,
    first_block: int = 0,
    namespace: str = "",
    adapter: str | None = None,
    seed: str = DEFAULT_HASH_SEED,
) -> list[bytes]:
    """The straightforward form: one Python tuple and one cbor2 call per block, as vLLM."""
    key = parent or hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        entries: list[tuple[str, ...]] = []
        if adapter is not None:
            entries.append(("lora", adapter, ""))
        if first_block + i == 0 and namespace:
            entries.append(("cache_salt", namespace))
        block = tuple(int(t) for t in tokens[i * block_size : (i + 1) * block_size])
        triple = (key, block, tuple(entries) or None)
        key = hashlib.sha256(cbor2.dumps(triple, canonical=True)).digest()
        out.append(key)
    return out


def some_key(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


# ---------------------------------------------------------------- DESIGN vectors


def test_root_digest_matches_the_vllm_vector() -> None:
    assert root_digest().hex().startswith("9bd96a485ad84efd")
    assert BlockHasher(16).root == root_digest(DEFAULT_HASH_SEED)


def test_block_zero_of_tokens_0_to_15_matches_the_vllm_vector() -> None:
    (key,) = BlockHasher(16).keys(np.arange(16), None)
    assert key.hex() == "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"


def test_event_id_is_the_last_8_bytes_big_endian() -> None:
    (key,) = BlockHasher(16).keys(list(range(16)), None)
    assert event_id(key) == 2233398808101521225


def test_another_seed_gives_another_root_and_keys() -> None:
    other = BlockHasher(16, seed="42")
    assert other.root == hashlib.sha256(cbor2.dumps("42", canonical=True)).digest()
    tokens = np.arange(32)
    assert other.keys(tokens, None) == reference_keys(tokens, 16, None, seed="42")
    assert other.keys(tokens, None) != BlockHasher(16).keys(tokens, None)


# ----------------------------------------------------------- equality with cbor2


@pytest.mark.parametrize("value", EDGES)
def test_blocks_of_one_edge_value_equal_the_reference(value: int) -> None:
    tokens = np.full(3 * 16, value, dtype=np.uint32)
    assert BlockHasher(16).keys(tokens, None) == reference_keys(tokens, 16, None)


def test_blocks_mixing_every_width_equal_the_reference() -> None:
    rng = np.random.default_rng(7)
    tokens = rng.choice(np.array(EDGES, dtype=np.int64), size=40 * 16)
    assert BlockHasher(16).keys(tokens, None) == reference_keys(tokens, 16, None)


token_ids = st.one_of(
    st.sampled_from(EDGES),
    st.integers(0, 23),
    st.integers(24, 255),
    st.integers(256, 65535),
    st.integers(65536, 2**32 - 1),
)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 3, 16, 23, 24, 255, 256]),
    data=st.data(),
    namespace=st.sampled_from(["", "tenant-a", "é" * 40]),
    adapter=st.sampled_from([None, "sql-lora", "x" * 300]),
    chained=st.booleans(),
)
def test_keys_equal_the_reference_for_any_tokens(
    block_size: int, data: st.DataObject, namespace: str, adapter: str | None, chained: bool
) -> None:
    tokens = data.draw(st.lists(token_ids, max_size=6 * block_size + 5))
    parent, first_block = (some_key("parent"), 3) if chained else (None, 0)
    got = BlockHasher(block_size).keys(
        tokens, parent, first_block=first_block, namespace=namespace, adapter=adapter
    )
    want = reference_keys(
        tokens, block_size, parent, first_block=first_block, namespace=namespace, adapter=adapter
    )
    assert got == want


def test_a_call_longer_than_one_encoding_pass_equals_the_reference() -> None:
    # 70,000 tokens: more than one numpy pass (65,536 tokens each); the salt must
    # still go on block 0 only.
    tokens = np.random.default_rng(3).choice(np.array(EDGES), size=70_000)
    got = BlockHasher(16).keys(tokens, None, namespace="t", adapter="a")
    assert got == reference_keys(tokens, 16, None, namespace="t", adapter="a")


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64, np.uint64])
def test_array_dtypes_and_lists_give_the_same_keys(dtype: type[np.integer]) -> None:
    values = list(range(0, 60000, 937))[:64]
    hasher = BlockHasher(16)
    expected = hasher.keys(values, None)
    assert hasher.keys(np.array(values, dtype=dtype), None) == expected
    assert hasher.keys(tuple(values), None) == expected


# ------------------------------------------------------------------- semantics


def test_a_trailing_partial_block_is_ignored() -> None:
    hasher = BlockHasher(16)
    tokens = np.arange(1000, 1000 + 3 * 16 + 15)
    assert hasher.keys(tokens, None) == hasher.keys(tokens[: 3 * 16], None)
    assert len(hasher.keys(tokens, None)) == 3
    assert hasher.keys(tokens[:15], None) == []
    assert hasher.keys([], None) == []


def test_a_namespace_changes_block_zero_and_through_the_chain_every_key() -> None:
    hasher = BlockHasher(16)
    tokens = np.arange(5 * 16)
    plain = hasher.keys(tokens, None)
    salted = hasher.keys(tokens, None, namespace="tenant-a")
    assert all(a != b for a, b in zip(plain, salted, strict=True))


def test_different_namespaces_never_share_a_key() -> None:
    hasher = BlockHasher(16)
    tokens = np.arange(5 * 16)
    a = hasher.keys(tokens, None, namespace="a")
    b = hasher.keys(tokens, None, namespace="b")
    assert not set(a) & set(b)


def test_an_adapter_name_never_collides_with_an_equal_namespace() -> None:
    hasher = BlockHasher(16)
    tokens = np.arange(3 * 16)
    as_adapter = hasher.keys(tokens, None, adapter="x")
    as_namespace = hasher.keys(tokens, None, namespace="x")
    assert not set(as_adapter) & set(as_namespace)


def test_an_adapter_changes_every_block_not_only_through_the_chain() -> None:
    hasher = BlockHasher(16)
    tokens = np.arange(16, 4 * 16)
    parent = some_key("block 0")
    plain = hasher.keys(tokens, parent, first_block=1)
    lora = hasher.keys(tokens, parent, first_block=1, adapter="sql-lora")
    other = hasher.keys(tokens, parent, first_block=1, adapter="chat-lora")
    assert all(len({a, b, c}) == 3 for a, b, c in zip(plain, lora, other, strict=True))


def test_blocks_after_block_zero_get_no_salt() -> None:
    hasher = BlockHasher(16)
    tokens = np.arange(16, 4 * 16)
    parent = some_key("block 0")
    assert hasher.keys(tokens, parent, first_block=1, namespace="tenant-a") == hasher.keys(
        tokens, parent, first_block=1
    )


@settings(max_examples=40, deadline=None)
@given(
    split=st.integers(0, 8),
    namespace=st.sampled_from(["", "t"]),
    adapter=st.sampled_from([None, "a"]),
)
def test_a_prompt_hashed_in_two_calls_equals_one_call(
    split: int, namespace: str, adapter: str | None
) -> None:
    hasher = BlockHasher(16)
    tokens = np.random.default_rng(split).integers(0, 150_000, 8 * 16 + 7)
    whole = hasher.keys(tokens, None, namespace=namespace, adapter=adapter)
    head = hasher.keys(tokens[: split * 16], None, namespace=namespace, adapter=adapter)
    parent = head[-1] if head else None
    tail = hasher.keys(
        tokens[split * 16 :], parent, first_block=split, namespace=namespace, adapter=adapter
    )
    assert head + tail == whole


def test_another_process_computes_the_same_keys() -> None:
    tokens = [int(t) for t in np.random.default_rng(11).integers(0, 150_000, 300)]
    script = (
        "import json, sys\n"
        "from kvd_client.wire.hashing import BlockHasher\n"
        "tokens = json.loads(sys.stdin.read())\n"
        "keys = BlockHasher(16).keys(tokens, None, namespace='t', adapter='a')\n"
        "print(json.dumps([k.hex() for k in keys]))\n"
    )
    # Another interpreter with another str-hash seed: keys must not depend on either.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(tokens),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    here = [k.hex() for k in BlockHasher(16).keys(tokens, None, namespace="t", adapter="a")]
    assert json.loads(child.stdout) == here
    assert len(here) == 300 // 16


# ------------------------------------------------------------------- bad input


BAD_KEYS_CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("negative token in a list", {"tokens": [5, -1, 7]}, "non-negative"),
    ("negative token in an array", {"tokens": np.array([5, -1, 7])}, "non-negative, got -1"),
    ("negative token in the partial tail", {"tokens": np.array([1] * 8 + [-3])}, "got -3"),
    ("token of 2**32", {"tokens": [0, 2**32]}, "below 2\\*\\*32"),
    ("token of 2**32 in block 1 of a list", {"tokens": [1] * 4 + [2**32]}, "below 2\\*\\*32"),
    (
        "uint64 token of 2**63",
        {"tokens": np.array([2**63], dtype=np.uint64)},
        "got 9223372036854775808",
    ),
    ("token of 2**64", {"tokens": [2**64]}, "below 2\\*\\*32"),
    ("float token in a list", {"tokens": [1.0, 2.0]}, "must be integers"),
    ("str token in a tuple", {"tokens": ("1", "2")}, "must be integers"),
    ("float array", {"tokens": np.array([1.0, 2.0])}, "integers, got dtype float64"),
    ("bool array", {"tokens": np.array([True, False])}, "integers, got dtype bool"),
    ("object array", {"tokens": np.array([1, 2], dtype=object)}, "integers, got dtype object"),
    ("2-D array", {"tokens": np.zeros((2, 16), dtype=np.int32)}, "1-D"),
    ("0-D array", {"tokens": np.array(5)}, "0 dimensions"),
    ("root parent after block 0", {"first_block": 2}, "parent is required"),
    ("short parent", {"parent": b"\x00" * 8}, "32-byte key"),
    ("negative first_block", {"parent": b"\x00" * 32, "first_block": -1}, "non-negative int"),
    ("empty adapter", {"adapter": ""}, "non-empty str"),
    ("non-str namespace", {"namespace": 3}, "namespace must be a str"),
]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [case[1:] for case in BAD_KEYS_CALLS],
    ids=[case[0] for case in BAD_KEYS_CALLS],
)
def test_bad_input_raises_value_error_and_changes_nothing(
    kwargs: dict[str, Any], message: str
) -> None:
    hasher = BlockHasher(4)
    before = hasher.keys(np.arange(8), None)
    call: dict[str, Any] = {"tokens": np.arange(8), "parent": None, **kwargs}
    tokens, parent = call.pop("tokens"), call.pop("parent")
    with pytest.raises(ValueError, match=message):
        hasher.keys(tokens, parent, **call)
    assert hasher.keys(np.arange(8), None) == before


@pytest.mark.parametrize(
    "kwargs", [case[1] for case in BAD_KEYS_CALLS], ids=[case[0] for case in BAD_KEYS_CALLS]
)
def test_bad_input_gives_the_same_error_through_c_and_python(kwargs: dict[str, Any]) -> None:
    hasher = BlockHasher(4)
    call: dict[str, Any] = {"tokens": np.arange(8), "parent": None, **kwargs}
    tokens, parent = call.pop("tokens"), call.pop("parent")
    errors = set()
    for method in (hasher.keys, hasher.keys_blob, hasher.keys_python):
        with pytest.raises(ValueError) as err:
            method(tokens, parent, **call)
        errors.add(str(err.value))
    assert len(errors) == 1


@pytest.mark.parametrize("block_size", [0, -16, True, 16.0])
def test_a_block_size_that_is_not_a_positive_int_is_refused(block_size: Any) -> None:
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockHasher(block_size)


def test_event_id_refuses_anything_but_a_key() -> None:
    assert KEY_SIZE == 32
    with pytest.raises(ValueError, match="32 bytes"):
        event_id(b"\x01" * 8)


def test_root_digest_refuses_a_non_str_seed() -> None:
    with pytest.raises(ValueError, match="seed must be a str"):
        root_digest(b"vllm-none-hash")  # type: ignore[arg-type]
