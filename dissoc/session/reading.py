"""Reading one stream as bursts of batches: what the client's entry points iterate.

:func:`read_stream` starts a :class:`~dissoc.session.session.Session`, and each time it wakes takes every
event that is ready, decodes it (:class:`~dissoc.session.decoding.Decoding`) and hands the batches over as one
:class:`Chunk`, so that a consumer that pays a fixed cost per resumption (the synchronous reader) pays it
once per burst. It counts the stream in :data:`dissoc.metrics.CLIENT` as it goes, and reports what it carried
and the path its bytes took in the caller's :class:`~dissoc.session.options.FetchStats` when it ends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable

import pyarrow as pa

from dissoc.errors import (
    DevicePathError,
    DissocError,
    ProtocolError,
    RemoteError,
    ResourceError,
    TransportError,
)
from dissoc.logs import new_stream_id, stream_id
from dissoc.metrics import CLIENT, Tally
from dissoc.protocol import ArenaAnnouncement, MessageReady, SchemaReceived, StreamEnded
from dissoc.session.decoding import Batch
from dissoc.session.options import ClientOptions, FetchStats
from dissoc.session.session import Session, live
from dissoc.tokens import is_signed
from dissoc.uri import DissocURI

__all__ = ["Chunk", "as_uri", "read_stream"]

log = logging.getLogger("dissoc.client")  # (the client's lines, wherever its machinery lives)

#: Bytes of batches decoded into one burst before it is handed to the consumer: the consumer lets go of its
#: batches before more are decoded, so that pair readers' pooled buffers (and pages) are reused.
CHUNK_BYTES = 64 << 20


class Chunk(list[Batch]):
    """Batches complete at once (a burst), with the session they came from as ``watch``: consumers handing
    them out one by one check ``watch.failure`` first, so that a server gone mid-stream fails the stream now,
    not after the consumer has worked through a burst (with pairs, as many batches as the server's arena
    holds; zero-copy ones over the dead server's memory). The synchronous reader notices between batches
    only where its loop runs meanwhile (zero-copy; else at its next read)."""

    __slots__ = ("watch",)

    def __init__(self, watch: Session | None) -> None:
        super().__init__()
        self.watch = watch


def as_uri(uri: str | DissocURI) -> DissocURI:
    return uri if isinstance(uri, DissocURI) else DissocURI.parse(uri)


def _ticket_bytes(ticket: str | bytes) -> bytes:
    return ticket.encode() if isinstance(ticket, str) else bytes(ticket)


class _Counted:
    """What a stream has added to the client's metrics so far (once per burst)."""

    def __init__(self, transport: str, tally: Tally) -> None:
        self.transport = transport
        self.tally = tally
        self.batches = 0
        self.bytes = 0
        self.begun = time.monotonic()  # 0.0 once the first batch was handed over

    def add(self, stats: FetchStats) -> None:
        self.tally.batches += stats.batches - self.batches
        self.tally.bytes += stats.bytes - self.bytes
        self.batches, self.bytes = stats.batches, stats.bytes

    def first_batch(self) -> None:
        if self.begun:
            CLIENT.time_to_first_batch.observe(time.monotonic() - self.begun)
            self.begun = 0.0


def _outcome(exc: DissocError) -> str:
    """How a failed stream is counted."""
    if isinstance(exc, RemoteError):
        return exc.code
    for kind, name in (
        (ProtocolError, "protocol"),
        (TransportError, "transport"),
        (ResourceError, "resource"),
        (DevicePathError, "device_path"),
    ):
        if isinstance(exc, kind):
            return name
    return "error"


async def _started(meta: DissocURI, data: DissocURI, ticket: bytes, options: ClientOptions) -> Session:
    """A session that has begun: connected, want_data sent, its first event in (or its failure raised)."""
    session = Session(meta, data, ticket, options)
    live.add(session)
    try:
        await session.start()
        await session.wait()
        return session
    except BaseException as exc:
        await session.close()
        live.discard(session)
        if not (isinstance(exc, TransportError) and session.reused):
            raise
    # A pooled connection the server had dropped meanwhile (restarted, or its idle limit): once more, on fresh
    # connections.
    log.debug("a reused connection failed before the stream began; connecting afresh")
    session = Session(meta, data, ticket, options, pooled=False)
    live.add(session)
    try:
        await session.start()
    except BaseException:
        await session.close()
        live.discard(session)
        raise
    return session


async def _burst(session: Session, on_schema: Callable[[pa.Schema], None] | None) -> tuple[Chunk, bool]:
    """Every event ready now (at least one, waiting for it), decoded: the batches, and whether the stream
    ended."""
    await session.wait()
    chunk = Chunk(session)
    ready = session.ready
    decoding = session.decoding
    stats = decoding.stats
    start = stats.bytes
    consumed = 0
    ended = False
    limit = start + CHUNK_BYTES
    while ready:
        if type(ready[0]) is MessageReady:  # (a run of them, decoded in one call)
            consumed += decoding.messages(ready, chunk, limit)
            if stats.bytes >= limit:
                break
            continue
        ev = ready.popleft()
        if isinstance(ev, SchemaReceived):
            schema = decoding.schema(ev.metadata)
            if on_schema is not None:
                on_schema(schema)
        elif isinstance(ev, StreamEnded):
            ended = True
            break
        else:
            assert isinstance(ev, ArenaAnnouncement)
            decoding.arena(ev)
    session.consumed(consumed)
    await session.frees.flush()
    return chunk, ended


async def read_stream(
    uri: str | DissocURI,
    data_uri: str | DissocURI | None,
    ticket: str | bytes,
    *,
    options: ClientOptions | None,
    stats: FetchStats | None,
    on_schema: Callable[[pa.Schema], None] | None,
) -> AsyncGenerator[list[Batch], None]:
    """One stream's batches, in bursts. Counted in :data:`dissoc.metrics.CLIENT` per burst: bytes and batches
    received, and the stream's start, end or failure."""
    opts = options or ClientOptions()
    meta = as_uri(uri)
    data = as_uri(data_uri) if data_uri is not None else meta
    body = "packed" if data.memory is None else "pairs"
    counted = _Counted(meta.scheme, CLIENT.received(meta.scheme, body))
    outcome = "closed_early"  # the consumer stopped reading before the end (unless set below)
    CLIENT.streams_started.inc(meta.scheme)
    previous = stream_id.set(new_stream_id())  # the session's tasks, made next, log with it
    if log.isEnabledFor(logging.DEBUG):
        # a signed ticket is a credential: not even part of it goes to the log
        shown = "<signed ticket>" if is_signed(ticket) else repr(ticket[:64])
        log.debug("stream of %s from %s", shown, meta)
    session: Session | None = None
    try:
        session = await _started(meta, data, _ticket_bytes(ticket), opts)
        data_conn = session.data_conn
        session.decoding.began(meta.scheme, data_conn.lanes() if data_conn is not None else ())
        ended = False
        while not ended:
            chunk, ended = await _burst(session, on_schema)
            counted.add(session.decoding.stats)
            if chunk:
                counted.first_batch()
                yield chunk
            del chunk
        outcome = "ok"
    except DissocError as e:
        outcome = _outcome(e)
        raise
    finally:
        if session is not None:
            live.discard(session)
            counted.add(session.decoding.stats)
            if stats is not None:
                done = session.decoding.stats
                stats.batches, stats.rows, stats.bytes = done.batches, done.rows, done.bytes
                stats.paths = [session.decoding.path]
            await session.close()
        if outcome == "ok":
            CLIENT.streams_finished.inc(meta.scheme)
        else:
            CLIENT.streams_failed.inc(meta.scheme, outcome)
        with contextlib.suppress(ValueError):  # finalized in another context: nothing to restore there
            stream_id.reset(previous)
