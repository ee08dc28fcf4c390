"""What a dissoc server serves: named datasets, each opened afresh, and lazily, per request.

A :class:`Dataset` knows its name and schema up front and, on :meth:`Dataset.open`, hands out a new
iterator of ``pa.RecordBatch`` that reads batch by batch, so a 10 GiB file never has to sit in memory.

- :mod:`~dissoc.datasets.base`: the interface and its errors;
- :mod:`~dissoc.datasets.in_memory`: a ``pa.Table``, device batches, a reader factory;
- :mod:`~dissoc.datasets.files`: Arrow IPC files (memory-mapped, zero-copy) and streams, Parquet;
- :mod:`~dissoc.datasets.tabular`: CSV and newline-delimited JSON files, and directories of Parquet, CSV,
  JSON or IPC files with hive partitions, read through ``pyarrow.dataset``;
- :mod:`~dissoc.datasets.generated`: deterministic synthetic data;
- :mod:`~dissoc.datasets.live`: live streams, appended to while clients read them (offsets, retention);
- :mod:`~dissoc.datasets.catalog`: :func:`dataset_from` (the right dataset for a table, a callable or a
  path) and :class:`Catalog`, the thread-safe registry that maps tickets to datasets;
- :mod:`~dissoc.datasets.messages`: a dataset as the IPC messages a server sends (stored data forwarded as
  stored, the rest encoded).
"""

from __future__ import annotations

from dissoc.datasets.base import Dataset, DatasetError, UnknownTicket
from dissoc.datasets.catalog import Catalog, dataset_from
from dissoc.datasets.files import IpcFileDataset, IpcStreamDataset, ParquetDataset
from dissoc.datasets.generated import GeneratedDataset
from dissoc.datasets.in_memory import DeviceDataset, ReaderFactoryDataset, TableDataset
from dissoc.datasets.live import FellBehind, LiveDataset, LiveView, RetentionFull
from dissoc.datasets.tabular import FileSystemDataset

__all__ = [
    "Catalog",
    "Dataset",
    "DatasetError",
    "DeviceDataset",
    "FileSystemDataset",
    "GeneratedDataset",
    "IpcFileDataset",
    "IpcStreamDataset",
    "FellBehind",
    "LiveDataset",
    "LiveView",
    "RetentionFull",
    "ParquetDataset",
    "ReaderFactoryDataset",
    "TableDataset",
    "UnknownTicket",
    "dataset_from",
]
