"""Reusable pieces of the throughput benchmarks: workloads, datasets, server subprocesses, anchor paths.

The anchors are the reference points of spec/FACTS.md section 6, measured on this machine in the same run as
whatever they are compared with:

- ``numpy copy``: one copy of the payload bytes with ``np.copyto`` (the memory-bandwidth ceiling);
- ``flight do_get``: a pyarrow.flight server in a subprocess, read with ``FlightClient.do_get``;
- ``ipc stream socket``: a subprocess writes a pyarrow IPC stream to a TCP socket, read with
  ``pa.ipc.open_stream``;
- ``ucxx raw``: a minimal ucxx sender subprocess sends each batch's bytes (cut from the memory-mapped file) as
  one tagged message to this process, worker-address endpoints, polling progress (``_ucx_anchor.py``);
  ``ucxx raw blocking`` waits on epoll instead of spinning (as dissoc does; it suffers less when other
  processes compete for the CPUs); ``ucxx raw anon-mem`` sends the same sizes from anonymous (numpy,
  huge-page) memory instead of the file's 4 KiB pages (the best case for UCX's CMA copy).

Every server reads the same Arrow IPC file through ``pa.memory_map`` (zero-copy) and writes it with C++ loops
(``flight.RecordBatchStream`` over the table, ``RecordBatchStreamWriter.write_table``), so no server pays a
different read cost. Every client consumes every batch with :func:`consume` and never concatenates.

A *path* is a function ``(dataset, exit_stack) -> transfer``: it sets up what it needs (servers, clients),
registers their cleanup on the exit stack, and returns a zero-argument ``transfer`` that moves the whole
dataset once and returns what it consumed. :func:`measure` times a transfer. Later benchmarks (UCX, Spark)
add rows by writing more paths.

This file is also the entry point of the anchor servers (run as a script)::

    python benchmarks/_anchors.py serve-flight PATH   # {"ticket", "uri"}; serves until SIGTERM
    python benchmarks/_anchors.py serve-ipc PATH      # {"ticket", "uri", "port"}; a stream per connection
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import numpy as np
import pyarrow as pa

MiB = 1 << 20
HOST = os.environ.get("DISSOC_BENCH_HOST", "127.0.0.1")  # where the anchor servers listen
#: Buffer size of the IPC socket writer and reader (Python ``BufferedWriter``/``BufferedReader`` from
#: ``socket.makefile``). Measured readers: a 1 MiB ``BufferedReader`` given straight to
#: ``pa.ipc.open_stream`` is as fast as the best for 16 MiB batches (large reads bypass the buffer, no extra
#: copy) and 1.6x the default 8 KiB one for 16 KiB batches; ``pa.input_stream(file, buffer_size=...)``
#: matches it on small batches but adds a copy on large ones.
IPC_SOCKET_BUFFER = 1 * MiB
#: numpy copy cycles through source/destination regions at least this large, so that it measures memory,
#: not the 32 MiB L3 cache.
NUMPY_RING_BYTES = 64 * MiB
REPO_ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------------------
# Workloads and datasets


#: Workload kinds: ``int64`` (``columns`` int64 columns, as the original workloads) and ``spark`` (ten mixed
#: columns shaped like a Spark executor's batch: :func:`spark_batch`).
KINDS = ("int64", "spark")


@dataclass(frozen=True)
class Workload:
    """``num_batches`` identical batches of ``rows_per_batch`` rows: ``columns`` int64 columns (kind
    ``int64``) or the ten mixed columns of :func:`spark_batch` (kind ``spark``)."""

    name: str
    columns: int
    rows_per_batch: int
    num_batches: int
    kind: str = "int64"

    @property
    def batch_bytes(self) -> int:
        if self.kind == "int64":
            return self.columns * self.rows_per_batch * 8
        return int(make_batch(self).nbytes)

    @property
    def payload_bytes(self) -> int:
        return self.batch_bytes * self.num_batches

    def describe(self) -> str:
        if self.kind == "int64":
            cols = f"{self.columns} int64 cols"
        else:
            cols = f"{self.columns} mixed cols ({', '.join(str(f.type) for f in make_batch(self).schema)})"
        return (
            f"{self.name}: {self.num_batches} batches x {cols} x {self.rows_per_batch}"
            f" rows = {_size(self.batch_bytes)}/batch, {_size(self.payload_bytes)} in all"
        )


#: Full-size workloads: 1 GiB in 16 MiB batches, 1 GiB in 64 MiB batches, 100k batches of 1k rows, and
#: 1280 Spark-shaped batches of 10k rows x 10 mixed columns (~0.8 MiB each, ~1 GiB).
WORKLOADS: dict[str, Workload] = {
    "large": Workload("large", 2, 1 << 20, 64),
    "large64": Workload("large64", 2, 1 << 22, 16),
    "small": Workload("small", 2, 1024, 100_000),
    "spark": Workload("spark", 10, 10_000, 1280, kind="spark"),
}
#: ``--quick`` workloads: 256 MiB in 16 MiB and in 64 MiB batches, 10k small batches, 160 Spark batches.
QUICK_WORKLOADS: dict[str, Workload] = {
    "large": Workload("large", 2, 1 << 20, 16),
    "large64": Workload("large64", 2, 1 << 22, 4),
    "small": Workload("small", 2, 1024, 10_000),
    "spark": Workload("spark", 10, 10_000, 160, kind="spark"),
}

#: Rows per batch of the batch-size sweep (2 int64 columns): 16 KiB, 256 KiB, 2 MiB, 16 MiB and 64 MiB.
SWEEP_ROWS = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
#: Bytes each sweep workload moves per transfer (at least 2 batches), full and ``--quick``.
SWEEP_BYTES = 512 * MiB
QUICK_SWEEP_BYTES = 64 * MiB


def sweep_workloads(quick: bool = False, rows: Sequence[int] = SWEEP_ROWS) -> list[Workload]:
    """The batch-size sweep: one 2-column int64 workload per row count, each moving about the same bytes."""
    total = QUICK_SWEEP_BYTES if quick else SWEEP_BYTES
    out = []
    for count in rows:
        label = f"{count >> 20}m" if count >= 1 << 20 else f"{count >> 10}k"
        out.append(Workload(f"sweep-{label}", 2, count, max(2, total // (2 * 8 * count))))
    return out


def make_batch(workload: Workload) -> pa.RecordBatch:
    """The batch every one of ``workload``'s batches is (deterministic: the same bytes on every run)."""
    if workload.kind == "int64":
        values = np.arange(workload.rows_per_batch, dtype=np.int64)
        return pa.record_batch(
            [pa.array(values + column) for column in range(workload.columns)],
            names=[f"c{column}" for column in range(workload.columns)],
        )
    if workload.kind == "spark":
        if workload.columns != SPARK_COLUMNS:
            raise ValueError(f"a spark workload has {SPARK_COLUMNS} columns, not {workload.columns}")
        return spark_batch(workload.rows_per_batch)
    raise ValueError(f"unknown workload kind {workload.kind!r} (kinds: {', '.join(KINDS)})")


SPARK_COLUMNS = 10
_CATEGORIES = ("books", "games", "garden", "grocery", "health", "music", "outdoors", "toys")


@functools.cache
def spark_batch(rows: int, seed: int = 20240611) -> pa.RecordBatch:
    """A Spark-executor-like batch of ``rows`` rows and ten mixed columns, the same for the same arguments:
    int64 ids, int32 quantities, float64 prices (~10% null), float32 discounts, utf8 comments of 0-48
    characters (~5% null), bools, timestamp[us], date32, int64 customer ids and a short utf8 category."""
    rng = np.random.default_rng(seed)
    ids = np.arange(rows, dtype=np.int64)
    price = np.round(rng.uniform(0.5, 500.0, rows), 2)
    price_null = rng.random(rows) < 0.10
    lengths = rng.integers(0, 49, rows)
    starts = rng.integers(0, 4096 - 48, rows)
    pool = "".join(chr(c) for c in rng.integers(ord("a"), ord("z") + 1, 4096))
    comment_null = rng.random(rows) < 0.05
    comments = [
        None if null else pool[start : start + length]
        for start, length, null in zip(starts.tolist(), lengths.tolist(), comment_null.tolist(), strict=True)
    ]
    base_us = 1_700_000_000_000_000
    columns: dict[str, pa.Array] = {
        "id": pa.array(ids),
        "quantity": pa.array(rng.integers(1, 1000, rows, dtype=np.int32)),
        "price": pa.array(price, mask=price_null),
        "discount": pa.array(rng.uniform(0.0, 0.5, rows).astype(np.float32)),
        "comment": pa.array(comments, type=pa.utf8()),
        "active": pa.array(rng.random(rows) < 0.5),
        "event_time": pa.array(base_us + ids * 1_000_003, type=pa.timestamp("us")),
        "event_date": pa.array((19_000 + ids // 500).astype(np.int32), type=pa.date32()),
        "customer_id": pa.array(rng.integers(0, 1 << 40, rows, dtype=np.int64)),
        "category": pa.array([_CATEGORIES[i] for i in rng.integers(0, len(_CATEGORIES), rows).tolist()]),
    }
    return pa.record_batch(list(columns.values()), names=list(columns))


@dataclass(frozen=True)
class Dataset:
    """An Arrow IPC file every path serves; ``payload_bytes`` is the sum of ``batch.nbytes``."""

    name: str
    path: Path
    ticket: str
    num_batches: int
    num_rows: int
    payload_bytes: int


def write_dataset(directory: Path, workload: Workload) -> Dataset:
    """Write ``workload`` to ``directory/<name>.arrow`` (Arrow IPC file); its ticket is the file stem."""
    path = directory / f"{workload.name}.arrow"
    batch = make_batch(workload)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        for _ in range(workload.num_batches):
            writer.write_batch(batch)
    assert batch.nbytes == workload.batch_bytes
    return Dataset(
        name=workload.name,
        path=path,
        ticket=path.stem,
        num_batches=workload.num_batches,
        num_rows=workload.rows_per_batch * workload.num_batches,
        payload_bytes=workload.payload_bytes,
    )


def describe_dataset(path: Path) -> Dataset:
    """A :class:`Dataset` for an existing Arrow IPC file (reads every batch's metadata)."""
    rows = nbytes = 0
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            rows += batch.num_rows
            nbytes += batch.nbytes
        count = reader.num_record_batches
    return Dataset(path.stem, path, path.stem, count, rows, nbytes)


def load_table(path: Path | str) -> pa.Table:
    """The whole IPC file as a table over a memory map: zero-copy, one chunk per batch, no concatenation."""
    return pa.ipc.open_file(pa.memory_map(str(path))).read_all()


def default_tmpdir(needed_bytes: int) -> str | None:
    """``/dev/shm`` when it has room (no disk writeback disturbing the timings), else the default."""
    with contextlib.suppress(OSError):
        stats = os.statvfs("/dev/shm")
        if stats.f_bavail * stats.f_frsize > 2 * needed_bytes + 512 * MiB:
            return "/dev/shm"
    return None


# ----------------------------------------------------------------------------------------------------------
# Consuming and measuring


@dataclass(frozen=True)
class Consumed:
    batches: int
    rows: int


#: Moves a whole dataset once and returns what it consumed.
Transfer = Callable[[], Consumed]
#: Sets up a path for a dataset (cleanup registered on the exit stack) and returns its transfer.
PathFactory = Callable[[Dataset, contextlib.ExitStack], Transfer]


class Unavailable(Exception):
    """A path cannot run here (missing module, server that does not start); the message says why."""


class BenchmarkError(Exception):
    """A transfer delivered something other than the dataset."""


def consume(batches: Iterable[pa.RecordBatch]) -> Consumed:
    """Touch every batch (count it and its rows), keep none: the same consumer for every path."""
    count = rows = 0
    for batch in batches:
        count += 1
        rows += batch.num_rows
    return Consumed(count, rows)


@dataclass
class Measurement:
    """Timings of one path on one dataset; ``error`` set (and no timings) when it could not run.

    ``client_cpu`` and ``server_cpu`` are the CPU seconds (user + system) each timed transfer cost this
    process and the server subprocesses the path started (:func:`process_cpu_seconds`); empty where they were
    not measured (no server, or no ``/proc``).
    """

    path: str
    workload: str
    payload_bytes: int
    num_batches: int
    seconds: list[float] = field(default_factory=list)
    error: str | None = None
    note: str | None = None
    client_cpu: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.seconds)

    @property
    def gbps(self) -> list[float]:
        return [self.payload_bytes / s / 1e9 for s in self.seconds]

    @property
    def median_gbps(self) -> float:
        return statistics.median(self.gbps)

    @property
    def median_batches_per_s(self) -> float:
        return self.num_batches / statistics.median(self.seconds)

    @property
    def client_cpu_per_gb(self) -> float | None:
        """Median client CPU seconds per GB (1e9 bytes) of payload; None when not measured."""
        return self._per_gb(self.client_cpu)

    @property
    def server_cpu_per_gb(self) -> float | None:
        """Median server CPU seconds per GB of payload; None when not measured (e.g. no server)."""
        return self._per_gb(self.server_cpu)

    def _per_gb(self, cpu: list[float]) -> float | None:
        if not cpu or not self.ok:
            return None
        return statistics.median(cpu) / (self.payload_bytes / 1e9)

    def to_json(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "path": self.path,
            "workload": self.workload,
            "payload_bytes": self.payload_bytes,
            "batches": self.num_batches,
            "error": self.error,
        }
        if self.note:
            result["note"] = self.note
        if self.ok:
            result.update(
                seconds=[round(s, 6) for s in self.seconds],
                median_GBps=round(self.median_gbps, 4),
                min_GBps=round(min(self.gbps), 4),
                max_GBps=round(max(self.gbps), 4),
                median_batches_per_s=round(self.median_batches_per_s, 1),
                client_cpu_s=[round(c, 4) for c in self.client_cpu] or None,
                server_cpu_s=[round(c, 4) for c in self.server_cpu] or None,
                client_cpu_s_per_GB=_round(self.client_cpu_per_gb),
                server_cpu_s_per_GB=_round(self.server_cpu_per_gb),
            )
        return result


def format_cpu(result: Measurement) -> str:
    """``client/server`` CPU seconds per GB, ``-`` for a side not measured."""

    def cell(value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if value >= 1 else f"{value:.3f}"

    return f"{cell(result.client_cpu_per_gb)}/{cell(result.server_cpu_per_gb)}"


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (``/proc/PID/task/*/children``; empty where the kernel lacks it)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as file:
                out += [int(child) for child in file.read().split()]
    return out


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (utime + stime, every thread, exited ones included, in clock ticks: 10 ms on most
    kernels) that process ``pid`` and its live descendants have used, from ``/proc``; None when it cannot be
    read (no ``/proc``, process gone)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After "pid (comm)": state is field 3, utime 14 and stime 15 (proc(5)), so indices 11 and 12 here.
    total = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    for child in _children(pid):
        total += process_cpu_seconds(child) or 0.0
    return total


def _thread_runtimes(pid: int, out: dict[tuple[int, int], float]) -> bool:
    """Add each live thread's time on a CPU (``/proc/PID/task/TID/schedstat``, nanoseconds) of ``pid`` and
    its descendants to ``out``; False where the kernel does not provide it."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as file:
                out[(pid, int(task))] = int(file.read().split()[0]) / 1e9
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{task}"):
                continue  # the thread exited meanwhile
            return False
        except (OSError, ValueError, IndexError):
            return False
    return all(_thread_runtimes(child, out) for child in _children(pid))


@dataclass(frozen=True)
class CpuSample:
    """The CPU time of some processes at one moment: ``ticks`` (utime + stime, exited threads included,
    clock-tick resolution) and, where the kernel has schedstat, each live thread's runtime in seconds
    (nanosecond resolution; empty otherwise)."""

    ticks: float
    threads: dict[tuple[int, int], float] = field(default_factory=dict)


def cpu_sample(pids: Sequence[int]) -> CpuSample | None:
    """A :class:`CpuSample` of every process in ``pids`` and their descendants; None if one is unreadable."""
    ticks = 0.0
    threads: dict[tuple[int, int], float] = {}
    fine = True
    for pid in pids:
        cpu = process_cpu_seconds(pid)
        if cpu is None:
            return None
        ticks += cpu
        fine = fine and _thread_runtimes(pid, threads)
    return CpuSample(ticks, threads if fine else {})


def cpu_has_schedstat() -> bool:
    """Whether this kernel gives each thread's runtime in nanoseconds (else CPU times are clock ticks)."""
    return _thread_runtimes(os.getpid(), {})


def cpu_between(before: CpuSample, after: CpuSample) -> float:
    """CPU seconds used between two samples: the per-thread runtimes where both have them and no thread
    of ``before`` has gone (threads started since count whole), else (or when the tick count says more
    work was done, by threads that came and went) the tick difference."""
    coarse = after.ticks - before.ticks
    if not before.threads or not after.threads or not before.threads.keys() <= after.threads.keys():
        return coarse
    fine = sum(runtime - before.threads.get(key, 0.0) for key, runtime in after.threads.items())
    return fine if coarse <= fine + 2 / _CLOCK_TICKS else coarse


#: Collectors of the pids of the servers :func:`start_server` starts (see :func:`collect_servers`).
_SERVER_COLLECTORS: list[list[int]] = []


@contextlib.contextmanager
def collect_servers() -> Iterator[list[int]]:
    """A list that the pid of every server :func:`start_server` starts in this block is appended to."""
    pids: list[int] = []
    _SERVER_COLLECTORS.append(pids)
    try:
        yield pids
    finally:
        _SERVER_COLLECTORS.remove(pids)


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`_Timeout` in the main thread after ``seconds`` (SIGALRM); a no-op elsewhere."""
    import threading

    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise _Timeout(f"no result after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def measure(
    name: str,
    dataset: Dataset,
    factory: PathFactory,
    *,
    repeat: int,
    warmup: int = 1,
    timeout: float | None = 120.0,
) -> Measurement:
    """Set up ``factory``'s path, run ``warmup`` untimed then ``repeat`` timed transfers, tear it down.

    Never raises for a path that fails (except KeyboardInterrupt/SystemExit): the failure becomes
    ``Measurement.error``. The garbage collector is off during each timed transfer (for every path alike).

    Around each timed transfer it also reads the CPU time of this process (``time.process_time``: every
    thread; the client side of every path runs here) and of the server subprocesses the path started with
    :func:`start_server` (``/proc``: :func:`cpu_sample`, :func:`cpu_between`), outside the timed span.
    """
    result = Measurement(name, dataset.name, dataset.payload_bytes, dataset.num_batches)
    try:
        with contextlib.ExitStack() as stack:
            with collect_servers() as servers:
                transfer = factory(dataset, stack)
            for i in range(warmup + repeat):
                gc.collect()
                gc.disable()
                try:
                    with _deadline(timeout):
                        server_before = cpu_sample(servers) if servers else None
                        client_before = time.process_time()
                        start = time.perf_counter()
                        got = transfer()
                        elapsed = time.perf_counter() - start
                        client_after = time.process_time()
                        server_after = cpu_sample(servers) if servers else None
                finally:
                    gc.enable()
                if got.rows != dataset.num_rows:
                    raise BenchmarkError(f"expected {dataset.num_rows} rows, received {got.rows}")
                if got.batches != dataset.num_batches:
                    result.note = f"received {got.batches} batches for {dataset.num_batches} sent"
                if i >= warmup:
                    result.seconds.append(elapsed)
                    result.client_cpu.append(client_after - client_before)
                    if server_before is not None and server_after is not None:
                        result.server_cpu.append(cpu_between(server_before, server_after))
        if len(result.server_cpu) != len(result.seconds):  # a server could not be read every time
            result.server_cpu.clear()
    except Unavailable as exc:
        result.error = f"not available ({exc})"
    except Exception as exc:
        result.error = f"error: {type(exc).__name__}: {exc}"
    if result.error:
        result.seconds.clear()
        result.client_cpu.clear()
        result.server_cpu.clear()
    return result


def run_paths(
    paths: Iterable[tuple[str, str, Callable[[Dataset, contextlib.ExitStack], Transfer]]],
    workloads: Iterable[Workload],
    *,
    repeat: int,
    warmup: int,
    timeout: float | None,
    tmpdir: str | None,
    results: list[Measurement],
    progress: Callable[[str], None],
    note: Callable[[str], str | None] | None = None,
    prefix: str = "dissoc-bench-",
) -> None:
    """Measure every path on every workload (a dataset file written per workload), appending to ``results``
    as it goes; ``note(label)``, asked after each one, gives its note when the measurement left none."""
    paths = list(paths)
    with tempfile.TemporaryDirectory(prefix=prefix, dir=tmpdir) as directory:
        for workload in workloads:
            progress(f"# writing {workload.describe()}")
            dataset = write_dataset(Path(directory), workload)
            try:
                for _slug, label, factory in paths:
                    progress(f"  {label} / {workload.name} ...")
                    result = measure(label, dataset, factory, repeat=repeat, warmup=warmup, timeout=timeout)
                    if note is not None and not result.note:
                        result.note = note(label) or result.note
                    results.append(result)
                    if result.ok:
                        progress(
                            f"    {result.median_gbps:.2f} GB/s median "
                            f"({', '.join(f'{g:.2f}' for g in result.gbps)}), "
                            f"{result.median_batches_per_s:,.0f} batches/s, "
                            f"cpu s/GB cli/srv {format_cpu(result)}"
                        )
                    else:
                        progress(f"    {result.error}")
            finally:
                dataset.path.unlink(missing_ok=True)


def select_paths(
    paths: Sequence[tuple[str, str, Any]], only: str | None, groups: dict[str, Iterable[str]] | None = None
) -> list[tuple[str, str, Any]]:
    """The paths ``--only`` names (comma-separated): an exact slug is that path alone, otherwise a prefix
    selects every slug it starts; ``groups`` names sets of slugs (e.g. ``anchors``). All paths without it."""
    if not only:
        return list(paths)
    slugs = [slug for slug, _, _ in paths]
    chosen: set[str] = set()
    for selector in (s.strip().lower().replace(" ", "-").replace("_", "-") for s in only.split(",")):
        if not selector:
            continue
        if groups and selector in groups:
            matched = set(groups[selector])
        elif selector in slugs:
            matched = {selector}
        else:
            matched = {slug for slug in slugs if slug.startswith(selector)}
        if not matched:
            names = ", ".join(slugs + sorted(groups or {}))
            raise SystemExit(f"--only: {selector!r} matches no path (paths: {names})")
        chosen |= matched
    return [path for path in paths if path[0] in chosen]


# ----------------------------------------------------------------------------------------------------------
# Server subprocesses


class ServerProcess:
    """A server subprocess that prints one JSON line per dataset on stdout when ready.

    Its stderr goes to a temporary file (quoted in errors). :meth:`stop` (also the context-manager exit)
    sends SIGTERM, waits, and kills it if it does not exit; it is safe to call more than once.
    """

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.argv = list(argv)
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        self._pending = b""
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
            env=env,
            cwd=cwd,
        )

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def read_json_lines(self, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait for ``count`` JSON lines on stdout; raises :class:`Unavailable` if it exits or times out."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        lines: list[dict[str, Any]] = []
        while len(lines) < count:
            if b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                if line.strip():
                    try:
                        lines.append(json.loads(line))
                    except ValueError:
                        raise Unavailable(f"{self._name()} printed {line[:200]!r}, not JSON") from None
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"{self._name()} not ready after {timeout:g} s{self._stderr_tail()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.proc.wait(timeout=5)
                    raise Unavailable(f"{self._name()} exited with status {code}{self._stderr_tail()}")
                self._pending += chunk
        return lines

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()

    def _name(self) -> str:
        return " ".join(Path(a).name if i < 2 else a for i, a in enumerate(self.argv[:4]))

    def _stderr_tail(self, limit: int = 1500) -> str:
        with contextlib.suppress(ValueError, OSError):
            self._stderr.seek(0)
            text = self._stderr.read().decode(errors="replace").strip()
            if text:
                return ": ..." + text[-limit:] if len(text) > limit else ": " + text
        return ""


def subprocess_env() -> dict[str, str]:
    """The environment for server subprocesses: the repository root first on PYTHONPATH."""
    env = dict(os.environ)
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def start_server(
    stack: contextlib.ExitStack, argv: Sequence[str], *, lines: int = 1, timeout: float = 60.0
) -> list[dict[str, Any]]:
    """Start a :class:`ServerProcess` stopped by ``stack``; return its ready lines. Its pid goes to every
    :func:`collect_servers` list open (so that :func:`measure` reads its CPU time)."""
    server = stack.enter_context(ServerProcess(argv, env=subprocess_env(), cwd=REPO_ROOT))
    for pids in _SERVER_COLLECTORS:
        pids.append(server.proc.pid)
    return server.read_json_lines(lines, timeout=timeout)


def anchor_server_argv(kind: str, path: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), kind, str(path)]


# ----------------------------------------------------------------------------------------------------------
# Anchor paths


def numpy_copy(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """One ``np.copyto`` per batch of the batch's bytes, cycling through >= 64 MiB source and target rings."""
    size = dataset.payload_bytes // dataset.num_batches
    slots = max(1, -(-NUMPY_RING_BYTES // size))
    source = np.ones(slots * size, dtype=np.uint8)
    destination = np.ones(slots * size, dtype=np.uint8)
    sources = [source[i * size : (i + 1) * size] for i in range(slots)]
    destinations = [destination[i * size : (i + 1) * size] for i in range(slots)]
    count, rows = dataset.num_batches, dataset.num_rows

    def transfer() -> Consumed:
        for i in range(count):
            slot = i % slots
            np.copyto(destinations[slot], sources[slot])
        return Consumed(count, rows)

    return transfer


def flight_do_get(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """``FlightClient.do_get(ticket)`` from a pyarrow.flight server subprocess, read batch by batch."""
    from pyarrow import flight

    (info,) = start_server(stack, anchor_server_argv("serve-flight", dataset.path))
    client = flight.FlightClient(info["uri"])
    stack.callback(client.close)
    ticket = flight.Ticket(info["ticket"].encode())

    def transfer() -> Consumed:
        return consume(client.do_get(ticket).to_reader())

    return transfer


def ipc_stream_socket(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """``pa.ipc.open_stream`` over a TCP connection to a subprocess that writes the IPC stream."""
    (info,) = start_server(stack, anchor_server_argv("serve-ipc", dataset.path))
    address = (HOST, int(info["port"]))

    def transfer() -> Consumed:
        with (
            socket.create_connection(address) as sock,
            sock.makefile("rb", buffering=IPC_SOCKET_BUFFER) as file,
        ):
            return consume(pa.ipc.open_stream(file))

    return transfer


def _ucx_anchor_module() -> Any:
    """``_ucx_anchor``, imported the way this module was (as ``benchmarks._ucx_anchor`` or top-level)."""
    import importlib

    return importlib.import_module(f"{__package__}._ucx_anchor" if __package__ else "_ucx_anchor")


def ucxx_raw(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """Raw ucxx tagged sends of each batch's bytes, cut from the memory-mapped file (``_ucx_anchor.py``)."""
    return _ucx_anchor_module().ucxx_raw(dataset, stack)  # type: ignore[no-any-return]


def ucxx_raw_blocking(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """The same, each side waiting on its worker's epoll descriptor instead of spinning (as dissoc does)."""
    return _ucx_anchor_module().ucxx_raw(dataset, stack, progress="blocking")  # type: ignore[no-any-return]


def ucxx_raw_anon(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """The same, sent from anonymous memory (numpy, huge pages) instead of the file mapping."""
    return _ucx_anchor_module().ucxx_raw(dataset, stack, source="anon")  # type: ignore[no-any-return]


def ucxx_raw_listener(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """The same over an endpoint connected to the sender's listener (TCP here): the listener path's anchor."""
    return _ucx_anchor_module().ucxx_raw(dataset, stack, connect="listener")  # type: ignore[no-any-return]


def ucxx_raw_listener_2msg(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """:func:`ucxx_raw_listener` sending each batch as two messages (256 bytes, then the body), the message
    count of the Dissociated IPC mapping (metadata, then body): the like-for-like anchor of the listener and
    reference-style paths."""
    return _ucx_anchor_module().ucxx_raw(dataset, stack, connect="listener", messages=2)  # type: ignore[no-any-return]


#: The anchors in table order: (slug, label, path).
ANCHORS: list[tuple[str, str, PathFactory]] = [
    ("numpy-copy", "numpy copy", numpy_copy),
    ("flight-do-get", "flight do_get", flight_do_get),
    ("ipc-stream-socket", "ipc stream socket", ipc_stream_socket),
    ("ucxx-raw", "ucxx raw", ucxx_raw),
    ("ucxx-raw-blocking", "ucxx raw blocking", ucxx_raw_blocking),
    ("ucxx-raw-anon", "ucxx raw anon-mem", ucxx_raw_anon),
    ("ucxx-raw-listener", "ucxx raw listener", ucxx_raw_listener),
    ("ucxx-raw-listener-2msg", "ucxx raw listener 2-msg", ucxx_raw_listener_2msg),
]


# ----------------------------------------------------------------------------------------------------------
# Server entry points (subprocess side)


def _print_ready(info: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()


def _exit_on_sigterm() -> None:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))


def serve_flight(path: Path) -> None:
    """Serve the file's table under its stem with ``flight.RecordBatchStream`` until SIGTERM/SIGINT."""
    from pyarrow import flight

    tables = {path.stem.encode(): load_table(path)}

    class Server(flight.FlightServerBase):  # type: ignore[misc]
        def do_get(self, context: Any, ticket: Any) -> Any:
            table = tables.get(ticket.ticket)
            if table is None:
                raise flight.FlightServerError(f"unknown ticket {ticket.ticket!r}")
            return flight.RecordBatchStream(table)

    server = Server(f"grpc://{HOST}:0")
    _print_ready({"ticket": path.stem, "uri": f"grpc://{HOST}:{server.port}"})
    server.serve()  # returns on SIGINT/SIGTERM


def serve_ipc(path: Path) -> None:
    """Accept connections one at a time; write the file's batches to each as an IPC stream, then close it."""
    table = load_table(path)
    _exit_on_sigterm()
    with socket.create_server((HOST, 0)) as listener:
        port = listener.getsockname()[1]
        _print_ready({"ticket": path.stem, "uri": f"tcp://{HOST}:{port}", "port": port})
        while True:
            conn, _ = listener.accept()
            with (
                contextlib.suppress(OSError, pa.ArrowException),
                conn,
                conn.makefile("wb", buffering=IPC_SOCKET_BUFFER) as sink,
                pa.ipc.new_stream(sink, table.schema) as writer,
            ):
                writer.write_table(table)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="anchor servers of the throughput benchmarks")
    parser.add_argument("kind", choices=["serve-flight", "serve-ipc"])
    parser.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        (serve_flight if args.kind == "serve-flight" else serve_ipc)(args.path)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    main()
