"""Prometheus metrics (dissoc.metrics): the counters and their export, read back with prometheus-client's own
text parser; ``dissoc serve --metrics 0`` scraped over HTTP during a fetch and after it; refusals, the
Flight control plane's calls and the client's side counted, each against real servers.

The counts are process-wide, so every test compares what it reads before and after what it does."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, ask_raw, cli_server, eventually, ordered_table, sample_table, within

import dissoc.metrics as metrics
from dissoc.client import ClientOptions, fetch_async, stream_batches
from dissoc.errors import DissocError, RemoteError
from dissoc.metrics import Histogram, Sample, client_metrics, server_metrics
from dissoc.server import Server
from dissoc.tokens import Secret
from dissoc.transport import connect

# By name, as dissoc.metrics does: the metrics extra is optional, for mypy too (tests/test_house.py).
prometheus_client = pytest.importorskip("prometheus_client")
parser = pytest.importorskip("prometheus_client.parser")
text_string_to_metric_families = parser.text_string_to_metric_families

pytestmark = pytest.mark.timeout(90)

#: ``{sample name: {frozenset of label items: value}}``, as parsed from the text format.
Parsed = dict[str, dict[frozenset[tuple[str, str]], float]]


def parse(text: str) -> Parsed:
    out: Parsed = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def family_names(text: str) -> set[str]:
    """The metric families a scrape describes (counters named without ``_total``, as the parser has them)."""
    return {family.name for family in text_string_to_metric_families(text)}


def value(parsed: Parsed, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly these labels (0 when absent)."""
    return parsed.get(name, {}).get(frozenset(labels.items()), 0.0)


def total(parsed: Parsed, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include these."""
    want = set(labels.items())
    return sum(v for key, v in parsed.get(name, {}).items() if want <= key)


def exported() -> Parsed:
    """Every dissoc metric through a registry of our own, as a scrape would see it."""
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.collector())
    return parse(prometheus_client.generate_latest(registry).decode())


def snap_total(snapshot: dict[str, dict[Any, float]], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for key, v in snapshot.get(name, {}).items() if want <= set(key))


# --------------------------------------------------------------------------------------------- unit tests


def test_histogram_counts_in_cumulative_buckets() -> None:
    h = Histogram("h_seconds", "doc", buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0, float("nan")):
        h.observe(v)
    buckets, total_ = h.cumulative()
    assert buckets == [("0.1", 2.0), ("1.0", 3.0), ("+Inf", 4.0)]  # a value on a bound is in its bucket
    assert total_ == pytest.approx(3.65)
    assert h.count == 4


def test_the_collector_exports_counters_tallies_histograms_and_sources_that_parse() -> None:
    before = exported()
    metrics.SERVER.want_data.inc("metadata")
    metrics.SERVER.refusals.inc("unit_test", amount=2)
    tally = metrics.SERVER.sent("unit", "packed")
    tally.batches += 3
    tally.bytes += 3000
    metrics.SERVER.time_to_first_batch.observe(0.003)
    metrics.CLIENT.received("unit", "pairs").bytes += 7

    class Source:
        def __init__(self) -> None:
            self.open = 5.0
            self.evicted = 4.0

        def metrics_samples(self) -> Iterable[Sample]:
            yield "dissoc_server_connections_open", ("data", "unit"), self.open
            yield "dissoc_server_arena_evictions_total", ("unit",), self.evicted
            yield "not_a_dissoc_metric", (), 1.0  # ignored

    source = Source()
    metrics.register(source)
    try:
        after = exported()
        assert value(after, "dissoc_server_want_data_total", role="metadata") == (
            value(before, "dissoc_server_want_data_total", role="metadata") + 1
        )
        assert value(after, "dissoc_server_refusals_total", reason="unit_test") == 2
        assert value(after, "dissoc_server_sent_batches_total", transport="unit", body="packed") == 3
        assert value(after, "dissoc_server_sent_bytes_total", transport="unit", body="packed") == 3000
        assert value(after, "dissoc_client_received_bytes_total", transport="unit", body="pairs") == 7
        name = "dissoc_server_time_to_first_batch_seconds"
        assert value(after, f"{name}_count") == value(before, f"{name}_count") + 1
        assert value(after, f"{name}_bucket", le="0.005") == value(before, f"{name}_bucket", le="0.005") + 1
        assert value(after, f"{name}_bucket", le="0.0025") == value(before, f"{name}_bucket", le="0.0025")
        assert value(after, "dissoc_server_connections_open", role="data", transport="unit") == 5
        assert value(after, "dissoc_server_arena_evictions_total", memory="unit") == 4
        assert "not_a_dissoc_metric" not in after
        # the snapshot (no prometheus-client needed) says the same
        snapshot = server_metrics()
        assert snap_total(snapshot, "dissoc_server_refusals_total", reason="unit_test") == 2
        assert snap_total(snapshot, "dissoc_server_connections_open", transport="unit") == 5
        assert snap_total(client_metrics(), "dissoc_client_received_bytes_total", transport="unit") == 7
        assert "dissoc_client_received_bytes_total" not in snapshot
    finally:
        source.open, source.evicted = 0.0, 6.0
        metrics.unregister(source)
    gone = exported()
    # a gauge of an unregistered source is gone; its counter keeps its last value (counters never go down)
    assert value(gone, "dissoc_server_connections_open", role="data", transport="unit") == 0
    assert value(gone, "dissoc_server_arena_evictions_total", memory="unit") == 6


def test_importing_dissoc_does_not_import_prometheus_client() -> None:
    code = (
        "import sys, dissoc, dissoc.metrics, dissoc.client, dissoc.server, dissoc.cli, dissoc.flight.server\n"
        "import dissoc.metrics as m; m.SERVER.want_data.inc('combined'); m.server_metrics()\n"
        "assert 'prometheus_client' not in sys.modules, 'imported'\n"
    )
    got = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr


def test_without_prometheus_client_exporting_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    for call in (metrics.collector, lambda: metrics.start_http_server(0)):
        with pytest.raises(DissocError, match=r"pip install 'dissoc\[metrics\]'"):
            call()


def test_start_http_server_serves_metrics_on_a_free_port_and_stops() -> None:
    exporter = metrics.start_http_server(0, "127.0.0.1")
    try:
        assert exporter.port > 0 and exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        names = family_names(scrape(exporter.url))
        assert {
            "dissoc_server_streams_started",
            "dissoc_client_streams_started",
            "dissoc_flight_calls",
        } <= names
        assert "process_cpu_seconds" in names or sys.platform != "linux"
    finally:
        exporter.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(exporter.url, timeout=5)


def test_the_endpoint_bounds_connections_and_drops_silent_ones() -> None:
    import socket
    import time

    exporter = metrics.start_http_server(0, "127.0.0.1", max_connections=2, timeout=0.5)
    key = (("reason", "metrics_connections"),)

    def refused() -> float:
        return server_metrics().get("dissoc_server_refusals_total", {}).get(key, 0)

    refused_before = refused()
    idle = [socket.create_connection(("127.0.0.1", exporter.port), timeout=5) for _ in range(2)]
    try:
        time.sleep(0.1)  # both accepted and waiting for a request
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as third:
            assert third.recv(1) == b""  # closed at once: no slot left
        assert refused() == refused_before + 1
        started = time.monotonic()
        for sock in idle:
            sock.settimeout(5)
            sock.recv(1024)  # the server gives up on a request that never comes (and closes)
        assert time.monotonic() - started < 3
        # the slots are free again: a scrape works
        assert "dissoc_server_refusals_total" in scrape(exporter.url)
    finally:
        for sock in idle:
            sock.close()
        exporter.close()


def test_endpoint_bounds_are_checked() -> None:
    with pytest.raises(DissocError, match="max_connections"):
        metrics.start_http_server(0, max_connections=0)


# ---------------------------------------------------------------------------------- dissoc serve --metrics


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


async def scrape_until(url: str, check: Callable[[Parsed], bool], seconds: float = 20) -> Parsed:
    """Scrape until ``check`` holds (the endpoint is polled: what it waits for happens in another process)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        parsed = parse(await asyncio.to_thread(scrape, url))
        if check(parsed) or asyncio.get_running_loop().time() > deadline:
            return parsed
        await asyncio.sleep(0.05)


BIG_BATCHES = 64


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 batches of 1 MiB: far more than socket buffers hold, so a paused consumer holds the server up."""
    path = tmp_path_factory.mktemp("metrics") / "big.arrow"
    table = ordered_table(BIG_BATCHES, 1 << 17)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=1 << 17)
    return path


async def test_serve_metrics_endpoint_shows_the_counters_move_during_and_after_a_fetch(
    big_file: Path,
) -> None:
    with cli_server(str(big_file), "--metrics", "0", count=1) as (proc, lines):
        line = lines[0]
        url = line["metrics"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        before = parse(await asyncio.to_thread(scrape, url))
        assert value(before, "dissoc_server_streams_started_total", role="combined") == 0
        assert value(before, "dissoc_server_connections_open", role="combined", transport="tcp") == 0

        options = ClientOptions(max_in_flight_bytes=1 << 20, reuse_connections=False)
        batches = stream_batches(line["uri"], "big", options=options)
        first = await within(20, anext(batches), "the first batch")
        assert first.num_rows == 1 << 17
        # The consumer holds off: the server sent some, is stuck in a send, and has not finished.
        during = await scrape_until(url, lambda p: value(p, "dissoc_server_in_flight_bytes") > 0)
        assert value(during, "dissoc_server_streams_started_total", role="combined") == 1
        assert value(during, "dissoc_server_want_data_total", role="combined") == 1
        assert value(during, "dissoc_server_connections_total", role="combined", transport="tcp") == 1
        assert value(during, "dissoc_server_connections_open", role="combined", transport="tcp") == 1
        assert value(during, "dissoc_server_streams_finished_total", role="combined") == 0
        sent_during = value(during, "dissoc_server_sent_bytes_total", transport="tcp", body="packed")
        assert sent_during >= 1 << 20
        assert value(during, "dissoc_server_sent_batches_total", transport="tcp", body="packed") >= 1
        assert value(during, "dissoc_server_in_flight_bytes") > 0
        assert value(during, "dissoc_server_time_to_first_batch_seconds_count") == 1

        rows = first.num_rows
        async for batch in batches:
            rows += batch.num_rows
        assert rows == BIG_BATCHES << 17
        after = await scrape_until(
            url,
            lambda p: value(p, "dissoc_server_connections_open", role="combined", transport="tcp") == 0,
        )
        assert value(after, "dissoc_server_streams_finished_total", role="combined") == 1
        assert total(after, "dissoc_server_streams_failed_total") == 0
        sent_after = value(after, "dissoc_server_sent_bytes_total", transport="tcp", body="packed")
        assert sent_after > sent_during and sent_after >= BIG_BATCHES << 20
        assert value(after, "dissoc_server_sent_batches_total", transport="tcp", body="packed") == BIG_BATCHES
        assert value(after, "dissoc_server_in_flight_bytes") == 0
        assert value(after, "dissoc_server_connections_open", role="combined", transport="tcp") == 0
        assert "process_resident_memory_bytes" in after or sys.platform != "linux"

        # A refusal shows too: an unknown ticket.
        with pytest.raises(RemoteError, match="unknown_ticket"):
            await fetch_async(line["uri"], "nope")
        refused = await asyncio.to_thread(scrape, url)
        assert value(parse(refused), "dissoc_server_refusals_total", reason="unknown_ticket") == 1
        proc.terminate()
        assert proc.wait(15) == 0


def test_serve_metrics_host_and_usage(tmp_path: Path) -> None:
    path = tmp_path / "t.arrow"
    table = sample_table(batches=1)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    with cli_server(str(path), "--metrics", "0", "--metrics-host", "127.0.0.1", count=1) as (_, lines):
        assert lines[0]["metrics"].startswith("http://127.0.0.1:")
        assert "dissoc_server_want_data" in family_names(scrape(lines[0]["metrics"]))
    bad = subprocess.run(
        [PYTHON, "-m", "dissoc.cli", "serve", str(path), "--metrics", "70000"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "out of range" in bad.stderr


# ------------------------------------------------------------------------------------- refusals, in process


async def test_refusals_are_counted_by_reason() -> None:
    secret = Secret(b"metrics-test-secret-0123456789ab")
    before = server_metrics()
    client_before = client_metrics()
    async with Server({"t": sample_table(batches=1)}, secret=secret, max_ticket_bytes=128) as server:
        # no token: unauthorized (the client sees it as the stream's failure reason)
        with pytest.raises(RemoteError, match="unauthorized"):
            await within(10, fetch_async(server.uri, "t"))
        # a valid token: served
        table = await within(10, fetch_async(server.uri, secret.mint("t")))
        assert table.num_rows == sample_table(batches=1).num_rows
        # a want_data over max_ticket_bytes: refused from its header
        uri = server.uris[0]
        conn = await connect(uri.scheme, uri.host, uri.port)
        try:
            await conn.send_tagged(uri.want_data, b"x" * 1000)
            with pytest.raises(DissocError):
                await within(10, conn.recv())  # the error message, then the connection ends
                await within(10, conn.recv())
        finally:
            await conn.close()

        # connections open: read from the listener when scraped
        def open_now() -> float:
            return snap_total(server_metrics(), "dissoc_server_connections_open", role="combined")

        base = open_now()
        extra = [await connect(uri.scheme, uri.host, uri.port) for _ in range(2)]
        try:
            assert await eventually(lambda: open_now() == base + 2, 10), (open_now(), base)
        finally:
            for c in extra:
                await c.close()
        assert await eventually(lambda: open_now() == base, 10), (open_now(), base)
    after = server_metrics()
    client_after = client_metrics()

    def delta(name: str, **labels: str) -> float:
        return snap_total(after, name, **labels) - snap_total(before, name, **labels)

    assert delta("dissoc_server_refusals_total", reason="unauthorized") == 1
    assert delta("dissoc_server_refusals_total", reason="request_too_large") == 1
    assert delta("dissoc_server_streams_started_total", role="combined") == 1
    assert delta("dissoc_server_streams_finished_total", role="combined") == 1
    assert delta("dissoc_server_want_data_total", role="combined") == 2
    failed = "dissoc_client_streams_failed_total"
    assert (
        snap_total(client_after, failed, reason="unauthorized")
        - snap_total(client_before, failed, reason="unauthorized")
        == 1
    )
    # the server is closed: its gauges are gone
    assert snap_total(after, "dissoc_server_connections_open") == snap_total(
        before, "dissoc_server_connections_open"
    )


async def test_deadline_drops_are_counted_by_reason() -> None:
    before = server_metrics()
    async with Server({"t": sample_table(batches=1)}, want_data_timeout=0.2, idle_timeout=0.3) as server:
        uri = server.uris[0]
        # one says nothing: dropped after want_data_timeout
        silent = await connect(uri.scheme, uri.host, uri.port)
        try:
            with pytest.raises(DissocError):
                await within(10, silent.recv())
        finally:
            await silent.close()
        # another asks at once, reads its stream to the end, then idles: dropped after idle_timeout
        idle = await connect(uri.scheme, uri.host, uri.port)
        try:
            outcome, _ = await within(10, ask_raw(idle, uri.want_data, b"t"))
            assert outcome == "eos"
            with pytest.raises(DissocError):
                await within(10, ask_raw(idle, uri.want_data, b"t", send=False))
        finally:
            await idle.close()
    after = server_metrics()
    for reason in ("want_data_timeout", "idle_timeout"):
        name = "dissoc_server_refusals_total"
        assert snap_total(after, name, reason=reason) - snap_total(before, name, reason=reason) == 1, reason


async def test_a_client_over_its_unfreed_quota_is_counted() -> None:
    table = ordered_table(4, 1 << 17)  # 4 batches of 1 MiB; the quota is a quarter of 16 MiB: one stream
    before = server_metrics()
    async with Server({"t": table}, body="pairs", memory="shm", arena_bytes=16 << 20) as server:
        uri = server.uris[0]
        hostile = await connect(uri.scheme, uri.host, uri.port)
        try:
            outcome, _ = await within(10, ask_raw(hostile, uri.want_data, b"t"))
            assert outcome == "eos"
            held = snap_total(server_metrics(), "dissoc_server_awaiting_free_data_bytes")
            assert held >= table.nbytes  # listed, never freed
            outcome, error = await within(10, ask_raw(hostile, uri.want_data, b"t"))
            assert (outcome, error.code) == ("error", "quota_exceeded")
        finally:
            await hostile.close()
    after = server_metrics()

    def delta(name: str, **labels: str) -> float:
        return snap_total(after, name, **labels) - snap_total(before, name, **labels)

    assert delta("dissoc_server_refusals_total", reason="quota_exceeded") == 1
    assert delta("dissoc_server_streams_failed_total", role="combined", reason="quota_exceeded") == 1
    assert delta("dissoc_server_streams_finished_total", role="combined") == 1


# --------------------------------------------------------------------------------------- pairs, free_data


async def test_pairs_free_data_and_arena_gauges() -> None:
    table = ordered_table(8, 4096)
    before = server_metrics()
    client_before = client_metrics()
    async with Server({"t": table}, body="pairs", arena_bytes=16 << 20) as server:
        got = await within(20, fetch_async(server.uri, "t"))
        assert got.equals(table)
        during = server_metrics()
        assert snap_total(during, "dissoc_server_arena_capacity_bytes", memory="shm") >= 16 << 20
        # resident placements stay in the arena after the stream (listed to the next client with no copy)
        assert snap_total(during, "dissoc_server_arena_used_bytes", memory="shm") > 0
        assert (
            snap_total(during, "dissoc_server_arena_placements_total", memory="shm")
            - snap_total(before, "dissoc_server_arena_placements_total", memory="shm")
            == 8
        )

        # the client's free_data leaves as its stream ends; the server takes it in on its own time
        def freed() -> bool:
            now = snap_total(server_metrics(), "dissoc_server_free_data_total", role="combined")
            return now > snap_total(before, "dissoc_server_free_data_total", role="combined")

        assert await eventually(freed, 10)
    after = server_metrics()
    client_after = client_metrics()

    def delta(name: str, **labels: str) -> float:
        return snap_total(after, name, **labels) - snap_total(before, name, **labels)

    assert delta("dissoc_server_sent_batches_total", transport="tcp", body="pairs") == 8
    nbytes = delta("dissoc_server_sent_bytes_total", transport="tcp", body="pairs")
    assert nbytes >= table.nbytes
    assert delta("dissoc_server_free_data_total", role="combined") >= 1
    assert delta("dissoc_server_freed_bytes_total", role="combined") == nbytes
    # placements counted while the server ran stay in the totals after it closed
    assert delta("dissoc_server_arena_placements_total", memory="shm") == 8
    received = snap_total(client_after, "dissoc_client_received_batches_total", body="pairs") - snap_total(
        client_before, "dissoc_client_received_batches_total", body="pairs"
    )
    assert received == 8
    sent_frees = snap_total(client_after, "dissoc_client_free_data_total") - snap_total(
        client_before, "dissoc_client_free_data_total"
    )
    assert sent_frees == delta("dissoc_server_free_data_total", role="combined")


# ------------------------------------------------------------------------------------------- client side


def _client_delta(before: dict[str, dict[Any, float]]) -> Callable[..., float]:
    after = client_metrics()

    def delta(name: str, **labels: str) -> float:
        return snap_total(after, name, **labels) - snap_total(before, name, **labels)

    return delta


async def test_client_metrics_move_per_burst_and_count_the_outcome() -> None:
    table = ordered_table(40, 1 << 15)
    async with Server({"t": table}) as server:
        before = client_metrics()
        options = ClientOptions(max_in_flight_bytes=1 << 18, reuse_connections=False)
        batches = stream_batches(server.uri, "t", options=options)
        first = await within(10, anext(batches))
        mid = _client_delta(before)
        assert mid("dissoc_client_streams_started_total", transport="tcp") == 1
        assert mid("dissoc_client_streams_open") == 1
        assert mid("dissoc_client_received_batches_total", transport="tcp", body="packed") >= 1
        assert mid("dissoc_client_received_bytes_total", transport="tcp", body="packed") >= first.nbytes
        assert mid("dissoc_client_time_to_first_batch_seconds_count") == 1
        assert mid("dissoc_client_streams_finished_total", transport="tcp") == 0
        async for _ in batches:
            pass
        end = _client_delta(before)
        assert end("dissoc_client_streams_finished_total", transport="tcp") == 1
        assert end("dissoc_client_received_batches_total", transport="tcp", body="packed") == 40
        assert end("dissoc_client_received_bytes_total", transport="tcp", body="packed") >= table.nbytes
        assert end("dissoc_client_streams_open") == 0
        assert end("dissoc_client_in_flight_bytes") == 0

        # a consumer that stops early: closed_early
        before = client_metrics()
        batches = stream_batches(server.uri, "t", options=options)
        await within(10, anext(batches))
        await batches.aclose()
        stopped = _client_delta(before)
        assert stopped("dissoc_client_streams_failed_total", transport="tcp", reason="closed_early") == 1
        assert stopped("dissoc_client_streams_finished_total") == 0
    # the client's collector has only its side
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.collector("client"))
    names = family_names(prometheus_client.generate_latest(registry).decode())
    assert "dissoc_client_streams_started" in names and not any(n.startswith("dissoc_server") for n in names)


# ---------------------------------------------------------------------------------------------- Flight


async def test_flight_calls_are_counted_by_method_and_code() -> None:
    pytest.importorskip("pyarrow.flight")
    import pyarrow.flight as flight

    from dissoc.flight import describe, serve_with_flight

    def calls(method: str, code: str) -> float:
        return snap_total(server_metrics(), "dissoc_flight_calls_total", method=method, code=code)

    ok, unknown = calls("get_flight_info", "ok"), calls("get_flight_info", "unknown_ticket")
    listed = calls("list_flights", "ok")
    async with serve_with_flight({"trips": sample_table(batches=2)}) as plane:
        info = await asyncio.to_thread(describe, plane.location, "trips")
        assert info.endpoints
        with pytest.raises(DissocError):
            await asyncio.to_thread(describe, plane.location, "nope")
        client = flight.FlightClient(plane.location)
        try:
            assert len(await asyncio.to_thread(lambda: list(client.list_flights()))) == 1
        finally:
            client.close()
    assert calls("get_flight_info", "ok") == ok + 1
    assert calls("get_flight_info", "unknown_ticket") == unknown + 1
    assert calls("list_flights", "ok") == listed + 1
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.collector("server"))
    parsed = parse(prometheus_client.generate_latest(registry).decode())
    assert value(parsed, "dissoc_flight_calls_total", method="get_flight_info", code="ok") == ok + 1


def test_flight_calls_refused_by_the_authenticator_are_counted() -> None:
    pytest.importorskip("pyarrow.flight")
    import pyarrow.flight as flight

    from dissoc.flight import serve_with_flight

    secret = Secret(b"metrics-flight-secret-0123456789")

    async def main() -> float:
        before = snap_total(server_metrics(), "dissoc_flight_calls_total", code="unauthenticated")
        async with serve_with_flight({"trips": sample_table(batches=1)}, secret=secret) as plane:
            client = flight.FlightClient(plane.location)
            try:
                with pytest.raises(flight.FlightUnauthenticatedError):
                    await asyncio.to_thread(lambda: list(client.list_flights()))
            finally:
                client.close()
        return snap_total(server_metrics(), "dissoc_flight_calls_total", code="unauthenticated") - before

    assert asyncio.run(main()) == 1


async def test_tls_handshake_refusals_and_tls_traffic_are_counted(tmp_path: Path) -> None:
    from helpers.tls import make_certs

    certs = make_certs(tmp_path)
    before = server_metrics()
    table = ordered_table(3, 100)
    async with Server({"t": table}, tls_cert=certs.server_cert, tls_key=certs.server_key) as server:
        plain = server.uri.replace("tls://", "tcp://")
        with pytest.raises(DissocError):
            await within(10, fetch_async(plain, "t", options=ClientOptions(timeout=10.0)))
        got = await within(10, fetch_async(server.uri, "t", options=ClientOptions(tls_ca=str(certs.ca))))
        assert got.equals(table)
    after = server_metrics()

    def delta(name: str, **labels: str) -> float:
        return snap_total(after, name, **labels) - snap_total(before, name, **labels)

    assert delta("dissoc_server_refusals_total", reason="tls_handshake") == 1
    assert delta("dissoc_server_sent_batches_total", transport="tls", body="packed") == 3
    assert delta("dissoc_server_connections_total", role="combined", transport="tls") == 2


async def test_split_roles_and_the_per_peer_connection_limit_are_counted() -> None:
    table = ordered_table(3, 100)
    before = server_metrics()
    async with Server({"t": table}, split=True, max_connections_per_peer=1) as server:
        got = await within(
            10,
            fetch_async(
                server.uri, "t", data_uri=server.data_uri, options=ClientOptions(reuse_connections=False)
            ),
        )
        assert got.equals(table)
        meta = server.uris[0]
        first = await connect(meta.scheme, meta.host, meta.port)
        second = await connect(meta.scheme, meta.host, meta.port)
        try:
            with pytest.raises(DissocError):  # one more from the same address: closed at once
                await within(10, second.recv())
        finally:
            await second.close()
            await first.close()
    after = server_metrics()

    def delta(name: str, **labels: str) -> float:
        return snap_total(after, name, **labels) - snap_total(before, name, **labels)

    for role in ("metadata", "data"):
        assert delta("dissoc_server_streams_started_total", role=role) == 1, role
        assert delta("dissoc_server_streams_finished_total", role=role) == 1, role
        assert delta("dissoc_server_want_data_total", role=role) == 1, role
    assert delta("dissoc_server_streams_started_total", role="combined") == 0
    assert delta("dissoc_server_sent_batches_total", transport="tcp", body="packed") == 3  # bodies: data only
    assert delta("dissoc_server_refusals_total", reason="max_connections_per_peer") == 1


@pytest.mark.ucx
async def test_ucx_traffic_is_counted_under_its_transport() -> None:
    table = ordered_table(3, 100)
    before, client_before = server_metrics(), client_metrics()
    async with Server({"t": table}, transport="ucx") as server:
        got = await within(30, fetch_async(server.uri, "t", options=ClientOptions(timeout=30)))
        assert got.equals(table)
    after, client_after = server_metrics(), client_metrics()
    name = "dissoc_server_sent_batches_total"
    assert snap_total(after, name, transport="ucx") - snap_total(before, name, transport="ucx") == 3
    name = "dissoc_client_received_batches_total"
    assert (
        snap_total(client_after, name, transport="ucx") - snap_total(client_before, name, transport="ucx")
        == 3
    )
    name = "dissoc_client_streams_finished_total"
    assert (
        snap_total(client_after, name, transport="ucx") - snap_total(client_before, name, transport="ucx")
        == 1
    )
