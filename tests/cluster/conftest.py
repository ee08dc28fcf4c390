"""Fixtures of the cluster tests: a cluster of network namespaces, and dissoc agents in its hosts."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.netns import Cluster, Host

AGENT = str(Path(__file__).resolve().parent / "agent.py")
REPO = Path(__file__).resolve().parents[2]


class Agent:
    """A running ``agent.py`` (server or client) in a host, asked with JSON lines."""

    def __init__(self, host: Host, role: str, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.host = host
        self.proc = host.popen(
            [sys.executable, AGENT, role, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info: dict[str, Any] = {}
        if role == "server":
            self.info = self.read(30)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float) -> dict[str, Any]:
        """The agent's next line (a test failure if none comes within ``timeout`` seconds)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"{self.host.name}: the agent said nothing within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"{self.host.name}: the agent exited ({self.proc.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, obj: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
        self.send(obj)
        while True:
            answer = self.read(timeout)
            if "event" not in answer:
                return answer

    def status_until(self, check: Any, timeout: float) -> dict[str, Any]:
        """Ask the server's status until ``check(status)`` holds; the last status (the test asserts on it)."""
        deadline = time.monotonic() + timeout
        status = self.ask({"op": "status"})
        while not check(status) and time.monotonic() < deadline:
            time.sleep(0.2)
            status = self.ask({"op": "status"})
        return status

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "stop"})
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(3) as c:
        yield c
