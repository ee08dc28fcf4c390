"""``benchmarks/live.py``: its pure pieces (the stamped batches, the paced producer, the receipts' checks, the
ratios, table and targets) and a tiny run of both systems end to end (the dissoc server, the Flight relay, its
producer and two readers, each a child process), whose JSON must have every row, every batch, sane latencies
and the ratios to the relay."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parents[2]


def _module(name: str) -> ModuleType:
    """``benchmarks.<name>`` (imported by name: the benchmarks are scripts, outside the checked package)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"benchmarks.{name}")


live: Any = _module("live")


# ----------------------------------------------------------------------------------------------------------
# The producer's and the reader's pieces


def test_batches_are_16_kib_fresh_and_numbered() -> None:
    maker = live.BatchMaker()
    t0, first = maker.make(0)
    _, second = maker.make(7)
    assert first.schema == live.SCHEMA and first.num_rows == 1024
    assert first.nbytes == 16 * 1024 == live.BATCH_BYTES
    t0[0] = 123_456  # the stamp, written after the batch is made, is in the batch
    assert first.column(0)[0].as_py() == 123_456
    assert second.column(0)[0].as_py() == 0  # each batch has its own buffer
    assert [first.column(0)[1].as_py(), second.column(0)[1].as_py()] == [0, 7]
    assert first.column(1).equals(second.column(1))


def test_produce_stamps_each_batch_as_it_hands_it_over_and_keeps_the_pace() -> None:
    got: list[tuple[int, int, int]] = []

    def append(batch: pa.RecordBatch) -> None:
        got.append((time.monotonic_ns(), batch.column(0)[0].as_py(), batch.column(0)[1].as_py()))

    before = time.monotonic_ns()
    produced = live.produce(append, 40, 2000.0)  # one every 0.5 ms: at least 19.5 ms from first to last
    assert [seq for _, _, seq in got] == list(range(40))
    assert all(before <= stamp <= now for now, stamp, _ in got)
    assert produced["batches"] == 40 and produced["first_ns"] == got[0][1]
    assert produced["end_ns"] - produced["first_ns"] >= 19_000_000
    assert produced["rate"] <= 2000 * 40 / 39 * 1.01

    got.clear()
    unpaced = live.produce(append, 200, None)
    assert len(got) == 200 and unpaced["rate"] > 5000


def test_receipts_measure_latency_and_refuse_a_gap_or_an_extra_batch() -> None:
    maker = live.BatchMaker()
    receipts = live.Receipts(3)
    t, batch = maker.make(0)
    t[0] = 1_000
    receipts.add(batch, 1_500)
    # A column that starts inside its buffer (an offset) is read from its own first row.
    stamped = pa.array([9, 9, 2_000, 1, 5], type=pa.int64()).slice(2)
    receipts.add(pa.RecordBatch.from_arrays([stamped, stamped], schema=live.SCHEMA), 2_700)
    assert receipts.count == 2 and receipts.latency[:2].tolist() == [500, 700]
    assert (receipts.first_ns, receipts.last_ns) == (1_500, 2_700)
    _, skipped = maker.make(3)
    with pytest.raises(live.BenchmarkError, match="batch 3 arrived where batch 2 was due"):
        receipts.add(skipped, 3_000)

    full = live.Receipts(1)
    full.add(maker.make(0)[1], 10)
    with pytest.raises(live.BenchmarkError):
        full.add(maker.make(1)[1], 20)


def test_scenarios_size_the_latency_runs_by_time_and_cap_them() -> None:
    plan = live.scenarios([1000.0, 100_000.0], [1, 4], seconds=2.0, max_batches=50_000, batches=700)
    assert [(s.name, s.kind, s.readers, s.batches, s.rate) for s in plan] == [
        ("latency 1k/s", "latency", 1, 2000, 1000.0),
        ("latency 100k/s", "latency", 1, 50_000, 100_000.0),
        ("throughput 1 rdr", "throughput", 1, 700, None),
        ("throughput 4 rdr", "throughput", 4, 700, None),
    ]


# ----------------------------------------------------------------------------------------------------------
# Ratios, table and targets


def _row(system: str, scenario: Any, *, p50: float, p99: float, recv: float) -> Any:
    run = live.Run(
        system=system,
        readers=scenario.readers,
        batches=scenario.batches,
        rate=scenario.rate,
        append_rate=recv / scenario.readers,
        received=scenario.batches * scenario.readers,
        recv_rate=recv,
        p50_us=p50,
        p99_us=p99,
        max_us=p99 * 2,
        producer_cpu_us=40.0,
        reader_cpu_us=25.0,
    )
    return live.Row(scenario, system, [run])


def test_ratios_say_how_many_times_lower_the_latency_and_higher_the_throughput() -> None:
    latency = live.Scenario("latency 1k/s", "latency", 1, 1000, 1000.0)
    fan_out = live.Scenario("throughput 4 rdr", "throughput", 4, 500, None)
    wide = live.Scenario("throughput 16 rdr", "throughput", 16, 500, None)
    rows = [
        _row(live.RELAY, latency, p50=400, p99=2000, recv=1000),
        _row(live.DISSOC, latency, p50=100, p99=250, recv=1000),
        _row(live.RELAY, fan_out, p50=9000, p99=20_000, recv=10_000),
        _row(live.DISSOC, fan_out, p50=3000, p99=10_000, recv=15_000),
        _row(live.DISSOC, wide, p50=1, p99=2, recv=3),
        live.Row(wide, live.RELAY, error="error: BenchmarkError: reader 3 received 10 of 500 batches"),
    ]
    assert live.ratio(rows, rows[1], "p50_us") == pytest.approx(4.0)
    assert live.ratio(rows, rows[1], "p99_us") == pytest.approx(8.0)
    assert live.ratio(rows, rows[3], "recv_rate") == pytest.approx(1.5)
    assert live.ratio(rows, rows[0], "p99_us") == pytest.approx(1.0)
    assert live.ratio(rows, rows[4], "recv_rate") is None  # its relay row failed

    checks = live.check_targets(rows)
    assert checks == [
        {"what": "p99 latency, latency 1k/s", "vs_relay": 8.0, "target": live.TARGET_P99, "met": True},
        {"what": "recv/s, throughput 4 rdr", "vs_relay": 1.5, "target": live.TARGET_THROUGHPUT, "met": False},
    ]
    targets = live.format_targets(checks)
    assert "8.00x (met)" in targets and "1.50x (MISSED)" in targets

    lines = live.format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["scenario", "system", "rdrs"]
    dissoc_latency = next(line for line in lines if line.startswith("latency 1k/s") and live.DISSOC in line)
    assert dissoc_latency.split()[-3:] == ["4.00x", "8.00x", "1.00x"]
    assert "100 us" in dissoc_latency and "40/25" in dissoc_latency
    failed = next(line for line in lines if "throughput 16 rdr" in line and live.RELAY in line)
    assert "reader 3 received 10 of 500 batches" in failed


# ----------------------------------------------------------------------------------------------------------
# A tiny run of both systems


@pytest.mark.timeout(180)
def test_a_tiny_run_of_both_systems_has_every_row_and_the_ratios() -> None:
    argv = [
        sys.executable,
        str(REPO / "benchmarks" / "live.py"),
        *("--rates", "2000", "--seconds", "0.05", "--readers", "2", "--batches", "200"),
        *("--repeat", "1", "--warmup", "0", "--timeout", "60", "--json"),
    ]
    got = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=170, check=False)
    assert got.returncode == 0, got.stderr[-4000:]
    report = json.loads(got.stdout)
    rows = {(row["scenario"], row["system"]): row for row in report["rows"]}
    assert list(rows) == [
        ("latency 2k/s", live.RELAY),
        ("latency 2k/s", live.DISSOC),
        ("throughput 2 rdr", live.RELAY),
        ("throughput 2 rdr", live.DISSOC),
    ]
    for (scenario, system), row in rows.items():
        assert row["error"] is None, row
        (run,) = row["runs"]
        assert row["batches"] == (100 if scenario.startswith("latency") else 200)
        assert run["received"] == row["readers"] * row["batches"]
        assert 0 < run["p50_us"] <= run["p99_us"] <= run["max_us"] < 60e6
        assert run["append_rate"] > 0 and run["recv_rate"] > 0
        if scenario.startswith("latency"):
            assert run["append_rate"] <= 2000 * 1.05  # paced, not as fast as it can
        ratios = row["vs_relay"]
        assert set(ratios) == {"p50_us", "p99_us", "recv_rate"}
        if system == live.RELAY:
            assert all(value == pytest.approx(1.0) for value in ratios.values())
        else:
            assert all(value is not None and value > 0 for value in ratios.values())
    (check,) = report["targets"]  # no 4-reader row here: the latency target alone
    assert check["what"] == "p99 latency, latency 2k/s" and check["vs_relay"] > 0
    assert "p99 vs relay" in got.stderr and "targets (dissoc vs the Flight relay" in got.stderr
    assert np.isfinite([row["p99_us"] for row in report["rows"]]).all()
