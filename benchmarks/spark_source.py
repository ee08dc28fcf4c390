"""Spark reading through the dissoc data source against ``spark.read.parquet`` of the same data.

Not collected by pytest. One run writes the dataset once, both as Arrow IPC files (one per dissoc stream,
served by a ``dissoc serve`` subprocess that forwards the stored messages) and as Parquet files (pyarrow,
snappy, the same number of files), starts one local Spark session, and times each source fully
materialised the same way, alternating between them:

- ``agg``: ``selectExpr("sum(id)", "sum(value)", "sum(length(label))", "count(*)")`` -- every value of every
  column is read (nothing can be pushed down into the Parquet scan), and the results must agree;
- ``noop``: ``df.write.format("noop")`` -- every row goes through Spark's write path.

Rows: ``dissoc`` (the data source, one partition per stream, default options), ``dissoc validate=false``
(the decoder's content checks off, for trusted servers), ``python ds ceiling`` (a minimal Python data
source yielding the batches of memory-mapped local IPC files: what Spark's Python data source path itself
costs, with no network and no decoding) and ``parquet``. Each figure is the median of
``--repeat`` timed runs after one warm-up; the ratio divides a source's rows/s by Parquet's (same run); on
a busy machine the ratio of the fastest runs (``min vs pq``) is the steadier figure.

Run from the repository root::

    .venv/bin/python benchmarks/spark_source.py                 # 10M rows, 5 repeats (~3-5 min here)
    .venv/bin/python benchmarks/spark_source.py --rows 1000000 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.float64()), ("label", pa.string())])
AGG = ["sum(id) as s_id", "sum(value) as s_value", "sum(length(label)) as s_label", "count(*) as n"]


def write_data(root: Path, rows: int, parts: int, batch_rows: int) -> tuple[list[Path], Path, int]:
    """``parts`` Arrow IPC files and a directory of ``parts`` Parquet files holding the same rows."""
    from dissoc.datasets import GeneratedDataset

    batches = max(1, -(-rows // batch_rows))
    data = GeneratedDataset("bench", SCHEMA, batches=batches, rows_per_batch=batch_rows, seed=7)
    per_part = -(-batches // parts)
    ipc_files: list[Path] = []
    parquet_dir = root / "parquet"
    parquet_dir.mkdir()
    total = 0
    for p in range(parts):
        chunk = [data.batch(i) for i in range(p * per_part, min(batches, (p + 1) * per_part))]
        if chunk and p == parts - 1 and rows % batch_rows:
            chunk[-1] = chunk[-1].slice(0, rows % batch_rows)  # exactly `rows` rows in all
        table = pa.Table.from_batches(chunk, schema=SCHEMA)
        path = root / f"part{p}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
            writer.write_table(table)
        pq.write_table(table, parquet_dir / f"part{p}.parquet", row_group_size=batch_rows)
        ipc_files.append(path)
        total += table.num_rows
    return ipc_files, parquet_dir, total


@contextlib.contextmanager
def dissoc_server(files: list[Path]) -> Iterator[list[list[str]]]:
    """``dissoc serve FILES`` in a subprocess; yields the endpoints ``[[uri, data_uri, ticket], ...]``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dissoc.cli", "serve", "--port", "0", *map(str, files)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        buf = b""
        deadline = time.monotonic() + 60
        while buf.count(b"\n") < len(files):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"dissoc serve did not start (exit status {proc.poll()})")
            if select.select([proc.stdout], [], [], 1.0)[0]:
                buf += os.read(proc.stdout.fileno(), 65536)
        lines = [json.loads(line) for line in buf.decode().splitlines()]
        yield [[d["uri"], d["data_uri"], d["ticket"]] for d in lines]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def register_ceiling(spark: Any) -> None:
    """``format("ipcfile")``: a Python data source that memory-maps local Arrow IPC files (zero-copy) and
    yields their batches: what any Python data source costs in Spark, with no network and no decoding."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class IpcFileReader(DataSourceReader):
        def __init__(self, paths: list[str]) -> None:
            self.paths = paths

        def partitions(self) -> list[InputPartition]:
            return [InputPartition(p) for p in self.paths]

        def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
            reader = pa.ipc.open_file(pa.memory_map(partition.value))
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)

    class IpcFileSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "ipcfile"

        def schema(self) -> str:
            return "id long, value double, label string"

        def reader(self, schema: Any) -> DataSourceReader:
            return IpcFileReader(json.loads(self.options["paths"]))

    spark.dataSource.register(IpcFileSource)


def spark_session(master: str, memory: str) -> Any:
    from pyspark.sql import SparkSession

    import dissoc.spark

    spark = (
        SparkSession.builder.master(master)
        .appName("dissoc-spark-source-benchmark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", memory)
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    dissoc.spark.register(spark, check=True)
    return spark


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--partitions", type=int, default=2, help="dissoc streams = Parquet files (default 2)"
    )
    parser.add_argument("--batch-rows", type=int, default=1 << 18, help="rows per batch / row group")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--modes", default="agg,noop", help="comma-separated: agg, noop")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    out = sys.stderr if args.json else sys.stdout

    root = Path(tempfile.mkdtemp(prefix="dissoc-spark-bench-", dir=args.tmpdir))
    try:
        t, (ipc_files, parquet_dir, rows) = timed(
            lambda: write_data(root, args.rows, args.partitions, args.batch_rows)
        )
        print(f"wrote {rows:,} rows in {len(ipc_files)} IPC + Parquet files in {t:.1f} s", file=out)
        spark = spark_session(args.master, args.driver_memory)
        with dissoc_server(ipc_files) as endpoints:
            register_ceiling(spark)
            paths = json.dumps([str(p) for p in ipc_files])
            sources: dict[str, Callable[[], Any]] = {
                "python ds ceiling": lambda: spark.read.format("ipcfile").option("paths", paths).load(),
                "dissoc": lambda: (
                    spark.read.format("dissoc").option("endpoints", json.dumps(endpoints)).load()
                ),
                "dissoc validate=false": lambda: (
                    spark.read.format("dissoc")
                    .option("endpoints", json.dumps(endpoints))
                    .option("validate", "false")
                    .load()
                ),
                "parquet": lambda: spark.read.parquet(str(parquet_dir)),
            }
            partitions = {name: make().rdd.getNumPartitions() for name, make in sources.items()}
            results: dict[str, dict[str, list[float]]] = {m: {name: [] for name in sources} for m in modes}
            answers: dict[str, Any] = {}
            for mode in modes:
                for i in range(args.repeat + 1):  # the first round is the warm-up
                    for name, make in sources.items():
                        df = make()
                        if mode == "agg":
                            seconds, rows_out = timed(lambda df=df: df.selectExpr(*AGG).collect()[0])
                            answers.setdefault(name, rows_out)
                        else:
                            seconds, _ = timed(lambda df=df: df.write.format("noop").mode("overwrite").save())
                        if i:
                            results[mode][name].append(seconds)
            spark.stop()
        reference = answers.get("parquet")
        for name, answer in answers.items():
            if answer is not None and reference is not None:
                same = (
                    answer.n == reference.n
                    and answer.s_id == reference.s_id
                    and answer.s_label == reference.s_label
                )
                close = abs(answer.s_value - reference.s_value) <= 1e-6 * abs(reference.s_value)
                if not (same and close):
                    print(f"MISMATCH: {name} computed {answer}, parquet {reference}", file=out)
                    return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)

    report: dict[str, Any] = {"rows": rows, "repeat": args.repeat, "partitions": partitions, "modes": {}}
    print(
        f"\n{rows:,} rows (id int64, value float64, label string), {args.master}, median of {args.repeat}",
        file=out,
    )
    print(f"partitions: {partitions}", file=out)
    print(
        f"{'mode':5} {'source':22} {'median s':>9} {'min s':>7} {'max s':>7} {'Mrows/s':>8} {'vs pq':>7} "
        f"{'min vs pq':>9}",
        file=out,
    )
    for mode in modes:
        base = statistics.median(results[mode]["parquet"])
        best = min(results[mode]["parquet"])
        report["modes"][mode] = {}
        for name, times in results[mode].items():
            median = statistics.median(times)
            ratio = base / median
            report["modes"][mode][name] = {
                "median_s": median,
                "min_s": min(times),
                "max_s": max(times),
                "rows_per_s": rows / median,
                "ratio_vs_parquet": ratio,
                "min_ratio_vs_parquet": best / min(times),
            }
            print(
                f"{mode:5} {name:22} {median:9.2f} {min(times):7.2f} {max(times):7.2f} "
                f"{rows / median / 1e6:8.2f} {ratio:6.2f}x {best / min(times):8.2f}x",
                file=out,
            )
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    sys.exit(main())
