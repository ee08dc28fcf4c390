"""The ``dissoc`` command line: ``dissoc serve``, ``dissoc get``, ``dissoc token`` (DESIGN.md section 5).

stdout carries only JSON lines, for scripts (``dissoc token`` prints the bare ticket, URL-safe, unless given
``--json``); logs and progress go to stderr. Exit status: 0 success, 1 a
:class:`~dissoc.errors.DissocError` (its message on stderr, no traceback), 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dissoc.config import ConfigError, Layered, config_path, layer, track_defaults
from dissoc.errors import DissocError
from dissoc.logs import LOG_FORMATS, configure

__all__ = ["main", "parse_args"]

log = logging.getLogger("dissoc")

#: ``dissoc serve --live``'s retention defaults (those of :mod:`dissoc.datasets.live`, not imported here:
#: the command line loads pyarrow only for the subcommands that need it).
DEFAULT_LIVE_BATCHES = 10_000
DEFAULT_LIVE_MIB = 256


def _port(text: str) -> int:
    """A TCP/UDP port number, 0..65535 (0 picks a free one); anything else is a usage error."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range (0-65535; 0 picks a free one)")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _limit(text: str) -> int | None:
    """A count or size limit: a non-negative integer, 0 meaning no limit."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no limit) or positive, got {value}")
    return value or None


def _seconds(text: str) -> float | None:
    """A timeout in seconds, 0 meaning none."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 (none) or a positive number of seconds, got {text}")
    return value or None


def _keepalive(text: str) -> Any:
    """``--keepalive``: IDLE,INTERVAL,COUNT[,USER_TIMEOUT] or off."""
    from dissoc.transport.tcp import parse_keepalive

    try:
        return parse_keepalive(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _keepalive_flag(parser: Any) -> None:
    from dissoc.transport.tcp import DEFAULT_KEEPALIVE, format_keepalive

    parser.add_argument(
        "--keepalive",
        type=_keepalive,
        default=DEFAULT_KEEPALIVE,
        metavar="SPEC",
        help="how TCP/TLS connections notice a peer gone without a word: IDLE,INTERVAL,COUNT[,USER_TIMEOUT] "
        f"seconds, probes, seconds (default {format_keepalive(DEFAULT_KEEPALIVE)}), or off",
    )


def _start(text: str) -> str:
    """A live stream's start: a number >= 0, ``earliest`` or ``latest``; anything else is a usage error."""
    value = text.strip().lower()
    if value in ("earliest", "latest") or value.isdigit():
        return value
    raise argparse.ArgumentTypeError(f"expected an offset (a number), 'earliest' or 'latest', not {text!r}")


def _timeout(text: str) -> float:
    """A positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _connections(text: str) -> int | str | None:
    return "auto" if text == "auto" else _limit(text)


#: What ``dissoc get -o`` writes, by kind: (what it is called, the suffixes that choose it).
_OUTPUT_SUFFIXES: dict[str, tuple[str, tuple[str, ...]]] = {
    "ipc": ("an Arrow IPC file", (".arrow", ".feather", ".ipc")),
    "ipc-stream": ("an Arrow IPC stream", (".arrows", ".stream")),
    "parquet": ("Parquet", (".parquet", ".parq")),
    "csv": ("CSV", (".csv",)),
}


def _output_kind(path: str) -> str | None:
    suffix = Path(path).suffix.lower()
    return next((kind for kind, (_, suffixes) in _OUTPUT_SUFFIXES.items() if suffix in suffixes), None)


def _output(text: str) -> str:
    """``-o FILE``: a path whose suffix names a format ``dissoc get`` writes; anything else is a usage
    error."""
    if _output_kind(text) is None:
        known = ", ".join(s for _, suffixes in _OUTPUT_SUFFIXES.values() for s in suffixes)
        raise argparse.ArgumentTypeError(
            f"cannot tell what to write to {text!r}: its suffix must be one of {known}"
        )
    return text


#: Environment variables read when the flags are not given (never the secret itself: a file holding it).
SECRET_FILE_ENV = "DISSOC_SECRET_FILE"
TOKEN_ENV = "DISSOC_TOKEN"


def _ttl(text: str) -> float:
    from dissoc.tokens import TokenError, parse_ttl

    try:
        return parse_ttl(text)
    except TokenError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _secret_file(args: argparse.Namespace) -> str | None:
    found: str | None = args.secret_file or os.environ.get(SECRET_FILE_ENV) or None
    return found


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    # The limits' defaults are the server's own (one definition each).
    from dissoc.flight.server import DEFAULT_MAX_PUT_BYTES
    from dissoc.server.options import (
        DEFAULT_IDLE_TIMEOUT,
        DEFAULT_MAX_CONNECTIONS_PER_PEER,
        DEFAULT_MAX_FREE_DATA_BYTES,
        DEFAULT_MAX_RECEIVING_BYTES,
        DEFAULT_MAX_TICKET_BYTES,
        DEFAULT_WANT_DATA_TIMEOUT,
    )
    from dissoc.tokens import DEFAULT_TTL

    p = argparse.ArgumentParser(
        prog="dissoc", description="Arrow Dissociated IPC: serve and fetch Arrow data."
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging on stderr (-v, -vv)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="serve Arrow IPC, Parquet, CSV and JSON files and directories, each under the ticket of its "
        "file stem",
    )
    s.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="Arrow IPC file or stream, Parquet, CSV/TSV or newline-delimited JSON file, or a directory of "
        "one of those formats (hive partitions become columns) (or 'paths' from the environment/file)",
    )
    s.add_argument(
        "--per-file",
        action="store_true",
        help="also serve each directory's files one by one, each as NAME/PATH (its path under the "
        "directory), which --flight lists as the directory's endpoints, read in order",
    )
    s.add_argument(
        "--live",
        default=None,
        metavar="NAME[=SCHEMA_FILE][,...]",
        help="serve live streams: NAME, fed through the Flight plane (dissoc publish) while clients follow "
        "it (dissoc get --follow); its schema from SCHEMA_FILE's (an Arrow IPC or Parquet file), else from "
        "the first batch published; several, comma-separated",
    )
    s.add_argument(
        "--live-max-batches",
        type=int,
        default=DEFAULT_LIVE_BATCHES,
        metavar="N",
        help=f"a live stream keeps at most its last N batches (default {DEFAULT_LIVE_BATCHES}; 0: no bound)",
    )
    s.add_argument(
        "--live-max-mib",
        type=int,
        default=DEFAULT_LIVE_MIB,
        metavar="MIB",
        help=f"... and at most MIB of them (default {DEFAULT_LIVE_MIB}; 0: no bound)",
    )
    s.add_argument(
        "--live-on-full",
        choices=["evict", "block", "refuse"],
        default="evict",
        help="when the retention is full: drop the oldest batches (a reader that needed one fails, naming "
        "the first offset held), make the producer wait for readers, or refuse the append (default evict)",
    )
    s.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a TOML file of serve options, keys named like the flags (default $DISSOC_CONFIG); "
        "precedence: flag > environment (DISSOC_<FLAG>) > file > default",
    )
    s.add_argument(
        "--log-format",
        choices=list(LOG_FORMATS),
        default="text",
        help="stderr lines: text, or one JSON object each",
    )
    s.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=None,
        help="default: warning, or info/debug with -v/-vv",
    )
    s.add_argument("--transport", choices=["tcp", "ucx"], default="tcp")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=0, help="metadata (or combined) port; 0 picks a free one")
    s.add_argument("--data-port", type=_port, default=0, help="data port with --split; 0 picks a free one")
    s.add_argument("--split", action="store_true", help="metadata and data streams on two servers")
    s.add_argument(
        "--role",
        choices=["all", "metadata", "data", "none"],
        default="all",
        help="with --split, run one half here (the other in another process: give the metadata half "
        "--advertise-data-uri); 'none': no server, only the datasets' catalog for --flight, handing out "
        "--advertise-uri and --advertise-data-uri",
    )
    s.add_argument("--advertise-uri", default=None, metavar="URI", help="metadata URI given to clients")
    s.add_argument("--advertise-data-uri", default=None, metavar="URI", help="data URI given to clients")
    s.add_argument("--body", choices=["packed", "pairs"], default="packed")
    s.add_argument(
        "--memory", choices=["shm", "ucx", "cuda"], default=None, help="what pair addresses point at"
    )
    s.add_argument(
        "--arena-mib",
        type=_positive_int,
        default=1024,
        metavar="MIB",
        help="with --body pairs: size of the memory arena pairs point into (default 1024)",
    )
    s.add_argument(
        "--no-resident",
        dest="resident",
        action="store_false",
        help="with --body pairs: copy every batch into the arena per request, instead of placing each once "
        "and listing it to every client",
    )
    s.add_argument(
        "--private-memory",
        action="store_true",
        help="with --body pairs (--memory shm or ucx): an arena per data connection, of --max-unfreed-mib, "
        "announced to it once its want_data is accepted, so a client reads only its own listings "
        "(all of them together within --arena-mib)",
    )
    s.add_argument("--compression", choices=["lz4", "zstd"], default=None)
    s.add_argument(
        "--device",
        action="store_true",
        help="upload each dataset to the GPU and serve it from device memory (needs the gpu extra)",
    )
    s.add_argument(
        "--flight",
        type=_port,
        default=None,
        metavar="PORT",
        help="also run an Arrow Flight control plane on this port (0 picks a free one)",
    )
    s.add_argument(
        "--flight-read-only",
        action="store_true",
        help="with --flight: refuse DoPut and the remove action (nobody can publish or remove)",
    )
    s.add_argument(
        "--flight-max-put-mib",
        type=_limit,
        default=DEFAULT_MAX_PUT_BYTES >> 20,
        metavar="MIB",
        help=f"with --flight: largest DoPut upload ({DEFAULT_MAX_PUT_BYTES >> 20}; 0: no limit)",
    )
    s.add_argument(
        "--metrics",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port; the ready lines "
        'then carry "metrics"); needs the metrics extra',
    )
    s.add_argument(
        "--metrics-host",
        default=None,
        metavar="HOST",
        help="with --metrics: the address the metrics endpoint listens on (default: --host)",
    )
    s.add_argument(
        "--secret-file",
        default=None,
        metavar="FILE",
        help=f"serve only signed tickets made with the secret in FILE (default ${SECRET_FILE_ENV}); see "
        "'dissoc token'",
    )

    lim = s.add_argument_group(
        "limits",
        "what one client can make the server hold (0 turns a limit off; see the README's limits table)",
    )
    lim.add_argument(
        "--max-connections",
        type=_connections,
        default="auto",
        metavar="N",
        help="connections open at once (split: half per port); 'auto' (default) stays below the fd limit",
    )
    lim.add_argument(
        "--max-connections-per-peer",
        type=_limit,
        default=DEFAULT_MAX_CONNECTIONS_PER_PEER,
        metavar="N",
        help=f"per client address ({DEFAULT_MAX_CONNECTIONS_PER_PEER})",
    )
    lim.add_argument(
        "--want-data-timeout",
        type=_seconds,
        default=DEFAULT_WANT_DATA_TIMEOUT,
        metavar="S",
        help=f"time to send a whole want_data after connecting or a stream ({DEFAULT_WANT_DATA_TIMEOUT:g})",
    )
    lim.add_argument(
        "--idle-timeout",
        type=_seconds,
        default=DEFAULT_IDLE_TIMEOUT,
        metavar="S",
        help=f"no request, no stream and no ranges held for this long: dropped ({DEFAULT_IDLE_TIMEOUT:g})",
    )
    _keepalive_flag(lim)
    lim.add_argument(
        "--max-ticket-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_TICKET_BYTES,
        metavar="N",
        help=f"want_data payload ({DEFAULT_MAX_TICKET_BYTES})",
    )
    lim.add_argument(
        "--max-free-data-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_FREE_DATA_BYTES,
        metavar="N",
        help=f"free_data payload ({DEFAULT_MAX_FREE_DATA_BYTES})",
    )
    lim.add_argument(
        "--max-unfreed-mib",
        type=_limit,
        default=None,
        metavar="MIB",
        help="pairs: what one client may hold awaiting free_data (default: a quarter of the arena)",
    )
    lim.add_argument(
        "--max-receiving-mib",
        type=_limit,
        default=DEFAULT_MAX_RECEIVING_BYTES >> 20,
        metavar="MIB",
        help=f"bytes being received across all connections ({DEFAULT_MAX_RECEIVING_BYTES >> 20})",
    )

    _tls_serve_flags(s)

    g = sub.add_parser("get", help="fetch one stream; prints a JSON summary")
    g.add_argument(
        "uri",
        help="metadata URI, e.g. tcp://HOST:PORT?want_data=N, or a Flight control plane grpc://HOST:PORT",
    )
    g.add_argument("ticket")
    g.add_argument("--data-uri", default=None, help="data URI when the servers are split")
    g.add_argument(
        "-o",
        "--output",
        type=_output,
        default=None,
        metavar="FILE",
        help="write what was fetched, batch by batch, as FILE's suffix says: "
        + ", ".join(f"{what} ({', '.join(suffixes)})" for what, suffixes in _OUTPUT_SUFFIXES.values()),
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to connect, and of silence tolerated mid-stream (default 30; --follow: no limit)",
    )
    g.add_argument(
        "--follow",
        action="store_true",
        help="follow a live stream: batches as they are published, until its producer ends it (no limit on "
        "silence; Ctrl-C stops)",
    )
    g.add_argument(
        "--from",
        dest="start",
        type=_start,
        default=None,
        metavar="OFFSET",
        help="a live stream: start at OFFSET (a number, 'earliest' or 'latest'; default earliest)",
    )
    _keepalive_flag(g)
    g.add_argument("--no-progress", action="store_true")
    g.add_argument(
        "--ucx-path",
        choices=["auto", "listener", "address"],
        default="auto",
        help="how a ucx:// connection is made: through the listener, by the URI's worker address, or auto",
    )
    g.add_argument(
        "--landing",
        choices=["host", "device"],
        default="host",
        help="where batches land: host memory, or GPU memory (copied to the host only for -o)",
    )
    g.add_argument(
        "--zero-copy",
        action="store_true",
        help="pairs: batches over the server's shared (or, landing on the device, CUDA IPC) memory",
    )
    g.add_argument(
        "--require-device-path",
        action="store_true",
        help="with --landing device: fail (exit 1) rather than land bodies that went through host memory "
        "(packed over TCP, pairs in shm or ucx memory); without it they are uploaded, with a warning",
    )
    _tls_get_flags(g)
    g.add_argument(
        "--token",
        default=None,
        help=f"a signed ticket for a server with a secret (default ${TOKEN_ENV}): a Flight location gets it "
        "as its bearer token; a dissoc URI gets it in place of TICKET",
    )

    t = sub.add_parser("token", help="print a signed ticket for a server started with --secret-file")
    t.add_argument("name", metavar="NAME", help="the dataset's name ('*': every dataset, on a Flight plane)")
    t.add_argument(
        "--secret-file",
        default=None,
        metavar="FILE",
        help=f"the server's secret (default ${SECRET_FILE_ENV})",
    )
    t.add_argument(
        "--ttl",
        type=_ttl,
        default=float(DEFAULT_TTL),
        help=f"how long it is valid: 90, 90s, 10m, 2h, 1d (default {DEFAULT_TTL // 60}m)",
    )
    t.add_argument(
        "--scope",
        choices=["read", "write"],
        default="read",
        help="read (fetch, describe, list) or write (also publish and remove on a Flight plane)",
    )
    t.add_argument(
        "--bind",
        default=None,
        metavar="SUBJECT",
        help="valid only from the client whose mutual-TLS certificate subject is SUBJECT",
    )
    t.add_argument(
        "--json", action="store_true", help='print {"ticket", "name", "scope", "expires", "bind"} as JSON'
    )

    h = sub.add_parser(
        "health",
        help="does the server at URI answer a cheap request? exit 0 if so, 1 if not; prints a JSON line",
    )
    h.add_argument(
        "uri", help="a dissoc URI (metadata, data or combined server) or a Flight location grpc://HOST:PORT"
    )
    h.add_argument("--timeout", type=_timeout, default=5.0, help="seconds to answer (default 5)")
    h.add_argument("--ucx-path", choices=["auto", "listener", "address"], default="auto")
    _tls_get_flags(h)
    h.add_argument("--token", default=None, help=f"bearer token for a Flight plane (default ${TOKEN_ENV})")

    pub = sub.add_parser(
        "publish",
        help="append files' batches to a live stream through a Flight plane (dissoc serve --flight --live); "
        "prints the acknowledgement as a JSON line",
    )
    pub.add_argument("location", help="the Flight control plane, grpc://HOST:PORT")
    pub.add_argument("name", help="the live stream")
    pub.add_argument(
        "files", nargs="+", metavar="FILE", help="Arrow IPC, Parquet, CSV or JSON files, in order"
    )
    pub.add_argument("--close", action="store_true", help="end the stream after the last batch")
    pub.add_argument("--timeout", type=_timeout, default=None, help="seconds the whole upload may take")
    _tls_get_flags(pub)
    pub.add_argument(
        "--token", default=None, help=f"bearer token for the Flight plane (default ${TOKEN_ENV})"
    )

    c = sub.add_parser(
        "cleanup",
        help="remove the shared-memory segments killed dissoc servers left behind; prints a JSON summary",
    )
    c.add_argument("--dir", default=None, help="where POSIX shared memory lives (default /dev/shm)")
    return p


def _tls_serve_flags(s: argparse.ArgumentParser) -> None:
    from dissoc.transport.tls import DEFAULT_HANDSHAKE_TIMEOUT

    t = s.add_argument_group(
        "TLS", "serve tls:// URIs (and grpc+tls:// with --flight); see the README's 'Running on a cluster'"
    )
    t.add_argument(
        "--tls-cert", metavar="PEM", help="the server's certificate chain (names the host clients use)"
    )
    t.add_argument("--tls-key", metavar="PEM", help="the server's private key (unencrypted PEM)")
    t.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        help="mutual TLS: clients must present a certificate signed by a CA in this bundle",
    )
    t.add_argument(
        "--tls-handshake-timeout",
        type=_seconds,
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        metavar="S",
        help=f"a connection that has not completed its TLS handshake by then is dropped "
        f"({DEFAULT_HANDSHAKE_TIMEOUT:g})",
    )


def _tls_get_flags(g: argparse.ArgumentParser) -> None:
    t = g.add_argument_group("TLS", "for tls:// URIs and grpc+tls:// control planes")
    t.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="CA bundle the server's certificate is checked against (default: system's)",
    )
    t.add_argument(
        "--tls-cert", metavar="PEM", help="this client's certificate, for servers that require one"
    )
    t.add_argument("--tls-key", metavar="PEM", help="this client's private key")


def _tls_serve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Server and control-plane keywords for the TLS flags (none without --tls-cert)."""
    if args.tls_cert is None:
        if args.tls_key is not None or args.tls_client_ca is not None:
            raise DissocError("--tls-key and --tls-client-ca need --tls-cert")
        return {}
    if args.tls_key is None:
        raise DissocError("--tls-cert needs --tls-key (the certificate's private key)")
    return {"tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_client_ca": args.tls_client_ca}


# --------------------------------------------------------------------------------------------------- serve


async def _serve(args: argparse.Namespace) -> int:
    from dissoc.datasets import FileSystemDataset, LiveDataset, dataset_from
    from dissoc.server import Server, ServerOptions
    from dissoc.tokens import Secret, load_secret

    secret_file = _secret_file(args)
    secret: Secret | None = load_secret(secret_file) if secret_file else None
    if secret is None and not _is_loopback(args.host):
        sys.stderr.write(
            f"dissoc: warning: serving on {args.host} without --secret-file: anyone who can reach the port "
            "can read every dataset (see 'Running on a cluster' in the README)\n"
        )

    if args.per_file and args.device:
        raise DissocError("--per-file does not combine with --device (serve the files one by one)")
    datasets: dict[str, Any] = {}
    for path in args.paths or ():
        per_file = args.per_file and Path(path).is_dir()
        ds = FileSystemDataset(path, per_file=True) if per_file else dataset_from(path)
        if ds.name in datasets:
            raise DissocError(f"two paths would be served under the same ticket {ds.name!r}")
        datasets[ds.name] = ds
    if args.device:
        from dissoc.datasets import DeviceDataset
        from dissoc.device import DeviceBatch

        for name, ds in list(datasets.items()):
            batches = DeviceBatch.from_batches(ds.schema, list(ds.open()))
            datasets[name] = DeviceDataset(name, batches, schema=ds.schema)
            ds.close()
    for spec in filter(None, (args.live or "").split(",")):
        name, _, schema_file = spec.strip().partition("=")
        if name in datasets:
            raise DissocError(f"--live {name}: a dataset of that name is served already")
        schema = dataset_from(schema_file).schema if schema_file else None
        datasets[name] = LiveDataset(
            name,
            schema,
            max_batches=args.live_max_batches or None,
            max_bytes=(args.live_max_mib << 20) or None,
            on_full=args.live_on_full,
        )
    tls = _tls_serve_options(args)
    server = Server(datasets, ServerOptions.from_args(args, secret=secret))
    async with contextlib.AsyncExitStack() as running:
        metrics_url: str | None = None
        if args.metrics is not None:
            from dissoc.metrics import start_http_server

            exporter = start_http_server(args.metrics, args.metrics_host or args.host)
            running.callback(exporter.close)  # stopped last, after the servers
            metrics_url = exporter.url
        await running.enter_async_context(server)
        flight_location: str | None = None
        if args.flight is not None:
            from dissoc.flight import FlightControlPlane

            plane = FlightControlPlane(
                server,
                host=args.host,
                port=args.flight,
                read_only=args.flight_read_only,
                max_put_bytes=None if args.flight_max_put_mib is None else args.flight_max_put_mib << 20,
                **tls,
            )
            await running.enter_async_context(plane)
            flight_location = plane.location
        # Handlers first: a script may signal the moment it reads the ready lines.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        for name, ds in datasets.items():
            line: dict[str, Any] = {"ticket": name, "uri": server.uri, "data_uri": server.data_uri}
            if ds.parts:
                line["parts"] = [part.name for part in ds.parts]
            if flight_location is not None:
                line["flight"] = flight_location
            if metrics_url is not None:
                line["metrics"] = metrics_url
            sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        await stop.wait()
        log.info("stopping")
    return 0


# --------------------------------------------------------------------------------------------------- get


class _Progress:
    """A one-line progress display on stderr, only when stderr is a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.last = 0.0

    def update(self, batches: int, nbytes: int, started: float) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.1:
            return
        self.last = now
        rate = nbytes / max(now - started, 1e-9) / 1e9
        sys.stderr.write(f"\r{batches} batches  {nbytes / 1e6:,.1f} MB  {rate:.2f} GB/s ")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def _get(args: argparse.Namespace) -> int:
    import pyarrow as pa

    from dissoc import codec
    from dissoc.client import ClientOptions, FetchStats, stream_batches

    if args.require_device_path and args.landing != "device":
        raise DissocError("--require-device-path applies to --landing device")
    if args.start is not None:
        args.ticket = f"{args.ticket}@{args.start}"
    options = ClientOptions(
        timeout=None if args.follow else args.timeout,
        ucx_path=args.ucx_path,
        landing=args.landing,
        zero_copy=args.zero_copy,
        flight_timeout=args.timeout,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        token=args.token or os.environ.get(TOKEN_ENV) or None,
        require_device_path=args.require_device_path,
        keepalive=args.keepalive,
    )
    stats = FetchStats()
    progress = _Progress(not args.no_progress)
    started = time.perf_counter()
    writer: Any = None
    schema_holder: list[Any] = []
    nbytes = 0
    count = 0
    try:
        # A Flight location (grpc://) is resolved by the client into its endpoints, read in order.
        async for batch in stream_batches(
            args.uri,
            args.ticket,
            data_uri=args.data_uri,
            options=options,
            stats=stats,
            on_schema=schema_holder.append,
        ):
            nbytes += batch.nbytes
            count += 1
            if args.output is not None:
                host = batch if isinstance(batch, pa.RecordBatch) else batch.to_arrow()
                if writer is None:
                    writer = _open_writer(args.output, host.schema)
                writer.write_batch(host)
                del host  # zero copy: a batch still referenced here would keep its ranges from settle()
            del batch
            progress.update(count, nbytes, started)
        rows = stats.rows
        if args.output is not None and writer is None and schema_holder:
            writer = _open_writer(args.output, schema_holder[0])
    finally:
        if writer is not None:
            writer.close()
        progress.done()
        if args.zero_copy:
            import gc

            from dissoc.client import settle

            gc.collect()  # a batch kept alive by an exception's traceback: its frees go now
            await settle()
    seconds = time.perf_counter() - started
    summary: dict[str, Any] = {
        "rows": rows,
        "batches": count,
        "bytes": nbytes,
        "seconds": round(seconds, 6),
        "gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds > 0 else None,
        # the path the bytes took (the first stream's; each one's under "paths" when there were several)
        "path": stats.path.as_dict() if stats.path is not None else None,
    }
    if len(stats.paths) > 1:
        summary["paths"] = [p.as_dict() for p in stats.paths]
    if args.output is not None:
        summary["output"] = str(args.output)
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    del codec
    return 0


def _open_writer(path: str, schema: Any) -> _Output:
    return _Output(path, schema)


class _Output:
    """``dissoc get -o FILE``: the batches written one at a time, in the format FILE's suffix names (an
    Arrow IPC file or stream, Parquet, CSV). A write that fails is a DissocError naming the file."""

    def __init__(self, path: str, schema: Any) -> None:
        import pyarrow as pa

        from dissoc import codec

        self.path = path
        self.kind = _output_kind(path)
        assert self.kind is not None  # checked when the arguments were parsed
        self.what = _OUTPUT_SUFFIXES[self.kind][0]
        try:
            if self.kind == "ipc":
                self._writer: Any = codec.new_file(path, schema)
            elif self.kind == "ipc-stream":
                self._writer = codec.new_stream(path, schema)
            elif self.kind == "parquet":
                import pyarrow.parquet as pq

                self._writer = pq.ParquetWriter(path, schema)
            else:
                import pyarrow.csv as pacsv

                self._writer = pacsv.CSVWriter(path, schema)
        except (OSError, pa.ArrowException) as e:
            raise DissocError(f"cannot write {path!r} as {self.what}: {_arrow_reason(e)}") from None

    def write_batch(self, batch: Any) -> None:
        import pyarrow as pa

        try:
            self._writer.write_batch(batch)
        except (OSError, pa.ArrowException) as e:
            raise DissocError(f"writing {self.path!r} as {self.what} failed: {_arrow_reason(e)}") from None

    def close(self) -> None:
        import pyarrow as pa

        try:
            self._writer.close()
        except (OSError, pa.ArrowException) as e:
            raise DissocError(f"closing {self.path!r} failed: {_arrow_reason(e)}") from None


def _arrow_reason(error: BaseException) -> str:
    return str(error).split(". Detail: ", 1)[0].strip() or type(error).__name__


# --------------------------------------------------------------------------------------------------- token


def _token(args: argparse.Namespace) -> int:
    """Print one signed ticket for NAME, made with the secret in the secret file."""
    from dissoc.tokens import load_secret, peek

    secret_file = _secret_file(args)
    if not secret_file:
        raise DissocError(f"dissoc token needs --secret-file FILE (or ${SECRET_FILE_ENV})")
    ticket = load_secret(secret_file).mint(args.name, ttl=args.ttl, scope=args.scope, bind=args.bind)
    if args.json:
        claims = peek(ticket)
        assert claims is not None
        line = {
            "ticket": ticket,
            "name": claims.name,
            "scope": claims.scope,
            "expires": claims.expires,
            "bind": claims.bind,
        }
        sys.stdout.write(json.dumps(line) + "\n")
    else:
        sys.stdout.write(ticket + "\n")
    sys.stdout.flush()
    return 0


# -------------------------------------------------------------------------------------------------- health


def _health(args: argparse.Namespace) -> int:
    """Probe one server; the JSON line says what it answered (or why it is not healthy)."""
    from dissoc.client import ClientOptions
    from dissoc.health import check_sync

    options = ClientOptions(
        ucx_path=args.ucx_path,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        token=args.token or os.environ.get(TOKEN_ENV) or None,
    )
    result = check_sync(args.uri, timeout=args.timeout, options=options)
    sys.stdout.write(json.dumps(result.as_dict()) + "\n")
    sys.stdout.flush()
    return 0 if result.healthy else 1


# ------------------------------------------------------------------------------------------------- cleanup


def _cleanup(args: argparse.Namespace) -> int:
    """Unlink the segments of dead dissoc processes (a SIGKILLed pairs server leaves its arena behind)."""
    from dissoc.memory.shm import SHM_DIR, remove_stale_segments

    removed = remove_stale_segments(directory=args.dir or SHM_DIR)
    summary = {
        "removed": [{"name": r.name, "size": r.size, "allocated": r.allocated} for r in removed],
        "bytes": sum(r.allocated for r in removed),
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------------------------------- main


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise LookupError(name)


def parse_args(
    argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[argparse.Namespace, Layered | None]:
    """The command line's arguments, ``serve``'s completed from ``environ`` (default ``os.environ``) and its
    configuration file (flag > environment > file > default), with where each came from. Usage errors,
    configuration errors included, print the usage and raise ``SystemExit(2)``, as argparse does."""
    parser = _parser()
    serve_parser = _subparser(parser, "serve")
    serve_defaults = track_defaults(serve_parser)
    args = parser.parse_args(argv)
    if args.command != "serve":
        return args, None
    try:
        layered = layer(
            serve_parser, args, serve_defaults, environ=environ, config_file=config_path(args, environ)
        )
    except ConfigError as e:
        serve_parser.error(str(e))
    if not args.paths and not args.live:
        serve_parser.error(
            "no PATH to serve (as arguments, in DISSOC_PATHS or the file's 'paths') and no --live stream"
        )
    return args, layered


def _publish(args: argparse.Namespace) -> int:
    """``dissoc publish``: each file's batches, in order, appended to the live stream by one DoPut each."""
    from dissoc.datasets import dataset_from
    from dissoc.flight import append

    options: dict[str, Any] = {
        "tls_ca": args.tls_ca,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "token": args.token or os.environ.get(TOKEN_ENV) or None,
        "timeout": args.timeout,
    }
    ack: dict[str, Any] = {}
    rows = batches = 0
    for k, path in enumerate(args.files):
        source = dataset_from(path)
        try:
            last = k == len(args.files) - 1
            ack = append(
                args.location,
                args.name,
                source.open(),
                schema=source.schema,
                close=args.close and last,
                **options,
            )
        finally:
            source.close()
        rows += int(ack.get("rows", 0))
        batches += int(ack.get("batches", 0))
    sys.stdout.write(json.dumps({**ack, "rows": rows, "batches": batches, "files": len(args.files)}) + "\n")
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dissoc`` command."""
    try:
        args, layered = parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 for --help
        return int(e.code or 0)
    level = max(logging.WARNING - 10 * args.verbose, logging.DEBUG)
    log_format = "text"
    if args.command == "serve":
        log_format = args.log_format
        if args.log_level is not None:
            level = logging.getLevelName(args.log_level.upper())
    configure(level, log_format)
    if layered is not None:
        for name, like in layered.unknown_env:
            log.warning("environment variable %s names no 'dissoc serve' option (%s?): ignored", name, like)
        for dest, source in layered.sources.items():
            if source not in ("default", "flag"):
                log.info("%s from %s", dest, source)
    try:
        if args.command == "serve":
            return asyncio.run(_serve(args))
        if args.command == "cleanup":
            return _cleanup(args)
        if args.command == "token":
            return _token(args)
        if args.command == "health":
            return _health(args)
        if args.command == "publish":
            return _publish(args)
        return asyncio.run(_get(args))
    except DissocError as e:
        sys.stderr.write(f"dissoc: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
