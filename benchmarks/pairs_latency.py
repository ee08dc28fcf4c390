"""Time to one batch: pairs in shared memory read zero-copy vs Arrow Flight ``do_get`` (not run by pytest).

For each size N (default 1, 16, 64 and 256 MiB) one Arrow IPC file holding a single batch of N MiB (2 int64
columns) is written, and served by server subprocesses:

- ``flight do_get``: a pyarrow.flight server (``flight.RecordBatchStream`` over the memory-mapped table); the
  client (one ``FlightClient``, connected once) calls ``do_get`` and reads the first chunk;
- ``dissoc pairs-shm zero-copy``: ``dissoc.Server(transport="tcp", body="pairs", memory="shm")``; the client
  calls ``dissoc.client.open_stream(..., options=ClientOptions(zero_copy=True))`` and ``read_next_batch()``:
  the batch's buffers are the server's shared-memory segment itself, nothing is copied on the client;
- ``dissoc pairs-shm copy``: the same in copy mode (the client copies the buffers out of the segment), for
  reference;
- ``dissoc zero-copy, placed per request``: zero-copy from a server with ``resident=False``, which copies the
  batch into its arena for every request (what every request cost before placements became resident).

The dissoc servers keep placed batches resident (the default): the warm-up request places the file's batch
in the arena once, and the timed requests are listed the same ranges, with nothing copied by anyone.

Two times per request, both ending when the client holds the batch as a ``pa.RecordBatch``:

- **ask->batch**: from the client's call (``do_get`` / ``open_stream``) on: the time to a batch. It includes
  the dissoc client's connection set-up (one per stream; Flight's client is connected once);
- **ready->batch**: from the moment the server has the batch ready to send: for Flight, when its ``do_get``
  handler is entered (the table is already in memory); for dissoc, when the batch's ranges in the arena are
  listed to the client (found resident, or placed: the server subprocess wraps ``Placements.acquire``). Both
  processes read ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for the whole machine).

Each figure is the median of ``--repeat`` requests after one warm-up; ratios are Flight's median over the
row's (how many times faster than Flight). Target: zero-copy >= 20x faster than Flight.

Run from the repository root::

    .venv/bin/python benchmarks/pairs_latency.py                 # 1, 16, 64, 256 MiB; ~15-30 s
    .venv/bin/python benchmarks/pairs_latency.py --quick         # 1, 16, 64 MiB, fewer repeats
    .venv/bin/python benchmarks/pairs_latency.py --sizes 1,256 --repeat 11 --json

Server entry points (started by this script)::

    python benchmarks/pairs_latency.py serve-flight FILE...   # {"ticket", "uri"} per file, then ready lines
    python benchmarks/pairs_latency.py serve-dissoc FILE...   # {"ticket", "uri", "data_uri"} per file, ...
    python benchmarks/pairs_latency.py serve-dissoc-placing FILE...   # the same with resident=False
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

if __package__:
    from benchmarks import _anchors as anchors
else:  # run as a script: benchmarks/ is sys.path[0]
    import _anchors as anchors  # type: ignore[no-redef, import-not-found]

MiB = 1 << 20
SIZES_MIB = (1, 16, 64, 256)
QUICK_SIZES_MIB = (1, 16, 64)
#: How many times faster than Flight the zero-copy row should be (the issue's target).
TARGET_SPEEDUP = 20.0
ZERO_COPY_LABEL = "dissoc pairs-shm zero-copy"
FLIGHT_LABEL = "flight do_get"

# ----------------------------------------------------------------------------------------------------------
# Data


def write_batch_file(directory: Path, size_mib: int) -> Path:
    """One batch of ``size_mib`` MiB: 2 int64 columns of ``size_mib * 64Ki`` rows."""
    rows = size_mib * MiB // 16
    values = np.arange(rows, dtype=np.int64)
    batch = pa.record_batch([pa.array(values), pa.array(values + 1)], names=["c0", "c1"])
    assert batch.nbytes == size_mib * MiB
    path = directory / f"batch_{size_mib}mib.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return path


# ----------------------------------------------------------------------------------------------------------
# Servers (subprocess side)


def _emit(info: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()


def serve_flight(paths: Sequence[Path]) -> None:
    """Serve each file under its stem; print ``{"ready_ns"}`` when a ``do_get`` starts."""
    from pyarrow import flight

    tables = {path.stem.encode(): anchors.load_table(path) for path in paths}
    lock = threading.Lock()

    class Server(flight.FlightServerBase):  # type: ignore[misc]
        def do_get(self, context: Any, ticket: Any) -> Any:
            ready = time.monotonic_ns()
            table = tables.get(ticket.ticket)
            if table is None:
                raise flight.FlightServerError(f"unknown ticket {ticket.ticket!r}")
            with lock:
                _emit({"ready_ns": ready})
            return flight.RecordBatchStream(table)

    server = Server(f"grpc://{anchors.HOST}:0")
    for path in paths:
        _emit({"ticket": path.stem, "uri": f"grpc://{anchors.HOST}:{server.port}"})
    server.serve()


async def _serve_dissoc(paths: Sequence[Path], resident: bool = True) -> None:
    from dissoc.datasets import dataset_from
    from dissoc.memory.placements import Placements
    from dissoc.server import Server

    original = Placements.acquire

    async def timed_acquire(self: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = await original(self, *args, **kwargs)
        _emit({"ready_ns": time.monotonic_ns()})
        return pairs

    Placements.acquire = timed_acquire  # type: ignore[method-assign]
    datasets = {path.stem: dataset_from(path) for path in paths}
    largest = max(path.stat().st_size for path in paths)
    arena = max(1 << 30, 4 * largest)
    async with Server(
        datasets, transport="tcp", body="pairs", memory="shm", arena_bytes=arena, resident=resident
    ) as server:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        for name in datasets:
            _emit({"ticket": name, "uri": server.uri, "data_uri": server.data_uri, "ready_hook": True})
        await stop.wait()


# ----------------------------------------------------------------------------------------------------------
# Clients


@dataclass
class Timings:
    """Seconds per request of one path at one size (``ready`` empty when the server gives no ready time)."""

    path: str
    size_mib: int
    ask: list[float] = field(default_factory=list)
    ready: list[float] = field(default_factory=list)
    error: str | None = None

    def median(self, which: str) -> float | None:
        values = self.ask if which == "ask" else self.ready
        return statistics.median(values) if values and self.error is None else None


#: Sets up a client for a server's ready lines; returns ``request(ticket) -> (t_asked_ns, t_batch_ns)``.
Request = Callable[[str], tuple[int, int]]


def _flight_client(info: dict[str, Any], stack: contextlib.ExitStack) -> Request:
    from pyarrow import flight

    client = flight.FlightClient(info["uri"])
    stack.callback(client.close)

    def request(ticket: str) -> tuple[int, int]:
        asked = time.monotonic_ns()
        reader = client.do_get(flight.Ticket(ticket.encode()))
        batch = reader.read_chunk().data
        got = time.monotonic_ns()
        assert isinstance(batch, pa.RecordBatch)
        with contextlib.suppress(StopIteration):
            while True:
                reader.read_chunk()
        del batch, reader
        return asked, got

    return request


def _dissoc_client(zero_copy: bool) -> Callable[[dict[str, Any], contextlib.ExitStack], Request]:
    def setup(info: dict[str, Any], stack: contextlib.ExitStack) -> Request:
        if str(anchors.REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(anchors.REPO_ROOT))
        from dissoc.client import ClientOptions, open_stream

        options = ClientOptions(zero_copy=zero_copy)
        data_uri = info.get("data_uri")
        data_uri = None if data_uri in (None, info["uri"]) else data_uri

        def request(ticket: str) -> tuple[int, int]:
            asked = time.monotonic_ns()
            reader = open_stream(info["uri"], ticket, data_uri=data_uri, options=options)
            batch = reader.read_next_batch()
            got = time.monotonic_ns()
            assert isinstance(batch, pa.RecordBatch)
            for _rest in reader:
                pass
            reader.close()
            del batch, reader
            return asked, got

        return request

    return setup


PATHS: list[tuple[str, str, Callable[[dict[str, Any], contextlib.ExitStack], Request]]] = [
    (FLIGHT_LABEL, "serve-flight", _flight_client),
    (ZERO_COPY_LABEL, "serve-dissoc", _dissoc_client(zero_copy=True)),
    ("dissoc pairs-shm copy", "serve-dissoc", _dissoc_client(zero_copy=False)),
    ("dissoc zero-copy, placed per request", "serve-dissoc-placing", _dissoc_client(zero_copy=True)),
]


def measure_path(
    label: str,
    kind: str,
    setup: Callable[[dict[str, Any], contextlib.ExitStack], Request],
    files: dict[int, Path],
    *,
    repeat: int,
    warmup: int,
    progress: Callable[[str], None],
) -> list[Timings]:
    """Start the path's server for every file, then time ``warmup + repeat`` requests per size."""
    results = {size: Timings(label, size) for size in files}
    try:
        with contextlib.ExitStack() as stack:
            argv = [sys.executable, str(Path(__file__).resolve()), kind, *map(str, files.values())]
            server = stack.enter_context(
                anchors.ServerProcess(argv, env=anchors.subprocess_env(), cwd=anchors.REPO_ROOT)
            )
            lines = server.read_json_lines(len(files), timeout=60.0)
            by_ticket = {line["ticket"]: line for line in lines}
            hooked = all(line.get("ready_hook", True) for line in lines)
            request = setup(lines[0], stack)
            for size, path in files.items():
                result = results[size]
                progress(f"  {label} / {size} MiB ...")
                try:
                    ticket = by_ticket[path.stem]["ticket"]
                    for i in range(warmup + repeat):
                        gc.collect()
                        gc.disable()
                        try:
                            asked, got = request(ticket)
                        finally:
                            gc.enable()
                        ready = server.read_json_lines(1, timeout=30.0)[0]["ready_ns"] if hooked else None
                        if i >= warmup:
                            result.ask.append((got - asked) / 1e9)
                            if ready is not None:
                                result.ready.append((got - int(ready)) / 1e9)
                    ask, ready_s = _ms(result.median("ask")), _ms(result.median("ready"))
                    progress(f"    ask->batch {ask}, ready->batch {ready_s}")
                except Exception as exc:
                    result.error = f"error: {type(exc).__name__}: {exc}"
                    progress(f"    {result.error}")
                    if isinstance(exc, anchors.Unavailable):
                        break  # the server is gone: the other sizes fail the same way
    except Exception as exc:
        for result in results.values():
            result.error = result.error or f"error: {type(exc).__name__}: {exc}"
        progress(f"    {label}: error: {type(exc).__name__}: {exc}")
    return list(results.values())


# ----------------------------------------------------------------------------------------------------------
# Reporting


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _speedup(flight: float | None, mine: float | None) -> float | None:
    return flight / mine if flight is not None and mine is not None and mine > 0 else None


def format_table(results: Sequence[Timings]) -> str:
    header = ["path", "MiB", "ask->batch", "min", "vs flight", "ready->batch", "min", "vs flight"]
    rows: list[list[str]] = []
    for result in sorted(results, key=lambda r: r.size_mib):
        if result.error:
            rows.append([result.path, str(result.size_mib), result.error])
            continue
        flight = next((r for r in results if r.path == FLIGHT_LABEL and r.size_mib == result.size_mib), None)
        cells = [result.path, str(result.size_mib)]
        for which, values in (("ask", result.ask), ("ready", result.ready)):
            mine = result.median(which)
            ratio = _speedup(flight.median(which) if flight else None, mine)
            cells += [
                _ms(mine),
                _ms(min(values) if values else None),
                "-" if ratio is None else f"{ratio:.1f}x",
            ]
        rows.append(cells)
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row if len(row) == len(header) else row[:2]):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        if len(cells) < len(header):
            return f"{cells[0]:<{widths[0]}}  {cells[1]:>{widths[1]}}  {cells[2]}"
        return "  ".join(
            f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}"
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths), *(line(row) for row in rows)]
    out.append("(vs flight: Flight's median time over the row's, i.e. how many times faster than Flight)")
    return "\n".join(out)


def check_targets(results: Sequence[Timings]) -> list[dict[str, Any]]:
    checks = []
    for result in results:
        if result.path != ZERO_COPY_LABEL:
            continue
        flight = next((r for r in results if r.path == FLIGHT_LABEL and r.size_mib == result.size_mib), None)
        for which in ("ask", "ready"):
            ratio = _speedup(flight.median(which) if flight else None, result.median(which))
            checks.append(
                {
                    "size_mib": result.size_mib,
                    "time": f"{which}->batch",
                    "speedup_vs_flight": None if ratio is None else round(ratio, 2),
                    "target": TARGET_SPEEDUP,
                    "met": None if ratio is None else ratio >= TARGET_SPEEDUP,
                }
            )
    return checks


def format_targets(checks: Sequence[dict[str, Any]]) -> str:
    out = [f"target: {ZERO_COPY_LABEL} >= {TARGET_SPEEDUP:g}x faster than {FLIGHT_LABEL}:"]
    for check in checks:
        ratio = check["speedup_vs_flight"]
        verdict = "-" if ratio is None else f"{ratio:.1f}x ({'met' if check['met'] else 'MISSED'})"
        out.append(f"  {check['size_mib']:>4} MiB  {check['time']:<13} {verdict}")
    return "\n".join(out)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Time to one batch: dissoc pairs-shm zero-copy vs Arrow Flight do_get.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command",
        nargs="?",
        choices=["serve-flight", "serve-dissoc", "serve-dissoc-placing"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("files", nargs="*", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help="batch sizes in MiB, comma-separated (default 1,16,64,256)")
    parser.add_argument("--quick", action="store_true", help="sizes 1,16,64 and 5 repeats")
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed requests per size (default 9; quick 5)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests first (default 1)")
    parser.add_argument("--only", help="paths whose label contains one of these words, comma-separated")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    parser.add_argument("--tmpdir", help="where to write the files (default /dev/shm when it has room)")
    args = parser.parse_args(argv)
    if args.command == "serve-flight":
        with contextlib.suppress(KeyboardInterrupt):
            serve_flight(args.files)
        return 0
    if args.command in ("serve-dissoc", "serve-dissoc-placing"):
        asyncio.run(_serve_dissoc(args.files, resident=args.command == "serve-dissoc"))
        return 0

    sizes = (
        [int(s) for s in args.sizes.split(",")]
        if args.sizes
        else list(QUICK_SIZES_MIB if args.quick else SIZES_MIB)
    )
    repeat = args.repeat or (5 if args.quick else 9)
    paths = PATHS
    if args.only:
        words = [w.strip() for w in args.only.split(",") if w.strip()]
        paths = [p for p in PATHS if any(w in p[0] for w in words)]
    tmpdir = args.tmpdir or anchors.default_tmpdir(sum(sizes) * MiB)
    _progress(f"# sizes {sizes} MiB, {repeat} requests each after {args.warmup} warm-up")
    results: list[Timings] = []
    with tempfile.TemporaryDirectory(prefix="dissoc-latency-", dir=tmpdir) as directory:
        files = {size: write_batch_file(Path(directory), size) for size in sizes}
        for label, kind, setup in paths:
            results += measure_path(
                label, kind, setup, files, repeat=repeat, warmup=args.warmup, progress=_progress
            )
    checks = check_targets(results)
    text = format_table(results) + ("\n\n" + format_targets(checks) if checks else "")
    if args.json:
        print(text, file=sys.stderr)
        report = {
            "sizes_mib": sizes,
            "repeat": repeat,
            "results": [
                {
                    "path": r.path,
                    "size_mib": r.size_mib,
                    "error": r.error,
                    "ask_s": [round(x, 6) for x in r.ask],
                    "ready_s": [round(x, 6) for x in r.ready],
                    "median_ask_s": r.median("ask"),
                    "median_ready_s": r.median("ready"),
                }
                for r in results
            ],
            "targets": checks,
        }
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(text)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
