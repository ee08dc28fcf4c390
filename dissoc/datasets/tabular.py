"""Files read through ``pyarrow.dataset``: CSV and newline-delimited JSON files, and directories of Parquet,
CSV, JSON or Arrow IPC files with hive partitions (``key=value/`` folders become columns).

What a path holds is decided from its files' suffixes (:func:`file_format`): ``.csv``, ``.tsv``, ``.json``,
``.jsonl``, ``.ndjson`` (each also compressed, ``.csv.gz`` and the like), ``.parquet``/``.parq`` and
``.arrow``/``.feather``/``.ipc``; a file of a directory without one of them is taken by its magic (Parquet's
``PAR1``, Arrow IPC's ``ARROW1``). A directory holds one format: mixed ones are a :class:`DatasetError`.
:func:`directory_dataset` keeps a directory of Parquet files without partition folders a
:class:`~dissoc.datasets.files.ParquetDataset`, as before, and makes every other a
:class:`FileSystemDataset`.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pyarrow as pa

from dissoc.datasets.base import (
    DEFAULT_PARQUET_BATCH_SIZE,
    IPC_FILE_MAGIC,
    IPC_FILE_SUFFIXES,
    IPC_STREAM_SUFFIXES,
    PARQUET_MAGIC,
    PARQUET_SUFFIXES,
    Dataset,
    DatasetError,
    close_quietly,
)
from dissoc.datasets.files import ParquetDataset
from dissoc.errors import CodecError

__all__ = [
    "COMPRESSION_SUFFIXES",
    "CSV_SUFFIXES",
    "JSON_SUFFIXES",
    "TABULAR_SUFFIXES",
    "TSV_SUFFIXES",
    "FileSystemDataset",
    "directory_dataset",
    "file_format",
]

log = logging.getLogger(__name__)

CSV_SUFFIXES: Final = frozenset({".csv"})
TSV_SUFFIXES: Final = frozenset({".tsv"})
JSON_SUFFIXES: Final = frozenset({".json", ".jsonl", ".ndjson"})
#: Every suffix of a text format read here (before a compression suffix).
TABULAR_SUFFIXES: Final = CSV_SUFFIXES | TSV_SUFFIXES | JSON_SUFFIXES
#: What ``pyarrow.dataset`` decompresses by the file's last suffix (it takes ``.zst`` for plain text: such a
#: file is not recognised here rather than read as garbage).
COMPRESSION_SUFFIXES: Final = frozenset({".gz", ".bz2", ".lz4", ".zstd", ".brotli"})
#: Names ``pyarrow.dataset`` skips in a directory, and so does the format decision.
_IGNORED_PREFIXES: Final = (".", "_")
#: Formats by their name here, and what each is called in messages.
_FORMAT_NAMES: Final = {
    "csv": "CSV",
    "tsv": "TSV",
    "json": "newline-delimited JSON",
    "parquet": "Parquet",
    "ipc": "Arrow IPC",
}


def _suffixes(name: str) -> tuple[str, str | None]:
    """(the format suffix, the compression suffix or None) of a file name, lower-cased."""
    path = Path(name.lower())
    if path.suffix in COMPRESSION_SUFFIXES:
        return Path(path.stem).suffix, path.suffix
    return path.suffix, None


def file_format(path: str | os.PathLike[str]) -> str | None:
    """The format a file's suffixes name: ``"csv"``, ``"tsv"``, ``"json"`` (each possibly compressed),
    ``"parquet"`` or ``"ipc"`` (an IPC file); ``"ipc-stream"`` for an IPC stream; None for anything else."""
    suffix, compression = _suffixes(Path(path).name)
    if suffix in CSV_SUFFIXES:
        return "csv"
    if suffix in TSV_SUFFIXES:
        return "tsv"
    if suffix in JSON_SUFFIXES:
        return "json"
    if compression is not None:
        return None  # Parquet and IPC files compress themselves
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in IPC_FILE_SUFFIXES:
        return "ipc"
    if suffix in IPC_STREAM_SUFFIXES:
        return "ipc-stream"
    return None


def _default_name(path: Path) -> str:
    """A file's name without its format and compression suffixes (``trips.csv.gz`` → ``trips``); a
    directory's stem, as for a directory of Parquet."""
    if path.is_dir():
        return path.stem
    name = path.name
    suffix, compression = _suffixes(name)
    cut = len(suffix) + len(compression or "")
    return name[: len(name) - cut] if 0 < cut < len(name) else path.stem


def _sniff(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(len(IPC_FILE_MAGIC))
    except OSError as e:
        raise DatasetError(f"cannot read {str(path)!r}: {e.strerror}") from None
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    if head.startswith(IPC_FILE_MAGIC):
        return "ipc"
    return None


@dataclass(frozen=True)
class _Found:
    """What a directory (or one file) holds: its format, its files in order, whether it has hive folders."""

    format: str
    files: list[Path]
    hive: bool


def _walk(root: Path) -> Iterator[Path]:
    """Every file under ``root``, sorted, but for names ``pyarrow.dataset`` skips (``.x``, ``_x``)."""
    for parent, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(_IGNORED_PREFIXES))
        for name in sorted(names):
            if not name.startswith(_IGNORED_PREFIXES):
                yield Path(parent, name)


def _look(path: Path) -> _Found:
    """The format of a file, or the one format of a directory's files (DatasetError if there is none)."""
    if not path.is_dir():
        fmt = file_format(path)
        if fmt not in _FORMAT_NAMES:
            raise DatasetError(
                f"{str(path)!r} is not a CSV, TSV or newline-delimited JSON file ({_known_suffixes()}), "
                "nor a Parquet or Arrow IPC file"
            )
        assert fmt is not None
        return _Found(fmt, [path], False)
    found: dict[str, Path] = {}
    files: list[Path] = []
    for file in _walk(path):
        fmt = file_format(file) or _sniff(file)
        if fmt == "ipc-stream":
            raise DatasetError(
                f"{str(file)!r} is an Arrow IPC stream: a directory is read through pyarrow.dataset, which "
                "reads IPC files only (serve the stream on its own, or write IPC files)"
            )
        if fmt is None:
            raise DatasetError(
                f"cannot tell what {str(file)!r} holds: in a directory every file must be CSV, TSV or "
                f"newline-delimited JSON ({_known_suffixes()}), Parquet ({_listed(PARQUET_SUFFIXES)}, or "
                f"{PARQUET_MAGIC!r} magic) or an Arrow IPC file ({_listed(IPC_FILE_SUFFIXES)}, or "
                f"{IPC_FILE_MAGIC!r} magic); files starting with '.' or '_' are skipped"
            )
        found.setdefault(fmt, file)
        files.append(file)
    if not files:
        raise DatasetError(f"no data files under {str(path)!r}")
    if len(found) > 1:
        seen = "; ".join(f"{_FORMAT_NAMES[f]} ({str(p)!r})" for f, p in found.items())
        raise DatasetError(
            f"{str(path)!r} mixes formats: {seen}; a directory is served as one format (serve each "
            "format's files from a directory of their own)"
        )
    hive = any("=" in part for file in files for part in file.relative_to(path).parts[:-1])
    return _Found(next(iter(found)), files, hive)


def _listed(suffixes: frozenset[str]) -> str:
    return ", ".join(sorted(suffixes))


def _known_suffixes() -> str:
    return f"{_listed(TABULAR_SUFFIXES)}, each possibly compressed: {_listed(COMPRESSION_SUFFIXES)}"


def _file_format(fmt: str) -> Any:
    """The ``pyarrow.dataset`` FileFormat that reads ``fmt``."""
    import pyarrow.csv as pacsv
    import pyarrow.dataset as pads

    if fmt == "csv":
        return pads.CsvFileFormat()
    if fmt == "tsv":
        return pads.CsvFileFormat(parse_options=pacsv.ParseOptions(delimiter="\t"))
    if fmt == "json":
        return pads.JsonFileFormat()
    if fmt == "parquet":
        return pads.ParquetFileFormat(
            default_fragment_scan_options=pads.ParquetFragmentScanOptions(pre_buffer=False)
        )
    return pads.IpcFileFormat()


def directory_dataset(path: Path, name: str | None = None) -> Dataset:
    """A directory's dataset: a :class:`~dissoc.datasets.files.ParquetDataset` for Parquet files without
    hive partition folders (as a directory of Parquet always was), a :class:`FileSystemDataset` otherwise."""
    found = _look(path)
    if found.format == "parquet" and not found.hive:
        return ParquetDataset(path, name)
    return FileSystemDataset(path, name)


class FileSystemDataset(Dataset):
    """A CSV, TSV or newline-delimited JSON file, or a directory of Parquet, CSV, TSV, JSON or Arrow IPC
    files, read through ``pyarrow.dataset`` one batch at a time, files in sorted order.

    The schema is known up front: CSV and JSON types are inferred from the start of the first file (as
    ``pyarrow.dataset`` does), the hive partition columns (``key=value`` folders, their types inferred from
    every folder's name) come last; every request reads with that schema, and a value a later row cannot be
    read as raises a :class:`~dissoc.errors.CodecError` naming the file. A Parquet file is read with
    ``pyarrow.parquet.ParquetFile.iter_batches`` (the partition columns added to each batch), so that a
    stalled client makes the server hold about one batch, not the file; the other formats are scanned with
    no batch read ahead (``batch_readahead``). ``batch_size`` bounds the rows of a batch. With
    ``read_ahead`` (the default) a server decodes the next batch while it sends one, as for Parquet.

    ``per_file=True`` (a directory) makes one dataset per file, :attr:`parts`, each with the directory's
    schema and named ``NAME/PATH`` by the file's path under the directory (``trips/year=2024/part-0.csv``):
    a server serves each under that name too, and a Flight control plane lists them as the directory's
    endpoints, in order.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        *,
        batch_size: int = DEFAULT_PARQUET_BATCH_SIZE,
        batch_readahead: int = 0,
        use_threads: bool = True,
        read_ahead: bool = True,
        per_file: bool = False,
    ) -> None:
        import pyarrow.dataset as pads

        self.path = Path(path)
        super().__init__(_default_name(self.path) if name is None else name)
        if batch_size <= 0:
            raise DatasetError(f"dataset {self.name!r}: batch_size must be positive, got {batch_size}")
        if not self.path.exists():
            raise DatasetError(f"no such file or directory: {str(self.path)!r}")
        self.batch_size = batch_size
        self.batch_readahead = batch_readahead
        self.use_threads = use_threads
        self.read_ahead = read_ahead
        found = _look(self.path)
        #: The files' format: ``"csv"``, ``"tsv"``, ``"json"``, ``"parquet"`` or ``"ipc"``.
        self.format = found.format
        what = _FORMAT_NAMES[self.format]
        try:
            if self.path.is_dir():
                scanned = pads.dataset(
                    [str(f) for f in found.files],
                    format=_file_format(self.format),
                    partitioning="hive",
                    partition_base_dir=str(self.path),
                )
            else:
                scanned = pads.dataset(str(self.path), format=_file_format(self.format))
            self._schema: pa.Schema = scanned.schema
            self._fragments: Sequence[Any] = tuple(scanned.get_fragments())
            partitioning = getattr(scanned, "partitioning", None)
            partition_fields = partitioning.schema.names if partitioning is not None else []
        except (OSError, ValueError, pa.ArrowException) as e:
            raise CodecError(f"cannot read {str(self.path)!r} as {what}: {_reason(e)}") from None
        #: The hive partition columns (the schema's last fields).
        self._partition_names = frozenset(partition_fields)
        self._size = sum(_size(f) for f in found.files)
        self._parts: tuple[FileSystemDataset, ...] = ()
        if per_file and self.path.is_dir():
            self._parts = tuple(self._part(fragment) for fragment in self._fragments)

    def _part(self, fragment: Any) -> FileSystemDataset:
        """The dataset of one of the directory's files: its settings and schema, only that file."""
        part = copy.copy(self)
        file = Path(fragment.path)
        Dataset.__init__(part, f"{self.name}/{file.relative_to(self.path).as_posix()}")
        part.path = file
        part._fragments = (fragment,)
        part._size = _size(file)
        part._parts = ()
        return part

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def files(self) -> list[str]:
        """The files read, in order."""
        return [str(f.path) for f in self._fragments]

    @property
    def parts(self) -> tuple[FileSystemDataset, ...]:
        """With ``per_file``, one dataset per file (``NAME/PATH``), in order; else none."""
        return self._parts

    @property
    def nbytes(self) -> int:
        """The files' size on disk (compressed, or as text: a hint, not the Arrow size)."""
        return self._size

    def close(self) -> None:
        for part in self._parts:
            part.close()
        super().close()

    def open(self) -> Iterator[pa.RecordBatch]:
        self._check_open()
        return self._iterate()

    def _iterate(self) -> Iterator[pa.RecordBatch]:
        what = _FORMAT_NAMES[self.format]
        for fragment in self._fragments:
            path = str(fragment.path)
            batches: Iterator[pa.RecordBatch] | None = None
            try:
                try:
                    batches = self._read(fragment)
                    while True:
                        batch = next(batches, None)
                        if batch is None:
                            break
                        if batch.num_rows:
                            yield self._conform(batch)
                except (OSError, ValueError, pa.ArrowException) as e:
                    if isinstance(e, DatasetError | CodecError):
                        raise
                    raise CodecError(f"reading {what} {path!r} failed: {_reason(e)}") from None
            finally:
                close_quietly(batches)  # stops the scan when a request is abandoned

    def _read(self, fragment: Any) -> Iterator[pa.RecordBatch]:
        if self.format == "parquet":
            batches = self._parquet_batches(fragment)
            if batches is not None:
                return batches
        return iter(
            fragment.to_batches(
                schema=self._schema,
                batch_size=self.batch_size,
                batch_readahead=self.batch_readahead,
                fragment_readahead=0,
                use_threads=self.use_threads,
            )
        )

    def _parquet_batches(self, fragment: Any) -> Iterator[pa.RecordBatch] | None:
        """A Parquet file's batches with its partition columns added, or None when the file's own columns
        are not the dataset's (the scanner then reconciles them)."""
        import pyarrow.parquet as pq

        file = pq.ParquetFile(str(fragment.path), pre_buffer=False)
        stored = pa.schema([f for f in self._schema if f.name not in self._partition_names])
        if not file.schema_arrow.equals(stored):
            file.close()
            return None
        return self._with_partitions(file, fragment)

    def _with_partitions(self, file: Any, fragment: Any) -> Iterator[pa.RecordBatch]:
        import pyarrow.dataset as pads

        keys = pads.get_partition_keys(fragment.partition_expression)
        with file:
            batches = file.iter_batches(batch_size=self.batch_size, use_threads=self.use_threads)
            try:
                for batch in batches:
                    n = batch.num_rows
                    columns = [
                        _constant(keys.get(field.name), field.type, n)
                        if field.name in self._partition_names
                        else batch.column(field.name)
                        for field in self._schema
                    ]
                    yield pa.RecordBatch.from_arrays(columns, schema=self._schema)
            finally:
                close_quietly(batches)

    def __repr__(self) -> str:
        return f"FileSystemDataset({str(self.path)!r}, name={self.name!r}, format={self.format!r})"


def _constant(value: object, type_: pa.DataType, length: int) -> pa.Array:
    if value is None:
        return pa.nulls(length, type_)
    return pa.repeat(pa.scalar(value, type_), length)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _reason(error: BaseException) -> str:
    """pyarrow's message without the C++ source locations it may append."""
    text = str(error).strip() or type(error).__name__
    return text.split("\n/")[0].strip()
