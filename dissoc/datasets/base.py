"""The dataset interface: a named, typed source of record batches that is opened afresh per request."""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeAlias

import pyarrow as pa

from dissoc.errors import DissocError

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
    def parts(self) -> Sequence[Dataset]:
        """Datasets of their own that this one is also served as, in order, each named ``NAME/...`` (a
        directory's files, with ``FileSystemDataset(per_file=True)``): a server serves each under its name
        too, and a Flight control plane lists them as this dataset's endpoints. None by default (a dataset
        served under another name than its own has none: its parts' names would not lie under it)."""
        return ()

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


def close_quietly(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # closing a reader we are done with must not mask the real outcome
            log.debug("closing %s failed", type(obj).__name__, exc_info=True)
