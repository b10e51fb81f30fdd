"""kvd.server.security: namespace policy, rate and size limits, key files, CURVE + ZAP on real
sockets, and the modes of the files a real daemon creates."""

from __future__ import annotations

import grp
import os
import pwd
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest
import zmq
import zmq.auth
from kvd_client import Client, DaemonUnavailable, wire
from kvd_client.errors import Forbidden, RateLimited, TooLarge

from kvd.errors import ConfigError, StartupError
from kvd.memory.shm import segment_path
from kvd.server.security import (
    CurveKeys,
    DirCheck,
    NamespacePolicy,
    Principal,
    RateLimiter,
    RequestLimits,
    ZapHandler,
    bind_curve,
    check_dir,
    load_client_keys,
    load_server_keys,
    principal_of,
)
from kvd.server.sessions import PeerCred

ALICE = Principal(uid=1000, gid=100)
BOB = Principal(uid=1001, gid=200)
KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a z85 public key (40 characters)


def _tokens(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32)


# --------------------------------------------------------------------------
# Principals


def test_principal_names_list_every_rule_key_that_matches_it() -> None:
    p = Principal.of(PeerCred(uid=5, gid=6, pid=7), KEY)
    assert p.names() == ("*", "uid:5", "gid:6", f"key:{KEY}")
    assert Principal.of(None).names() == ("*",)
    assert str(Principal.of(None)) == "anonymous"


def test_principal_of_an_ipc_frame_carries_the_kernel_credentials(tmp_path: Path) -> None:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind(f"ipc://{tmp_path}/p.sock")
        dealer.connect(f"ipc://{tmp_path}/p.sock")
        dealer.send(b"x")
        assert router.poll(5000)
        ident = router.recv(copy=False)
        router.recv_multipart()
        assert principal_of(ident) == Principal(os.getuid(), os.getgid(), None)
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


# --------------------------------------------------------------------------
# Namespace policy


def test_an_unenforced_policy_allows_every_namespace() -> None:
    policy = NamespacePolicy.from_config({"uid:1000": ["a"]}, enforce=False)
    assert policy.check_namespace(BOB, "a") is None
    assert policy.check_namespace(Principal(), "anything") is None


def test_an_enforced_policy_allows_only_the_listed_namespaces() -> None:
    policy = NamespacePolicy.from_config({"uid:1000": ["tenant-a"]}, enforce=True)
    assert policy.check_namespace(ALICE, "tenant-a") is None
    denial = policy.check_namespace(BOB, "tenant-a")
    assert denial is not None and denial.code == wire.Code.FORBIDDEN
    assert "uid:1001" in denial.message and "'tenant-a'" in denial.message
    assert policy.check_namespace(ALICE, "tenant-b") is not None
    assert policy.check_namespace(ALICE, "") is not None  # the default namespace too


def test_prefix_patterns_and_group_rules() -> None:
    policy = NamespacePolicy.from_config({"gid:100": ["team-a/*"], "*": [""]}, enforce=True)
    assert policy.check_namespace(ALICE, "team-a/lora-1") is None
    assert policy.check_namespace(ALICE, "team-ab") is not None
    assert policy.check_namespace(BOB, "team-a/lora-1") is not None
    assert policy.check_namespace(BOB, "") is None  # "*" covers everyone


def test_a_curve_key_rule_matches_the_zap_user_id() -> None:
    policy = NamespacePolicy.from_config({f"key:{KEY}": ["remote"]}, enforce=True)
    assert policy.check_namespace(Principal(curve_key=KEY), "remote") is None
    assert policy.check_namespace(Principal(uid=0, gid=0), "remote") is not None


def test_user_and_group_names_are_resolved_at_load() -> None:
    me = pwd.getpwuid(os.getuid()).pw_name
    group = grp.getgrgid(os.getgid()).gr_name
    policy = NamespacePolicy.from_config(
        {f"user:{me}": ["u"], f"group:{group}": ["g"]}, enforce=True
    )
    assert policy.rules == {f"uid:{os.getuid()}": ("u",), f"gid:{os.getgid()}": ("g",)}


@pytest.mark.parametrize(
    "rules",
    [
        {"user:no-such-user-kvd": ["a"]},
        {"group:no-such-group-kvd": ["a"]},
        {"uid:abc": ["a"]},
        {"nobody": ["a"]},
        {"key:short": ["a"]},
        {"uid:1": ["a*b"]},
    ],
)
def test_bad_rules_fail_at_load_naming_the_key(rules: dict[str, list[str]]) -> None:
    with pytest.raises(ConfigError) as err:
        NamespacePolicy.from_config(rules, enforce=True)
    assert err.value.key == "security.namespaces"


def test_admin_kinds_need_an_admin_once_admins_are_set() -> None:
    open_policy = NamespacePolicy.from_config({}, enforce=True)
    assert open_policy.check_admin(BOB, wire.Kind.FLUSH) is None
    policy = NamespacePolicy.from_config({}, enforce=True, admins=["uid:1000"])
    assert policy.check_admin(ALICE, wire.Kind.FLUSH) is None
    denial = policy.check_admin(BOB, wire.Kind.FLUSH)
    assert denial is not None and denial.code == wire.Code.FORBIDDEN
    assert policy.check_admin(BOB, wire.Kind.PING) is None  # liveness stays open


def test_with_namespaces_enforced_and_no_admins_a_flush_names_an_allowed_namespace() -> None:
    policy = NamespacePolicy.from_config({"uid:1000": ["tenant-a"]}, enforce=True)
    assert policy.check_flush(ALICE, "tenant-a") is None
    for namespace in ("tenant-b", None):
        denial = policy.check_flush(ALICE, namespace)
        assert denial is not None and denial.code == wire.Code.FORBIDDEN
    assert NamespacePolicy.from_config({}, enforce=False).check_flush(BOB, None) is None
    # With operators named, check_admin decides who flushes (anything).
    admins = NamespacePolicy.from_config({}, enforce=True, admins=["uid:1001"])
    assert admins.check_flush(BOB, None) is None


# --------------------------------------------------------------------------
# Rate limit


def test_the_rate_limiter_allows_a_burst_then_refuses() -> None:
    limiter = RateLimiter(rate=10, burst=3)
    assert [limiter.allow("s", 100.0) for _ in range(4)] == [True, True, True, False]


def test_the_bucket_refills_at_the_rate_up_to_the_burst() -> None:
    limiter = RateLimiter(rate=4, burst=3)
    for _ in range(3):
        limiter.allow("s", 100.0)
    assert limiter.allow("s", 100.125) is False  # half a token
    assert limiter.allow("s", 100.25) is True  # a whole token after 1/rate s
    assert [limiter.allow("s", 1000.0) for _ in range(4)] == [True, True, True, False]


def test_sessions_have_buckets_of_their_own() -> None:
    limiter = RateLimiter(rate=1, burst=1)
    assert limiter.allow(1, 0.0) and not limiter.allow(1, 0.0)
    assert limiter.allow(2, 0.0)
    limiter.forget(1)
    assert len(limiter) == 1
    assert limiter.allow(1, 0.0)


def test_a_refusal_is_rate_limited_with_the_wait() -> None:
    limiter = RateLimiter(rate=4, burst=1)
    assert limiter.check(None, 0.0) is None
    denial = limiter.check(None, 0.0)
    assert denial is not None and denial.code == wire.Code.RATE_LIMITED
    assert "retry in 250 ms" in denial.message


def test_a_rate_limiter_needs_a_positive_rate_and_a_burst() -> None:
    with pytest.raises(ValueError):
        RateLimiter(rate=0, burst=1)
    with pytest.raises(ValueError):
        RateLimiter(rate=1, burst=0.5)


# --------------------------------------------------------------------------
# Size limits


def test_too_many_tokens_in_one_request_is_too_large() -> None:
    limits = RequestLimits(max_tokens=100)
    assert limits.check_request(wire.AllocateRequest(id=1, seq="s", tokens=_tokens(100))) is None
    denial = limits.check_request(wire.AppendRequest(id=1, seq="s", tokens=_tokens(101)))
    assert denial is not None and denial.code == wire.Code.TOO_LARGE


def test_a_reservation_beyond_the_limit_is_too_large() -> None:
    limits = RequestLimits(max_tokens=100)
    denial = limits.check_request(
        wire.AllocateRequest(id=1, seq="s", tokens=_tokens(1), reserve=10**9)
    )
    assert denial is not None and denial.code == wire.Code.TOO_LARGE
    assert limits.check_request(wire.ForkRequest(id=1, seq="s", child="c", reserve=101)) is not None
    # No size in a commit.
    assert limits.check_request(wire.CommitRequest(id=1, seq="s", n=10**9)) is None


def test_zero_limits_leave_the_protocol_limits_alone() -> None:
    limits = RequestLimits()
    big = wire.AllocateRequest(id=1, seq="s", tokens=_tokens(5000), reserve=2**40)
    assert limits.check_request(big) is None
    assert limits.check_sequences(10**6) is None


def test_a_session_at_its_sequence_limit_cannot_add_one() -> None:
    limits = RequestLimits(max_sequences=2)
    assert limits.check_sequences(1) is None
    denial = limits.check_sequences(2)
    assert denial is not None and denial.code == wire.Code.TOO_LARGE


# --------------------------------------------------------------------------
# Trusted files


def test_a_private_directory_has_no_problems(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir(mode=0o770)
    d.chmod(0o770)
    assert check_dir(d).ok


def test_a_directory_others_can_enter_is_a_warning(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(0o755)
    assert check_dir(d) == DirCheck((), (f"{d} has mode 0755: others may enter it",))


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_directory_owned_by_another_user_is_fatal(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir(mode=0o770)
    os.chown(d, 65534, -1)
    assert check_dir(d).fatal == (f"{d} is owned by uid 65534, not by the daemon's user",)


def test_a_missing_path_or_a_file_is_fatal(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    assert check_dir(missing).fatal == (f"{missing}: No such file or directory",)
    f = tmp_path / "file"
    f.write_text("")
    f.chmod(0o600)
    assert check_dir(f).fatal == (f"{f} is not a directory",)


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    d = tmp_path / "certs"
    d.mkdir()
    zmq.auth.create_certificates(d, "server")
    return d


def test_the_server_key_file_must_be_private(certs: Path) -> None:
    secret = certs / "server.key_secret"
    secret.chmod(0o640)
    with pytest.raises(StartupError, match="must be 0600"):
        load_server_keys(secret)
    secret.chmod(0o600)
    keys = load_server_keys(secret)
    assert len(keys.public) == len(keys.secret) == 40


def test_a_public_certificate_is_no_server_key(certs: Path) -> None:
    public = certs / "server.key"
    public.chmod(0o600)
    with pytest.raises(StartupError, match="holds no secret-key"):
        load_server_keys(public)
    with pytest.raises(StartupError, match="No such file"):
        load_server_keys(certs / "missing")


def test_client_keys_are_the_public_certificates_of_a_directory(tmp_path: Path) -> None:
    d = tmp_path / "clients"
    d.mkdir()
    with pytest.raises(StartupError, match=r"no \*\.key certificate"):
        load_client_keys(d)
    public, _ = zmq.auth.create_certificates(d, "worker")
    assert load_client_keys(d) == {zmq.auth.load_certificate(public)[0]}
    with pytest.raises(StartupError, match="not a directory"):
        load_client_keys(public)


# --------------------------------------------------------------------------
# CURVE on loopback with a ZAP handler


def _zap_request(mechanism: bytes, creds: list[bytes], domain: bytes = b"kvd") -> list[bytes]:
    return [b"1.0", b"7", domain, b"127.0.0.1", b"", mechanism, *creds]


def test_zap_replies_allow_only_listed_curve_keys() -> None:
    ctx = zmq.Context()
    public, _ = zmq.curve_keypair()
    handler = ZapHandler(ctx, [public])
    try:
        raw = zmq.utils.z85.decode(public)
        ok = handler.reply(_zap_request(b"CURVE", [raw]))
        assert ok == [b"1.0", b"7", b"200", b"OK", public, b""]
        other = zmq.utils.z85.decode(zmq.curve_keypair()[0])
        assert handler.reply(_zap_request(b"CURVE", [other]))[2] == b"400"
        assert handler.reply(_zap_request(b"CURVE", [raw], domain=b"x"))[2] == b"400"
        assert handler.reply(_zap_request(b"NULL", []))[2] == b"400"
        assert handler.reply([b"1.0", b"8"])[:3] == [b"1.0", b"8", b"400"]
        assert handler.stats() == {"zap_accepted": 1, "zap_refused": 4}
    finally:
        handler.close()
        ctx.term()


def test_one_zap_handler_per_context() -> None:
    ctx = zmq.Context()
    first = ZapHandler(ctx, [])
    try:
        with pytest.raises(StartupError, match="ZAP handler"):
            ZapHandler(ctx, [])
    finally:
        first.close()
        ctx.term()


class CurveServer:
    """A ROUTER with a plain ipc endpoint and a CURVE tcp endpoint, echoing the User-Id."""

    def __init__(self, workdir: Path, allowed: list[bytes]) -> None:
        self.ctx = zmq.Context()
        self.keys = CurveKeys(*zmq.curve_keypair())
        self.zap = ZapHandler(self.ctx, allowed)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.ipc = f"ipc://{workdir}/s.sock"
        self.router.bind(self.ipc)
        bind_curve(self.router, "tcp://127.0.0.1:*", self.keys)
        self.tcp = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.late_ipc = f"ipc://{workdir}/late.sock"
        self.router.bind(self.late_ipc)  # after the CURVE endpoint: CURVE too
        self._stop = threading.Event()
        self._thread = threading.Thread(target=anyio.run, args=(self._serve,), daemon=True)
        self._thread.start()

    async def _serve(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.zap.serve)
            fd = int(self.router.getsockopt(zmq.FD))
            while not self._stop.is_set():
                while int(self.router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    ident = self.router.recv(copy=False)
                    self.router.recv_multipart()
                    who = principal_of(ident)
                    self.router.send_multipart([ident.bytes, str(who).encode()])
                with anyio.move_on_after(0.02):
                    await anyio.wait_readable(fd)
            tg.cancel_scope.cancel()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.router.close(0)
        self.zap.close()
        self.ctx.term()


@pytest.fixture
def client_keys() -> tuple[bytes, bytes]:
    return zmq.curve_keypair()


@pytest.fixture
def curve_server(tmp_path: Path, client_keys: tuple[bytes, bytes]) -> Iterator[CurveServer]:
    server = CurveServer(tmp_path, [client_keys[0]])
    yield server
    server.close()


def _ask(address: str, keys: tuple[bytes, bytes] | None = None, server: bytes | None = None):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)
    try:
        sock.connect(address)
        sock.send(b"hi")
        return sock.recv().decode() if sock.poll(1500) else None
    finally:
        sock.close(0)


def test_a_listed_client_key_is_served_over_curve_with_its_key_as_user_id(
    curve_server: CurveServer, client_keys: tuple[bytes, bytes]
) -> None:
    answer = _ask(curve_server.tcp, client_keys, curve_server.keys.public)
    assert answer == f"key:{client_keys[0].decode()}"
    assert curve_server.zap.accepted == 1


def test_an_unlisted_client_key_gets_no_connection(curve_server: CurveServer) -> None:
    stranger = zmq.curve_keypair()
    assert _ask(curve_server.tcp, stranger, curve_server.keys.public) is None
    assert curve_server.zap.refused >= 1


def test_a_plain_tcp_client_gets_no_connection(curve_server: CurveServer) -> None:
    assert _ask(curve_server.tcp) is None


def test_the_ipc_endpoint_bound_before_stays_plain(curve_server: CurveServer) -> None:
    assert _ask(curve_server.ipc) == f"uid:{os.getuid()}, gid:{os.getgid()}"
    assert curve_server.zap.accepted == curve_server.zap.refused == 0


def test_an_endpoint_bound_after_the_curve_one_fails_closed(curve_server: CurveServer) -> None:
    assert _ask(curve_server.late_ipc) is None


# --------------------------------------------------------------------------
# What a real daemon creates


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_the_daemon_creates_a_0660_socket_in_a_0770_directory_and_0660_pools(
    start_kvd, kvd_workdir: Path, umask: int
) -> None:
    run_dir = kvd_workdir / "run"
    old = os.umask(umask)
    try:
        daemon = start_kvd(address=f"ipc://{run_dir}/kvd.sock")
    finally:
        os.umask(old)
    modes = {
        "dir": stat.S_IMODE(run_dir.stat().st_mode),
        "socket": stat.S_IMODE((run_dir / "kvd.sock").lstat().st_mode),
        "pool": stat.S_IMODE(segment_path("/dev/shm", daemon.instance, "default").stat().st_mode),
    }
    assert modes == {"dir": 0o770, "socket": 0o660, "pool": 0o660}
    assert check_dir(run_dir).ok


# --------------------------------------------------------------------------
# The policy wired into a real daemon


def _connect(address: str, **kw):  # a short time-out: refusals are answered at once
    return Client.connect(address, name="t", timeout=kw.pop("timeout", 5.0), **kw)


def test_a_hello_outside_the_namespace_rules_is_forbidden_over_ipc(start_kvd) -> None:
    rules = f'{{"uid:{os.getuid()}" = ["mine*"]}}'
    daemon = start_kvd(
        overrides={"security.enforce_namespaces": "true", "security.namespaces": rules}
    )
    with pytest.raises(Forbidden, match="'other' is not allowed for uid:"):
        _connect(daemon.address, namespace="other")
    assert daemon.stats()["clients"]["sessions"] == 0
    with _connect(daemon.address, namespace="mine-1") as kv:
        assert kv.session_id > 0


def test_a_tenant_cannot_flush_another_namespace(start_kvd) -> None:
    rules = f'{{"uid:{os.getuid()}" = ["mine*"]}}'
    daemon = start_kvd(
        overrides={"security.enforce_namespaces": "true", "security.namespaces": rules}
    )
    with _connect(daemon.address, namespace="mine-1") as kv:
        kv.allocate("s", _tokens(32)).commit()
        for namespace in ("other", None):
            reply = daemon.call(wire.FlushRequest(id=1, namespace=namespace))
            assert isinstance(reply, wire.ErrorReply) and reply.code == wire.Code.FORBIDDEN
        keys = kv.block_keys(_tokens(32))
        assert kv.lookup(keys).cached == 2  # nothing was flushed
        reply = daemon.call(wire.FlushRequest(id=2, namespace="mine-1"))
        assert isinstance(reply, wire.OkReply)
        assert kv.lookup(keys).cached == 0


def test_admin_requests_need_an_admin_once_admins_are_set(start_kvd) -> None:
    daemon = start_kvd(overrides={"security.admins": '["uid:4242"]'})
    assert isinstance(daemon.call(wire.PingRequest(id=1)), wire.OkReply)
    reply = daemon.call(wire.StatsRequest(id=2))
    assert isinstance(reply, wire.ErrorReply) and reply.code == wire.Code.FORBIDDEN


def test_a_session_past_its_rate_is_rate_limited(start_kvd) -> None:
    daemon = start_kvd(overrides={"security.rate_limit": "0.5", "security.rate_burst": "3"})
    with _connect(daemon.address) as kv:  # the hello came from the shared bucket
        codes = []
        for i in range(5):
            try:
                kv.allocate(f"s{i}", _tokens(4)).free()
                codes.append("ok")
            except RateLimited:
                codes.append("RATE_LIMITED")
    assert "RATE_LIMITED" in codes and codes[0] == "ok"


def test_request_limits_refuse_too_many_tokens_and_sequences(start_kvd) -> None:
    daemon = start_kvd(
        overrides={
            "security.max_tokens_per_request": "32",
            "security.max_sequences_per_session": "2",
        }
    )
    with _connect(daemon.address) as kv:
        with pytest.raises(TooLarge, match="33 tokens in one request"):
            kv.allocate("big", _tokens(33))
        a = kv.allocate("a", _tokens(8))
        a.fork("b")
        with pytest.raises(TooLarge, match="holds 2 sequences"):
            kv.allocate("c", _tokens(8))
        with pytest.raises(TooLarge, match="holds 2 sequences"):
            a.fork("d")
    assert daemon.check()["ok"] is True


def test_pins_and_holds_past_the_held_limit_are_refused(start_kvd) -> None:
    daemon = start_kvd(overrides={"security.max_held_blocks_per_session": "4"})
    with _connect(daemon.address) as kv:
        seq = kv.allocate("a", _tokens(32))  # two full blocks of the default size 16
        seq.commit()
        seq.pin()
        held = kv.lookup(kv.block_keys(_tokens(32)), hold=True)
        assert held.cached == 2
        with pytest.raises(TooLarge, match="would hold 6 block references"):
            seq.pin()
        with pytest.raises(TooLarge, match="would hold 6 block references"):
            kv.lookup(kv.block_keys(_tokens(32)), hold=True)
        with pytest.raises(TooLarge, match="would hold 5 block references"):
            kv.grant(1)
        assert kv.release(held.hold) == 2
        kv.grant(2)
        stats = daemon.stats()
    assert stats["rpc"]["errors"]["TOO_LARGE"] == 3
    assert daemon.check()["ok"] is True


@pytest.fixture
def curve_certs(tmp_path: Path) -> dict[str, Path]:
    keys = tmp_path / "keys"
    allowed = keys / "allowed"
    allowed.mkdir(parents=True)
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    public, _ = zmq.auth.create_certificates(keys, "client")
    Path(server_secret).chmod(0o600)
    (allowed / "client.key").write_bytes(Path(public).read_bytes())
    zmq.auth.create_certificates(keys, "stranger")
    return {"keys": keys, "server_secret": Path(server_secret), "allowed": allowed}


def _curve(keys: Path, who: str) -> tuple[bytes, bytes, bytes]:
    server_public, _ = zmq.auth.load_certificate(keys / "server.key")
    public, secret = zmq.auth.load_certificate(keys / f"{who}.key_secret")
    assert secret is not None
    return server_public, public, secret


def _tcp_daemon(start_kvd, certs: dict[str, Path], **extra: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tcp = f"tcp://127.0.0.1:{port}"
    daemon = start_kvd(
        overrides={
            "server.tcp_address": tcp,
            "server.curve_secret_key_file": str(certs["server_secret"]),
            "server.curve_clients_dir": str(certs["allowed"]),
            **extra,
        }
    )
    return daemon, tcp


def test_pipelined_tcp_hellos_get_busy_instead_of_holding_descriptors(
    start_kvd, curve_certs: dict[str, Path]
) -> None:
    daemon, tcp = _tcp_daemon(start_kvd, curve_certs)
    server, public, secret = _curve(curve_certs["keys"], "client")
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    for option, value in (
        (zmq.CURVE_SERVERKEY, server),
        (zmq.CURVE_PUBLICKEY, public),
        (zmq.CURVE_SECRETKEY, secret),
    ):
        sock.setsockopt(option, value)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tcp)
    fds = Path(f"/proc/{daemon.proc.pid}/fd")
    before, most = len(list(fds.iterdir())), 0
    hellos = 2000
    try:
        for i in range(1, hellos + 1):
            hello = wire.HelloRequest(
                id=i, version=wire.PROTOCOL_VERSION, pool="default", name="flood", pid=os.getpid()
            )
            sock.send_multipart(hello.encode())
            if i % 100 == 0:
                most = max(most, len(list(fds.iterdir())))
        codes: list[str] = []
        while len(codes) < hellos and sock.poll(10_000):
            reply = wire.decode_reply(sock.recv_multipart())
            codes.append("OK" if isinstance(reply, wire.OkReply) else str(reply.code))
    finally:
        sock.close(0)
    # One lookup per connection at a time: one descriptor more, not one per hello
    # (before: 2,600 more after 3,000 pipelined hellos).
    assert most <= before + 8
    assert len(codes) == hellos and set(codes) <= {"OK", "BUSY"} and "BUSY" in codes
    assert daemon.stats()["rpc"]["errors"]["BUSY"] == codes.count("BUSY")
    assert daemon.check()["ok"] is True


def test_a_listed_curve_client_is_served_over_tcp_and_others_are_not(
    start_kvd, curve_certs: dict[str, Path]
) -> None:
    key = _curve(curve_certs["keys"], "client")[1].decode()
    rules = f'{{"key:{key}" = ["remote"], "*" = [""]}}'
    daemon, tcp = _tcp_daemon(
        start_kvd,
        curve_certs,
        **{"security.enforce_namespaces": "true", "security.namespaces": rules},
    )
    with _connect(tcp, namespace="remote", curve=_curve(curve_certs["keys"], "client")) as kv:
        seq = kv.allocate("s", _tokens(20))
        assert len(seq.block_table) == 2
    with pytest.raises(DaemonUnavailable):
        _connect(tcp, curve=_curve(curve_certs["keys"], "stranger"), timeout=1.0)
    with pytest.raises(DaemonUnavailable):
        _connect(tcp, timeout=1.0)  # plain tcp
    zap = daemon.stats()["security"]
    assert zap["zap_accepted"] >= 1 and zap["zap_refused"] >= 1
    with _connect(daemon.address) as kv:  # the ipc endpoint stays plain
        assert kv.session_id > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_daemon_refuses_a_socket_directory_owned_by_another_user(
    start_kvd, kvd_workdir: Path
) -> None:
    run_dir = kvd_workdir / "theirs"
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, 4242, 4242)
    daemon = start_kvd(address=f"ipc://{run_dir}/kvd.sock", wait=False)
    assert daemon.proc.wait(30) == 1
    assert "owned by uid 4242" in daemon.log()
