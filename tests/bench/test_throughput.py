"""The pure pieces of ``benchmarks/throughput.py`` (the benchmark itself is run by hand, not here): the
``spark`` workload's dataset, the batch-size sweep, CPU accounting and its table column, and ``--plot``."""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa
import pytest

REPO = Path(__file__).resolve().parents[2]


def _module(name: str) -> ModuleType:
    """``benchmarks.<name>`` (imported by name: the benchmarks are scripts, outside the checked package)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(f"benchmarks.{name}")


anchors: Any = _module("_anchors")
throughput: Any = _module("throughput")

SPARK_TYPES = [
    pa.int64(),
    pa.int32(),
    pa.float64(),
    pa.float32(),
    pa.utf8(),
    pa.bool_(),
    pa.timestamp("us"),
    pa.date32(),
    pa.int64(),
    pa.utf8(),
]


def _result(path: str, workload: str = "spark", **fields: Any) -> Any:
    result = anchors.Measurement(path, workload, payload_bytes=2_000_000_000, num_batches=100)
    result.seconds = [1.0, 2.0, 1.5]
    for name, value in fields.items():
        setattr(result, name, value)
    return result


# ----------------------------------------------------------------------------------------------------------
# The spark workload and the sweep


def test_spark_dataset_has_ten_mixed_columns_and_every_row(tmp_path: Path) -> None:
    workload = anchors.Workload("spark", 10, 2000, 3, kind="spark")
    dataset = anchors.write_dataset(tmp_path, workload)
    reader = pa.ipc.open_file(pa.memory_map(str(dataset.path)))
    assert reader.schema.types == SPARK_TYPES
    batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    assert len(batches) == dataset.num_batches == 3
    assert sum(b.num_rows for b in batches) == dataset.num_rows == 6000
    assert sum(b.nbytes for b in batches) == dataset.payload_bytes == workload.payload_bytes
    first = batches[0]
    assert 0.05 < first.column("price").null_count / 2000 < 0.15
    assert 0 < first.column("comment").null_count < 200
    assert first.column("category").null_count == 0
    assert all(b.equals(first) for b in batches)


def test_spark_batch_is_deterministic_and_in_every_table() -> None:
    assert anchors.spark_batch(500).equals(anchors.spark_batch.__wrapped__(500))
    for table in (anchors.WORKLOADS, anchors.QUICK_WORKLOADS):
        spark = table["spark"]
        assert (spark.kind, spark.columns, spark.rows_per_batch) == ("spark", 10, 10_000)
    assert anchors.QUICK_WORKLOADS["spark"].num_batches < anchors.WORKLOADS["spark"].num_batches
    assert "mixed cols" in anchors.QUICK_WORKLOADS["spark"].describe()


def test_sweep_runs_from_16_kib_to_64_mib_batches_with_similar_totals() -> None:
    sweep = anchors.sweep_workloads(quick=True)
    assert [w.batch_bytes for w in sweep] == [16 << 10, 256 << 10, 2 << 20, 16 << 20, 64 << 20]
    assert all(w.num_batches >= 2 for w in sweep)
    assert all(w.payload_bytes <= 2 * anchors.QUICK_SWEEP_BYTES for w in sweep)
    assert len({w.name for w in sweep}) == len(sweep)
    assert not {w.name for w in sweep} & set(anchors.WORKLOADS)  # 'all' does not run the sweep


# ----------------------------------------------------------------------------------------------------------
# CPU accounting


def test_cpu_between_prefers_thread_runtimes_and_falls_back_to_ticks() -> None:
    sample = anchors.CpuSample
    fine_before = sample(1.00, {(1, 1): 0.500, (1, 2): 0.100})
    fine_after = sample(1.01, {(1, 1): 0.505, (1, 2): 0.102, (1, 3): 0.001})
    assert anchors.cpu_between(fine_before, fine_after) == pytest.approx(0.008)
    # a thread of the first sample is gone: its last runtime is unknown, so the ticks count
    assert anchors.cpu_between(fine_before, sample(1.05, {(1, 1): 0.51})) == pytest.approx(0.05)
    # no per-thread runtimes (kernel without schedstat)
    assert anchors.cpu_between(sample(1.0), sample(1.3)) == pytest.approx(0.3)
    # the ticks say much more was done (a thread came and went in between)
    assert anchors.cpu_between(fine_before, sample(2.0, dict(fine_after.threads))) == pytest.approx(1.0)


def test_cpu_sample_sees_this_process_work() -> None:
    if anchors.cpu_sample([os.getpid()]) is None:
        pytest.skip("no /proc here")
    before = anchors.cpu_sample([os.getpid()])
    start = time.process_time()
    while time.process_time() - start < 0.1:
        pass
    after = anchors.cpu_sample([os.getpid()])
    assert 0.05 < anchors.cpu_between(before, after) < 5.0


def test_measure_records_client_and_server_cpu(tmp_path: Path) -> None:
    workload = anchors.Workload("tiny", 2, 16, 2)
    dataset = anchors.write_dataset(tmp_path, workload)
    ready = "import json, time; print(json.dumps({'ticket': 't'}), flush=True); time.sleep(60)"

    def path(data: Any, stack: Any) -> Any:
        anchors.start_server(stack, [sys.executable, "-c", ready])
        return lambda: anchors.Consumed(data.num_batches, data.num_rows)

    result = anchors.measure("fake", dataset, path, repeat=3, warmup=0, timeout=30)
    assert result.ok, result.error
    assert len(result.client_cpu) == len(result.server_cpu) == 3
    assert all(c >= 0 for c in result.client_cpu + result.server_cpu)

    def serverless(data: Any, stack: Any) -> Any:
        return lambda: anchors.Consumed(data.num_batches, data.num_rows)

    plain = anchors.measure("no server", dataset, serverless, repeat=1, warmup=0)
    assert plain.ok and plain.server_cpu == [] and plain.server_cpu_per_gb is None


def test_table_and_json_show_cpu_per_gb() -> None:
    flight = _result("flight do_get", client_cpu=[1.0, 3.0, 2.0], server_cpu=[0.5, 0.5, 0.4])
    copy = _result("numpy copy", client_cpu=[0.2, 0.2, 0.2])
    failed = anchors.Measurement("dissoc tcp combined", "spark", 1, 1, error="not available (x)")
    table = throughput.format_table([copy, flight, failed])
    header, _, copy_row, flight_row, failed_row, *notes = table.splitlines()
    assert throughput.CPU_HEADER in header
    assert "1.00/0.250" in flight_row.split()  # medians 2.0 s and 0.5 s over 2 GB
    assert "0.100/-" in copy_row.split()
    assert "not available (x)" in failed_row
    assert any("server CPU not measured (-) for: numpy copy (no server" in n for n in notes)
    assert any("median CPU seconds" in n for n in notes)
    entry = flight.to_json()
    assert entry["client_cpu_s_per_GB"] == 1.0 and entry["server_cpu_s_per_GB"] == 0.25
    assert copy.to_json()["server_cpu_s_per_GB"] is None


# ----------------------------------------------------------------------------------------------------------
# --plot


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    sweep = anchors.sweep_workloads(quick=True)[:3]
    results = [_result(label, w.name) for label in ("flight do_get", "dissoc tcp combined") for w in sweep]
    results.append(anchors.Measurement("ucxx raw", sweep[0].name, 1, 1, error="not available (no ucxx)"))
    target = tmp_path / "sweep.png"
    assert throughput.plot_sweep(results, sweep, str(target)) == 2
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(throughput.MissingExtra, match=r"dissoc\[bench\]"):
        throughput._pyplot()
    with pytest.raises(SystemExit) as exit_info:  # refused before anything runs
        throughput.main(["--plot", "out.png", "--only", "numpy-copy"])
    assert exit_info.value.code == 2
    assert "pip install 'dissoc[bench]'" in capsys.readouterr().err
