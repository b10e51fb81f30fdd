"""How a client finds a cuda pool's bytes: the memory map in the hello reply.

The daemon allocates each cuda pool as its own device allocation and sends,
in the hello reply's ``memory``, a `CudaMemoryMap`::

    {"backend": "cuda", "device": 0, "uuid": "GPU-…", "handle": <64 bytes>,
     "offset": 0, "size": N}

``device`` is the daemon's CUDA ordinal, for messages only: a client whose
``CUDA_VISIBLE_DEVICES`` orders GPUs differently finds the same GPU by its
``uuid``. Plain data, no CUDA: the daemon builds it, clients parse it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvd_client.wire.layout import PAGE, POOL_ALIGN

__all__ = ["BACKEND", "HANDLE_BYTES", "CudaMemoryMap", "canonical_uuid", "format_uuid"]

#: ``memory["backend"]`` of a cuda pool.
BACKEND: Final = "cuda"
#: Bytes of a CUDA IPC memory handle (``cudaIpcMemHandle_t``).
HANDLE_BYTES: Final = 64

_UUID_RE: Final = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_MAP_KEYS: Final = frozenset({"backend", "device", "uuid", "handle", "offset", "size"})


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ValueError(f"cuda memory map: {key} {message}")


def _is_int(value: object) -> bool:
    return type(value) is int


def format_uuid(raw: bytes) -> str:
    """A device's 16 UUID bytes (``cudaDeviceProp.uuid``) in NVML's ``GPU-…`` form."""
    if type(raw) is not bytes or len(raw) != 16:
        raise ValueError(f"a device UUID is 16 bytes, got {raw!r}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def canonical_uuid(text: str | bytes) -> str | None:
    """A UUID as NVML or torch writes it, in the ``GPU-…`` form (None when it is not one).

    Takes ``GPU-8f2c…`` (NVML, any case) and ``8f2c1a0e-5b7d-…`` (torch).
    """
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    digits = text.strip().lower().removeprefix("gpu-").replace("-", "")
    if len(digits) != 32 or any(c not in "0123456789abcdef" for c in digits):
        return None
    return format_uuid(bytes.fromhex(digits))


@dataclass(frozen=True, slots=True)
class CudaMemoryMap:
    """Where a cuda pool's bytes are: an IPC handle, and the pool's span in it.

    ``offset`` and ``size`` delimit the pool inside the exported allocation;
    ``device`` is the daemon's ordinal, ``uuid`` the GPU's identity. Built
    by the daemon (`to_dict` is the hello reply's ``memory``) and parsed by
    clients (`from_dict`): one definition for both sides.
    """

    device: int
    uuid: str
    handle: bytes
    offset: int
    size: int

    def __post_init__(self) -> None:
        _require(_is_int(self.device) and self.device >= 0, "device", "must be an ordinal >= 0")
        _require(type(self.uuid) is str and bool(_UUID_RE.match(self.uuid)), "uuid", "is not GPU-…")
        _require(
            type(self.handle) is bytes and len(self.handle) == HANDLE_BYTES,
            "handle",
            f"must be {HANDLE_BYTES} bytes",
        )
        _require(
            _is_int(self.offset) and self.offset >= 0 and self.offset % PAGE == 0,
            "offset",
            f"must be a multiple of {PAGE} >= 0",
        )
        _require(
            _is_int(self.size) and self.size > 0 and self.size % POOL_ALIGN == 0,
            "size",
            f"must be a positive multiple of {POOL_ALIGN}",
        )

    def to_dict(self) -> dict[str, Any]:
        """The msgpack-ready form (``handle`` packs as ``bin``)."""
        return {
            "backend": BACKEND,
            "device": self.device,
            "uuid": self.uuid,
            "handle": self.handle,
            "offset": self.offset,
            "size": self.size,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CudaMemoryMap:
        """Parse a hello reply's memory map; ValueError names the bad key."""
        _require(isinstance(d, Mapping), "", "must be a map")
        _require(d.get("backend") == BACKEND, "backend", f"must be {BACKEND!r}")
        missing = _MAP_KEYS - d.keys()
        _require(not missing, ",".join(sorted(missing)), "missing")
        unknown = d.keys() - _MAP_KEYS
        _require(not unknown, ",".join(sorted(map(str, unknown))), "unknown")
        return cls(
            device=d["device"],
            uuid=d["uuid"],
            handle=d["handle"],
            offset=d["offset"],
            size=d["size"],
        )
