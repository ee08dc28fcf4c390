"""`dissoc get` shows a progress bar when stderr is a terminal, and none otherwise."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    rows = 1 << 20
    batch = pa.record_batch([pa.array(np.arange(rows))], names=["id"])
    path = tmp_path / "p.arrow"
    with pa.ipc.new_file(path, batch.schema) as w:
        for _ in range(48):
            w.write_batch(batch)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dissoc.cli", "serve", str(path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    yield info
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)


def test_progress_bar_on_a_terminal(served: dict[str, str]) -> None:
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dissoc.cli", "get", served["uri"], served["ticket"]],
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    out, _ = proc.communicate(timeout=30)
    os.close(master)
    assert proc.returncode == 0
    summary = json.loads(out)
    assert summary["batches"] == 48
    lines = [part for part in seen.decode().replace("\r", "\n").split("\n") if "batches" in part]
    assert lines, f"no progress line on the terminal: {seen!r}"
    counts = [int(line.split()[0]) for line in lines]
    assert max(counts) > 0 and counts == sorted(counts), counts


def test_no_progress_bar_when_stderr_is_not_a_terminal(served: dict[str, str]) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "dissoc.cli", "get", served["uri"], served["ticket"]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0
    assert json.loads(r.stdout)["batches"] == 48
    assert "batches" not in r.stderr
