"""kvd.log: JSON lines off a terminal, console on one, level filtering, stdlib routing."""

from __future__ import annotations

import io
import json
import logging
import os
import select
from collections.abc import Iterator
from datetime import datetime

import pytest
import structlog

from kvd.log import configure_logging, get_logger


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def _lines(buf: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_lines_when_stream_is_not_a_terminal() -> None:
    buf = io.StringIO()
    configure_logging("info", "auto", stream=buf)
    get_logger("kvd.test").info("pool_ready", pool="p0", blocks=8)

    (line,) = _lines(buf)
    assert line["event"] == "pool_ready"
    assert line["level"] == "info"
    assert line["logger"] == "kvd.test"
    assert line["pool"] == "p0"
    assert line["blocks"] == 8
    stamp = datetime.fromisoformat(str(line["timestamp"]))
    assert stamp.utcoffset() is not None and stamp.utcoffset().total_seconds() == 0  # type: ignore[union-attr]


def test_console_rendering_on_a_terminal() -> None:
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as tty, os.fdopen(leader, "rb", buffering=0) as reader:
        configure_logging("info", "auto", stream=tty)
        get_logger("kvd.test").info("pool_ready", pool="p0")
        assert select.select([reader], [], [], 5)[0], "nothing written to the terminal"
        out = reader.read(4096).decode()
    assert "pool_ready" in out
    assert "pool" in out and "p0" in out
    assert not out.lstrip().startswith("{")


def test_level_filters_lower_levels() -> None:
    buf = io.StringIO()
    configure_logging("warning", "json", stream=buf)
    log = get_logger("kvd.test")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [line["event"] for line in _lines(buf)] == ["w", "e"]


def test_reconfiguring_changes_the_level_of_a_logger_already_used() -> None:
    buf = io.StringIO()
    configure_logging("info", "json", stream=buf)
    log = get_logger("kvd.test")
    log.debug("hidden")
    log.info("shown")
    configure_logging("debug", "json", stream=buf)
    log.debug("now shown")
    assert [line["event"] for line in _lines(buf)] == ["shown", "now shown"]


def test_configuring_twice_writes_each_line_once() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "json", stream=first)
    configure_logging("info", "json", stream=second)
    get_logger("kvd.test").info("once")
    logging.getLogger("some.library").warning("stdlib once")
    assert first.getvalue() == ""
    assert [line["event"] for line in _lines(second)] == ["once", "stdlib once"]


def test_stdlib_records_are_rendered_like_structlog_ones() -> None:
    buf = io.StringIO()
    configure_logging("info", "json", stream=buf)
    logging.getLogger("anyio.x").info("hello %s", "world")
    logging.getLogger("anyio.x").debug("filtered")

    (line,) = _lines(buf)
    assert line["event"] == "hello world"
    assert line["level"] == "info"
    assert line["logger"] == "anyio.x"
    assert "timestamp" in line


def test_exceptions_are_rendered_into_the_json_line() -> None:
    buf = io.StringIO()
    configure_logging("info", "json", stream=buf)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger("kvd.test").exception("handler_failed")
    (line,) = _lines(buf)
    assert line["level"] == "error"
    assert "RuntimeError: boom" in str(line["exception"])


@pytest.mark.parametrize(("level", "fmt"), [("verbose", "json"), ("info", "xml")])
def test_bad_settings_are_refused_and_keep_the_previous_configuration(level: str, fmt: str) -> None:
    buf = io.StringIO()
    configure_logging("info", "json", stream=buf)
    with pytest.raises(ValueError, match="unknown log"):
        configure_logging(level, fmt, stream=io.StringIO())  # type: ignore[arg-type]
    get_logger("kvd.test").info("still here")
    assert [line["event"] for line in _lines(buf)] == ["still here"]


def test_level_names_are_case_insensitive() -> None:
    buf = io.StringIO()
    configure_logging("ERROR", "json", stream=buf)
    get_logger("kvd.test").warning("w")
    get_logger("kvd.test").error("e")
    assert [line["event"] for line in _lines(buf)] == ["e"]
