"""Byte encodings of the wire's payloads: msgpack bodies, token and block ids.

Token ids travel as extra frames of little-endian int32 (``tokens_to_bytes``),
block ids inside bodies as msgpack ``bin`` of the same form. Encoding is
where the client validates ids (once); decoding is where the daemon checks
them again, since it never trusts a client.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import msgpack
import numpy as np
import numpy.typing as npt

from kvd_client.wire.codes import MAX_KEYS, MAX_TOKENS, Code, ProtocolError
from kvd_client.wire.hashing import KEY_SIZE, KeyList

__all__ = [
    "INT32_LE",
    "Blocks",
    "Keys",
    "SharedKeys",
    "SharedTokens",
    "TokenArray",
    "TokenFrames",
    "Tokens",
    "blocks_from_bytes",
    "blocks_to_bytes",
    "decode_keys",
    "decode_tokens",
    "keys_frame",
    "keys_from_bytes",
    "keys_to_bytes",
    "pack",
    "token_frame",
    "tokens_from_bytes",
    "tokens_to_bytes",
]


#: One Packer per thread: ``packb`` builds a Packer per call, which costs
#: four times the packing of a small body; a Packer is not shareable.
_packers = threading.local()


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (``bin`` type for bytes), with this thread's Packer."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)  # type: ignore[no-any-return]


INT32_LE: Final = np.dtype("<i4")


#: Up to this many ids, a range check goes through a list: numpy's reductions
#: cost more on short arrays (a 1-token append, a block table of one block).
_SHORT: Final = 16
#: Bytes 0x00-0x7f: deleting them from the high bytes of int32 LE ids leaves
#: something exactly when an id is negative.
_NON_NEGATIVE_HIGH: Final = bytes(range(0x80))
#: Up to this many bytes (4 Ki ids) the sign check reads the bytes (one C pass,
#: no array); above, numpy's min is faster than copying every fourth byte.
_SIGN_BY_BYTES: Final = 16 * 1024


def _min(arr: npt.NDArray[Any]) -> int:
    """The smallest element of a non-empty 1-D integer array."""
    return min(arr.tolist()) if arr.shape[0] <= _SHORT else int(arr.min())


def _any_negative(buf: bytes) -> bool:
    """Whether int32 little-endian ``buf`` (length a multiple of 4) holds a negative id."""
    if len(buf) <= _SIGN_BY_BYTES:
        return bool(buf[3::4].translate(None, _NON_NEGATIVE_HIGH))
    return int(np.frombuffer(buf, dtype=INT32_LE).min()) < 0


def tokens_to_bytes(tokens: npt.ArrayLike) -> bytes:
    """Token ids as little-endian int32 bytes (the extra-frame form)."""
    if type(tokens) is np.ndarray and tokens.dtype is INT32_LE and tokens.ndim == 1:
        # The common form: only the sign can be out of range, read from the bytes.
        buf = tokens.tobytes()
        if _any_negative(buf):
            raise ValueError("token ids must lie in [0, 2**31)")
        return buf
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("token ids must be a 1-D sequence")
    if not arr.size:
        return b""
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == INT32_LE:  # only the sign can be out of range
        if _min(arr) < 0:
            raise ValueError("token ids must lie in [0, 2**31)")
        return arr.tobytes()
    if _min(arr) < 0 or int(arr.max()) > 2**31 - 1:
        raise ValueError("token ids must lie in [0, 2**31)")
    return arr.astype("<i4", copy=False).tobytes()


def tokens_from_bytes(buf: bytes | memoryview) -> npt.NDArray[np.int32]:
    """Decode a token frame (a read-only array on it); ProtocolError on a bad length or value."""
    if len(buf) % 4:
        raise ProtocolError(Code.INVALID, f"token frame of {len(buf)} bytes is not int32s")
    if len(buf) // 4 > MAX_TOKENS:
        raise ProtocolError(Code.TOO_LARGE, f"more than {MAX_TOKENS} tokens in one frame")
    if type(buf) is not bytes:
        buf = bytes(buf)
    if _any_negative(buf):
        raise ProtocolError(Code.INVALID, "negative token id")
    return np.frombuffer(buf, dtype=INT32_LE)


#: Block ids travel inside bodies as msgpack ``bin`` of little-endian int32.
blocks_to_bytes = tokens_to_bytes


def blocks_from_bytes(buf: bytes) -> npt.NDArray[np.int32]:
    """Decode a block-id ``bin`` field (int32 LE)."""
    return tokens_from_bytes(buf)


class Tokens:
    """Annotation marker: a field carried as an extra int32 frame.

    In the body the field holds the index of its frame among the extras.
    """


if TYPE_CHECKING:
    #: To type checkers a Blocks field is the int32 array it holds.
    Blocks = npt.NDArray[np.int32]
else:

    class Blocks:
        """Annotation marker: an int32 array carried as msgpack ``bin`` in the body."""


if TYPE_CHECKING:
    #: To type checkers a Keys field is the list of block keys it holds.
    Keys = list[bytes]
else:

    class Keys:
        """Annotation marker: block keys carried as an extra frame of concatenated keys.

        In the body the field holds the index of its frame among the extras.
        """


def keys_to_bytes(keys: Sequence[bytes]) -> bytes:
    """Block keys as one frame: each ``KEY_SIZE`` bytes, in chain order."""
    for key in keys:
        if type(key) is not bytes or len(key) != KEY_SIZE:
            raise ValueError(f"block keys must be {KEY_SIZE}-byte bytes")
    if len(keys) > MAX_KEYS:
        raise ValueError(f"at most {MAX_KEYS} keys in one field")
    return b"".join(keys)


#: Keys cut per C call (a fixed struct: bounded memory, 5x a Python loop of slices).
_KEYS_CHUNK: Final = 256
_unpack_keys = struct.Struct(f"{KEY_SIZE}s" * _KEYS_CHUNK).unpack_from


def keys_from_bytes(buf: bytes | memoryview) -> KeyList:
    """Decode a keys frame; ProtocolError on a length not a multiple of ``KEY_SIZE``."""
    size = len(buf)
    if size % KEY_SIZE:
        raise ProtocolError(Code.INVALID, f"keys of {size} bytes are not {KEY_SIZE}-byte keys")
    if size // KEY_SIZE > MAX_KEYS:
        raise ProtocolError(Code.TOO_LARGE, f"more than {MAX_KEYS} keys in one field")
    step = KEY_SIZE * _KEYS_CHUNK
    if size < step:  # the common few keys: one slice each
        if type(buf) is not bytes:
            buf = bytes(buf)
        return KeyList([buf[i : i + KEY_SIZE] for i in range(0, size, KEY_SIZE)])
    keys = KeyList()
    full = size - size % step
    for off in range(0, full, step):
        keys += _unpack_keys(buf, off)
    if full < size:
        rest = bytes(buf[full:])
        keys += [rest[i : i + KEY_SIZE] for i in range(0, len(rest), KEY_SIZE)]
    return keys


def _frame_index(value: int, extras: Sequence[bytes], name: str) -> int:
    """A field's whole-frame reference, checked against the message's extras."""
    if not 0 <= value < len(extras):
        raise ProtocolError(Code.INVALID, f"field {name!r}: no extra frame {value!r}")
    return value


def _frame_slice(value: Any, extras: Sequence[bytes], name: str) -> tuple[int, int, int]:
    """A field's ``[frame, start, stop]`` reference (frame checked; bounds are the caller's)."""
    if (
        type(value) is not list
        or len(value) != 3
        or type(value[0]) is not int
        or type(value[1]) is not int
        or type(value[2]) is not int
    ):
        raise ProtocolError(
            Code.INVALID, f"field {name!r}: expected a frame index or [frame, start, stop]"
        )
    index, start, stop = value
    return _frame_index(index, extras, name), start, stop


def decode_keys(value: Any, extras: Sequence[bytes], name: str) -> list[bytes]:
    """A keys field: ``i`` (all of extra frame ``i``) or ``[i, start, stop]``
    (keys ``start`` to ``stop`` of it, which a batch's fields share)."""
    if type(value) is int:
        return keys_from_bytes(extras[_frame_index(value, extras, name)])
    index, start, stop = _frame_slice(value, extras, name)
    buf = extras[index]
    if len(buf) % KEY_SIZE:
        raise ProtocolError(Code.INVALID, f"keys of {len(buf)} bytes are not {KEY_SIZE}-byte keys")
    if not 0 <= start <= stop <= len(buf) // KEY_SIZE:
        raise ProtocolError(
            Code.INVALID,
            f"field {name!r}: keys {start}:{stop} outside frame {index} of {len(buf) // KEY_SIZE}",
        )
    return keys_from_bytes(buf[start * KEY_SIZE : stop * KEY_SIZE])


def keys_frame(value: Sequence[bytes], extras: list[bytes]) -> int:
    """Append a keys field's frame to ``extras``; the field's body value (its index)."""
    extras.append(keys_to_bytes(value))
    return len(extras) - 1


class SharedKeys:
    """One keys frame for a whole batch: each field becomes ``[frame, start, stop]``
    (a frame per field would cost both ends a ZeroMQ frame per operation)."""

    __slots__ = ("frame", "parts", "size")

    def __init__(self, frame: int) -> None:
        self.frame = frame
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, value: Sequence[bytes], extras: list[bytes]) -> list[int]:
        part = keys_to_bytes(value)
        start = self.size
        self.size = start + len(part) // KEY_SIZE
        self.parts.append(part)
        return [self.frame, start, self.size]

    def frame_bytes(self) -> bytes:
        return b"".join(self.parts)


TokenArray = npt.NDArray[np.int32]


class TokenFrames(list[bytes]):
    """The extra frames of one message, each decoded to tokens at most once.

    A batch's token fields slice one shared frame: the frame is decoded and
    sign-checked once, and each operation gets a view of its slice.
    """

    __slots__ = ("_arrays",)

    def __init__(self, frames: Sequence[bytes] = ()) -> None:
        super().__init__(frames)
        self._arrays: dict[int, tuple[TokenArray, bool]] = {}

    def tokens(self, index: int) -> tuple[TokenArray, bool]:
        """Frame ``index`` as int32 (length checked) and whether every id is >= 0."""
        got = self._arrays.get(index)
        if got is None:
            buf = self[index]
            if len(buf) % 4:
                raise ProtocolError(Code.INVALID, f"token frame of {len(buf)} bytes is not int32s")
            if len(buf) // 4 > MAX_TOKENS:
                raise ProtocolError(Code.TOO_LARGE, f"more than {MAX_TOKENS} tokens in one frame")
            arr = np.frombuffer(buf, dtype="<i4")
            got = self._arrays[index] = (arr, not arr.size or int(arr.min()) >= 0)
        return got


def decode_tokens(value: Any, extras: Sequence[bytes], name: str) -> TokenArray:
    """A token field: ``i`` (all of extra frame ``i``) or ``[i, start, stop]`` (a slice of it)."""
    if type(value) is int:
        return tokens_from_bytes(extras[_frame_index(value, extras, name)])
    index, start, stop = _frame_slice(value, extras, name)
    frames = extras if type(extras) is TokenFrames else TokenFrames(extras)
    arr, nonnegative = frames.tokens(index)
    if not 0 <= start <= stop <= arr.shape[0]:
        raise ProtocolError(
            Code.INVALID,
            f"field {name!r}: tokens {start}:{stop} outside frame {index} of {arr.shape[0]}",
        )
    part = arr[start:stop]
    if not nonnegative and stop > start and int(part.min()) < 0:
        raise ProtocolError(Code.INVALID, "negative token id")
    return part


def token_frame(value: Any, extras: list[bytes]) -> int:
    """Append a token field's frame to ``extras``; the field's body value (its index)."""
    extras.append(tokens_to_bytes(value))
    return len(extras) - 1


class SharedTokens:
    """One token frame for a whole batch: each field becomes ``[frame, start, stop]``."""

    __slots__ = ("arrays", "frame", "size")

    def __init__(self, frame: int) -> None:
        self.frame = frame
        self.arrays: list[TokenArray] = []
        self.size = 0

    def add(self, value: Any, extras: list[bytes]) -> list[int]:
        if type(value) is np.ndarray and value.dtype == INT32_LE and value.ndim == 1:
            if value.shape[0] and _min(value) < 0:
                raise ValueError("token ids must lie in [0, 2**31)")
            arr = value
        else:
            arr = np.frombuffer(tokens_to_bytes(value), dtype=INT32_LE)
        start = self.size
        self.size = start + arr.shape[0]
        self.arrays.append(arr)
        return [self.frame, start, self.size]

    def frame_bytes(self) -> bytes:
        arrays = self.arrays
        return arrays[0].tobytes() if len(arrays) == 1 else np.concatenate(arrays).tobytes()
