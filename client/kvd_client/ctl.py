"""kvd-ctl: look at and operate a running kvd daemon.

Commands: ``stats [section ...]`` (Redis INFO style, ``--json``,
``--watch SECONDS``), ``clients``, ``pools``, ``config`` (the running
config, each key marked ``reload`` when a SIGHUP applies it, else
``restart``), ``flush [--namespace NS]``, ``check``, ``ping``, ``top`` (a
live view; ``--once`` prints one frame).

Exit codes: 0 ok; 1 an error reply, or ``check`` found violated invariants;
2 usage; 3 no daemon answers at the address (the message names it).

Rendering is generic: any nested map of sections prints as ``# Section``
headers and ``key:value`` lines (nested maps flattened with dots), so new
keys in the daemon's payloads show up without a kvd-ctl change.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, TextIO

from kvd_client.client import Client
from kvd_client.errors import DaemonUnavailable, KvdError
from kvd_client.wire import default_address, ipc_path

__all__ = [
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "flatten",
    "format_value",
    "main",
    "render_info",
    "render_top",
]

EXIT_OK: Final = 0
EXIT_ERROR: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNAVAILABLE: Final = 3

#: kvd-ctl waits less than a library client: an operator wants a quick answer.
DEFAULT_TIMEOUT: Final = 2.0


# --------------------------------------------------------------------------
# Rendering (pure functions)


def format_value(value: Any) -> str:
    """One value as text: booleans as 1/0 (like Redis), None empty, lists comma-joined."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return ",".join(format_value(v) for v in value)
    return str(value)


def flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, text)`` pairs of a nested value; lists of maps are indexed."""
    if isinstance(value, Mapping):
        if not value and prefix:
            return [(prefix, "")]
        out: list[tuple[str, str]] = []
        for key, inner in value.items():
            out.extend(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and any(isinstance(v, Mapping) for v in value):
        out = []
        for i, inner in enumerate(value):
            out.extend(flatten(inner, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return [(prefix, format_value(value))]


def _title(name: str) -> str:
    return name[:1].upper() + name[1:]


def _row(item: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={format_value(v)}" for k, v in flatten(item))


def render_info(info: Mapping[str, Any]) -> str:
    """Sections as ``# Section`` + ``key:value`` lines; a list of maps as one ``k=v`` line each.

    Top-level scalars come first, without a header.
    """
    loose: list[str] = []
    blocks: list[str] = []
    for name, value in info.items():
        if isinstance(value, Mapping):
            lines = [f"{k}:{v}" for k, v in flatten(value)]
            blocks.append("\n".join([f"# {_title(str(name))}", *lines]))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            blocks.append("\n".join([f"# {_title(str(name))}", *(_row(v) for v in value)]))
        else:
            loose.append(f"{name}:{format_value(value)}")
    parts = (["\n".join(loose)] if loose else []) + blocks
    return "\n\n".join(parts) + "\n"


def _get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, Mapping):
            return None
        d = d.get(key)
    return d


def _cell(value: Any) -> str:
    return "-" if value is None else format_value(value)


def _usage(blocks: Mapping[str, Any]) -> str:
    used, total = blocks.get("in_use"), blocks.get("total")
    if not isinstance(used, int) or not isinstance(total, int) or total <= 0:
        return "-"
    frac = used / total
    filled = round(frac * 10)
    return f"{'█' * filled}{'·' * (10 - filled)} {frac:6.1%}"


def render_top(stats: Mapping[str, Any], clients: Mapping[str, Any]) -> Any:
    """One frame of ``kvd-ctl top`` (a rich renderable) from STATS and CLIENTS replies.

    Missing keys show as ``-``: the frame never depends on the exact payload.
    """
    from rich.console import Group  # noqa: PLC0415 - rich only for top
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    server = _get(stats, "server") or {}
    rpc = _get(stats, "rpc") or {}
    head = Text.assemble(
        ("kvd ", "bold"),
        f"{_cell(server.get('version'))}  pid {_cell(server.get('pid'))}  ",
        f"epoch {_cell(server.get('epoch'))}  up {_cell(server.get('uptime_s'))}s  ",
        f"{_cell(server.get('state'))}  ",
        f"sessions {_cell(_get(stats, 'clients', 'sessions'))}  ",
        f"rpc {_cell(rpc.get('ops_per_s'))} ops/s  p50 {_cell(rpc.get('latency_p50_us'))}µs  ",
        f"p99 {_cell(rpc.get('latency_p99_us'))}µs",
    )

    pools = Table(title="pools", title_justify="left", expand=True)
    for col in ("pool", "usage", "in use", "evictable", "free", "pinned", "reserved", "total"):
        pools.add_column(col, justify="left" if col in ("pool", "usage") else "right")
    for col in ("seqs", "hit ratio", "queries", "evictions"):
        pools.add_column(col, justify="right")
    names = list(_get(stats, "pools") or {}) or list(_get(stats, "blocks") or {})
    for name in names:
        blocks = _get(stats, "blocks", name) or {}
        prefix = _get(stats, "prefix", name) or {}
        pools.add_row(
            str(name),
            _usage(blocks),
            *(_cell(blocks.get(k)) for k in ("in_use", "evictable", "free", "pinned", "reserved")),
            _cell(blocks.get("total")),
            _cell(_get(stats, "pools", name, "sequences")),
            _cell(prefix.get("hit_ratio")),
            _cell(prefix.get("queries")),
            _cell(prefix.get("evictions")),
        )

    sessions = [s for s in _get(clients, "sessions") or [] if isinstance(s, Mapping)]
    by_ns: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for s in sessions:
        entry = by_ns[(str(s.get("pool", "-")), str(s.get("namespace", "")))]
        entry[0] += 1
        entry[1] += int(s.get("usage_blocks") or 0)
    namespaces = Table(title="namespaces", title_justify="left", expand=True)
    for col in ("pool", "namespace", "sessions", "blocks"):
        namespaces.add_column(col, justify="right" if col in ("sessions", "blocks") else "left")
    for (pool, ns), (count, used) in sorted(by_ns.items()):
        namespaces.add_row(pool, ns or "(default)", str(count), str(used))

    table = Table(title="clients", title_justify="left", expand=True)
    cols = ("id", "name", "pid", "pool", "namespace", "usage_blocks", "requests", "idle_ms")
    for col in cols:
        table.add_column("blocks" if col == "usage_blocks" else col.replace("_", " "))
    for s in sorted(sessions, key=lambda s: -int(s.get("usage_blocks") or 0)):
        table.add_row(*(_cell(s.get(c)) for c in cols))

    refused = _get(stats, "admission", "refusals") or {}
    errors = rpc.get("errors") or {}
    tail = Text.assemble(
        ("refusals ", "bold"),
        " ".join(f"{k}={v}" for k, v in refused.items()) or "none",
        ("   errors ", "bold"),
        " ".join(f"{k}={v}" for k, v in errors.items()) or "none",
    )
    return Group(head, pools, namespaces, table, tail)


# --------------------------------------------------------------------------
# Commands


def _stats(kv: Client, args: argparse.Namespace, out: TextIO) -> int:
    sections = args.sections or None
    count = 0
    while True:
        info = kv.stats(sections)
        if args.json:
            out.write(json.dumps(info, default=format_value) + "\n")
        else:
            if args.watch is not None:
                out.write(f"# kvd-ctl {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            out.write(render_info(info))
        out.flush()
        count += 1
        if args.watch is None or (args.count is not None and count >= args.count):
            return EXIT_OK
        time.sleep(args.watch)


def _info(fetch: Callable[[Client], Mapping[str, Any]]) -> Callable[..., int]:
    def run(kv: Client, args: argparse.Namespace, out: TextIO) -> int:
        info = fetch(kv)
        out.write(json.dumps(info, default=format_value) + "\n" if args.json else render_info(info))
        return EXIT_OK

    return run


def _config(kv: Client, args: argparse.Namespace, out: TextIO) -> int:
    section = kv.stats(["config"])["config"]
    if args.json:
        out.write(json.dumps(section, default=format_value) + "\n")
        return EXIT_OK
    # A key is reloadable when it or the table it belongs to is declared so by the daemon.
    reloadable = set(section["reloadable"])
    for key, value in flatten(section["values"]):
        fate = (
            "reload" if any(key == r or key.startswith(r + ".") for r in reloadable) else "restart"
        )
        out.write(f"{key}:{value}  # {fate}\n")
    return EXIT_OK


def _flush(kv: Client, args: argparse.Namespace, out: TextIO) -> int:
    dropped = kv.flush(args.namespace)
    out.write(json.dumps({"dropped": dropped}) + "\n" if args.json else f"dropped:{dropped}\n")
    return EXIT_OK


def _check(kv: Client, args: argparse.Namespace, out: TextIO) -> int:
    res = kv.check()
    if args.json:
        out.write(json.dumps({"ok": res.ok, "problems": res.problems}) + "\n")
    elif res.ok:
        out.write("ok\n")
    else:
        out.write("".join(f"violated: {p}\n" for p in res.problems))
    return EXIT_OK if res.ok else EXIT_ERROR


def _ping(kv: Client, args: argparse.Namespace, out: TextIO) -> int:
    t0 = time.perf_counter()
    res = kv.ping()
    rtt = (time.perf_counter() - t0) * 1e6
    out.write(f"PONG epoch={res.epoch} protocol={res.version} rtt_us={rtt:.1f}\n")
    return EXIT_OK


def _top(kv: Client, args: argparse.Namespace, out: TextIO) -> int:
    from rich.console import Console  # noqa: PLC0415 - rich only for top
    from rich.live import Live  # noqa: PLC0415

    def frame() -> Any:
        return render_top(kv.stats(), kv.clients())

    if args.once:
        Console(file=out, width=args.width).print(frame())
        return EXIT_OK
    with Live(frame(), console=Console(file=out), auto_refresh=False, screen=False) as live:
        while True:
            time.sleep(args.interval)
            live.update(frame(), refresh=True)


_COMMANDS: Final[dict[str, Callable[[Client, argparse.Namespace, TextIO], int]]] = {
    "stats": _stats,
    "clients": _info(lambda kv: kv.clients()),
    "pools": _info(lambda kv: kv.pools()),
    "config": _config,
    "flush": _flush,
    "check": _check,
    "ping": _ping,
    "top": _top,
}


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvd-ctl", description="Look at and operate a kvd daemon.")
    p.add_argument("--address", help="daemon address (default: $KVD_ADDRESS or the ipc socket)")
    p.add_argument("--timeout", type=_positive, default=DEFAULT_TIMEOUT, help="seconds to wait")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def json_flag(q: argparse.ArgumentParser) -> None:
        q.add_argument("--json", action="store_true", help="print JSON")

    q = sub.add_parser("stats", help="statistics by section (INFO style)")
    q.add_argument("sections", nargs="*", metavar="section")
    json_flag(q)
    q.add_argument("--watch", type=_positive, metavar="SECONDS", help="repeat every SECONDS")
    q.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N reports")
    json_flag(sub.add_parser("clients", help="connected sessions"))
    json_flag(sub.add_parser("pools", help="pools, layouts and usage"))
    json_flag(sub.add_parser("config", help="the running config; which keys SIGHUP applies"))
    q = sub.add_parser("flush", help="drop every evictable cached block")
    q.add_argument("--namespace", help="only this namespace")
    json_flag(q)
    json_flag(
        sub.add_parser("check", help="run the daemon's invariant checks (exit 1 if violated)")
    )
    sub.add_parser("ping", help="is the daemon there?")
    q = sub.add_parser("top", help="live view of pools, namespaces and clients")
    q.add_argument("--once", action="store_true", help="print one frame and exit")
    q.add_argument("--interval", type=_positive, default=1.0, metavar="SECONDS")
    q.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Iterable[str] | None = None, out: TextIO | None = None) -> int:
    """Run kvd-ctl; returns the exit code."""
    out = sys.stdout if out is None else out
    try:
        args = _parser().parse_args(None if argv is None else list(argv))
    except SystemExit as exc:  # argparse: --help exits 0, bad usage 2
        return int(exc.code or 0)
    address = args.address or default_address()
    path = ipc_path(address)
    if path is not None and not path.exists():
        print(f"kvd-ctl: kvd is not running: no socket at {path} ({address})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        kv = Client.connect(address, pool=None, name="kvd-ctl", timeout=args.timeout)
    except ValueError as exc:
        print(f"kvd-ctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _COMMANDS[args.command](kv, args, out)
    except DaemonUnavailable as exc:
        print(f"kvd-ctl: kvd is not running? {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KvdError as exc:
        print(f"kvd-ctl: (error) {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        kv.close()
