"""Typed exceptions of the kvd client: one class per wire `Code`, under `KvdError`.

Every error reply of the daemon becomes the class registered for its code in
`ERRORS` (one table, no other mapping). `DaemonUnavailable` is the client's
own condition (nothing answered at an address within the timeout) and has
the client-only code ``UNAVAILABLE``.

`RefusalError` groups the capacity outcomes (`OutOfBlocks`, `QuotaExceeded`):
the daemon changed nothing and the same request may succeed later.
"""

from __future__ import annotations

from typing import ClassVar, Final

from kvd_client.wire import Code

__all__ = [
    "ERRORS",
    "UNAVAILABLE",
    "AlreadyExists",
    "Busy",
    "DaemonUnavailable",
    "Forbidden",
    "InternalError",
    "InvalidRequest",
    "KvdError",
    "LayoutMismatch",
    "NotFound",
    "OutOfBlocks",
    "QuotaExceeded",
    "RateLimited",
    "RefusalError",
    "SessionLost",
    "ShuttingDown",
    "TooLarge",
    "UnknownKind",
    "Unsupported",
    "VersionMismatch",
    "error_from_reply",
]

#: Code of `DaemonUnavailable`; never sent on the wire.
UNAVAILABLE: Final = "UNAVAILABLE"


class KvdError(Exception):
    """Base of every kvd error; ``code`` is the stable uppercase code."""

    #: The code this class stands for (``code`` of instances may differ only
    #: for a code unknown to this client version, see `error_from_reply`).
    CODE: ClassVar[str] = Code.INTERNAL

    def __init__(self, message: str, *, code: str | None = None) -> None:
        self.code: str = code or type(self).CODE
        self.message = message
        super().__init__(f"{self.code}: {message}")


class RefusalError(KvdError):
    """The daemon cannot serve this now and changed nothing (capacity)."""


class OutOfBlocks(RefusalError):
    """The pool cannot provide the blocks or the reservation now."""

    CODE = Code.OUT_OF_BLOCKS


class QuotaExceeded(RefusalError):
    """The session's or namespace's hard quota would be exceeded."""

    CODE = Code.QUOTA_EXCEEDED


class NotFound(KvdError, LookupError):
    """No such sequence, pin or pool (or it belongs to another session)."""

    CODE = Code.NOT_FOUND


class AlreadyExists(KvdError):
    """A sequence with that id already exists in this session."""

    CODE = Code.EXISTS


class InvalidRequest(KvdError, ValueError):
    """A field is missing, of the wrong type or out of range (checked locally first)."""

    CODE = Code.INVALID


class TooLarge(KvdError, ValueError):
    """The message or a list in it exceeds the daemon's limits."""

    CODE = Code.TOO_LARGE


class UnknownKind(KvdError):
    """The daemon does not know this request kind (an older daemon)."""

    CODE = Code.UNKNOWN_KIND


class VersionMismatch(KvdError):
    """The daemon speaks another protocol version."""

    CODE = Code.VERSION


class LayoutMismatch(KvdError):
    """The expected pool layout or hash seed differs from the daemon's."""

    CODE = Code.MISMATCH


class SessionLost(KvdError):
    """The session is gone (daemon restart, lease expiry): its sequences are gone too.

    The client re-attaches on its next call; sequences and pins of the old
    session raise this on every use.
    """

    CODE = Code.SESSION_LOST


class Forbidden(KvdError):
    """The operation is not allowed for this session."""

    CODE = Code.FORBIDDEN


class RateLimited(KvdError):
    """The session sends faster than its configured request rate."""

    CODE = Code.RATE_LIMITED


class Busy(KvdError):
    """The daemon is overloaded; retry later."""

    CODE = Code.BUSY


class Unsupported(KvdError):
    """This host cannot serve what was asked (e.g. a cuda pool where CUDA is missing)."""

    CODE = Code.UNSUPPORTED


class ShuttingDown(KvdError):
    """The daemon is draining for shutdown and accepts no new work."""

    CODE = Code.SHUTTING_DOWN


class InternalError(KvdError):
    """A bug in the daemon (or a reply this client cannot decode)."""

    CODE = Code.INTERNAL


class DaemonUnavailable(KvdError, ConnectionError):
    """Nothing answered at ``address`` within ``timeout`` seconds."""

    CODE = UNAVAILABLE

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        super().__init__(f"no kvd daemon answered at {address} within {timeout:g} s")


#: The one table from wire code to exception class.
ERRORS: Final[dict[str, type[KvdError]]] = {
    cls.CODE: cls
    for cls in (
        OutOfBlocks,
        QuotaExceeded,
        NotFound,
        AlreadyExists,
        InvalidRequest,
        TooLarge,
        UnknownKind,
        VersionMismatch,
        LayoutMismatch,
        SessionLost,
        Forbidden,
        RateLimited,
        Busy,
        Unsupported,
        ShuttingDown,
        InternalError,
    )
}


def error_from_reply(code: str, message: str) -> KvdError:
    """The exception for an error reply; an unknown code keeps its text on a `KvdError`."""
    cls = ERRORS.get(code)
    if cls is None:
        return KvdError(message, code=code)
    return cls(message)
