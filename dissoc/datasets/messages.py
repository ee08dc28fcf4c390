"""A dataset as the IPC messages a server sends: the Schema message, then each batch's messages.

Stored IPC data is forwarded as it is (metadata plus a zero-copy slice of the memory map, no decode and no
re-encode); device batches are sent as their device messages (bodies left in device memory); everything else
is encoded with :class:`~dissoc.codec.MessageEncoder`. Encoding is deterministic, so two servers serving one
ticket independently number the same messages the same way.

The messages come in chunks (:func:`message_chunks`): a server walks each chunk with no per-message await,
which is most of what a small batch costs it. A memory-mapped IPC file is parsed once, as the first stream
reaches each message, and its messages are kept for the dataset's life (metadata and zero-copy slices of the
mapping, which is immutable while the dataset is open), so that later streams of it parse nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeAlias

import pyarrow as pa

from dissoc.codec import MessageEncoder, iter_messages
from dissoc.datasets.base import Dataset, DatasetError
from dissoc.datasets.files import IpcFileDataset, IpcStreamDataset, ParquetDataset
from dissoc.datasets.in_memory import DeviceDataset, TableDataset
from dissoc.datasets.live import EARLIEST, LiveDataset, LiveView
from dissoc.datasets.tabular import FileSystemDataset

__all__ = ["DatasetMessage", "dataset_messages", "device_bodies", "message_chunks", "same_every_time"]

#: (metadata flatbuffer, body buffers, whether the message has a body). The body is the encoder's padded
#: pieces, one slice of stored data, or one device array.
DatasetMessage: TypeAlias = tuple[Any, list[Any], bool]


def same_every_time(dataset: Dataset) -> bool:
    """Stored or in-memory data: the next message is ready at once, and the same on every request."""
    return isinstance(dataset, (TableDataset, IpcFileDataset, IpcStreamDataset, DeviceDataset))


def device_bodies(dataset: Dataset, compression: str | None) -> bool:
    """Whether the dataset's bodies are sent from device memory (device batches, or a live stream of them,
    served uncompressed)."""
    if compression is not None:
        return False
    if isinstance(dataset, LiveView):
        return dataset.live.device
    return isinstance(dataset, DeviceDataset) or (isinstance(dataset, LiveDataset) and dataset.device)


async def _batches(dataset: Dataset) -> AsyncIterator[pa.RecordBatch]:
    """The dataset's batches. In-memory and memory-mapped ones are read on the event loop; the others
    (Parquet, generated, user factories) in a worker thread, so that one slow read stalls no other client.

    Parquet, CSV and JSON are read one batch ahead (the next batch is decoded while this one is sent, which
    keeps a normal client's throughput; ``read_ahead=False`` on the dataset: none), and no further: reading
    is pulled by sending, so a client that stops reading makes the server hold the batch being sent and the
    next one, whatever the file's size.
    """
    iterator: Iterator[pa.RecordBatch] = dataset.open()
    inline = isinstance(dataset, (TableDataset, IpcFileDataset))
    ahead = isinstance(dataset, ParquetDataset | FileSystemDataset) and dataset.read_ahead
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


#: Messages parsed per step of a stored source: a chunk a server walks without an await.
_CHUNK = 256
#: Distinct metadata flatbuffers shared per parsed file (a stored stream repeats its batches' metadata byte
#: for byte: one copy each is kept); others are kept one per message.
_INTERNED = 1024


class StoredMessages:
    """A memory-mapped IPC file's messages, parsed as the first stream of it reaches them and kept: its
    metadata (``bytes``, repeats shared) and zero-copy slices of ``buffer``, the mapping. Shared by the
    dataset's streams (in any thread): the kept messages are never changed, only appended to.

    A message that cannot be parsed ends the messages there: every stream reaching it raises the error
    (after the messages before it, as when each stream parsed the file itself).
    """

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        #: The messages parsed so far, in order (a stream reads them by index while more are appended).
        self.items: list[DatasetMessage] = []
        self._rest: Iterator[tuple[Any, memoryview, Any]] | None = iter_messages(buffer, file_format=True)
        self._error: BaseException | None = None
        self._interned: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    @property
    def failed(self) -> bool:
        """Whether a message could not be parsed (the messages end before it)."""
        return self._error is not None

    def more(self, have: int) -> bool:
        """Whether there are messages past the first ``have`` (parsing the next ones if need be); raises the
        file's parse error once ``have`` reaches the message that failed."""
        with self._lock:
            items = self.items
            if len(items) > have:
                return True
            rest = self._rest
            if rest is None:
                if self._error is not None:
                    raise _fresh(self._error)
                return False
            interned = self._interned
            sentinel = None
            try:
                while len(items) - have < _CHUNK:
                    item = next(rest, sentinel)
                    if item is None:
                        self._rest = None
                        break
                    msg, meta, body = item
                    key = bytes(meta)
                    shared = interned.get(key)
                    if shared is None:
                        shared = key
                        if len(interned) < _INTERNED:
                            interned[key] = key
                    items.append((shared, [body], msg.has_body))
            except Exception as e:
                self._rest = None
                self._error = e
                if len(items) > have:
                    return True  # the messages before it go first; the error comes with the next call
                raise
            return len(items) > have


#: Each IPC file dataset's parsed messages, as long as the dataset lives (weakly keyed: forgotten with it).
_PARSED: weakref.WeakKeyDictionary[IpcFileDataset, StoredMessages] = weakref.WeakKeyDictionary()
_PARSED_LOCK = threading.Lock()


def stored_messages(dataset: IpcFileDataset) -> StoredMessages:
    """The file's messages, parsed once for every stream of the dataset (a DatasetError once it is closed).

    A file whose parse failed is parsed afresh by the next stream (the failure is not kept).
    """
    try:
        buffer = dataset.buffer
    except DatasetError:  # closed: its messages go now (they keep the mapping), not once it is collected
        with _PARSED_LOCK:
            _PARSED.pop(dataset, None)
        raise
    with _PARSED_LOCK:
        stored = _PARSED.get(dataset)
        if stored is None or stored.buffer is not buffer or stored.failed:
            stored = _PARSED[dataset] = StoredMessages(buffer)
        return stored


def _fresh(error: BaseException) -> BaseException:
    """A copy of a kept parse error for one more stream to raise (with a traceback of its own)."""
    try:
        fresh = copy.copy(error)
    except Exception:  # an exception that cannot be rebuilt from its args: raised as it is
        fresh = error
    return fresh.with_traceback(None)


async def _kept_chunks(stored: StoredMessages) -> AsyncGenerator[Sequence[DatasetMessage], None]:
    items = stored.items
    have = 0
    while stored.more(have):
        end = len(items)
        yield items[have:end]
        have = end


async def _parsed_chunks(source: Any) -> AsyncGenerator[Sequence[DatasetMessage], None]:
    """An IPC stream file's messages, parsed per request (the file may be rewritten between requests): in
    chunks, a message that cannot be parsed raising after the messages before it went."""
    messages = iter_messages(source, file_format=False)
    while True:
        chunk: list[DatasetMessage] = []
        try:
            for msg, meta, body in messages:
                chunk.append((meta, [body], msg.has_body))
                if len(chunk) >= _CHUNK:
                    break
        except Exception:
            if chunk:
                yield chunk
            raise
        if not chunk:
            return
        yield chunk


async def message_chunks(
    dataset: Dataset, compression: str | None, alive: Callable[[], bool] | None = None
) -> AsyncGenerator[Sequence[DatasetMessage], None]:
    """Every message of the dataset's stream, schema first, in chunks that are never empty: a chunk is
    ready at once (no message of it waits on the source), which lets a server walk it without an await.
    ``compression`` applies to encoded batches (stored data is forwarded as stored). A live stream waiting
    for appends asks ``alive()`` (its client is still there) every second."""
    if isinstance(dataset, (LiveDataset, LiveView)):
        if isinstance(dataset, LiveView):
            live = dataset.chunks(compression, alive)
        else:
            live = dataset.chunks(EARLIEST, compression, alive)
        try:
            async for ready in live:
                yield ready
        finally:
            await live.aclose()
        return
    if isinstance(dataset, IpcFileDataset):
        async for kept in _kept_chunks(stored_messages(dataset)):
            yield kept
        return
    if isinstance(dataset, IpcStreamDataset):
        async for parsed in _parsed_chunks(dataset.path):
            yield parsed
        return
    if isinstance(dataset, DeviceDataset) and compression is None:
        from dissoc.device import DeviceEncoder

        batches = dataset.batches
        device_encoder = DeviceEncoder(
            dataset.schema, schema_metadata=batches[0].schema_metadata if batches else None
        )
        yield [(device_encoder.schema_message().metadata, [], False)]
        for device_batch in batches:
            yield [(dm.metadata, [dm.body], True) for dm in device_encoder.encode(device_batch)]
        return
    encoder = MessageEncoder(dataset.schema, compression=compression)
    yield [(encoder.schema_message().metadata, [], False)]
    async for batch in _batches(dataset):
        encoded = [(m.metadata, m.body_buffers, True) for m in encoder.encode(batch)]
        if encoded:
            yield encoded


async def dataset_messages(dataset: Dataset, compression: str | None) -> AsyncGenerator[DatasetMessage, None]:
    """Every message of the dataset's stream, schema first (``compression`` applies to encoded batches); one
    at a time (:func:`message_chunks` gives them as they come)."""
    chunks = message_chunks(dataset, compression)
    try:
        async for chunk in chunks:
            for item in chunk:
                yield item
    finally:
        await chunks.aclose()
