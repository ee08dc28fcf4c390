"""End to end over real TCP: every kind of dataset round-trips, combined and split, through every client API;
batches arrive in order; unknown tickets fail cleanly without hurting the server; 64 clients at once."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from helpers.e2e import (
    ServerThread,
    assert_ids_in_order,
    collect,
    ordered_table,
    sample_table,
    within,
)

import dissoc
from dissoc.client import ClientOptions, FetchStats, fetch_async, open_stream, stream_batches
from dissoc.errors import DissocError, RemoteError
from dissoc.server import Server

pytestmark = pytest.mark.timeout(60)

LAYOUTS = [pytest.param(False, id="combined"), pytest.param(True, id="split")]


def _ipc_file(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("split", LAYOUTS)
async def test_table_with_dictionaries_strings_nulls_nested(split: bool) -> None:
    table = sample_table()
    async with Server({"t": table}, split=split) as server:
        got = await within(20, fetch_async(server.uri, "t", data_uri=server.data_uri), "fetch")
    assert got.schema.equals(table.schema, check_metadata=True)
    assert got.equals(table)
    assert got.num_rows == table.num_rows


@pytest.mark.parametrize("split", LAYOUTS)
async def test_ipc_file_path(split: bool, tmp_path: Path) -> None:
    table = sample_table(batches=3)
    path = _ipc_file(tmp_path / "trips.arrow", table)
    async with Server({"trips": str(path)}, split=split) as server:
        got = await within(20, fetch_async(server.uri, "trips", data_uri=server.data_uri), "fetch")
    assert got.equals(pa.ipc.open_file(str(path)).read_all())
    assert got.equals(table)


@pytest.mark.parametrize("split", LAYOUTS)
async def test_parquet_file(split: bool, tmp_path: Path) -> None:
    table = sample_table(batches=3).drop_columns(["fsl"])  # keep to types Parquet round-trips exactly
    path = tmp_path / "events.parquet"
    pq.write_table(table, path, row_group_size=300)
    expected = pq.read_table(path)
    async with Server({"events": path}, split=split) as server:
        got = await within(20, fetch_async(server.uri, "events", data_uri=server.data_uri), "fetch")
    assert got.equals(expected)
    assert got.num_rows == table.num_rows
    assert got.column("id").to_pylist() == table.column("id").to_pylist()


@pytest.mark.parametrize("split", LAYOUTS)
async def test_reader_factory(split: bool) -> None:
    table = sample_table(batches=5, rows=100)
    calls = []

    def factory() -> pa.RecordBatchReader:
        calls.append(1)
        return pa.RecordBatchReader.from_batches(table.schema, table.to_batches())

    async with Server({"gen": factory}, split=split) as server:
        first = await within(20, fetch_async(server.uri, "gen", data_uri=server.data_uri), "fetch")
        second = await within(20, fetch_async(server.uri, "gen", data_uri=server.data_uri), "fetch")
    assert first.equals(table)
    assert second.equals(table)  # a factory gives a fresh reader to every request
    assert len(calls) >= 2


@pytest.mark.parametrize("split", LAYOUTS)
async def test_dictionary_replaced_between_batches(split: bool) -> None:
    """Each batch has its own dictionary: the stream must carry the replacement dictionaries."""
    b1 = pa.record_batch({"d": pa.array(["a", "b", None, "a"]).dictionary_encode(), "i": [1, 2, 3, 4]})
    b2 = pa.record_batch({"d": pa.array(["x", "y", "x"]).dictionary_encode(), "i": [5, 6, 7]})
    table = pa.Table.from_batches([b1, b2])
    async with Server({"t": table}, split=split) as server:
        got = await within(20, fetch_async(server.uri, "t", data_uri=server.data_uri), "fetch")
    assert got.column("d").to_pylist() == ["a", "b", None, "a", "x", "y", "x"]
    assert got.equals(table)


@pytest.mark.parametrize("split", LAYOUTS)
async def test_empty_table_keeps_schema(split: bool) -> None:
    table = sample_table(batches=1).slice(0, 0)
    async with Server({"empty": table}, split=split) as server:
        got = await within(20, fetch_async(server.uri, "empty", data_uri=server.data_uri), "fetch")
    assert got.num_rows == 0
    assert got.schema.equals(table.schema)


@pytest.mark.parametrize("split", LAYOUTS)
async def test_batches_arrive_in_sequence_order(split: bool) -> None:
    table = ordered_table(batches=200, rows=500)
    stats = FetchStats()
    async with Server({"ordered": table}, split=split) as server:
        batches = await within(
            30,
            collect(stream_batches(server.uri, "ordered", data_uri=server.data_uri, stats=stats)),
            "stream",
        )
    assert len(batches) == 200
    assert assert_ids_in_order(batches) == 200 * 500
    assert [b.num_rows for b in batches] == [500] * 200
    assert (stats.batches, stats.rows) == (200, 100_000)


@pytest.mark.parametrize("split", LAYOUTS)
async def test_kept_small_batches_outlive_the_slabs_their_neighbours_landed_in(split: bool) -> None:
    """Small fixed-width batches land side by side in shared slabs, which are handed out again once no batch
    uses them: a few batches kept from a long stream (the rest dropped as they come) keep their values while
    later batches land, and the slabs of the dropped ones serve again (memory stays bounded)."""
    rows, count = 1024, 2000  # 16 KiB a batch: about 60 to a 1 MiB slab
    ids = pa.array(range(count * rows), pa.int64())
    table = pa.Table.from_batches(pa.table({"id": ids, "x": pc.negate(ids)}).to_batches(max_chunksize=rows))
    kept: list[pa.RecordBatch] = []
    slabs: set[int] = set()

    async def consume() -> int:
        got = 0
        async for batch in stream_batches(server.uri, "t", data_uri=server.data_uri):
            assert isinstance(batch, pa.RecordBatch)
            parent = batch.column(0).buffers()[1]
            slabs.add(parent.address - parent.address % (1 << 20))  # (the 1 MiB-aligned region it lies in)
            if got % 499 == 0:
                kept.append(batch)
            got += 1
        return got

    async with Server({"t": table}, split=split) as server:
        assert await within(30, consume(), "stream") == count
    assert len(kept) == 5
    for k, batch in zip(range(0, count, 499), kept, strict=True):
        assert batch.column(0).to_pylist() == list(range(k * rows, (k + 1) * rows))
        assert batch.column(1).to_pylist() == list(range(-k * rows, -(k + 1) * rows, -1))
    # 2000 batches fill about 33 slabs, each across one or two 1 MiB regions, if none were handed out again
    assert len(slabs) < 30


@pytest.mark.parametrize("split", LAYOUTS)
async def test_one_connection_per_fetch_many_fetches(split: bool) -> None:
    """Repeated fetches of different tickets from one server all succeed (no state leaks between them)."""
    a, b = sample_table(batches=2), ordered_table(3, 10)
    async with Server({"a": a, "b": b}, split=split) as server:
        for _ in range(3):
            assert (await within(10, fetch_async(server.uri, "a", data_uri=server.data_uri))).equals(a)
            assert (await within(10, fetch_async(server.uri, "b", data_uri=server.data_uri))).equals(b)


# ------------------------------------------------------------------------------------------ synchronous API


@pytest.mark.parametrize("split", LAYOUTS)
def test_sync_fetch(split: bool) -> None:
    table = sample_table()
    with ServerThread({"t": table}, split=split) as srv:
        got = dissoc.fetch(srv.uri, "t", data_uri=srv.data_uri, options=ClientOptions(timeout=10))
    assert got.equals(table)


@pytest.mark.parametrize("split", LAYOUTS)
def test_sync_open_stream_read_all(split: bool) -> None:
    table = ordered_table(batches=20, rows=100)
    with ServerThread({"t": table}, split=split) as srv:
        reader = open_stream(srv.uri, "t", data_uri=srv.data_uri, options=ClientOptions(timeout=10))
        with reader:
            assert reader.schema.equals(table.schema)
            got = reader.read_all()
    assert got.equals(table)
    assert assert_ids_in_order(got.to_batches()) == 2000


@pytest.mark.parametrize("split", LAYOUTS)
def test_sync_open_stream_iterates_in_order(split: bool) -> None:
    table = ordered_table(batches=30, rows=64)
    with (
        ServerThread({"t": table}, split=split) as srv,
        open_stream(srv.uri, "t", data_uri=srv.data_uri, options=ClientOptions(timeout=10)) as reader,
    ):
        batches = list(reader)
    assert len(batches) == 30
    assert assert_ids_in_order(batches) == 30 * 64


def test_sync_fetch_unknown_ticket_raises_remote_error() -> None:
    with ServerThread({"t": ordered_table(1, 1)}) as srv, pytest.raises(RemoteError, match="nope"):
        dissoc.fetch(srv.uri, "nope", options=ClientOptions(timeout=10))


async def test_sync_fetch_from_inside_a_running_loop_uses_a_thread() -> None:
    """``dissoc.fetch`` called from a coroutine (a running loop) still works against another loop's server."""
    table = ordered_table(4, 8)
    with ServerThread({"t": table}) as srv:
        result: list[pa.Table] = []
        thread = threading.Thread(target=lambda: result.append(dissoc.fetch(srv.uri, "t")))
        thread.start()
        await asyncio.to_thread(thread.join, 20)
        assert not thread.is_alive()
        assert dissoc.fetch(srv.uri, "t").equals(table)
    assert result and result[0].equals(table)


# -------------------------------------------------------------------------------------------- unknown ticket


@pytest.mark.parametrize("split", LAYOUTS)
async def test_unknown_ticket_is_a_remote_error_and_the_server_goes_on(split: bool) -> None:
    table = sample_table(batches=2)
    opts = ClientOptions(timeout=5)
    async with Server({"known": table}, split=split) as server:
        with pytest.raises(RemoteError) as info:
            await within(
                10, fetch_async(server.uri, "no-such-ticket", data_uri=server.data_uri, options=opts)
            )
        assert "no-such-ticket" in str(info.value)
        assert isinstance(info.value, dissoc.DissocError)
        # the same server keeps serving, on new connections
        for _ in range(2):
            got = await within(10, fetch_async(server.uri, "known", data_uri=server.data_uri, options=opts))
            assert got.equals(table)
        # and the failure repeats cleanly
        with pytest.raises(RemoteError, match="another-missing"):
            await within(
                10, fetch_async(server.uri, "another-missing", data_uri=server.data_uri, options=opts)
            )


@pytest.mark.parametrize("split", LAYOUTS)
async def test_unknown_ticket_streaming_api_raises_before_any_batch(split: bool) -> None:
    got: list[pa.RecordBatch] = []
    async with Server({"known": ordered_table(2, 2)}, split=split) as server:
        with pytest.raises(RemoteError, match="missing-one"):
            async with contextlib.aclosing(
                stream_batches(
                    server.uri, "missing-one", data_uri=server.data_uri, options=ClientOptions(timeout=5)
                )
            ) as agen:
                async for batch in agen:
                    got.append(batch)
    assert got == []


async def test_removed_dataset_becomes_unknown() -> None:
    table = ordered_table(2, 2)
    async with Server({"x": table}) as server:
        assert (await within(10, fetch_async(server.uri, "x"))).equals(table)
        server.remove("x")
        with pytest.raises(RemoteError, match="x"):
            await within(10, fetch_async(server.uri, "x", options=ClientOptions(timeout=5)))
        server.add("x", table)
        assert (await within(10, fetch_async(server.uri, "x"))).equals(table)


# ---------------------------------------------------------------------------------------- many clients


@pytest.mark.parametrize("split", LAYOUTS)
async def test_64_concurrent_clients_each_get_their_stream_intact(split: bool) -> None:
    # 4 MiB per client: 16 batches of 2048 rows of (id + 120 bytes of padding).
    tables = {f"t{k}": ordered_table(16, 2048, pad=120) for k in range(4)}
    opts = ClientOptions(timeout=30)
    async with Server(tables, split=split) as server:
        tickets = [f"t{k % 4}" for k in range(64)]
        results = await within(
            60,
            asyncio.gather(
                *(fetch_async(server.uri, t, data_uri=server.data_uri, options=opts) for t in tickets)
            ),
            "64 concurrent fetches",
        )
    assert len(results) == 64
    for ticket, got in zip(tickets, results, strict=True):
        assert got.nbytes >= 4 << 20
        assert got.equals(tables[ticket])
        assert assert_ids_in_order(got.to_batches()) == 16 * 2048


@pytest.mark.parametrize(
    "kwargs", [{"port": 70000}, {"port": 65536}, {"port": -1}, {"split": True, "data_port": 1 << 17}]
)
def test_out_of_range_ports_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(DissocError, match="65535"):
        Server({"t": ordered_table(1, 3)}, **kwargs)
