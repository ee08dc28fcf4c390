"""What a dissoc server serves: named datasets, each opened afresh, and lazily, per request.

A :class:`Dataset` knows its name and schema up front and, on :meth:`Dataset.open`, hands out a new
iterator of ``pa.RecordBatch`` that reads batch by batch, so a 10 GiB file never has to sit in memory.
Implementations cover in-memory tables, reader factories, Arrow IPC files (memory-mapped, zero-copy) and
streams, Parquet files and directories, and deterministic synthetic data. :func:`dataset_from` builds the
right one from a table, a callable or a path, and :class:`Catalog` is the thread-safe registry that maps
tickets to datasets.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa

import dissoc.codec as codec
from dissoc.errors import CodecError, DissocError

__all__ = [
    "Catalog",
    "Dataset",
    "DatasetError",
    "DeviceDataset",
    "GeneratedDataset",
    "IpcFileDataset",
    "IpcStreamDataset",
    "ParquetDataset",
    "ReaderFactoryDataset",
    "TableDataset",
    "UnknownTicket",
    "dataset_from",
]

log = logging.getLogger(__name__)

ReaderFactory: TypeAlias = Callable[[], "pa.RecordBatchReader | Iterable[pa.RecordBatch]"]
"""A callable that returns a fresh reader (or iterable of batches) each time it is called."""

IPC_FILE_MAGIC = b"ARROW1"
PARQUET_MAGIC = b"PAR1"
FEATHER_V1_MAGIC = b"FEA1"
_CONTINUATION = b"\xff\xff\xff\xff"
IPC_FILE_SUFFIXES = frozenset({".arrow", ".feather", ".ipc"})
IPC_STREAM_SUFFIXES = frozenset({".arrows", ".stream"})
PARQUET_SUFFIXES = frozenset({".parquet", ".parq"})
DEFAULT_PARQUET_BATCH_SIZE = 1 << 20


class DatasetError(DissocError, ValueError):
    """A dataset cannot be built or served: an unsupported object or path, a bad name, a schema mismatch."""


class UnknownTicket(DatasetError, KeyError):
    """No dataset is served under the requested ticket (or the ticket is not valid UTF-8).

    ``.ticket`` holds the ticket as given (``str`` or ``bytes``).
    """

    def __init__(self, ticket: str | bytes, message: str) -> None:
        super().__init__(message)
        self.ticket = ticket
        self.message = message

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


# ------------------------------------------------------------------------------------------------------- base


class Dataset(abc.ABC):
    """A named sequence of record batches with a known schema, opened afresh for every request.

    Subclasses implement :attr:`schema` and :meth:`open`; :attr:`num_rows` and :attr:`nbytes` are hints
    (``None`` when not cheaply known). ``open`` must be safe to call from several threads at once, each call
    returning an independent iterator. Datasets are context managers that :meth:`close` on exit.
    """

    def __init__(self, name: str) -> None:
        self.name = _check_name(name)
        self._closed = False

    @property
    @abc.abstractmethod
    def schema(self) -> pa.Schema:
        """The schema of every batch :meth:`open` yields (known without reading the data)."""

    @abc.abstractmethod
    def open(self) -> Iterator[pa.RecordBatch]:
        """A fresh iterator over the batches, reading lazily: one batch is produced per ``next()``.

        The built-in datasets return generators: ``close()`` one to abandon a request early and release what
        it holds (a reader, a scan) at once.
        """

    @property
    def num_rows(self) -> int | None:
        """Total number of rows, when known cheaply; otherwise ``None``."""
        return None

    @property
    def nbytes(self) -> int | None:
        """Approximate size of the data in bytes, when known cheaply; otherwise ``None``."""
        return None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def close(self) -> None:
        """Release what the dataset holds (mappings, readers). Iterators already handed out keep working."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise DatasetError(f"dataset {self.name!r} is closed")

    def _conform(self, batch: Any) -> pa.RecordBatch:
        """``batch`` with exactly this dataset's schema (metadata included), or a DatasetError."""
        if not isinstance(batch, pa.RecordBatch):
            raise DatasetError(
                f"dataset {self.name!r}: expected a pyarrow.RecordBatch, got {type(batch).__name__}"
            )
        schema = self.schema
        if batch.schema.equals(schema, check_metadata=True):
            return batch
        if batch.schema.equals(schema, check_metadata=False):
            return pa.RecordBatch.from_arrays(batch.columns, schema=schema)
        raise DatasetError(
            f"dataset {self.name!r}: a batch's schema ({_brief(batch.schema)}) differs from the dataset's "
            f"({_brief(schema)})"
        )

    def __enter__(self) -> Dataset:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, schema=<{_brief(self.schema)}>)"


def _brief(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise DatasetError(f"a dataset name must be a str, got {type(name).__name__}")
    if not name:
        raise DatasetError("a dataset name must not be empty")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise DatasetError(f"dataset name {name!r} cannot be encoded as UTF-8") from None
    return name


# -------------------------------------------------------------------------------------------------- in memory


class TableDataset(Dataset):
    """An in-memory ``pa.Table`` (or ``pa.RecordBatch``), served as zero-copy batches.

    ``max_chunksize`` caps the rows per batch (slices of the table's chunks, still zero-copy).
    """

    def __init__(self, name: str, table: pa.Table | pa.RecordBatch, max_chunksize: int | None = None) -> None:
        super().__init__(name)
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if not isinstance(table, pa.Table):
            raise DatasetError(
                f"dataset {name!r}: expected a pyarrow.Table or RecordBatch, got {type(table).__name__}"
            )
        if max_chunksize is not None and max_chunksize <= 0:
            raise DatasetError(f"dataset {name!r}: max_chunksize must be positive, got {max_chunksize}")
        self.table: pa.Table = table
        self.max_chunksize = max_chunksize

    @property
    def schema(self) -> pa.Schema:
        return self.table.schema

    @property
    def num_rows(self) -> int:
        return int(self.table.num_rows)

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    def open(self) -> Iterator[pa.RecordBatch]:
        self._check_open()
        # to_batches only slices the table's chunks: zero-copy, and cheap to list up front.
        return self._iterate(self.table.to_batches(self.max_chunksize))

    def _iterate(self, batches: list[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from batches


class DeviceDataset(Dataset):
    """Batches in device memory (:class:`dissoc.device.DeviceBatch`, one schema), served from where they lie.

    Servers send their bodies from device memory (over UCX's CUDA transports; through the host on transports
    without them) or place them in a ``memory=cuda`` arena device-to-device. Consumers that need host batches
    (:meth:`open`, e.g. Flight's DoGet) get copies.
    """

    def __init__(self, name: str, batches: Any, schema: pa.Schema | None = None) -> None:
        super().__init__(name)
        from dissoc.device import DeviceBatch

        items = [batches] if isinstance(batches, DeviceBatch) else list(batches)
        for b in items:
            if not isinstance(b, DeviceBatch):
                raise DatasetError(f"dataset {name!r}: expected DeviceBatch objects, got {type(b).__name__}")
        if schema is None:
            if not items:
                raise DatasetError(f"dataset {name!r}: no device batches and no schema")
            schema = items[0].schema
        for i, b in enumerate(items):
            if not b.schema.equals(schema, check_metadata=False):
                raise DatasetError(
                    f"dataset {name!r}: batch {i} has schema {_brief(b.schema)}, not {_brief(schema)}"
                )
        self._schema = schema
        self.batches: list[Any] = items

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def num_rows(self) -> int:
        return sum(int(b.num_rows) for b in self.batches)

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.batches)

    def open(self) -> Iterator[pa.RecordBatch]:
        self._check_open()
        return (b.to_arrow() for b in self.batches)


class ReaderFactoryDataset(Dataset):
    """Calls ``factory()`` once per request; it returns a ``pa.RecordBatchReader`` or an iterable of batches.

    The schema is ``schema`` when given; otherwise it is taken from the first reader's ``.schema`` (without
    reading any batch), and that reader is kept for the first :meth:`open`. A factory returning a plain
    iterable (a generator, a list) needs ``schema``. Batches whose schema differs from it raise DatasetError.
    """

    def __init__(self, name: str, factory: ReaderFactory, schema: pa.Schema | None = None) -> None:
        super().__init__(name)
        if not callable(factory):
            raise DatasetError(
                f"dataset {name!r}: the factory must be callable, not {type(factory).__name__}"
            )
        self.factory = factory
        self._lock = threading.Lock()
        self._pending: Any = None
        if schema is not None:
            if not isinstance(schema, pa.Schema):
                raise DatasetError(f"dataset {name!r}: schema must be a pyarrow.Schema")
            self._schema = schema
            return
        first = self._call()
        found = getattr(first, "schema", None)
        if not isinstance(found, pa.Schema):
            _close_quietly(first)
            raise DatasetError(
                f"dataset {name!r}: the factory returned a {type(first).__name__}, which has no schema; "
                "pass schema= (or return a pyarrow.RecordBatchReader)"
            )
        self._schema = found
        self._pending = first

    def _call(self) -> Any:
        try:
            result = self.factory()
        except DissocError:
            raise
        except Exception as e:
            raise DatasetError(f"dataset {self.name!r}: the reader factory failed: {e}") from e
        if isinstance(result, (pa.Table, pa.RecordBatch)) or hasattr(result, "__iter__"):
            return result
        raise DatasetError(
            f"dataset {self.name!r}: the factory returned a {type(result).__name__}; expected a "
            "pyarrow.RecordBatchReader or an iterable of pyarrow.RecordBatch"
        )

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    def open(self) -> Iterator[pa.RecordBatch]:
        self._check_open()
        with self._lock:
            source, self._pending = self._pending, None
        if source is None:
            source = self._call()
        log.debug("dataset %r: opened a %s", self.name, type(source).__name__)
        return self._iterate(source)

    def _iterate(self, source: Any) -> Iterator[pa.RecordBatch]:
        try:
            if isinstance(source, pa.Table):
                items: Iterable[Any] = source.to_batches()
            elif isinstance(source, pa.RecordBatch):
                items = [source]
            else:
                items = source
            for batch in items:
                yield self._conform(batch)
        finally:
            _close_quietly(source)

    def close(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        _close_quietly(pending)
        super().close()


def _close_quietly(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # closing a reader we are done with must not mask the real outcome
            log.debug("closing %s failed", type(obj).__name__, exc_info=True)


# ------------------------------------------------------------------------------------------------------ files


def _map_file(path: Path) -> tuple[pa.MemoryMappedFile, pa.Buffer]:
    try:
        mm = pa.memory_map(str(path), "r")
    except (OSError, pa.ArrowException) as e:
        raise CodecError(f"cannot memory-map {str(path)!r}: {e}") from None
    try:
        buf = mm.read_buffer()
    except (OSError, pa.ArrowException) as e:
        mm.close()
        raise CodecError(f"cannot read {str(path)!r}: {e}") from None
    return mm, buf


class IpcFileDataset(Dataset):
    """An Arrow IPC file, memory-mapped once and read with random access by :func:`dissoc.codec.open_file`.

    Every batch is a zero-copy view of the mapping (:attr:`buffer`). Each :meth:`open` gets its own reader
    (dictionaries are per reader) over the shared, read-only mapping; batches are decoded one per ``next()``.
    """

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        self.path = Path(path)
        super().__init__(self.path.stem if name is None else name)
        self._map, buffer = _map_file(self.path)
        try:
            reader = codec.open_file(buffer)
        except BaseException:
            self._map.close()
            raise
        self._buffer: pa.Buffer | None = buffer
        self._size = int(buffer.size)
        self._schema = reader.schema
        self._num_batches = reader.num_record_batches

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def buffer(self) -> pa.Buffer:
        """The whole file as one zero-copy ``pa.Buffer`` over the memory map (DatasetError once closed)."""
        if self._buffer is None:
            raise DatasetError(f"dataset {self.name!r} is closed")
        return self._buffer

    @property
    def num_batches(self) -> int:
        """The number of record batches in the file (from its footer)."""
        return self._num_batches

    @property
    def nbytes(self) -> int:
        """The file's size (message bodies plus a little framing)."""
        return self._size

    def open(self) -> Iterator[pa.RecordBatch]:
        reader = codec.open_file(self.buffer)
        return self._iterate(reader)

    def _iterate(self, reader: codec.FileReader) -> Iterator[pa.RecordBatch]:
        for i in range(reader.num_record_batches):
            yield self._conform(reader.get_batch(i))

    def close(self) -> None:
        # Arrow unmaps only when the last slice of the mapping is released: batches handed out stay valid.
        self._buffer = None
        self._map.close()
        super().close()

    def __repr__(self) -> str:
        return f"IpcFileDataset({str(self.path)!r}, name={self.name!r})"


class IpcStreamDataset(Dataset):
    """An Arrow IPC stream file, read by :func:`dissoc.codec.open_stream` over the path for each request.

    The schema is read from the stream's first message when the dataset is built.
    """

    def __init__(self, path: str | os.PathLike[str], name: str | None = None) -> None:
        self.path = Path(path)
        super().__init__(self.path.stem if name is None else name)
        self._schema = codec.open_stream(self.path).schema
        try:
            self._size: int | None = self.path.stat().st_size
        except OSError:
            self._size = None

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def nbytes(self) -> int | None:
        """The file's size (message bodies plus a little framing)."""
        return self._size

    def open(self) -> Iterator[pa.RecordBatch]:
        self._check_open()
        reader = codec.open_stream(self.path)
        return self._iterate(reader)

    def _iterate(self, reader: codec.StreamReader) -> Iterator[pa.RecordBatch]:
        with reader:
            for batch in reader:
                yield self._conform(batch)

    def __repr__(self) -> str:
        return f"IpcStreamDataset({str(self.path)!r}, name={self.name!r})"


class ParquetDataset(Dataset):
    """A Parquet file, or a directory of Parquet files, read lazily through ``pyarrow.dataset``.

    Batches of at most ``batch_size`` rows are produced by ``to_batches``; ``batch_readahead`` and
    ``fragment_readahead`` bound how far the scanner reads ahead (kept small so memory stays bounded).
    ``columns`` selects a subset of columns. ``num_rows`` and ``nbytes`` (uncompressed) come from the Parquet
    footers, read on first use.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        *,
        batch_size: int = DEFAULT_PARQUET_BATCH_SIZE,
        columns: list[str] | None = None,
        batch_readahead: int = 2,
        fragment_readahead: int = 1,
        use_threads: bool = True,
    ) -> None:
        import pyarrow.dataset as pads

        self.path = Path(path)
        super().__init__(self.path.stem if name is None else name)
        if batch_size <= 0:
            raise DatasetError(f"dataset {self.name!r}: batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self.batch_readahead = batch_readahead
        self.fragment_readahead = fragment_readahead
        self.use_threads = use_threads
        self.columns = columns
        try:
            self._dataset = pads.dataset(str(self.path), format="parquet")
        except (OSError, pa.ArrowException) as e:
            raise CodecError(f"cannot open Parquet {str(self.path)!r}: {e}") from None
        if not self._dataset.files:
            raise DatasetError(f"dataset {self.name!r}: no Parquet files under {str(self.path)!r}")
        schema = self._dataset.schema
        if columns is not None:
            missing = [c for c in columns if schema.get_field_index(c) < 0]
            if missing:
                raise DatasetError(f"dataset {self.name!r}: no such columns {missing} in {str(self.path)!r}")
            schema = pa.schema([schema.field(c) for c in columns], metadata=schema.metadata)
        self._schema = schema
        self._lock = threading.Lock()
        self._stats: tuple[int, int] | None = None

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def files(self) -> list[str]:
        """The Parquet files read, in order."""
        return list(self._dataset.files)

    def _footer_stats(self) -> tuple[int, int] | None:
        with self._lock:
            if self._stats is None:
                rows = size = 0
                try:
                    for fragment in self._dataset.get_fragments():
                        md = fragment.metadata
                        rows += md.num_rows
                        size += sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
                except (OSError, pa.ArrowException):
                    log.debug("dataset %r: reading Parquet footers failed", self.name, exc_info=True)
                    return None
                self._stats = (rows, size)
            return self._stats

    @property
    def num_rows(self) -> int | None:
        stats = self._footer_stats()
        return None if stats is None else stats[0]

    @property
    def nbytes(self) -> int | None:
        """Uncompressed size of the selected row groups (all columns), from the footers."""
        stats = self._footer_stats()
        return None if stats is None else stats[1]

    def open(self) -> Iterator[pa.RecordBatch]:
        self._check_open()
        try:
            batches = self._dataset.to_batches(
                columns=self.columns,
                batch_size=self.batch_size,
                batch_readahead=self.batch_readahead,
                fragment_readahead=self.fragment_readahead,
                use_threads=self.use_threads,
            )
        except (OSError, pa.ArrowException) as e:
            raise CodecError(f"cannot read Parquet {str(self.path)!r}: {e}") from None
        return self._iterate(batches)

    def _iterate(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        try:
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                except (OSError, pa.ArrowException) as e:
                    raise CodecError(f"reading Parquet {str(self.path)!r} failed: {e}") from None
                if batch.num_rows:
                    yield self._conform(batch)
        finally:
            _close_quietly(batches)  # stops the scan when a request is abandoned

    def __repr__(self) -> str:
        return f"ParquetDataset({str(self.path)!r}, name={self.name!r}, batch_size={self.batch_size})"


# -------------------------------------------------------------------------------------------------- synthetic

DEFAULT_GENERATED_SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.float64()), ("label", pa.string())])
_MAX_STRING_LEN = 15  # generated strings have 0..15 letters (7.5 on average)


class GeneratedDataset(Dataset):
    """Deterministic synthetic data: ``batches`` batches of ``rows_per_batch`` rows, made one at a time.

    Batch ``i`` depends only on ``(seed, i)``: the same seed gives equal batches, in any order (see
    :meth:`batch`). Supported field types: integers, floats, booleans, temporal types (timestamp, date, time,
    duration), (large) strings and (large) binaries (0 to 15 letters ``a``-``p``); no nulls are generated.
    Integer fields named ``id`` hold the global row number (``i * rows_per_batch + row``), so a receiver can
    check order; other integer fields are uniformly random. The default schema is
    ``id: int64, value: float64, label: string``.
    """

    def __init__(
        self,
        name: str,
        schema: pa.Schema | None = None,
        batches: int = 16,
        rows_per_batch: int = 1 << 16,
        seed: int = 0,
    ) -> None:
        super().__init__(name)
        schema = DEFAULT_GENERATED_SCHEMA if schema is None else schema
        if not isinstance(schema, pa.Schema):
            raise DatasetError(f"dataset {name!r}: schema must be a pyarrow.Schema")
        if batches < 0 or rows_per_batch < 0:
            raise DatasetError(
                f"dataset {name!r}: batches and rows_per_batch must be >= 0 "
                f"(got {batches} and {rows_per_batch})"
            )
        for field in schema:
            if _column_kind(field.type) is None:
                raise DatasetError(
                    f"dataset {name!r}: cannot generate field {field.name!r} of type {field.type}; "
                    "supported: integer, floating point, boolean, temporal, string and binary types"
                )
            if (
                _column_kind(field.type) == "bytes"
                and not _is_large(field.type)
                and rows_per_batch * _MAX_STRING_LEN >= 1 << 31
            ):
                raise DatasetError(
                    f"dataset {name!r}: {rows_per_batch} rows per batch overflow the 32-bit offsets of field "
                    f"{field.name!r} ({field.type}); use large_{field.type} or fewer rows"
                )
        self._schema = schema
        self.batches = batches
        self.rows_per_batch = rows_per_batch
        self.seed = seed

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def num_rows(self) -> int:
        return self.batches * self.rows_per_batch

    @property
    def nbytes(self) -> int:
        """Expected size: exact for fixed-width columns, average string lengths for the others."""
        per_row = 0.0
        for field in self._schema:
            t = field.type
            if pa.types.is_boolean(t):
                per_row += 1 / 8
            elif _column_kind(t) == "bytes":
                per_row += (8 if _is_large(t) else 4) + _MAX_STRING_LEN / 2
            else:
                per_row += t.bit_width // 8
        return int(per_row * self.num_rows)

    def batch(self, i: int) -> pa.RecordBatch:
        """Batch ``i`` (0 <= i < batches), computed from ``(seed, i)`` alone."""
        if not 0 <= i < self.batches:
            raise IndexError(f"batch index {i} out of range for {self.batches} batches")
        n = self.rows_per_batch
        rng = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, i])
        columns = [_generate(field, rng, n, i * n) for field in self._schema]
        return pa.RecordBatch.from_arrays(columns, schema=self._schema)

    def open(self) -> Iterator[pa.RecordBatch]:
        self._check_open()
        return self._iterate()

    def _iterate(self) -> Iterator[pa.RecordBatch]:
        for i in range(self.batches):
            yield self.batch(i)

    def __repr__(self) -> str:
        return (
            f"GeneratedDataset(name={self.name!r}, batches={self.batches}, "
            f"rows_per_batch={self.rows_per_batch}, seed={self.seed})"
        )


def _is_large(t: pa.DataType) -> bool:
    return bool(pa.types.is_large_string(t) or pa.types.is_large_binary(t))


def _column_kind(t: pa.DataType) -> str | None:
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_temporal(t) and not pa.types.is_interval(t):
        return "temporal"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or _is_large(t):
        return "bytes"
    return None


def _generate(field: pa.Field, rng: np.random.Generator, n: int, first_row: int) -> pa.Array:
    """A column of ``n`` values for ``field``; ``first_row`` is the global number of its first row."""
    t = field.type
    kind = _column_kind(t)
    data: np.ndarray[Any, Any]
    if kind == "bool":
        return pa.array(rng.integers(0, 2, n, dtype=np.uint8).astype(np.bool_), type=t)
    if kind == "float":
        data = rng.random(n)
        if t.bit_width != 64:
            data = data.astype(np.float32 if t.bit_width == 32 else np.float16)
        return pa.Array.from_buffers(t, n, [None, pa.py_buffer(data)])
    if kind == "int" or kind == "temporal":
        signed = kind == "temporal" or pa.types.is_signed_integer(t)
        dtype: np.dtype[Any] = np.dtype(f"<{'i' if signed else 'u'}{t.bit_width // 8}")
        if kind == "int" and field.name == "id":
            data = np.arange(first_row, first_row + n, dtype=np.uint64).astype(dtype)
        elif kind == "temporal":
            # plausible values (dates and timestamps within 50 years of the epoch, times within a day)
            # date64 holds whole days in milliseconds; nanoseconds stay whole microseconds so that
            # to_pylist() works without pandas.
            scale = 86_400_000 if pa.types.is_date64(t) else 1_000 if getattr(t, "unit", "") == "ns" else 1
            data = rng.integers(0, _temporal_span(t) // (1 if scale == 86_400_000 else scale), n, dtype=dtype)
            if scale != 1:
                data *= scale
        else:
            info = np.iinfo(dtype)
            data = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        return pa.Array.from_buffers(t, n, [None, pa.py_buffer(data)])
    # variable-length strings or binaries of 0..15 letters a-p: a nibble of random bits per length and per
    # character keeps this several times faster than drawing bounded integers.
    lengths = _random_bytes(rng, n) & np.uint8(_MAX_STRING_LEN)
    offsets = np.zeros(n + 1, dtype=np.int64 if _is_large(t) else np.int32)
    np.cumsum(lengths, out=offsets[1:])
    chars = _random_bytes(rng, int(offsets[-1]))
    chars &= np.uint8(15)
    chars += np.uint8(ord("a"))
    return pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets), pa.py_buffer(chars)])


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``n`` random bytes (drawn as 64-bit integers, the generator's fastest path)."""
    words = rng.integers(0, np.iinfo(np.int64).max, (n + 7) // 8, dtype=np.int64, endpoint=True)
    return words.view(np.uint8)[:n]


def _temporal_span(t: pa.DataType) -> int:
    """The exclusive upper bound of generated values of temporal type ``t``."""
    days = 50 * 365
    if pa.types.is_date32(t) or pa.types.is_date64(t):
        return days
    ticks: int = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[t.unit]
    if pa.types.is_timestamp(t):
        return days * 86_400 * ticks
    return 86_400 * ticks  # time of day, duration


# --------------------------------------------------------------------------------------------------- dispatch


class _Renamed(Dataset):
    """Another dataset served under a different name (the inner one keeps its own)."""

    def __init__(self, name: str, inner: Dataset) -> None:
        super().__init__(name)
        self.inner = inner

    @property
    def schema(self) -> pa.Schema:
        return self.inner.schema

    @property
    def num_rows(self) -> int | None:
        return self.inner.num_rows

    @property
    def nbytes(self) -> int | None:
        return self.inner.nbytes

    def open(self) -> Iterator[pa.RecordBatch]:
        self._check_open()
        return self.inner.open()

    def close(self) -> None:
        self.inner.close()
        super().close()

    def __repr__(self) -> str:
        return f"{self.name!r} -> {self.inner!r}"


def _sniff(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(8)
    except OSError as e:
        raise DatasetError(f"cannot read {str(path)!r}: {e.strerror}") from None


def _dataset_from_path(path: Path, name: str | None) -> Dataset:
    if path.is_dir():
        return ParquetDataset(path, name)
    if not path.exists():
        raise DatasetError(f"no such file or directory: {str(path)!r}")
    if not path.is_file():
        raise DatasetError(f"{str(path)!r} is not a regular file or a directory")
    head = _sniff(path)
    suffix = path.suffix.lower()
    if head.startswith(IPC_FILE_MAGIC):
        return IpcFileDataset(path, name)
    if head.startswith(PARQUET_MAGIC):
        return ParquetDataset(path, name)
    if head.startswith(FEATHER_V1_MAGIC):
        raise DatasetError(f"{str(path)!r} is a Feather version 1 file; only Arrow IPC (Feather 2) is served")
    if suffix in IPC_STREAM_SUFFIXES or suffix in IPC_FILE_SUFFIXES or head.startswith(_CONTINUATION):
        # No file magic: an IPC stream, whatever the extension says (the codec reports a malformed one).
        return IpcStreamDataset(path, name)
    if suffix in PARQUET_SUFFIXES:
        raise CodecError(f"{str(path)!r}: expected Parquet magic {PARQUET_MAGIC!r}, found {head[:4]!r}")
    raise DatasetError(
        f"cannot tell what {str(path)!r} holds: expected an Arrow IPC file (magic {IPC_FILE_MAGIC!r}), an "
        f"IPC stream ({', '.join(sorted(IPC_STREAM_SUFFIXES))}), a Parquet file "
        f"({', '.join(sorted(PARQUET_SUFFIXES))}) or a directory of Parquet files"
    )


def _is_device_batches(obj: object) -> bool:
    from dissoc.device import DeviceBatch

    if isinstance(obj, DeviceBatch):
        return True
    return isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(b, DeviceBatch) for b in obj)


def dataset_from(obj: object, name: str | None = None) -> Dataset:
    """Build the :class:`Dataset` that serves ``obj``.

    ``obj`` may be a Dataset (returned as is, or renamed when ``name`` differs), a ``pa.Table`` or
    ``pa.RecordBatch`` (``name`` required), a :class:`~dissoc.device.DeviceBatch` or a list of them (``name``
    required; served from device memory), a callable reader factory (``name`` defaults to its ``__name__``),
    or a path: an Arrow IPC file (recognised by its ``ARROW1`` magic whatever the extension), an IPC
    stream (``.arrows``, ``.stream``, or an ``.arrow``/``.feather``/``.ipc`` file without the file magic), a
    Parquet file (``.parquet``, ``.parq``, or ``PAR1`` magic) or a directory of Parquet files; ``name``
    defaults to the file's stem. Anything else raises :class:`DatasetError`.
    """
    if isinstance(obj, Dataset):
        if name is None or name == obj.name:
            return obj
        return _Renamed(name, obj)
    if isinstance(obj, (pa.Table, pa.RecordBatch)):
        if name is None:
            raise DatasetError(f"a name is required to serve a pyarrow.{type(obj).__name__}")
        return TableDataset(name, obj)
    if _is_device_batches(obj):
        if name is None:
            raise DatasetError("a name is required to serve device batches")
        return DeviceDataset(name, obj)
    if isinstance(obj, pa.RecordBatchReader):
        raise DatasetError(
            "a pyarrow.RecordBatchReader can be read only once; serve a callable that returns a fresh reader"
        )
    if isinstance(obj, (str, os.PathLike)):
        return _dataset_from_path(Path(obj), name)
    if callable(obj):
        if name is None:
            name = getattr(obj, "__name__", None)
            if not isinstance(name, str) or name == "<lambda>":
                raise DatasetError("a name is required to serve an anonymous reader factory")
        return ReaderFactoryDataset(name, obj)
    raise DatasetError(
        f"cannot serve a {type(obj).__name__}: expected a Dataset, pyarrow.Table, pyarrow.RecordBatch, a "
        "callable returning a pyarrow.RecordBatchReader, or a path to an Arrow IPC or Parquet file or "
        "directory"
    )


# ---------------------------------------------------------------------------------------------------- catalog


def _ticket_name(ticket: object) -> str:
    if isinstance(ticket, str):
        return ticket
    if isinstance(ticket, (bytes, bytearray, memoryview)):
        raw = bytes(ticket)
        try:
            return raw.decode("utf-8", errors="strict")
        except UnicodeDecodeError as e:
            raise UnknownTicket(
                raw, f"ticket {raw[:64]!r} is not valid UTF-8 (byte {e.start}: {e.reason})"
            ) from None
    raise UnknownTicket(repr(ticket), f"a ticket must be bytes or str, got {type(ticket).__name__}")


class Catalog:
    """A thread-safe registry of the datasets a server serves, by name (the ticket, UTF-8 on the wire)."""

    def __init__(self, datasets: dict[str, object] | None = None) -> None:
        self._lock = threading.RLock()
        self._datasets: dict[str, Dataset] = {}
        for name, obj in (datasets or {}).items():
            self.add(name, obj)

    def add(self, name: str | None, obj: object, *, replace: bool = False) -> Dataset:
        """Serve ``obj`` (anything :func:`dataset_from` takes) under ``name`` and return its Dataset.

        ``name=None`` uses the dataset's own name (a path's stem). A name already served raises DatasetError
        unless ``replace`` is true (the replaced dataset is not closed: requests may still be reading it).
        """
        dataset = dataset_from(obj, name)
        key = dataset.name
        with self._lock:
            if key in self._datasets and not replace:
                raise DatasetError(f"a dataset named {key!r} is already served")
            self._datasets[key] = dataset
        log.info("serving %r: %s", key, dataset)
        return dataset

    def remove(self, name: str | bytes) -> Dataset:
        """Stop serving ``name`` and return its dataset (not closed: requests may still be reading it)."""
        key = _ticket_name(name)
        with self._lock:
            try:
                dataset = self._datasets.pop(key)
            except KeyError:
                raise UnknownTicket(name, f"unknown ticket {key!r}: no such dataset") from None
        log.info("no longer serving %r", key)
        return dataset

    def get(self, ticket: str | bytes) -> Dataset:
        """The dataset served under ``ticket`` (bytes are decoded as strict UTF-8), or UnknownTicket."""
        key = _ticket_name(ticket)
        with self._lock:
            dataset = self._datasets.get(key)
            if dataset is None:
                served = sorted(self._datasets)
                shown = ", ".join(repr(n) for n in served[:10]) + (", ..." if len(served) > 10 else "")
                raise UnknownTicket(
                    ticket, f"unknown ticket {key!r}: no such dataset (serving {shown or 'nothing'})"
                )
            return dataset

    __getitem__ = get

    def names(self) -> list[str]:
        """The names served, in the order they were added."""
        with self._lock:
            return list(self._datasets)

    def describe(self, name: str | bytes) -> dict[str, Any]:
        """``{"name", "schema", "num_rows", "nbytes"}`` for ``name``; the hints are None when unknown."""
        dataset = self.get(name)
        return {
            "name": _ticket_name(name),
            "schema": dataset.schema,
            "num_rows": dataset.num_rows,
            "nbytes": dataset.nbytes,
        }

    def close(self) -> None:
        """Close and forget every dataset."""
        with self._lock:
            datasets, self._datasets = list(self._datasets.values()), {}
        for dataset in datasets:
            dataset.close()

    def __contains__(self, name: object) -> bool:
        try:
            key = _ticket_name(name)
        except UnknownTicket:
            return False
        with self._lock:
            return key in self._datasets

    def __len__(self) -> int:
        with self._lock:
            return len(self._datasets)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __enter__(self) -> Catalog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Catalog({self.names()!r})"
