"""Argument checks: each returns the stored form or raises InvalidError."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.engine.checks import (
    adapter_name,
    as_tokens,
    count,
    limits,
    namespace_name,
    sequence_id,
)
from kvd.engine.errors import InvalidError


def test_an_int32_array_is_taken_as_is() -> None:
    arr = np.arange(5, dtype=np.int32)
    assert as_tokens(arr) is arr


def test_a_list_of_ints_becomes_an_int32_array() -> None:
    arr = as_tokens([1, 2, 3])
    assert arr.dtype == np.int32 and arr.tolist() == [1, 2, 3]


def test_no_tokens_is_an_empty_int32_array() -> None:
    arr = as_tokens([])
    assert arr.dtype == np.int32 and arr.shape == (0,)


@pytest.mark.parametrize(
    "tokens",
    [
        np.int32([1, -1]),
        np.arange(-1, 40, dtype=np.int32),
        [2**31],
        [1.5],
        [[1], [2, 3]],
        np.zeros((2, 2), np.int64),
    ],
    ids=["negative", "negative-long", "too-big", "float", "ragged", "2-d"],
)
def test_bad_token_ids_are_invalid(tokens: object) -> None:
    with pytest.raises(InvalidError):
        as_tokens(tokens)  # type: ignore[arg-type]


def test_count_takes_numpy_integers() -> None:
    assert count(np.int64(3), "n") == 3


@pytest.mark.parametrize("value", [True, -1, "3", 2.0])
def test_count_refuses_bools_negatives_and_non_ints(value: object) -> None:
    with pytest.raises(InvalidError, match="n must be"):
        count(value, "n")


def test_limits_refuse_a_minimum_above_the_quota() -> None:
    with pytest.raises(InvalidError, match="exceeds quota"):
        limits(2, 3)
    assert limits(None, 3) == (None, 3)


def test_a_sequence_id_is_a_str() -> None:
    assert sequence_id("a") == "a"
    with pytest.raises(InvalidError):
        sequence_id(7)


def test_a_namespace_is_a_str() -> None:
    assert namespace_name("") == ""
    with pytest.raises(InvalidError):
        namespace_name(None)


def test_an_adapter_is_a_non_empty_str_or_none() -> None:
    assert adapter_name(None) is None
    assert adapter_name("lora") == "lora"
    with pytest.raises(InvalidError):
        adapter_name("")
