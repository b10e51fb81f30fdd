"""The field schema of every message and the codecs compiled from it.

A message class is a slotted dataclass whose annotations say how each field
travels (`int`, `bool`, `str`, `bytes`, `dict`, `list`, `Blocks`, `Keys`, or an int32 array
for a token frame). From that schema each class gets, on first use, one
straight-line decoder (type and size checks per field, a `ProtocolError`
with a stable code on the first bad one) and one encoder: no loop over a
schema per message.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Union

import numpy as np

from kvd_client.wire.codes import INT64_MIN, MAX_NAME_LEN, UINT64_MAX, Code, ProtocolError
from kvd_client.wire.payloads import (
    INT32_LE,
    Blocks,
    Keys,
    TokenArray,
    Tokens,
    blocks_to_bytes,
    decode_keys,
    decode_tokens,
    tokens_from_bytes,
)

if TYPE_CHECKING:
    from kvd_client.wire.messages import Message

__all__ = [
    "DECODERS",
    "ENCODERS",
    "LENIENT_DECODERS",
    "Field",
    "compile_decoder",
    "compile_encoder",
    "fields",
]


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    check: Any  # Callable[[Any, str], Any]
    optional: bool
    is_tokens: bool
    default: Any


def _fail(name: str, expected: str, value: object) -> typing.NoReturn:
    raise ProtocolError(
        Code.INVALID, f"field {name!r}: expected {expected}, got {type(value).__name__}"
    )


def _check_int(value: Any, name: str) -> int:
    if type(value) is not int:
        _fail(name, "an integer", value)
    if not INT64_MIN <= value <= UINT64_MAX:
        raise ProtocolError(Code.INVALID, f"field {name!r}: integer out of range")
    return value


def _check_bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        _fail(name, "a boolean", value)
    return value


def _check_str(value: Any, name: str) -> str:
    if type(value) is not str:
        _fail(name, "a string", value)
    if len(value) > MAX_NAME_LEN:
        raise ProtocolError(Code.TOO_LARGE, f"field {name!r}: longer than {MAX_NAME_LEN}")
    return value


def _check_bytes(value: Any, name: str) -> bytes:
    if type(value) is not bytes:
        _fail(name, "bytes", value)
    if len(value) > MAX_NAME_LEN:
        raise ProtocolError(Code.TOO_LARGE, f"field {name!r}: longer than {MAX_NAME_LEN}")
    return value


def _check_map(value: Any, name: str) -> dict[str, Any]:
    if type(value) is not dict:
        _fail(name, "a map", value)
    return value


def _check_list(value: Any, name: str) -> list[Any]:
    if type(value) is not list:
        _fail(name, "an array", value)
    return value


_NO_BLOCKS: Final = np.empty(0, dtype="<i4")
_NO_BLOCKS.flags.writeable = False


def _check_blocks(value: Any, name: str) -> TokenArray:
    if type(value) is not bytes:
        _fail(name, "int32 bytes", value)
    # Most appends get no new block and no copy: one shared empty array.
    return tokens_from_bytes(value) if value else _NO_BLOCKS


_CHECKS: dict[Any, Any] = {
    int: _check_int,
    bool: _check_bool,
    str: _check_str,
    bytes: _check_bytes,
    dict: _check_map,
    list: _check_list,
    Blocks: _check_blocks,
    # Decoded from its extra frame, like a token field (the check is the decoder).
    Keys: decode_keys,
}


#: Each message class's decoded field schema, built on first use.
_SCHEMAS: dict[type[Message], tuple[Field, ...]] = {}


def fields(cls: type[Message]) -> tuple[Field, ...]:
    """The decoded field schema of ``cls``, in declaration order (cached)."""
    schema = _SCHEMAS.get(cls)
    if schema is None:
        schema = _SCHEMAS[cls] = _schema(cls)
    return schema


def _schema(cls: type[Message]) -> tuple[Field, ...]:
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    schema: list[Field] = []
    for f in dataclasses.fields(typing.cast(Any, cls)):
        ann = hints[f.name]
        optional = False
        origin = typing.get_origin(ann)
        if origin in (Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            optional = len(args) < len(typing.get_args(ann))
            (ann,) = args
            origin = typing.get_origin(ann)
        base = origin or ann
        if base is np.ndarray or ann is Tokens:
            schema.append(Field(f.name, None, optional, True, None))
            continue
        if ann is Blocks or ann is Keys:
            base = ann
        default: Any = None
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        optional = optional or f.default is not dataclasses.MISSING
        optional = optional or f.default_factory is not dataclasses.MISSING
        schema.append(Field(f.name, _CHECKS[base], optional, False, default))
    return tuple(schema)


def _unknown_fields(body: dict[Any, Any], names: frozenset[str]) -> None:
    """INVALID when ``body`` has keys outside ``names`` (the keys may also be nil fields)."""
    unknown = body.keys() - names
    if unknown:
        raise ProtocolError(Code.INVALID, f"unknown fields {sorted(map(str, unknown))}")


def compile_decoder(cls: type[Message], lenient: bool) -> Any:
    """A straight-line decoder for ``cls`` (same checks and messages as the field loop).

    ``lenient``: ignore unknown fields (results from a newer daemon) instead of
    refusing them (requests).
    """
    schema = fields(cls)
    env: dict[str, Any] = {
        "cls": cls,
        "ProtocolError": ProtocolError,
        "INVALID": Code.INVALID,
        "MIN": INT64_MIN,
        "MAX": UINT64_MAX,
        "LEN": MAX_NAME_LEN,
        "check_int": _check_int,
        "check_str": _check_str,
        "tokens": decode_tokens,
        "keys": decode_keys,
        "unknown": _unknown_fields,
        "NAMES": frozenset(f.name for f in schema),
    }
    not_map = f"{cls.__name__} body must be a map"
    lines = [
        "def decode(body, extras):",
        "    if type(body) is not dict:",
        f"        raise ProtocolError(INVALID, {not_map!r})",
        "    get = body.get",
        "    seen = 0",
    ]
    args = []
    for i, f in enumerate(schema):
        v, name = f"v{i}", f.name
        args.append(v)
        lines.append(f"    {v} = get({name!r})")
        lines.append(f"    if {v} is None:")
        if f.optional:
            env[f"D{i}"] = f.default
            lines.append(f"        {v} = D{i}")
        else:
            required = f"field {name!r} is required"
            lines.append(f"        raise ProtocolError(INVALID, {required!r})")
        lines.append("    else:")
        lines.append("        seen += 1")
        if f.is_tokens:
            lines.append(f"        {v} = tokens({v}, extras, {name!r})")
        elif f.check is decode_keys:
            lines.append(f"        {v} = keys({v}, extras, {name!r})")
        elif f.check is _check_int:
            lines.append(f"        if type({v}) is not int or not MIN <= {v} <= MAX:")
            lines.append(f"            check_int({v}, {name!r})")
        elif f.check is _check_str:
            lines.append(f"        if type({v}) is not str or len({v}) > LEN:")
            lines.append(f"            check_str({v}, {name!r})")
        else:
            env[f"C{i}"] = f.check
            lines.append(f"        {v} = C{i}({v}, {name!r})")
    if not lenient:
        lines.append("    if seen != len(body):")
        lines.append("        unknown(body, NAMES)")
    lines.append(f"    return cls({', '.join(args)})")
    exec("\n".join(lines), env)  # noqa: S102 (source built above from the dataclass schema)
    return env["decode"]


def compile_encoder(cls: type[Message]) -> Any:
    """A straight-line ``to_map`` for ``cls``: absent (None) fields are left out.

    An int32 array in a Blocks field is trusted as it is (the daemon's engine
    made it; a negative id still fails the peer's decoder): its bytes are
    taken without the range scan `blocks_to_bytes` does.
    """
    schema = fields(cls)
    env: dict[str, Any] = {
        "ndarray": np.ndarray,
        "I32": INT32_LE,
        "blocks": blocks_to_bytes,
    }
    lines = ["def encode(self, extras, tok, key):", "    out = {}"]
    for f in schema:
        name = f.name
        lines.append(f"    v = self.{name}")
        lines.append("    if v is not None:")
        if f.is_tokens:
            lines.append(f"        out[{name!r}] = tok(v, extras)")
        elif f.check is _check_blocks:
            lines.append("        if type(v) is ndarray and v.dtype == I32 and v.ndim == 1:")
            lines.append(f"            out[{name!r}] = v.tobytes()")
            lines.append("        else:")
            lines.append(f"            out[{name!r}] = blocks(v)")
        elif f.check is decode_keys:
            lines.append(f"        out[{name!r}] = key(v, extras)")
        else:
            lines.append(f"        out[{name!r}] = v")
    lines.append("    return out")
    exec("\n".join(lines), env)  # noqa: S102 (source built above from the dataclass schema)
    return env["encode"]


#: Compiled codecs by message class (built on first use).
DECODERS: dict[type[Message], Any] = {}
LENIENT_DECODERS: dict[type[Message], Any] = {}
ENCODERS: dict[type[Message], Any] = {}
