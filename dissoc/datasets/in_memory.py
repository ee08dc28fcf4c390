"""Datasets held in memory: a ``pa.Table`` (or anything exporting Arrow PyCapsules, read into one), device
batches, a reader factory."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from dissoc.datasets.base import (
    Dataset,
    DatasetError,
    ReaderFactory,
    _brief,
    close_quietly,
)
from dissoc.errors import DissocError

log = logging.getLogger(__name__)

# -------------------------------------------------------------------------------------------------- in memory


def stream_of(obj: Any, what: str) -> pa.RecordBatchReader:
    """A ``pa.RecordBatchReader`` over an Arrow PyCapsule stream producer (``__arrow_c_stream__``)."""
    try:
        return pa.RecordBatchReader.from_stream(obj)
    except Exception as e:
        raise DatasetError(
            f"{what}: exporting the {type(obj).__name__} as an Arrow stream failed: {e}"
        ) from e


def table_of(obj: Any, what: str) -> pa.Table:
    """All of an Arrow PyCapsule producer (``__arrow_c_stream__``, or ``__arrow_c_array__`` of a struct
    array) read into a ``pa.Table``."""
    try:
        if hasattr(obj, "__arrow_c_stream__"):
            return stream_of(obj, what).read_all()
        return pa.Table.from_batches([pa.record_batch(obj)])
    except DatasetError:
        raise
    except Exception as e:
        raise DatasetError(f"{what}: reading the {type(obj).__name__} as Arrow data failed: {e}") from e


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
            close_quietly(first)
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
        if isinstance(result, (pa.Table, pa.RecordBatch, pa.RecordBatchReader)):
            return result
        if hasattr(result, "__arrow_c_stream__"):
            # Before __iter__: a polars or pandas DataFrame iterates over its columns.
            return stream_of(result, f"dataset {self.name!r}")
        if hasattr(result, "__iter__"):
            return result
        raise DatasetError(
            f"dataset {self.name!r}: the factory returned a {type(result).__name__}; expected a "
            "pyarrow.RecordBatchReader, an object with __arrow_c_stream__ (a polars or pandas DataFrame, a "
            "DuckDB relation...) or an iterable of pyarrow.RecordBatch"
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
            close_quietly(source)

    def close(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        close_quietly(pending)
        super().close()
