"""Files read through ``pyarrow.dataset``: CSV, TSV and newline-delimited JSON files (compressed too), and
directories of one format with hive partitions. Each is equal to pyarrow's own read, read lazily with one
schema on every request, and a bad file is a clear DissocError, never a raw pyarrow exception."""

from __future__ import annotations

import gzip
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from dissoc.datasets import (
    Dataset,
    DatasetError,
    FileSystemDataset,
    ParquetDataset,
    dataset_from,
)
from dissoc.errors import CodecError, DissocError

CSV = "id,name,score\n1,ann,0.5\n2,,1.25\n3,cy,\n"
NDJSON = '{"id": 1, "tags": ["a"], "at": {"x": 1}}\n{"id": 2, "tags": [], "at": null}\n{"id": 3}\n'


def read(ds: Dataset) -> pa.Table:
    """One request's batches as a table; every batch has exactly the dataset's schema."""
    batches = list(ds.open())
    for b in batches:
        assert b.schema.equals(ds.schema, check_metadata=True)
    return pa.Table.from_batches(batches, schema=ds.schema)


def pyarrow_read(path: Path, fmt: str | pads.FileFormat) -> pa.Table:
    """What pyarrow itself reads there (hive partitions for a directory)."""
    hive = "hive" if path.is_dir() else None
    return pads.dataset(str(path), format=fmt, partitioning=hive).to_table()


def same(got: pa.Table, want: pa.Table) -> None:
    assert got.schema.equals(want.schema), (got.schema, want.schema)
    assert got.combine_chunks().equals(want.combine_chunks()), (got.to_pydict(), want.to_pydict())


def hive_csv(root: Path) -> Path:
    """``sales/year=Y/region=R/part.csv``: three files, partition values in the folders' names."""
    for year, region, rows in (
        (2023, "eu", "1,9.5\n2,3\n"),
        (2024, "eu", "3,1\n"),
        (2024, "us", "4,2\n5,7\n"),
    ):
        folder = root / "sales" / f"year={year}" / f"region={region}"
        folder.mkdir(parents=True)
        (folder / "part.csv").write_text("id,amount\n" + rows)
    return root / "sales"


# ------------------------------------------------------------------------------------------------- one file


@pytest.mark.parametrize(
    ("filename", "fmt"),
    [("t.csv", "csv"), ("t.csv.gz", "csv"), ("t.tsv", "tsv"), ("t.jsonl", "json"), ("t.json.gz", "json")],
)
def test_text_files_are_served_as_pyarrow_reads_them(tmp_path: Path, filename: str, fmt: str) -> None:
    text = NDJSON if fmt == "json" else CSV.replace(",", "\t") if fmt == "tsv" else CSV
    path = tmp_path / filename
    if filename.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    ds = dataset_from(path)
    assert isinstance(ds, FileSystemDataset)
    assert ds.name == "t" and ds.format == fmt
    assert ds.nbytes == path.stat().st_size and ds.parts == ()
    want_format: str | pads.FileFormat = fmt
    if fmt == "tsv":
        want_format = pads.CsvFileFormat(parse_options=pacsv.ParseOptions(delimiter="\t"))
    same(read(ds), pyarrow_read(path, want_format))
    assert read(ds).num_rows == 3


@pytest.mark.parametrize("suffix", [".json", ".ndjson"])
def test_json_suffixes(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"events{suffix}"
    path.write_text(NDJSON)
    ds = dataset_from(path, name="ev")
    assert ds.name == "ev"
    same(read(ds), pyarrow_read(path, "json"))
    assert ds.schema.field("tags").type == pa.list_(pa.string())  # nested types come through


def test_schema_is_inferred_once_and_kept_on_every_request(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(CSV)
    ds = FileSystemDataset(path)
    schema = ds.schema
    assert schema.types == [pa.int64(), pa.string(), pa.float64()]
    first, second = read(ds), read(ds)
    assert first.schema.equals(schema) and second.schema.equals(schema) and first.equals(second)


def test_a_batch_size_bounds_the_rows_of_a_batch(tmp_path: Path) -> None:
    path = tmp_path / "many.csv"
    path.write_text("v\n" + "".join(f"{i}\n" for i in range(100)))
    batches = list(FileSystemDataset(path, batch_size=30).open())
    assert max(b.num_rows for b in batches) <= 30 and len(batches) >= 4
    assert pa.Table.from_batches(batches).column("v").to_pylist() == list(range(100))
    with pytest.raises(DatasetError, match="batch_size must be positive"):
        FileSystemDataset(path, batch_size=0)


# -------------------------------------------------------------------------------------------- directories


def test_hive_partitioned_csv_directory(tmp_path: Path) -> None:
    root = hive_csv(tmp_path)
    ds = dataset_from(root)
    assert isinstance(ds, FileSystemDataset) and ds.name == "sales" and ds.format == "csv"
    assert ds.schema.names == ["id", "amount", "year", "region"]
    assert ds.schema.field("year").type == pa.int32()
    got = read(ds)
    same(got, pyarrow_read(root, "csv"))
    assert got.column("region").to_pylist() == ["eu", "eu", "eu", "us", "us"]
    assert [Path(f).relative_to(root).as_posix() for f in ds.files] == [
        "year=2023/region=eu/part.csv",
        "year=2024/region=eu/part.csv",
        "year=2024/region=us/part.csv",
    ]


def test_hive_partitioned_parquet_is_read_file_by_file(tmp_path: Path) -> None:
    root = tmp_path / "p"
    for k in (1, 2):
        (root / f"k={k}").mkdir(parents=True)
        table = pa.table({"v": pa.array(range(k * 100, k * 100 + 50), pa.int64()), "s": [f"r{k}"] * 50})
        pq.write_table(table, root / f"k={k}" / "data.parquet", row_group_size=10)
    ds = dataset_from(root)
    assert isinstance(ds, FileSystemDataset) and ds.format == "parquet"
    same(read(ds), pyarrow_read(root, "parquet"))
    small = FileSystemDataset(root, batch_size=10)
    it = small.open()
    first = next(it)
    assert first.num_rows == 10 and first.column("k").to_pylist() == [1] * 10
    it.close()  # type: ignore[attr-defined]  # abandoning a request stops the read
    assert len(list(small.open())) == 10


def test_a_parquet_file_whose_columns_differ_is_reconciled(tmp_path: Path) -> None:
    root = tmp_path / "p"
    (root / "k=1").mkdir(parents=True)
    (root / "k=2").mkdir(parents=True)
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), root / "k=1" / "f.parquet")
    pq.write_table(pa.table({"b": ["z"]}), root / "k=2" / "f.parquet")  # no column a
    got = read(FileSystemDataset(root))
    assert got.to_pydict() == {"a": [1, 2, None], "b": ["x", "y", "z"], "k": [1, 1, 2]}


def test_ipc_and_json_directories(tmp_path: Path) -> None:
    ipc = tmp_path / "ipc"
    for k in (1, 2):
        (ipc / f"part={k}").mkdir(parents=True)
        with pa.ipc.new_file(str(ipc / f"part={k}" / "a.arrow"), pa.schema([("x", pa.int64())])) as w:
            w.write_table(pa.table({"x": [k, k]}))
    ds = dataset_from(ipc)
    assert isinstance(ds, FileSystemDataset) and ds.format == "ipc"
    same(read(ds), pyarrow_read(ipc, "ipc"))
    flat = tmp_path / "json"
    flat.mkdir()
    (flat / "a.jsonl").write_text('{"x": 1}\n')
    (flat / "b.ndjson").write_text('{"x": 2}\n')
    ds = dataset_from(flat)
    assert isinstance(ds, FileSystemDataset) and ds.format == "json"
    assert read(ds).column("x").to_pylist() == [1, 2]


def test_a_flat_parquet_directory_stays_a_parquet_dataset(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    (root / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"x": [1]}), root / "a.parquet")
    pq.write_table(pa.table({"x": [2]}), root / "sub" / "b")  # no suffix: Parquet by its magic
    (root / "_SUCCESS").write_text("")  # skipped, as pyarrow.dataset skips it
    (root / ".a.parquet.crc").write_bytes(b"\0")
    ds = dataset_from(root)
    assert isinstance(ds, ParquetDataset)
    assert sorted(read(ds).column("x").to_pylist()) == [1, 2]


def test_a_directory_is_one_format(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.csv").write_text("x\n1\n")
    (mixed / "b.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(DatasetError, match=r"mixes formats: CSV \(.*a\.csv'\); newline-delimited JSON"):
        dataset_from(mixed)
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "a.csv").write_text("x\n1\n")
    (odd / "notes.txt").write_text("hello")
    with pytest.raises(DatasetError, match=r"cannot tell what .*notes\.txt.* holds.*\.csv"):
        dataset_from(odd)
    streams = tmp_path / "streams"
    streams.mkdir()
    with pa.ipc.new_stream(str(streams / "s.arrows"), pa.schema([("x", pa.int64())])):
        pass
    with pytest.raises(DatasetError, match="IPC stream"):
        dataset_from(streams)
    empty = tmp_path / "empty"
    (empty / "_temporary").mkdir(parents=True)
    (empty / "_temporary" / "a.csv").write_text("x\n1\n")
    with pytest.raises(DatasetError, match="no data files"):
        dataset_from(empty)


# ------------------------------------------------------------------------------------------------ per file


def test_per_file_parts_carry_the_directorys_schema(tmp_path: Path) -> None:
    root = hive_csv(tmp_path)
    ds = FileSystemDataset(root, per_file=True)
    names = [p.name for p in ds.parts]
    assert names == [
        "sales/year=2023/region=eu/part.csv",
        "sales/year=2024/region=eu/part.csv",
        "sales/year=2024/region=us/part.csv",
    ]
    tables = [read(p) for p in ds.parts]
    assert all(p.schema.equals(ds.schema) for p in ds.parts)
    assert [t.num_rows for t in tables] == [2, 1, 2]
    assert tables[2].column("region").to_pylist() == ["us", "us"]
    same(pa.concat_tables(tables), read(ds))
    ds.close()
    assert all(p.closed for p in ds.parts)
    assert FileSystemDataset(root).parts == ()
    one = tmp_path / "one.csv"
    one.write_text("x\n1\n")
    assert FileSystemDataset(one, per_file=True).parts == ()  # a file is one endpoint anyway


# ---------------------------------------------------------------------------------------------------- errors


def test_a_row_that_does_not_fit_the_schema_is_a_codec_error_naming_the_file(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    (root / "1.csv").write_text("v\n1\n2\n")
    (root / "2.csv").write_text("v\nnot-a-number\n")
    ds = dataset_from(root)
    it = ds.open()
    assert next(it).column("v").to_pylist() == [1, 2]  # the first file's batch goes first
    with pytest.raises(CodecError, match=r"reading CSV '.*2\.csv' failed: .*not-a-number") as e:
        next(it)
    assert isinstance(e.value, DissocError) and not isinstance(e.value, pa.ArrowException)


def test_files_are_opened_only_when_a_request_reaches_them(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    (root / "1.jsonl").write_text('{"v": 1}\n')
    (root / "2.jsonl").write_text('{"v": 2}\n')
    ds = dataset_from(root)
    it = ds.open()
    assert next(it).column("v").to_pylist() == [1]
    (root / "2.jsonl").write_text("[1, 2")  # broken after the request began: seen when it gets there
    with pytest.raises(CodecError, match=r"2\.jsonl"):
        list(it)
    (root / "2.jsonl").write_text('{"v": 3}\n')
    assert read(ds).column("v").to_pylist() == [1, 3]


@pytest.mark.parametrize(
    ("filename", "content", "error", "match"),
    [
        ("arr.json", '[{"a": 1}, {"a": 2}]', CodecError, r"arr\.json.*as newline-delimited JSON"),
        ("bad.csv.gz", "x\n1\n", CodecError, r"bad\.csv\.gz.*as CSV"),  # not gzip
        ("empty.csv", "", CodecError, r"empty\.csv.*as CSV.*[Ee]mpty"),
        ("t.csv.zst", "x\n1\n", DatasetError, r"cannot tell what .*t\.csv\.zst.*\.zstd"),
    ],
)
def test_malformed_files_are_clear_errors(
    tmp_path: Path, filename: str, content: str, error: type[DissocError], match: str
) -> None:
    path = tmp_path / filename
    path.write_text(content)
    with pytest.raises(error, match=match) as e:
        dataset_from(path)
    assert not isinstance(e.value, pa.ArrowException)


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        FileSystemDataset(tmp_path / "missing.csv")
    with pytest.raises(DatasetError, match="no such file"):
        dataset_from(tmp_path / "missing.csv")
