"""polars, DuckDB and pandas reading a stream from a server subprocess, against the same library reading Arrow
Flight's DoGet (not collected by pytest).

Each library is handed the stream as it is, through the Arrow PyCapsule interface, and builds its own result:

- ``LIB-flight``       the anchor: ``FlightClient.do_get(ticket).to_reader()`` handed to the library, from a
                       plain pyarrow.flight server subprocess;
- ``LIB-dissoc``       ``dissoc.client.open_stream`` handed to the library (``__arrow_c_stream__``), from a
                       ``dissoc serve`` subprocess over TCP;
- ``LIB-read-all``     what users wrote before the interface: ``open_stream(...).read_all()`` first, then the
                       table handed to the library.

where LIB is ``polars`` (``pl.DataFrame(reader)``), ``duckdb`` (``SELECT count(*), sum(c0) FROM reader``: it
aggregates as it scans) and ``pandas`` (``pd.DataFrame.from_arrow``, pandas 3; else
``pa.table(reader).to_pandas()``). Workloads are ``_anchors``'s ``large`` (16 MiB batches; ``--quick``: 256
MiB in all) and ``small`` (16 KiB batches). The table gives median GB/s over ``--repeat`` transfers and each
median's ratio to the same library's Flight row.

Run from the repository root::

    .venv/bin/python benchmarks/interop.py --quick                  # ~1-2 min
    .venv/bin/python benchmarks/interop.py --only duckdb --workload large --repeat 7
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

try:
    from benchmarks import _anchors as anchors
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import _anchors as anchors  # type: ignore[no-redef, import-not-found]

if str(anchors.REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(anchors.REPO_ROOT))

Consumed = anchors.Consumed
Dataset = anchors.Dataset
Measurement = anchors.Measurement
PathFactory = anchors.PathFactory
Transfer = anchors.Transfer
Unavailable = anchors.Unavailable


def _import(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError as exc:
        raise Unavailable(f"{name} is not installed ({exc}; the 'test' extra has it)") from None


def _polars(source: Any) -> int:
    pl = _import("polars")
    return int(pl.DataFrame(source).height)


def _duckdb(source: Any) -> int:
    duckdb = _import("duckdb")
    reader = source  # (DuckDB finds the Python variable by its name)
    ((rows, _),) = duckdb.connect().sql("SELECT count(*), sum(c0) FROM reader").fetchall()
    del reader
    return int(rows)


def _pandas(source: Any) -> int:
    pd = _import("pandas")
    if hasattr(pd.DataFrame, "from_arrow"):
        return len(pd.DataFrame.from_arrow(source))
    return len(pa.table(source).to_pandas())


CONSUMERS: dict[str, Callable[[Any], int]] = {"polars": _polars, "duckdb": _duckdb, "pandas": _pandas}


def _flight(consumer: Callable[[Any], int]) -> PathFactory:
    def factory(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
        from pyarrow import flight

        (info,) = anchors.start_server(stack, anchors.anchor_server_argv("serve-flight", dataset.path))
        client = flight.FlightClient(info["uri"])
        stack.callback(client.close)
        ticket = flight.Ticket(info["ticket"].encode())

        def transfer() -> Consumed:
            return Consumed(dataset.num_batches, consumer(client.do_get(ticket).to_reader()))

        return transfer

    return factory


def _dissoc(consumer: Callable[[Any], int], *, read_all: bool) -> PathFactory:
    def factory(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
        from dissoc.client import close_idle_connections_sync, open_stream

        argv = [sys.executable, "-m", "dissoc.cli", "serve", "--host", anchors.HOST, "--port", "0"]
        (info,) = anchors.start_server(stack, [*argv, str(dataset.path)])
        uri, ticket = str(info["uri"]), str(info["ticket"])
        stack.callback(close_idle_connections_sync)

        def transfer() -> Consumed:
            with open_stream(uri, ticket) as reader:
                rows = consumer(reader.read_all() if read_all else reader)
            return Consumed(dataset.num_batches, rows)

        return transfer

    return factory


PATHS: list[tuple[str, str, PathFactory]] = [
    path
    for lib, consumer in CONSUMERS.items()
    for path in (
        (f"{lib}-flight", f"{lib} <- flight do_get", _flight(consumer)),
        (f"{lib}-dissoc", f"{lib} <- dissoc (capsule)", _dissoc(consumer, read_all=False)),
        (f"{lib}-read-all", f"{lib} <- dissoc read_all", _dissoc(consumer, read_all=True)),
    )
]


def _ratio(result: Measurement, results: Sequence[Measurement]) -> float | None:
    lib = result.path.split(" ")[0]
    anchor = next(
        (r for r in results if r.path == f"{lib} <- flight do_get" and r.workload == result.workload), None
    )
    if not result.ok or anchor is None or not anchor.ok:
        return None
    return result.median_gbps / anchor.median_gbps


def format_table(results: Sequence[Measurement]) -> str:
    header = ["path", "workload", "GB/s med", "min", "max", "vs the library's flight row"]
    rows = []
    for r in results:
        if not r.ok:
            rows.append([r.path, r.workload, "-", "-", "-", str(r.error)])
            continue
        ratio = _ratio(r, results)
        rows.append(
            [
                r.path,
                r.workload,
                f"{r.median_gbps:.2f}",
                f"{min(r.gbps):.2f}",
                f"{max(r.gbps):.2f}",
                "-" if ratio is None else f"{ratio:.2f}x",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="polars, DuckDB and pandas reading a dissoc stream, against reading Flight's DoGet.",
        epilog="paths: " + ", ".join(slug for slug, _, _ in PATHS),
    )
    parser.add_argument("--quick", action="store_true", help="256 MiB large workload, 10k small batches")
    parser.add_argument("--repeat", type=int, default=5, help="timed transfers per path (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed transfers first (default 1)")
    parser.add_argument("--workload", choices=["large", "small", "both"], default="both")
    parser.add_argument("--only", metavar="PATH[,PATH]", help="paths (slugs or prefixes: polars, duckdb...)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per transfer before giving up")
    parser.add_argument("--tmpdir", help="where to write the dataset (default /dev/shm when it has room)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0:
        parser.error("--repeat must be >= 1 and --warmup >= 0")
    table = anchors.QUICK_WORKLOADS if args.quick else anchors.WORKLOADS
    workloads = [table[name] for name in (["large", "small"] if args.workload == "both" else [args.workload])]
    tmpdir = args.tmpdir or anchors.default_tmpdir(max(w.payload_bytes for w in workloads))
    load = os.getloadavg()
    _progress(
        f"# {os.cpu_count()} cpus, load {load[0]:.2f}; repeat {args.repeat} after {args.warmup} warm-up; "
        f"data in {tmpdir or tempfile.gettempdir()}"
    )
    results: list[Measurement] = []
    try:
        anchors.run_paths(
            anchors.select_paths(PATHS, args.only),
            workloads,
            repeat=args.repeat,
            warmup=args.warmup,
            timeout=args.timeout or None,
            tmpdir=tmpdir,
            results=results,
            progress=_progress,
            prefix="dissoc-interop-bench-",
        )
    except KeyboardInterrupt:
        _progress("# interrupted: partial results")
        print(format_table(results))
        return 130
    print(format_table(results))
    return 1 if any(r.error and r.error.startswith("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
