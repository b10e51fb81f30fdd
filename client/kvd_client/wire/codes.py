"""Message kinds, error codes and limits: the fixed vocabulary of the wire.

Every message is a ZeroMQ multipart message (the daemon's ROUTER adds the
peer's routing id in front, which the wire package never sees)::

    frame 0   one byte: the message kind (`Kind`)
    frame 1   msgpack body: a map, decoded by the kind's own typed decoder
    frame 2.. extra binary frames: token ids as little-endian int32 bytes,
              block keys as concatenated 32-byte keys

Requests carry an ``id`` chosen by the client; every reply repeats it. A
reply is `Kind.OK` with a ``r`` result map, or `Kind.ERROR` with a stable
``code`` (`Code`) and a human ``msg``. The daemon may also push
`Kind.NOTICE` messages (pressure notifications) with ``id`` 0.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "INT64_MIN",
    "MAX_BATCH_OPS",
    "MAX_FRAMES",
    "MAX_KEYS",
    "MAX_MESSAGE_BYTES",
    "MAX_NAME_LEN",
    "MAX_TOKENS",
    "PROTOCOL_VERSION",
    "UINT64_MAX",
    "Code",
    "Kind",
    "ProtocolError",
]

PROTOCOL_VERSION: Final = 4

#: A message (all frames together) larger than this is refused with TOO_LARGE.
#: The daemon sets ZMQ_MAXMSGSIZE above it so that zmq never drops silently.
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
#: Most tokens in one token frame (16 Mi tokens of int32 = 64 MiB).
MAX_TOKENS: Final = MAX_MESSAGE_BYTES // 4
#: Most block keys in one keys frame (4 MiB of 32-byte keys: 2 Mi tokens at
#: block size 16), so that splitting one frame stays a few milliseconds.
MAX_KEYS: Final = 128 * 1024
#: Most operations in one batch.
MAX_BATCH_OPS: Final = 4096
#: Most frames in one message: kind, body, the batch's shared token frame and
#: one keys frame per operation.
MAX_FRAMES: Final = MAX_BATCH_OPS + 3
#: Longest sequence id, client name, namespace, pool name or adapter name.
MAX_NAME_LEN: Final = 256

#: The range of a msgpack integer field (int64 and uint64 together).
INT64_MIN: Final = -(2**63)
UINT64_MAX: Final = 2**64 - 1


class Kind(enum.IntEnum):
    """The one-byte message kind in frame 0."""

    HELLO = 0x01
    HEARTBEAT = 0x02
    GOODBYE = 0x03
    ALLOCATE = 0x10
    COMMIT = 0x11
    APPEND = 0x12
    FORK = 0x13
    TRUNCATE = 0x14
    FREE = 0x15
    PIN = 0x16
    UNPIN = 0x17
    CAN_ALLOCATE = 0x18
    LOOKUP = 0x19
    GRANT = 0x1A
    PUBLISH = 0x1B
    RELEASE = 0x1C
    BATCH = 0x1F
    STATS = 0x20
    CHECK = 0x21
    FLUSH = 0x22
    CLIENTS = 0x23
    POOLS = 0x24
    PING = 0x25
    OK = 0x80
    ERROR = 0x81
    NOTICE = 0x82


class Code(enum.StrEnum):
    """Stable error codes: one per condition, counted per code in stats."""

    #: The pool cannot serve the blocks (or the reservation) now; nothing changed.
    OUT_OF_BLOCKS = "OUT_OF_BLOCKS"
    #: The session's or namespace's hard quota would be exceeded; nothing changed.
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"
    #: The sequence, pin or pool does not exist (or belongs to another session).
    NOT_FOUND = "NOT_FOUND"
    #: A sequence with that id already exists in this session.
    EXISTS = "EXISTS"
    #: A field is missing, of the wrong type, or out of range.
    INVALID = "INVALID"
    #: The message or a list in it is larger than the daemon accepts.
    TOO_LARGE = "TOO_LARGE"
    #: Frame 0 is not a known request kind.
    UNKNOWN_KIND = "UNKNOWN_KIND"
    #: The client speaks another protocol version.
    VERSION = "VERSION"
    #: The client's expected pool layout or hash seed differs from the daemon's.
    MISMATCH = "MISMATCH"
    #: No session for this connection: the daemon restarted, the lease
    #: expired, or no hello was sent. Old sequences are gone; re-attach.
    SESSION_LOST = "SESSION_LOST"
    #: The operation is not allowed for this session (namespace, admin op).
    FORBIDDEN = "FORBIDDEN"
    #: The session sends faster than its configured request rate.
    RATE_LIMITED = "RATE_LIMITED"
    #: The daemon is overloaded; retry later.
    BUSY = "BUSY"
    #: This host cannot serve what was asked (a memory backend without its runtime).
    UNSUPPORTED = "UNSUPPORTED"
    #: The daemon is draining for shutdown; no new work is accepted.
    SHUTTING_DOWN = "SHUTTING_DOWN"
    #: A bug in the daemon: the request was rolled back and logged.
    INTERNAL = "INTERNAL"


class ProtocolError(Exception):
    """A message could not be decoded; carries the stable code for the reply."""

    def __init__(self, code: Code, message: str, req_id: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.req_id = req_id
