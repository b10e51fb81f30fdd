"""Argument checks of the engine's calls.

Each check returns the argument in the form the engine stores, or raises
`InvalidError`; the engine calls them before it changes anything.
"""

from __future__ import annotations

import operator

import numpy as np
import numpy.typing as npt

from kvd.engine.errors import InvalidError

__all__ = [
    "TokensLike",
    "adapter_name",
    "as_tokens",
    "count",
    "limits",
    "namespace_name",
    "sequence_id",
]

#: Token ids: any 1-D integer sequence; int32 arrays take the fast path.
TokensLike = npt.ArrayLike

_INT32 = np.dtype(np.int32)
_MAX_TOKEN = 2**31 - 1
_EMPTY = np.empty(0, dtype=np.int32)
_EMPTY.flags.writeable = False
#: Small arrays are checked through a list: numpy's reductions cost more.
_SMALL = 16


def as_tokens(tokens: TokensLike) -> npt.NDArray[np.int32]:
    """``tokens`` as a 1-D int32 array of ids in [0, 2**31) (no copy when it already is one)."""
    if type(tokens) is np.ndarray and tokens.dtype is _INT32 and tokens.ndim == 1:
        # The wire decoder's form: only the sign needs checking.
        n = tokens.shape[0]
        if n and (min(tokens.tolist()) if n <= _SMALL else int(tokens.min())) < 0:
            raise InvalidError("token ids must lie in [0, 2**31)")
        return tokens
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as exc:
            raise InvalidError(f"token ids must be a 1-D integer sequence: {exc}") from None
    if arr.ndim != 1:
        raise InvalidError(f"token ids must be a 1-D sequence, got {arr.ndim} dimensions")
    n = arr.shape[0]
    if n == 0:
        return _EMPTY
    if arr.dtype.kind not in "iu":
        raise InvalidError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise InvalidError("token ids must lie in [0, 2**31)")
    return arr.astype(np.int32)


def count(value: object, what: str) -> int:
    """A non-negative int argument (numpy integers accepted, bools not)."""
    if type(value) is not int:
        if isinstance(value, bool):
            raise InvalidError(f"{what} must be an int, got bool")
        try:
            value = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidError(f"{what} must be an int, got {type(value).__name__}") from None
    assert isinstance(value, int)
    if value < 0:
        raise InvalidError(f"{what} must be >= 0, got {value}")
    return value


def limits(quota: object, minimum: object) -> tuple[int | None, int]:
    """An account's hard quota (None: unlimited) and guaranteed minimum, in blocks."""
    q = None if quota is None else count(quota, "quota")
    m = count(minimum, "minimum")
    if q is not None and m > q:
        raise InvalidError(f"minimum ({m}) exceeds quota ({q})")
    return q, m


def sequence_id(value: object) -> str:
    """A sequence id: a str."""
    if type(value) is not str:
        raise InvalidError(f"sequence id must be a str, got {type(value).__name__}")
    return value


def namespace_name(value: object) -> str:
    """A namespace name: a str (empty: the default namespace)."""
    if not isinstance(value, str):
        raise InvalidError(f"namespace must be a str, got {type(value).__name__}")
    return value


def adapter_name(value: object) -> str | None:
    """An adapter identity: a non-empty str, or None."""
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidError(f"adapter must be a non-empty str or None, got {value!r}")
    return value
