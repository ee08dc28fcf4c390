"""The Arrow PyCapsule interface at both ends, against the real libraries: polars, DuckDB and pandas each
serve a table (a DataFrame or relation handed to the server as it is) and each reads a dissoc stream (the
``StreamReader`` handed to it as it is), equal to the source; pyarrow reads it through ``to_reader`` and
``RecordBatchReader.from_stream``; a consumer that stops early closes the stream on the server, which stops
reading its source."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import ServerThread

import dissoc
from dissoc.client import open_stream

pytestmark = pytest.mark.timeout(60)


def _lib(name: str) -> Any:
    return pytest.importorskip(name, reason=f"{name} is not installed (the 'test' extra has it)")


def _source() -> pa.Table:
    """Types the three libraries all keep as they are: integers, floats, strings with nulls."""
    n = 5000
    return pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "x": pa.array([i * 0.5 for i in range(n)], pa.float64()),
            "s": pa.array([None if i % 7 == 0 else f"s{i}" for i in range(n)], pa.large_string()),
        }
    )


def _same(got: pa.Table, want: pa.Table) -> None:
    """Equal values, string kinds aside (polars hands out string views or large strings)."""
    assert got.column_names == want.column_names
    assert got.num_rows == want.num_rows
    for name in want.column_names:
        a, b = got.column(name), want.column(name)
        if pa.types.is_string(b.type) or pa.types.is_large_string(b.type):
            a, b = a.cast(pa.large_string()), b.cast(pa.large_string())
        assert a.combine_chunks().equals(b.combine_chunks()), name


@pytest.fixture(scope="module")
def served() -> Iterator[ServerThread]:
    """One server, the source table served from each library's own object (and from pyarrow)."""
    pl, duckdb, pd = _lib("polars"), _lib("duckdb"), _lib("pandas")
    table = _source()
    frame = pl.from_arrow(table)
    rel = duckdb.connect().from_arrow(table)
    datasets = {
        "arrow": table,
        "polars": frame,  # a polars DataFrame
        "duckdb": rel,  # a DuckDB relation
        "pandas": pd.DataFrame({"id": table["id"].to_pylist(), "x": table["x"].to_pylist()}),
        "query": lambda: duckdb.connect().from_arrow(table).filter("id % 2 = 0"),  # per request
        "lazy": lambda: pl.from_arrow(table).lazy().filter(pl.col("id") < 100).collect(),
    }
    with ServerThread(datasets) as server:
        yield server


def _reader(server: ServerThread, name: str) -> dissoc.client.StreamReader:
    return open_stream(server.uri, name, data_uri=server.data_uri)


@pytest.mark.parametrize("producer", ["polars", "duckdb"])
def test_a_dataframe_or_relation_is_served_as_it_is(served: ServerThread, producer: str) -> None:
    _same(dissoc.fetch(served.uri, producer), _source())


def test_a_pandas_frame_is_served(served: ServerThread) -> None:
    got = dissoc.fetch(served.uri, "pandas")
    src = _source()
    assert got.column("id").to_pylist() == src.column("id").to_pylist()
    assert got.column("x").to_pylist() == src.column("x").to_pylist()


def test_a_callable_returning_a_relation_or_frame_runs_per_request(served: ServerThread) -> None:
    src = _source()
    for _ in range(2):  # read anew each time
        got = dissoc.fetch(served.uri, "query")
        assert got.column("id").to_pylist() == list(range(0, src.num_rows, 2))
    assert dissoc.fetch(served.uri, "lazy").column("id").to_pylist() == list(range(100))


def test_polars_reads_a_stream(served: ServerThread) -> None:
    pl = _lib("polars")
    with _reader(served, "arrow") as reader:
        frame = pl.DataFrame(reader)
    _same(frame.to_arrow(), _source())


def test_duckdb_queries_a_stream(served: ServerThread) -> None:
    duckdb = _lib("duckdb")
    reader = _reader(served, "arrow")
    con = duckdb.connect()
    got = con.sql("SELECT count(*), sum(id), count(s) FROM reader").fetchall()
    src = _source()
    assert got == [(src.num_rows, sum(range(src.num_rows)), src.num_rows - src["s"].null_count)]
    reader.close()


def test_pandas_reads_a_stream(served: ServerThread) -> None:
    pd = _lib("pandas")
    if not hasattr(pd.DataFrame, "from_arrow"):
        pytest.skip(f"pandas {pd.__version__} has no DataFrame.from_arrow (pandas 3 has)")
    with _reader(served, "arrow") as reader:
        frame = pd.DataFrame.from_arrow(reader)
    assert frame["id"].tolist() == _source()["id"].to_pylist()


def test_pyarrow_reads_a_stream_through_each_door(served: ServerThread) -> None:
    src = _source()
    with _reader(served, "arrow") as reader:
        assert pa.schema(reader).equals(src.schema)  # __arrow_c_schema__
        _same(pa.RecordBatchReader.from_stream(reader).read_all(), src)
    with _reader(served, "arrow") as reader:
        _same(reader.to_reader().read_all(), src)
    with _reader(served, "arrow") as reader:
        _same(pa.table(reader), src)


def test_requested_schema_is_cast_to(served: ServerThread) -> None:
    src = _source()
    want = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("s", pa.string())])
    with _reader(served, "arrow") as reader:
        got = pa.RecordBatchReader.from_stream(reader, schema=want).read_all()
    assert got.schema.equals(want)
    assert got.column("s").to_pylist() == src.column("s").to_pylist()


def test_a_stream_a_consumer_only_planned_with_stays_open(served: ServerThread) -> None:
    """DuckDB takes the schema while planning a query, then exports the stream again to run it."""
    duckdb = _lib("duckdb")
    reader = _reader(served, "arrow")
    con = duckdb.connect()
    rel = con.sql("SELECT id FROM reader WHERE id >= 4990")  # planned, not run
    assert rel.fetchall() == [(i,) for i in range(4990, 5000)]
    reader.close()


# ------------------------------------------------------------------------------------------- stopping early


class _Counted:
    """A reader factory whose readers count the batches they produced and say when they were closed."""

    def __init__(self, batches: int, rows: int) -> None:
        self.table = pa.table({"v": pa.array(range(batches * rows), pa.int64())})
        self.rows = rows
        self.produced = 0
        self.closed = threading.Event()

    def __call__(self) -> pa.RecordBatchReader:
        def batches() -> Iterator[pa.RecordBatch]:
            try:
                for b in self.table.to_batches(max_chunksize=self.rows):
                    self.produced += 1
                    yield b
            finally:
                self.closed.set()

        return pa.RecordBatchReader.from_batches(self.table.schema, batches())


@pytest.mark.parametrize("consumer", ["duckdb-limit", "from-stream", "to-reader"])
def test_a_consumer_that_stops_early_closes_the_stream_on_the_server(consumer: str) -> None:
    # 256 batches of 32 KiB: far more than the socket buffers and the client's window hold, so the server
    # has not read its source to the end when the consumer lets go.
    source = _Counted(batches=256, rows=4096)
    with ServerThread({"big": source}) as server:
        reader = open_stream(server.uri, "big")
        if consumer == "duckdb-limit":
            duckdb = _lib("duckdb")
            assert duckdb.connect().sql("SELECT v FROM reader LIMIT 3").fetchall() == [(0,), (1,), (2,)]
        elif consumer == "from-stream":
            stream = pa.RecordBatchReader.from_stream(reader)
            assert stream.read_next_batch().num_rows == 4096
            del stream  # releasing the C stream closes it
        else:
            batches = reader.to_reader()
            assert batches.read_next_batch().num_rows == 4096
            del batches
        assert source.closed.wait(10), "the server kept reading its source after the consumer let go"
        assert source.produced < 256
        deadline = time.monotonic() + 10
        while reader._done is False and time.monotonic() < deadline:  # the reader closed itself too
            time.sleep(0.01)
        assert reader._done


# ---------------------------------------------------------------------------------------- device streams


def test_a_device_landing_reader_exports_a_device_stream() -> None:
    """``__arrow_c_device_stream__`` of a reader landing on the (fake) device, read by dissoc's own importer:
    every batch equal; a consumer that stops after one batch closes the stream on the server."""
    from dissoc.client import ClientOptions
    from dissoc.device import DeviceBatch
    from dissoc.memory.cuda import FakeDeviceBackend, use_backend

    source = _Counted(batches=256, rows=4096)
    options = ClientOptions(landing="device")
    with use_backend(FakeDeviceBackend()), ServerThread({"big": source, "t": _source()}) as server:
        with open_stream(server.uri, "t", options=options) as reader:
            got = [b.to_arrow() for b in DeviceBatch.from_arrow_device_stream(reader)]
        _same(pa.Table.from_batches(got), _source())
        reader = open_stream(server.uri, "big", options=options)
        stream = DeviceBatch.from_arrow_device_stream(reader)
        assert next(stream).num_rows == 4096
        stream.close()  # type: ignore[attr-defined]
        assert source.closed.wait(10), "the server kept reading its source after the consumer let go"
        assert source.produced < 256 and reader._done
