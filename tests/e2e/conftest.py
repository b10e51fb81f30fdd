"""End-to-end fixtures: client processes (``agent.py``) driven step by step."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

AGENT = Path(__file__).with_name("agent.py")
ROOT = Path(__file__).resolve().parents[2]


class AgentProcess:
    """A real client process; `do` sends one command and returns its JSON answer."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def do(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"agent exited with {self.proc.wait()} during {op}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ok(self, op: str, **args: Any) -> dict[str, Any]:
        answer = self.do(op, **args)
        assert answer.pop("ok") is True, (op, answer)
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.close()
                self.proc.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def spawn_agent(kvd_env: dict[str, str]) -> Iterator[Callable[[], AgentProcess]]:
    """Start client processes; all are stopped (killed if need be) at teardown."""
    agents: list[AgentProcess] = []

    def spawn() -> AgentProcess:
        agent = AgentProcess(kvd_env)
        agents.append(agent)
        return agent

    yield spawn
    for agent in agents:
        agent.stop()
