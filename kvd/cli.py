"""``kvd``: run the daemon in the foreground.

    kvd [--config FILE] [--address ADDR] [--log-level L] [--log-format F]
        [--set KEY=VALUE ...] [--print-config]

Configuration: the embedded defaults, then FILE (or ``$KVD_CONFIG``), then
``KVD_*`` environment variables, then these flags (see `kvd.config`).
A configuration or start-up failure prints one line to standard error and
exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import anyio

import kvd
from kvd.config import Config, load_config
from kvd.errors import DaemonError
from kvd.log import configure_logging
from kvd.server.daemon import Daemon

__all__ = ["main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``argv`` without the program name)."""
    parser = argparse.ArgumentParser(
        prog="kvd", description="Node-local KV-cache daemon (runs in the foreground)."
    )
    parser.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        default=os.environ.get("KVD_CONFIG"),
        help="TOML configuration file (default: $KVD_CONFIG, else the embedded defaults)",
    )
    parser.add_argument("--address", metavar="ADDR", help="endpoint, e.g. ipc:///run/kvd/kvd.sock")
    parser.add_argument("--log-level", metavar="LEVEL", help="debug, info, warning, error")
    parser.add_argument("--log-format", metavar="FMT", help="auto, json or console")
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override any key by its dotted name (repeatable), e.g. server.lease_ms=3000",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective config as JSON and exit"
    )
    parser.add_argument("--version", action="version", version=f"kvd {kvd.__version__}")
    return parser.parse_args(argv)


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DaemonError(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    for key, value in (
        ("server.address", args.address),
        ("log.level", args.log_level),
        ("log.format", args.log_format),
    ):
        if value is not None:
            out[key] = value
    return out


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config, overrides=_overrides(args))


def _apply_logging(config: Config) -> None:
    configure_logging(config.log.level, config.log.format)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the daemon; returns the exit status (0 after a clean stop, 1 on failure)."""
    args = parse_args(argv)
    try:
        config = _load(args)
        if args.print_config:
            print(json.dumps(config.to_dict(), indent=2))
            return 0
        _apply_logging(config)
        daemon = Daemon(
            config,
            reload=(lambda: _load(args)) if args.config else None,
            on_log_config=_apply_logging,
            own_process=True,
        )
        anyio.run(daemon.run)
    except DaemonError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a signal before the handlers were installed
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
