"""Which dataset a ticket names: :func:`dataset_from` builds one from a table, a callable or a path, and
:class:`Catalog` is the thread-safe registry of a server's datasets."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa

from dissoc.datasets.base import (
    _CONTINUATION,
    FEATHER_V1_MAGIC,
    IPC_FILE_MAGIC,
    IPC_FILE_SUFFIXES,
    IPC_STREAM_SUFFIXES,
    PARQUET_MAGIC,
    PARQUET_SUFFIXES,
    Dataset,
    DatasetError,
    UnknownTicket,
)
from dissoc.datasets.files import IpcFileDataset, IpcStreamDataset, ParquetDataset
from dissoc.datasets.in_memory import DeviceDataset, ReaderFactoryDataset, TableDataset, table_of
from dissoc.datasets.live import LiveDataset
from dissoc.datasets.tabular import (
    COMPRESSION_SUFFIXES,
    TABULAR_SUFFIXES,
    FileSystemDataset,
    directory_dataset,
    file_format,
)
from dissoc.errors import CodecError
from dissoc.tokens import split_start

log = logging.getLogger(__name__)

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
        return directory_dataset(path, name)
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
    if file_format(path) in ("csv", "tsv", "json"):
        return FileSystemDataset(path, name)
    raise DatasetError(
        f"cannot tell what {str(path)!r} holds: expected an Arrow IPC file (magic {IPC_FILE_MAGIC!r}), an "
        f"IPC stream ({', '.join(sorted(IPC_STREAM_SUFFIXES))}), a Parquet file "
        f"({', '.join(sorted(PARQUET_SUFFIXES))}), a CSV, TSV or newline-delimited JSON file "
        f"({', '.join(sorted(TABULAR_SUFFIXES))}, each possibly compressed: "
        f"{', '.join(sorted(COMPRESSION_SUFFIXES))}) or a directory of such files"
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
    required; served from device memory), any object exporting the Arrow PyCapsule interface
    (``__arrow_c_stream__`` or ``__arrow_c_array__``: a polars or pandas DataFrame, a DuckDB relation, a
    ``pa.RecordBatchReader``...; ``name`` required; read into memory once, here), a callable reader factory
    returning a reader, a table or such an object (read anew per request; ``name`` defaults to its
    ``__name__``),
    or a path: an Arrow IPC file (recognised by its ``ARROW1`` magic whatever the extension), an IPC
    stream (``.arrows``, ``.stream``, or an ``.arrow``/``.feather``/``.ipc`` file without the file magic), a
    Parquet file (``.parquet``, ``.parq``, or ``PAR1`` magic), a CSV, TSV or newline-delimited JSON file, or a
    directory of Parquet, CSV, TSV, JSON or Arrow IPC files (hive partitions become columns); ``name``
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
    if isinstance(obj, (str, os.PathLike)):
        return _dataset_from_path(Path(obj), name)
    if hasattr(obj, "__arrow_c_stream__") or hasattr(obj, "__arrow_c_array__"):
        # A polars or pandas DataFrame, a DuckDB relation, a pyarrow or dissoc reader...: read once, now.
        if name is None:
            raise DatasetError(f"a name is required to serve a {type(obj).__name__}")
        table = table_of(obj, f"dataset {name!r}")
        log.info(
            "dataset %r: read %d rows (%d bytes) from a %s",
            name,
            table.num_rows,
            table.nbytes,
            type(obj).__name__,
        )
        return TableDataset(name, table)
    if callable(obj):
        if name is None:
            name = getattr(obj, "__name__", None)
            if not isinstance(name, str) or name == "<lambda>":
                raise DatasetError("a name is required to serve an anonymous reader factory")
        return ReaderFactoryDataset(name, obj)
    raise DatasetError(
        f"cannot serve a {type(obj).__name__}: expected a Dataset, pyarrow.Table, pyarrow.RecordBatch, an "
        "object with __arrow_c_stream__ (a DataFrame, a reader...), a callable returning one or a "
        "pyarrow.RecordBatchReader, or a path to an Arrow IPC, Parquet, CSV or JSON file or a directory"
    )


# ---------------------------------------------------------------------------------------------------- catalog


#: Most bytes of a ticket quoted in an error message (a client controls the ticket, and errors go back to it).
_QUOTED_TICKET_BYTES = 64


def quote_ticket(ticket: str | bytes) -> str:
    """A short, escaped quote of ``ticket`` for error messages: at most its first 64 bytes, then how long it
    was."""
    raw = ticket.encode("utf-8", "surrogatepass") if isinstance(ticket, str) else bytes(ticket)
    if len(raw) <= _QUOTED_TICKET_BYTES:
        return repr(ticket) if isinstance(ticket, str) else repr(raw)
    head = raw[:_QUOTED_TICKET_BYTES]
    shown = repr(head.decode("utf-8", "ignore")) if isinstance(ticket, str) else repr(head)
    return f"{shown}... ({len(raw)} bytes)"


def _ticket_name(ticket: object) -> str:
    if isinstance(ticket, str):
        return ticket
    if isinstance(ticket, (bytes, bytearray, memoryview)):
        raw = bytes(ticket)
        try:
            return raw.decode("utf-8", errors="strict")
        except UnicodeDecodeError as e:
            raise UnknownTicket(
                raw, f"ticket {quote_ticket(raw)} is not valid UTF-8 (byte {e.start}: {e.reason})"
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
                raise UnknownTicket(name, f"unknown ticket {quote_ticket(key)}: no such dataset") from None
        log.info("no longer serving %r", key)
        return dataset

    def get(self, ticket: str | bytes) -> Dataset:
        """The dataset served under ``ticket`` (bytes are decoded as strict UTF-8), or UnknownTicket (whose
        message quotes a short prefix of the ticket and never names the datasets served: it goes back to
        whoever asked)."""
        key = _ticket_name(ticket)
        with self._lock:
            dataset = self._datasets.get(key)
            base, start = split_start(key)
            if dataset is None and start is not None:
                # NAME@START: a live stream read from START
                stream = self._datasets.get(base)
                if isinstance(stream, LiveDataset):
                    return stream.view(start)
        if dataset is None:
            raise UnknownTicket(ticket, f"unknown ticket {quote_ticket(key)}: no such dataset")
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
