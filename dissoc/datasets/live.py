"""Live datasets: a named, append-only stream of batches of one schema, read while its producer appends.

A :class:`LiveDataset` is fed by its producer (:meth:`LiveDataset.append`, from any thread; then
:meth:`~LiveDataset.close`, or :meth:`~LiveDataset.fail` to end it with an error). Each batch gets an
*offset*, its index in the stream (0, 1, 2...). Readers follow it: a ticket ``NAME@OFFSET`` (a number,
``earliest`` or ``latest``; plain ``NAME`` is ``NAME@earliest``) starts there, receives every batch appended
since, as it is appended, and the end of the stream once the producer closes it. Each reader goes at its own
pace; the producer is held back only as the retention says.

**Retention.** The stream keeps its last batches, at most ``max_batches`` of them and ``max_bytes`` of their
encoded bodies. When an append would exceed either, ``on_full`` decides:

- ``"evict"`` (the default): the oldest batches go. A reader that still needed one gets a
  :class:`FellBehind` error naming the first offset still held: never a silent gap.
- ``"block"``: the oldest batches go only once no reader still needs them; until then ``append`` waits (at
  most ``block_timeout`` seconds, then :class:`RetentionFull`). With no reader, the oldest go.
- ``"refuse"``: ``append`` raises :class:`RetentionFull`.

A batch is encoded once, when a reader first needs it, and its messages are shared by every reader (as an
in-memory table's are). A schema with dictionary fields sends, before each batch, the dictionaries it uses
(a reader may start at any offset).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from dissoc.codec import MessageEncoder
from dissoc.datasets.base import Dataset, DatasetError
from dissoc.errors import ResourceError, TransportError

__all__ = [
    "DEFAULT_MAX_BATCHES",
    "DEFAULT_MAX_BYTES",
    "EARLIEST",
    "LATEST",
    "FellBehind",
    "LiveDataset",
    "LiveView",
    "RetentionFull",
    "parse_start",
]

#: Retention defaults: the last 10,000 batches, and at most 256 MiB of them.
DEFAULT_MAX_BATCHES = 10_000
DEFAULT_MAX_BYTES = 256 << 20
ON_FULL = ("evict", "block", "refuse")
#: Seconds between checks that a waiting reader's client is still there.
_ALIVE_EVERY = 1.0
EARLIEST, LATEST = "earliest", "latest"

#: (metadata, body buffers, has a body): a message as :mod:`dissoc.datasets.messages` gives it.
_Message = tuple[Any, list[Any], bool]


class FellBehind(ResourceError):
    """A reader asked for (or had not yet read) batches the retention no longer holds."""

    code = "fell_behind"


class RetentionFull(ResourceError):
    """An append found the retention full, and the stream refuses (``on_full="refuse"``) or waited in vain
    (``"block"``)."""

    code = "retention_full"


def parse_start(start: str | int) -> str | int:
    """A reader's start: ``"earliest"``, ``"latest"`` or an offset >= 0; DatasetError otherwise."""
    if isinstance(start, int) and not isinstance(start, bool):
        if start < 0:
            raise DatasetError(f"a live stream's start offset must be >= 0, got {start}")
        return start
    text = str(start).strip().lower()
    if text in (EARLIEST, LATEST):
        return text
    if text.isdigit():
        return int(text)
    raise DatasetError(f"a live stream's start is an offset, 'earliest' or 'latest', not {start!r}")


@dataclass(eq=False)
class _Entry:
    offset: int
    batch: Any  # a pa.RecordBatch, or a DeviceBatch on a device stream
    nbytes: int
    encoded: dict[str | None, list[_Message]] = field(default_factory=dict)


@dataclass(eq=False)
class _Reader:
    """Where one reader is: the next offset it will take."""

    position: int
    since: float = field(default_factory=time.monotonic)


class LiveDataset(Dataset):
    """A stream fed while it is read (see the module docstring). ``schema`` may be left out: the first
    append sets it."""

    def __init__(
        self,
        name: str,
        schema: pa.Schema | None = None,
        *,
        max_batches: int | None = DEFAULT_MAX_BATCHES,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        on_full: str = "evict",
        block_timeout: float | None = 60.0,
        device: bool = False,
    ) -> None:
        super().__init__(name)
        if "@" in name:
            raise DatasetError(f"live stream {name!r}: a live stream's name must not contain '@'")
        if schema is not None and not isinstance(schema, pa.Schema):
            raise DatasetError(f"live stream {name!r}: schema must be a pyarrow.Schema")
        if on_full not in ON_FULL:
            raise DatasetError(
                f"live stream {name!r}: on_full is one of {', '.join(ON_FULL)}, not {on_full!r}"
            )
        for what, value in (("max_batches", max_batches), ("max_bytes", max_bytes)):
            if value is not None and value < 1:
                raise DatasetError(f"live stream {name!r}: {what} must be >= 1 (or None: unbounded)")
        self._schema = schema
        #: Batches are :class:`~dissoc.device.DeviceBatch` objects, sent from device memory.
        self.device = device
        self._schema_metadata: bytes | None = None
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.on_full = on_full
        self.block_timeout = block_timeout
        self._cond = threading.Condition(threading.RLock())
        self._entries: deque[_Entry] = deque()
        self._bytes = 0
        self._head = 0  # the offset the next append gets
        self._ended = False
        self._error: BaseException | None = None
        self._readers: set[_Reader] = set()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.appended_rows = 0
        self._sequences: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------ state

    @property
    def schema(self) -> pa.Schema:
        if self._schema is None:
            raise DatasetError(f"live stream {self.name!r} has no schema yet (nothing was published to it)")
        return self._schema

    @property
    def has_schema(self) -> bool:
        return self._schema is not None

    @property
    def head(self) -> int:
        """The offset the next batch appended will get (the number of batches appended so far)."""
        return self._head

    @property
    def first(self) -> int:
        """The first offset still held (``head`` when none is)."""
        with self._cond:
            return self._entries[0].offset if self._entries else self._head

    @property
    def ended(self) -> bool:
        """Whether the producer closed (or failed) the stream."""
        return self._ended

    @property
    def retained(self) -> tuple[int, int]:
        """``(batches, bytes)`` held now."""
        with self._cond:
            return len(self._entries), self._bytes

    def lags(self) -> list[int]:
        """How many batches each reader has still to take of what was appended."""
        with self._cond:
            return [self._head - r.position for r in self._readers]

    @property
    def nbytes(self) -> int | None:
        return self._bytes

    def describe(self) -> dict[str, Any]:
        """What a control plane says about the stream (JSON-friendly)."""
        held, nbytes = self.retained
        return {
            "live": True,
            "head": self.head,
            "first": self.first,
            "ended": self.ended,
            "retained_batches": held,
            "retained_bytes": nbytes,
            "readers": len(self._readers),
        }

    # ------------------------------------------------------------------------------------------ producer

    def append(self, batch: pa.RecordBatch | pa.Table, *, timeout: float | None = None) -> int:
        """Append ``batch`` (a table: each of its batches) and return the offset of the (last) batch.

        Thread-safe. With ``on_full="block"`` it may wait for readers (up to ``timeout``, by default the
        stream's ``block_timeout``): call it from a thread, not from the event loop serving the readers
        (from async code: ``await asyncio.to_thread(stream.append, batch)``)."""
        if isinstance(batch, pa.Table) and not self.device:
            offset = self._head - 1
            for b in batch.to_batches():
                offset = self.append(b, timeout=timeout)
            return offset
        if self.device:
            from dissoc.device import DeviceBatch

            if not isinstance(batch, DeviceBatch):
                raise DatasetError(f"live stream {self.name!r} holds device batches: append a DeviceBatch")
            nbytes = batch.nbytes
        elif isinstance(batch, pa.RecordBatch):
            nbytes = batch.get_total_buffer_size()
        else:
            raise DatasetError(f"live stream {self.name!r}: append takes a pyarrow.RecordBatch or Table")
        wait = self.block_timeout if timeout is None else timeout
        deadline = None if wait is None else time.monotonic() + wait
        with self._cond:
            if self._ended:
                raise DatasetError(f"live stream {self.name!r} is closed: nothing more can be appended")
            if self._schema is None:
                self._schema = batch.schema
            if self.device and self._schema_metadata is None:
                self._schema_metadata = batch.schema_metadata  # the device batches' Schema message
            if not batch.schema.equals(self._schema):
                raise DatasetError(
                    f"live stream {self.name!r}: the batch's schema differs from the stream's "
                    f"({batch.schema} is not {self._schema})"
                )
            while self._full(nbytes):
                if self.on_full == "evict" or not self._needed(self._entries[0].offset):
                    self._evict()
                    continue
                if self.on_full == "refuse":
                    raise RetentionFull(
                        f"live stream {self.name!r}: the retention is full ({self._describe_limits()}) and "
                        f"a reader still needs offset {self._entries[0].offset}"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RetentionFull(
                        f"live stream {self.name!r}: the retention stayed full ({self._describe_limits()}) "
                        f"for {wait:g} s: the slowest reader is at offset {self._slowest()}"
                    )
                self._cond.wait(left)
                if self._ended:
                    raise DatasetError(f"live stream {self.name!r} was closed while an append waited")
            offset = self._head
            self._entries.append(_Entry(offset, batch, nbytes))
            self._bytes += nbytes
            self._head = offset + 1
            self.appended_rows += batch.num_rows
            self._wake()
        return offset

    def append_once(
        self, batches: Sequence[pa.RecordBatch], *, producer: str, sequence: int, timeout: float | None = None
    ) -> tuple[int, int] | None:
        """Append ``batches`` together, at most once per ``(producer, sequence)``: a sequence number at or
        below the last one appended for ``producer`` is a retry, and is skipped (None). Returns the first
        and last offsets given (an empty list gives ``(head, head - 1)``). For exactly-once producers (the
        Spark sink): a retried commit never appends twice."""
        with self._cond:
            last = self._sequences.get(producer)
            if last is not None and sequence <= last:
                return None
            first = self._head
            for batch in batches:
                self.append(batch, timeout=timeout)
            self._sequences[producer] = sequence
            return first, self._head - 1

    def last_sequence(self, producer: str) -> int | None:
        """The last sequence number :meth:`append_once` appended for ``producer``."""
        with self._cond:
            return self._sequences.get(producer)

    def close(self) -> None:
        """End the stream: readers get what is held, then the end of the stream. Appends are refused. (The
        stream stays served: readers joining later read what is held, then the end.)"""
        with self._cond:
            self._ended = True
            self._wake()
            self._cond.notify_all()

    def __enter__(self) -> LiveDataset:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """``with server.publish(...) as stream:`` closes it, or fails it with the exception that left."""
        if exc is not None:
            self.fail(exc)
        else:
            self.close()

    def fail(self, error: BaseException | str) -> None:
        """End the stream with an error: readers get what is held, then this error (not an end)."""
        with self._cond:
            if not self._ended:
                self._error = error if isinstance(error, BaseException) else DatasetError(str(error))
                self._ended = True
            self._wake()
            self._cond.notify_all()

    def _full(self, nbytes: int) -> bool:
        if not self._entries:
            return False
        if self.max_batches is not None and len(self._entries) >= self.max_batches:
            return True
        return self.max_bytes is not None and self._bytes + nbytes > self.max_bytes

    def _needed(self, offset: int) -> bool:
        return any(r.position <= offset for r in self._readers)

    def _slowest(self) -> int | None:
        return min((r.position for r in self._readers), default=None)

    def _evict(self) -> None:
        entry = self._entries.popleft()
        self._bytes -= entry.nbytes

    def _describe_limits(self) -> str:
        return f"max_batches={self.max_batches}, max_bytes={self.max_bytes}"

    def _wake(self) -> None:
        """Wake every reader waiting on an event loop (with the lock held)."""
        waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, future)

    # ------------------------------------------------------------------------------------------ readers

    def view(self, start: str | int) -> LiveView:
        """The stream as read from ``start`` (an offset, ``"earliest"`` or ``"latest"``)."""
        return LiveView(self, parse_start(start))

    def open(self) -> Iterator[pa.RecordBatch]:
        """The batches from the earliest held, blocking for new ones (for readers in threads: Flight)."""
        return self._follow_sync(EARLIEST)

    def _attach(self, start: str | int) -> _Reader:
        with self._cond:
            first = self._entries[0].offset if self._entries else self._head
            if start == EARLIEST:
                position = first
            elif start == LATEST:
                position = self._head
            else:
                assert isinstance(start, int)
                if start < first:
                    raise FellBehind(
                        f"live stream {self.name!r}: offset {start} is no longer held; the first offset held "
                        f"is {first}"
                    )
                position = start
            reader = _Reader(position)
            self._readers.add(reader)
            return reader

    def _detach(self, reader: _Reader) -> None:
        with self._cond:
            self._readers.discard(reader)
            self._cond.notify_all()

    def _take(self, reader: _Reader, limit: int) -> list[_Entry] | None:
        """Up to ``limit`` entries from the reader's position (moving it on); [] when it must wait; None at
        the end. Raises the producer's error, or FellBehind."""
        with self._cond:
            entries = self._entries
            first = entries[0].offset if entries else self._head
            if reader.position < first:
                raise FellBehind(
                    f"live stream {self.name!r}: this reader fell behind the retention at offset "
                    f"{reader.position}; the first offset held is {first} ({self._describe_limits()}, "
                    f"on_full={self.on_full!r})"
                )
            if reader.position >= self._head:
                if not self._ended:
                    return []
                if self._error is not None:
                    raise DatasetError(
                        f"live stream {self.name!r}: the producer failed at offset {self._head}: "
                        f"{self._error}"
                    )
                return None
            start = reader.position - first
            taken = [entries[i] for i in range(start, min(len(entries), start + limit))]
            reader.position = taken[-1].offset + 1
            if self.on_full == "block":
                self._cond.notify_all()
            return taken

    def _follow_sync(self, start: str | int) -> Iterator[pa.RecordBatch]:
        reader = self._attach(start)
        try:
            self._wait_schema_sync()
            while True:
                taken = self._take(reader, 64)
                if taken is None:
                    return
                if not taken:
                    with self._cond:
                        if reader.position >= self._head and not self._ended:
                            self._cond.wait(1.0)
                    continue
                for entry in taken:
                    yield entry.batch.to_arrow() if self.device else entry.batch
        finally:
            self._detach(reader)

    def _wait_schema_sync(self) -> None:
        with self._cond:
            while self._schema is None and not self._ended:
                self._cond.wait(1.0)
            if self._schema is None:
                raise DatasetError(f"live stream {self.name!r} ended before anything was published to it")

    async def _wait(self, ready: Any, alive: Callable[[], bool] | None) -> None:
        """Wait (on this loop) until ``ready()`` holds, checked under the lock. While it waits, ``alive()``
        is asked every second: a reader whose client left ends (TransportError) instead of holding its place
        until the next append."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if ready():
                    return
                future: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, future))
            if alive is None:
                await future
                continue
            # One timer per wait (cheaper than asyncio.wait's): it wakes the reader to look at its client.
            timer = loop.call_later(_ALIVE_EVERY, _resolve, future)
            try:
                await future
            finally:
                timer.cancel()
            if not alive():
                raise TransportError(f"live stream {self.name!r}: the reader's connection closed")

    async def chunks(
        self, start: str | int, compression: str | None, alive: Callable[[], bool] | None = None
    ) -> AsyncGenerator[Sequence[_Message], None]:
        """The stream's messages from ``start``, schema first, in chunks of what is ready, waiting (on the
        running loop) for appends; ends when the producer closes, raises when it failed."""
        behind: FellBehind | None = None
        try:
            reader = self._attach(start)  # from the request on: the retention keeps what it needs ("block")
        except FellBehind as e:  # told after the schema, as every error of a stream is
            behind, reader = e, _Reader(0)
        try:
            await self._wait(lambda: self._schema is not None or self._ended, alive)
            if self._schema is None:
                raise DatasetError(f"live stream {self.name!r} ended before anything was published to it")
            schema = self._schema
            shared = MessageEncoder(schema, compression=compression)
            dictionaries = bool(shared.ids.by_path)  # (the encoder's own walk, extension types included)
            device = None
            if self.device and compression is None:
                from dissoc.device import DeviceEncoder

                # The reader's own encoder: it sends each dictionary once to this reader, from device memory.
                device = DeviceEncoder(schema, schema_metadata=self._schema_metadata)
                yield [(device.schema_message().metadata, [], False)]
            else:
                yield [(shared.schema_message().metadata, [], False)]
            if behind is not None:
                raise behind
            while True:
                taken = self._take(reader, 256)
                if taken is None:
                    return
                if not taken:
                    await self._wait(lambda: reader.position < self._head or self._ended, alive)
                    continue
                chunk: list[_Message] = []
                for entry in taken:
                    if device is not None:
                        chunk += [(m.metadata, [m.body], True) for m in device.encode(entry.batch)]
                    else:
                        chunk += self._encoded(entry, compression, None if dictionaries else shared)
                yield chunk
        finally:
            self._detach(reader)

    def _encoded(
        self, entry: _Entry, compression: str | None, shared: MessageEncoder | None
    ) -> list[_Message]:
        """The entry's messages (encoded once per compression and kept with it). With dictionaries, a fresh
        encoder: each batch carries the dictionaries it uses, whatever offset a reader started at."""
        messages = entry.encoded.get(compression)
        if messages is None:
            batch = entry.batch.to_arrow() if self.device else entry.batch  # (device batches, compressed)
            encoder = shared if shared is not None else MessageEncoder(batch.schema, compression=compression)
            encoded = encoder.encode(batch)
            messages = [(m.metadata, m.body_buffers, True) for m in encoded]
            entry.encoded[compression] = messages
        return messages

    def __repr__(self) -> str:
        held, nbytes = self.retained
        return (
            f"LiveDataset({self.name!r}, head={self.head}, retained={held} batches / {nbytes} bytes, "
            f"on_full={self.on_full!r}{', ended' if self.ended else ''})"
        )


class LiveView(Dataset):
    """A live stream as one reader reads it: from ``start`` (what ``NAME@START`` names)."""

    def __init__(self, live: LiveDataset, start: str | int) -> None:
        super().__init__(live.name)
        self.live = live
        self.start = start

    @property
    def schema(self) -> pa.Schema:
        return self.live.schema

    def open(self) -> Iterator[pa.RecordBatch]:
        return self.live._follow_sync(self.start)

    def chunks(
        self, compression: str | None, alive: Callable[[], bool] | None = None
    ) -> AsyncGenerator[Sequence[_Message], None]:
        return self.live.chunks(self.start, compression, alive)

    def __repr__(self) -> str:
        return f"LiveView({self.live.name!r}, from {self.start})"


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
