"""Throughput of moving the same Arrow data between two processes over loopback (not collected by pytest).

Paths (rows of the table), all serving one Arrow IPC file written beforehand and memory-mapped by the servers:

- ``numpy-copy``          one ``np.copyto`` of each batch's bytes (the memory-bandwidth ceiling);
- ``flight-do-get``       pyarrow.flight server subprocess, ``FlightClient.do_get`` read batch by batch;
- ``ipc-stream-socket``   subprocess writes a pyarrow IPC stream to a TCP socket, ``pa.ipc.open_stream``
                          reads it;
- ``dissoc-tcp-combined`` ``python -m dissoc.cli serve --transport tcp`` subprocess, dissoc client;
- ``dissoc-tcp-split``    the same with ``--split`` (metadata and bodies on separate connections);
- ``dissoc-tcp-pairs-shm`` combined, with bodies as address/length pairs into the server's shared memory
  (the client copies each batch out of the segment and frees it);
- ``dissoc-tls-combined`` ``dissoc-tcp-combined`` inside TLS (``--tls-cert/--tls-key`` with a self-signed
  certificate made by the ``openssl`` command, ``ClientOptions(tls_ca=...)``); below the table, its GB/s and
  batches/s over the plaintext row's on each workload (TLS against plaintext: AES-GCM on one core);
- ``dissoc-tcp-pairs-shm-zc`` the same read zero-copy (``ClientOptions(zero_copy=True)``: batches over the
  mapped segment, freed when released);
- ``dissoc-ucx-listener``  ``--transport ucx`` (packed bodies), the client connecting through the listener
  (``ClientOptions(ucx_path="listener")``: the reference mapping's way, no handshake, everything on the
  endpoint to host:port, which UCX runs over TCP; the server accepts it on a worker of its own);
- ``dissoc-ucx-address``   the same, connecting straight to the server's worker address
  (``ucx_path="address"``);
- ``dissoc-ucx-pairs-rma`` ``--transport ucx --body pairs --memory ucx``: the client reads each batch's
  buffers with UCX RMA gets from the server's registered arena;
- ``dissoc-ucx-reference`` ``--transport ucx`` (packed bodies) read the way the reference mapping is
  (apache/arrow-experiments ``dissociated-ipc/``, issue 18): the server's URIs are given to the client
  without their ``worker=`` parameter, as a reference-style server publishes them, and the client's default
  ``ucx_path="auto"`` then connects through the listener and asks with want_data straight away, no
  handshake (everything on the listener's endpoint; UCX restricts those to TCP unless the server moves the
  connection). Compare it with ``dissoc-ucx-address`` (today's fastest UCX path) and the raw ucxx anchors.
- ``dissoc-ucx-address-fresh``, ``dissoc-tcp-combined-fresh``: the same as ``dissoc-ucx-address`` and
  ``dissoc-tcp-combined`` with ``ClientOptions(reuse_connections=False)``: every transfer makes and closes
  its connections, as every stream did before connections were reused. The gap to the reused rows is the
  per-stream cost of a connection (for UCX a worker on each side, tens of milliseconds), which once halved
  the same-host UCX rate of ``--quick`` transfers unnoticed.

Anchors (``_anchors.py``): ``numpy-copy`` (one ``np.copyto`` per batch, the memory-bandwidth ceiling),
``flight-do-get``, ``ipc-stream-socket`` and ``ucxx-raw``: a minimal ucxx sender subprocess sending each
batch's bytes (cut from the same memory-mapped file) as one tagged message, worker-address endpoints without
peer-failure handling (so UCX uses shared memory: CMA), polling progress (``_ucx_anchor.py``);
``ucxx-raw-blocking`` is the same waiting on epoll (as dissoc does; spinning suffers on a busy machine) and
``ucxx-raw-anon`` sends the same sizes from anonymous (huge-page) memory, the best case for CMA.
``ucxx-raw-listener`` connects through the sender's listener instead (``host:port``, peer-failure handling
on, as the reference mapping's clients do; UCX runs it over TCP here): the anchor for the listener path.
``ucxx-raw-listener-2msg`` sends each batch there as two messages (256 bytes, then the body), the message
count of the Dissociated IPC mapping (metadata, then body), which per-message costs over TCP make the
like-for-like anchor of the listener and reference-style rows on small batches.

Workloads: ``large`` (1 GiB in 16 MiB batches; ``--quick``: 256 MiB), ``large64`` (1 GiB in 64 MiB batches;
``--quick``: 256 MiB), ``spark`` (below) and ``small`` (100k batches of 1k rows, 16 KiB each; ``--quick``:
10k). Each path runs one untimed warm-up and ``--repeat`` timed transfers; the table shows the median GB/s
(payload = sum of ``batch.nbytes``, the same for every path), min, max, median batches/s, CPU per GB, and the
ratios of the medians to the anchors of the same workload (spec/FACTS.md section 6). Below it, the targets:
dissoc over UCX on one host >= 0.80x raw ucxx (the faster of ``ucxx-raw`` and ``ucxx-raw-blocking``) and
>= 4x Flight on the 16 and 64 MiB workloads. A row that fails prints its error and the run goes on.

The ``spark`` workload (``_anchors.spark_batch``) is 10k-row batches of ten mixed columns (ints, floats with
nulls, strings with nulls, bools, timestamp, date, a category-like string): 1280 batches (``--quick``: 160).
The ``cpu s/GB cli/srv`` column is the median CPU time per GB of payload of this process (every path's client
runs here; ``time.process_time``) and of the path's server subprocesses (``/proc``), read around each timed
transfer; ``-`` where not measured (the notes below the table say why). ``--plot FILE.png`` also runs a
batch-size sweep (16 KiB to 64 MiB batches of 2 int64 columns) and draws GB/s and batches/s against batch
size, one line per path; it needs matplotlib (``pip install 'dissoc[bench]'``).

Run from the repository root::

    .venv/bin/python benchmarks/throughput.py --quick --workload large,large64   # ~1 min
    .venv/bin/python benchmarks/throughput.py --quick                 # + small batches, ~2-3 min
    .venv/bin/python benchmarks/throughput.py --workload large,large64   # 1 GiB each, ~3-5 min
    .venv/bin/python benchmarks/throughput.py                         # + 100k small batches: much longer
    .venv/bin/python benchmarks/throughput.py --only anchors --workload large --json
    .venv/bin/python benchmarks/throughput.py --only ucxx,flight,dissoc-ucx --workload large64
    .venv/bin/python benchmarks/throughput.py --quick --workload spark
    .venv/bin/python benchmarks/throughput.py --quick --plot sweep.png --only flight,dissoc-tcp

The dissoc rows say "not available (...)" while ``dissoc.cli`` / the client do not exist yet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa

try:
    from benchmarks import _anchors as anchors
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import _anchors as anchors  # type: ignore[no-redef, import-not-found]

Consumed = anchors.Consumed
Dataset = anchors.Dataset
Measurement = anchors.Measurement
PathFactory = anchors.PathFactory
Transfer = anchors.Transfer
Unavailable = anchors.Unavailable
REPO_ROOT = anchors.REPO_ROOT
#: The ratio columns, in order (an anchor that is not in the run shows "-").
ANCHOR_LABELS = ("ucxx raw", "flight do_get", "ipc stream socket", "numpy copy")
SERVER_READY_TIMEOUT = 60.0
#: The targets of dissoc over UCX on one host (the issue): at least these ratios to the anchors, on these
#: workloads, for the rows whose label starts with ``TARGET_PREFIX``. The ucxx target is checked against
#: the faster of the raw ucxx rows that send the same bytes (``UCXX_SAME_BYTES``: polling and blocking).
TARGETS: dict[str, float] = {"ucxx raw": 0.80, "flight do_get": 4.0}
TARGET_WORKLOADS = ("large", "large64")
TARGET_PREFIX = "dissoc ucx"
UCXX_SAME_BYTES = ("ucxx raw", "ucxx raw blocking")
#: The TLS row, compared below the table with the plaintext row of the same layout.
TLS_LABEL = "dissoc tls combined"
PLAIN_LABEL = "dissoc tcp combined"

# ----------------------------------------------------------------------------------------------------------
# dissoc paths

#: Which client API a dissoc path used, by path label (shown as a note).
_API_USED: dict[str, str] = {}

#: The command that starts a dissoc server, up to its options (default ``python -m dissoc.cli serve``);
#: ``--dissoc-serve`` replaces it, e.g. with a wrapper script.
DISSOC_SERVE: list[str] = []

DissocReader = Callable[[str, str, "str | None"], Consumed]
#: ``dissoc.client.ClientOptions`` fields of a path (empty: the client's defaults, no options passed).
ClientFields = dict[str, Any]


def _closing(stream: Any) -> contextlib.AbstractContextManager[Any]:
    if hasattr(stream, "__enter__"):
        return stream  # type: ignore[no-any-return]
    if hasattr(stream, "close"):
        return contextlib.closing(stream)
    return contextlib.nullcontext(stream)


def _dissoc_reader(
    stack: contextlib.ExitStack, fields: ClientFields | None = None
) -> tuple[DissocReader, str]:
    """The best dissoc client API there is: ``client.open_stream``, ``client.stream_batches``, ``fetch``.

    With ``fields``, each call passes ``options=ClientOptions(**fields)``.
    """
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        import dissoc
    except ImportError as exc:
        raise Unavailable(f"import dissoc: {exc}") from None
    try:
        client: Any = importlib.import_module("dissoc.client")
    except ModuleNotFoundError as exc:
        if exc.name != "dissoc.client":
            raise Unavailable(f"import dissoc.client: {exc}") from None
        client = None
    except ImportError as exc:
        raise Unavailable(f"import dissoc.client: {exc}") from None

    extra: dict[str, Any] = {}
    if fields:
        options_type = getattr(client, "ClientOptions", None)
        if options_type is None:
            raise Unavailable("dissoc.client.ClientOptions does not exist yet")
        try:
            extra = {"options": options_type(**fields)}
        except TypeError as exc:
            raise Unavailable(f"ClientOptions({fields}): {exc}") from None

    if client is not None and hasattr(client, "open_stream"):

        def read_sync(uri: str, ticket: str, data_uri: str | None) -> Consumed:
            with _closing(client.open_stream(uri, ticket, data_uri=data_uri, **extra)) as batches:
                return anchors.consume(batches)

        return read_sync, "dissoc.client.open_stream"

    loop = asyncio.new_event_loop()
    stack.callback(loop.close)

    if client is not None and hasattr(client, "stream_batches"):

        async def consume_async(uri: str, ticket: str, data_uri: str | None) -> Consumed:
            count = rows = 0
            async for batch in client.stream_batches(uri, ticket, data_uri=data_uri, **extra):
                count += 1
                rows += batch.num_rows
            return Consumed(count, rows)

        def read_async(uri: str, ticket: str, data_uri: str | None) -> Consumed:
            return loop.run_until_complete(consume_async(uri, ticket, data_uri))

        return read_async, "dissoc.client.stream_batches"

    fetch = getattr(dissoc, "fetch", None)
    if fetch is not None:

        def read_table(uri: str, ticket: str, data_uri: str | None) -> Consumed:
            table = fetch(uri, ticket, data_uri=data_uri, **extra)
            if inspect.isawaitable(table):
                table = loop.run_until_complete(table)
            return anchors.consume(table.to_batches())

        return read_table, "dissoc.fetch"

    raise Unavailable("no client yet: neither dissoc.client.open_stream/stream_batches nor dissoc.fetch")


def dissoc_tcp(split: bool, pairs: bool = False) -> PathFactory:
    label = "dissoc tcp pairs-shm" if pairs else f"dissoc tcp {'split' if split else 'combined'}"
    return dissoc_path(label, "tcp", split=split, memory="shm" if pairs else None)


def _self_signed(stack: contextlib.ExitStack) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1 and its key (PEM files, removed with ``stack``),
    made with the ``openssl`` command; the certificate is also the client's CA bundle."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise Unavailable("the TLS row needs the openssl command")
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="dissoc-tls-bench-"))
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    argv = [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    argv += ["-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=localhost"]
    argv += ["-addext", f"subjectAltName=DNS:localhost,IP:{anchors.HOST}"]
    made = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if made.returncode != 0:
        raise Unavailable(f"openssl req failed: {made.stderr.strip()[-300:]}")
    return cert, key


def dissoc_path(
    label: str,
    transport: str,
    *,
    split: bool = False,
    memory: str | None = None,
    fields: ClientFields | None = None,
    tls: bool = False,
    publish_worker: bool = True,
) -> PathFactory:
    """A dissoc server subprocess (``--transport``; pairs in ``memory`` when given; inside TLS with ``tls``)
    read by the client with ``ClientOptions(**fields)``; with ``publish_worker=False`` the client gets the
    server's URIs without their ``worker=`` parameter (the reference-style path, module docstring)."""

    def factory(dataset: Dataset, stack: contextlib.ExitStack) -> Transfer:
        path_fields = fields
        server_tls: list[str] = []
        if tls:
            cert, key = _self_signed(stack)
            server_tls = ["--tls-cert", cert, "--tls-key", key]
            path_fields = {**(fields or {}), "tls_ca": cert}
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        serve = DISSOC_SERVE or [sys.executable, "-m", "dissoc.cli", "serve"]
        if not DISSOC_SERVE:
            try:
                has_cli = importlib.util.find_spec("dissoc.cli") is not None
            except ImportError as exc:
                raise Unavailable(f"dissoc: {exc}") from None
            if not has_cli:
                raise Unavailable("dissoc.cli does not exist yet")
        read, api = _dissoc_reader(stack, path_fields)
        argv = [*serve, "--transport", transport, "--host", anchors.HOST, "--port", "0"]
        argv += [
            *(["--split"] if split else []),
            *(["--body", "pairs", "--memory", memory] if memory else []),
            *server_tls,
        ]
        argv += [str(dataset.path)]
        lines = anchors.start_server(stack, argv, timeout=SERVER_READY_TIMEOUT)
        # Before the server stops (the stack unwinds in reverse): let go of the connections the client keeps
        # for a next stream, while their peer is still there to close them with.
        close_idle = getattr(importlib.import_module("dissoc.client"), "close_idle_connections_sync", None)
        if close_idle is not None:
            stack.callback(close_idle)
        info = next((line for line in lines if line.get("ticket") == dataset.ticket), lines[0])
        try:
            uri, ticket = str(info["uri"]), str(info["ticket"])
        except KeyError as exc:
            raise Unavailable(f"dissoc serve printed {info}, without {exc}") from None
        data_uri = info.get("data_uri")
        data_uri = None if data_uri in (None, uri) else str(data_uri)
        if not publish_worker:
            uri = _without_worker(uri)
            data_uri = None if data_uri is None else _without_worker(data_uri)
        if split and data_uri is None:
            raise Unavailable(f"dissoc serve --split printed no separate data_uri: {info}")
        _API_USED[label] = api + (
            f"({', '.join(f'{k}={v!r}' for k, v in path_fields.items())})" if path_fields else ""
        )

        def transfer() -> Consumed:
            return read(uri, ticket, data_uri)

        return transfer

    return factory


def _without_worker(uri: str) -> str:
    """``uri`` without its ``worker=`` query parameter (as a reference-style server publishes a ucx URI)."""
    parts = urllib.parse.urlsplit(uri)
    query = "&".join(p for p in parts.query.split("&") if p.split("=", 1)[0] != "worker")
    return urllib.parse.urlunsplit(parts._replace(query=query))


def _dissoc_row(slug: str, label: str, transport: str, **kwargs: Any) -> tuple[str, str, PathFactory]:
    return slug, label, dissoc_path(label, transport, **kwargs)


#: Every path, in table order: (slug for --only, label, path). Later benchmarks append rows here.
PATHS: list[tuple[str, str, PathFactory]] = [
    *anchors.ANCHORS,
    ("dissoc-tcp-combined", "dissoc tcp combined", dissoc_tcp(split=False)),
    ("dissoc-tcp-split", "dissoc tcp split", dissoc_tcp(split=True)),
    ("dissoc-tcp-pairs-shm", "dissoc tcp pairs-shm", dissoc_tcp(split=False, pairs=True)),
    _dissoc_row("dissoc-tls-combined", TLS_LABEL, "tcp", tls=True),
    _dissoc_row(
        "dissoc-tcp-pairs-shm-zc",
        "dissoc tcp pairs-shm zero-copy",
        "tcp",
        memory="shm",
        fields={"zero_copy": True},
    ),
    _dissoc_row("dissoc-ucx-listener", "dissoc ucx listener", "ucx", fields={"ucx_path": "listener"}),
    _dissoc_row("dissoc-ucx-address", "dissoc ucx address", "ucx", fields={"ucx_path": "address"}),
    _dissoc_row("dissoc-ucx-pairs-rma", "dissoc ucx pairs-rma", "ucx", memory="ucx"),
    _dissoc_row("dissoc-ucx-reference", "dissoc ucx reference", "ucx", publish_worker=False),
    # Every stream on fresh connections, as before connections were reused: the per-stream cost of making
    # and closing a UCX connection (a worker on each side), which once halved the same-host rate on --quick.
    _dissoc_row(
        "dissoc-ucx-address-fresh",
        "dissoc ucx address fresh",
        "ucx",
        fields={"ucx_path": "address", "reuse_connections": False},
    ),
    _dissoc_row(
        "dissoc-tcp-combined-fresh", "dissoc tcp combined fresh", "tcp", fields={"reuse_connections": False}
    ),
]


# ----------------------------------------------------------------------------------------------------------
# Reporting


def _ratios(result: Measurement, results: Sequence[Measurement]) -> dict[str, float | None]:
    """Median GB/s of ``result`` over each anchor's median GB/s on the same workload."""
    ratios: dict[str, float | None] = {}
    for label in ANCHOR_LABELS:
        anchor = next((r for r in results if r.path == label and r.workload == result.workload), None)
        ok = result.ok and anchor is not None and anchor.ok
        ratios[label] = result.median_gbps / anchor.median_gbps if ok and anchor else None
    return ratios


CPU_HEADER = "cpu s/GB cli/srv"


def cpu_notes(results: Sequence[Measurement]) -> list[str]:
    """What the CPU column measured, and for which rows a side was not measured (and why)."""
    done = [r for r in results if r.ok]
    if not done:
        return []
    precision = (
        "each thread's schedstat runtime, ns"
        if anchors.cpu_has_schedstat()
        else f"utime + stime in 1/{anchors._CLOCK_TICKS} s ticks, coarse for short transfers"
    )
    out = [
        f"{CPU_HEADER}: median CPU seconds (user + system) per GB of payload over the timed transfers; cli ="
        " this process (time.process_time, every thread: every path's client side runs here, the anchors'"
        " included), srv = the path's server subprocesses and their children (/proc, read before and after"
        f" each transfer: {precision}); a side that"
        " busy-polls (ucxx raw with --ucxx-progress poll, the default) spends CPU while it waits"
    ]
    missing: dict[str, list[str]] = {}
    for result in done:
        if result.client_cpu_per_gb is None:
            missing.setdefault("client CPU", []).append(f"{result.path} / {result.workload}")
        if result.server_cpu_per_gb is None:
            why = "no server: one process copies" if result.path == "numpy copy" else "/proc not readable"
            missing.setdefault("server CPU", []).append(f"{result.path} ({why})")
    for side, rows in missing.items():
        out.append(f"{side} not measured (-) for: {', '.join(dict.fromkeys(rows))}")
    return out


def format_table(results: Sequence[Measurement]) -> str:
    header = ["path", "workload", "GB/s med", "min", "max", "batches/s", CPU_HEADER]
    header += [f"vs {label.split()[0]}" for label in ANCHOR_LABELS]
    rows: list[list[str]] = []
    notes: list[str] = []
    for result in results:
        if not result.ok:
            rows.append([result.path, result.workload, str(result.error)])
            continue
        ratios = _ratios(result, results)
        rows.append(
            [
                result.path,
                result.workload,
                f"{result.median_gbps:.2f}",
                f"{min(result.gbps):.2f}",
                f"{max(result.gbps):.2f}",
                f"{result.median_batches_per_s:,.0f}",
                anchors.format_cpu(result),
                *("-" if ratio is None else f"{ratio:.2f}x" for ratio in ratios.values()),
            ]
        )
        if result.note:
            notes.append(f"{result.path} / {result.workload}: {result.note}")
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row if len(row) == len(header) else row[:2]):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        if len(cells) < len(header):  # an error row: the message spans the numeric columns
            return f"{cells[0]:<{widths[0]}}  {cells[1]:<{widths[1]}}  {cells[2]}"
        return "  ".join(
            f"{cell:<{w}}" if i < 2 else f"{cell:>{w}}"
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    out += [f"note: {n}" for n in notes]
    out += [f"note: {n}" for n in cpu_notes(results)]
    return "\n".join(out)


def check_targets(results: Sequence[Measurement]) -> list[dict[str, Any]]:
    """For each dissoc-over-UCX row on a target workload: its ratio to each target anchor, and whether it
    meets the target (None where the row or the anchor has no figure)."""
    checks: list[dict[str, Any]] = []
    for result in results:
        if not result.path.startswith(TARGET_PREFIX) or result.workload not in TARGET_WORKLOADS:
            continue
        for label, target in TARGETS.items():
            names = UCXX_SAME_BYTES if label == "ucxx raw" else (label,)
            candidates = [r for r in results if r.path in names and r.workload == result.workload and r.ok]
            anchor = max(candidates, key=lambda r: r.median_gbps, default=None)
            ratio = result.median_gbps / anchor.median_gbps if anchor is not None and result.ok else None
            checks.append(
                {
                    "path": result.path,
                    "workload": result.workload,
                    "anchor": anchor.path if anchor is not None else label,
                    "anchor_GBps": round(anchor.median_gbps, 4) if anchor is not None else None,
                    "target": target,
                    "ratio": None if ratio is None else round(ratio, 4),
                    "met": None if ratio is None else ratio >= target,
                    "error": result.error,
                }
            )
    return checks


def format_targets(checks: Sequence[dict[str, Any]]) -> str:
    if not checks:
        return ""
    goals = " and ".join(f">= {target:g}x {label}" for label, target in TARGETS.items())
    out = [
        f"targets ({TARGET_PREFIX}* rows, {'/'.join(TARGET_WORKLOADS)} workloads): {goals}",
        f"  (the ucxx anchor is the faster of {' / '.join(UCXX_SAME_BYTES)}, both sending the same bytes)",
    ]
    width = max(len(c["path"]) for c in checks)
    rows: dict[tuple[str, str], list[str]] = {}
    for c in checks:
        name = (
            "flight" if c["anchor"].startswith("flight") else c["anchor"].replace("ucxx raw", "ucxx").strip()
        )
        if c["ratio"] is None:
            cell = f"{name} -"
        else:
            verdict = "met" if c["met"] else "MISSED"
            cell = f"{c['ratio']:.2f}x {name} (>= {c['target']:g}x: {verdict})"
        rows.setdefault((c["path"], c["workload"]), []).append(cell)
    cell_width = max(len(cell) for cells in rows.values() for cell in cells)
    for (path, workload), cells in rows.items():
        text = "   ".join(f"{cell:<{cell_width}}" for cell in cells).rstrip()
        out.append(f"  {path:<{width}}  {workload:<8}  {text}")
    return "\n".join(out)


def format_ceiling(results: Sequence[Measurement]) -> str:
    """How many times Flight's speed one memcpy of the same bytes reaches (what a path that copies the bytes
    once cannot beat)."""
    lines = []
    for workload in TARGET_WORKLOADS:
        here = [r for r in results if r.workload == workload and r.ok]
        copy = next((r for r in here if r.path == "numpy copy"), None)
        flight = next((r for r in here if r.path.startswith("flight")), None)
        if copy is not None and flight is not None:
            lines.append(
                f"  ceiling {workload}: numpy copy (one memcpy of the same bytes) is "
                f"{copy.median_gbps / flight.median_gbps:.2f}x flight"
            )
    return ("\n" + "\n".join(lines)) if lines else ""


def tls_ratios(results: Sequence[Measurement]) -> list[dict[str, Any]]:
    """The TLS row over the plaintext row, per workload where both ran."""
    out = []
    for tls in (r for r in results if r.path == TLS_LABEL and r.ok):
        plain = next(
            (r for r in results if r.path == PLAIN_LABEL and r.workload == tls.workload and r.ok), None
        )
        if plain is not None:
            out.append(
                {
                    "workload": tls.workload,
                    "tls_GBps": round(tls.median_gbps, 4),
                    "plain_GBps": round(plain.median_gbps, 4),
                    "ratio": round(tls.median_gbps / plain.median_gbps, 4),
                    "batches_ratio": round(tls.median_batches_per_s / plain.median_batches_per_s, 4),
                }
            )
    return out


def format_tls(ratios: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"  {TLS_LABEL} / {PLAIN_LABEL} on {r['workload']}: {r['ratio']:.2f}x GB/s "
        f"({r['tls_GBps']:.2f} vs {r['plain_GBps']:.2f}), {r['batches_ratio']:.2f}x batches/s"
        for r in ratios
    ]
    return ("\n\nTLS against plaintext:\n" + "\n".join(lines)) if lines else ""


class MissingExtra(RuntimeError):
    """An optional dependency of the benchmarks is not installed (the message names the extra)."""


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, imported only when a plot is asked for."""
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra(
            "--plot needs matplotlib, the 'bench' extra: pip install 'dissoc[bench]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(results: Sequence[Measurement], workloads: Sequence[anchors.Workload], path: str) -> int:
    """Draw median GB/s and batches/s against batch size (log x) for every path measured on ``workloads``,
    one line per path (anchors dashed), into the image ``path``; return how many paths were drawn."""
    plt = _pyplot()
    sizes = {w.name: w.batch_bytes for w in workloads}
    lines: dict[str, list[tuple[int, float, float]]] = {}
    for result in results:
        if result.ok and result.workload in sizes:
            point = (sizes[result.workload], result.median_gbps, result.median_batches_per_s)
            lines.setdefault(result.path, []).append(point)
    anchor_labels = {label for _, label, _ in anchors.ANCHORS}
    fig, (gbps_axes, batches_axes) = plt.subplots(1, 2, figsize=(14, 6.5), layout="constrained")
    tab20 = list(plt.get_cmap("tab20").colors)
    colors = tab20[0::2] + tab20[1::2]  # the ten strong colours first, then their light pairs
    for i, (label, points) in enumerate(lines.items()):
        points.sort()
        xs = [p[0] for p in points]
        style = {
            "linestyle": "--" if label in anchor_labels else "-",
            "marker": "o",
            "color": colors[i % len(colors)],
            "label": label,
        }
        gbps_axes.plot(xs, [p[1] for p in points], **style)
        batches_axes.plot(xs, [p[2] for p in points], **style)
    ticks = sorted(set(sizes.values()))
    for axes, ylabel in ((gbps_axes, "GB/s (median)"), (batches_axes, "batches/s (median)")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(ticks, [anchors._size(t) for t in ticks])
        axes.minorticks_off()
        axes.set_xlabel("batch size (2 int64 columns)")
        axes.set_ylabel(ylabel)
        axes.grid(True, which="major", alpha=0.3)
    gbps_axes.set_ylim(bottom=0)
    batches_axes.set_yscale("log")
    gbps_axes.set_title("throughput")
    batches_axes.set_title("batches per second")
    if lines:
        handles, labels = gbps_axes.get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=4, fontsize="small")
    fig.suptitle(
        "dissoc and anchors over loopback, by batch size (anchors dashed; one shared, noisy machine)"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(lines)


def _machine() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in load] if load else None,
    }


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# Main


def _select(only: str | None) -> list[tuple[str, str, PathFactory]]:
    return anchors.select_paths(PATHS, only, {"anchors": [slug for slug, _, _ in anchors.ANCHORS]})


def run(
    paths: Iterable[tuple[str, str, PathFactory]],
    workloads: Iterable[anchors.Workload],
    *,
    repeat: int,
    warmup: int,
    timeout: float | None,
    tmpdir: str | None,
    results: list[Measurement],
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
        progress=_progress,
        note=lambda label: f"client: {_API_USED[label]}" if label in _API_USED else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Throughput of Arrow data between two processes over loopback, against anchors.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="paths: "
        + ", ".join(slug for slug, _, _ in PATHS)
        + f" ('anchors' = the first {len(anchors.ANCHORS)}). Workloads: "
        + "; ".join(w.describe() for w in anchors.WORKLOADS.values()),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="256 MiB large and large64 workloads, 10k small and 160 spark batches, 64 MiB per sweep size",
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed transfers per path (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed transfers first (default 1)")
    parser.add_argument(
        "--workload",
        metavar="NAME[,NAME]",
        help=f"{', '.join(anchors.WORKLOADS)}, 'both' (large,small) or 'all' (the default without --plot; "
        "with --plot, only the sweep unless this is given)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also run the batch-size sweep (2 int64 columns, "
        + ", ".join(anchors._size(rows * 16) for rows in anchors.SWEEP_ROWS)
        + " per batch) and draw GB/s and batches/s against batch size into FILE.png (needs matplotlib: "
        "pip install 'dissoc[bench]')",
    )
    parser.add_argument(
        "--ucxx-window",
        type=int,
        default=1,
        metavar="N",
        help="sends/receives the raw ucxx anchor keeps outstanding per side (default 1: serial)",
    )
    parser.add_argument(
        "--ucxx-progress",
        choices=["poll", "blocking"],
        default="poll",
        help="the raw ucxx anchor's progress: spin (default; best on an idle machine) or wait on epoll",
    )
    parser.add_argument("--only", metavar="PATH[,PATH]", help="paths (slugs, prefixes, 'anchors')")
    parser.add_argument("--json", action="store_true", help="JSON on stdout (the table goes to stderr)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per transfer before giving up")
    parser.add_argument("--tmpdir", help="where to write the dataset (default /dev/shm when it has room)")
    parser.add_argument(
        "--dissoc-serve",
        metavar="CMD",
        help="command that starts a dissoc server, instead of 'python -m dissoc.cli serve' (split on spaces)",
    )
    args = parser.parse_args(argv)
    if args.dissoc_serve:
        DISSOC_SERVE[:] = args.dissoc_serve.split()
    if args.repeat < 1 or args.warmup < 0 or args.ucxx_window < 1:
        parser.error("--repeat and --ucxx-window must be >= 1 and --warmup >= 0")
    if args.plot:
        try:
            _pyplot()
        except MissingExtra as exc:
            parser.error(str(exc))
    ucx_anchor = anchors._ucx_anchor_module()
    ucx_anchor.WINDOW, ucx_anchor.PROGRESS = args.ucxx_window, args.ucxx_progress

    table = anchors.QUICK_WORKLOADS if args.quick else anchors.WORKLOADS
    names: list[str] = []
    requested = args.workload if args.workload is not None else ("" if args.plot else "all")
    for name in (n.strip() for n in requested.split(",") if n.strip()):
        expanded = {"both": ["large", "small"], "all": list(table)}.get(name, [name])
        for each in expanded:
            if each not in table:
                parser.error(f"--workload: unknown {each!r} (workloads: {', '.join(table)}, both, all)")
            if each not in names:
                names.append(each)
    workloads = [table[name] for name in names]
    sweep = anchors.sweep_workloads(args.quick) if args.plot else []
    workloads += sweep
    paths = _select(args.only)
    tmpdir = args.tmpdir or anchors.default_tmpdir(max(w.payload_bytes for w in workloads))

    terminated = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal terminated
        terminated = True
        raise KeyboardInterrupt  # unwinds through the exit stacks: servers are stopped

    signal.signal(signal.SIGTERM, on_sigterm)
    machine = _machine()
    _progress(
        f"# python {machine['python']}, pyarrow {machine['pyarrow']}, {machine['cpus']} cpus, "
        f"load {machine['loadavg']}; repeat {args.repeat} after {args.warmup} warm-up; "
        f"data in {tmpdir or tempfile.gettempdir()}"
    )
    results: list[Measurement] = []
    interrupted = False
    try:
        run(
            paths,
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

    checks = check_targets(results)
    text = format_table(results)
    if checks:
        text += "\n\n" + format_targets(checks) + format_ceiling(results)
    text += format_tls(tls_ratios(results))
    if args.plot:
        drawn = plot_sweep(results, sweep, args.plot)
        text += f"\n\nplot: {args.plot} ({drawn} paths, {len(sweep)} batch sizes)"
    if args.json:
        print(text, file=sys.stderr)
        report = {
            "machine": machine,
            "quick": args.quick,
            "repeat": args.repeat,
            "warmup": args.warmup,
            "ucxx_window": args.ucxx_window,
            "ucxx_progress": args.ucxx_progress,
            "workloads": {w.name: w.describe() for w in workloads},
            "results": [
                {**r.to_json(), "ratios": {k: v and round(v, 4) for k, v in _ratios(r, results).items()}}
                for r in results
            ],
            "targets": checks,
            "tls": tls_ratios(results),
            "cpu": cpu_notes(results),
            "plot": args.plot,
        }
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(text)
    if interrupted:
        return 143 if terminated else 130
    return 1 if any(r.error and r.error.startswith("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
