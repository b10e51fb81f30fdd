"""Access policy: who may use which namespace, how fast and how much; tcp only with CURVE.

The socket file's mode decides who can connect at all (``server.socket_mode``,
0660 in a 0770 directory). Within that, these pieces decide what a
connection may do; each answers the `RequestError` to raise (code +
message) or None, and changes nothing itself, so the dispatcher can refuse
a request before any state moves:

- `NamespacePolicy`: a session's namespace is bound to its identity. On
  ``ipc://`` the identity is the peer's kernel credentials (uid, primary
  gid, from ``SO_PEERCRED`` through libzmq's ``Peer-Address``); on tcp it
  is the client's CURVE public key (the ``User-Id`` the ZAP handler
  answers). Rules map principals (``uid:1000``, ``gid:100``,
  ``user:alice``, ``group:tenant-a``, ``key:<z85>``, ``*``) to the
  namespaces they may open (exact names, ``prefix*`` or ``*``). A hello
  naming any other namespace gets FORBIDDEN. With ``admins`` set, admin
  kinds other than PING need an admin principal.
- `RateLimiter`: a token bucket per session (and one shared bucket for
  requests without a session): O(1) time and memory per session.
  Exhausted: RATE_LIMITED.
- `RequestLimits`: tokens per request and sequences per session: TOO_LARGE.

Supplementary groups are not consulted: ``SO_PEERCRED`` carries the
primary gid only, and reading ``/proc/<pid>/status`` races with pid reuse.

TCP (off by default; loopback unless ``server.allow_public_tcp``) is
served only with ZeroMQ CURVE: `load_server_keys` reads the server's
certificate (a ``zmq.auth`` certificate file that must be private to the
daemon's user, mode 0600), `load_client_keys` the allowed clients' public
certificates, `bind_curve` binds an endpoint as a CURVE server without
touching the endpoints bound before it (libzmq applies these options at
bind time), and `ZapHandler` answers the ZAP requests of that endpoint on
the daemon's own event loop, allowing only the listed client keys.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import stat
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import anyio
import zmq
import zmq.auth
from kvd_client import wire
from zmq.utils import z85

from kvd.errors import ConfigError, RequestError, StartupError
from kvd.server.sessions import PeerCred, parse_peer_address

__all__ = [
    "ZAP_ENDPOINT",
    "CurveKeys",
    "DirCheck",
    "NamespacePolicy",
    "Principal",
    "RateLimiter",
    "RequestLimits",
    "ZapHandler",
    "bind_curve",
    "check_dir",
    "load_client_keys",
    "load_server_keys",
    "principal_of",
]

#: Where libzmq sends ZAP requests (one handler per context).
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"
_ZAP_VERSION: Final = b"1.0"


# --------------------------------------------------------------------------
# Identity


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is on the other end of a connection, as far as the kernel or CURVE vouches."""

    uid: int | None = None
    gid: int | None = None
    #: The client's CURVE public key (z85), on a CURVE endpoint.
    curve_key: str | None = None

    @classmethod
    def of(cls, peer: PeerCred | None, user_id: str | None = None) -> Principal:
        """From ipc credentials and/or a ZAP user id (which is the z85 key)."""
        return cls(
            uid=peer.uid if peer else None,
            gid=peer.gid if peer else None,
            curve_key=user_id or None,
        )

    def names(self) -> tuple[str, ...]:
        """The rule keys that name this principal (``*`` matches everyone)."""
        out = ["*"]
        if self.uid is not None:
            out.append(f"uid:{self.uid}")
        if self.gid is not None:
            out.append(f"gid:{self.gid}")
        if self.curve_key is not None:
            out.append(f"key:{self.curve_key}")
        return tuple(out)

    def __str__(self) -> str:
        parts = [k for k in self.names() if k != "*"]
        return ", ".join(parts) if parts else "anonymous"


def principal_of(frame: zmq.Frame) -> Principal:
    """The principal of a received frame (``copy=False``): Peer-Address, User-Id.

    libzmq sets ``Peer-Address`` to ``"<host>:<uid>:<gid>:<pid>"`` on ipc
    and ``User-Id`` to what the ZAP handler answered; a property that is
    not there reads as absent.
    """
    peer = user_id = None
    with contextlib.suppress(zmq.ZMQError):
        peer = parse_peer_address(str(frame.get("Peer-Address")))
    with contextlib.suppress(zmq.ZMQError):
        user_id = str(frame.get("User-Id"))
    return Principal.of(peer, user_id)


# --------------------------------------------------------------------------
# Namespace policy


def _resolve_key(key: str, where: str) -> str:
    """Canonical rule key: names resolved to ids, everything else checked."""
    kind, sep, value = key.partition(":")
    if key == "*":
        return key
    if not sep or not value:
        raise ConfigError(where, f"bad principal {key!r} (use uid:N, gid:N, user:NAME, ...)")
    if kind in ("uid", "gid"):
        if not value.isdigit():
            raise ConfigError(where, f"{key!r}: {kind} must be a number")
        return f"{kind}:{int(value)}"
    if kind == "user":
        try:
            return f"uid:{pwd.getpwnam(value).pw_uid}"
        except KeyError:
            raise ConfigError(where, f"{key!r}: no such user") from None
    if kind == "group":
        try:
            return f"gid:{grp.getgrnam(value).gr_gid}"
        except KeyError:
            raise ConfigError(where, f"{key!r}: no such group") from None
    if kind == "key":
        if len(value) != 40:
            raise ConfigError(where, f"{key!r}: a CURVE public key is 40 z85 characters")
        return key
    raise ConfigError(where, f"bad principal {key!r} (use uid:N, gid:N, user:NAME, ...)")


def _matches(pattern: str, namespace: str) -> bool:
    if pattern.endswith("*"):
        return namespace.startswith(pattern[:-1])
    return namespace == pattern


@dataclass(frozen=True, slots=True)
class NamespacePolicy:
    """Which principals may open sessions in which namespaces, and who is an admin.

    ``rules``: canonical principal key -> namespace patterns. Not
    ``enforce``: everyone may use every namespace (the socket mode is the
    only control). ``admins`` empty: admin kinds are open to every
    connection.
    """

    rules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    enforce: bool = False
    admins: frozenset[str] = frozenset()

    @classmethod
    def from_config(
        cls,
        rules: Mapping[str, Iterable[str]],
        *,
        enforce: bool,
        admins: Iterable[str] = (),
        key: str = "security",
    ) -> NamespacePolicy:
        """Build from config values; user/group names are resolved now (ConfigError)."""
        resolved: dict[str, tuple[str, ...]] = {}
        for principal, patterns in rules.items():
            canon = _resolve_key(principal, f"{key}.namespaces")
            pats = tuple(patterns)
            for p in pats:
                if not isinstance(p, str) or "*" in p[:-1]:
                    raise ConfigError(
                        f"{key}.namespaces", f"{principal!r}: bad pattern {p!r} (NAME or PREFIX*)"
                    )
            resolved[canon] = resolved.get(canon, ()) + pats
        admin_keys = frozenset(_resolve_key(a, f"{key}.admins") for a in admins)
        return cls(resolved, enforce, admin_keys)

    def check_namespace(self, principal: Principal, namespace: str) -> RequestError | None:
        """None when ``principal`` may open a session in ``namespace``, else FORBIDDEN."""
        if not self.enforce:
            return None
        for key in principal.names():
            for pattern in self.rules.get(key, ()):
                if _matches(pattern, namespace):
                    return None
        return RequestError(
            wire.Code.FORBIDDEN,
            f"namespace {namespace!r} is not allowed for {principal} "
            "(see the daemon's security.namespaces)",
        )

    def check_flush(self, principal: Principal, namespace: str | None) -> RequestError | None:
        """With namespaces enforced and no ``admins`` named (who else could flush),
        FORBIDDEN unless the FLUSH names a namespace ``principal`` may open: one
        tenant must not drop another's cache."""
        if not self.enforce or self.admins:
            return None
        if namespace is None:
            return RequestError(
                wire.Code.FORBIDDEN,
                f"{principal} may flush only a namespace it may open; name one "
                "(or list operators in security.admins)",
            )
        return self.check_namespace(principal, namespace)

    def check_admin(self, principal: Principal, kind: wire.Kind) -> RequestError | None:
        """None when ``principal`` may send admin request ``kind``, else FORBIDDEN."""
        if not self.admins or kind == wire.Kind.PING:
            return None
        if self.admins.intersection(principal.names()):
            return None
        return RequestError(
            wire.Code.FORBIDDEN,
            f"{kind.name} is for operators; {principal} is not in security.admins",
        )


# --------------------------------------------------------------------------
# Rate and size limits


class RateLimiter:
    """Token buckets: ``rate`` requests per second, bursts of up to ``burst``.

    One bucket per key (a session id; None for requests without a
    session, which share one bucket). A key's bucket is two floats; call
    `forget` when the session closes.
    """

    __slots__ = ("_buckets", "burst", "rate")

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self._buckets: dict[Hashable, list[float]] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: Hashable, now: float) -> bool:
        """Take one token from ``key``'s bucket at time ``now``; False when it is empty."""
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = [self.burst - 1.0, now]
            return True
        tokens = bucket[0] + (now - bucket[1]) * self.rate
        tokens = min(tokens, self.burst)
        bucket[1] = now
        if tokens < 1.0:
            bucket[0] = tokens
            return False
        bucket[0] = tokens - 1.0
        return True

    def check(self, key: Hashable, now: float) -> RequestError | None:
        """`allow` as a `RequestError` (RATE_LIMITED) with the time to wait."""
        if self.allow(key, now):
            return None
        wait_ms = (1.0 - self._buckets[key][0]) / self.rate * 1e3
        return RequestError(
            wire.Code.RATE_LIMITED,
            f"more than {self.rate:g} requests/s (burst {self.burst:g}); retry in {wait_ms:.0f} ms",
        )

    def forget(self, key: Hashable) -> None:
        """Drop ``key``'s bucket (its session closed)."""
        self._buckets.pop(key, None)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Size limits below the protocol's own: 0 means no limit beyond the protocol."""

    #: Tokens one allocate/append may carry, and the most an allocate/fork may reserve.
    max_tokens: int = 0
    #: Sequences one session may hold at once.
    max_sequences: int = 0

    def check_request(self, req: wire.Request) -> RequestError | None:
        """TOO_LARGE when ``req`` carries or reserves more tokens than allowed."""
        limit = self.max_tokens
        if not limit:
            return None
        tokens = getattr(req, "tokens", None)
        if tokens is not None and not isinstance(tokens, int) and len(tokens) > limit:
            return RequestError(
                wire.Code.TOO_LARGE, f"{len(tokens)} tokens in one request (limit {limit})"
            )
        reserve = getattr(req, "reserve", None)
        if reserve is not None and reserve > limit:
            return RequestError(wire.Code.TOO_LARGE, f"reserve of {reserve} tokens (limit {limit})")
        return None

    def check_sequences(self, held: int) -> RequestError | None:
        """TOO_LARGE when a session holding ``held`` sequences may not create another."""
        if self.max_sequences and held >= self.max_sequences:
            return RequestError(
                wire.Code.TOO_LARGE,
                f"the session holds {held} sequences (limit {self.max_sequences}); free some",
            )
        return None


# --------------------------------------------------------------------------
# Files the daemon trusts


@dataclass(frozen=True, slots=True)
class DirCheck:
    """What makes a directory unsafe for the socket: ``fatal`` (refuse to start), ``warnings``."""

    fatal: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Nothing to report."""
        return not self.fatal and not self.warnings


def check_dir(path: str | os.PathLike[str]) -> DirCheck:
    """Is ``path`` a safe home for the socket?

    Fatal: it is not a directory, or another user (not root, not the
    daemon's) owns it and could replace the socket file with their own
    daemon's. A warning: others may enter it (only the socket's own mode
    then keeps them out).
    """
    p = Path(path)
    try:
        st = p.lstat()
    except OSError as exc:
        return DirCheck(fatal=(f"{p}: {exc.strerror}",))
    fatal = []
    if not stat.S_ISDIR(st.st_mode):
        fatal.append(f"{p} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        fatal.append(f"{p} is owned by uid {st.st_uid}, not by the daemon's user")
    warnings = []
    if st.st_mode & 0o007:
        warnings.append(f"{p} has mode {stat.S_IMODE(st.st_mode):04o}: others may enter it")
    return DirCheck(tuple(fatal), tuple(warnings))


def _private_file(path: Path, what: str) -> None:
    """Refuse a key file that is not a regular file private to the daemon's user."""
    try:
        st = path.stat()
    except OSError as exc:
        raise StartupError(f"{what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StartupError(f"{what} {path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise StartupError(f"{what} {path} is owned by uid {st.st_uid}, not the daemon's user")
    if st.st_mode & 0o077:
        raise StartupError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0600"
        )


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A CURVE key pair, z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes


def load_server_keys(path: str | os.PathLike[str]) -> CurveKeys:
    """The server's key pair from a ``zmq.auth`` secret certificate (mode 0600); StartupError."""
    file = Path(path)
    _private_file(file, "CURVE secret key file")
    try:
        public, secret = zmq.auth.load_certificate(file)
    except (OSError, ValueError) as exc:
        raise StartupError(f"CURVE secret key file {file}: {exc}") from None
    if not secret:
        raise StartupError(f"CURVE secret key file {file} holds no secret-key")
    return CurveKeys(public, secret)


def load_client_keys(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """The allowed clients' public keys (z85) from the ``*.key`` certificates in ``directory``."""
    path = Path(directory)
    if not path.is_dir():
        raise StartupError(f"CURVE client keys: {path} is not a directory")
    try:
        keys = frozenset(zmq.auth.load_certificates(path))
    except (OSError, ValueError) as exc:
        raise StartupError(f"CURVE client keys in {path}: {exc}") from None
    if not keys:
        raise StartupError(f"CURVE client keys: no *.key certificate in {path}")
    return keys


# --------------------------------------------------------------------------
# CURVE endpoints and their ZAP handler


def bind_curve(sock: zmq.Socket[bytes], address: str, keys: CurveKeys, domain: str = "kvd") -> None:
    """Bind ``address`` as a CURVE server endpoint whose clients ZAP domain ``domain`` vets.

    libzmq copies socket options into an endpoint when it is bound, so
    endpoints bound before keep their mechanism. Bind every plain (ipc)
    endpoint first: the options stay set afterwards (libzmq cannot clear
    ZAP_DOMAIN again), so anything bound later is a CURVE endpoint too,
    failing closed. Raises zmq.ZMQError when the bind fails.
    """
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.bind(address)


class ZapHandler:
    """Answers libzmq's ZAP requests: CURVE clients with a listed key in ``domain``, no one else.

    Bind it (on the daemon's context) before binding any CURVE endpoint:
    without a handler libzmq lets every CURVE client in. ``serve`` runs it
    on the event loop; ``process`` answers what is pending, for tests and
    loops of their own. The User-Id of an allowed connection is the
    client's z85 public key.
    """

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], allowed: Iterable[bytes], domain: str = "kvd"
    ) -> None:
        self.allowed = frozenset(allowed)
        self.domain = domain
        self.accepted = 0
        self.refused = 0
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise StartupError(
                f"cannot start the ZAP handler: {zmq.strerror(exc.errno or 0)}"
            ) from None
        self._sock: zmq.Socket[bytes] | None = sock

    def reply(self, request: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (RFC 27), counting the decision."""
        if len(request) < 6:
            self.refused += 1
            rid = request[1] if len(request) > 1 else b""
            return [_ZAP_VERSION, rid, b"400", b"malformed ZAP request", b"", b""]
        version, rid, domain, _address, _identity, mechanism = request[:6]
        credentials = request[6:]
        ok = (
            version == _ZAP_VERSION
            and domain == self.domain.encode()
            and mechanism == b"CURVE"
            and len(credentials) == 1
            and len(credentials[0]) == 32
            and z85.encode(credentials[0]) in self.allowed
        )
        if not ok:
            self.refused += 1
            return [_ZAP_VERSION, rid, b"400", b"client key not allowed", b"", b""]
        self.accepted += 1
        user_id = z85.encode(credentials[0])
        return [_ZAP_VERSION, rid, b"200", b"OK", user_id, b""]

    def process(self) -> int:
        """Answer every pending request without blocking; how many were answered."""
        sock = self._sock
        assert sock is not None, "closed"
        done = 0
        while True:
            try:
                request = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return done
            sock.send_multipart(self.reply(request))
            done += 1

    async def serve(self) -> None:
        """Answer requests until cancelled (the FD is edge-triggered: drain, then wait)."""
        sock = self._sock
        assert sock is not None, "closed"
        fd = int(sock.getsockopt(zmq.FD))
        while True:
            while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self.process()
            await anyio.wait_readable(fd)

    def stats(self) -> dict[str, int]:
        """Decisions so far (a stats section)."""
        return {"zap_accepted": self.accepted, "zap_refused": self.refused}

    def close(self) -> None:
        """Unbind (idempotent)."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
