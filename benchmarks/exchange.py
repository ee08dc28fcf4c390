"""``dissoc.spark.exchange``, a barrier-stage hash exchange, against Spark's shuffle (not run by pytest).

One run starts one Spark session (``--master``, default ``local-cluster[2,1,1024]``: two executor JVMs with
one core each, so the two tasks of every stage run in different executors and their Python workers are
different processes), makes a DataFrame of ``--gib`` of Arrow data on the executors (``spark.range`` and
expressions, 2 partitions: ``k`` int64 key, ``pmod(xxhash64(id), --keys)``, uniform over 16M values by
default; ``v`` int64; ``x`` float64; ``--mixed`` adds a string column ``s``), caches it and materialises the
cache before anything is timed, then times, in alternating rounds (shuffle, each path, shuffle, ...):

- ``shuffle``: ``df.repartition(2, "k").mapInArrow(consume, schema).collect()`` -- Spark's hash shuffle of
  its rows, then the same Arrow hand-over to Python every path has;
- ``input``: ``df.mapInArrow(consume, schema).collect()``, no exchange at all: Spark handing the cached rows
  to Python as Arrow, which every dissoc path pays before it exchanges anything (so the shuffle's time over
  this one is the most any exchange can gain on the shuffle in this benchmark);
- one row per dissoc path: ``df.mapInArrow(fn, schema, barrier=True).collect()`` where ``fn`` reads its
  partition's batches, calls ``dissoc.spark.exchange(batches, key="k", **kwargs)`` and runs the same
  ``consume`` on what it received:

  ========== ===============================================================================================
  path       kwargs
  ========== ===============================================================================================
  tcp        ``transport="tcp", body="packed"``
  ucx        ``transport="ucx", body="packed"`` (only when ``ucxx`` imports)
  pairs-shm  ``transport="tcp", body="pairs", memory="shm"`` (bodies in shared memory between executors)
  auto       none (``exchange()`` picks)
  device-fake ``landing="device"``; the task first uploads its batches with ``DeviceBatch.from_arrow``
             (timed apart: ``upload s``) under ``DISSOC_DEVICE_BACKEND=fake``, set for this path's Python
             workers only (see :func:`worker_env`), and consumes the ``DeviceBatch`` es it receives
             (``num_rows``, ``nbytes``; the key checksum, through ``to_arrow()``, only with ``--check``)
  ========== ===============================================================================================

``--source python`` starts the data in Python instead, as a job whose tasks make their batches themselves
(a pyarrow or cuDF job, the use the exchange is for) would have it: each of the 2 tasks makes its half of the
rows as Arrow batches (``k`` from a multiplicative hash of the row id, ``v`` the id, ``x`` half of it), in
every round, whatever the row. Spark can only shuffle such data as rows, so ``shuffle`` is then
``src.mapInArrow(make).repartition(2, "k").mapInArrow(consume)`` (the batches handed to Spark, shuffled, and
handed back), ``input`` is making and consuming them with no exchange, and each dissoc path exchanges them
where they are made. ``src`` is a 2-row DataFrame, one row per task; nothing is cached.

``consume`` iterates the batches and yields one row per task: rows, Arrow bytes, the sum of ``k`` (the
checksum) and the seconds the task spent. Every path's total rows and checksum must equal those of the same
``consume`` over the cached DataFrame itself (Spark's shuffle included): a mismatch is printed and the exit
status is 1. The ceiling, ``memcpy``, is one ``np.copyto`` of the dataset's Arrow bytes in this process (16
MiB chunks over 64 MiB rings, so it measures memory, not the cache), timed in every round too.

Figures: each path's median over ``--repeat`` rounds (after ``--warmup`` untimed ones) of the job's wall
time (``collect()``, as the driver sees it): rows/s, GB/s (the dataset's Arrow bytes per second), and the
ratios ``vs shuffle`` (the shuffle's median time over the path's: > 1 is faster than Spark) and ``vs
memcpy`` (GB/s over the copy's). ``task s`` is the median of the slowest task's own time for the exchange
and its consume (for the shuffle: reading and consuming the shuffled stream); ``upload s`` the slowest
task's upload (device-fake). ``exchange()``'s report (``result.report``, per peer: the path taken), where
it has one, is in the JSON.

Run from the repository root::

    .venv/bin/python benchmarks/exchange.py --quick                      # 64 MiB, 1 round: a smoke run
    .venv/bin/python benchmarks/exchange.py                              # 1 GiB, 3 rounds
    .venv/bin/python benchmarks/exchange.py --gib 4 --master 'local-cluster[2,1,4096]' --only shuffle,tcp
    .venv/bin/python benchmarks/exchange.py --mixed --json > exchange.jsonl

``--json``: JSON lines on stdout (``event`` = ``setup``, ``run`` per timed or warm-up job, ``copy``,
``summary`` per path), the table on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

MiB = 1 << 20
GiB = 1 << 30
#: The dissoc paths, in table order, and the keyword arguments each gives ``exchange()``.
PATHS: dict[str, dict[str, Any]] = {
    "tcp": {"transport": "tcp", "body": "packed"},
    "ucx": {"transport": "ucx", "body": "packed"},
    "pairs-shm": {"transport": "tcp", "body": "pairs", "memory": "shm"},
    "auto": {},
    "device-fake": {"landing": "device"},
}
SHUFFLE = "shuffle"
#: No exchange at all: Spark handing the cached rows to Python as Arrow, which every path pays first (the
#: floor of the dissoc paths' time, and so the most any exchange can gain on the shuffle here).
INPUT = "input"
COPY = "memcpy"
NAMES = [SHUFFLE, INPUT, *PATHS]
#: The environment of the device-fake path's Python workers.
DEVICE_ENV = {"DISSOC_DEVICE_BACKEND": "fake"}
#: What each task yields (one row).
RESULT_SCHEMA = (
    "task long, rows long, bytes long, ksum long, input_s double, upload_s double, exchange_s double, "
    "report string, skipped string"
)
PARTITIONS = 2
QUICK_GIB = 64 / 1024
#: The copy ceiling's chunk and ring sizes (as ``_anchors.numpy_copy``: rings beyond the L3 cache).
COPY_CHUNK = 16 * MiB
COPY_RING = 64 * MiB


# ----------------------------------------------------------------------------------------------------------
# What runs in the tasks (pickled by value: only pyarrow, numpy and dissoc imported inside)


def _task_row(
    rows: int,
    nbytes: int,
    ksum: int | None,
    *,
    input_s: float = 0.0,
    upload_s: float = 0.0,
    exchange_s: float = 0.0,
    report: Any = None,
    skipped: str | None = None,
) -> pa.RecordBatch:
    from pyspark import TaskContext

    context = TaskContext.get()
    task = context.partitionId() if context is not None else -1
    text = None if report is None else json.dumps(report, default=str)
    return pa.RecordBatch.from_pydict(
        {
            "task": pa.array([task], pa.int64()),
            "rows": pa.array([rows], pa.int64()),
            "bytes": pa.array([nbytes], pa.int64()),
            "ksum": pa.array([ksum], pa.int64()),
            "input_s": pa.array([input_s], pa.float64()),
            "upload_s": pa.array([upload_s], pa.float64()),
            "exchange_s": pa.array([exchange_s], pa.float64()),
            "report": pa.array([text], pa.string()),
            "skipped": pa.array([skipped], pa.string()),
        }
    )


def _report_of(result: Any) -> dict[str, Any] | None:
    """What ``exchange()`` says of its paths and phases (an older dissoc's says nothing)."""
    if not hasattr(result, "report"):
        return None
    return {"peers": [r.as_dict() for r in result.report], "seconds": getattr(result, "seconds", None)}


def _count(batches: Any, *, check: bool = True) -> tuple[int, int, int | None]:
    """The consumer every path shares: rows, bytes and the sum of ``k`` of host batches; rows and device
    bytes of ``DeviceBatch`` es (their key sum through ``to_arrow()`` only when ``check``)."""
    import pyarrow.compute as pc

    rows = nbytes = ksum = 0
    summed = True
    for batch in batches:
        if not isinstance(batch, pa.RecordBatch):  # a DeviceBatch
            rows += batch.num_rows
            nbytes += batch.nbytes
            if not check:
                summed = False
                continue
            batch = batch.to_arrow()
        else:
            rows += batch.num_rows
            nbytes += batch.nbytes
        if batch.num_rows:
            ksum += pc.sum(batch.column("k")).as_py() or 0
    return rows, nbytes, ksum if summed else None


def make_producer(
    rows: int, keys: int, batch_rows: int
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """``--source python``: the function that turns a task's row of the 2-row source into its part of the
    data, as Arrow batches made in Python (the same rows every time)."""

    def make(parts: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for part in parts:
            for p in part.column(0).to_pylist():
                start, stop = rows * p // PARTITIONS, rows * (p + 1) // PARTITIONS
                ids = np.arange(start, stop, dtype=np.int64)
                mixed = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                k = ((mixed >> np.uint64(17)) % np.uint64(keys)).astype(np.int64)
                x = ids * 0.5
                for at in range(0, len(ids), batch_rows):
                    end = at + batch_rows
                    columns = [pa.array(k[at:end]), pa.array(ids[at:end]), pa.array(x[at:end])]
                    yield pa.record_batch(columns, names=["k", "v", "x"])

    return make


def consume(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Spark's shuffle (and the untimed reference pass): consume the partition's stream as it comes."""
    start = time.perf_counter()
    rows, nbytes, ksum = _count(batches)
    yield _task_row(rows, nbytes, ksum, exchange_s=time.perf_counter() - start)


def make_and_consume(
    make: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]],
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """``--source python``'s ``input`` row (and reference pass): make the task's batches and consume them."""

    def run(parts: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return consume(make(parts))

    return run


def exchange_task(
    kwargs: dict[str, Any],
    *,
    device: bool,
    check: bool,
    timeout: float,
    make: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None = None,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The barrier stage's function for one path: read the partition (or ``make`` it, ``--source python``),
    (upload it,) exchange, consume."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import dissoc.spark

        start = time.perf_counter()
        if make is not None:
            batches = make(batches)
        # Host paths hand exchange() the stream itself (it splits batches as Spark hands them over);
        # the device path reads them first, to upload them.
        data: Any = list(batches) if device else batches
        read = time.perf_counter()
        if device:
            from dissoc.device import DeviceBatch

            backend = os.environ.get("DISSOC_DEVICE_BACKEND")
            if backend != "fake":
                raise RuntimeError(f"device-fake: DISSOC_DEVICE_BACKEND is {backend!r} in this worker")
            data = [DeviceBatch.from_arrow(b) for b in data]
        uploaded = time.perf_counter()
        result = dissoc.spark.exchange(data, key="k", timeout=timeout, **kwargs)
        rows, nbytes, ksum = _count(result, check=check or not device)
        done = time.perf_counter()
        yield _task_row(
            rows,
            nbytes,
            ksum,
            input_s=read - start,
            upload_s=uploaded - read,
            exchange_s=done - uploaded,
            report=_report_of(result),
        )

    return run


# ----------------------------------------------------------------------------------------------------------
# The driver's side


@dataclass
class Measured:
    """One row of the table: its runs (timed and warm-up) or why it did not run."""

    name: str
    kwargs: dict[str, Any] | None = None
    note: str | None = None
    skipped: str | None = None
    error: str | None = None
    frame: Any = None
    seconds: list[float] = field(default_factory=list)
    task_s: list[float] = field(default_factory=list)
    upload_s: list[float] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.skipped is None and self.error is None and bool(self.seconds)


@dataclass(frozen=True)
class Reference:
    """What the cached DataFrame holds, as ``consume`` counts it (untimed)."""

    rows: int
    nbytes: int
    ksum: int


def probe(name: str, exchange: Callable[..., Any]) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """``(kwargs to call exchange() with, why the path is skipped, a note)`` for a dissoc path, asked of
    ``exchange``'s signature on the driver (the workers import the same dissoc)."""
    kwargs = PATHS[name]
    try:
        inspect.signature(exchange).bind([], key="k", timeout=1.0, **kwargs)
    except TypeError as e:  # an older dissoc on the driver
        return None, f"exchange() does not take {', '.join(sorted(kwargs))} ({e})", None
    if name == "ucx":
        got = subprocess.run(
            [sys.executable, "-c", "import ucxx"], capture_output=True, text=True, timeout=120, check=False
        )
        if got.returncode:
            lines = (got.stderr.strip() or f"exit status {got.returncode}").splitlines()
            return None, f"ucxx does not import: {lines[-1]}", None
    return dict(kwargs), None, None


@contextlib.contextmanager
def worker_env(spark: Any, env: dict[str, str]) -> Iterator[None]:
    """Python UDFs made inside get ``env`` in their workers. PySpark gives every Python function the
    context's ``environment`` when the function is wrapped (``df.mapInArrow(...)`` wraps it at once), which
    is how ``spark.executorEnv.*`` reaches Python workers; Spark keeps a separate worker pool per
    environment, so the other paths' workers never see it."""
    environment = spark.sparkContext.environment
    saved = {k: environment.get(k) for k in env}
    environment.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                environment.pop(k, None)
            else:
                environment[k] = v


def spark_session(args: argparse.Namespace) -> Any:
    """The Spark session (FACTS.md section 7: local-cluster needs the venv's Python and 127.0.0.1)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import dissoc.spark

    python = os.environ["PYSPARK_PYTHON"]
    spark = (
        SparkSession.builder.master(args.master)
        .appName("dissoc-exchange-benchmark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.memory", args.driver_memory)
        .config("spark.pyspark.python", python)
        .config("spark.executorEnv.PYSPARK_PYTHON", python)
        .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", str(PARTITIONS))
        .config("spark.default.parallelism", str(PARTITIONS))
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(args.batch_rows))
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.session.timeZone", "UTC")
        # a benchmark fails at once rather than retrying a failed (barrier) stage
        .config("spark.task.maxFailures", "1")
        .config("spark.stage.maxConsecutiveAttempts", "1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    dissoc.spark.register(spark, check=True)
    return spark


def bytes_per_row(mixed: bool) -> int:
    """Estimated Arrow bytes per row: three 8-byte columns; ``s`` adds an offset and ~11 characters."""
    return 24 + (15 if mixed else 0)


def make_frame(spark: Any, rows: int, keys: int, mixed: bool) -> Any:
    """The dataset, generated on the executors in 2 partitions, deterministic (the same rows every time)."""
    exprs = [f"pmod(xxhash64(id), {keys}) AS k", "id AS v", "CAST(id AS DOUBLE) * 0.5 AS x"]
    if mixed:
        exprs.append("concat('item-', CAST(pmod(xxhash64(id, 1), 1000000) AS STRING)) AS s")
    return spark.range(0, rows, 1, numPartitions=PARTITIONS).selectExpr(*exprs)


def collect(frame: Any) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    rows = frame.collect()
    return time.perf_counter() - start, rows


def numpy_copy(nbytes: int) -> Callable[[], float]:
    """One ``np.copyto`` of ``nbytes`` in ``COPY_CHUNK`` pieces over ``COPY_RING`` rings; returns seconds."""
    chunk = max(1, min(nbytes, COPY_CHUNK))
    slots = max(1, -(-COPY_RING // chunk))
    source = np.ones(slots * chunk, dtype=np.uint8)
    target = np.zeros(slots * chunk, dtype=np.uint8)
    sources = [source[i * chunk : (i + 1) * chunk] for i in range(slots)]
    targets = [target[i * chunk : (i + 1) * chunk] for i in range(slots)]
    pieces = [(i % slots, chunk) for i in range(nbytes // chunk)]
    if nbytes % chunk:
        pieces.append((len(pieces) % slots, nbytes % chunk))

    def run() -> float:
        start = time.perf_counter()
        for slot, size in pieces:
            np.copyto(targets[slot][:size], sources[slot][:size])
        return time.perf_counter() - start

    return run


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(
    path: Measured, ref: Reference, shuffle: Measured | None, copy_s: list[float]
) -> dict[str, Any]:
    """The ``summary`` JSON line of a path (or of the memcpy ceiling)."""
    out: dict[str, Any] = {"event": "summary", "path": path.name, "kwargs": path.kwargs}
    for key in ("note", "skipped", "error"):
        if getattr(path, key):
            out[key] = getattr(path, key)
    median = _median(path.seconds)
    if not path.ok or median is None:
        return out
    copy_median = _median(copy_s)
    shuffle_median = _median(shuffle.seconds) if shuffle is not None and shuffle.ok else None
    gbps = ref.nbytes / median / 1e9
    out.update(
        runs=len(path.seconds),
        median_s=median,
        min_s=min(path.seconds),
        max_s=max(path.seconds),
        rows=ref.rows,
        bytes=ref.nbytes,
        rows_per_s=ref.rows / median,
        gbps=gbps,
        vs_shuffle=shuffle_median / median if shuffle_median else None,
        vs_memcpy=gbps / (ref.nbytes / copy_median / 1e9) if copy_median else None,
        task_s=_median(path.task_s),
        upload_s=_median(path.upload_s) if path.name == "device-fake" else None,
        report=path.reports[-1] if path.reports else None,
    )
    return out


def format_table(summaries: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        f"{'path':12} {'median s':>9} {'min s':>7} {'max s':>7} {'Mrows/s':>8} {'GB/s':>6} "
        f"{'vs shuffle':>10} {'vs memcpy':>9} {'task s':>7} {'upload s':>8}",
    ]
    notes = []
    for s in summaries:
        if "median_s" not in s:
            why = s.get("skipped") or s.get("error") or "no timed run"
            lines.append(f"{s['path']:12} {'skipped' if 'skipped' in s else 'failed'}: {why}")
            continue

        def ratio(key: str, s: dict[str, Any] = s) -> str:
            value = s.get(key)
            return "-" if value is None else f"{value:.2f}x" if value >= 0.1 else f"{value:.3f}x"

        def secs(key: str, s: dict[str, Any] = s) -> str:
            return "-" if s.get(key) is None else f"{s[key]:.2f}"

        lines.append(
            f"{s['path']:12} {s['median_s']:9.3f} {s['min_s']:7.3f} {s['max_s']:7.3f} "
            f"{s['rows_per_s'] / 1e6:8.2f} {s['gbps']:6.2f} {ratio('vs_shuffle'):>10} "
            f"{ratio('vs_memcpy'):>9} {secs('task_s'):>7} {secs('upload_s'):>8}"
        )
        if s.get("note"):
            notes.append(f"{s['path']}: {s['note']}")
        if s.get("report") is not None:
            notes.append(f"{s['path']} report: {json.dumps(s['report'], default=str)[:300]}")
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=None, help="GiB of Arrow data (default 1; --quick 1/16)")
    parser.add_argument(
        "--rows", type=int, default=None, help="rows instead of --gib (tests: a few thousand)"
    )
    parser.add_argument("--quick", action="store_true", help="64 MiB, 1 timed round: a smoke run")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (default 3; --quick 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--only", metavar="PATH[,PATH]", help=f"paths: {', '.join(NAMES)} (default all)")
    parser.add_argument("--master", default="local-cluster[2,1,1024]")
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument("--keys", type=int, default=1 << 24, help="distinct keys (default 16M)")
    parser.add_argument("--mixed", action="store_true", help="add a string column s (--source dataframe)")
    parser.add_argument(
        "--source",
        choices=("dataframe", "python"),
        default="dataframe",
        help="where the data starts: a cached Spark DataFrame (default), or Arrow batches each task makes",
    )
    parser.add_argument(
        "--batch-rows", type=int, default=10_000, help="spark.sql.execution.arrow.maxRecordsPerBatch (10000)"
    )
    parser.add_argument(
        "--check", action="store_true", help="device-fake: download what it receives to checksum the keys"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="exchange()'s timeout, seconds")
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout (the table on stderr)")
    args = parser.parse_args(argv)
    gib = args.gib if args.gib is not None else (QUICK_GIB if args.quick else 1.0)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    if repeat < 1 or args.warmup < 0 or args.keys < 1 or args.batch_rows < 1:
        parser.error("--repeat, --keys and --batch-rows must be >= 1 and --warmup >= 0")
    if args.mixed and args.source == "python":
        parser.error("--mixed is for --source dataframe")
    rows = args.rows if args.rows is not None else max(1, int(gib * GiB / bytes_per_row(args.mixed)))
    chosen = NAMES
    if args.only:
        chosen = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in NAMES]
        if unknown:
            parser.error(f"--only: unknown {', '.join(unknown)} (paths: {', '.join(NAMES)})")
    table_out = sys.stderr if args.json else sys.stdout

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def emit(record: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(record, default=str), flush=True)

    if __name__ != "__main__":  # imported: the tasks' functions cannot be imported by name in the workers
        from pyspark import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    import dissoc.spark

    paths = [Measured(n) for n in NAMES if n in chosen]
    for path in paths:
        if path.name in (SHUFFLE, INPUT):
            continue
        path.kwargs, path.skipped, path.note = probe(path.name, dissoc.spark.exchange)
        if path.skipped:
            progress(f"# skipping {path.name}: {path.skipped}")
    mismatches: list[str] = []
    copy_s: list[float] = []
    progress(f"# starting Spark on {args.master}")
    spark = spark_session(args)
    try:
        start = time.perf_counter()
        make = None
        if args.source == "python":
            make = make_producer(rows, args.keys, args.batch_rows)
            df = spark.range(0, PARTITIONS, 1, numPartitions=PARTITIONS)
            columns = ["k", "v", "x"]
            tasks = df.mapInArrow(make_and_consume(make), RESULT_SCHEMA).collect()
        else:
            df = make_frame(spark, rows, args.keys, args.mixed).cache()
            df.count()
            columns = list(df.columns)
            tasks = df.mapInArrow(consume, RESULT_SCHEMA).collect()
        ref = Reference(
            sum(t.rows for t in tasks), sum(t.bytes for t in tasks), sum(t.ksum or 0 for t in tasks)
        )
        took = time.perf_counter() - start
        what = "made in the tasks" if make is not None else "cached"
        progress(f"# {what}: {ref.rows:,} rows, {_size(ref.nbytes)} of Arrow data, in {took:.1f} s")
        setup = {
            "event": "setup",
            "master": args.master,
            "rows": ref.rows,
            "bytes": ref.nbytes,
            "ksum": ref.ksum,
            "gib_asked": None if args.rows is not None else gib,
            "columns": columns,
            "keys": args.keys,
            "source": args.source,
            "partitions": PARTITIONS,
            "batch_rows": args.batch_rows,
            "repeat": repeat,
            "warmup": args.warmup,
            "quick": args.quick,
            "check": args.check,
            "paths": [p.name for p in paths],
            "skipped": {p.name: p.skipped for p in paths if p.skipped},
            "spark": spark.version,
            "pyarrow": pa.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        }
        emit(setup)
        for path in paths:
            if path.skipped:
                continue
            if path.name == SHUFFLE:
                rows_of = df if make is None else df.mapInArrow(make, "k long, v long, x double")
                path.frame = rows_of.repartition(PARTITIONS, "k").mapInArrow(consume, RESULT_SCHEMA)
                continue
            if path.name == INPUT:
                path.frame = df.mapInArrow(consume if make is None else make_and_consume(make), RESULT_SCHEMA)
                continue
            device = path.name == "device-fake"
            assert path.kwargs is not None
            fn = exchange_task(path.kwargs, device=device, check=args.check, timeout=args.timeout, make=make)
            with worker_env(spark, DEVICE_ENV) if device else contextlib.nullcontext():
                path.frame = df.mapInArrow(fn, RESULT_SCHEMA, barrier=True)
        copy = numpy_copy(ref.nbytes)

        for round_ in range(args.warmup + repeat):
            timed = round_ >= args.warmup
            for path in paths:
                if path.skipped or path.error:
                    continue
                try:
                    seconds, tasks = collect(path.frame)
                except Exception as e:
                    text = str(e).strip().splitlines()
                    path.error = f"{type(e).__name__}: {text[0] if text else e}"[:500]
                    progress(f"  {path.name}: error: {path.error}")
                    continue
                skipped = {t.skipped for t in tasks if t.skipped}
                if skipped:
                    path.skipped = "; ".join(sorted(skipped))
                    progress(f"# skipping {path.name}: {path.skipped}")
                    continue
                got_rows = sum(t.rows for t in tasks)
                sums = [t.ksum for t in tasks]
                got_ksum = None if None in sums else sum(sums)
                if got_rows != ref.rows or (got_ksum is not None and got_ksum != ref.ksum):
                    mismatches.append(
                        f"{path.name} (round {round_}): {got_rows:,} rows, key sum {got_ksum}; the data has "
                        f"{ref.rows:,} rows, key sum {ref.ksum}"
                    )
                    progress(f"MISMATCH: {mismatches[-1]}")
                report = [None if t.report is None else json.loads(t.report) for t in tasks]
                task_s = max(t.exchange_s for t in tasks)
                upload_s = max(t.upload_s for t in tasks)
                if timed:
                    path.seconds.append(seconds)
                    path.task_s.append(task_s)
                    path.upload_s.append(upload_s)
                if any(r is not None for r in report):
                    path.reports.append(report)
                emit(
                    {
                        "event": "run",
                        "path": path.name,
                        "round": round_,
                        "timed": timed,
                        "seconds": seconds,
                        "rows": got_rows,
                        "ksum": got_ksum,
                        "rows_per_s": ref.rows / seconds,
                        "gbps": ref.nbytes / seconds / 1e9,
                        "kwargs": path.kwargs,
                        "tasks": [
                            {k: v for k, v in t.asDict().items() if k not in ("report", "skipped")}
                            for t in tasks
                        ],
                        "report": report,
                    }
                )
                progress(
                    f"  {path.name:12} round {round_}{'' if timed else ' (warm-up)'}: {seconds:.3f} s, "
                    f"{ref.rows / seconds / 1e6:.2f} Mrows/s, task {task_s:.3f} s"
                )
            seconds = copy()
            if timed:
                copy_s.append(seconds)
            emit({"event": "copy", "round": round_, "timed": timed, "seconds": seconds})
    finally:
        spark.stop()

    shuffle = next((p for p in paths if p.name == SHUFFLE), None)
    summaries = [summarise(p, ref, shuffle, copy_s) for p in paths]
    ceiling = Measured(COPY, seconds=copy_s)
    summaries.append(summarise(ceiling, ref, shuffle, copy_s))
    for s in summaries:
        emit(s)
    origin = "made in the tasks" if make is not None else "in a cached DataFrame"
    header = (
        f"\n{ref.rows:,} rows, {_size(ref.nbytes)} of Arrow data {origin} ({', '.join(columns)}; k over "
        f"{args.keys:,} keys), {PARTITIONS} partitions of {args.batch_rows:,}-row batches, {args.master}; "
        f"median of {repeat} after {args.warmup} warm-up"
    )
    print(format_table(summaries, header), file=table_out)
    for mismatch in mismatches:
        print(f"MISMATCH: {mismatch}", file=table_out)
    if mismatches:
        return 1
    return 1 if any(p.error for p in paths) else 0


if __name__ == "__main__":
    sys.exit(main())
