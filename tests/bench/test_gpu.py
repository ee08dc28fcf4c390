"""``benchmarks/gpu.py`` cannot be measured without a GPU, so it is kept from rotting here: its ``--fake``
mode runs every path (server subprocesses, device landing, the copy anchor, the report) on the fake device
backend, and must finish with a table and no error row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.ucx, pytest.mark.timeout(180)]  # ucx: its ucx-packed path


def test_gpu_benchmark_runs_every_path_on_the_fake_device() -> None:
    args = ["--fake", "--sizes", "2", "--total-mib", "8", "--repeat", "1", "--json"]
    r = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["fake"] is True
    paths = {e["path"]: e for e in report["results"]}
    assert set(paths) == {
        "cupy-d2d-copy",
        "ucx-packed",
        "cuda-ipc-pairs-zc",
        "cuda-ipc-pairs-copy",
        "partition-2way",
    }
    for entry in paths.values():
        assert "error" not in entry, entry
        assert entry["batches"] == 4 and entry["median_gbps"] > 0
