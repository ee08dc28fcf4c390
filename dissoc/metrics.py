"""Metrics for Prometheus: what the servers, the Flight control plane and the client do, counted as they do it
and read by a prometheus-client collector only when scraped.

Ground floor (it imports nothing of dissoc but its errors), so every layer counts into it. What counting
costs:

- per message (bytes and batches sent or received), a Python integer add on a :class:`Tally` the server or
  client looked up once per stream: no lock, no dict, no prometheus-client call on the fast path;
- per event (a stream begun or ended, a connection, a request, a refusal), :meth:`Family.inc`: a dict entry
  under a lock;
- gauges (connections open, arena occupancy, bytes awaiting free_data, bytes in flight) cost nothing until a
  scrape: the objects that know them are :func:`register`-ed and asked then.

The counts are process-wide (:data:`SERVER`, :data:`FLIGHT`, :data:`CLIENT`). Read them with
:func:`server_metrics` / :func:`client_metrics` (plain dicts, no dependency), or export them: register
:func:`collector` in a ``prometheus_client.CollectorRegistry`` of your own, or run :func:`start_http_server`
(what ``dissoc serve --metrics PORT`` does). Exporting needs prometheus-client: ``pip install
'dissoc[metrics]'``; importing dissoc never imports it.

Counts from several threads (clients in their own threads, Flight calls) are exact for events. Per-message
tallies are plain adds without a lock: exact within one event loop (where a server counts), while two threads
adding to one tally at the same instant (servers or synchronous clients of one process on different threads)
could, rarely, lose an add. The client adds once per burst of batches, not per batch.
"""

from __future__ import annotations

import bisect
import importlib
import logging
import math
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias

from dissoc.errors import DissocError

__all__ = [
    "CLIENT",
    "FLIGHT",
    "SERVER",
    "SOURCE_METRICS",
    "TIME_BUCKETS",
    "ClientMetrics",
    "Collector",
    "Exported",
    "Family",
    "FlightMetrics",
    "Histogram",
    "Labels",
    "MetricsServer",
    "Sample",
    "ServerMetrics",
    "Source",
    "Tally",
    "client_metrics",
    "collector",
    "families",
    "register",
    "server_metrics",
    "start_http_server",
    "unregister",
]

log = logging.getLogger(__name__)

Kind: TypeAlias = Literal["counter", "gauge", "histogram"]
#: A sample's labels as ``((name, value), ...)``, in the family's label order.
Labels: TypeAlias = "tuple[tuple[str, str], ...]"
#: What a :class:`Source` reports at scrape time: (metric name, label values in the metric's order, value).
Sample: TypeAlias = "tuple[str, tuple[str, ...], float]"

#: Upper bounds (seconds) of the time-to-first-batch histograms' buckets.
TIME_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Family:
    """A counter (or gauge) with labels: values by label values, added to under a lock (per event)."""

    __slots__ = ("_lock", "doc", "kind", "labelnames", "name", "values")

    def __init__(self, name: str, doc: str, labelnames: Sequence[str] = (), kind: Kind = "counter") -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self.kind = kind
        self.values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, *labels: str, amount: float = 1) -> None:
        """Add ``amount`` to the sample of these label values (one value per label name, in order)."""
        with self._lock:
            self.values[labels] = self.values.get(labels, 0) + amount

    def value(self, *labels: str) -> float:
        """The sample of these label values (0 if never counted)."""
        return self.values.get(labels, 0)

    def total(self) -> float:
        """The sum over every label value."""
        with self._lock:
            return sum(self.values.values())

    def samples(self) -> dict[tuple[str, ...], float]:
        """A copy of the samples, by label values."""
        with self._lock:
            return dict(self.values)


class Tally:
    """Bytes and batches of one (transport, body) pair: the per-message counter, plain integer adds.

    Look it up once (:meth:`ServerMetrics.sent`, :meth:`ClientMetrics.received`), then add to its fields."""

    __slots__ = ("batches", "bytes")

    def __init__(self) -> None:
        self.batches = 0
        self.bytes = 0


class _Tallies:
    """Tallies by (transport, body), exported as two counters: ``{prefix}_bytes_total`` and
    ``{prefix}_batches_total``."""

    def __init__(self, prefix: str, what: str) -> None:
        self.prefix = prefix
        self.what = what
        self._by: dict[tuple[str, str], Tally] = {}
        self._lock = threading.Lock()

    def get(self, transport: str, body: str) -> Tally:
        key = (transport, body)
        tally = self._by.get(key)
        if tally is None:
            with self._lock:
                tally = self._by.setdefault(key, Tally())
        return tally

    def families(self) -> list[Exported]:
        with self._lock:
            items = list(self._by.items())
        labels = ("transport", "body")
        return [
            Exported(
                "counter",
                f"{self.prefix}_bytes_total",
                f"Body bytes {self.what} (packed: the bodies; pairs: the bytes the pair lists point at)",
                labels,
                {key: float(t.bytes) for key, t in items},
            ),
            Exported(
                "counter",
                f"{self.prefix}_batches_total",
                f"Messages with a body (record and dictionary batches) {self.what}",
                labels,
                {key: float(t.batches) for key, t in items},
            ),
        ]


class Histogram:
    """Observations counted in fixed buckets (upper bounds ``buckets``, then +Inf), with their sum."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float] = TIME_BUCKETS) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        """Count one observation (NaN is ignored)."""
        if math.isnan(value):
            return
        i = bisect.bisect_left(self.bounds, value)  # the first bucket whose bound is >= value
        with self._lock:
            self.counts[i] += 1
            self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        """The buckets as Prometheus has them, ``[(le, count of values <= le), ..., ("+Inf", total)]``, and
        the sum."""
        with self._lock:
            counts, total = list(self.counts), self.sum
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*(repr(float(b)) for b in self.bounds), "+Inf"), counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out, total


class ServerMetrics:
    """What dissoc servers count (every server of the process together; labels tell roles apart)."""

    def __init__(self) -> None:
        self.connections = Family(
            "dissoc_server_connections_total", "Connections accepted", ("role", "transport")
        )
        self.want_data = Family("dissoc_server_want_data_total", "want_data requests received", ("role",))
        self.free_data = Family("dissoc_server_free_data_total", "free_data messages received", ("role",))
        self.freed_bytes = Family(
            "dissoc_server_freed_bytes_total", "Bytes of listed ranges freed by free_data", ("role",)
        )
        self.streams_started = Family(
            "dissoc_server_streams_started_total", "Streams begun (a want_data accepted)", ("role",)
        )
        self.streams_finished = Family(
            "dissoc_server_streams_finished_total", "Streams sent to their end", ("role",)
        )
        self.streams_failed = Family(
            "dissoc_server_streams_failed_total",
            "Streams that ended early, by reason (client_gone, stream_failed, quota_exceeded, "
            "arenas_exhausted, cancelled: the server closed)",
            ("role", "reason"),
        )
        self.refusals = Family(
            "dissoc_server_refusals_total",
            "Requests and connections refused or dropped by a limit or check, by reason (unknown_ticket, "
            "unauthorized, request_too_large, receive_budget, quota_exceeded, arenas_exhausted, "
            "bad_free_data, max_connections, max_connections_per_peer, want_data_timeout, request_timeout, "
            "idle_timeout, tls_handshake)",
            ("reason",),
        )
        self._sent = _Tallies("dissoc_server_sent", "sent")
        #: Bytes handed to a connection's send that has not returned yet (a slow client's backpressure).
        self.in_flight = Tally()
        self.time_to_first_batch = Histogram(
            "dissoc_server_time_to_first_batch_seconds",
            "Seconds from a want_data accepted to its stream's first batch ready to send (the dataset opened "
            "and read that far)",
        )

    def sent(self, transport: str, body: str) -> Tally:
        """The tally of bytes and batches sent over ``transport`` with ``body`` (``packed`` or ``pairs``)."""
        return self._sent.get(transport, body)

    def families(self) -> list[Exported]:
        out = [
            _family(f)
            for f in (
                self.connections,
                self.want_data,
                self.free_data,
                self.freed_bytes,
                self.streams_started,
                self.streams_finished,
                self.streams_failed,
                self.refusals,
            )
        ]
        out.extend(self._sent.families())
        out.append(
            Exported(
                "gauge",
                "dissoc_server_in_flight_bytes",
                "Bytes handed to a connection's send that has not returned yet (slow clients' backpressure)",
                (),
                {(): float(self.in_flight.bytes)},
            )
        )
        out.append(_histogram(self.time_to_first_batch))
        return out


class FlightMetrics:
    """What the Flight control plane counts."""

    def __init__(self) -> None:
        self.calls = Family(
            "dissoc_flight_calls_total",
            "Flight control-plane calls, by method and outcome (ok, or the error code)",
            ("method", "code"),
        )

    def families(self) -> list[Exported]:
        return [_family(self.calls)]


class ClientMetrics:
    """What the dissoc client counts (every stream this process read)."""

    def __init__(self) -> None:
        self.streams_started = Family(
            "dissoc_client_streams_started_total", "Streams asked for (want_data sent)", ("transport",)
        )
        self.streams_finished = Family(
            "dissoc_client_streams_finished_total", "Streams read to their end", ("transport",)
        )
        self.streams_failed = Family(
            "dissoc_client_streams_failed_total",
            "Streams that failed, by reason (the server's error code, transport, protocol, resource, "
            "device_path, closed_early: the consumer stopped reading)",
            ("transport", "reason"),
        )
        self.free_data = Family("dissoc_client_free_data_total", "free_data messages sent", ("transport",))
        self.device_host_copies = Family(
            "dissoc_client_device_host_copies_total",
            "Streams landing on the device whose bodies went through host memory (received on the host, "
            "then uploaded), by data transport and body",
            ("transport", "body"),
        )
        self._received = _Tallies("dissoc_client_received", "received and decoded")
        self.time_to_first_batch = Histogram(
            "dissoc_client_time_to_first_batch_seconds",
            "Seconds from asking for a stream to its first batch decoded",
        )

    def received(self, transport: str, body: str) -> Tally:
        """The tally of bytes and batches received over ``transport`` with ``body`` (packed or pairs)."""
        return self._received.get(transport, body)

    def families(self) -> list[Exported]:
        out = [_family(f) for f in (self.streams_started, self.streams_finished, self.streams_failed)]
        out.append(_family(self.free_data))
        out.append(_family(self.device_host_copies))
        out.extend(self._received.families())
        out.append(_histogram(self.time_to_first_batch))
        return out


#: The process's server-side counts.
SERVER = ServerMetrics()
#: The process's Flight control-plane counts.
FLIGHT = FlightMetrics()
#: The process's client-side counts.
CLIENT = ClientMetrics()


# ------------------------------------------------------------------------------------------- live sources


class Source(Protocol):
    """An object asked for its gauges (and counters it keeps itself) at scrape time."""

    def metrics_samples(self) -> Iterable[Sample]:
        """``(name, label values, value)`` for metrics named in :data:`SOURCE_METRICS`; samples of one name
        and labels from several sources are added up."""
        ...


#: The metrics :class:`Source` objects report: name -> (kind, help, label names).
SOURCE_METRICS: dict[str, tuple[Kind, str, tuple[str, ...]]] = {
    "dissoc_server_connections_open": ("gauge", "Connections open", ("role", "transport")),
    "dissoc_server_awaiting_free_data_bytes": (
        "gauge",
        "Bytes listed to clients in pair lists and not freed yet (awaiting free_data)",
        (),
    ),
    "dissoc_server_arena_used_bytes": ("gauge", "Bytes of the pair arenas in use", ("memory",)),
    "dissoc_server_arena_capacity_bytes": ("gauge", "Bytes the pair arenas hold at most", ("memory",)),
    "dissoc_server_arena_resident_bytes": (
        "gauge",
        "Arena bytes of resident placements (placed once, listed to every client that asks)",
        ("memory",),
    ),
    "dissoc_server_arena_placements_total": (
        "counter",
        "Batches placed in a pair arena",
        ("memory",),
    ),
    "dissoc_server_arena_evictions_total": (
        "counter",
        "Resident placements evicted to make room",
        ("memory",),
    ),
    "dissoc_server_receiving_bytes": (
        "gauge",
        "Bytes being received, or received and not yet taken, from clients (max_receiving_bytes)",
        (),
    ),
    "dissoc_live_head_offset": (
        "gauge",
        "A live stream's next offset (batches appended so far)",
        ("stream",),
    ),
    "dissoc_live_first_offset": ("gauge", "A live stream's first offset still held", ("stream",)),
    "dissoc_live_retained_batches": ("gauge", "Batches a live stream holds (its retention)", ("stream",)),
    "dissoc_live_retained_bytes": ("gauge", "Bytes of batches a live stream holds", ("stream",)),
    "dissoc_live_readers": ("gauge", "Readers following a live stream", ("stream",)),
    "dissoc_live_max_lag_batches": (
        "gauge",
        "Batches the slowest reader of a live stream has still to take",
        ("stream",),
    ),
    "dissoc_client_streams_open": ("gauge", "Streams being read", ()),
    "dissoc_client_in_flight_bytes": (
        "gauge",
        "Bytes received and not yet decoded (bounded by max_in_flight_bytes per stream)",
        (),
    ),
}

_sources: weakref.WeakSet[Any] = weakref.WeakSet()
_sources_lock = threading.Lock()
#: Counters of sources that were unregistered (their counts stay in the totals).
_retired: dict[tuple[str, tuple[str, ...]], float] = {}


def register(source: Source) -> None:
    """Ask ``source`` for its samples at every scrape, until :func:`unregister` (or until it is garbage; it
    is held weakly)."""
    with _sources_lock:
        _sources.add(source)


def unregister(source: Source) -> None:
    """Stop asking ``source``; its counters' last values stay in the totals (counters never go down)."""
    with _sources_lock:
        if source not in _sources:
            return
        _sources.discard(source)
        for name, labels, value in _safe_samples(source):
            spec = SOURCE_METRICS.get(name)
            if spec is not None and spec[0] == "counter":
                _retired[(name, labels)] = _retired.get((name, labels), 0) + value


def _safe_samples(source: Source) -> list[Sample]:
    try:
        return list(source.metrics_samples())
    except Exception:  # a scrape must not fail for one source
        log.warning("reading metrics from %r failed", source, exc_info=True)
        return []


def _source_families(prefix: str) -> list[Exported]:
    with _sources_lock:
        sources = list(_sources)
        sums: dict[str, dict[tuple[str, ...], float]] = {}
        for (name, labels), value in _retired.items():
            sums.setdefault(name, {})[labels] = value
    for source in sources:
        for name, labels, value in _safe_samples(source):
            if name not in SOURCE_METRICS:
                continue
            by = sums.setdefault(name, {})
            by[labels] = by.get(labels, 0) + value
    out = []
    for name, (kind, doc, labelnames) in SOURCE_METRICS.items():
        if name.startswith(prefix):
            out.append(Exported(kind, name, doc, labelnames, sums.get(name, {})))
    return out


# ---------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class Exported:
    """One metric as exported: counters and gauges have ``samples``, histograms ``buckets`` and ``sum``."""

    kind: Kind
    name: str
    doc: str
    labelnames: tuple[str, ...]
    samples: dict[tuple[str, ...], float]
    buckets: tuple[tuple[str, float], ...] = ()
    sum: float = 0.0


def _family(f: Family) -> Exported:
    return Exported(f.kind, f.name, f.doc, f.labelnames, f.samples())


def _histogram(h: Histogram) -> Exported:
    buckets, total = h.cumulative()
    return Exported("histogram", h.name, h.doc, (), {}, tuple(buckets), total)


_SIDES = {"server": ("dissoc_server_", "dissoc_flight_"), "client": ("dissoc_client_",)}


def families(side: Literal["server", "client"] | None = None) -> list[Exported]:
    """Every dissoc metric as it stands now (``side``: only the server's and Flight plane's, or only the
    client's)."""
    out: list[Exported] = []
    if side in (None, "server"):
        out.extend(SERVER.families())
        out.extend(FLIGHT.families())
        out.extend(_source_families("dissoc_server_"))
    if side in (None, "client"):
        out.extend(CLIENT.families())
        out.extend(_source_families("dissoc_client_"))
    return out


def _snapshot(side: Literal["server", "client"]) -> dict[str, dict[Labels, float]]:
    out: dict[str, dict[Labels, float]] = {}
    for f in families(side):
        if f.kind == "histogram":
            out[f"{f.name}_count"] = {(): f.buckets[-1][1]}
            out[f"{f.name}_sum"] = {(): f.sum}
            out[f"{f.name}_bucket"] = {(("le", le),): n for le, n in f.buckets}
        else:
            out[f.name] = {tuple(zip(f.labelnames, key, strict=True)): v for key, v in f.samples.items()}
    return out


def server_metrics() -> dict[str, dict[Labels, float]]:
    """The server side's metrics now (servers and Flight plane): ``{name: {labels: value}}``, where labels is
    ``(("role", "combined"), ...)``; a histogram ``H`` appears as ``H_count``, ``H_sum`` and ``H_bucket``
    (labelled ``le``). Needs no prometheus-client."""
    return _snapshot("server")


def client_metrics() -> dict[str, dict[Labels, float]]:
    """The client side's metrics now, shaped as :func:`server_metrics`."""
    return _snapshot("client")


# ---------------------------------------------------------------------------------------------- export


class Collector(Protocol):
    """What a prometheus-client registry collects from: the shape of ``prometheus_client.registry.Collector``
    (a protocol there too), which a ``CollectorRegistry`` and :func:`collector`'s result both have. Spelled
    here so that dissoc's signatures need no prometheus-client to type-check."""

    def collect(self) -> Iterable[Any]:
        """The metric families (``prometheus_client.Metric``) to expose now."""
        ...


def _prometheus(module: str = "prometheus_client") -> Any:
    """prometheus-client's ``module``, imported on first need (by name: the ``metrics`` extra is optional, so
    nothing of it is imported where it may be absent, for the type checker either)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DissocError(
            "exporting metrics needs prometheus-client: pip install 'dissoc[metrics]'"
        ) from None


def _metric_families(side: Literal["server", "client"] | None) -> Iterator[Any]:
    core = _prometheus("prometheus_client.core")
    for f in families(side):
        metric: Any
        if f.kind == "histogram":
            metric = core.HistogramMetricFamily(f.name, f.doc, buckets=list(f.buckets), sum_value=f.sum)
        else:
            cls = core.CounterMetricFamily if f.kind == "counter" else core.GaugeMetricFamily
            metric = cls(f.name, f.doc, labels=list(f.labelnames))
            for key, value in sorted(f.samples.items()):
                metric.add_metric(list(key), value)
        yield metric


class _DissocCollector:
    """:func:`collector`'s result (a :class:`Collector`; prometheus-client's registries take any object of
    that shape)."""

    def __init__(self, side: Literal["server", "client"] | None) -> None:
        self._side = side

    def collect(self) -> Iterable[Any]:
        return list(_metric_families(self._side))

    def describe(self) -> Iterable[Any]:
        return []  # nothing is known up front (registering must not scrape)


def collector(side: Literal["server", "client"] | None = None) -> Collector:
    """A prometheus-client collector of dissoc's metrics (``side``: only the server's, or only the client's),
    to register in a registry of your own: ``registry.register(dissoc.metrics.collector())``. Each scrape
    reads the counts as they stand. Needs prometheus-client (``pip install 'dissoc[metrics]'``)."""
    _prometheus()
    return _DissocCollector(side)


class MetricsServer:
    """An HTTP endpoint serving ``/metrics`` from a thread (see :func:`start_http_server`)."""

    def __init__(self, httpd: Any, thread: threading.Thread, host: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host = host
        #: The port bound (the one chosen when 0 was asked).
        self.port = int(httpd.server_port)

    @property
    def url(self) -> str:
        """``http://HOST:PORT/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_wsgi(app: Any, host: str, port: int, max_connections: int, timeout: float) -> Any:
    """A threading WSGI server for ``app`` bound to ``host:port`` (not yet serving), bounded in connections
    and in the time a request may take to arrive."""
    import socket
    import socketserver
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    slots = threading.BoundedSemaphore(max_connections)
    read_timeout = timeout

    class Handler(WSGIRequestHandler):
        timeout = read_timeout  # reads of the request line and headers: a silent client is dropped

        def log_message(self, format: str, *args: Any) -> None:
            pass  # no line per scrape on stderr

    class Server(socketserver.ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def process_request(self, request: Any, client_address: Any) -> None:
            if not slots.acquire(blocking=False):
                SERVER.refusals.inc("metrics_connections")
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

    return make_server(host, port, app, server_class=Server, handler_class=Handler)


#: Connections the metrics endpoint serves at once; one more is closed at once (a scraper needs one).
MAX_METRICS_CONNECTIONS = 16
#: Seconds the metrics endpoint waits for a request's bytes before it drops the connection.
METRICS_TIMEOUT = 5.0


def start_http_server(
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    registry: Collector | None = None,
    process: bool = True,
    max_connections: int = MAX_METRICS_CONNECTIONS,
    timeout: float = METRICS_TIMEOUT,
) -> MetricsServer:
    """Serve ``http://HOST:PORT/metrics`` from a daemon thread (port 0 picks a free one; see
    :attr:`MetricsServer.url`): ``registry`` (a ``prometheus_client.CollectorRegistry``, or any
    :class:`Collector`), by default a fresh one holding :func:`collector` and, with ``process``,
    prometheus-client's process, platform and garbage-collector metrics. Needs prometheus-client (``pip
    install 'dissoc[metrics]'``); close it with :meth:`MetricsServer.close`.

    Bounded like the data ports: at most ``max_connections`` connections are served at once (one more is
    closed at once, counted as the refusal ``metrics_connections``), and a connection that has not sent its
    request within ``timeout`` seconds is dropped, so a client that opens connections and sends nothing holds
    neither threads nor sockets for long."""
    prom = _prometheus()
    if max_connections < 1 or not timeout > 0:
        raise DissocError(f"max_connections must be >= 1 and timeout > 0, got {max_connections}, {timeout}")
    if registry is None:
        fresh = prom.CollectorRegistry(auto_describe=True)
        fresh.register(collector())
        if process:
            prom.ProcessCollector(registry=fresh)
            prom.PlatformCollector(registry=fresh)
            prom.GCCollector(registry=fresh)
        registry = fresh
    try:
        httpd = _serve_wsgi(prom.make_wsgi_app(registry), host, port, max_connections, timeout)
    except OSError as e:
        raise DissocError(f"serving metrics on {host}:{port} failed: {e}") from None
    thread = threading.Thread(target=httpd.serve_forever, name="dissoc-metrics", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread, host)
