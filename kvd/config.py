"""The daemon's configuration: one frozen dataclass tree with a default for every key.

Sources, later ones winning: the embedded defaults (the dataclass
defaults below; ``config/kvd.toml`` documents them one for one), a TOML
file, ``KVD_*`` environment variables, command-line overrides.

Environment scheme: ``KVD_<SECTION>__<KEY>=value`` with ``__`` between
path parts, e.g. ``KVD_SERVER__ADDRESS=ipc:///tmp/kvd.sock`` or
``KVD_POOLS__0__NUM_BLOCKS=1024`` (list entries by index). A value is
parsed as a TOML literal (``5000``, ``true``, ``[0.8, 0.9]``) unless the
key is a string, which takes the text as is. Command-line ``--set
server.lease_ms=3000`` uses dotted paths with the same parsing.

Unknown keys and invalid values raise `ConfigError` naming the dotted key.
The config is passed down explicitly; there is no global instance.

What a SIGHUP may change on a running daemon is declared on each field
(``metadata=RELOAD``); `reload_keys` lists them for the reload and for
``kvd-ctl config``. Every other key needs a restart.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar
from urllib.parse import urlsplit

from kvd_client.wire import DTYPE_SIZES, MAX_FORMAT_LEN, PoolLayout
from kvd_client.wire.hashing import DEFAULT_HASH_SEED

from kvd.engine import EVICTION_POLICIES
from kvd.errors import ConfigError
from kvd.memory import BACKENDS
from kvd.memory.mooncake import parse_url as parse_mooncake_url

__all__ = [
    "RELOAD",
    "AdmissionConfig",
    "CacheConfig",
    "Config",
    "EventsConfig",
    "LogConfig",
    "MemoryConfig",
    "MetricsConfig",
    "NamespaceLimits",
    "PoolConfig",
    "RemoteTierConfig",
    "SecurityConfig",
    "ServerConfig",
    "TiersConfig",
    "load_config",
    "reload_keys",
]

#: Field metadata of a key that a SIGHUP applies to the running daemon.
RELOAD: Final = {"reload": True}
_LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
_LOG_FORMATS: Final = ("auto", "json", "console")
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Principal keys of ``security.namespaces`` and ``security.admins`` (names resolved later).
_PRINCIPAL_RE: Final = re.compile(r"^(\*|(uid|gid):[0-9]+|(user|group):[^:\s]+|key:\S{40})$")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _check_endpoint(key: str, address: str, allow_public: bool) -> None:
    """An endpoint is ``ipc://PATH`` or ``tcp://HOST:PORT`` on loopback unless allowed."""
    if address.startswith("ipc://"):
        _require(len(address) > len("ipc://"), key, "ipc:// needs a path")
        return
    _require(
        address.startswith("tcp://"),
        key,
        f"expected ipc://PATH or tcp://HOST:PORT, got {address!r}",
    )
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    _require(port is not None and parts.hostname is not None, key, f"bad tcp endpoint {address!r}")
    host = typing.cast(str, parts.hostname)
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    _require(
        loopback or allow_public,
        key,
        f"{address!r} is not a loopback address (set server.allow_public_tcp = true to allow it)",
    )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The socket, sessions and shutdown."""

    #: Main endpoint; "" means ``ipc://<runtime dir>/kvd.sock``.
    address: str = ""
    #: Optional second endpoint (``tcp://127.0.0.1:PORT``); "" for none.
    tcp_address: str = ""
    #: Allow a non-loopback tcp endpoint (tcp clients still need a listed CURVE key).
    allow_public_tcp: bool = False
    #: The server's CURVE certificate (``zmq.auth`` secret file, mode 0600); needed for tcp.
    curve_secret_key_file: str = ""
    #: Directory of the allowed clients' public CURVE certificates (``*.key``); needed for tcp.
    curve_clients_dir: str = ""
    #: Mode of the ipc socket file; the access control for every request.
    socket_mode: int = 0o660
    #: Mode of the runtime directory the daemon creates for its socket.
    dir_mode: int = 0o770
    #: A session's lease; renewed by any request, a heartbeat or a live pid.
    lease_ms: int = 5000
    #: Leases a session closed by lease expiry (no pid to watch: tcp) keeps its blocks
    #: out of circulation, since its stopped process may still write them; 0 = free at once.
    quarantine_leases: int = 4
    #: How often the pids of same-host clients are checked.
    pid_watch_ms: int = 200
    #: Graceful shutdown budget: drain, close sessions, unlink, within this.
    drain_timeout_s: float = 10.0
    #: How long to wait for a PING answer from a daemon already at the address.
    probe_timeout_ms: int = 300
    #: ZeroMQ high-water marks (messages queued per peer).
    rcvhwm: int = 10000
    sndhwm: int = 10000
    #: Most sessions at once; a hello beyond it gets BUSY. 0 = unlimited.
    max_sessions: int = 1024
    #: A connection that sent no hello this long after it was accepted is shut
    #: down (it holds a descriptor); 0 = never.
    hello_timeout_ms: int = 10000
    #: Growth of the daemon's anonymous memory past which the connections that sent
    #: no complete message while it grew are shut down (an unfinished multipart
    #: message, which libzmq buffers without bound); 0 = off.
    memory_guard_bytes: int = 128 << 20
    #: Reply bytes libzmq may hold for one peer that does not read them; past it the
    #: peer's replies are dropped and its session closed. 0 = no limit.
    max_queued_reply_bytes: int = 16 << 20
    #: Find a local tcp peer's process at its hello (``/proc``) and watch its pid as
    #: an ipc peer's; false: tcp sessions live by lease and quarantine alone.
    tcp_pid_watch: bool = True

    def __post_init__(self) -> None:
        if self.address:
            _check_endpoint("address", self.address, self.allow_public_tcp)
        if self.tcp_address:
            _require(
                self.tcp_address.startswith("tcp://"), "tcp_address", "must be tcp://HOST:PORT"
            )
            _check_endpoint("tcp_address", self.tcp_address, self.allow_public_tcp)
        _require(0 <= self.socket_mode <= 0o777, "socket_mode", "must be a mode like 0o660")
        _require(0 <= self.dir_mode <= 0o777, "dir_mode", "must be a mode like 0o770")
        _require(self.lease_ms > 0, "lease_ms", "must be > 0")
        _require(self.quarantine_leases >= 0, "quarantine_leases", "must be >= 0 (0 = none)")
        _require(self.pid_watch_ms > 0, "pid_watch_ms", "must be > 0")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0")
        _require(self.probe_timeout_ms > 0, "probe_timeout_ms", "must be > 0")
        _require(self.rcvhwm >= 0, "rcvhwm", "must be >= 0 (0 = no limit)")
        _require(self.sndhwm >= 0, "sndhwm", "must be >= 0 (0 = no limit)")
        _require(self.max_sessions >= 0, "max_sessions", "must be >= 0 (0 = unlimited)")
        _require(self.hello_timeout_ms >= 0, "hello_timeout_ms", "must be >= 0 (0 = never)")
        _require(self.memory_guard_bytes >= 0, "memory_guard_bytes", "must be >= 0 (0 = off)")
        _require(
            self.max_queued_reply_bytes >= 0,
            "max_queued_reply_bytes",
            "must be >= 0 (0 = no limit)",
        )
        tcp = self.tcp_address or self.address.startswith("tcp://")
        _require(
            not tcp or bool(self.curve_secret_key_file and self.curve_clients_dir),
            "curve_secret_key_file",
            "a tcp endpoint is served only with CURVE: set curve_secret_key_file "
            "and curve_clients_dir",
        )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The prefix cache."""

    #: Seed of the block-hash chain (vLLM's default; must match routers' config).
    hash_seed: str = DEFAULT_HASH_SEED
    #: Which cached block a full pool evicts: "adaptive" (use counts and recency
    #: while that out-hits LRU on a sample of the keys, else LRU's order),
    #: "frequency" (use counts and recency always) or "lru" (vLLM's order).
    eviction: str = "adaptive"

    def __post_init__(self) -> None:
        _require(
            self.eviction in EVICTION_POLICIES,
            "eviction",
            f"must be one of {list(EVICTION_POLICIES)}",
        )


@dataclass(frozen=True, slots=True)
class NamespaceLimits:
    """Hard cap and guaranteed minimum of one namespace, in blocks (0 = none)."""

    quota_blocks: int = 0
    minimum_blocks: int = 0

    def __post_init__(self) -> None:
        _require(self.quota_blocks >= 0, "quota_blocks", "must be >= 0 (0 = no cap)")
        _require(self.minimum_blocks >= 0, "minimum_blocks", "must be >= 0")
        _require(
            not self.quota_blocks or self.minimum_blocks <= self.quota_blocks,
            "minimum_blocks",
            "must not exceed quota_blocks",
        )


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Refuse before anything can run out of memory (applies to every pool)."""

    #: Blocks kept free for the growth of running sequences.
    watermark_blocks: int = 0
    #: Hard cap per session (held + reserved + pinned blocks); 0 = none.
    session_quota_blocks: int = field(default=0, metadata=RELOAD)
    #: Usage fractions whose crossing pushes a pressure notice to clients.
    pressure_thresholds: tuple[float, ...] = field(default=(0.8, 0.9, 0.95), metadata=RELOAD)
    #: Per-namespace caps and minimums: ``[admission.namespaces.NAME]``.
    namespaces: dict[str, NamespaceLimits] = field(default_factory=dict, metadata=RELOAD)

    def __post_init__(self) -> None:
        _require(self.watermark_blocks >= 0, "watermark_blocks", "must be >= 0")
        _require(self.session_quota_blocks >= 0, "session_quota_blocks", "must be >= 0")
        th = self.pressure_thresholds
        _require(
            all(0 < t <= 1 for t in th) and list(th) == sorted(set(th)),
            "pressure_thresholds",
            "must be increasing fractions in (0, 1]",
        )


#: Most tier blocks per pool block of a runtime pool (a bound on a typo, not a tuning).
_MAX_TIER_FACTOR: Final = 64


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """Node-wide memory settings."""

    #: Bytes all pools together may take; a pool set above it is refused. 0 = unlimited.
    budget_bytes: int = field(default=0, metadata=RELOAD)
    #: Bytes every memory place (the shm tmpfs, a GPU) must keep free after the pools.
    headroom_bytes: int = field(default=0, metadata=RELOAD)
    #: Directory of shm pool files (a tmpfs).
    shm_dir: str = "/dev/shm"  # noqa: S108 (the tmpfs itself, not a temp file)
    #: Let a client's hello create a pool for its layout (``create``); else FORBIDDEN.
    runtime_pools: bool = field(default=True, metadata=RELOAD)
    #: Most pools created at runtime that may exist at once (0: none).
    max_runtime_pools: int = field(default=4, metadata=RELOAD)
    #: Largest pool a client may create, in bytes (0: only the budget and headroom limit it).
    runtime_pool_max_bytes: int = field(default=8 << 30, metadata=RELOAD)
    #: Backend of a runtime pool whose hello names none.
    runtime_pool_backend: str = field(default="shm", metadata=RELOAD)
    #: Host tier of each runtime pool, in tier blocks per pool block (0: none):
    #: a pool of N blocks gets a tier of factor * N, budgeted with it.
    runtime_pool_tier_factor: int = 0

    def __post_init__(self) -> None:
        _require(self.budget_bytes >= 0, "budget_bytes", "must be >= 0 (0 = unlimited)")
        _require(self.headroom_bytes >= 0, "headroom_bytes", "must be >= 0")
        _require(self.shm_dir.startswith("/"), "shm_dir", "must be an absolute path")
        _require(self.max_runtime_pools >= 0, "max_runtime_pools", "must be >= 0")
        _require(
            self.runtime_pool_max_bytes >= 0,
            "runtime_pool_max_bytes",
            "must be >= 0 (0 = no cap of its own)",
        )
        _require(
            self.runtime_pool_backend in BACKENDS,
            "runtime_pool_backend",
            f"must be one of {list(BACKENDS)}",
        )
        _require(
            0 <= self.runtime_pool_tier_factor <= _MAX_TIER_FACTOR,
            "runtime_pool_tier_factor",
            f"must be between 0 and {_MAX_TIER_FACTOR}",
        )


#: The pool keys that are its layout (the contract shared with clients).
_LAYOUT_KEYS: Final = (
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "block_size",
    "num_blocks",
    "order",
    "format",
)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool: a model's KV geometry, its block count and where its bytes live."""

    name: str = "default"
    backend: str = "shm"
    num_layers: int = 4
    num_kv_heads: int = 4
    head_dim: int = 64
    dtype: str = "float16"
    block_size: int = 16
    num_blocks: int = 4096
    order: Literal["layer_major", "block_major", "paged"] = "layer_major"
    #: A ``paged`` pool's engine fingerprint (its pages' packing); empty otherwise.
    format: str = ""
    #: Touch every page at start so the first client write is not the slow one.
    prefault: bool = True
    #: Ask for transparent huge pages (MADV_HUGEPAGE) on the daemon's mapping.
    hugepages: bool = False
    #: GPU index of a ``cuda`` pool (ignored by ``shm``).
    device: int = 0
    #: Blocks of the pool's tier 1 in host memory (shm: a segment of its own; cuda:
    #: pinned memory); 0: no tier.
    tier_blocks: int = 0
    #: Keep the pool's committed blocks in the shared remote store (``[tiers.remote]``);
    #: several nodes' pools of one layout share them. With ``tier_blocks`` the
    #: tiers chain: pool -> tier 1 (host) -> tier 2 (remote), every copy tier 1
    #: records written through to the store, and an allocate promotes each block
    #: from tier 1 where it is there, else from the store. Off by default (no
    #: tier at all: tier_blocks 0, remote_tier false).
    remote_tier: bool = False

    def __post_init__(self) -> None:
        _require(bool(_NAME_RE.match(self.name)), "name", "must match [A-Za-z0-9_.-]{1,64}")
        _require(self.backend in BACKENDS, "backend", f"must be one of {list(BACKENDS)}")
        _require(self.dtype in DTYPE_SIZES, "dtype", f"must be one of {sorted(DTYPE_SIZES)}")
        _require(
            self.order in ("layer_major", "block_major", "paged"),
            "order",
            "must be layer_major, block_major or paged",
        )
        _require(
            (self.order == "paged") == bool(self.format) and len(self.format) <= MAX_FORMAT_LEN,
            "format",
            f"a paged pool needs its engine's format (at most {MAX_FORMAT_LEN} characters), "
            "and only a paged pool has one",
        )
        # Engine pages are mapped by CPU engines only (vLLM's CPU KV layout);
        # a device pool's pages would need the engine's device layout (issue #19).
        _require(
            self.order != "paged" or self.backend == "shm", "backend", "a paged pool must be shm"
        )
        for key in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"):
            _require(getattr(self, key) > 0, key, "must be > 0")
        _require(self.device >= 0, "device", "must be a GPU index >= 0")
        _require(self.tier_blocks >= 0, "tier_blocks", "must be >= 0")
        # A cuda pool's remote copies would need a device -> host staging path of their own.
        _require(
            not self.remote_tier or self.backend == "shm",
            "remote_tier",
            "the remote tier copies from shm pools only",
        )

    @property
    def layout(self) -> PoolLayout:
        """The pool's layout (the contract shared with clients)."""
        return PoolLayout(**{key: getattr(self, key) for key in _LAYOUT_KEYS})

    @classmethod
    def of_layout(
        cls, name: str, layout: PoolLayout, *, backend: str, device: int, tier_blocks: int = 0
    ) -> PoolConfig:
        """The config of pool ``name`` for ``layout`` (ConfigError when it is not valid)."""
        return cls(
            name=name,
            backend=backend,
            device=device,
            tier_blocks=tier_blocks,
            **{key: getattr(layout, key) for key in _LAYOUT_KEYS},
        )


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Structured logs (configured by ``kvd.log``)."""

    level: str = field(default="info", metadata=RELOAD)
    #: ``auto``: JSON when stderr is not a terminal, console otherwise.
    format: str = field(default="auto", metadata=RELOAD)

    def __post_init__(self) -> None:
        _require(self.level in _LOG_LEVELS, "level", f"must be one of {list(_LOG_LEVELS)}")
        _require(self.format in _LOG_FORMATS, "format", f"must be one of {list(_LOG_FORMATS)}")


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Prometheus endpoint."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 9464

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, "port", "must be in 0..65535 (0: any free port)")


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV events publisher (vLLM's format) for cluster routers."""

    enabled: bool = False
    endpoint: str = "tcp://127.0.0.1:5557"
    #: "" for no replay socket.
    replay_endpoint: str = "tcp://127.0.0.1:5558"
    #: Event batches kept for replay.
    buffer: int = 10000
    #: Topic frame of each pool's batches; ``{pool}`` becomes the pool's name.
    topic: str = ""

    def __post_init__(self) -> None:
        _require(self.buffer > 0, "buffer", "must be > 0")
        try:
            self.topic.format(pool="p")
        except (KeyError, IndexError, ValueError):
            raise ConfigError("topic", "may only use the {pool} placeholder") from None


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """Tier 2: a store shared by several nodes: Redis (or Valkey, ``kvd.memory.remote``)
    or Mooncake Store (``kvd.memory.mooncake``)."""

    #: ``redis://host:port/db``, or ``mooncake://master:port?metadata=URL&segment_mb=N``;
    #: "" for no remote tier.
    url: str = ""
    #: Most seconds one call to a Redis store may take (connect, read, write); Mooncake's
    #: calls have its own RPC time-outs.
    timeout_s: float = 0.5
    #: After a failed call, seconds in which calls fail at once (misses, counted).
    retry_after_s: float = 5.0
    #: Expiry of stored blocks in seconds (Redis only); 0: none (the server's maxmemory
    #: policy evicts; Mooncake evicts by its own watermarks).
    ttl_s: int = 0
    #: Bytes of remote blocks each pool indexes (the names it can promote).
    max_bytes: int = 1 << 30
    #: Seconds between reads of the names other nodes stored.
    poll_s: float = 0.05

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme if self.url else "redis"
        _require(
            scheme in ("redis", "rediss", "unix", "mooncake"),
            "url",
            "must be redis://, rediss://, unix:// or mooncake://",
        )
        if scheme == "mooncake":
            try:
                parse_mooncake_url(self.url)
            except ValueError as exc:
                _require(False, "url", str(exc))
            _require(self.ttl_s == 0, "ttl_s", "must be 0 with Mooncake (it evicts by itself)")
        for key in ("timeout_s", "retry_after_s", "poll_s"):
            _require(getattr(self, key) > 0, key, "must be > 0")
        _require(self.ttl_s >= 0, "ttl_s", "must be >= 0 (0 = none)")
        _require(self.max_bytes > 0, "max_bytes", "must be > 0")


@dataclass(frozen=True, slots=True)
class TiersConfig:
    """Tiers shared by pools (a pool's host tier is its own ``tier_blocks``)."""

    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Who may use which namespace, how fast and how much (``kvd.server.security``)."""

    #: Bind namespaces to principals: a hello outside its rules gets FORBIDDEN.
    enforce_namespaces: bool = False
    #: Principal (``uid:N``, ``gid:N``, ``user:NAME``, ``group:NAME``, ``key:Z85``, ``*``)
    #: -> namespaces it may open (``NAME``, ``PREFIX*`` or ``*``).
    namespaces: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Principals allowed admin requests other than PING; empty: every connection.
    admins: tuple[str, ...] = ()
    #: Requests per second per session (one shared bucket without a session); 0 = off.
    rate_limit: float = 0.0
    #: Burst of the rate limit, in requests.
    rate_burst: int = 200
    #: Tokens one allocate/append may carry or an allocate/fork reserve; 0 = no limit.
    max_tokens_per_request: int = 0
    #: Sequences one session may hold at once; 0 = no limit.
    max_sequences_per_session: int = 4096
    #: Block references one session may have in pins and holds together; 0 = no limit.
    max_held_blocks_per_session: int = 1 << 20

    def __post_init__(self) -> None:
        for principal, patterns in self.namespaces.items():
            key = f"namespaces.{principal}"
            _require(
                bool(_PRINCIPAL_RE.match(principal)),
                key,
                "bad principal (use uid:N, gid:N, user:NAME, group:NAME, key:Z85 or *)",
            )
            for p in patterns:
                _require("*" not in p[:-1], key, f"bad pattern {p!r} (NAME, PREFIX* or *)")
        for admin in self.admins:
            _require(
                bool(_PRINCIPAL_RE.match(admin)),
                "admins",
                f"bad principal {admin!r} (use uid:N, gid:N, user:NAME, group:NAME, key:Z85 or *)",
            )
        _require(self.rate_limit >= 0, "rate_limit", "must be >= 0 (0 = off)")
        _require(self.rate_burst >= 1, "rate_burst", "must be >= 1")
        _require(self.max_tokens_per_request >= 0, "max_tokens_per_request", "must be >= 0")
        _require(
            self.max_sequences_per_session >= 0,
            "max_sequences_per_session",
            "must be >= 0 (0 = no limit)",
        )
        _require(
            self.max_held_blocks_per_session >= 0,
            "max_held_blocks_per_session",
            "must be >= 0 (0 = no limit)",
        )


def _default_pools() -> tuple[PoolConfig, ...]:
    return (PoolConfig(),)


@dataclass(frozen=True, slots=True)
class Config:
    """The whole configuration."""

    server: ServerConfig = field(default_factory=ServerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    pools: tuple[PoolConfig, ...] = field(default_factory=_default_pools)
    log: LogConfig = field(default_factory=LogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)

    def __post_init__(self) -> None:
        _require(len(self.pools) > 0, "pools", "at least one pool is needed")
        seen: set[str] = set()
        for i, pool in enumerate(self.pools):
            _require(pool.name not in seen, f"pools[{i}].name", f"duplicate pool {pool.name!r}")
            _require(
                not pool.remote_tier or bool(self.tiers.remote.url),
                f"pools[{i}].remote_tier",
                "needs tiers.remote.url",
            )
            seen.add(pool.name)
        remote, guard = self.tiers.remote.url, self.server.memory_guard_bytes
        if remote.startswith("mooncake://") and guard:
            # The segment this daemon lends the store is its own anonymous memory as it
            # fills: past the guard's budget it would look like a hostile client's.
            where = parse_mooncake_url(remote)
            lent = where.segment_bytes + where.buffer_bytes
            _require(
                lent < guard,
                "tiers.remote.url",
                f"segment_mb + buffer_mb ({lent >> 20} MiB) must be below "
                f"server.memory_guard_bytes ({guard >> 20} MiB): lower them or raise the guard",
            )

    def pool(self, name: str) -> PoolConfig:
        """The pool called ``name``; KeyError when there is none."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for ``kvd --print-config`` and stats)."""
        return dataclasses.asdict(self)


def reload_keys() -> frozenset[str]:
    """Dotted names of the keys a SIGHUP applies (fields declared with ``RELOAD``)."""
    hints = typing.get_type_hints(Config)
    return frozenset(
        f"{section.name}.{key.name}"
        for section in dataclasses.fields(Config)
        if dataclasses.is_dataclass(hints[section.name])
        for key in dataclasses.fields(hints[section.name])
        if key.metadata.get("reload")
    )


# --------------------------------------------------------------------------
# Loading


class _Override(str):
    """A value given as text (environment, command line): parsed by the key's type."""

    __slots__ = ()


T = TypeVar("T")


def _parse_override(value: _Override, key: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(key, f"cannot parse {str(value)!r} as a TOML value") from None


def _string_override(value: _Override) -> str:
    """Text for a string key: bare (``block_major``) or TOML-quoted (``"block_major"``)."""
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return str(value)
    return parsed if type(parsed) is str else str(value)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(value, _Override):
        stringly = tp is str or origin is Literal
        value = _string_override(value) if stringly else _parse_override(value, key)
    if tp is bool:
        _require(type(value) is bool, key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        _require(type(value) is int, key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        _require(type(value) in (int, float), key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str or origin is Literal:
        _require(type(value) in (str, _Override), key, f"expected a string, got {value!r}")
        return str(value)
    if origin is tuple:
        _require(type(value) in (list, tuple), key, f"expected an array, got {value!r}")
        (item, _) = typing.get_args(tp)
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _require(type(value) is dict, key, f"expected a table, got {value!r}")
        (_, item) = typing.get_args(tp)
        return {str(k): _convert(item, v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        _require(type(value) is dict, key, f"expected a table, got {value!r}")
        return _build(typing.cast(type[Any], tp), value, key)
    raise AssertionError(f"no converter for {tp!r}")  # a new field type needs one


def _build(cls: type[T], raw: Mapping[str, Any], prefix: str) -> T:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(typing.cast(Any, cls))]
    dot = f"{prefix}." if prefix else ""
    for key in raw:
        _require(key in names, f"{dot}{key}", "unknown key")
    kwargs = {k: _convert(hints[k], raw[k], f"{dot}{k}") for k in names if k in raw}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{dot}{exc.key}" if exc.key else prefix, exc.message) from None


def _set_path(raw: dict[str, Any], path: list[str], value: str, dotted: str) -> None:
    node: Any = raw
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if type(node) is list:
            _require(part.isdigit() and int(part) < len(node), dotted, f"no list entry {part!r}")
            if last:
                node[int(part)] = _Override(value)
            else:
                node = node[int(part)]
            continue
        _require(type(node) is dict, dotted, "is not a table")
        if last:
            node[part] = _Override(value)
        else:
            node = node.setdefault(part, {})


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; anything else (arrays of pools included) replaces."""
    out = dict(base)
    for key, value in top.items():
        if type(value) is dict and type(out.get(key)) is dict:
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _raw(value: Any) -> Any:
    """Defaults as TOML-shaped data (tuples become lists so overrides can index them)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _raw(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_raw(v) for v in value]
    if isinstance(value, dict):
        return {k: _raw(v) for k, v in value.items()}
    return value


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> Config:
    """Defaults, then the TOML file at ``path``, then ``KVD_*`` in ``env``, then ``overrides``.

    ``env`` defaults to ``os.environ``; ``overrides`` maps dotted keys
    (``server.lease_ms``) to text values. Raises ConfigError.
    """
    raw: dict[str, Any] = _raw(Config())
    if path is not None:
        try:
            with Path(path).open("rb") as fh:
                file_raw = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError("", f"cannot read {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("", f"{path} is not valid TOML: {exc}") from None
        raw = _merge(raw, file_raw)
    env = os.environ if env is None else env
    for name in sorted(env):
        if name.startswith("KVD_") and "__" in name:
            parts = name[4:].lower().split("__")
            _set_path(raw, parts, env[name], name)
    for dotted, value in (overrides or {}).items():
        _set_path(raw, dotted.split("."), value, dotted)
    return _build(Config, raw, "")
