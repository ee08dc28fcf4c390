"""Reading through the Flight control plane, against Arrow Flight's own DoGet (not collected by pytest).

The same Arrow IPC file (written once, memory-mapped by every server) moves from a server subprocess to this
process along these paths:

- ``flight-do-get``        the anchor: a plain pyarrow.flight server subprocess, ``FlightClient.do_get``;
- ``plane-do-get``         ``dissoc serve --flight 0`` subprocess, ``FlightClient.do_get`` against its control
                           plane (gRPC all the way, for clients that only speak Flight);
- ``via-plane-combined``   the same subprocess: ``dissoc.flight.resolve`` (GetFlightInfo) then
                           ``dissoc.client.open_stream`` on each endpoint, over dissoc TCP;
- ``via-plane-split``      the same against ``dissoc serve --flight 0 --split``;
- ``fetch-via-flight``     ``dissoc.fetch`` of the ``grpc://`` location (resolve, fetch every endpoint, one
                           table), then every batch of the table is consumed.

Every timed transfer includes the control-plane round trip (GetFlightInfo) where the path has one, and
consumes every batch with the same consumer (``_anchors.consume``). Workloads are ``_anchors``'s: ``large``
(1 GiB in 16 MiB batches; ``--quick``: 256 MiB) and ``small`` (100k batches of 1k rows; ``--quick``: 10k).
Each path runs ``--warmup`` untimed and ``--repeat`` timed transfers; the table shows median GB/s (min,
max), median batches/s, and the ratio of each median to the Flight DoGet anchor's on the same workload. The
latency of ``resolve`` alone (median of ``--resolve-calls`` calls) is printed after the table.

Run from the repository root::

    .venv/bin/python benchmarks/flight_control.py --quick             # ~10-20 s
    .venv/bin/python benchmarks/flight_control.py                     # full size
    .venv/bin/python benchmarks/flight_control.py --only plane,flight --workload small --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

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

ANCHOR = "flight do_get"
SERVER_READY_TIMEOUT = 60.0

#: Resolve latencies measured per (layout, workload), in seconds; printed after the table.
RESOLVE_LATENCY: dict[str, list[float]] = {}
RESOLVE_CALLS = [50]


def _start_dissoc(dataset: Dataset, stack: contextlib.ExitStack, *, split: bool) -> dict[str, Any]:
    """``dissoc serve --flight 0`` on the dataset in a subprocess (stopped by ``stack``); its ready line."""
    try:
        import dissoc.flight  # noqa: F401  (fails early, with the reason, when Flight is missing)
    except ImportError as exc:
        raise Unavailable(f"import dissoc.flight: {exc}") from None
    argv = [sys.executable, "-m", "dissoc.cli", "serve", "--host", anchors.HOST, "--port", "0"]
    argv += ["--flight", "0", *(["--split"] if split else []), str(dataset.path)]
    (info,) = anchors.start_server(stack, argv, timeout=SERVER_READY_TIMEOUT)
    if "flight" not in info:
        raise Unavailable(f"dissoc serve --flight printed no flight location: {info}")
    return info


def plane_do_get(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """``FlightClient.do_get`` against the control plane of a ``dissoc serve --flight`` subprocess."""
    from pyarrow import flight

    info = _start_dissoc(dataset, stack, split=False)
    client = flight.FlightClient(info["flight"])
    stack.callback(client.close)
    ticket = flight.Ticket(str(info["ticket"]).encode())

    def transfer() -> Consumed:
        return anchors.consume(client.do_get(ticket).to_reader())

    return transfer


def via_plane(split: bool) -> PathFactory:
    """Resolve through the control plane, then read each endpoint over dissoc with ``open_stream``."""

    def factory(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
        from dissoc.client import open_stream
        from dissoc.flight import resolve

        info = _start_dissoc(dataset, stack, split=split)
        location, ticket = str(info["flight"]), str(info["ticket"])
        latencies = RESOLVE_LATENCY.setdefault(f"{'split' if split else 'combined'} / {dataset.name}", [])
        for _ in range(RESOLVE_CALLS[0]):
            started = time.perf_counter()
            resolve(location, ticket)
            latencies.append(time.perf_counter() - started)

        def transfer() -> Consumed:
            batches = rows = 0
            for uri, data_uri, endpoint_ticket in resolve(location, ticket):
                with open_stream(uri, endpoint_ticket, data_uri=data_uri) as reader:
                    got = anchors.consume(reader)
                batches += got.batches
                rows += got.rows
            return Consumed(batches, rows)

        return transfer

    return factory


def fetch_via_flight_path(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
    """``dissoc.fetch`` of the ``grpc://`` location (one table), then every batch of it."""
    from dissoc.client import fetch

    info = _start_dissoc(dataset, stack, split=False)
    location, ticket = str(info["flight"]), str(info["ticket"])

    def transfer() -> Consumed:
        return anchors.consume(fetch(location, ticket).to_batches())

    return transfer


#: Every path in table order: (slug for --only, label, path).
PATHS: list[tuple[str, str, PathFactory]] = [
    ("flight-do-get", ANCHOR, anchors.flight_do_get),
    ("plane-do-get", "plane do_get", plane_do_get),
    ("via-plane-combined", "dissoc via plane, combined", via_plane(split=False)),
    ("via-plane-split", "dissoc via plane, split", via_plane(split=True)),
    ("fetch-via-flight", "dissoc.fetch(grpc://) (table)", fetch_via_flight_path),
]


# ----------------------------------------------------------------------------------------------------------
# Reporting


def _ratio(result: Measurement, results: Sequence[Measurement]) -> float | None:
    anchor = next((r for r in results if r.path == ANCHOR and r.workload == result.workload), None)
    if not result.ok or anchor is None or not anchor.ok:
        return None
    return result.median_gbps / anchor.median_gbps


def format_table(results: Sequence[Measurement]) -> str:
    header = ["path", "workload", "GB/s med", "min", "max", "batches/s", "vs flight do_get"]
    rows: list[list[str]] = []
    for r in results:
        if not r.ok:
            rows.append([r.path, r.workload, str(r.error)])
            continue
        ratio = _ratio(r, results)
        rows.append(
            [
                r.path,
                r.workload,
                f"{r.median_gbps:.2f}",
                f"{min(r.gbps):.2f}",
                f"{max(r.gbps):.2f}",
                f"{r.median_batches_per_s:,.0f}",
                "-" if ratio is None else f"{ratio:.2f}x",
            ]
        )
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row if len(row) == len(header) else row[:2]):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        if len(cells) < len(header):
            return f"{cells[0]:<{widths[0]}}  {cells[1]:<{widths[1]}}  {cells[2]}"
        return "  ".join(
            f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths), *(line(row) for row in rows)]
    for key, latencies in RESOLVE_LATENCY.items():
        if latencies:
            out.append(
                f"resolve (GetFlightInfo) latency, {key}: "
                f"median {statistics.median(latencies) * 1e6:,.0f} us "
                f"over {len(latencies)} calls (min {min(latencies) * 1e6:,.0f} us)"
            )
    return "\n".join(out)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _select(only: str | None) -> list[tuple[str, str, PathFactory]]:
    return anchors.select_paths(PATHS, only)


def run(
    paths: Sequence[tuple[str, str, PathFactory]],
    workloads: Sequence[anchors.Workload],
    *,
    repeat: int,
    warmup: int,
    timeout: float | None,
    tmpdir: str | None,
    results: list[Measurement],
    progress: Callable[[str], None] = _progress,
) -> None:
    """Measure every path on every workload, appending to ``results`` as it goes."""
    anchors.run_paths(
        paths,
        workloads,
        repeat=repeat,
        warmup=warmup,
        timeout=timeout,
        tmpdir=tmpdir,
        results=results,
        progress=progress,
        prefix="dissoc-flight-bench-",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Reading through dissoc's Flight control plane, against Flight DoGet.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="paths: " + ", ".join(slug for slug, _, _ in PATHS),
    )
    parser.add_argument("--quick", action="store_true", help="256 MiB large workload, 10k small batches")
    parser.add_argument("--repeat", type=int, default=5, help="timed transfers per path (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed transfers first (default 1)")
    parser.add_argument("--workload", choices=["large", "small", "both"], default="both")
    parser.add_argument("--only", metavar="PATH[,PATH]", help="paths (slugs or prefixes of them)")
    parser.add_argument(
        "--resolve-calls", type=int, default=50, help="resolve calls timed alone (default 50)"
    )
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per transfer before giving up")
    parser.add_argument("--tmpdir", help="where to write the dataset (default /dev/shm when it has room)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0 or args.resolve_calls < 0:
        parser.error("--repeat must be >= 1, --warmup and --resolve-calls >= 0")
    RESOLVE_CALLS[0] = args.resolve_calls

    table = anchors.QUICK_WORKLOADS if args.quick else anchors.WORKLOADS
    workloads = [table[name] for name in (["large", "small"] if args.workload == "both" else [args.workload])]
    tmpdir = args.tmpdir or anchors.default_tmpdir(max(w.payload_bytes for w in workloads))
    load = os.getloadavg()
    _progress(
        f"# {os.cpu_count()} cpus, load {load[0]:.2f}; repeat {args.repeat} after {args.warmup} warm-up; "
        f"data in {tmpdir or tempfile.gettempdir()}"
    )
    results: list[Measurement] = []
    interrupted = False
    try:
        run(
            _select(args.only),
            workloads,
            repeat=args.repeat,
            warmup=args.warmup,
            timeout=args.timeout or None,
            tmpdir=tmpdir,
            results=results,
        )
    except KeyboardInterrupt:
        interrupted = True
        _progress("# interrupted: partial results")

    text = format_table(results)
    if args.json:
        print(text, file=sys.stderr)
        report = {
            "quick": args.quick,
            "repeat": args.repeat,
            "workloads": {w.name: w.describe() for w in workloads},
            "results": [{**r.to_json(), "vs_flight_do_get": _ratio(r, results)} for r in results],
            "resolve_latency_us": {
                k: round(statistics.median(v) * 1e6, 1) for k, v in RESOLVE_LATENCY.items() if v
            },
        }
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(text)
    if interrupted:
        return 130
    return 1 if any(r.error and r.error.startswith("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
