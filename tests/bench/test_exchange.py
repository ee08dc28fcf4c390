"""``benchmarks/exchange.py`` runs end to end at a tiny size: Spark's shuffle and the tcp exchange path in a
``local[2]`` session (a subprocess, so its Spark session is its own), one timed round, with JSON lines whose
rows and key sums agree; the data in a cached DataFrame, and made by the tasks in Python."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ROWS = 4000

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(180)]

SUMMARY_KEYS = {
    "path",
    "kwargs",
    "median_s",
    "rows",
    "bytes",
    "rows_per_s",
    "gbps",
    "vs_shuffle",
    "vs_memcpy",
}


@pytest.mark.parametrize("source", ["dataframe", "python"])
def test_exchange_benchmark_smoke_run(source: str) -> None:
    argv = [
        sys.executable,
        str(REPO / "benchmarks" / "exchange.py"),
        *("--rows", str(ROWS), "--repeat", "1", "--warmup", "0", "--master", "local[2]"),
        *("--only", "shuffle,tcp", "--json", "--source", source),
    ]
    got = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=170, check=False)
    assert got.returncode == 0, got.stderr[-4000:]
    lines: list[dict[str, Any]] = [json.loads(line) for line in got.stdout.splitlines() if line.strip()]
    setup = next(line for line in lines if line["event"] == "setup")
    assert setup["rows"] == ROWS and setup["bytes"] > 0 and setup["paths"] == ["shuffle", "tcp"]
    assert setup["source"] == source and setup["columns"] == ["k", "v", "x"]
    runs = {line["path"]: line for line in lines if line["event"] == "run"}
    summaries = {line["path"]: line for line in lines if line["event"] == "summary"}
    assert set(summaries) == {"shuffle", "tcp", "memcpy"}
    for name in ("shuffle", "tcp"):
        assert set(summaries[name]) >= SUMMARY_KEYS, summaries[name]
        assert summaries[name]["rows"] == ROWS
        assert runs[name]["rows"] == ROWS
        assert runs[name]["ksum"] == setup["ksum"]
        assert sum(task["rows"] for task in runs[name]["tasks"]) == ROWS
        assert len(runs[name]["tasks"]) == 2
    assert summaries["shuffle"]["vs_shuffle"] == pytest.approx(1.0)
    for task in summaries["tcp"]["report"]:
        assert [peer["path"] for peer in task["peers"]] == ["tcp"]
        assert set(task["seconds"]) >= {"partition", "swap", "fetch", "wait"}
    assert "vs shuffle" in got.stderr and "MISMATCH" not in got.stderr
