"""Every entry point of the client takes a Flight location (``grpc://``) the same way: ``fetch``,
``fetch_async``, ``stream_batches``, ``open_stream`` and ``dissoc get`` resolve it with GetFlightInfo (in one
place, ``client.resolve_endpoints``) and read every endpoint it lists, in order, with the same errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Awaitable, Callable, Iterator

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, ordered_table, sample_table, within

import dissoc
from dissoc.client import (
    ClientOptions,
    FetchStats,
    fetch_async,
    open_stream,
    resolve_endpoints,
    stream_batches,
)
from dissoc.errors import DissocError, ProtocolError, RemoteError
from dissoc.server import Server

flight = pytest.importorskip("pyarrow.flight")

from dissoc.flight import serve_with_flight  # noqa: E402

from .test_control_plane import PlainControlPlane, _info  # noqa: E402  (needs pyarrow.flight)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def plain_plane() -> Iterator[PlainControlPlane]:
    """A Flight service that is not dissoc's, listing whatever endpoints a test gives it."""
    server = PlainControlPlane({})
    try:
        yield server
    finally:
        server.shutdown()


async def _all_entry_points(location: str, ticket: str) -> dict[str, pa.Table]:
    """The same dataset through each entry point of the client."""
    streamed = [b async for b in stream_batches(location, ticket)]
    schema_seen: list[pa.Schema] = []
    stats = FetchStats()
    async for _ in stream_batches(location, ticket, stats=stats, on_schema=schema_seen.append):
        pass

    def sync_reader() -> pa.Table:
        with open_stream(location, ticket) as reader:
            return reader.read_all()

    out = {
        "fetch": await asyncio.to_thread(dissoc.fetch, location, ticket),
        "fetch_async": await within(30, fetch_async(location, ticket)),
        "stream_batches": pa.Table.from_batches(streamed, schema=schema_seen[0]),
        "open_stream": await asyncio.to_thread(sync_reader),
    }
    assert len(schema_seen) == 1  # one schema, however many endpoints
    assert stats.rows == out["fetch"].num_rows and stats.batches == len(streamed)
    return out


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
async def test_every_entry_point_reads_through_a_dissoc_control_plane(split: bool) -> None:
    table = sample_table()
    async with serve_with_flight({"trips": table}, split=split) as plane:
        got = await _all_entry_points(plane.location, "trips")
        with pytest.raises(DissocError, match="data_uri"):
            async for _ in stream_batches(plane.location, "trips", data_uri=plane.server.data_uri):
                pass
        with pytest.raises(DissocError, match="data_uri"):
            reader = open_stream(plane.location, "trips", data_uri=plane.server.data_uri)
            await asyncio.to_thread(reader.read_all)
        with pytest.raises(DissocError, match="data_uri"):
            await fetch_async(plane.location, "trips", data_uri=plane.server.data_uri)
        refusals: tuple[Callable[[], Awaitable[object]], ...] = (
            lambda: fetch_async(plane.location, "nope"),
            lambda: asyncio.to_thread(lambda: open_stream(plane.location, "nope").read_all()),
        )
        for call in refusals:
            with pytest.raises(RemoteError) as refused:
                await call()
            assert refused.value.code == "unknown_ticket"
    for name, result in got.items():
        assert result.equals(table), name


async def test_endpoints_are_read_in_order_and_must_share_a_schema(plain_plane: PlainControlPlane) -> None:
    parts = [ordered_table(2, 50), ordered_table(3, 40)]
    other = pa.table({"x": pa.array([1.5, 2.5])})
    loc = f"grpc://127.0.0.1:{plain_plane.port}"
    async with Server({"part0": parts[0], "part1": parts[1], "other": other}, split=True) as server:
        uri, data_uri = server.uri, server.data_uri
        schema = parts[0].schema
        plain_plane.infos["whole"] = _info(
            "whole", schema, [(b"part0", [uri, data_uri]), (b"part1", [uri, data_uri])]
        )
        plain_plane.infos["empty"] = _info("empty", schema, [])
        plain_plane.infos["mixed"] = _info(
            "mixed", schema, [(b"part0", [uri, data_uri]), (b"other", [uri, data_uri])]
        )
        endpoints, described = await resolve_endpoints(loc, "whole")
        assert endpoints == [(uri, data_uri, b"part0"), (uri, data_uri, b"part1")]
        assert described is not None and described.equals(schema)
        # a dissoc URI is itself the one endpoint, with no schema known up front
        assert await resolve_endpoints(uri, "part0", data_uri=data_uri) == ([(uri, data_uri, "part0")], None)

        got = await _all_entry_points(loc, "whole")
        empty = await _all_entry_points(loc, "empty")
        mixed: tuple[Callable[[], Awaitable[object]], ...] = (
            lambda: fetch_async(loc, "mixed"),
            lambda: asyncio.to_thread(lambda: open_stream(loc, "mixed").read_all()),
        )
        for call in mixed:
            with pytest.raises(ProtocolError, match="different schemas"):
                await call()
    whole = pa.concat_tables(parts)
    for name, result in got.items():
        assert result.equals(whole), name  # endpoints concatenated in the order listed
    for name, result in empty.items():
        assert result.num_rows == 0 and result.schema.equals(schema), name


async def test_flight_timeout_bounds_the_control_plane_call() -> None:
    """``ClientOptions.flight_timeout`` is the GetFlightInfo deadline; an unreachable plane fails fast."""
    loc = "grpc://127.0.0.1:9"  # nothing listens on the discard port
    with pytest.raises(DissocError):
        await within(20, fetch_async(loc, "x", options=ClientOptions(flight_timeout=2.0)))


def test_dissoc_get_reads_every_endpoint(plain_plane: PlainControlPlane) -> None:
    parts = [ordered_table(2, 50), ordered_table(1, 30)]

    async def serve_and_get() -> dict[str, object]:
        async with Server({"a": parts[0], "b": parts[1]}) as server:
            plain_plane.infos["ab"] = _info(
                "ab",
                parts[0].schema,
                [(b"a", [server.uri, server.data_uri]), (b"b", [server.uri, server.uri])],
            )
            proc = await asyncio.create_subprocess_exec(
                PYTHON,
                "-m",
                "dissoc.cli",
                "get",
                f"grpc://127.0.0.1:{plain_plane.port}",
                "ab",
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == 0, err.decode()
            summary: dict[str, object] = json.loads(out.decode().strip().splitlines()[-1])
            return summary

    summary = asyncio.run(serve_and_get())
    assert (summary["rows"], summary["batches"]) == (130, 3)
