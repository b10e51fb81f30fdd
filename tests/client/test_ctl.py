"""kvd_client.ctl: rendering, commands against a real ROUTER socket, exit codes."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kvd_client import wire
from kvd_client.ctl import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    flatten,
    main,
    render_info,
    render_top,
)
from rich.console import Console

from .support import Router

StartRouter = Callable[..., Router]

STATS: dict[str, Any] = {
    "server": {"version": "0.1.0", "pid": 42, "epoch": 7, "uptime_s": 1.5, "state": "serving"},
    "pools": {"default": {"num_blocks": 64, "sequences": 2}},
    "blocks": {"default": {"free": 40, "evictable": 8, "in_use": 16, "pinned": 2, "total": 64}},
    "prefix": {"default": {"queries": 10, "hit_ratio": 0.25, "evictions": 3}},
    "clients": {"sessions": 2},
    "admission": {"refusals": {"OUT_OF_BLOCKS": 4}},
    "rpc": {"ops_per_s": 12.5, "latency_p50_us": 80.0, "errors": {"EXISTS": 1}},
}
CLIENTS: dict[str, Any] = {
    "sessions": [
        {
            "id": 1,
            "name": "vllm",
            "pid": 10,
            "pool": "default",
            "namespace": "",
            "usage_blocks": 12,
        },
        {"id": 2, "name": "rl", "pid": 11, "pool": "default", "namespace": "t1", "usage_blocks": 4},
    ]
}


def handler(check_ok: bool = True) -> Callable[[wire.Request], list[list[bytes]]]:
    def handle(req: wire.Request) -> list[list[bytes]]:
        rid = req.id  # type: ignore[attr-defined]
        match req:
            case wire.StatsRequest(sections=None):
                return [wire.encode_ok(rid, wire.InfoResult(info=STATS))]
            case wire.StatsRequest(sections=wanted):
                if set(wanted) - STATS.keys():
                    return [
                        wire.encode_error(
                            rid, wire.Code.INVALID, f"unknown stats sections {wanted}"
                        )
                    ]
                return [wire.encode_ok(rid, wire.InfoResult(info={k: STATS[k] for k in wanted}))]
            case wire.ClientsRequest():
                return [wire.encode_ok(rid, wire.InfoResult(info=CLIENTS))]
            case wire.PoolsRequest():
                return [
                    wire.encode_ok(
                        rid,
                        wire.InfoResult(info={"pools": {"default": {"layout": {"num_layers": 2}}}}),
                    )
                ]
            case wire.CheckRequest():
                problems = [] if check_ok else ["default: free + evictable + in_use != total"]
                return [wire.encode_ok(rid, wire.CheckResult(ok=check_ok, problems=problems))]
            case wire.FlushRequest():
                return [wire.encode_ok(rid, wire.FlushResult(dropped=5))]
            case wire.PingRequest():
                return [wire.encode_ok(rid, wire.PingResult(epoch=7, version=1))]
        raise AssertionError(f"unexpected {req}")

    return handle


def run(address: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["--address", address, *args], out=out)
    return code, out.getvalue()


# -- rendering ------------------------------------------------------------------


def test_flatten_joins_nested_keys_with_dots() -> None:
    value = {"a": {"b": 1, "c": {"d": True}}, "e": [1, 2], "f": None, "g": {}, "h": 0.5}
    assert flatten(value) == [
        ("a.b", "1"),
        ("a.c.d", "1"),
        ("e", "1,2"),
        ("f", ""),
        ("g", ""),
        ("h", "0.5"),
    ]


def test_flatten_indexes_lists_of_maps() -> None:
    assert flatten({"x": [{"a": 1}, {"a": 2}]}) == [("x.0.a", "1"), ("x.1.a", "2")]


def test_render_info_writes_redis_style_sections() -> None:
    text = render_info({"server": {"pid": 42, "new_key": "shown"}, "blocks": {"p": {"free": 3}}})
    assert text == "# Server\npid:42\nnew_key:shown\n\n# Blocks\np.free:3\n"


def test_render_info_puts_loose_scalars_first_and_lists_rows() -> None:
    text = render_info({"sessions": [{"id": 1, "name": "a"}], "dropped": 5})
    assert text == "dropped:5\n\n# Sessions\nid=1 name=a\n"


def _text(renderable: Any) -> str:
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_top_frame_shows_pools_namespaces_clients_and_refusals() -> None:
    text = _text(render_top(STATS, CLIENTS))
    assert "default" in text and "25.0%" in text  # 16 of 64 blocks in use
    assert "t1" in text and "(default)" in text
    assert "vllm" in text and "OUT_OF_BLOCKS=4" in text and "EXISTS=1" in text


def test_top_frame_survives_missing_keys() -> None:
    text = _text(render_top({"blocks": {"p": {"free": 1}}}, {}))
    assert "p" in text and " - " in text


# -- commands ---------------------------------------------------------------------


def test_stats_prints_sections(router: StartRouter) -> None:
    r = router(handler())
    code, out = run(r.address, "stats")
    assert code == EXIT_OK
    assert "# Server\nversion:0.1.0\n" in out and "default.hit_ratio:0.25" in out


def test_stats_of_some_sections_as_json(router: StartRouter) -> None:
    r = router(handler())
    code, out = run(r.address, "stats", "server", "rpc", "--json")
    assert code == EXIT_OK
    assert json.loads(out) == {"server": STATS["server"], "rpc": STATS["rpc"]}
    assert r.requests[-1].sections == ["server", "rpc"]  # type: ignore[attr-defined]


def test_stats_watch_repeats(router: StartRouter) -> None:
    r = router(handler())
    code, out = run(r.address, "stats", "server", "--watch", "0.01", "--count", "2")
    assert code == EXIT_OK
    assert out.count("# Server") == 2 and out.count("# kvd-ctl ") == 2


def test_error_reply_exits_1(router: StartRouter, capsys: pytest.CaptureFixture[str]) -> None:
    r = router(handler())
    code, _ = run(r.address, "stats", "nonsense")
    assert code == EXIT_ERROR
    assert "(error) INVALID: unknown stats sections" in capsys.readouterr().err


def test_check_exits_1_when_invariants_are_violated(router: StartRouter) -> None:
    r = router(handler(check_ok=False))
    code, out = run(r.address, "check")
    assert code == EXIT_ERROR
    assert out == "violated: default: free + evictable + in_use != total\n"


def test_check_ok(router: StartRouter) -> None:
    r = router(handler())
    assert run(r.address, "check") == (EXIT_OK, "ok\n")


def test_flush_a_namespace(router: StartRouter) -> None:
    r = router(handler())
    assert run(r.address, "flush", "--namespace", "t1") == (EXIT_OK, "dropped:5\n")
    assert r.requests[-1] == wire.FlushRequest(id=1, namespace="t1")


def test_clients_and_pools(router: StartRouter) -> None:
    r = router(handler())
    code, out = run(r.address, "clients")
    assert code == EXIT_OK
    assert out.startswith(
        "# Sessions\nid=1 name=vllm pid=10 pool=default namespace= usage_blocks=12\n"
    )
    code, out = run(r.address, "pools")
    assert (code, out) == (EXIT_OK, "# Pools\ndefault.layout.num_layers:2\n")


def test_ping(router: StartRouter) -> None:
    r = router(handler())
    code, out = run(r.address, "ping")
    assert code == EXIT_OK and out.startswith("PONG epoch=7 protocol=1 rtt_us=")


def test_top_once(router: StartRouter) -> None:
    r = router(handler())
    code, out = run(r.address, "top", "--once", "--width", "160")
    assert code == EXIT_OK
    assert "pools" in out and "vllm" in out
    assert [type(q).__name__ for q in r.requests] == ["StatsRequest", "ClientsRequest"]


def test_no_socket_exits_3_naming_the_address(
    ipc_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"ipc://{ipc_dir}/kvd.sock"
    assert run(address, "stats") == (EXIT_UNAVAILABLE, "")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and address in err and "not running" in err


def test_nothing_answering_exits_3_naming_the_address(
    ipc_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = ipc_dir / "kvd.sock"
    path.touch()  # a socket file that nobody serves (a stale one)
    code, _ = run(f"ipc://{path}", "--timeout", "0.2", "ping")
    assert code == EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"ipc://{path}" in err


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == EXIT_USAGE
    assert main(["stats", "--watch", "0"]) == EXIT_USAGE
    assert main(["--address", "nonsense", "ping"]) == EXIT_USAGE
    capsys.readouterr()
