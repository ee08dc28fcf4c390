"""Live streams from the command line: ``dissoc serve --live`` (the schema from a file), ``dissoc publish``
feeding it through the Flight plane while ``dissoc get --follow`` writes what arrives, from an offset too;
bad starts are usage errors."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from helpers.e2e import PYTHON, REPO, cli_server

pytest.importorskip("pyarrow.flight")

pytestmark = pytest.mark.timeout(90)


def _dissoc(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "dissoc.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_publish_while_get_follows(tmp_path: Path) -> None:
    first, second = pa.table({"v": list(range(10))}), pa.table({"v": list(range(10, 15))})
    pq.write_table(first, tmp_path / "a.parquet")
    pq.write_table(second, tmp_path / "b.parquet")
    args = ["--flight", "0", "--live", f"ev={tmp_path / 'a.parquet'}", "--live-max-batches", "100"]
    with cli_server(*args, count=1) as (_, (line,)):
        assert line["ticket"] == "ev"
        out_csv = str(tmp_path / "out.csv")
        follower = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "dissoc.cli",
                "get",
                line["uri"],
                "ev",
                "--follow",
                "--no-progress",
                "-o",
                out_csv,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(0.5)  # following before anything was published
            done = _dissoc("publish", line["flight"], "ev", str(tmp_path / "a.parquet"))
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["head"] == 1
            done = _dissoc("publish", line["flight"], "ev", str(tmp_path / "b.parquet"), "--close")
            assert done.returncode == 0, done.stderr
            out, err = follower.communicate(timeout=30)
        finally:
            follower.kill()
        assert follower.returncode == 0, err
        assert json.loads(out)["rows"] == 15
        assert pacsv.read_csv(tmp_path / "out.csv").column("v").to_pylist() == list(range(15))
        got = _dissoc("get", line["uri"], "ev", "--from", "1", "--no-progress")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["rows"] == 5
        late = _dissoc("publish", line["flight"], "ev", str(tmp_path / "b.parquet"))
        assert late.returncode == 1 and "is closed" in late.stderr
    bad = _dissoc("get", "tcp://127.0.0.1:1?want_data=1", "ev", "--from", "soon")
    assert bad.returncode == 2 and "'earliest' or 'latest'" in bad.stderr


def test_serve_defaults_are_the_library_ones() -> None:
    from dissoc import cli
    from dissoc.datasets import live

    assert cli.DEFAULT_LIVE_BATCHES == live.DEFAULT_MAX_BATCHES
    assert cli.DEFAULT_LIVE_MIB << 20 == live.DEFAULT_MAX_BYTES
