"""Hostile clients against a live daemon: the figures of issue #14 beside their goals.

Each scenario starts a fresh daemon (``python -m kvd.cli`` on a temporary ipc://
socket, the tests' 64-block pool) and does what the probe did, with the issue's
sizes; the daemon's memory is read from ``/proc/<pid>/status`` (VmRSS; VmHWM after
resetting it through ``/proc/<pid>/clear_refs``):

1. ``cuda``: a hello creating a pool on ``cuda`` (device 0, then 99) on this host:
   the reply, and whether the daemon lives. Goal: a refusal (UNAVAILABLE,
   UNSUPPORTED or INVALID with the reason), daemon alive.
2. ``flood``: sessions opened one by one (raw ZMTP connections, one hello each)
   with the daemon's RLIMIT_NOFILE at 1024 (``--nofile``) until BUSY or until the
   daemon dies; descriptors per session measured. Goal: BUSY before the
   descriptors run out, daemon alive.
3. ``unfinished``: 1 GiB as 1 MiB frames of one message that never ends. Goal:
   RSS growth <= 160 MiB.
4. ``bomb``: 8 MB and 32 MB msgpack bodies of nested empty arrays. Goal: peak
   growth <= 64 MiB (the time the request thread was held is printed beside it).
5. ``deaf``: 200 clients open sessions, send 40 CLIENTS requests each without ever
   reading a reply, say goodbye and leave; RSS left 5 s later. Goal: <= 64 MiB.
6. ``tcp``: a tcp+CURVE client (its own process) SIGSTOPped past its lease and
   quarantine (200 ms, 2 leases): is its session kept, and do its 40 blocks go to
   another client? Goal: kept, and not handed over.

Run: ``.venv/bin/python -m bench.hostile [--only NAME ...] [--nofile 1024] [--json]``
(``--json`` also writes ``bench/results/hostile.json``). Nothing here asserts; the
tests in ``tests/faults/test_hostile.py`` hold the daemon to the goals with CI sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from kvd_client import wire

from bench._common import RESULTS_DIR, machine
from tests.faults.zmtp import RawPeer

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
TINY_POOL = {
    "pools.0.num_blocks": "64",
    "pools.0.num_layers": "2",
    "pools.0.num_kv_heads": "2",
    "pools.0.head_dim": "16",
    "pools.0.block_size": "16",
    "metrics.enabled": "false",
    "server.drain_timeout_s": "2",
}
LAYOUT = wire.PoolLayout(
    num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", block_size=16, num_blocks=32
)


@dataclass
class Row:
    """One figure: what was measured, the goal, whether it is met."""

    name: str
    value: str
    goal: str
    met: bool
    note: str = ""


class Daemon:
    """A ``kvd`` process on a temporary socket; stopped and cleaned up by `close`."""

    def __init__(self, overrides: dict[str, str] | None = None, nofile: int | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="kvd-h-", dir="/tmp"))
        self.address = f"ipc://{self.dir}/kvd.sock"
        args = [sys.executable, "-m", "kvd.cli", "--address", self.address]
        args += ["--log-format", "json"]
        for key, value in (TINY_POOL | (overrides or {})).items():
            args += ["--set", f"{key}={value}"]
        self.log_path = self.dir / "kvd.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        if nofile is not None:  # before the interpreter is through its imports
            resource.prlimit(self.proc.pid, resource.RLIMIT_NOFILE, (nofile, nofile))
        deadline = time.monotonic() + 30
        while not self.ping(200):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvd did not start: {self.log()[-2000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def call(self, frames: list[bytes], timeout_ms: int = 5000) -> Any:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.address)
            sock.send_multipart(frames, copy=False)
            if not sock.poll(timeout_ms):
                return None
            return wire.decode_reply(sock.recv_multipart())
        finally:
            sock.close(0)

    def ping(self, timeout_ms: int = 2000) -> bool:
        if self.proc.poll() is not None:
            return False
        return isinstance(self.call(wire.PingRequest(id=1).encode(), timeout_ms), wire.OkReply)

    def alive(self) -> str:
        if self.proc.poll() is not None:
            return f"dead (exit {self.proc.returncode})"
        return "alive" if self.ping() else "not answering"

    def sessions(self) -> list[dict[str, Any]]:
        reply = self.call(wire.ClientsRequest(id=1).encode())
        return list(reply.result["info"]["sessions"]) if isinstance(reply, wire.OkReply) else []

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        from kvd.memory.shm import remove_stale
        from kvd.server.transport import instance_id

        remove_stale("/dev/shm", instance_id(self.address))


@contextlib.contextmanager
def daemon(overrides: dict[str, str] | None = None, nofile: int | None = None) -> Iterator[Daemon]:
    d = Daemon(overrides, nofile)
    try:
        yield d
    finally:
        d.close()


def status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def hello(name: str, **fields: Any) -> list[bytes]:
    return wire.HelloRequest(
        id=1, version=wire.PROTOCOL_VERSION, pool="default", name=name, pid=1, **fields
    ).encode()


# -- scenarios ----------------------------------------------------------------------------


def bench_cuda() -> list[Row]:
    rows = []
    for device in (0, 99):
        with daemon() as d:
            reply = d.call(
                wire.HelloRequest(
                    id=5,
                    version=wire.PROTOCOL_VERSION,
                    pool=f"rt-cuda-{device}",
                    name="hostile",
                    pid=1,
                    layout=LAYOUT.to_dict(),
                    create=True,
                    backend="cuda",
                    device=device,
                ).encode()
            )
            state = d.alive()
            got = (
                "no reply"
                if reply is None
                else f"{reply.code}: {reply.msg}"
                if isinstance(reply, wire.ErrorReply)
                else "OK (pool created)"
            )
            ok = isinstance(reply, wire.ErrorReply) and state == "alive"
            rows.append(
                Row(
                    f"hello create cuda device {device}",
                    f"{got}; {state}",
                    "a refusal with the reason; alive",
                    ok,
                )
            )
    return rows


def bench_flood(nofile: int) -> list[Row]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * nofile + 256)), hard))
    with daemon({"server.pid_watch_ms": "100"}, nofile=nofile) as d:
        base_fds = len(os.listdir(f"/proc/{d.pid}/fd"))
        peers: list[RawPeer] = []
        opened = busy = 0
        ended = "BUSY"
        t0 = time.perf_counter()
        try:
            for _ in range(nofile + 16):
                try:
                    peer = RawPeer(d.address, timeout=3.0)
                    peers.append(peer)
                    peer.send_message(hello(f"flood-{len(peers)}"))
                    reply = wire.decode_reply(peer.recv_message())
                except OSError as exc:
                    ended = f"connection {len(peers)}: {type(exc).__name__}"
                    break
                if isinstance(reply, wire.OkReply):
                    opened += 1
                    if opened == 50:
                        fds50 = len(os.listdir(f"/proc/{d.pid}/fd"))
                    continue
                ended = str(reply.code)
                if reply.code == wire.Code.BUSY:
                    busy += 1
                break
            took = time.perf_counter() - t0
            time.sleep(0.5)  # pid-watch sweeps over every pidfd
            state = d.alive()
            tail = [ln for ln in d.log().splitlines() if not ln.startswith("{")][-1:]
        finally:
            for peer in peers:
                peer.close()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    per = (fds50 - base_fds) / 50 if opened >= 50 else float("nan")
    return [
        Row(
            f"sessions before BUSY (RLIMIT_NOFILE {nofile})",
            f"{opened} opened, ended by {ended}; {state}",
            "BUSY before descriptors run out; alive",
            busy > 0 and state == "alive",
            f"{per:.1f} descriptors per session, {base_fds} at start; {took:.1f} s"
            + (f"; last non-JSON log line: {tail[0]!r}" if tail else ""),
        )
    ]


def bench_unfinished(total: int = 1 << 30) -> list[Row]:
    with daemon() as d:
        peer = RawPeer(d.address)
        base = status_mib(d.pid, "VmRSS")
        reset_peak(d.pid)
        chunk, sent, dropped = bytes(MIB), 0, "no"
        t0 = time.perf_counter()
        try:
            peer.send_frame(bytes((wire.Kind.PING,)), more=True)
            while sent < total:
                peer.send_frame_header(len(chunk), more=True)
                peer.send_raw(chunk)
                sent += len(chunk)
            time.sleep(0.3)
        except (BrokenPipeError, ConnectionResetError):
            dropped = f"after {sent // MIB} MiB"
        took = time.perf_counter() - t0
        growth = status_mib(d.pid, "VmHWM") - base
        held = status_mib(d.pid, "VmRSS") - base
        state = d.alive()
        peer.close()
        time.sleep(0.3)
        after_close = status_mib(d.pid, "VmRSS") - base
    return [
        Row(
            f"RSS growth, {total >> 20} MiB unfinished message",
            f"+{growth:.0f} MiB peak, +{held:.0f} MiB held; {state}",
            "<= 160 MiB",
            growth <= 160 and state == "alive",
            f"connection dropped: {dropped}; {took:.1f} s; +{after_close:.0f} MiB after close",
        )
    ]


def nested_empty_arrays(nbytes: int) -> bytes:
    inner = b"\xdc\x40\x00" + b"\x90" * 16384
    n = max(1, nbytes // len(inner))
    return b"\xdc" + n.to_bytes(2, "big") + inner * n


def bench_bomb() -> list[Row]:
    rows = []
    for mb in (8, 32):
        with daemon() as d:
            frames = [bytes((wire.Kind.PING,)), nested_empty_arrays(mb * MIB)]
            d.ping()
            base = status_mib(d.pid, "VmRSS")
            reset_peak(d.pid)
            t0 = time.perf_counter()
            reply = d.call(frames, timeout_ms=60_000)
            took = time.perf_counter() - t0
            growth = status_mib(d.pid, "VmHWM") - base
            state = d.alive()
        got = "no reply" if reply is None else getattr(reply, "code", "OK")
        rows.append(
            Row(
                f"peak growth, {mb} MB msgpack bomb",
                f"+{growth:.0f} MiB; {got}; {state}",
                "<= 64 MiB",
                growth <= 64 and state == "alive",
                f"request thread held {took:.2f} s",
            )
        )
    return rows


def bench_deaf(clients: int = 200, each: int = 40) -> list[Row]:
    with daemon() as d:
        for _ in range(3):
            d.sessions()
        base = status_mib(d.pid, "VmRSS")
        reset_peak(d.pid)
        peers = [RawPeer(d.address) for _ in range(clients)]
        for k, peer in enumerate(peers):
            peer.send_message(hello(f"deaf-{k}"))
        req = wire.ClientsRequest(id=3).encode()
        for _ in range(each):
            for peer in peers:
                peer.send_message(req)
        for peer in peers:
            peer.send_message(wire.GoodbyeRequest(id=4).encode())
        deadline = time.monotonic() + 120
        while d.sessions() and time.monotonic() < deadline:
            time.sleep(0.1)
        peak = status_mib(d.pid, "VmHWM") - base
        for peer in peers:
            peer.close()
        time.sleep(5.0)
        left = status_mib(d.pid, "VmRSS") - base
        state = d.alive()
    return [
        Row(
            f"RSS left after {clients} non-reading clients left",
            f"+{left:.0f} MiB; {state}",
            "<= 64 MiB",
            left <= 64 and state == "alive",
            f"+{peak:.0f} MiB peak while their replies queued ({each} CLIENTS each)",
        )
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Agent:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "faults" / "curve_agent.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def do(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def bench_tcp() -> list[Row]:
    keys = Path(tempfile.mkdtemp(prefix="kvd-h-keys-"))
    allowed = keys / "allowed"
    allowed.mkdir()
    _, server_secret = zmq.auth.create_certificates(keys, "server")
    public, client_secret = zmq.auth.create_certificates(keys, "client")
    Path(server_secret).chmod(0o600)
    (allowed / "client.key").write_bytes(Path(public).read_bytes())
    server_pub, _ = zmq.auth.load_certificate(keys / "server.key")
    cpub, csec = zmq.auth.load_certificate(client_secret)
    assert csec is not None
    curve = [server_pub.decode(), cpub.decode(), csec.decode()]
    tcp = f"tcp://127.0.0.1:{_free_port()}"
    overrides = {
        "server.curve_secret_key_file": str(server_secret),
        "server.curve_clients_dir": str(allowed),
        "server.lease_ms": "200",
        "server.quarantine_leases": "2",
        "server.tcp_address": tcp,
    }
    stopped, other = _Agent(), _Agent()
    try:
        with daemon(overrides) as d:
            stopped.do("connect", address=tcp, curve=curve)
            watched = [s.get("peer_pid") for s in d.sessions()] == [stopped.proc.pid]
            stopped.do("allocate", seq="s", tokens=list(range(40 * 16)))
            stopped.do("commit", seq="s", n=8 * 16)
            stopped.proc.send_signal(signal.SIGSTOP)
            time.sleep(1.5)
            kept = len(d.sessions()) == 1
            other.do("connect", address=d.address)
            theirs = other.do("allocate", seq="o", tokens=list(range(5000, 5000 + 50 * 16)))
            stopped.proc.send_signal(signal.SIGCONT)
            stopped.do("fill", seq="s", start=8 * 16, stop=40 * 16, value=9.0)
            mine = stopped.do("table", seq="s").get("table", [])
            overlap = set(mine) & set(theirs.get("table", []))
            clobbered = 0
            if theirs.get("ok"):
                values = other.do("read", seq="o", start=0, stop=50 * 16)["values"]
                clobbered = sum(1 for v in values if v == 9.0)
            state = d.alive()
    finally:
        stopped.close()
        other.close()
        shutil.rmtree(keys, ignore_errors=True)
    handed = bool(theirs.get("ok")) and bool(overlap)
    return [
        Row(
            "paused tcp client past lease + quarantine",
            f"session {'kept' if kept else 'closed'}; its blocks "
            f"{'handed to another client' if handed else 'kept from others'}; {state}",
            "session kept (watched by pid), blocks not handed over",
            kept and not handed and state == "alive",
            f"identified by pid over tcp: {watched}; other client's allocate: "
            f"{'OK' if theirs.get('ok') else theirs.get('code')}; {len(overlap)} blocks shared, "
            f"{clobbered} of its token positions overwritten by the stopped client",
        )
    ]


SCENARIOS = ("cuda", "flood", "unfinished", "bomb", "deaf", "tcp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--nofile", type=int, default=1024, help="the daemon's RLIMIT_NOFILE")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows: list[Row] = []
    for name in args.only:
        t0 = time.perf_counter()
        if name == "flood":
            got = bench_flood(args.nofile)
        else:
            got = {
                "cuda": bench_cuda,
                "unfinished": bench_unfinished,
                "bomb": bench_bomb,
                "deaf": bench_deaf,
                "tcp": bench_tcp,
            }[name]()
        rows += got
        for row in got:
            print(f"[{'met' if row.met else 'MISSED'}] {row.name}: {row.value}  (goal {row.goal})")
            if row.note:
                print(f"        {row.note}")
        print(f"        ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    met = sum(r.met for r in rows)
    print(f"\n{met}/{len(rows)} goals met on {machine()}")
    if args.json:
        RESULTS_DIR.mkdir(exist_ok=True)
        out = RESULTS_DIR / "hostile.json"
        out.write_text(
            json.dumps({"machine": machine(), "rows": [r.__dict__ for r in rows]}, indent=2)
        )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
