"""The Flight control plane (dissoc.flight) with real parts: pyarrow's own FlightClient against it
(ListFlights, GetFlightInfo with the dissoc URIs as locations, DoGet, DoPut, actions, errors), dissoc's
resolve / fetch / publish / remove against it, combined and split, and against a plain pyarrow
Flight server (interop and malformed FlightInfo); unreachable locations; a missing pyarrow.flight."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.e2e import PYTHON, REPO, ordered_table, sample_table, within

import dissoc
from dissoc.client import fetch as fetch_via_flight
from dissoc.client import fetch_async
from dissoc.client import fetch_async as fetch_via_flight_async
from dissoc.datasets import GeneratedDataset
from dissoc.errors import DissocError, ProtocolError, RemoteError, TransportError
from dissoc.flight import (
    ACTION_LIST_TICKETS,
    ACTION_LIVE_APPEND_STAGED,
    ACTION_LIVE_CLOSE,
    ACTION_LIVE_STATUS,
    ACTION_REMOVE,
    FlightControlPlane,
    describe,
    is_flight_location,
    list_datasets,
    publish,
    remove,
    resolve,
    serve_with_flight,
)
from dissoc.server import Server
from dissoc.uri import UriError

flight = pytest.importorskip("pyarrow.flight")

pytestmark = pytest.mark.timeout(60)

LAYOUTS = [pytest.param(False, id="combined"), pytest.param(True, id="split")]


def _client(plane: FlightControlPlane) -> Any:
    return flight.FlightClient(plane.location)


def _ipc_file(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def _ipc_stream(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def _do_put(client: Any, descriptor: Any, table: pa.Table) -> dict[str, Any]:
    writer, acks = client.do_put(descriptor, table.schema)
    with writer:
        writer.write_table(table)
        writer.done_writing()
        ack = acks.read()
    assert ack is not None, "DoPut sent no acknowledgement"
    result: dict[str, Any] = json.loads(ack.to_pybytes())
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# ------------------------------------------------------------------------------ pyarrow's FlightClient


@pytest.mark.parametrize("split", LAYOUTS)
async def test_list_flights_describes_every_dataset_with_both_dissoc_locations(
    split: bool, tmp_path: Path
) -> None:
    table = sample_table()
    path = _ipc_file(tmp_path / "trips.arrow", ordered_table(3, 100))
    generated = GeneratedDataset("gen", batches=2, rows_per_batch=50)
    async with serve_with_flight({"t": table, "trips": str(path), "gen": generated}, split=split) as plane:
        server = plane.server
        assert plane.location == f"grpc://127.0.0.1:{plane.port}"
        uri, data_uri = server.uri, server.data_uri
        assert (uri != data_uri) is split
        infos = list(_client(plane).list_flights())
        prefixed = list(_client(plane).list_flights(b"tr"))  # criteria: a name prefix
    assert [bytes(i.descriptor.path[0]) for i in prefixed] == [b"trips"]
    by_name = {bytes(info.descriptor.path[0]).decode(): info for info in infos}
    assert sorted(by_name) == ["gen", "t", "trips"]
    assert by_name["t"].schema.equals(table.schema)
    assert by_name["t"].total_records == table.num_rows
    assert by_name["t"].total_bytes == table.nbytes
    assert by_name["gen"].total_records == 100
    assert by_name["trips"].total_records == -1  # not cheaply known for an IPC file
    assert by_name["trips"].total_bytes == path.stat().st_size
    for name, info in by_name.items():
        (endpoint,) = info.endpoints
        assert endpoint.ticket.ticket == name.encode()
        assert [loc.uri.decode() for loc in endpoint.locations] == [uri, data_uri]


@pytest.mark.parametrize("split", LAYOUTS)
async def test_get_flight_info_and_schema(split: bool) -> None:
    table = sample_table(batches=2)
    async with serve_with_flight({"trips": table}, split=split) as plane:
        client = _client(plane)
        info = client.get_flight_info(flight.FlightDescriptor.for_path("trips"))
        schema = client.get_schema(flight.FlightDescriptor.for_path("trips")).schema
        uri, data_uri = plane.server.uri, plane.server.data_uri
    assert info.descriptor.path == [b"trips"]
    (endpoint,) = info.endpoints
    assert endpoint.ticket == flight.Ticket(b"trips")
    locations = [loc.uri.decode() for loc in endpoint.locations]
    assert locations == [uri, data_uri]  # metadata URI first, then the data URI, exactly as the server says
    assert locations[0].startswith("tcp://127.0.0.1:") and "want_data=" in locations[0]
    assert info.schema.equals(table.schema) and schema.equals(table.schema)
    assert (info.total_records, info.total_bytes) == (table.num_rows, table.nbytes)


def _datasets(tmp_path: Path, table: pa.Table) -> dict[str, Any]:
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=150)
    return {
        "table": table,
        "file": str(_ipc_file(tmp_path / "f.arrow", table)),
        "stream": str(_ipc_stream(tmp_path / "s.arrows", table)),
        "parquet": str(tmp_path / "p.parquet"),
        "generated": GeneratedDataset("generated", batches=3, rows_per_batch=100, seed=7),
        "factory": lambda: pa.RecordBatchReader.from_batches(table.schema, table.to_batches()),
    }


async def test_do_get_streams_every_kind_of_dataset_over_grpc(tmp_path: Path) -> None:
    table = ordered_table(4, 100, pad=8)
    datasets = _datasets(tmp_path, table)
    async with serve_with_flight(datasets) as plane:
        client = _client(plane)
        got = {name: client.do_get(flight.Ticket(name.encode())).read_all() for name in datasets}
        # the same data over dissoc, for comparison
        over_dissoc = {name: await fetch_async(plane.server.uri, name) for name in datasets}
    expected_generated = pa.Table.from_batches(list(datasets["generated"].open()))
    for name, result in got.items():
        expected = expected_generated if name == "generated" else table
        assert result.equals(expected), f"DoGet of {name!r} differs"
        assert result.equals(over_dissoc[name]), f"DoGet and dissoc fetch of {name!r} differ"


@pytest.mark.parametrize("split", LAYOUTS)
async def test_do_put_publishes_a_dataset_served_over_dissoc_and_flight(split: bool) -> None:
    table = sample_table(batches=3)
    async with serve_with_flight({}, split=split) as plane:
        client = _client(plane)
        ack = _do_put(client, flight.FlightDescriptor.for_path("uploaded"), table)
        assert ack == {"ticket": "uploaded", "rows": table.num_rows, "batches": 3, "bytes": table.nbytes}
        server = plane.server
        assert "uploaded" in server.catalog
        over_dissoc = await within(20, fetch_async(server.uri, "uploaded", data_uri=server.data_uri))
        over_flight = client.do_get(flight.Ticket(b"uploaded")).read_all()
        via_plane = await within(20, fetch_via_flight_async(plane.location, "uploaded"))
    assert over_dissoc.equals(table)
    assert over_flight.equals(table)
    assert via_plane.equals(table)


async def test_do_put_refuses_a_served_name_unless_replace() -> None:
    first, second = ordered_table(1, 10), ordered_table(2, 30)
    async with serve_with_flight({"x": first}) as plane:
        client = _client(plane)
        with pytest.raises(flight.FlightServerError, match="'x' is already served"):
            _do_put(client, flight.FlightDescriptor.for_path("x"), second)
        assert (await fetch_async(plane.server.uri, "x")).equals(first)
        command = json.dumps({"name": "x", "replace": True}).encode()
        assert _do_put(client, flight.FlightDescriptor.for_command(command), second)["rows"] == 60
        assert (await fetch_async(plane.server.uri, "x")).equals(second)
        with pytest.raises(flight.FlightServerError, match="DoPut command: expected JSON"):
            _do_put(client, flight.FlightDescriptor.for_command(b"not json"), second)


async def test_do_action_remove_then_the_dataset_is_gone_everywhere() -> None:
    table = ordered_table(2, 10)
    async with serve_with_flight({"a": table, "b": table}) as plane:
        client = _client(plane)
        (result,) = list(client.do_action(flight.Action(ACTION_REMOVE, b"a")))
        assert json.loads(result.body.to_pybytes()) == {"removed": "a"}
        (listed,) = list(client.do_action(flight.Action(ACTION_LIST_TICKETS, b"")))
        assert json.loads(listed.body.to_pybytes()) == ["b"]
        assert [bytes(i.descriptor.path[0]) for i in client.list_flights()] == [b"b"]
        with pytest.raises(flight.FlightServerError, match="unknown ticket 'a'"):
            client.get_flight_info(flight.FlightDescriptor.for_path("a"))
        with pytest.raises(RemoteError) as over_dissoc:
            await fetch_async(plane.server.uri, "a")
        assert over_dissoc.value.code == "unknown_ticket"
        assert (await fetch_async(plane.server.uri, "b")).equals(table)
        actions = {a.type: a.description for a in client.list_actions()}
    assert set(actions) == {
        ACTION_REMOVE,
        ACTION_LIST_TICKETS,
        ACTION_LIVE_STATUS,
        ACTION_LIVE_CLOSE,
        ACTION_LIVE_APPEND_STAGED,
    }
    assert all(actions.values())


async def test_unknown_tickets_and_actions_fail_clearly_for_a_pyarrow_client() -> None:
    async with serve_with_flight({"known": ordered_table(1, 5)}) as plane:
        client = _client(plane)
        calls: dict[str, Callable[[], object]] = {
            "DoGet": lambda: client.do_get(flight.Ticket(b"nope")).read_all(),
            "GetFlightInfo": lambda: client.get_flight_info(flight.FlightDescriptor.for_path("nope")),
            "remove": lambda: list(client.do_action(flight.Action(ACTION_REMOVE, b"nope"))),
        }
        for what, call in calls.items():
            with pytest.raises(flight.FlightServerError) as info:
                call()
            assert "unknown ticket 'nope'" in str(info.value), what
            assert "known" not in str(info.value).replace("unknown", ""), f"{what}: lists what is served"
            assert json.loads(info.value.extra_info)["code"] == "unknown_ticket", what
        # pyarrow's GetSchema wrapper turns any handler error into an "Unknown error" (the message survives)
        with pytest.raises(pa.ArrowException, match="unknown ticket 'nope'"):
            client.get_schema(flight.FlightDescriptor.for_path("nope"))
        with pytest.raises(flight.FlightServerError, match="unknown action 'explode'"):
            list(client.do_action(flight.Action("explode", b"")))
        # the server still serves
        assert client.do_get(flight.Ticket(b"known")).read_all().num_rows == 5


async def test_read_only_plane_refuses_put_and_remove() -> None:
    async with (
        Server({"a": ordered_table(1, 5)}) as server,
        FlightControlPlane(server, read_only=True) as plane,
    ):
        with pytest.raises(RemoteError) as put:
            await asyncio.to_thread(publish, plane.location, "b", ordered_table(1, 5))
        with pytest.raises(RemoteError) as rm:
            await asyncio.to_thread(remove, plane.location, "a")
        assert server.catalog.names() == ["a"]
    assert put.value.code == rm.value.code == "read_only"


async def test_put_size_limit() -> None:
    async with Server() as server, FlightControlPlane(server, max_put_bytes=1000) as plane:
        with pytest.raises(RemoteError) as err:
            await asyncio.to_thread(publish, plane.location, "big", ordered_table(4, 100))
        assert err.value.code == "too_large"
        assert "big" not in server.catalog
        assert await asyncio.to_thread(publish, plane.location, "small", ordered_table(1, 10)) == 10


# ------------------------------------------------------------------------- dissoc's client functions


@pytest.mark.parametrize("split", LAYOUTS)
async def test_resolve_and_fetch_via_flight(split: bool) -> None:
    table = sample_table()
    async with serve_with_flight({"trips": table}, split=split) as plane:
        uri, data_uri = plane.server.uri, plane.server.data_uri
        endpoints = await asyncio.to_thread(resolve, plane.location, "trips")
        by_bytes = await asyncio.to_thread(resolve, plane.location, b"trips")
        info = await asyncio.to_thread(describe, plane.location, "trips")
        got = await within(20, fetch_via_flight_async(plane.location, "trips"))
        got_sync = await asyncio.to_thread(fetch_via_flight, plane.location, "trips")
        # The top-level API takes a Flight location as well as a dissoc URI.
        via_fetch = await asyncio.to_thread(dissoc.fetch, plane.location, "trips")
        via_fetch_async = await within(20, fetch_async(plane.location, "trips"))
        with pytest.raises(DissocError, match="data_uri"):
            await fetch_async(plane.location, "trips", data_uri=data_uri)
    assert via_fetch.equals(table) and via_fetch_async.equals(table)
    assert endpoints == by_bytes == [(uri, data_uri, b"trips")]
    assert (info.name, info.num_rows, info.nbytes) == ("trips", table.num_rows, table.nbytes)
    assert info.schema.equals(table.schema)
    assert got.equals(table) and got_sync.equals(table)


async def test_data_uri_with_remote_handle_travels_unchanged_through_flight() -> None:
    """Pairs into shared memory: the data URI's free_data, percent-encoded remote_handle and memory=shm
    survive the FlightInfo byte for byte, and the client reads the pairs through it."""
    table = ordered_table(3, 100)
    async with serve_with_flight({"t": table}, split=True, body="pairs") as plane:
        data_uri = plane.server.data_uri
        assert "remote_handle=" in data_uri and "memory=shm" in data_uri
        endpoints = await asyncio.to_thread(resolve, plane.location, "t")
        got = await within(20, fetch_via_flight_async(plane.location, "t"))
    assert endpoints[0][1] == data_uri
    assert got.equals(table)


async def test_publish_list_remove_through_the_dissoc_api() -> None:
    table = ordered_table(3, 50)
    async with serve_with_flight({"base": table}, split=True) as plane:
        loc = plane.location
        assert await asyncio.to_thread(publish, loc, "one", table) == 150
        assert await asyncio.to_thread(publish, loc, "batch", table.to_batches()[0]) == 50
        reader = pa.RecordBatchReader.from_batches(table.schema, table.to_batches())
        assert await asyncio.to_thread(publish, loc, "reader", reader) == 150
        with pytest.raises(RemoteError) as exists:
            await asyncio.to_thread(publish, loc, "one", table)
        assert exists.value.code == "already_exists"
        assert await asyncio.to_thread(lambda: publish(loc, "one", table.slice(0, 7), replace=True)) == 7
        listed = await asyncio.to_thread(list_datasets, loc)
        assert [d.name for d in listed] == ["base", "one", "batch", "reader"]
        assert all(
            d.endpoints == [(plane.server.uri, plane.server.data_uri, d.name.encode())] for d in listed
        )
        assert (await fetch_via_flight_async(loc, "one")).equals(table.slice(0, 7))
        assert (await fetch_via_flight_async(loc, "reader")).equals(table)
        await asyncio.to_thread(remove, loc, "one")
        with pytest.raises(RemoteError) as gone:
            await asyncio.to_thread(resolve, loc, "one")
        assert gone.value.code == "unknown_ticket"
        assert "'one'" in gone.value.message
        with pytest.raises(RemoteError) as again:
            await asyncio.to_thread(remove, loc, "one")
        assert again.value.code == "unknown_ticket"
        with pytest.raises(RemoteError):
            await fetch_via_flight_async(loc, "one")


async def test_concurrent_puts_from_many_threads_while_dissoc_serves() -> None:
    """DoPut changes the catalog from Flight's threads while the event loop serves dissoc streams."""
    table = ordered_table(4, 200)
    async with serve_with_flight({"base": table}) as plane:
        loc = plane.location

        def writer(i: int) -> list[int]:
            return [publish(loc, f"w{i}-{j}", table.slice(0, 10 * (j + 1))) for j in range(5)]

        fetches = [fetch_async(plane.server.uri, "base") for _ in range(8)]
        results = await within(
            30, asyncio.gather(*(asyncio.to_thread(writer, i) for i in range(6)), *fetches), "puts + fetches"
        )
        names = set(plane.server.catalog.names())
        for name in (f"w{i}-{j}" for i in range(6) for j in range(5)):
            assert name in names
        got = await fetch_via_flight_async(loc, "w3-4")
    assert [r for r in results[:6]] == [[10, 20, 30, 40, 50]] * 6
    assert all(t.equals(table) for t in results[6:])
    assert got.equals(table.slice(0, 50))


async def test_a_synchronous_flight_client_on_the_loop_thread_does_not_deadlock() -> None:
    """Handlers never wait for the event loop: a blocking call made on the loop's own thread completes."""
    async with serve_with_flight({}) as plane:
        started = time.monotonic()
        rows = publish(plane.location, "here", ordered_table(1, 10))  # blocks this (the loop's) thread
        assert time.monotonic() - started < 10
        assert rows == 10
        assert (await fetch_async(plane.server.uri, "here")).num_rows == 10


# --------------------------------------------------------------- a plain pyarrow Flight control plane


#: pyarrow.flight has no type information: to the checker its classes are Any.
_FlightServerBase: Any = flight.FlightServerBase


class PlainControlPlane(_FlightServerBase):  # type: ignore[misc]
    """Not dissoc's: serves FlightInfos it is given, as any Flight service could."""

    def __init__(self, infos: dict[str, Any]) -> None:
        super().__init__("grpc://127.0.0.1:0")
        self.infos = infos

    def get_flight_info(self, context: Any, descriptor: Any) -> Any:
        name = bytes(descriptor.path[0]).decode()
        if name not in self.infos:
            raise flight.FlightServerError(f"no flight {name!r}")
        return self.infos[name]

    def list_flights(self, context: Any, criteria: bytes) -> Iterator[Any]:
        yield from self.infos.values()


def _info(name: str, schema: pa.Schema, endpoints: list[tuple[bytes, list[str]]]) -> Any:
    return flight.FlightInfo(
        schema,
        flight.FlightDescriptor.for_path(name),
        [flight.FlightEndpoint(ticket, [flight.Location(loc) for loc in locs]) for ticket, locs in endpoints],
        -1,
        -1,
    )


@pytest.fixture
def plain_plane() -> Iterator[PlainControlPlane]:
    server = PlainControlPlane({})
    try:
        yield server
    finally:
        server.shutdown()


@pytest.mark.parametrize("split", LAYOUTS)
async def test_resolve_and_fetch_through_a_plain_pyarrow_flight_service(
    split: bool, plain_plane: PlainControlPlane
) -> None:
    parts = [ordered_table(2, 50), ordered_table(3, 40)]
    schema = parts[0].schema
    loc = f"grpc://127.0.0.1:{plain_plane.port}"
    async with Server({"part0": parts[0], "part1": parts[1]}, split=split) as server:
        uri, data_uri = server.uri, server.data_uri
        plain_plane.infos["whole"] = _info(
            "whole", schema, [(b"part0", [uri, data_uri]), (b"part1", [uri, data_uri])]
        )
        plain_plane.infos["empty"] = _info("empty", schema, [])
        endpoints = await asyncio.to_thread(resolve, loc, "whole")
        got = await within(20, fetch_via_flight_async(loc, "whole"))
        empty = await fetch_via_flight_async(loc, "empty")
        with pytest.raises(RemoteError) as missing:
            await asyncio.to_thread(resolve, loc, "other")
    assert endpoints == [(uri, data_uri, b"part0"), (uri, data_uri, b"part1")]
    assert got.equals(pa.concat_tables(parts))  # endpoints concatenated in order
    assert empty.num_rows == 0 and empty.schema.equals(schema)
    assert missing.value.code == "server_error" and "no flight 'other'" in missing.value.message


async def test_malformed_flight_info_is_a_protocol_error(plain_plane: PlainControlPlane) -> None:
    schema = pa.schema([("id", pa.int64())])
    dissoc_uri = "tcp://127.0.0.1:9?want_data=1"
    plain_plane.infos.update(
        one=_info("one", schema, [(b"one", [dissoc_uri])]),
        none=_info("none", schema, [(b"none", [])]),
        grpc=_info("grpc", schema, [(b"grpc", ["grpc://127.0.0.1:9", "grpc://127.0.0.1:9"])]),
        mixed=_info("mixed", schema, [(b"mixed", [dissoc_uri, "grpc+tcp://127.0.0.1:9"])]),
        nowant=_info("nowant", schema, [(b"nowant", ["tcp://127.0.0.1:9", "tcp://127.0.0.1:9"])]),
    )
    loc = f"grpc://127.0.0.1:{plain_plane.port}"
    expected = {
        "one": "has 1 location",
        "none": "has 0 location",
        "grpc": "metadata location 'grpc://127.0.0.1:9' is not a dissoc URI",
        "mixed": "data location 'grpc+tcp://127.0.0.1:9' is not a dissoc URI",
        "nowant": "is not a dissoc URI",
    }
    for name, message in expected.items():
        with pytest.raises(ProtocolError, match=re.escape(message)):
            await asyncio.to_thread(resolve, loc, name)
    with pytest.raises(ProtocolError):
        await asyncio.to_thread(list_datasets, loc)
    with pytest.raises(ProtocolError):
        await fetch_via_flight_async(loc, "one")


# ------------------------------------------------------------------------------------- failures, edges


def test_unreachable_location_is_a_transport_error_within_seconds() -> None:
    loc = f"grpc://127.0.0.1:{_free_port()}"
    for call in (
        lambda: resolve(loc, "x"),
        lambda: list_datasets(loc),
        lambda: remove(loc, "x"),
        lambda: publish(loc, "x", ordered_table(1, 3)),
        lambda: fetch_via_flight(loc, "x"),
    ):
        started = time.monotonic()
        with pytest.raises(TransportError, match=f"at {loc}"):
            call()
        assert time.monotonic() - started < 5


def test_a_silent_peer_times_out_as_a_transport_error() -> None:
    """A TCP listener that never speaks gRPC: the call's deadline turns into a TransportError."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        loc = f"grpc://127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(TransportError):
            resolve(loc, "x", timeout=0.5)
        assert time.monotonic() - started < 5


def test_locations_that_are_not_flight_are_rejected() -> None:
    assert is_flight_location("grpc://h:1") and is_flight_location("grpc+tcp://h:1")
    assert not is_flight_location("tcp://h:1?want_data=1") and not is_flight_location(b"grpc://h:1")
    for bad in ("tcp://127.0.0.1:1?want_data=1", "127.0.0.1:1", ""):
        with pytest.raises(UriError):
            resolve(bad, "x")


async def test_plane_lifecycle_and_port_conflicts() -> None:
    async with Server({"a": ordered_table(1, 3)}) as server:
        plane = FlightControlPlane(server)
        with pytest.raises(DissocError, match="not started"):
            _ = plane.location
        async with plane:
            taken = plane.port
            assert await asyncio.to_thread(resolve, plane.location, "a")
            with pytest.raises(TransportError, match=f":{taken}"):
                await FlightControlPlane(server, port=taken).start()
        await plane.close()  # a second close is harmless
        with pytest.raises(TransportError):
            await asyncio.to_thread(resolve, f"grpc://127.0.0.1:{taken}", "a")


def _count_until_the_end(reader: Any) -> int:
    count = 0
    try:
        for _ in reader:
            count += 1
    except flight.FlightError:  # the shutdown may cut the stream instead of ending it
        pass
    return count


async def test_close_stops_a_generator_stream_still_being_read() -> None:
    """Closing while a Flight client reads a generated dataset slowly: close returns promptly."""
    endless = GeneratedDataset("big", batches=100_000, rows_per_batch=1000)
    async with Server({"big": endless}) as server:
        plane = await FlightControlPlane(server, shutdown_timeout=10).start()
        reader = flight.FlightClient(plane.location).do_get(flight.Ticket(b"big"))
        reader.read_chunk()
        started = time.monotonic()
        stop = asyncio.ensure_future(plane.close())
        got = await asyncio.to_thread(_count_until_the_end, reader)
        await stop
    assert time.monotonic() - started < 8
    assert got < 100_000


def test_importing_works_without_pyarrow_flight_and_use_names_it() -> None:
    code = (
        "import sys; sys.modules['pyarrow.flight'] = None\n"
        "import dissoc, dissoc.flight as f\n"
        "from dissoc.errors import DissocError\n"
        "try:\n"
        "    f.resolve('grpc://127.0.0.1:1', 'x')\n"
        "except DissocError as e:\n"
        "    print('DissocError:', e)\n"
    )
    result = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "DissocError:" in result.stdout and "pyarrow.flight" in result.stdout


def test_catalog_changes_from_flight_threads_are_seen_by_the_server_at_once() -> None:
    """The control plane and a dissoc server on a loop in another thread share one catalog."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def run() -> None:
        async with serve_with_flight({}) as plane:
            holder["plane"] = plane
            holder["stop"] = asyncio.Event()
            ready.set()
            await holder["stop"].wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),))
    thread.start()
    try:
        assert ready.wait(20)
        plane = holder["plane"]
        publish(plane.location, "t", ordered_table(2, 5))
        assert fetch_via_flight(plane.location, "t").num_rows == 10
        remove(plane.location, "t")
        with pytest.raises(RemoteError):
            fetch_via_flight(plane.location, "t")
    finally:
        if "stop" in holder:
            loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(20)
        loop.close()
