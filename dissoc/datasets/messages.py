"""A dataset as the IPC messages a server sends: the Schema message, then each batch's messages.

Stored IPC data is forwarded as it is (metadata plus a zero-copy slice of the memory map, no decode and no
re-encode); device batches are sent as their device messages (bodies left in device memory); everything else
is encoded with :class:`~dissoc.codec.MessageEncoder`. Encoding is deterministic, so two servers serving one
ticket independently number the same messages the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, TypeAlias, TypeGuard

import pyarrow as pa

from dissoc.codec import MessageEncoder, iter_messages
from dissoc.datasets.base import Dataset
from dissoc.datasets.files import IpcFileDataset, IpcStreamDataset, ParquetDataset
from dissoc.datasets.in_memory import DeviceDataset, TableDataset

__all__ = ["DatasetMessage", "dataset_messages", "device_bodies", "same_every_time"]

#: (metadata flatbuffer, body buffers, whether the message has a body). The body is the encoder's padded
#: pieces, one slice of stored data, or one device array.
DatasetMessage: TypeAlias = tuple[Any, list[Any], bool]


def same_every_time(dataset: Dataset) -> bool:
    """Stored or in-memory data: the next message is ready at once, and the same on every request."""
    return isinstance(dataset, (TableDataset, IpcFileDataset, IpcStreamDataset, DeviceDataset))


def device_bodies(dataset: Dataset, compression: str | None) -> TypeGuard[DeviceDataset]:
    """Whether the dataset's bodies are sent from device memory (device batches, served uncompressed)."""
    return isinstance(dataset, DeviceDataset) and compression is None


async def _batches(dataset: Dataset) -> AsyncIterator[pa.RecordBatch]:
    """The dataset's batches. In-memory and memory-mapped ones are read on the event loop; the others
    (Parquet, generated, user factories) in a worker thread, so that one slow read stalls no other client.

    Parquet is read one batch ahead (the next batch is decoded while this one is sent, which keeps a normal
    client's throughput; ``ParquetDataset(read_ahead=False)``: none), and no further: reading is pulled by
    sending, so a client that stops reading makes the server hold the batch being sent and the next one,
    whatever the file's size.
    """
    iterator: Iterator[pa.RecordBatch] = dataset.open()
    inline = isinstance(dataset, (TableDataset, IpcFileDataset))
    ahead = isinstance(dataset, ParquetDataset) and dataset.read_ahead
    sentinel = object()
    pending: asyncio.Future[object] | None = None
    try:
        while True:
            if inline:
                batch = next(iterator, sentinel)
            elif pending is not None:
                batch, pending = await pending, None
            else:
                batch = await asyncio.to_thread(next, iterator, sentinel)
            if batch is sentinel:
                return
            assert isinstance(batch, pa.RecordBatch)
            if ahead:
                pending = asyncio.ensure_future(asyncio.to_thread(next, iterator, sentinel))
            yield batch
    finally:
        if pending is not None:  # a read in a worker thread cannot be stopped: let it finish, then close
            with contextlib.suppress(Exception):
                await asyncio.shield(pending)
            pending = None
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def _stored_messages(dataset: Dataset) -> Iterator[DatasetMessage] | None:
    """Stored IPC data is forwarded as it is (no decode, no re-encode): its messages, or None."""
    if isinstance(dataset, IpcFileDataset):
        source: Any = dataset.buffer
        file_format = True
    elif isinstance(dataset, IpcStreamDataset):
        source, file_format = dataset.path, False
    else:
        return None
    return (
        (meta, [body], msg.has_body) for msg, meta, body in iter_messages(source, file_format=file_format)
    )


async def dataset_messages(dataset: Dataset, compression: str | None) -> AsyncGenerator[DatasetMessage, None]:
    """Every message of the dataset's stream, schema first (``compression`` applies to encoded batches)."""
    stored = _stored_messages(dataset)
    if stored is not None:
        for item in stored:
            yield item
        return
    if device_bodies(dataset, compression):
        from dissoc.device import DeviceEncoder

        batches = dataset.batches
        device_encoder = DeviceEncoder(
            dataset.schema, schema_metadata=batches[0].schema_metadata if batches else None
        )
        yield device_encoder.schema_message().metadata, [], False
        for device_batch in batches:
            for dm in device_encoder.encode(device_batch):
                yield dm.metadata, [dm.body], True
        return
    encoder = MessageEncoder(dataset.schema, compression=compression)
    yield encoder.schema_message().metadata, [], False
    async for batch in _batches(dataset):
        for m in encoder.encode(batch):
            yield m.metadata, m.body_buffers, True
