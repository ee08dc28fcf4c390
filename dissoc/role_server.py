"""What the spec's two servers share: a listener whose connections ask for tickets with want_data, and the
loop that walks a dataset's messages and hands each to the *parts* of the stream the server sends.

A stream has two parts: the metadata stream (:class:`dissoc.metadata_server.MetadataPart`) and the bodies
(:class:`dissoc.data_server.DataPart`). A metadata server sends the first, a data server the second, and a
combined server both over one connection (:class:`dissoc.server.CombinedServer`). The walk numbers the
messages with :class:`~dissoc.protocol.ServerStream` whichever parts it drives, which is what lets a client
join a metadata server's stream with a data server's.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from dissoc.buffers import BytesLike
from dissoc.datasets import Catalog, Dataset
from dissoc.datasets.messages import message_chunks, same_every_time
from dissoc.errors import DissocError, ResourceError, TransportError
from dissoc.logs import RateLimitedLog, new_stream_id, peer_log, stream_id
from dissoc.metrics import SERVER
from dissoc.protocol import (
    EMPTY_TICKET,
    ERROR_TAG,
    ServerMessage,
    ServerStream,
    encode_error,
    fmt_seq,
    fmt_tag,
)
from dissoc.tokens import Secret, TokenError
from dissoc.transport import Connection, Listener, TaggedMessage, serve
from dissoc.transport.base import ReceiveBudgetError
from dissoc.uri import DissocURI

if TYPE_CHECKING:
    from dissoc.memory.pairs import ServedArena
    from dissoc.memory.placements import Placements
    from dissoc.memory.private import PrivateArenas
    from dissoc.protocol.ledger import Ledger

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_FREE_DATA_BYTES",
    "DEFAULT_MAX_TICKET_BYTES",
    "DEFAULT_WANT_DATA_TIMEOUT",
    "Outbox",
    "Role",
    "RoleServer",
    "ServeOptions",
    "StreamPart",
    "UNAUTHORIZED",
    "stream_dataset",
]

log = logging.getLogger(__name__)

#: A stream's failures, at most one line per kind of failure every few seconds (clients can repeat them).
_stream_log = RateLimitedLog(log)


class Role(enum.Enum):
    """Which streams a connection carries."""

    METADATA = "metadata"
    DATA = "data"
    COMBINED = "combined"


#: The error code of a want_data refused for its token (missing, forged, expired, wrong scope or client).
UNAUTHORIZED = "unauthorized"

#: Largest want_data payload (ticket) a server reads (64 KiB).
DEFAULT_MAX_TICKET_BYTES = 64 << 10
#: Largest free_data payload a server reads (8 MiB: 1 Mi ranges of 8 bytes).
DEFAULT_MAX_FREE_DATA_BYTES = 8 << 20
#: Seconds a client has to send a complete want_data after connecting (and to finish any request it began).
DEFAULT_WANT_DATA_TIMEOUT = 10.0
#: Seconds a connection may sit with no request, no stream and no listed ranges held.
DEFAULT_IDLE_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Per-server settings shared by its connections.

    With ``placements`` (over the arena of ``served``, and a ``ledger``), bodies are sent as address/length
    pairs (body type 1): each batch's buffers are placed in the arena and stay there until the client frees
    them with free_data or disconnects; stored and in-memory batches stay resident (placed once, listed to
    every client that asks) unless the placements were made with ``resident=False``. One client holds at
    most ``max_unfreed_bytes`` awaiting free_data (:attr:`unfreed_quota`; see
    :class:`dissoc.data_server.DataPart`).
    """

    want_data: int
    free_data: int | None = None
    compression: str | None = None
    ledger: Ledger | None = None
    served: ServedArena | None = None  # what the data URI publishes (the arena's name, handle, memory kind)
    placements: Placements | None = None
    #: Largest want_data payload (ticket) read; a larger one is refused from its frame header.
    max_ticket_bytes: int = DEFAULT_MAX_TICKET_BYTES
    #: Largest free_data payload read; a larger one is refused from its frame header.
    max_free_data_bytes: int = DEFAULT_MAX_FREE_DATA_BYTES
    #: Seconds to send a complete want_data after connecting, or to finish a request begun later (None: no
    #: deadline).
    want_data_timeout: float | None = DEFAULT_WANT_DATA_TIMEOUT
    #: Seconds a connection may sit with no request, no stream and no listed ranges held (None: forever).
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT
    #: Bytes one client may hold awaiting free_data (None: a quarter of the ledger's capacity, the arena).
    max_unfreed_bytes: int | None = None
    #: Seconds a stream waits for its client, at its quota, to free something before failing it.
    unfreed_wait: float = 5.0
    #: With a secret, want_data must carry a signed ticket of scope ``read`` made with it
    #: (:mod:`dissoc.tokens`); without one, the ticket is the dataset's name. (Its repr shows no key.)
    secret: Secret | None = None
    #: With private arenas, each data connection's pair lists point into an arena of its own, made from
    #: these (there is then no shared arena: ``served``, ``placements`` and ``ledger`` are None).
    private: PrivateArenas | None = None

    @property
    def pairs(self) -> bool:
        """Whether bodies are sent as pair lists into an arena."""
        return self.placements is not None or self.private is not None

    @property
    def unfreed_quota(self) -> int:
        """Bytes one client may hold awaiting free_data: ``max_unfreed_bytes``, by default a quarter of the
        arena (so that one client that never frees cannot keep the arena from the others)."""
        if self.max_unfreed_bytes is not None:
            return self.max_unfreed_bytes
        return self.ledger.capacity_bytes // 4 if self.ledger is not None else 0


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
    chunks = message_chunks(dataset, compression)
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
        _stream_log.log(logging.WARNING, type(e).__name__, "stream of %r failed: %s", dataset.name, e)
        await out.flush()
        code = getattr(e, "code", None) if isinstance(e, ResourceError) else None
        metrics.streams_failed.inc(role, code if isinstance(code, str) else "stream_failed")
        if isinstance(code, str):  # a limit with its own error code (QuotaExceeded, ArenasExhausted)
            metrics.refusals.inc(code)
            await send_error(_error(stream, code, str(e)))
        else:
            await send_error(_error(stream, "stream_failed", f"serving {dataset.name!r} failed: {e}"))
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
            # Read through pyarrow's pool (Parquet, generated data, reader factories): give the memory freed
            # back to the system once nothing of the stream is referenced any more. The last batch is let go
            # of as this frame, the handler's task and a traceback through them unwind (a turn or two of the
            # loop): release then, and once more a little later.
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


class _Watch:
    """Where one connection stands, for the deadlines (see :meth:`RoleServer._check_deadlines`)."""

    __slots__ = ("first", "frame", "frame_since", "since", "streaming")

    def __init__(self, now: float) -> None:
        self.first = True  # no want_data received yet
        self.streaming = False
        self.since = now  # connected, or the last stream ended
        self.frame: object | None = None  # the partly received frame seen last
        self.frame_since = now


class RoleServer(abc.ABC):
    """A listener whose connections carry the streams of one role (base of the metadata and data servers).

    A connection's life: wait for want_data, answer with the stream of the ticket it names, wait again,
    until the peer leaves. Subclasses say which parts of a stream they send (:meth:`parts`).

    Hostile or silent clients (see :class:`ServeOptions`): a want_data or free_data frame larger than its
    limit is refused from its header (logged, rate-limited; answered with a ``request_too_large`` error when
    the transport can still send; the connection dropped); a connection that sends no complete want_data
    within ``want_data_timeout`` of connecting, leaves a later request unfinished that long, or sits idle
    (no request, no stream, no listed ranges held) for ``idle_timeout`` is dropped (logged at debug level).
    """

    role: Role = Role.COMBINED

    def __init__(
        self,
        catalog: Catalog,
        options: ServeOptions,
        *,
        transport: str = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        **transport_options: object,
    ) -> None:
        self.catalog = catalog
        self.options = options
        self.transport = transport
        self._host = host
        self._port = port
        self._transport_options = transport_options
        self._listener: Listener | None = None
        self._watched: dict[Connection, _Watch] = {}
        self._ticker: asyncio.TimerHandle | None = None
        self._drops: set[asyncio.Task[None]] = set()
        #: want_data requests refused for their token (``unauthorized``) since the server started.
        self.unauthorized = 0

    @abc.abstractmethod
    def parts(self, conn: Connection, dataset: Dataset, current: Callable[[], bool]) -> list[StreamPart]:
        """The parts of ``dataset``'s stream this server sends on ``conn`` (made per request).

        ``current()`` says whether ``dataset`` is still the one served under its name.
        """

    async def start(self) -> None:
        if self._listener is None:
            self._listener = await serve(
                self.transport, self._host, self._port, self.serve_connection, **self._transport_options
            )
            log.info("%s server listening on %s:%d", self.role.value, self.host, self.port)

    async def serve_connection(self, conn: Connection) -> None:
        """Answer ``conn``'s want_data requests until the peer leaves (or breaks a limit or deadline)."""
        SERVER.connections.inc(self.role.value, self.transport)
        options = self.options
        conn.limit_tag(options.want_data, options.max_ticket_bytes)
        if options.free_data is not None:
            conn.limit_tag(options.free_data, options.max_free_data_bytes)
        watch = self._watch(conn)
        try:
            await self._serve_requests(conn, watch)
        finally:
            self._watched.pop(conn, None)

    async def _serve_requests(self, conn: Connection, watch: _Watch | None) -> None:
        while True:
            try:
                request = await conn.recv_tagged(self.options.want_data)
            except ResourceError as e:
                await self._refuse(conn, e)
                return
            except TransportError:
                return
            SERVER.want_data.inc(self.role.value)
            if watch is not None:
                watch.first = False
                watch.streaming = True
            try:
                await self._answer(conn, request)
            finally:
                if watch is not None:
                    watch.streaming = False
                    watch.since = time.monotonic()

    async def _answer(self, conn: Connection, request: TaggedMessage) -> None:
        """One want_data request: the ticket's stream, or an error."""
        ticket: bytes | str = bytes(request.view())
        # this request's lines carry it (and the connection's own, from its transport), until the next one
        conn.stream_id = sid = new_stream_id()
        stream_id.set(sid)
        if not ticket:
            # The health probe (dissoc.health): answered at once, before any token check; a want_data, not a
            # refusal.
            log.debug("empty want_data on %s: answered %s", conn.description, EMPTY_TICKET)
            await self.send_error(conn, encode_error(0, EMPTY_TICKET, "want_data carried no ticket"))
            return
        secret = self.options.secret
        if log.isEnabledFor(logging.DEBUG):
            # a signed ticket is a credential: not even part of it goes to the log
            shown = repr(ticket[:64]) if secret is None else f"<{len(ticket)} bytes>"
            log.debug("want_data tag=%s ticket=%s on %s", fmt_tag(request.tag), shown, conn.description)
        if secret is not None:
            try:
                # The dataset served is the one the signed ticket names (exactly: no prefix, no wildcard).
                ticket = secret.verify(ticket, scope="read", peer=getattr(conn, "peer_identity", None)).name
            except TokenError as e:
                await self._unauthorized(conn, e)
                return
        try:
            dataset = self.catalog.get(ticket)
        except DissocError as e:
            SERVER.refusals.inc("unknown_ticket")
            await self.send_error(conn, encode_error(0, "unknown_ticket", str(e)))
            return
        out = Outbox(conn, coalesce=same_every_time(dataset))
        # Taken before the first await: the dataset is the one the catalog just gave.
        parts = self.parts(conn, dataset, _served_now(self.catalog, dataset))
        await stream_dataset(
            out,
            dataset,
            parts,
            compression=self.options.compression,
            send_error=lambda message: self.send_error(conn, message),
            role=self.role.value,
        )

    async def _unauthorized(self, conn: Connection, error: TokenError) -> None:
        """A want_data whose ticket carries no valid token: counted, logged (rate-limited), answered with an
        ``unauthorized`` error that names neither the dataset nor anything of the secret; the connection
        stays open (a client may ask again with a valid ticket) and other clients are not affected."""
        self.unauthorized += 1
        SERVER.refusals.inc(UNAUTHORIZED)
        peer_log.log(
            logging.WARNING,
            ("unauthorized", self.role),
            "%s server refused want_data from %s: %s",
            self.role.value,
            conn.description,
            error,
        )
        await self.send_error(conn, encode_error(0, UNAUTHORIZED, f"ticket refused: {error}"))

    async def _refuse(self, conn: Connection, error: ResourceError) -> None:
        """A request over a limit: log it (rate-limited), tell the client if the connection still sends, and
        end the connection (the caller returns)."""
        SERVER.refusals.inc(
            "receive_budget" if isinstance(error, ReceiveBudgetError) else "request_too_large"
        )
        peer_log.log(logging.WARNING, ("refused", type(error)), "refusing %s: %s", conn.description, error)
        with contextlib.suppress(DissocError, TimeoutError):
            async with asyncio.timeout(1.0):
                await self.send_error(conn, encode_error(0, "request_too_large", str(error)))

    # ------------------------------------------------------------------------------------------- deadlines

    def _watch(self, conn: Connection) -> _Watch | None:
        options = self.options
        if options.want_data_timeout is None and options.idle_timeout is None:
            return None
        watch = _Watch(time.monotonic())
        self._watched[conn] = watch
        if self._ticker is None:
            self._schedule_tick()
        return watch

    def _tick_seconds(self) -> float:
        timeouts = [t for t in (self.options.want_data_timeout, self.options.idle_timeout) if t is not None]
        return min(1.0, max(0.05, min(timeouts) / 4))

    def _schedule_tick(self) -> None:
        self._ticker = asyncio.get_running_loop().call_later(self._tick_seconds(), self._tick)

    def _tick(self) -> None:
        self._ticker = None
        self._check_deadlines(time.monotonic())
        if self._watched:
            self._schedule_tick()

    def _holds_ranges(self, conn: Connection) -> bool:
        ledger = self.options.ledger
        return ledger is not None and ledger.live_bytes_of(conn) > 0

    def _check_deadlines(self, now: float) -> None:
        """Drop the connections past a deadline: no complete want_data ``want_data_timeout`` after connecting,
        a request begun and unfinished that long, or idle (nothing held) for ``idle_timeout``."""
        want_data_timeout = self.options.want_data_timeout
        idle_timeout = self.options.idle_timeout
        for conn, watch in list(self._watched.items()):
            if watch.streaming or conn.closed:
                continue
            reason = kind = ""
            if watch.first:
                if want_data_timeout is not None and now - watch.since > want_data_timeout:
                    reason = f"no complete want_data within {want_data_timeout} s of connecting"
                    kind = "want_data_timeout"
            else:
                frame = conn.idle_frame()
                if frame is None or frame != watch.frame:
                    watch.frame = frame
                    watch.frame_since = now
                elif want_data_timeout is not None and now - watch.frame_since > want_data_timeout:
                    reason = f"a request left unfinished for {want_data_timeout} s"
                    kind = "request_timeout"
                if not reason and idle_timeout is not None:
                    if self._holds_ranges(conn):
                        watch.since = now  # a client holding listed ranges will send free_data later
                    elif now - watch.since > idle_timeout:
                        reason = f"idle for {idle_timeout} s"
                        kind = "idle_timeout"
            if reason:
                SERVER.refusals.inc(kind)
                log.debug("dropping %s: %s", conn.description, reason)
                del self._watched[conn]
                task = asyncio.get_running_loop().create_task(conn.close())
                self._drops.add(task)
                task.add_done_callback(self._drops.discard)

    async def send_error(self, conn: Connection, message: bytes) -> None:
        """Errors go on the metadata stream; a data-only connection carries them as a tagged ERROR_TAG
        message (the project's error extension)."""
        if self.role is Role.DATA:
            await conn.send_tagged(ERROR_TAG, message)
        else:
            await conn.send(message)

    @property
    def host(self) -> str:
        return self._listener.host if self._listener is not None else self._host

    @property
    def port(self) -> int:
        return self._listener.port if self._listener is not None else self._port

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed (0 before :meth:`start` and after :meth:`close`)."""
        return self._listener.open_connections if self._listener is not None else 0

    def uri(self, **params: str) -> DissocURI:
        """The URI clients use to reach this server (with where pairs point, for a data server using them)."""
        served = self.options.served if self.role is not Role.METADATA else None
        private = self.options.private if self.role is not Role.METADATA else None
        if self._listener is not None:
            params = {**self._listener.uri_params(), **params}
        if served is not None:
            params = {**served.params, **params}
        memory = served.memory if served is not None else None
        if private is not None:
            # Each connection's arena is announced on it once want_data is accepted: nothing here to read.
            params = {**params, "arena": "private"}
            memory = private.memory
        return DissocURI(
            self.transport,
            self.host,
            self.port,
            self.options.want_data,
            self.options.free_data if memory is not None else None,
            remote_handle=served.remote_handle if served is not None else None,
            memory=memory,
            params=params,
        )

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
            await listener.wait_closed()


def _served_now(catalog: Catalog, dataset: Dataset) -> Callable[[], bool]:
    def current() -> bool:
        try:
            return catalog.get(dataset.name) is dataset
        except DissocError:
            return False

    return current
