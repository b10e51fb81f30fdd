"""vLLM-compatible block keys (``sha256_cbor``), many blocks per call.

The key of block *i* of a sequence is::

    sha256(cbor((key[i-1] or root, tuple(block_token_ids), extra_keys or None)))

with canonical CBOR, and ``root = sha256(cbor(seed))`` for the configured
seed (vLLM's ``DEFAULT_NONE_HASH_SEED``, ``"vllm-none-hash"``, unless the
deployment sets another, as vLLM does with ``PYTHONHASHSEED``). With no extra
keys this is byte for byte what vLLM computes with
``--prefix-caching-hash-algo sha256_cbor``, so routers that index vLLM's KV
events index kvd's. Event ids are the last 8 bytes of a key, big-endian
(vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` form).

Extra keys, as vLLM 0.33.0 builds them (``generate_block_hash_extra_keys`` in
``vllm/v1/core/kv_cache_utils.py``, read from the released wheel): a tuple of
tagged tuples, LoRA first, then multimodal, then the cache salt, then prompt
embeds; ``None`` when there are none. The salt, ``("cache_salt", salt)``, goes
on the block that starts at token 0 only; through the parent chain it still
changes every later key. The LoRA entry, ``("lora", lora_name, lora_path)``,
goes on every block. kvd maps onto that as follows:

- ``namespace`` plays the role of ``cache_salt``: the empty namespace is "no
  salt" (vLLM also treats an empty salt as none), so kvd's default keys equal
  vLLM's; a non-empty namespace adds ``("cache_salt", namespace)`` to block 0.
- ``adapter`` adds ``("lora", adapter, "")`` to every block. kvd knows an
  adapter by name only (the wire carries no path), and vLLM requires a
  non-empty ``lora_path``, so a LoRA block's key is never equal to vLLM's:
  the entry keeps vLLM's shape, with an empty path, so that passing the real
  path later changes only that field. The tags keep an adapter name from ever
  colliding with a namespace (untagged, ``"x"`` as a LoRA name and ``"x"`` as
  a salt gave the same block-0 key in earlier vLLM releases; vLLM issue #44701).
- kvd has no multimodal inputs, prompt embeds or look-ahead tokens, so those
  entries never appear.

vLLM publishes extra keys in its KV events untagged (``to_event_extra_keys``:
bare LoRA names and salts); that is the events' business, not the keys'.

Speed: vLLM builds one Python tuple per block and CBOR-encodes it (2-3
microseconds per block). kvd computes every block of a call in one C loop
(``_keys.c``: each block's CBOR laid out in one buffer, then OpenSSL's
SHA-256), well under a microsecond per block. ``keys_python`` is the same
computation in Python (a fixed number of numpy passes lay out the CBOR of many
blocks, then one SHA-256 per block): the reference the C loop is tested
against, and what ``keys`` runs where the extension is not built, with a
RuntimeWarning at import (``IMPLEMENTATION`` says which). ``bench/hashing.py``
measures both beside the per-block cbor2 form.
"""

from __future__ import annotations

import array
import functools
import hashlib
import importlib
import warnings
from collections.abc import Callable, Sequence
from typing import Final, Literal, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_HASH_SEED",
    "IMPLEMENTATION",
    "KEY_SIZE",
    "BlockHasher",
    "KeyList",
    "event_id",
    "root_digest",
]

#: What a C loop returns: the keys as a list, or as one bytes object.
_Out = TypeVar("_Out", list[bytes], bytes)
_c_keys: Callable[..., list[bytes] | None] | None
_c_blob: Callable[..., bytes | None] | None
try:
    # By name: import-linter cannot see a C module and would take a static import
    # of it for one of the package kvd_client.wire, most of which the engine may not import.
    _c = importlib.import_module("kvd_client.wire._keys")
except ImportError as exc:
    _c_keys = _c_blob = None
    warnings.warn(
        f"kvd_client.wire._keys is not built ({exc}): block keys are computed in Python,"
        " several times slower. Build it with `pip install -e .` (`make venv`) where a C"
        " compiler and OpenSSL's headers (Debian: libssl-dev) are installed.",
        RuntimeWarning,
        stacklevel=1,
    )
else:
    _c_keys, _c_blob = _c.keys, _c.blob

#: Which code computes ``BlockHasher.keys``: the C extension, or Python where it
#: was not built.
IMPLEMENTATION: Final[Literal["c", "python"]] = "python" if _c_keys is None else "c"

#: vLLM's default seed for the root digest (``DEFAULT_NONE_HASH_SEED``).
DEFAULT_HASH_SEED: Final = "vllm-none-hash"
#: Bytes in a key (a SHA-256 digest).
KEY_SIZE: Final = 32


class KeyList(list[bytes]):
    """Block keys known to be ``KEY_SIZE``-byte bytes each (cut from a keys frame):
    the engine takes such a list without checking every key again."""


# Token ids must be below this (CBOR's 4-byte unsigned form is the widest encoded).
_TOKEN_LIMIT: Final = 2**32

# CBOR major types.
_TEXT: Final = 3
_ARRAY: Final = 4
# array(3) followed by the head of a 32-byte byte string: the start of every
# block's encoding, before the parent key.
_TRIPLE_HEAD: Final = b"\x83\x58\x20"
_TRIPLE_HEAD_HASH: Final = hashlib.sha256(_TRIPLE_HEAD)
_NULL: Final = b"\xf6"

# Width classes of a CBOR unsigned int: < 24 (1 byte), < 2**8 (2), < 2**16 (3),
# < 2**32 (5). Each token is first written right-aligned in a big-endian 8-byte
# word, ``head << 8 * (width - 1) | value`` (a value below 24 is its own head),
# then the unused leading bytes of the word are dropped.
_CLASS_BOUNDS: Final = (24, 256, 65536)
_CLASS_WIDTH: Final = (1, 2, 3, 5)
# The class of ``t`` is _CLASS_OF[min(t >> 3, 8192)]: every bound is a multiple
# of 8, and one small-table lookup is quicker than three comparisons.
_CLASS_OF: Final = np.searchsorted(
    np.array(_CLASS_BOUNDS) >> 3, np.arange((_CLASS_BOUNDS[2] >> 3) + 1), side="right"
).astype(np.uint8)
_CLASS_HEAD: Final = np.array([0, 0x18 << 8, 0x19 << 16, 0x1A << 32], dtype=np.uint64)
# Per class, which bytes of the word are kept: eight bools per class, stored
# as one uint64 so that a take() by class yields the byte mask directly.
_KEEP_BYTES: Final = np.arange(8) >= 8 - np.array(_CLASS_WIDTH)[:, None]
_CLASS_KEEP: Final = _KEEP_BYTES.view(np.uint64).reshape(-1)
# Tokens encoded per numpy pass (rounded to whole blocks): bounds the scratch
# memory of a huge call to a few MiB.
_CHUNK_TOKENS: Final = 65536
#: Up to this many tokens, their bounds are taken from a list (a block or a few).
_SHORT: Final = 64


def _cbor_head(major: int, n: int) -> bytes:
    """The CBOR head of major type ``major`` with argument ``n`` (shortest form)."""
    if n < 24:
        return bytes([major << 5 | n])
    if n < 2**8:
        return bytes([major << 5 | 24, n])
    if n < 2**16:
        return bytes([major << 5 | 25]) + n.to_bytes(2, "big")
    if n < 2**32:
        return bytes([major << 5 | 26]) + n.to_bytes(4, "big")
    return bytes([major << 5 | 27]) + n.to_bytes(8, "big")


def _cbor_text(s: str) -> bytes:
    data = s.encode("utf-8")
    return _cbor_head(_TEXT, len(data)) + data


def _cbor_extras(entries: Sequence[tuple[str, ...]]) -> bytes:
    """CBOR of ``tuple(entries)``, or of ``None`` when there are none (as vLLM)."""
    if not entries:
        return _NULL
    out = [_cbor_head(_ARRAY, len(entries))]
    for entry in entries:
        out.append(_cbor_head(_ARRAY, len(entry)))
        out.extend(_cbor_text(field) for field in entry)
    return b"".join(out)


def root_digest(seed: str = DEFAULT_HASH_SEED) -> bytes:
    """SHA-256 of the canonical CBOR of ``seed``: the parent of every sequence's block 0."""
    if not isinstance(seed, str):
        raise ValueError(f"hash seed must be a str, got {type(seed).__name__}")
    return hashlib.sha256(_cbor_text(seed)).digest()


def event_id(key: bytes) -> int:
    """The 64-bit form of a key in KV events: its last 8 bytes, big-endian, unsigned."""
    if len(key) != KEY_SIZE:
        raise ValueError(f"a block key has {KEY_SIZE} bytes, got {len(key)}")
    return int.from_bytes(key[-8:], "big")


def _width_class(value: int) -> int:
    """The CBOR width class of a non-negative value below 2**32."""
    if value < _CLASS_BOUNDS[1]:
        return 0 if value < _CLASS_BOUNDS[0] else 1
    return 2 if value < _CLASS_BOUNDS[2] else 3


def _token_array(
    tokens: npt.NDArray[np.integer] | Sequence[int],
) -> tuple[npt.NDArray[np.integer], int, int]:
    """Validate token ids: a 1-D integer array of them, their least and greatest."""
    if isinstance(tokens, list | tuple):
        # array.array converts through __index__, so floats and strings are refused
        # rather than truncated, and it is several times quicker than np.asarray.
        try:
            arr = np.frombuffer(array.array("Q", tokens), dtype=np.uint64)
        except OverflowError as exc:
            raise ValueError(f"token ids must be non-negative and below 2**32: {exc}") from None
        except TypeError as exc:
            raise ValueError(f"token ids must be integers: {exc}") from None
    else:
        arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a 1-D sequence, got {arr.ndim} dimensions")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64), 0, 0
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size <= _SHORT:  # numpy's min and max cost ~2 µs each on a few tokens
        values = arr.tolist()
        lo, hi = min(values), max(values)
    else:
        lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise ValueError(f"token ids must be non-negative, got {lo}")
    if hi >= _TOKEN_LIMIT:
        raise ValueError(f"token ids must be below 2**32, got {hi}")
    return arr, lo, hi


class BlockHasher:
    """Hashes full blocks of one pool (fixed ``block_size``) for one seed."""

    __slots__ = ("_array_head", "block_size", "root", "seed")

    root: bytes
    block_size: int
    seed: str
    _array_head: bytes

    def __init__(self, block_size: int, seed: str = DEFAULT_HASH_SEED) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.seed = seed
        self.root = root_digest(seed)
        self._array_head = _cbor_head(_ARRAY, block_size)

    def keys(
        self,
        tokens: npt.NDArray[np.integer] | Sequence[int],
        parent: bytes | None,
        *,
        first_block: int = 0,
        namespace: str = "",
        adapter: str | None = None,
    ) -> list[bytes]:
        """Keys of the ``len(tokens) // block_size`` full blocks of ``tokens``.

        A trailing partial block is ignored. ``parent`` is the key of the block
        before ``tokens[0]``; ``None`` means the root and is valid only when
        ``first_block == 0``. ``first_block`` is the index of the first block
        of ``tokens`` in its sequence: the namespace salt goes on block 0
        only. Token ids must be non-negative and below 2**32. Raises
        ValueError on bad input. Computed by the C loop (``IMPLEMENTATION``).
        """
        parent, extras, block0_extras = self._check(parent, first_block, namespace, adapter)
        if _c_keys is None:
            return self._python_keys(tokens, parent, extras, block0_extras)
        return self._in_c(_c_keys, tokens, parent, extras, block0_extras)

    def keys_blob(
        self,
        tokens: npt.NDArray[np.integer] | Sequence[int],
        parent: bytes | None,
        *,
        first_block: int = 0,
        namespace: str = "",
        adapter: str | None = None,
    ) -> bytes:
        """``b"".join(self.keys(...))``, without the list: the wire's form of keys."""
        parent, extras, block0_extras = self._check(parent, first_block, namespace, adapter)
        if _c_blob is None:
            return b"".join(self._python_keys(tokens, parent, extras, block0_extras))
        return self._in_c(_c_blob, tokens, parent, extras, block0_extras)

    def _in_c(
        self,
        loop: Callable[..., _Out | None],
        tokens: npt.NDArray[np.integer] | Sequence[int],
        parent: bytes,
        extras: bytes,
        block0_extras: bytes | None,
    ) -> _Out:
        """The C ``loop``'s keys of ``tokens``; what it does not take as they are
        (None) is checked (ValueError) and converted, then given to it again."""
        head, bs = self._array_head, self.block_size
        direct = tokens if type(tokens) in _C_DIRECT else _c_input(tokens)
        out = loop(direct, bs, parent, head, extras, block0_extras)
        if out is None:
            out = loop(_checked_tokens(tokens), bs, parent, head, extras, block0_extras)
            assert out is not None, "the C loop takes any checked token ids"
        return out

    def keys_python(
        self,
        tokens: npt.NDArray[np.integer] | Sequence[int],
        parent: bytes | None,
        *,
        first_block: int = 0,
        namespace: str = "",
        adapter: str | None = None,
    ) -> list[bytes]:
        """``keys`` computed in Python: the reference the C loop is tested
        against, and what ``keys`` runs where the extension is not built."""
        parent, extras, block0_extras = self._check(parent, first_block, namespace, adapter)
        return self._python_keys(tokens, parent, extras, block0_extras)

    def _check(
        self, parent: bytes | None, first_block: int, namespace: str, adapter: str | None
    ) -> tuple[bytes, bytes, bytes | None]:
        """Check every argument but the token ids. Returns the parent key (the root
        for None), the CBOR of every block's extra keys, and block 0's (None: the same)."""
        # ``type() is int`` first: isinstance costs more, and calls pass ints.
        if (
            type(first_block) is not int
            and (isinstance(first_block, bool) or not isinstance(first_block, int))
        ) or first_block < 0:
            raise ValueError(f"first_block must be a non-negative int, got {first_block!r}")
        if parent is None:
            if first_block != 0:
                raise ValueError(
                    f"parent is required for first_block={first_block}: "
                    "only block 0 descends from the root"
                )
            parent = self.root
        elif not isinstance(parent, bytes) or len(parent) != KEY_SIZE:
            raise ValueError(f"parent must be a {KEY_SIZE}-byte key or None, got {parent!r}")
        if not isinstance(namespace, str):
            raise ValueError(f"namespace must be a str, got {type(namespace).__name__}")
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            raise ValueError(f"adapter must be a non-empty str or None, got {adapter!r}")
        # Block 0 alone carries the salt.
        salt = namespace if first_block == 0 else ""
        if adapter is None and not salt:  # most calls: no lookup
            return parent, _NULL, None
        return (parent, *_extras(adapter, salt))

    def _python_keys(
        self,
        tokens: npt.NDArray[np.integer] | Sequence[int],
        parent: bytes,
        extras: bytes,
        block0_extras: bytes | None,
    ) -> list[bytes]:
        """The Python computation of ``keys``, on checked arguments."""
        arr, lo, hi = _token_array(tokens)
        bs = self.block_size
        num_blocks = arr.size // bs
        if num_blocks == 0:
            return []
        blocks = arr[: num_blocks * bs].reshape(num_blocks, bs)
        # Bounds of the whole input: a partial tail can only make the test stricter.
        lo_class = _width_class(lo)
        uniform = lo_class if lo_class == _width_class(hi) else None

        # Every block's encoding starts with the same three bytes: hash them once.
        fresh = _TRIPLE_HEAD_HASH.copy
        array_head = self._array_head
        out: list[bytes] = []
        append = out.append
        chunk = max(1, _CHUNK_TOKENS // bs)
        for first in range(0, num_blocks, chunk):
            data, ends = _encode_tokens(blocks[first : first + chunk], uniform)
            start = 0
            if first == 0 and block0_extras is not None:
                end = ends[0]
                h = fresh()
                h.update(parent)
                h.update(array_head + data[:end] + block0_extras)
                parent = h.digest()
                append(parent)
                start = end
                ends = ends[1:]
            for end in ends:
                h = fresh()
                h.update(parent)
                h.update(array_head + data[start:end] + extras)
                parent = h.digest()
                append(parent)
                start = end
        return out


# Token inputs the C loop reads as they are (a type test is quicker than isinstance).
_C_DIRECT: Final = (list, tuple, np.ndarray)


def _c_input(tokens: npt.NDArray[np.integer] | Sequence[int]) -> object:
    """``tokens`` as the C loop reads them: as _token_array, lists and tuples
    (subclasses too: the loop declines them) item by item, anything else as an array."""
    return tokens if isinstance(tokens, list | tuple) else np.asarray(tokens)


def _checked_tokens(tokens: npt.NDArray[np.integer] | Sequence[int]) -> npt.NDArray[np.uint64]:
    """Token ids the C loop declined (it takes native-order integer arrays and
    exact lists or tuples of ints, all in range): checked by the reference, which
    raises its errors, and handed back as uint64."""
    arr, _, _ = _token_array(tokens)
    return arr.astype(np.uint64, copy=False)


@functools.lru_cache(maxsize=256)
def _extras(adapter: str | None, salt: str) -> tuple[bytes, bytes | None]:
    """CBOR of every block's extra keys, and of block 0's when ``salt`` adds one."""
    lora: list[tuple[str, ...]] = [] if adapter is None else [("lora", adapter, "")]
    block0 = _cbor_extras([*lora, ("cache_salt", salt)]) if salt else None
    return _cbor_extras(lora), block0


def _encode_tokens(
    blocks: npt.NDArray[np.integer], uniform: int | None
) -> tuple[bytes, Sequence[int]]:
    """CBOR of the token ids of each block (without the array head), back to back.

    Returns the bytes and where each block's part ends. ``uniform`` is the width
    class of every token, when they share one.
    """
    flat = blocks.reshape(-1)
    if uniform is not None:
        # One width for every token: a fixed stride, nothing to search.
        width = _CLASS_WIDTH[uniform]
        words = flat.astype(np.uint64)
        words |= _CLASS_HEAD[uniform]
        data = words.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - width :].tobytes()
        step = width * blocks.shape[1]
        return data, range(step, len(data) + 1, step)
    index = flat >> 3
    if flat.itemsize > 1:  # 8-bit ids are within the table, whose size they cannot hold
        np.minimum(index, _CLASS_OF.size - 1, out=index)
    cls = _CLASS_OF.take(index)
    words = flat.astype(np.uint64)
    words |= _CLASS_HEAD.take(cls)
    kept = _CLASS_KEEP.take(cls).view(bool).nonzero()[0]
    data = words.astype(">u8").view(np.uint8).take(kept).tobytes()
    num_blocks, bs = blocks.shape
    if num_blocks == 1:  # the common decode-time call: nothing to search
        return data, (len(data),)
    # A block's part ends where the kept bytes of its last word end.
    block_ends = np.arange(8 * bs, 8 * bs * num_blocks + 1, 8 * bs)
    ends: list[int] = kept.searchsorted(block_ends).tolist()
    return data, ends
