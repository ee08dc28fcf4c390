"""Live streams: a producer appends while readers follow, dissoc against an Arrow Flight relay (not run by
pytest).

Every batch is 16 KiB: 1024 rows of 2 int64 columns, ``t`` and ``c1``. Each one is made fresh (``t`` is a new
buffer; ``c1`` is shared by all, it is never written) and, immediately before it is handed over, row 0 of
``t`` gets ``time.monotonic_ns()`` (CLOCK_MONOTONIC: one clock for every process on Linux; ``perf_counter``
is per process) and row 1 its sequence number. A reader takes ``time.monotonic_ns()`` as it receives the
batch: the difference is the batch's **end-to-end latency**, from the producer's hand-over to the reader's
batch, and the sequence numbers must arrive 0, 1, 2... with none missing.

The two systems, each started once and kept for the whole run:

- ``dissoc``: a ``dissoc.server.Server`` subprocess (``serve-dissoc``); for each run it ``publish``es a
  stream (``max_batches=10_000``, ``on_full="block"``) and appends to it from a thread of that process, as
  the API is meant to be used, then closes it. Readers follow ``NAME@earliest`` with
  ``dissoc.client.stream_batches`` over TCP (``ClientOptions(timeout=--timeout)``).
- ``flight relay`` (the anchor): what Flight users write for this, as Flight has no live streams. A
  pyarrow.flight relay server subprocess (``serve-relay``) accepts a ``DoPut`` from the producer and hands
  each batch, as it arrives, to a queue per ``DoGet`` reader (bounded at the same 10,000 batches, so that
  the slowest reader holds the producer back, as ``on_full="block"`` does); each ``DoGet`` streams its queue
  (``flight.GeneratorStream``). The producer is a separate process (``produce-relay``) writing the batches
  with ``FlightClient.do_put``: a producer must be a client of a Flight server, so the relay's batches cross
  one more connection (and are decoded and encoded again) than dissoc's. That is the cost the comparison
  is about, and it is why dissoc's producer lives in the server process and the relay's does not.

Readers are subprocesses of their own (``read``), one per reader, started once and reused by every run of
both systems (so 16 readers are 16 interpreters: no reader shares a GIL with another, or with a server).
Before each run the producer waits until every reader is attached (dissoc: ``describe()["readers"]``; the
relay: a ``readers`` action counting its queues), then appends. The garbage collector is off in the readers
while they read, and in the producer's process (and the relay's) while the producer appends.

Rows (each figure the median over ``--repeat`` runs; systems alternate run by run):

- ``latency R/s``: 1 reader; the producer paces its appends at R batches/s (``--rates``, default 1,000 and
  100,000) on an absolute schedule, sleeping between them (never spinning: a spinning producer thread
  would hold the dissoc server's GIL). When the machine cannot keep the rate the producer goes as fast as it
  can and ``append/s`` says what it achieved. Each run lasts ``--seconds`` (at most ``--max-batches``).
- ``throughput N rdr``: N readers (``--readers``, default 1, 4 and 16) follow ``--batches`` batches appended
  as fast as the producer can.

Columns: ``asked/s`` the pace asked (``max``: none); ``append/s`` the producer's achieved rate (batches over
the time from its first hand-over to the return of its last); ``recv/s`` every reader's batches together
over the time from the first hand-over to the last batch received by any reader (aggregate; per reader, it
is this over N); ``p50``/``p99``/``max`` the latencies of every batch every reader received in the run;
``cpu us/b`` the CPU microseconds per batch appended of the producer side (dissoc: its server process; the
relay: the relay server and the producer process) / of all the readers together per batch received. The
``vs relay`` columns are dissoc over the relay in the same run: for latency the relay's time over dissoc's
(how many times lower), for ``recv/s`` dissoc's over the relay's. The issue's targets are checked below
the table: p99 latency at least 5x lower than the relay, and ``recv/s`` at least 2x with 4 readers.

Run from the repository root::

    .venv/bin/python benchmarks/live.py --quick          # < 1 min
    .venv/bin/python benchmarks/live.py                  # 5 s latency runs, 20k-batch throughput runs, x3
    .venv/bin/python benchmarks/live.py --rates 1000 --readers 4 --repeat 5 --json > live.json

Subprocess entry points (started by this script; each answers JSON lines)::

    python benchmarks/live.py serve-dissoc    # {"uri"}; then commands on stdin: run, drop
    python benchmarks/live.py serve-relay     # {"uri"}; serves until SIGTERM
    python benchmarks/live.py produce-relay   # {"ready"}; then commands on stdin: run
    python benchmarks/live.py read            # {"ready"}; then commands on stdin: read
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa

try:
    from benchmarks import _anchors as anchors
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import _anchors as anchors  # type: ignore[no-redef, import-not-found]

if str(anchors.REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(anchors.REPO_ROOT))

THIS = Path(__file__).resolve()
ROWS = 1024
SCHEMA = pa.schema([("t", pa.int64()), ("c1", pa.int64())])
BATCH_BYTES = ROWS * 8 * len(SCHEMA)  # 16 KiB
#: Batches a stream holds for its readers (dissoc's ``max_batches``), and each relay reader's queue bound.
RETENTION = 10_000
DISSOC, RELAY = "dissoc", "flight relay"
SYSTEMS = (RELAY, DISSOC)  # the anchor first: each dissoc run follows the relay's
SLUGS = {"dissoc": DISSOC, "relay": RELAY}
#: The issue's targets: dissoc's p99 latency this many times lower than the relay's, and its aggregate
#: throughput this many times the relay's with TARGET_READERS readers.
TARGET_P99 = 5.0
TARGET_THROUGHPUT = 2.0
TARGET_READERS = 4

#: Full-size and ``--quick`` settings.
DEFAULTS = {"seconds": 5.0, "max_batches": 50_000, "batches": 20_000, "repeat": 3}
QUICK = {"seconds": 1.0, "max_batches": 10_000, "batches": 5_000, "repeat": 1}
WARMUP_BATCHES = 300


class BenchmarkError(Exception):
    """A run went wrong (a reader missed a batch, a process failed or did not answer)."""


# ----------------------------------------------------------------------------------------------------------
# The producer's side (both systems)


class BatchMaker:
    """Fresh batches of :data:`SCHEMA`: ``t`` a new buffer each time (the stream keeps batches, and encodes
    them when a reader first needs them: a buffer must never be reused), ``c1`` one shared array."""

    def __init__(self) -> None:
        self._base = np.arange(ROWS, dtype=np.int64)
        self._c1 = pa.array(self._base + 1)

    def make(self, seq: int) -> tuple[np.ndarray, pa.RecordBatch]:
        """The batch numbered ``seq``, and the numpy array under its ``t`` column (row 0 is for the stamp)."""
        t = self._base.copy()
        t[1] = seq
        return t, pa.RecordBatch.from_arrays([pa.array(t), self._c1], schema=SCHEMA)


def produce(append: Callable[[pa.RecordBatch], Any], count: int, rate: float | None) -> dict[str, Any]:
    """Hand ``count`` batches to ``append``, each stamped just before; paced at ``rate`` batches/s on an
    absolute schedule (None: as fast as possible). It sleeps until a batch is due, never spins: a spinning
    thread would hold the GIL the dissoc server's event loop needs; a batch that is late goes at once."""
    maker = BatchMaker()
    period = 1e9 / rate if rate else 0.0
    gc.collect()
    gc.disable()
    try:
        first = time.monotonic_ns()
        for i in range(count):
            t, batch = maker.make(i)
            if period and i:  # (the schedule counts from the first batch's hand-over, however late it was)
                delay = first + i * period - time.monotonic_ns()
                if delay > 0:
                    time.sleep(delay / 1e9)
            now = time.monotonic_ns()
            t[0] = now  # the arrow array is a view of ``t``: the batch carries the stamp
            if i == 0:
                first = now
            append(batch)
        end = time.monotonic_ns()
    finally:
        gc.enable()
    return {"batches": count, "first_ns": first, "end_ns": end, "rate": count / max(end - first, 1) * 1e9}


def wait_until(ready: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise BenchmarkError(f"{what}: not after {timeout:g} s")
        time.sleep(0.002)


# ----------------------------------------------------------------------------------------------------------
# The reader's side (both systems)


class Receipts:
    """What one reader received: each batch's latency, checked to come in sequence."""

    def __init__(self, expected: int) -> None:
        self.latency = np.zeros(expected, dtype=np.int64)
        self.count = 0
        self.first_ns = self.last_ns = 0

    def add(self, batch: pa.RecordBatch, now: int) -> None:
        column = batch.column(0)
        # (Not ``to_numpy()``: its first call in a process imports pandas, 0.3 s of the first run's latency.)
        t = np.frombuffer(column.buffers()[1], dtype=np.int64, count=2, offset=column.offset * 8)
        if int(t[1]) != self.count or self.count >= len(self.latency):
            raise BenchmarkError(
                f"batch {int(t[1])} arrived where batch {self.count} was due ({len(self.latency)} sent)"
            )
        self.latency[self.count] = now - int(t[0])
        self.count += 1
        if self.count == 1:
            self.first_ns = now
        self.last_ns = now


async def _read_dissoc(uri: str, ticket: str, receipts: Receipts, timeout: float) -> None:
    from dissoc.client import ClientOptions, stream_batches

    # A finite timeout: ``ClientOptions(timeout=None)`` fails (``loop.time() + None``) as soon as a reader
    # has to wait for a batch, and a live stream's reader waits for every one.
    async for batch in stream_batches(uri, ticket, options=ClientOptions(timeout=timeout)):
        now = time.monotonic_ns()
        receipts.add(batch, now)


def _read_flight(client: Any, ticket: str, receipts: Receipts) -> None:
    from pyarrow import flight

    reader = client.do_get(flight.Ticket(ticket.encode()))
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            return
        now = time.monotonic_ns()
        receipts.add(chunk.data, now)


# ----------------------------------------------------------------------------------------------------------
# Subprocess entry points


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _failure(exc: BaseException) -> dict[str, Any]:
    """The answer to a command that failed (the traceback goes to stderr, quoted when the process dies)."""
    traceback.print_exc()
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return {"error": f"{type(exc).__name__}: {exc} (at {Path(frame.filename).name}:{frame.lineno})"}


def reader_main() -> None:
    """``read``: for each ``{"op": "read", "system", "uri", "ticket", "expected", "out"}`` on stdin, follow
    the stream to its end, save the latencies (ns, int64) to ``out`` (.npy) and answer what it received."""
    from pyarrow import flight

    import dissoc.client  # noqa: F401  (imported before any run)

    loop = asyncio.new_event_loop()
    clients: dict[str, Any] = {}
    _emit({"ready": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        try:
            receipts = Receipts(int(command["expected"]))
            uri, ticket = str(command["uri"]), str(command["ticket"])
            gc.collect()
            gc.disable()
            try:
                if command["system"] == DISSOC:
                    loop.run_until_complete(_read_dissoc(uri, ticket, receipts, float(command["timeout"])))
                else:
                    client = clients.get(uri) or clients.setdefault(uri, flight.FlightClient(uri))
                    _read_flight(client, ticket, receipts)
            finally:
                gc.enable()
            np.save(command["out"], receipts.latency[: receipts.count])
            _emit({"received": receipts.count, "first_ns": receipts.first_ns, "last_ns": receipts.last_ns})
        except Exception as exc:
            _emit(_failure(exc))


async def _serve_dissoc() -> None:
    """``serve-dissoc``: a dissoc server that is also the producer. ``{"op": "run", "name", "readers",
    "batches", "rate", "timeout"}`` publishes NAME, answers ``published``, appends (from a thread) once the
    readers are attached, closes the stream and answers ``produced``; ``{"op": "drop", "name"}`` removes
    it."""
    from dissoc.server import Server

    async with Server({}, host=anchors.HOST, port=0) as server:
        _emit({"uri": server.uri})
        while line := await asyncio.to_thread(sys.stdin.readline):
            try:
                await _dissoc_command(server, json.loads(line))
            except Exception as exc:
                _emit(_failure(exc))


async def _dissoc_command(server: Any, command: dict[str, Any]) -> None:
    name = str(command["name"])
    if command["op"] == "drop":
        server.remove(name)
        _emit({"dropped": name})
        return
    stream = server.publish(name, SCHEMA, max_batches=RETENTION, on_full="block")
    _emit({"published": name})
    readers = int(command["readers"])
    await asyncio.to_thread(
        wait_until,
        lambda: int(stream.describe()["readers"]) >= readers,
        float(command["timeout"]),
        f"{readers} readers of {name}",
    )
    produced = await asyncio.to_thread(produce, stream.append, int(command["batches"]), command["rate"])
    stream.close()
    _emit({"produced": produced})


class _Channel:
    """One relayed stream: its schema (from the DoPut) and a queue per DoGet reader (copied on write)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.schema: pa.Schema | None = None
        self.queues: tuple[queue.Queue[pa.RecordBatch | None], ...] = ()


def serve_relay() -> None:
    """``serve-relay``: the anchor. DoPut(path NAME) relays each batch, as it arrives, to every DoGet(NAME)
    reader's queue (bounded: a full one holds the DoPut back); action ``readers`` (body NAME) counts them."""
    from pyarrow import flight

    channels: dict[str, _Channel] = {}
    lock = threading.Lock()

    def channel(name: str) -> _Channel:
        with lock:
            return channels.setdefault(name, _Channel())

    class Relay(flight.FlightServerBase):  # type: ignore[misc]
        def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
            name = descriptor.path[0].decode()
            relayed = channel(name)
            with relayed.cond:
                relayed.schema = reader.schema
                relayed.cond.notify_all()
            gc.disable()
            try:
                while True:
                    try:
                        batch = reader.read_chunk().data
                    except StopIteration:
                        break
                    for q in relayed.queues:
                        q.put(batch)
            finally:
                for q in relayed.queues:
                    q.put(None)
                with lock:
                    channels.pop(name, None)
                gc.enable()

        def do_get(self, context: Any, ticket: Any) -> Any:
            relayed = channel(ticket.ticket.decode())
            mine: queue.Queue[pa.RecordBatch | None] = queue.Queue(maxsize=RETENTION)
            with relayed.cond:
                relayed.queues = (*relayed.queues, mine)
                if not relayed.cond.wait_for(lambda: relayed.schema is not None, timeout=60):
                    raise flight.FlightServerError(f"no producer for {ticket.ticket!r}")

            def batches() -> Iterator[pa.RecordBatch]:
                while (batch := mine.get()) is not None:
                    yield batch

            return flight.GeneratorStream(relayed.schema, batches())

        def do_action(self, context: Any, action: Any) -> Iterator[Any]:
            if action.type != "readers":
                raise flight.FlightServerError(f"unknown action {action.type!r}")
            yield flight.Result(str(len(channel(action.body.to_pybytes().decode()).queues)).encode())

    server = Relay(f"grpc://{anchors.HOST}:0")
    _emit({"uri": f"grpc://{anchors.HOST}:{server.port}"})
    server.serve()  # returns on SIGINT/SIGTERM


def produce_relay() -> None:
    """``produce-relay``: for each ``{"op": "run", "uri", "name", "readers", "batches", "rate", "timeout"}``
    on stdin, open a DoPut of NAME to the relay (answering ``published``), wait for its readers, write the
    batches and answer ``produced``."""
    clients: dict[str, Any] = {}
    _emit({"ready": os.getpid()})
    for line in sys.stdin:
        try:
            _relay_command(clients, json.loads(line))
        except Exception as exc:
            _emit(_failure(exc))


def _relay_command(clients: dict[str, Any], command: dict[str, Any]) -> None:
    from pyarrow import flight

    uri, name, readers = str(command["uri"]), str(command["name"]), int(command["readers"])
    client = clients.get(uri) or clients.setdefault(uri, flight.FlightClient(uri))
    writer, _ = client.do_put(flight.FlightDescriptor.for_path(name), SCHEMA)
    _emit({"published": name})

    def attached() -> bool:
        (result,) = client.do_action(flight.Action("readers", name.encode()))
        return int(result.body.to_pybytes()) >= readers

    wait_until(attached, float(command["timeout"]), f"{readers} readers of {name}")
    produced = produce(writer.write_batch, int(command["batches"]), command["rate"])
    writer.done_writing()
    writer.close()
    _emit({"produced": produced})


# ----------------------------------------------------------------------------------------------------------
# Driving the subprocesses


class Worker(anchors.ServerProcess):
    """A subprocess of this script told what to do by JSON lines on its stdin; it answers with JSON lines
    (its first says it is ready). Stopping it closes its stdin first (it then exits by itself)."""

    def __init__(self, command: str) -> None:
        self.argv = [sys.executable, str(THIS), command]
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        self._pending = b""
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
            env=anchors.subprocess_env(),
            cwd=anchors.REPO_ROOT,
        )

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def answer(self, timeout: float, expect: str | None = None) -> dict[str, Any]:
        (line,) = self.read_json_lines(1, timeout=timeout)
        if "error" in line:
            raise BenchmarkError(f"{self._name()}: {line['error']}")
        if expect is not None and expect not in line:
            raise BenchmarkError(f"{self._name()} answered {line}, not {expect!r}")
        return line

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2)
        super().stop(timeout)


@dataclass
class Run:
    """One run of one system: what the producer and every reader reported."""

    system: str
    readers: int
    batches: int
    rate: float | None
    append_rate: float
    received: int
    recv_rate: float
    p50_us: float
    p99_us: float
    max_us: float
    producer_cpu_us: float | None = None
    reader_cpu_us: float | None = None


class Session:
    """The servers, producers and reader processes of the systems measured, started once."""

    def __init__(self, systems: Sequence[str], readers: int, directory: Path, timeout: float) -> None:
        self.systems = list(systems)
        self.max_readers = readers
        self.directory = directory
        self.timeout = timeout
        self.stack = contextlib.ExitStack()
        self.producers: dict[str, Worker] = {}
        self.uris: dict[str, str] = {}
        self.pids: dict[str, list[int]] = {}
        self.readers: list[Worker] = []
        self._names = itertools.count()

    def __enter__(self) -> Session:
        try:
            self._start()
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def _worker(self, command: str) -> Worker:
        worker = Worker(command)
        self.stack.enter_context(worker)
        return worker

    def _start(self) -> None:
        started: list[Worker] = []
        if DISSOC in self.systems:
            self.producers[DISSOC] = self._worker("serve-dissoc")
            started.append(self.producers[DISSOC])
        if RELAY in self.systems:
            relay = self.stack.enter_context(
                anchors.ServerProcess(
                    [sys.executable, str(THIS), "serve-relay"],
                    env=anchors.subprocess_env(),
                    cwd=anchors.REPO_ROOT,
                )
            )
            (info,) = relay.read_json_lines(1, timeout=60.0)
            self.uris[RELAY] = str(info["uri"])
            self.producers[RELAY] = self._worker("produce-relay")
            started.append(self.producers[RELAY])
            self.pids[RELAY] = [relay.proc.pid, self.producers[RELAY].proc.pid]
        self.readers = [self._worker("read") for _ in range(self.max_readers)]
        if DISSOC in self.producers:
            (info,) = self.producers[DISSOC].read_json_lines(1, timeout=60.0)
            self.uris[DISSOC] = str(info["uri"])
            self.pids[DISSOC] = [self.producers[DISSOC].proc.pid]
        if RELAY in self.producers:
            self.producers[RELAY].read_json_lines(1, timeout=60.0)
        for reader in self.readers:
            reader.read_json_lines(1, timeout=60.0)

    def run(self, system: str, readers: int, batches: int, rate: float | None) -> Run:
        """One run: publish, start the readers, let the producer go, collect what everyone saw."""
        name = f"live{next(self._names)}"
        producer = self.producers[system]
        producer.send(
            {
                "op": "run",
                "uri": self.uris[system],
                "name": name,
                "readers": readers,
                "batches": batches,
                "rate": rate,
                "timeout": self.timeout,
            }
        )
        producer.answer(self.timeout, "published")
        ticket = f"{name}@earliest" if system == DISSOC else name
        chosen = self.readers[:readers]
        reader_pids = [r.proc.pid for r in chosen]
        producer_cpu = anchors.cpu_sample(self.pids[system])
        reader_cpu = anchors.cpu_sample(reader_pids)
        outs = [self.directory / f"{name}-{i}.npy" for i in range(readers)]
        for reader, out in zip(chosen, outs, strict=True):
            reader.send(
                {
                    "op": "read",
                    "system": system,
                    "uri": self.uris[system],
                    "ticket": ticket,
                    "expected": batches,
                    "out": str(out),
                    "timeout": self.timeout,
                }
            )
        produced = producer.answer(self.timeout, "produced")["produced"]
        got = [reader.answer(self.timeout, "received") for reader in chosen]
        producer_after = anchors.cpu_sample(self.pids[system])
        reader_after = anchors.cpu_sample(reader_pids)
        if system == DISSOC:
            producer.send({"op": "drop", "name": name})
            producer.answer(self.timeout, "dropped")
        latencies = []
        for out in outs:
            latencies.append(np.load(out))
            out.unlink()
        for i, line in enumerate(got):
            if line["received"] != batches:
                raise BenchmarkError(f"reader {i} received {line['received']} of {batches} batches")
        lat_us = np.concatenate(latencies) / 1e3
        p50, p99 = np.percentile(lat_us, [50, 99])
        received = sum(int(line["received"]) for line in got)
        span = max(int(line["last_ns"]) for line in got) - int(produced["first_ns"])
        return Run(
            system=system,
            readers=readers,
            batches=batches,
            rate=rate,
            append_rate=float(produced["rate"]),
            received=received,
            recv_rate=received / max(span, 1) * 1e9,
            p50_us=float(p50),
            p99_us=float(p99),
            max_us=float(lat_us.max()),
            producer_cpu_us=_cpu_us(producer_cpu, producer_after, batches),
            reader_cpu_us=_cpu_us(reader_cpu, reader_after, received),
        )


def _cpu_us(before: anchors.CpuSample | None, after: anchors.CpuSample | None, count: int) -> float | None:
    if before is None or after is None or not count:
        return None
    return anchors.cpu_between(before, after) / count * 1e6


# ----------------------------------------------------------------------------------------------------------
# Scenarios and results


@dataclass(frozen=True)
class Scenario:
    """A pair of rows: ``readers`` readers, ``batches`` batches appended at ``rate`` (None: at full speed)."""

    name: str
    kind: str  # "latency" or "throughput"
    readers: int
    batches: int
    rate: float | None


def scenarios(
    rates: Sequence[float], readers: Sequence[int], *, seconds: float, max_batches: int, batches: int
) -> list[Scenario]:
    out = [
        Scenario(
            f"latency {_rate(rate)}/s", "latency", 1, max(1, min(int(rate * seconds), max_batches)), rate
        )
        for rate in rates
    ]
    out += [Scenario(f"throughput {n} rdr", "throughput", n, batches, None) for n in readers]
    return out


@dataclass
class Row:
    """Every run of one system in one scenario."""

    scenario: Scenario
    system: str
    runs: list[Run] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.runs)

    def median(self, metric: str) -> float | None:
        values = [getattr(r, metric) for r in self.runs]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values and self.error is None else None


def ratio(rows: Sequence[Row], row: Row, metric: str) -> float | None:
    """dissoc against the relay in the same scenario: the relay's latency over the row's (how many times
    lower), or the row's ``recv_rate`` over the relay's (how many times more)."""
    anchor = next((r for r in rows if r.system == RELAY and r.scenario == row.scenario), None)
    if anchor is None:
        return None
    mine, theirs = row.median(metric), anchor.median(metric)
    if mine is None or theirs is None or mine <= 0 or theirs <= 0:
        return None
    return mine / theirs if metric == "recv_rate" else theirs / mine


def _rate(rate: float | None) -> str:
    if rate is None:
        return "max"
    return f"{rate / 1000:g}k" if rate >= 1000 else f"{rate:g}"


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.0f} us"


def _cpu(row: Row, metric: str) -> str:
    value = row.median(metric)
    return "-" if value is None else f"{value:.0f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


HEADER = [
    "scenario",
    "system",
    "rdrs",
    "asked/s",
    "append/s",
    "recv/s",
    "p50",
    "p99",
    "max",
    "cpu us/b",
    "p50 vs relay",
    "p99 vs relay",
    "recv vs relay",
]


def format_table(rows: Sequence[Row]) -> str:
    lines: list[list[str]] = []
    for row in rows:
        s = row.scenario
        cells = [s.name, row.system, str(s.readers), _rate(s.rate)]
        if not row.ok:
            lines.append([*cells, str(row.error or "no run")])
            continue

        cells += [
            f"{row.median('append_rate') or 0:,.0f}",
            f"{row.median('recv_rate') or 0:,.0f}",
            _us(row.median("p50_us")),
            _us(row.median("p99_us")),
            _us(row.median("max_us")),
            f"{_cpu(row, 'producer_cpu_us')}/{_cpu(row, 'reader_cpu_us')}",
            _x(ratio(rows, row, "p50_us")),
            _x(ratio(rows, row, "p99_us")),
            _x(ratio(rows, row, "recv_rate")),
        ]
        lines.append(cells)
    widths = [len(h) for h in HEADER]
    for cells in lines:
        if len(cells) == len(HEADER):
            for i, cell in enumerate(cells):
                widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        if len(cells) < len(HEADER):
            head = "  ".join(f"{c:<{w}}" for c, w in zip(cells[:-1], widths, strict=False))
            return f"{head}  {cells[-1]}"
        return "  ".join(
            f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(HEADER), "  ".join("-" * w for w in widths), *(line(cells) for cells in lines)]
    out.append(
        "(recv/s: all readers together; cpu us/b: producer side per batch appended / all readers per batch "
        "received; vs relay: how many times lower dissoc's latency, how many times more its recv/s)"
    )
    return "\n".join(out)


def check_targets(rows: Sequence[Row]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []
    for row in rows:
        if row.system != DISSOC:
            continue
        s = row.scenario
        if s.kind == "latency":
            what, metric, target = f"p99 latency, {s.name}", "p99_us", TARGET_P99
        elif s.readers == TARGET_READERS:
            what, metric, target = f"recv/s, {s.name}", "recv_rate", TARGET_THROUGHPUT
        else:
            continue
        value = ratio(rows, row, metric)
        checks.append(
            {
                "what": what,
                "vs_relay": None if value is None else round(value, 3),
                "target": target,
                "met": None if value is None else value >= target,
            }
        )
    return checks


def format_targets(checks: Sequence[dict[str, Any]]) -> str:
    out = [
        f"targets (dissoc vs the Flight relay, same run): p99 latency >= {TARGET_P99:g}x lower, "
        f"recv/s >= {TARGET_THROUGHPUT:g}x with {TARGET_READERS} readers"
    ]
    for check in checks:
        value = check["vs_relay"]
        verdict = "-" if value is None else f"{value:.2f}x ({'met' if check['met'] else 'MISSED'})"
        out.append(f"  {check['what']:<32} {verdict}")
    return "\n".join(out)


def run_all(
    systems: Sequence[str],
    plan: Sequence[Scenario],
    *,
    repeat: int,
    warmup: int,
    timeout: float,
    tmpdir: str | None,
    rows: list[Row],
    progress: Callable[[str], None],
) -> None:
    """Every scenario, ``repeat`` runs of each system in turn, appending to ``rows`` as it goes. A failed
    run marks its row and restarts every process (a reader may be stuck in the failed stream)."""
    by_key = {(s, system): Row(s, system) for s in plan for system in systems}
    rows.extend(by_key.values())
    most = max(s.readers for s in plan)
    with (
        tempfile.TemporaryDirectory(prefix="dissoc-live-bench-", dir=tmpdir) as directory,
        contextlib.ExitStack() as outer,
    ):
        session: Session | None = None

        def open_session() -> Session:
            progress(f"# starting {', '.join(systems)} and {most} reader processes")
            opened = Session(systems, most, Path(directory), timeout).__enter__()
            try:
                for system in systems:
                    for _ in range(warmup):
                        opened.run(system, most, WARMUP_BATCHES, None)
            except BaseException:
                opened.__exit__()
                raise
            return opened

        for scenario in plan:
            for i in range(repeat):
                for system in systems:
                    row = by_key[(scenario, system)]
                    if row.error:
                        continue
                    if session is None:
                        try:
                            session = open_session()
                        except (BenchmarkError, anchors.Unavailable, OSError, ValueError) as exc:
                            error = f"error: could not start: {type(exc).__name__}: {exc}"
                            progress(f"  {error}")
                            for other in rows:
                                other.error = other.error or (None if other.runs else error)
                            return
                        outer.callback(session.__exit__)
                    try:
                        got = session.run(system, scenario.readers, scenario.batches, scenario.rate)
                    except (BenchmarkError, anchors.Unavailable, OSError, ValueError) as exc:
                        row.error = f"error: {type(exc).__name__}: {exc}"
                        progress(f"  {scenario.name} / {system}: {row.error}")
                        if session is not None:
                            session.__exit__()
                            session = None
                        continue
                    row.runs.append(got)
                    progress(
                        f"  {scenario.name} / {system} [{i + 1}/{repeat}]: append {got.append_rate:,.0f}/s, "
                        f"recv {got.recv_rate:,.0f}/s, p50 {_us(got.p50_us)}, p99 {_us(got.p99_us)}"
                    )


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _numbers(text: str, kind: Callable[[str], Any]) -> list[Any]:
    return [kind(part) for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Live streams: append-to-reader latency and fan-out throughput, dissoc vs Flight relay.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command",
        nargs="?",
        choices=["serve-dissoc", "serve-relay", "produce-relay", "read"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 s latency runs, 5k-batch throughput runs, once"
    )
    parser.add_argument("--repeat", type=int, help="timed runs per system and row (default 3; --quick 1)")
    parser.add_argument(
        "--warmup", type=int, default=1, help=f"untimed runs per system first ({WARMUP_BATCHES} batches)"
    )
    parser.add_argument("--rates", default="1000,100000", help="paced rates of the latency rows (batches/s)")
    parser.add_argument("--readers", default="1,4,16", help="reader counts of the throughput rows")
    parser.add_argument("--seconds", type=float, help="length of a latency run (default 5; --quick 1)")
    parser.add_argument(
        "--max-batches", type=int, help="most batches in a latency run (default 50,000; --quick 10,000)"
    )
    parser.add_argument(
        "--batches", type=int, help="batches of a throughput run (default 20,000; --quick 5,000)"
    )
    parser.add_argument("--only", choices=sorted(SLUGS), help="one system alone (no ratios)")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any step of a run may take")
    parser.add_argument(
        "--tmpdir", help="where readers leave their latencies (default /dev/shm when it has room)"
    )
    args = parser.parse_args(argv)
    if args.command is not None:
        with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
            if args.command == "serve-dissoc":
                asyncio.run(_serve_dissoc())
            elif args.command == "serve-relay":
                serve_relay()
            elif args.command == "produce-relay":
                produce_relay()
            else:
                reader_main()
        return 0

    settings = QUICK if args.quick else DEFAULTS
    repeat = args.repeat if args.repeat is not None else int(settings["repeat"])
    rates = _numbers(args.rates, float)
    readers = _numbers(args.readers, int)
    if repeat < 1 or args.warmup < 0 or any(r <= 0 for r in rates) or any(n < 1 for n in readers):
        parser.error("--repeat and every reader count must be >= 1, rates > 0, --warmup >= 0")
    if not rates and not readers:
        parser.error("nothing to run: give --rates or --readers")
    plan = scenarios(
        rates,
        readers,
        seconds=args.seconds if args.seconds is not None else float(settings["seconds"]),
        max_batches=args.max_batches or int(settings["max_batches"]),
        batches=args.batches or int(settings["batches"]),
    )
    systems = [SLUGS[args.only]] if args.only else list(SYSTEMS)
    tmpdir = args.tmpdir or anchors.default_tmpdir(64 << 20)
    load = os.getloadavg()
    _progress(
        f"# {os.cpu_count()} cpus, load {load[0]:.2f}; {BATCH_BYTES >> 10} KiB batches; repeat {repeat} "
        f"after {args.warmup} warm-up; " + "; ".join(f"{s.name}: {s.batches:,} batches" for s in plan)
    )
    rows: list[Row] = []
    interrupted = False
    try:
        run_all(
            systems,
            plan,
            repeat=repeat,
            warmup=args.warmup,
            timeout=args.timeout,
            tmpdir=tmpdir,
            rows=rows,
            progress=_progress,
        )
    except KeyboardInterrupt:
        interrupted = True
        _progress("# interrupted: partial results")
    checks = check_targets(rows)
    text = format_table(rows) + ("\n\n" + format_targets(checks) if checks else "")
    if args.json:
        print(text, file=sys.stderr)
        report = {
            "quick": args.quick,
            "repeat": repeat,
            "batch_bytes": BATCH_BYTES,
            "rows": [
                {
                    "scenario": r.scenario.name,
                    "kind": r.scenario.kind,
                    "system": r.system,
                    "readers": r.scenario.readers,
                    "batches": r.scenario.batches,
                    "rate_asked": r.scenario.rate,
                    "error": r.error,
                    "runs": [vars(run) for run in r.runs],
                    **{
                        metric: r.median(metric)
                        for metric in ("append_rate", "recv_rate", "p50_us", "p99_us", "max_us")
                    },
                    "vs_relay": {m: ratio(rows, r, m) for m in ("p50_us", "p99_us", "recv_rate")},
                }
                for r in rows
            ],
            "targets": checks,
        }
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(text)
    if interrupted:
        return 130
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
