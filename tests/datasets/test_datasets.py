"""Datasets a server serves: every kind round-trips one table, reads lazily, and the catalog maps tickets."""

from __future__ import annotations

import itertools
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dissoc.datasets import (
    Catalog,
    Dataset,
    DatasetError,
    GeneratedDataset,
    IpcFileDataset,
    IpcStreamDataset,
    ParquetDataset,
    ReaderFactoryDataset,
    TableDataset,
    UnknownTicket,
    dataset_from,
)
from dissoc.errors import CodecError, DissocError

# ---------------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def table() -> pa.Table:
    """Three chunks of ints, floats, strings (with nulls) and lists."""
    chunks = []
    for k in range(3):
        n = 50 + k
        chunks.append(
            pa.record_batch(
                {
                    "i": pa.array(range(k * 100, k * 100 + n), pa.int64()),
                    "f": pa.array([x / 4 for x in range(n)], pa.float64()),
                    "s": pa.array([None if x % 7 == 0 else f"s{k}-{x}" for x in range(n)], pa.string()),
                    "l": pa.array([[x, x + 1] if x % 3 else None for x in range(n)], pa.list_(pa.int32())),
                }
            )
        )
    return pa.Table.from_batches(chunks)


def read(ds: Dataset) -> pa.Table:
    """Everything one request of ``ds`` yields, as a table with the dataset's schema."""
    batches = list(ds.open())
    for b in batches:
        assert isinstance(b, pa.RecordBatch)
        assert b.schema.equals(ds.schema, check_metadata=True)
    return pa.Table.from_batches(batches, schema=ds.schema)


def same(got: pa.Table, want: pa.Table) -> None:
    assert got.schema.equals(want.schema, check_metadata=False), (got.schema, want.schema)
    assert got.num_rows == want.num_rows
    assert got.combine_chunks().equals(want.combine_chunks())


def write_ipc_file(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return path


def write_ipc_stream(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return path


def buffer_ranges(batch: pa.RecordBatch) -> list[tuple[int, int]]:
    """(address, size) of every non-empty buffer of every column, children included."""
    out: list[tuple[int, int]] = []

    def walk(arr: pa.Array) -> None:
        for buf in arr.buffers():
            if buf is not None and buf.size:
                out.append((buf.address, buf.size))

    for col in batch.columns:
        walk(col)
    return out


# ------------------------------------------------------------------------------------------------ round trips


def test_table_dataset_round_trip_and_zero_copy(table: pa.Table) -> None:
    ds = TableDataset("t", table)
    assert ds.name == "t" and ds.schema == table.schema
    assert ds.num_rows == table.num_rows and ds.nbytes == table.nbytes
    same(read(ds), table)
    first = next(ds.open())
    assert first.column(0).buffers()[1].address == table.column(0).chunk(0).buffers()[1].address


def test_table_dataset_max_chunksize_and_record_batch(table: pa.Table) -> None:
    ds = TableDataset("t", table, max_chunksize=16)
    batches = list(ds.open())
    assert max(b.num_rows for b in batches) == 16
    same(pa.Table.from_batches(batches), table)
    rb = table.combine_chunks().to_batches()[0]
    same(read(TableDataset("rb", rb)), table)
    with pytest.raises(DatasetError, match="max_chunksize"):
        TableDataset("t", table, max_chunksize=0)


def test_each_open_is_a_fresh_iterator(table: pa.Table) -> None:
    ds = TableDataset("t", table)
    a, b = ds.open(), ds.open()
    next(a)
    assert sum(x.num_rows for x in b) == table.num_rows
    assert sum(x.num_rows for x in a) == table.num_rows - len(table.column(0).chunk(0))


def test_reader_factory_round_trip(table: pa.Table) -> None:
    calls = []

    def factory() -> pa.RecordBatchReader:
        calls.append(1)
        return pa.RecordBatchReader.from_batches(table.schema, table.to_batches())

    ds = ReaderFactoryDataset("r", factory)
    assert ds.schema == table.schema
    assert len(calls) == 1  # probed for the schema
    same(read(ds), table)
    assert len(calls) == 1  # the probed reader served the first request
    same(read(ds), table)
    same(read(ds), table)
    assert len(calls) == 3


def test_reader_factory_plain_iterable_needs_schema(table: pa.Table) -> None:
    with pytest.raises(DatasetError, match="schema="):
        ReaderFactoryDataset("g", lambda: iter(table.to_batches()))
    ds = ReaderFactoryDataset("g", lambda: iter(table.to_batches()), schema=table.schema)
    same(read(ds), table)
    same(read(ds), table)


def test_reader_factory_schema_mismatch_is_reported(table: pa.Table) -> None:
    other = pa.record_batch({"x": [1, 2]})
    ds = ReaderFactoryDataset("bad", lambda: [other], schema=table.schema)
    with pytest.raises(DatasetError, match=r"'bad'.*differs"):
        list(ds.open())


def test_reader_factory_metadata_only_difference_is_conformed(table: pa.Table) -> None:
    schema = table.schema.with_metadata({"k": "v"})
    ds = ReaderFactoryDataset("m", lambda: table.to_batches(), schema=schema)
    batches = list(ds.open())
    assert all(b.schema.metadata == {b"k": b"v"} for b in batches)


def test_reader_factory_failure_is_a_dataset_error() -> None:
    def broken() -> pa.RecordBatchReader:
        raise RuntimeError("disk on fire")

    with pytest.raises(DatasetError, match="disk on fire"):
        ReaderFactoryDataset("x", broken)


def test_ipc_file_round_trip(tmp_path: Path, table: pa.Table) -> None:
    ds = IpcFileDataset(write_ipc_file(tmp_path / "data.arrow", table))
    assert ds.name == "data"
    assert ds.schema == table.schema
    assert ds.num_batches == 3
    assert ds.nbytes == (tmp_path / "data.arrow").stat().st_size
    same(read(ds), table)
    same(read(ds), table)


def test_ipc_file_batches_are_views_of_the_mapping(tmp_path: Path, table: pa.Table) -> None:
    path = write_ipc_file(tmp_path / "data.arrow", table)
    ds = IpcFileDataset(path)
    lo = ds.buffer.address
    hi = lo + ds.buffer.size
    assert ds.buffer.size == path.stat().st_size
    ranges = [r for batch in ds.open() for r in buffer_ranges(batch)]
    assert len(ranges) > 10
    for addr, size in ranges:
        assert lo <= addr and addr + size <= hi, (addr, size, lo, hi)


def test_ipc_file_close_keeps_handed_out_batches(tmp_path: Path, table: pa.Table) -> None:
    ds = IpcFileDataset(write_ipc_file(tmp_path / "data.arrow", table))
    it = ds.open()
    batches = [next(it)]
    ds.close()
    assert ds.closed
    batches.extend(it)  # the reader holds its own slice of the mapping
    same(pa.Table.from_batches(batches), table)
    with pytest.raises(DatasetError, match="closed"):
        ds.open()


def test_ipc_stream_round_trip(tmp_path: Path, table: pa.Table) -> None:
    path = write_ipc_stream(tmp_path / "data.arrows", table)
    ds = IpcStreamDataset(path)
    assert ds.name == "data" and ds.schema == table.schema
    assert ds.nbytes == path.stat().st_size
    same(read(ds), table)
    same(read(ds), table)


def test_parquet_file_round_trip(tmp_path: Path, table: pa.Table) -> None:
    path = tmp_path / "p.parquet"
    pq.write_table(table, path, row_group_size=40)
    ds = ParquetDataset(path, batch_size=32)
    assert ds.name == "p"
    assert ds.schema.equals(table.schema, check_metadata=False)
    assert ds.num_rows == table.num_rows
    assert ds.nbytes is not None and ds.nbytes > 0
    batches = list(ds.open())
    assert max(b.num_rows for b in batches) <= 32
    assert len(batches) > 3
    same(pa.Table.from_batches(batches), table)


def test_parquet_directory(tmp_path: Path, table: pa.Table) -> None:
    d = tmp_path / "parts"
    d.mkdir()
    for k, chunk in enumerate(table.to_batches()):
        pq.write_table(pa.Table.from_batches([chunk]), d / f"part-{k}.parquet")
    ds = dataset_from(d)
    assert isinstance(ds, ParquetDataset)
    assert ds.name == "parts"
    assert len(ds.files) == 3
    assert ds.num_rows == table.num_rows
    same(read(ds), table)


def test_parquet_columns_selection(tmp_path: Path, table: pa.Table) -> None:
    pq.write_table(table, tmp_path / "p.parquet")
    ds = ParquetDataset(tmp_path / "p.parquet", columns=["s", "i"])
    assert ds.schema.names == ["s", "i"]
    same(read(ds), table.select(["s", "i"]))
    with pytest.raises(DatasetError, match="nope"):
        ParquetDataset(tmp_path / "p.parquet", columns=["nope"])


def test_parquet_empty_directory_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no Parquet files"):
        ParquetDataset(tmp_path / "empty")


def test_generated_round_trip_matches_batch() -> None:
    ds = GeneratedDataset("g", batches=4, rows_per_batch=100, seed=7)
    t = read(ds)
    assert t.num_rows == ds.num_rows == 400
    assert t.column("id").to_pylist() == list(range(400))
    assert pa.Table.from_batches([ds.batch(i) for i in range(4)]).equals(t)
    strings = t.column("label").to_pylist()
    assert all(isinstance(s, str) and len(s) <= 15 and set(s) <= set("abcdefghijklmnop") for s in strings)
    floats = t.column("value").to_pylist()
    assert all(0.0 <= v < 1.0 for v in floats) and len(set(floats)) > 390
    assert ds.nbytes == pytest.approx(t.nbytes, rel=0.1)


# --------------------------------------------------------------------------------------------------- laziness


def test_reader_factory_is_lazy(table: pa.Table) -> None:
    produced: list[int] = []

    def gen() -> Iterator[pa.RecordBatch]:
        for i in range(1000):
            produced.append(i)
            yield pa.record_batch({"x": pa.array([i], pa.int64())})

    schema = pa.schema([("x", pa.int64())])
    ds = ReaderFactoryDataset("lazy", lambda: pa.RecordBatchReader.from_batches(schema, gen()))
    assert produced == []  # learning the schema read no batch
    got = [b.column(0)[0].as_py() for b in itertools.islice(ds.open(), 2)]
    assert got == [0, 1]
    assert len(produced) <= 3  # at most one batch of read-ahead; never the whole thing


def test_parquet_partial_read_stops_early(tmp_path: Path) -> None:
    big = pa.table({"x": pa.array(range(200_000), pa.int64())})
    pq.write_table(big, tmp_path / "big.parquet", row_group_size=10_000)
    ds = ParquetDataset(tmp_path / "big.parquet", batch_size=1_000)
    it = ds.open()
    first = next(it)
    assert first.num_rows == 1_000
    assert first.column(0).to_pylist() == list(range(1_000))
    it.close()  # type: ignore[attr-defined]  # a generator: abandoning the scan must not hang or raise
    assert ds.num_rows == 200_000


def test_concurrent_requests_are_independent(tmp_path: Path, table: pa.Table) -> None:
    ds = IpcFileDataset(write_ipc_file(tmp_path / "c.arrow", table))
    results: list[pa.Table] = []
    lock = threading.Lock()

    def request() -> None:
        t = read(ds)
        with lock:
            results.append(t)

    threads = [threading.Thread(target=request) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 6
    for t in results:
        same(t, table)


def test_generated_is_deterministic() -> None:
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("u", pa.uint16()),
            ("f", pa.float32()),
            ("b", pa.bool_()),
            ("ts", pa.timestamp("ns")),
            ("d", pa.date32()),
            ("s", pa.large_string()),
            ("bin", pa.binary()),
        ]
    )
    a = GeneratedDataset("a", schema, batches=3, rows_per_batch=64, seed=42)
    b = GeneratedDataset("b", schema, batches=3, rows_per_batch=64, seed=42)
    c = GeneratedDataset("c", schema, batches=3, rows_per_batch=64, seed=43)
    ta, tb, tc = read(a), read(b), read(c)
    assert ta.equals(tb)
    assert not ta.drop_columns(["id"]).equals(tc.drop_columns(["id"]))
    assert a.batch(2).equals(list(a.open())[2])  # batch i does not depend on the ones before
    for batch in a.open():
        batch.validate(full=True)
    assert len(ta.to_pylist()) == 192  # every value converts (dates and times are in range)


def test_generated_does_not_materialize() -> None:
    made: list[int] = []

    class Counting(GeneratedDataset):
        def batch(self, i: int) -> pa.RecordBatch:
            made.append(i)
            return super().batch(i)

    # 1000 batches of 200k rows would be ~3.5 GB; taking two must cost two batches.
    ds = Counting("big", batches=1000, rows_per_batch=200_000, seed=1)
    assert ds.num_rows == 200_000_000
    assert made == []
    tracemalloc.start()
    try:
        it = ds.open()
        assert made == []  # opening is free
        taken = list(itertools.islice(it, 2))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert made == [0, 1]
    assert [b.num_rows for b in taken] == [200_000, 200_000]
    assert taken[1].column("id")[0].as_py() == 200_000
    assert peak < 64 << 20, peak


def test_generated_rejects_unsupported_types() -> None:
    with pytest.raises(DatasetError, match=r"'m'.*map"):
        GeneratedDataset("g", pa.schema([("m", pa.map_(pa.string(), pa.int32()))]), 1, 1)
    with pytest.raises(DatasetError, match=">= 0"):
        GeneratedDataset("g", None, -1, 1)


# ----------------------------------------------------------------------------------------------- dataset_from


def test_dataset_from_objects(table: pa.Table) -> None:
    assert isinstance(dataset_from(table, "t"), TableDataset)
    assert isinstance(dataset_from(table.to_batches()[0], "rb"), TableDataset)

    def my_reader() -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_batches(table.schema, table.to_batches())

    ds = dataset_from(my_reader)
    assert isinstance(ds, ReaderFactoryDataset) and ds.name == "my_reader"
    gen = GeneratedDataset("g", batches=1, rows_per_batch=3)
    assert dataset_from(gen) is gen
    renamed = dataset_from(gen, "other")
    assert renamed.name == "other" and gen.name == "g"
    assert read(renamed).equals(read(gen))


def test_dataset_from_rejects_clearly(table: pa.Table) -> None:
    with pytest.raises(DatasetError, match="name is required"):
        dataset_from(table)
    with pytest.raises(DatasetError, match="anonymous"):
        dataset_from(lambda: table.to_reader())
    with pytest.raises(DatasetError, match="name is required to serve a RecordBatchReader"):
        dataset_from(table.to_reader())
    with pytest.raises(DatasetError, match="cannot serve a int"):
        dataset_from(42, "x")
    with pytest.raises(DatasetError, match="must not be empty"):
        dataset_from(table, "")


class _Exports:
    """A bare Arrow PyCapsule producer: only the dunder methods, as a third-party library has them."""

    def __init__(self, data: pa.Table | pa.RecordBatch, *, stream: bool = True, fail: bool = False) -> None:
        self.data, self.stream, self.fail, self.exports = data, stream, fail, 0
        if stream:
            self.__arrow_c_stream__ = self._stream
        else:
            self.__arrow_c_array__ = self._array

    def _stream(self, requested_schema: object = None) -> object:
        self.exports += 1
        if self.fail:
            raise RuntimeError("the producer broke")
        return self.data.__arrow_c_stream__(requested_schema)

    def _array(self, requested_schema: object = None) -> object:
        self.exports += 1
        return self.data.__arrow_c_array__(requested_schema)


def test_dataset_from_pycapsule_producers(table: pa.Table) -> None:
    """An object exporting a stream (or a struct array) is read once, when added; a callable returning one
    is read anew per request; a reader, too, is read into memory once."""
    producer = _Exports(table)
    ds = dataset_from(producer, "p")
    assert isinstance(ds, TableDataset) and producer.exports == 1
    assert read(ds).equals(table) and read(ds).equals(table) and producer.exports == 1
    batch = table.combine_chunks().to_batches()[0]
    assert read(dataset_from(_Exports(batch, stream=False), "a")).equals(pa.Table.from_batches([batch]))
    assert read(dataset_from(table.to_reader(), "r")).equals(table)

    per_request = _Exports(table)

    def factory() -> object:
        return per_request

    ds = dataset_from(factory)
    assert isinstance(ds, ReaderFactoryDataset) and ds.schema.equals(table.schema)
    assert read(ds).equals(table) and read(ds).equals(table)
    assert per_request.exports == 2  # the first export gave the schema and served the first request


def test_dataset_from_pycapsule_producer_that_fails(table: pa.Table) -> None:
    with pytest.raises(DatasetError, match=r"dataset 'p': .*the producer broke"):
        dataset_from(_Exports(table, fail=True), "p")
    broken = _Exports(table)
    ds = dataset_from(lambda: broken, "f")
    broken.fail = True
    assert read(ds).equals(table)  # the export that gave the schema serves the first request
    with pytest.raises(DatasetError, match="the producer broke"):
        read(ds)


def test_dataset_from_paths_by_extension(tmp_path: Path, table: pa.Table) -> None:
    f = dataset_from(write_ipc_file(tmp_path / "a.feather", table))
    s = dataset_from(write_ipc_stream(tmp_path / "b.stream", table))
    pq.write_table(table, tmp_path / "c.parq")
    p = dataset_from(str(tmp_path / "c.parq"), name="renamed")
    assert isinstance(f, IpcFileDataset) and f.name == "a"
    assert isinstance(s, IpcStreamDataset) and s.name == "b"
    assert isinstance(p, ParquetDataset) and p.name == "renamed"
    for ds in (f, s, p):
        same(read(ds), table)


def test_dataset_from_sniffs_magic_over_extension(tmp_path: Path, table: pa.Table) -> None:
    file_as_stream_ext = dataset_from(write_ipc_file(tmp_path / "f.arrows", table))
    stream_as_file_ext = dataset_from(write_ipc_stream(tmp_path / "s.arrow", table))
    stream_no_ext = dataset_from(write_ipc_stream(tmp_path / "s2.bin", table))
    pq.write_table(table, tmp_path / "p.dat")
    parquet_odd_ext = dataset_from(tmp_path / "p.dat")
    assert isinstance(file_as_stream_ext, IpcFileDataset)
    assert isinstance(stream_as_file_ext, IpcStreamDataset)
    assert isinstance(stream_no_ext, IpcStreamDataset)
    assert isinstance(parquet_odd_ext, ParquetDataset)
    for ds in (file_as_stream_ext, stream_as_file_ext, stream_no_ext, parquet_odd_ext):
        same(read(ds), table)


def test_dataset_from_unknown_paths(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, not arrow")
    with pytest.raises(DatasetError, match=r"notes\.txt.*expected an Arrow IPC file") as e:
        dataset_from(text)
    assert isinstance(e.value, DissocError) and isinstance(e.value, ValueError)
    with pytest.raises(DatasetError, match="no such file"):
        dataset_from(tmp_path / "missing.arrow")
    (tmp_path / "bad.parquet").write_bytes(b"definitely not parquet")
    with pytest.raises(CodecError, match=r"bad\.parquet"):
        dataset_from(tmp_path / "bad.parquet")


def test_malformed_ipc_is_a_codec_error(tmp_path: Path, table: pa.Table) -> None:
    good = write_ipc_file(tmp_path / "good.arrow", table).read_bytes()
    (tmp_path / "cut.arrow").write_bytes(good[: len(good) // 2])
    with pytest.raises(CodecError):
        dataset_from(tmp_path / "cut.arrow")
    (tmp_path / "junk.arrows").write_bytes(b"\xff\xff\xff\xff\x10\x00\x00\x00" + b"\x00" * 4)
    with pytest.raises(CodecError):
        dataset_from(tmp_path / "junk.arrows")


# ---------------------------------------------------------------------------------------------------- catalog


def test_catalog_add_get_remove(table: pa.Table, tmp_path: Path) -> None:
    cat = Catalog()
    assert len(cat) == 0 and cat.names() == []
    t = cat.add("t", table)
    f = cat.add(None, write_ipc_file(tmp_path / "frames.arrow", table))
    assert cat.names() == ["t", "frames"] and len(cat) == 2
    assert "t" in cat and b"frames" in cat and "x" not in cat and b"\xff" not in cat
    assert cat.get("t") is t and cat.get(b"frames") is f
    assert list(cat) == ["t", "frames"]
    with pytest.raises(DatasetError, match="already served"):
        cat.add("t", table)
    replacement = cat.add("t", table.slice(0, 5), replace=True)
    assert cat.get("t") is replacement and replacement.num_rows == 5
    assert cat.remove(b"t") is replacement
    assert "t" not in cat and cat.names() == ["frames"]
    with pytest.raises(UnknownTicket):
        cat.remove("t")
    cat.close()
    assert len(cat) == 0 and f.closed


def test_catalog_unknown_ticket(table: pa.Table) -> None:
    cat = Catalog({"known": table})
    with pytest.raises(UnknownTicket) as e:
        cat.get(b"nope")
    err = e.value
    assert isinstance(err, KeyError) and isinstance(err, DatasetError) and isinstance(err, DissocError)
    assert "'nope'" in str(err) and "'known'" not in str(err)  # served names are never listed
    assert err.ticket == b"nope"
    with pytest.raises(KeyError):
        cat["missing"]


def test_catalog_invalid_utf8_ticket(table: pa.Table) -> None:
    cat = Catalog({"t": table})
    with pytest.raises(UnknownTicket, match="not valid UTF-8") as e:
        cat.get(b"t\xff\xfe")
    assert e.value.ticket == b"t\xff\xfe"
    assert "\\xff" in str(e.value)
    with pytest.raises(UnknownTicket, match="not valid UTF-8"):
        cat.describe(b"\xc3")  # truncated two-byte sequence
    with pytest.raises(UnknownTicket, match="bytes or str"):
        cat.get(17)  # type: ignore[arg-type]


def test_catalog_describe(tmp_path: Path, table: pa.Table) -> None:
    cat = Catalog()
    cat.add("t", table)
    cat.add("s", write_ipc_stream(tmp_path / "s.arrows", table))
    cat.add("g", GeneratedDataset("g", batches=2, rows_per_batch=10))
    d = cat.describe(b"t")
    assert d == {"name": "t", "schema": table.schema, "num_rows": table.num_rows, "nbytes": table.nbytes}
    s = cat.describe("s")
    assert s["schema"] == table.schema and s["num_rows"] is None and s["nbytes"] > 0
    assert cat.describe("g")["num_rows"] == 20


def test_catalog_is_thread_safe(table: pa.Table) -> None:
    cat = Catalog()
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(50):
                name = f"w{k}-{j}"
                cat.add(name, table)
                assert cat.get(name).num_rows == table.num_rows
                if j % 2:
                    cat.remove(name)
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(cat) == 8 * 25
    assert sorted(cat.names()) == sorted(f"w{k}-{j}" for k in range(8) for j in range(0, 50, 2))


def test_catalog_add_rejects_bad_names(table: pa.Table) -> None:
    cat = Catalog()
    with pytest.raises(DatasetError, match="UTF-8"):
        cat.add("bad\udc80", table)
    assert len(cat) == 0
