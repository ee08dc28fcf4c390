"""A stream as a server sends it: the walk of a dataset's messages (:func:`stream_dataset`), the *parts*
of the stream it hands each message to (:class:`StreamPart`), and the :class:`Outbox` that writes what they
queue.

A stream has two parts: the metadata stream (:class:`dissoc.server.metadata.MetadataPart`) and the bodies
(:class:`dissoc.server.data.DataPart`). A metadata server sends the first, a data server the second, and a
combined server both over one connection (:class:`dissoc.server.CombinedServer`). The walk numbers the
messages with :class:`~dissoc.protocol.ServerStream` whichever parts it drives, which is what lets a client
join a metadata server's stream with a data server's.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pyarrow as pa

from dissoc.buffers import BytesLike
from dissoc.datasets import Dataset
from dissoc.datasets.messages import message_chunks, same_every_time
from dissoc.errors import DissocError, ResourceError, TransportError
from dissoc.logs import RateLimitedLog
from dissoc.metrics import SERVER
from dissoc.protocol import ServerMessage, ServerStream, encode_error, fmt_seq
from dissoc.transport import Connection

__all__ = ["Outbox", "StreamPart", "stream_dataset"]

log = logging.getLogger(__name__)

#: A stream's failures, at most one line per kind of failure every few seconds (clients can repeat them).
_stream_log = RateLimitedLog(log)

#: Bytes handed to a connection's send that has not returned yet (metrics: dissoc_server_in_flight_bytes).
_IN_FLIGHT = SERVER.in_flight

# Small messages from a source that never blocks are written together, up to these limits per system call.
_COALESCE_BYTES = 256 << 10
_COALESCE_MESSAGES = 64


class Outbox:
    """Frames waiting to be written to one connection: coalesced into one vectored send where the source
    never blocks, flushed after every message otherwise (so the client never waits on a half-filled batch)."""

    def __init__(self, conn: Connection, *, coalesce: bool) -> None:
        self.conn = conn
        self._frames: list[tuple[int | None, Any]] = []
        self._bytes = 0
        # what makes it due: any frame, or the coalescing limits
        self._max_frames = _COALESCE_MESSAGES if coalesce else 1
        self._max_bytes = _COALESCE_BYTES if coalesce else 0

    def add(self, tag: int | None, data: BytesLike | Sequence[BytesLike], nbytes: int) -> None:
        """Queue one frame: untagged (metadata stream) when ``tag`` is None, else tagged."""
        self._frames.append((tag, data))
        self._bytes += nbytes

    async def flush(self) -> None:
        """Write everything queued (counted in flight until the send returns)."""
        if self._frames:
            frames, nbytes, self._frames, self._bytes = self._frames, self._bytes, [], 0
            in_flight = _IN_FLIGHT
            in_flight.bytes += nbytes
            try:
                await self.conn.send_many(frames)
            finally:
                in_flight.bytes -= nbytes

    def due(self) -> bool:
        """Whether what is queued should be written now (after each message unless coalescing, else once
        the limits are reached)."""
        return len(self._frames) >= self._max_frames or self._bytes >= self._max_bytes


class StreamPart(abc.ABC):
    """One part of a stream as a server sends it (the metadata stream, or the bodies)."""

    def schema(self, out: Outbox, header: bytes, metadata: Any) -> None:  # noqa: B027 (optional hook)
        """The Schema message (sequence number 0; it has no body)."""

    @abc.abstractmethod
    def message(
        self, out: Outbox, sent: ServerMessage, metadata: Any, body: list[Any]
    ) -> Awaitable[None] | None:
        """One message after the schema, numbered by ``sent``: queued on ``out`` at once (None), or by the
        awaitable returned (a part that must wait, e.g. for room in an arena; most messages need none, and
        this is the per-message path)."""

    def end(self, out: Outbox, stream: ServerStream) -> None:  # noqa: B027 (optional hook)
        """Every message was handed over."""


async def stream_dataset(
    out: Outbox,
    dataset: Dataset,
    parts: Sequence[StreamPart],
    *,
    compression: str | None,
    send_error: Callable[[bytes], Any],
    role: str = "combined",
) -> int:
    """Walk ``dataset``'s messages through ``parts``; returns the number of messages numbered.

    A failure of the dataset or its encoding is reported to the client with ``send_error`` (an error
    message numbered after what was sent), which ends the stream; a transport failure propagates.
    Counted in :data:`dissoc.metrics.SERVER` under ``role``: started, finished or failed (by reason), and the
    time to the first batch.
    """
    stream = ServerStream()
    conn = out.conn
    chunks = message_chunks(dataset, compression, alive=lambda: not conn.closed)
    metrics = SERVER
    metrics.streams_started.inc(role)
    begun = time.monotonic()  # 0.0 once the first batch went
    number = stream.message
    senders = [part.message for part in parts]
    metadata: Any = None
    body: list[Any] = []
    try:
        first = True
        # A chunk is walked with no await but the flushes (and a part that must wait): the per-message path.
        async for chunk in chunks:
            messages = iter(chunk)
            if first:
                first = False
                metadata, body, _ = next(messages)
                header = stream.schema(metadata)
                for part in parts:
                    part.schema(out, header, metadata)
            for metadata, body, with_body in messages:
                if begun:
                    metrics.time_to_first_batch.observe(time.monotonic() - begun)
                    begun = 0.0
                sent = number(metadata, with_body)
                for send in senders:
                    waiting = send(out, sent, metadata, body)
                    if waiting is not None:
                        await waiting
                if out.due():
                    await out.flush()
        count = stream.next_seq
        for part in parts:
            part.end(out, stream)
        await out.flush()
        log.debug("stream of %r done: %s messages", dataset.name, fmt_seq(count))
        metrics.streams_finished.inc(role)
        return count
    except TransportError as e:
        # The client left mid-send. The failed send's tracebacks hold the frames that held the batch, in a
        # cycle with the transport's futures that only the garbage collector would break: let go of them.
        _drop_tracebacks(e)
        metrics.streams_failed.inc(role, "client_gone")
        raise
    except (DissocError, pa.ArrowException, OSError, ValueError) as e:
        # The dataset or its encoding failed: tell the client on the stream, which then ends.
        await _report_failure(out, stream, dataset, e, send_error, role)
        return stream.next_seq
    except BaseException as e:  # the server is closing (cancelled), or a bug: counted, so that every stream
        # started is counted as finished or failed
        metrics.streams_failed.inc(role, "cancelled" if isinstance(e, asyncio.CancelledError) else "error")
        raise
    finally:
        # a traceback through this frame must not keep the last batch
        metadata, body, chunk, messages = None, [], (), iter(())
        await chunks.aclose()  # the dataset's reader stops now, also when the client left mid-stream
        if not same_every_time(dataset):
            _release_pool_soon()


async def _report_failure(
    out: Outbox,
    stream: ServerStream,
    dataset: Dataset,
    error: Exception,
    send_error: Callable[[bytes], Any],
    role: str,
) -> None:
    """What was queued goes out, then an error message numbered after it: the limit's own code for a limit
    (:class:`~dissoc.protocol.ledger.QuotaExceeded`, ``ArenasExhausted``), ``stream_failed`` otherwise."""
    _stream_log.log(logging.WARNING, type(error).__name__, "stream of %r failed: %s", dataset.name, error)
    await out.flush()
    code = getattr(error, "code", None) if isinstance(error, ResourceError) else None
    SERVER.streams_failed.inc(role, code if isinstance(code, str) else "stream_failed")
    if isinstance(code, str):
        SERVER.refusals.inc(code)
        await send_error(_error(stream, code, str(error)))
    else:
        await send_error(_error(stream, "stream_failed", f"serving {dataset.name!r} failed: {error}"))


def _release_pool_soon() -> None:
    """Data read through pyarrow's pool (Parquet, generated data, reader factories): give the memory freed
    back to the system once nothing of the stream is referenced any more. The last batch is let go of as the
    walk's frame, the handler's task and a traceback through them unwind (a turn or two of the loop):
    release then, and once more a little later."""
    loop = asyncio.get_running_loop()
    loop.call_soon(loop.call_soon, _release_pool)
    loop.call_later(0.25, _release_pool)


def _drop_tracebacks(error: BaseException) -> None:
    seen: set[int] = set()
    chained: BaseException | None = error
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__


def _release_pool() -> None:
    pa.default_memory_pool().release_unused()


def _error(stream: ServerStream, code: str, message: str) -> bytes:
    try:
        return stream.error(code, message)
    except RuntimeError:  # the stream already ended or failed: number the error after what was sent
        return encode_error(stream.next_seq, code, message)
