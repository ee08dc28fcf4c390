"""The Dissociated IPC client: ask for a ticket, receive both streams concurrently, yield batches in order.

    table = dissoc.fetch("tcp://127.0.0.1:9000?want_data=1465007700", "trips")

    async for batch in dissoc.client.stream_batches(uri, "trips", data_uri=data_uri):
        ...

Metadata and bodies are matched by sequence number in :class:`dissoc.protocol.ClientStream`; each batch is
decoded over the memory its body was received into (no copy) as soon as it and everything before it are
complete. Memory is bounded: no more than ``max_in_flight_bytes`` of received bodies wait for the consumer,
and the transport stops reading from the socket beyond its own budget, so a slow consumer slows the server.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import pyarrow as pa

from dissoc.buffers import ALIGNMENT, DEFAULT_POOL, buffer_nbytes, default_allocator
from dissoc.codec import MessageDecoder, frame_room
from dissoc.connection_pool import own, owned, pool_of
from dissoc.errors import DissocError, ProtocolError, RemoteError, ResourceError, TransportError
from dissoc.flight.common import DEFAULT_TIMEOUT, is_flight_location
from dissoc.logs import new_stream_id, stream_id
from dissoc.memory.pairs import PairReader, open_pair_reader
from dissoc.metrics import CLIENT, Sample, Tally, register
from dissoc.protocol import (
    ARENA_TAG,
    BODY_ERROR,
    BODY_PACKED,
    BODY_PAIRS,
    PAIRS_HEADER_SIZE,
    PREFIX_SIZE,
    SEQ_HALF,
    SEQ_MAX,
    SEQ_MODULUS,
    ArenaAnnouncement,
    ClientState,
    ClientStream,
    ErrorMessage,
    MessageReady,
    MessageType,
    PairList,
    SchemaReceived,
    StreamEnded,
    body_type_of,
    decode_arena,
    decode_stream_message,
    encode_free,
    fmt_seq,
    next_seq,
    peek_prefix,
    seq_diff,
    seq_of,
)
from dissoc.tokens import is_signed, peek
from dissoc.transport import Connection, TaggedMessage, connect
from dissoc.uri import DissocURI

if TYPE_CHECKING:
    from dissoc.device import DeviceBatch
    from dissoc.device.landing import DeviceLanding

#: What a stream yields: host batches, or device batches with ``ClientOptions(landing="device")``.
Batch: TypeAlias = "pa.RecordBatch | DeviceBatch"

__all__ = [
    "ClientOptions",
    "FetchStats",
    "StreamReader",
    "close_idle_connections",
    "close_idle_connections_sync",
    "fetch",
    "fetch_async",
    "open_stream",
    "resolve_endpoints",
    "stream_batches",
]

log = logging.getLogger(__name__)

#: Metadata-stream messages whose sequence numbers follow the stream's order (errors are numbered after it).
_ORDERED_TYPES = frozenset({MessageType.END_OF_STREAM, MessageType.METADATA})
# The members the per-message paths compare with, as globals (an enum member looked up on its class costs a
# descriptor call each time).
_METADATA = MessageType.METADATA
_STREAMING = ClientState.STREAMING
_SEQ = struct.Struct("<I")  # a metadata message's sequence number, after its type byte

#: Bytes of batches decoded into one burst before it is handed to the consumer (see _stream_one).
_CHUNK_BYTES = 64 << 20

#: Tasks that outlive the call that started them (zero-copy sessions waiting for their batches to go).
_background: set[asyncio.Task[None]] = set()


class _LiveSessions:
    """The sessions reading now, for the client's gauges (:mod:`dissoc.metrics`, read at scrape time)."""

    def __init__(self) -> None:
        self._sessions: weakref.WeakSet[_Session] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, session: _Session) -> None:
        with self._lock:
            self._sessions.add(session)

    def discard(self, session: _Session) -> None:
        with self._lock:
            self._sessions.discard(session)

    def metrics_samples(self) -> Iterator[Sample]:
        with self._lock:
            sessions = list(self._sessions)
        yield "dissoc_client_streams_open", (), float(len(sessions))
        yield "dissoc_client_in_flight_bytes", (), float(sum(s.in_flight for s in sessions))


_live = _LiveSessions()
register(_live)


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """Client limits.

    ``timeout``: seconds to connect, and the longest silence tolerated while a stream is incomplete.
    ``max_in_flight_bytes``: received body bytes waiting for the consumer before reading pauses.
    ``max_buffered_bytes``: the transport's own read-ahead budget per connection.
    ``window``: how many sequence numbers metadata or bodies may run ahead of the next batch to release.
    ``ordered_metadata``: the metadata transport delivers in order (default: true for ``tcp`` and ``tls``),
    so a gap, a duplicate or a wrong end-of-stream count is an error at once; otherwise metadata may arrive in
    any order (the spec's sequence numbers allow it) and a gap is only reported when the timeout expires.
    ``ucx_path``: how a ``ucx`` connection is set up: ``"listener"`` (host:port, works across hosts),
    ``"address"`` (the URI's ``worker`` address, same host) or ``"auto"`` (the address path when the server's
    host is this machine).
    ``zero_copy``: pairs in shared memory (``memory=shm``) become batches over the mapped segment itself, no
    copy; each batch's ranges are freed when the batch is released, and the data connection stays open until
    every such batch is (the server would reuse the memory otherwise). Synchronous calls then run the stream
    on a background event loop that outlives the call. With ``landing="device"`` and ``memory=cuda`` pairs,
    batches are views over the server's device allocation (CUDA IPC), freed the same way.
    ``landing``: where batches land, whatever memory the server keeps them in: ``"host"`` (``pa.RecordBatch``)
    or ``"device"`` (:class:`dissoc.device.DeviceBatch`, CUDA memory through CuPy; needs the ``gpu`` extra and
    uncompressed bodies). See :mod:`dissoc.device.landing` for how each body gets there.
    ``flight_timeout``: seconds a Flight control plane (a ``grpc://`` location) may take to describe a
    dataset before the fetch fails.
    ``tls_ca``, ``tls_cert``, ``tls_key``: PEM files for ``tls://`` URIs and ``grpc+tls://`` control planes:
    the CA bundle the server's certificate must be signed by (None: the system's trusted roots), and this
    client's certificate and key for servers that require one (mutual TLS). A ``tcp://`` URI is plaintext
    whatever these say.
    ``token``: a signed ticket (:mod:`dissoc.tokens`, ``dissoc token``) for servers started with a secret.
    A Flight control plane gets it as ``authorization: Bearer TOKEN`` and hands back endpoints with tickets
    it signed; a dissoc URI gets it in place of the ticket when the ticket is the dataset's name the token
    is for (a ticket that is already signed is sent as it is). A signed ticket given as the ticket to a
    Flight location, with no ``token``, is used as the bearer token for the name it carries.
    ``reuse_connections``: a stream of packed bodies that ended cleanly leaves its connections to the next
    stream to the same server from the same event loop, as the server waits for another request on them;
    they are dropped after 5 s unused (see :mod:`dissoc.connection_pool`). None (the default): only in the
    loop the synchronous API runs (the main thread's, closed at exit); True: in any loop (close them with
    :func:`close_idle_connections` before the loop ends); False: every stream connects afresh and closes
    its connections.
    """

    timeout: float = 30.0
    max_in_flight_bytes: int = 256 << 20
    max_buffered_bytes: int = 64 << 20
    window: int = 4096
    validate: bool = True
    ordered_metadata: bool | None = None
    ucx_path: str = "auto"
    zero_copy: bool = False
    landing: str = "host"
    flight_timeout: float | None = DEFAULT_TIMEOUT
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    reuse_connections: bool | None = None


@dataclass(slots=True)
class FetchStats:
    """What one stream carried."""

    batches: int = 0
    rows: int = 0
    bytes: int = 0


async def settle(timeout: float = 5.0) -> None:
    """Wait (up to ``timeout`` s) for this loop's zero-copy sessions to end: each ends when the batches over
    the server's memory are released, after it has sent their free_data. Call it before the loop closes, so
    that no session is cut off with frees unsent."""
    loop = asyncio.get_running_loop()
    mine = [t for t in _background if t.get_loop() is loop and not t.done()]
    if mine:
        await asyncio.wait(mine, timeout=timeout)


def _ticket_bytes(ticket: str | bytes) -> bytes:
    return ticket.encode() if isinstance(ticket, str) else bytes(ticket)


def _as_uri(uri: str | DissocURI) -> DissocURI:
    return uri if isinstance(uri, DissocURI) else DissocURI.parse(uri)


async def open_connection(uri: DissocURI, options: ClientOptions) -> Connection:
    """A fresh connection to ``uri``'s server with ``options``' transport settings (TLS files, UCX path,
    read-ahead budget), within ``options.timeout``; failures are :class:`~dissoc.errors.TransportError`."""
    extra: dict[str, Any] = {}
    if uri.scheme == "ucx":
        extra = {"worker": uri.params.get("worker"), "path": options.ucx_path}
    elif uri.scheme == "tls":
        from dissoc.transport.tls import cached_client_context

        extra = {"tls": cached_client_context(options.tls_ca, options.tls_cert, options.tls_key)}
    try:
        return await asyncio.wait_for(
            connect(
                uri.scheme,
                uri.host,
                uri.port,
                max_buffered_bytes=options.max_buffered_bytes,
                **extra,
            ),
            options.timeout,
        )
    except TimeoutError:
        raise TransportError(
            f"connecting to {uri.host}:{uri.port}: no answer within {options.timeout} s"
        ) from None
    except OSError as e:
        raise TransportError(f"connecting to {uri.host}:{uri.port} failed: {e}") from None


class _Taker:
    """Takes one connection's messages for a session as they arrive (see ``Connection.set_receiver``):
    untagged ones are metadata-stream messages where ``metadata``, tagged ones bodies where ``bodies``."""

    __slots__ = ("bodies", "conn", "metadata", "session")

    def __init__(self, session: _Session, conn: Connection, *, metadata: bool, bodies: bool) -> None:
        self.session = session
        self.conn = conn
        self.metadata = metadata
        self.bodies = bodies

    def on_message(self, tag: int | None, payload: Any, nbytes: int) -> bool:
        session = self.session
        if session.done:
            return False
        if tag is None:
            return self.metadata and session.take_metadata(self.conn, payload)
        return self.bodies and session.take_body(self.conn, tag, payload, nbytes)

    def on_staged(self, tag: int, staged: memoryview) -> bool:
        session = self.session
        if session.done or not self.bodies:
            return False
        return session.take_staged(self.conn, tag, staged)

    def on_untagged_run(self, messages: list[bytes]) -> int:
        session = self.session
        if session.done or not self.metadata:
            return 0
        return session.take_metadata_run(self.conn, messages)

    def on_failure(self, exc: DissocError) -> None:
        self.session.connection_failed(exc)


class _PairTaker(_Taker):
    """A :class:`_Taker` for a connection that carries both streams: it also takes a metadata message and
    its body in one call (``StagingReceiver.on_pair``)."""

    __slots__ = ()

    def on_pair(self, untagged: bytes, tag: int, staged: memoryview) -> bool:
        session = self.session
        if session.done:
            return False
        return session.take_pair(self.conn, untagged, tag, staged)


def _copied(staged: memoryview) -> Any:
    """A payload still in a transport's buffer, copied out into a pooled one (as the transport would)."""
    body = DEFAULT_POOL.allocate(len(staged))
    body.data[:] = staged
    return body


#: Bytes of a session's landing slab (see ``_Session._land``).
_LANDING_SLAB = 1 << 20
_NO_SLAB = pa.py_buffer(b"")


#: A batch decoded as its message was released (packed host bodies), with its body's size: what the consumer
#: is handed in place of the :class:`MessageReady` it would decode itself (a plain tuple: one per batch).
_Decoded: TypeAlias = "tuple[pa.RecordBatch, int]"


class _Session:
    """One stream's state on the client: connections, the sans-IO stream, the decoder, flow control.

    Messages are taken inside the transports' reading callbacks (``_Taker``): each wake-up of a connection
    runs every message it brought through the stream at once, and the consumer is woken once for all the
    events they released.
    """

    def __init__(
        self,
        meta_uri: DissocURI,
        data_uri: DissocURI,
        ticket: bytes,
        options: ClientOptions,
        *,
        pooled: bool = True,
    ) -> None:
        self.meta_uri = meta_uri
        self.data_uri = data_uri
        self.split = (meta_uri.scheme, meta_uri.host, meta_uri.port) != (
            data_uri.scheme,
            data_uri.host,
            data_uri.port,
        )
        self.ticket = ticket
        self.options = options
        self.decoder = MessageDecoder(validate=options.validate)
        self.stream = ClientStream(self.decoder.has_body, window=options.window, max_pending_bytes=1 << 62)
        self.ready: deque[MessageReady | SchemaReceived | StreamEnded | _Decoded | BaseException] = deque()
        self._wakeup: asyncio.Future[None] | None = None
        self.in_flight = 0
        self.reading_paused = False
        self.meta_conn: Connection | None = None
        self.data_conn: Connection | None = None
        self.conns: list[Connection] = []
        self.failure: TransportError | None = None  # the stream's connection failed
        self.done = False  # failed, finished or closed: the takers take nothing more
        self.metadata_done = False
        # Input ahead of the reorder window, waiting for releases (its connection is paused meanwhile).
        self.stalled_metadata: deque[Any] = deque()
        self.stalled_bodies: deque[tuple[int, Any, int]] = deque()
        self.stalled_bytes = 0
        self._retrying = False
        self._retry_at = 0  # (see _metadata_fits)
        # Where small bodies land (see _land): a slab of this session's, carved in order; each batch keeps
        # the slab it landed in alive, and the pool hands the slab out again once none does.
        self._land_pos = _LANDING_SLAB
        self._land_view = memoryview(b"")
        self._land_slab = _NO_SLAB
        # Metadata messages that run in sequence from the next one to release wait here for their bodies, so
        # that each pair goes through the stream in one step (the common case; anything out of sequence
        # sends what is held through the stream, which sorts it out). Once the stream has started.
        self.pairing = False
        self.held: deque[tuple[int, Any]] = deque()
        # The end-of-stream message, when it came while metadata was held: it goes through the stream once
        # the held run is done (else the last window's worth of messages would go through the stream alone).
        self._held_eos: Any = None
        # Packed bodies landing in host memory are decoded as they are released (see _decode_now).
        self.express = options.landing == "host" and data_uri.memory is None
        self.schema_decoded = False  # (by _decode_now, for the consumer's decode to skip)
        # Connections carrying packed bodies come from, and go back to, the loop's pool (connection_pool).
        # (zero-copy batches keep the server's ranges, tied to the connection, until they are released)
        self.pooled = (
            pooled
            and options.reuse_connections is not False
            and not options.zero_copy
            and options.landing == "host"
        )
        self.reused = False  # some connection came from the pool
        self.errored = False
        self.stats = FetchStats()
        self._flush_scheduled = False
        ordered = options.ordered_metadata
        self.ordered = meta_uri.scheme in ("tcp", "tls") if ordered is None else ordered
        self.expected_meta = 0
        self.pairs: PairReader | None = None
        self.to_free: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.device: DeviceLanding | None = None
        if options.landing == "device":
            from dissoc.device.landing import DeviceLanding

            self.device = DeviceLanding(validate=options.validate)
        elif options.landing != "host":
            raise DissocError(f"landing: expected 'host' or 'device', got {options.landing!r}")
        # A private arena (the URI says arena=private) is announced on the data connection once want_data
        # was accepted (_arena); any other is named in the URI itself.
        self._arena: tuple[str, bytes | None, tuple[tuple[str, str], ...]] | None = None
        if data_uri.memory is not None and data_uri.params.get("arena") != "private":
            self.pairs = open_pair_reader(
                data_uri, zero_copy=options.zero_copy, on_release=self._released, timeout=options.timeout
            )
            self._arena = _arena_key(data_uri)

    def _released(self, offsets: list[int]) -> None:
        """A zero-copy batch was released (in any thread): free its ranges from the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
            loop.call_soon_threadsafe(self._free_later, offsets)

    def _free_later(self, offsets: list[int]) -> None:
        self.to_free.extend(offsets)
        if not self._flush_scheduled and self.data_conn is not None:
            # One flush for every release that happens before it runs (free_data messages are coalesced).
            self._flush_scheduled = True
            task = asyncio.get_running_loop().create_task(self._flush_quietly())
            _background.add(task)
            task.add_done_callback(_background.discard)

    async def _flush_quietly(self) -> None:
        self._flush_scheduled = False
        with contextlib.suppress(DissocError):
            await self.flush_frees()

    async def _connect(self, uri: DissocURI) -> Connection:
        return await open_connection(uri, self.options)

    def _pool_key(self, uri: DissocURI) -> Hashable:
        o = self.options
        return (
            uri.scheme,
            uri.host,
            uri.port,
            uri.params.get("worker"),
            o.ucx_path,
            o.tls_ca,
            o.tls_cert,
            o.tls_key,
            o.max_buffered_bytes,
        )

    async def _open(self, uri: DissocURI) -> Connection:
        if self.pooled:
            conn = await pool_of(asyncio.get_running_loop()).take(self._pool_key(uri))
            if conn is not None:
                self.reused = True
                return conn
        return await self._connect(uri)

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        if self.pooled and self.options.reuse_connections is None and not owned(loop):
            self.pooled = False  # an application's loop: pooling is asked for explicitly there
        meta = await self._open(self.meta_uri)
        self.conns.append(meta)
        data = meta
        if self.split:
            data = await self._open(self.data_uri)
            self.conns.append(data)
        self.meta_conn, self.data_conn = meta, data
        for conn in self.conns:  # the transport's own lines about them name this stream
            conn.stream_id = stream_id.get()
        device = self.device
        if device is not None and device.receives_on_device and data.device_memory:
            # Packed bodies go straight into device memory; the small tagged messages (pairs, errors) stay
            # on the host, where they are parsed.
            def allocate(tag: int, length: int) -> Any:
                if body_type_of(tag) == BODY_PACKED:
                    return device.allocate(length)
                return default_allocator(tag, length)

            data.set_allocator(allocate)
        if self.split:
            meta.set_receiver(_Taker(self, meta, metadata=True, bodies=False))
            data.set_receiver(_Taker(self, data, metadata=False, bodies=True))
        else:
            meta.set_receiver(_PairTaker(self, meta, metadata=True, bodies=True))
        self.pairing = True
        await meta.send_tagged(self.meta_uri.want_data, self.ticket)
        if self.split:
            await data.send_tagged(self.data_uri.want_data, self.ticket)

    # -- taking messages (inside the transports' reading callbacks; never raise) ---------------------------

    def _wake(self) -> None:
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _failed(self, exc: BaseException) -> None:
        """End the stream with ``exc``, handed to the consumer, which raises it."""
        if self.done:
            return
        self.done = True
        self.errored = True
        if isinstance(exc, TransportError):
            # The server is gone: a burst of batches already handed over must not delay the error until
            # the consumer has worked through it (see _Chunk).
            self.failure = exc
        self.ready.append(exc)
        self._wake()

    def connection_failed(self, exc: DissocError) -> None:
        if not self.done and not self.stream.finished:
            if self.held:
                try:
                    self._flush_held()
                except BaseException as error:
                    self._failed(error)
                    return
            self._failed(exc)

    def _publish(self, events: list[Any]) -> None:
        if events:
            if self.express:
                self._decode_now(events)
            else:
                self.ready.extend(events)
            self._wake()
            if self.stream.finished:
                self.done = True
            elif (self.stalled_bodies or self._metadata_fits()) and not self._retrying:
                self._retry_stalled()

    def _decode_now(self, events: list[Any]) -> None:
        """Decode released messages as they are released (express sessions: packed bodies in host memory),
        in release order, so that the decoder's state (schema, dictionaries) is always the one the next
        message follows; the consumer is handed the batches (:class:`_Decoded`) and the other events."""
        ready = self.ready
        decoder = self.decoder
        for ev in events:
            kind = type(ev)
            if kind is MessageReady:
                if ev.body_type != BODY_PACKED:
                    self.decode(ev)  # raises what the consumer's decoding would (no arena, unknown type)
                    continue
                body = ev.body
                n = buffer_nbytes(body)
                batch = decoder.decode(ev.metadata, body)
                if batch is None:  # a dictionary batch: nothing to hand over, nothing held
                    self.in_flight -= n
                else:
                    ready.append((batch, n))
            else:
                if kind is SchemaReceived:
                    decoder.decode(ev.metadata)
                    self.schema_decoded = True
                ready.append(ev)

    def _ahead(self, seq: int) -> bool:
        """Whether input for ``seq`` must wait for releases (ahead of the reorder window).

        A sequence number already released is passed on at once (the stream then reports the duplicate),
        and one far beyond anything a window could need is an error rather than a wait that only a timeout
        ends.
        """
        if self.stream.classify(seq) <= 0:
            return False
        ahead = seq_diff(seq, self.stream.next_seq)
        if ahead >= 4 * self.options.window:
            raise ResourceError(
                f"message {fmt_seq(seq)} is {ahead} sequence numbers ahead of the next one to release "
                f"({fmt_seq(self.stream.next_seq)}); at most {self.options.window} may be pending"
            )
        return True

    def take_pair(self, conn: Connection, buf: bytes, tag: int, staged: memoryview) -> bool:
        """A metadata message and the tagged message after it, from one connection (see ``on_pair``;
        ``staged`` is the tagged payload in the transport's buffer). In the common case (the next message, a
        packed body, nothing held or waiting) the body is landed after room for its framing and the message
        released and decoded at once (``MessageDecoder.decode_landed``); otherwise both are taken one by
        one. False (nothing taken) once the metadata stream is done."""
        nbytes = len(staged)
        if (
            self.express
            and len(buf) > PREFIX_SIZE
            and buf[0] == _METADATA
            and not self.held
            and not self.stalled_metadata
            and not self.stalled_bodies
            and not self.metadata_done
        ):
            seq = _SEQ.unpack_from(buf, 1)[0]
            if seq == tag and (seq == self.expected_meta or not self.ordered):
                metadata = buf[PREFIX_SIZE:]
                try:
                    if self.stream.release_packed(seq, metadata, nbytes):
                        self.expected_meta = (seq + 1) & SEQ_MAX
                        self._land(metadata, staged, nbytes)
                        return True
                except BaseException as exc:  # handed to the consumer, which raises it
                    self._failed(exc)
                    return True
        if not self.take_metadata(conn, buf):
            return False
        self.take_body(conn, tag, _copied(staged), nbytes)
        return True

    def _land(self, metadata: bytes, staged: memoryview, nbytes: int) -> None:
        """A released message's body, still in the transport's buffer: landed after room for its framing and
        decoded in place (``MessageDecoder.landing`` where the layout leaves nothing in the body to check,
        else ``decode_landed``); the batch is handed over."""
        decoder = self.decoder
        plain = decoder.landing(metadata)
        room = frame_room(len(metadata)) if plain is None else plain.room
        need = room + nbytes
        pos = self._land_pos
        if pos + need > _LANDING_SLAB:
            if need > _LANDING_SLAB // 4:  # a large body: an allocation of its own
                landing = DEFAULT_POOL.allocate(need)
                landing.data[room:] = staged
                self._hand_over(decoder.decode_landed(metadata, pa.py_buffer(landing)), nbytes)
                return
            slab = DEFAULT_POOL.allocate(_LANDING_SLAB)  # (an idle pooled one, once nothing uses it)
            self._land_view = slab.data
            self._land_slab = pa.py_buffer(slab)
            pos = 0
        end = pos + need
        view = self._land_view
        view[pos + room : end] = staged
        self._land_pos = (end + ALIGNMENT - 1) & -ALIGNMENT
        if plain is not None:
            # nothing to check in the body: the framing before it, and one read of a slice of the slab (whose
            # batches then hold the slab through pyarrow alone)
            view[pos : pos + room] = plain.head
            self._hand_over(plain.read(self._land_slab.slice(pos, need)), nbytes)
        else:
            self._hand_over(decoder.decode_landed(metadata, pa.py_buffer(view[pos:end])), nbytes)

    def _hand_over(self, batch: pa.RecordBatch | None, nbytes: int) -> None:
        """A batch decoded as its message was released without an event goes to the consumer (None: a
        dictionary batch, nothing to hand over); reading pauses once enough waits, and input that waited for
        the window goes on, as :meth:`_publish` has it for released events."""
        if batch is not None:
            self.ready.append((batch, nbytes))
            waiter = self._wakeup  # (what _wake does)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            self.in_flight += nbytes
            if self.in_flight >= self.options.max_in_flight_bytes:
                self._update_pause()
        if (self.stalled_bodies or (self.stalled_metadata and self._metadata_fits())) and not self._retrying:
            self._retry_stalled()

    def _metadata_fits(self) -> bool:
        """Whether enough metadata that waited for the window fits it now to be worth passing on: a quarter of
        the window beyond the first waiting message (one at a time, each release would take a trip through
        the stalled path and resume the metadata connection for one message)."""
        return bool(self.stalled_metadata) and (self.stream.next_seq - self._retry_at) & SEQ_MAX < SEQ_HALF

    def _stall_metadata_from(self, seq: int) -> None:
        """Metadata message ``seq`` is the first to wait for the window: when to pass it on (see above)."""
        window = self.options.window
        self._retry_at = (seq - window + 1 + window // 4) & SEQ_MAX

    def take_staged(self, conn: Connection, tag: int, staged: memoryview) -> bool:
        """A tagged message still in the transport's buffer (see ``on_staged``): the body of the first held
        metadata message, released and decoded at once, in the common case; otherwise copied out and taken
        as any other."""
        held = self.held
        nbytes = len(staged)
        if self.express and held and tag == held[0][0] and type(held[0][1]) is bytes:
            metadata = held[0][1][PREFIX_SIZE:]
            try:
                if self.stream.release_packed(tag, metadata, nbytes):
                    held.popleft()
                    self._land(metadata, staged, nbytes)
                    if not held and self._held_eos is not None:
                        self._end_if_due()
                    return True
            except BaseException as exc:  # handed to the consumer, which raises it
                self._failed(exc)
                return True
        return self.take_body(conn, tag, _copied(staged), nbytes)

    def take_metadata_run(self, conn: Connection, messages: list[bytes]) -> int:
        """Metadata messages that came back to back: how many of them, from the first on, are the next in a
        held run inside the window (the fast case of :meth:`take_metadata`, checked per message, with what
        cannot change during the run checked once); the others go to :meth:`take_metadata` one by one. The
        first of a run that finds nothing held (a stream's first batch) goes to it too."""
        taken = 0
        if not self.held and messages:
            if not self.take_metadata(conn, messages[0]):
                return 0
            taken = 1
        held = self.held
        stream = self.stream
        if (
            self.metadata_done
            or not held
            or self._held_eos is not None
            or self.stalled_metadata
            or self.stalled_bodies
            or stream.state is not _STREAMING
            or self.done
        ):
            return taken
        last = held[-1][0]
        expected = self.expected_meta
        ordered = self.ordered
        next_seq = stream.next_seq
        window = self.options.window
        append = held.append
        for buf in itertools.islice(messages, taken, None):
            if len(buf) <= PREFIX_SIZE or buf[0] != _METADATA:
                break
            seq = _SEQ.unpack_from(buf, 1)[0]
            if (
                seq != (last + 1) & SEQ_MAX
                or (ordered and seq != expected)
                or (seq - next_seq) & SEQ_MAX >= window
            ):
                break
            append((seq, buf))
            last = seq
            expected = (seq + 1) & SEQ_MAX
            taken += 1
        self.expected_meta = expected
        return taken

    def take_metadata(self, conn: Connection, buf: Any) -> bool:
        if self.metadata_done:
            return False
        held = self.held
        if held and type(buf) is bytes and len(buf) > PREFIX_SIZE and buf[0] == _METADATA:
            # The common case of a metadata stream running ahead of its bodies: the next in a held run,
            # inside the window (what _check_order, _ahead and _hold would find, in fewer steps).
            seq = _SEQ.unpack_from(buf, 1)[0]
            stream = self.stream
            if (
                seq == (held[-1][0] + 1) & SEQ_MAX
                and (seq == self.expected_meta or not self.ordered)
                and self._held_eos is None
                and not self.stalled_metadata
                and not self.stalled_bodies
                and stream.state is _STREAMING
                and (seq - stream.next_seq) & SEQ_MAX < self.options.window
            ):
                self.expected_meta = (seq + 1) & SEQ_MAX
                held.append((seq, buf))
                return True
        try:
            if self._held_eos is not None:  # nothing comes after the end of stream: the stream judges it
                self._flush_held()
            prefix = peek_prefix(buf)
            if prefix is not None and prefix[0] in _ORDERED_TYPES:
                kind, seq = prefix
                if self.ordered:
                    self._check_order(kind, seq)
                if kind == MessageType.END_OF_STREAM and self.held and self._held_eos is None:
                    self._held_eos = buf
                    return True
                if kind == MessageType.METADATA and (self.stalled_metadata or self._ahead(seq)):
                    if not self.stalled_metadata:
                        self._stall_metadata_from(seq)
                    self.stalled_metadata.append(buf)
                    self._stalled(conn, len(buf))
                    return True
                if kind == MessageType.METADATA and self._hold(seq, buf):
                    return True
            if self.held:
                self._flush_held()
            self._metadata(buf)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._failed(exc)
        return True

    def _hold(self, seq: int, buf: Any) -> bool:
        """Hold metadata message ``seq`` for its body (pairing), if it runs on from the next one to release;
        False: it goes through the stream on its own."""
        if not self.pairing or self.stalled_bodies:
            return False
        held = self.held
        if held:
            if seq == (held[-1][0] + 1) & SEQ_MAX:
                held.append((seq, buf))
                return True
            return False
        stream = self.stream
        if seq == stream.next_seq and stream.state is ClientState.STREAMING and stream.pending_bytes == 0:
            held.append((seq, buf))
            return True
        return False

    def _flush_held(self) -> None:
        """The held metadata messages go through the stream on their own (what came next did not pair)."""
        held = self.held
        while held:
            self._metadata(held.popleft()[1])
        self._end_if_due()

    def _end_if_due(self) -> None:
        """The held end-of-stream message goes through the stream once no metadata is held or waits."""
        if self._held_eos is not None and not self.held and not self.stalled_metadata:
            eos, self._held_eos = self._held_eos, None
            self._metadata(eos)

    def _metadata(self, buf: Any) -> None:
        stream = self.stream
        self._publish(stream.receive_metadata_message(buf))
        # Done once the end of stream and all metadata before it are in; the server keeps the connection
        # open for the next request.
        if stream.metadata_complete or stream.finished:
            self.metadata_done = True

    def _check_order(self, kind: int, seq: int) -> None:
        """On an ordered transport every metadata message has the next number, and EOS carries the count."""
        if seq != self.expected_meta:
            what = "end of stream" if kind == MessageType.END_OF_STREAM else "metadata message"
            # Those received are the seqs before the expected one (fewer than 2**32 in any real stream).
            if (self.expected_meta - seq) % SEQ_MODULUS <= self.expected_meta:
                why = "a duplicate of one already received"
            else:
                why = f"a jump {(seq - self.expected_meta) % SEQ_MODULUS} ahead: messages were skipped"
            raise ProtocolError(
                f"metadata stream: expected {what} {fmt_seq(self.expected_meta)}, got {fmt_seq(seq)} "
                f"(the transport delivers in order, so this is {why})"
            )
        if kind == MessageType.METADATA:
            self.expected_meta = next_seq(seq)

    def take_body(self, conn: Connection, tag: int, payload: Any, nbytes: int) -> bool:
        try:
            if body_type_of(tag) == BODY_ERROR:
                err = decode_stream_message(TaggedMessage(tag, payload).view())
                if isinstance(err, ErrorMessage):
                    raise RemoteError(err.code, err.message)
                raise ProtocolError(f"data stream: an error tag carried a {type(err).__name__}, not an error")
            if tag == ARENA_TAG:
                self._arena_announced(decode_arena(TaggedMessage(tag, payload).view()))
                return True
            held = self.held
            if held:
                if tag == held[0][0]:  # a packed body (type 0: the tag is the seq) for the first held
                    buf = held.popleft()[1]
                    if self.express and type(buf) is bytes:
                        # released without an event and decoded at once (see _decode_now)
                        metadata = buf[PREFIX_SIZE:]
                        if self.stream.release_packed(tag, metadata, nbytes):
                            self._hand_over(self.decoder.decode(metadata, payload), nbytes)
                            if not held and self._held_eos is not None:
                                self._end_if_due()
                            return True
                    self.in_flight += nbytes
                    self._publish(self.stream.receive_message_with_body(buf, tag, payload, nbytes))
                    self._update_pause()
                    if not held and self._held_eos is not None:
                        self._end_if_due()
                    return True
                self._flush_held()
            self.in_flight += nbytes
            if self.stalled_bodies or self._ahead(seq_of(tag)):
                self.stalled_bodies.append((tag, payload, nbytes))
                self._stalled(conn, nbytes)
            else:
                self._publish(self.stream.receive_body(tag, payload, nbytes))
                self._update_pause()
        except BaseException as exc:  # handed to the consumer, which raises it
            self._failed(exc)
        return True

    def _stalled(self, conn: Connection, nbytes: int) -> None:
        """Input from ``conn`` waits for the window: its connection pauses, unless it carries both streams
        (then what it waits for comes after it on the same connection), where the waiting bytes are bounded
        by ``max_in_flight_bytes`` instead."""
        self.stalled_bytes += nbytes
        if conn is self.meta_conn and conn is self.data_conn:
            if self.stalled_bytes > self.options.max_in_flight_bytes:
                raise ResourceError(
                    f"{self.stalled_bytes} bytes arrived ahead of the reorder window (window "
                    f"{self.options.window}), more than max_in_flight_bytes "
                    f"({self.options.max_in_flight_bytes})"
                )
            return
        self._update_pause()

    def _retry_stalled(self) -> None:
        """Pass on the input that waited for the window, as far as the window now allows."""
        self._retrying = True
        try:
            progress = True
            while progress and not self.done:
                progress = False
                stream = self.stream
                while self.stalled_metadata:
                    buf = self.stalled_metadata[0]
                    prefix = peek_prefix(buf)
                    if prefix is not None and self._ahead(prefix[1]):
                        self._stall_metadata_from(prefix[1])
                        break
                    self.stalled_metadata.popleft()
                    self.stalled_bytes -= len(buf)
                    # held for its body as if it had just come (else, once in the stream, every later
                    # message would meet a stream holding something, and none would pair again)
                    if prefix is None or prefix[0] != MessageType.METADATA or not self._hold(prefix[1], buf):
                        if self.held:
                            self._flush_held()
                        self._metadata(buf)
                    progress = True
                while self.stalled_bodies and not self.done:
                    tag, payload, nbytes = self.stalled_bodies[0]
                    if self._ahead(seq_of(tag)):
                        break
                    self.stalled_bodies.popleft()
                    self.stalled_bytes -= nbytes
                    events = stream.receive_body(tag, payload, nbytes)
                    if self.express:
                        self._decode_now(events)
                    else:
                        self.ready.extend(events)
                    progress = True
            self._end_if_due()
            if self.stream.finished:
                self.done = True
            self._wake()
            self._update_pause()
        except BaseException as exc:
            self._failed(exc)
        finally:
            self._retrying = False

    def _update_pause(self) -> None:
        """Pause the connections that must wait: the data connection while enough bodies wait for the
        consumer (resumed at half) or some wait for the window, the metadata one while metadata waits."""
        meta, data = self.meta_conn, self.data_conn
        limit = self.options.max_in_flight_bytes
        if self.reading_paused:
            if self.in_flight <= limit // 2:
                self.reading_paused = False
        elif self.in_flight >= limit:
            # Enough bodies wait for the consumer: stop reading (TCP then pushes back on the server).
            self.reading_paused = True
        pauses: tuple[tuple[Connection | None, bool], ...]
        if meta is data:
            # One connection carries both streams: only the consumer's pace pauses it (see _stalled).
            pauses = ((data, self.reading_paused),)
        else:
            pauses = (
                (data, self.reading_paused or bool(self.stalled_bodies)),
                (meta, bool(self.stalled_metadata)),
            )
        for conn, paused in pauses:
            if conn is None:
                continue
            if paused:
                conn.pause_reading()
            else:
                conn.resume_reading()

    # -- the consumer's side ---------------------------------------------------------------------------------

    async def next_event(self) -> MessageReady | SchemaReceived | StreamEnded | _Decoded:
        """The next event for the consumer; silence longer than the timeout while it waits is an error."""
        ready = self.ready
        deadline = None
        while not ready:  # (a wake-up may have released nothing to hand over: a dictionary batch)
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.options.timeout
            waiter = self._wakeup = loop.create_future()
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except TimeoutError:
                if self.held:  # nothing followed them: let the stream see them before it is asked
                    with contextlib.suppress(DissocError):
                        self._flush_held()
                missing = [fmt_seq(m) for m in self.stream.missing()[:8]]
                if self.stream.state is ClientState.ENDED and not self.stream.metadata_complete:
                    # The server said how many messages it sent, and metadata for some never came.
                    raise ProtocolError(
                        f"the stream ended, but after {self.options.timeout} s messages are still missing: "
                        f"{missing}"
                    ) from None
                raise TransportError(
                    f"nothing arrived within {self.options.timeout} s (waiting for message "
                    f"{fmt_seq(self.stream.next_seq)}; missing {missing})"
                ) from None
            finally:
                self._wakeup = None
                del waiter
        ev = ready.popleft()
        if isinstance(ev, BaseException):
            raise ev
        return ev

    def _arena_announced(self, arena: ArenaAnnouncement) -> None:
        """The data server named the arena this connection's pair lists point into (private arenas): open a
        reader for it, before any of those pair lists is read."""
        uri = self.data_uri
        if uri.memory != arena.memory:
            raise ProtocolError(
                f"arena announcement: expected memory={uri.memory} as the data URI says, got {arena.memory!r}"
            )
        announced = dataclasses.replace(uri, remote_handle=arena.remote_handle, params=arena.params)
        key = _arena_key(announced)
        if self._arena is not None:
            if key != self._arena:  # a repeat (each stream announces the connection's arena) changes nothing
                raise ProtocolError(
                    "arena announcement: the data server named a second arena on one connection"
                )
            return
        self.pairs = open_pair_reader(
            announced,
            zero_copy=self.options.zero_copy,
            on_release=self._released,
            timeout=self.options.timeout,
        )
        self._arena = key

    def decode(self, ev: MessageReady | SchemaReceived) -> Batch | None:
        if isinstance(ev, SchemaReceived):
            if self.schema_decoded:
                return None
            if self.device is not None:
                self.device.schema(ev.metadata)
            return self.decoder.decode(ev.metadata)
        body = ev.body
        # What the body reader counted in flight goes back now, pair lists included (reading paused on them
        # too, and before this never resumed).
        n = (
            0
            if body is None
            else (_pairs_nbytes(body) if isinstance(body, PairList) else buffer_nbytes(body))
        )
        self.in_flight -= n
        if self.reading_paused:
            self.resume_if_drained()
        if ev.body_type == BODY_PAIRS:
            return self._decode_pairs(ev)
        if ev.body_type != BODY_PACKED:
            raise ProtocolError(f"message {fmt_seq(ev.seq)}: unknown body type {ev.body_type}")
        batch: Batch | None
        if self.device is not None:
            batch = self.device.packed(ev.metadata, body)
        else:
            batch = self.decoder.decode(ev.metadata, body)
        if batch is not None:
            self.stats.batches += 1
            self.stats.rows += batch.num_rows
            self.stats.bytes += n
        return batch

    def resume_if_drained(self) -> None:
        """Reading was paused on the bodies held for the consumer: resume once they went down to half."""
        if self.in_flight <= self.options.max_in_flight_bytes // 2:
            self._update_pause()

    def _decode_pairs(self, ev: MessageReady) -> Batch | None:
        """Body type 1: read the listed ranges (copy, zero-copy or RMA); free what is done."""
        if self.pairs is None:
            where = (
                "the data server announced no arena"
                if self.data_uri.memory is not None
                else "the data URI names no memory"
            )
            raise ProtocolError(f"message {fmt_seq(ev.seq)}: address/length pairs, but {where} for them")
        pairs = ev.body
        assert isinstance(pairs, PairList)
        batch: Batch | None
        if self.device is not None:
            batch, done = self.device.pairs(ev.metadata, pairs, self.pairs)
            self.to_free.extend(done)
        else:
            buffers, done = self.pairs.read(pairs)
            self.to_free.extend(done)
            batch = self.decoder.decode_scattered(ev.metadata, buffers)
        if batch is not None:
            self.stats.batches += 1
            self.stats.rows += batch.num_rows
            self.stats.bytes += int(pairs.total)
        return batch

    async def flush_frees(self) -> None:
        """Send the addresses freed so far as one free_data message.

        A connection that is gone cannot take it, and needs none: a server releases what it listed on a
        connection when that closes. A stream still missing messages fails through :meth:`connection_failed`;
        one received whole (copy-mode pairs, all copied out before the server went) is not failed here."""
        if self.to_free and self.data_conn is not None and self.data_uri.free_data is not None:
            addresses, self.to_free = self.to_free, []
            try:
                await self.data_conn.send_tagged(self.data_uri.free_data, encode_free(addresses))
            except TransportError as e:
                log.debug("free_data of %d ranges not sent (the connection is gone): %s", len(addresses), e)
                return
            CLIENT.free_data.inc(self.data_uri.scheme)

    async def close(self) -> None:
        self.done = True
        self.stalled_metadata.clear()
        self.stalled_bodies.clear()
        # The stream is over: the decoders' dictionaries are needed no more. Zero-copy ones lie in the
        # server's memory, which goes back when the consumer's batches are released, not with the session.
        self.decoder.dictionaries.clear()
        self.device = None
        reader = self.pairs
        if reader is not None and reader.zero_copy and not reader.idle.is_set():  # type: ignore[attr-defined]
            # Zero-copy batches still use the server's memory: the data connection (which holds those ranges
            # on the server) stays open until the last of them is released.
            task = asyncio.get_running_loop().create_task(self._linger(reader))
            _background.add(task)
            task.add_done_callback(_background.discard)
            return
        await self._shutdown()

    async def _linger(self, reader: PairReader) -> None:
        idle: threading.Event = reader.idle  # type: ignore[attr-defined]
        try:
            while not idle.is_set():
                await asyncio.sleep(0.05)
                await self._flush_quietly()
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        with contextlib.suppress(DissocError):
            await self.flush_frees()
        clean = (
            self.pooled
            and not self.to_free  # every range read was freed: the connection holds nothing on the server
            and self.stream.finished
            and not self.errored
            and not self.held
            and not self.stalled_metadata
            and not self.stalled_bodies
        )
        for c in self.conns:
            if clean and not c.closed:
                # The server waits for this connection's next want_data: the next stream here takes it.
                pool_of(asyncio.get_running_loop()).give(
                    self._pool_key(self.meta_uri if c is self.meta_conn else self.data_uri), c
                )
                continue
            c.set_receiver(None)
            with contextlib.suppress(DissocError):
                await c.close()
        if self.pairs is not None:
            self.pairs.close()


class _Chunk(list[Batch]):
    """Batches complete at once (a burst, see :func:`stream_chunks`), with the session they came from as
    ``watch``: consumers handing them out one by one check ``watch.failure`` first, so that a server gone
    mid-stream fails the stream now, not after the consumer has worked through a burst (with pairs, as many
    batches as the server's arena holds; zero-copy ones over the dead server's memory). The synchronous
    reader notices between batches only where its loop runs meanwhile (zero-copy; else at its next read)."""

    __slots__ = ("watch",)

    def __init__(self, watch: _Session | None) -> None:
        super().__init__()
        self.watch = watch


#: One stream to read: (metadata URI, data URI or None for the same, ticket).
Endpoint: TypeAlias = "tuple[str | DissocURI, str | DissocURI | None, str | bytes]"


async def resolve_endpoints(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
) -> tuple[list[Endpoint], pa.Schema | None]:
    """The streams a fetch of ``ticket`` at ``uri`` reads, and the schema when it is known up front.

    A dissoc URI is one stream. A Flight location (``grpc://``) is resolved with GetFlightInfo into every
    endpoint it lists (their metadata and data URIs and tickets) and the dataset's schema; this is the one
    place where the client's entry points (:func:`fetch`, :func:`stream_batches`, :func:`open_stream`, and
    ``dissoc get``) turn a control plane's location into streams.
    """
    token = options.token if options is not None else None
    if not (isinstance(uri, str) and is_flight_location(uri)):
        return [(uri, data_uri, _signed_ticket(ticket, token))], None
    if data_uri is not None:
        raise DissocError(
            "data_uri (--data-uri) does not apply to a Flight location (grpc://): the control plane gives "
            "each endpoint's URIs"
        )
    from dissoc.flight.client import describe

    options = options or ClientOptions()
    info = await asyncio.to_thread(
        describe,
        uri,
        ticket,
        timeout=options.flight_timeout,
        tls_ca=options.tls_ca,
        tls_cert=options.tls_cert,
        tls_key=options.tls_key,
        token=token,
    )
    return list(info.endpoints), info.schema


def _signed_ticket(ticket: str | bytes, token: str | None) -> str | bytes:
    """What a dissoc server is sent for ``ticket`` given ``ClientOptions.token``: the token when the ticket is
    the name it is for, the ticket itself otherwise (no token, or a ticket that is already signed)."""
    if token is None or is_signed(ticket):
        return ticket
    claims = peek(token)
    if claims is None:
        raise DissocError("ClientOptions.token is not a signed ticket (dissoc token prints one)")
    name = ticket if isinstance(ticket, str) else bytes(ticket).decode("utf-8", "replace")
    if claims.name != name:
        raise DissocError("ClientOptions.token is for another dataset than the ticket asked for")
    return token


async def stream_chunks(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
    stats: FetchStats | None = None,
    on_schema: Callable[[pa.Schema], None] | None = None,
) -> AsyncGenerator[list[Batch], None]:
    """Like :func:`stream_batches`, but yields every batch that is already complete at once, as a list.

    Waits only when nothing is ready; consumers that pay a fixed cost per resumption (the synchronous
    reader) use this to pay it once per burst instead of once per batch. A Flight location's endpoints are
    read one after the other, in the order listed; they must share one schema.
    """
    endpoints, schema = await resolve_endpoints(uri, ticket, data_uri=data_uri, options=options)
    if schema is None and len(endpoints) == 1:
        one = _stream_one(*endpoints[0], options=options, stats=stats, on_schema=on_schema)
        async with contextlib.aclosing(one):
            async for chunk in one:
                yield chunk
        return
    first: list[pa.Schema] = [] if schema is None else [schema]
    if schema is not None and on_schema is not None:
        on_schema(schema)

    def check_schema(got: pa.Schema) -> None:
        if not first:
            first.append(got)
            if on_schema is not None:
                on_schema(got)
        elif not got.equals(first[0]):
            raise ProtocolError(f"the endpoints of {ticket!r} at {uri} sent different schemas")

    total = FetchStats()
    try:
        for meta, data, t in endpoints:
            part = FetchStats()
            one = _stream_one(meta, data, t, options=options, stats=part, on_schema=check_schema)
            try:
                async with contextlib.aclosing(one):
                    async for chunk in one:
                        yield chunk
            finally:
                total.batches += part.batches
                total.rows += part.rows
                total.bytes += part.bytes
    finally:
        if stats is not None:
            stats.batches, stats.rows, stats.bytes = total.batches, total.rows, total.bytes


async def _stream_one(
    uri: str | DissocURI,
    data_uri: str | DissocURI | None,
    ticket: str | bytes,
    *,
    options: ClientOptions | None,
    stats: FetchStats | None,
    on_schema: Callable[[pa.Schema], None] | None,
) -> AsyncGenerator[list[Batch], None]:
    """One stream's batches, in bursts (see :func:`stream_chunks`). Counted in :data:`dissoc.metrics.CLIENT`
    per burst: bytes and batches received, and the stream's start, end or failure."""
    opts = options or ClientOptions()
    meta = _as_uri(uri)
    data = _as_uri(data_uri) if data_uri is not None else meta
    transport = meta.scheme
    tally = CLIENT.received(transport, "packed" if data.memory is None else "pairs")
    counted = FetchStats()  # what was added to the tally so far
    outcome = "closed_early"  # the consumer stopped reading before the end (unless set below)
    CLIENT.streams_started.inc(transport)
    begun = time.monotonic()  # 0.0 once the first batch was decoded
    previous = stream_id.set(new_stream_id())  # the session's tasks, made next, log with it
    session = _Session(meta, data, _ticket_bytes(ticket), opts)
    if log.isEnabledFor(logging.DEBUG):
        # a signed ticket is a credential: not even part of it goes to the log
        shown = "<signed ticket>" if is_signed(ticket) else repr(ticket[:64])
        log.debug("stream of %s from %s", shown, meta)
    _live.add(session)
    try:
        first: MessageReady | SchemaReceived | StreamEnded | _Decoded | None = None
        try:
            await session.start()
            first = await session.next_event()
        except TransportError:
            if not session.reused:
                raise
            # A pooled connection the server had dropped meanwhile (restarted, or its idle limit): once more,
            # on fresh connections.
            log.debug("a reused connection failed before the stream began; connecting afresh")
            await session.close()
            _live.discard(session)
            session = _Session(meta, data, _ticket_bytes(ticket), opts, pooled=False)
            _live.add(session)
            await session.start()
        ended = False
        while not ended:
            chunk = _Chunk(session)
            chunk_start = session.stats.bytes
            if first is not None:
                ev, first = first, None
            else:
                ev = await session.next_event()
            ready = session.ready
            counts = session.stats
            while True:
                if isinstance(ev, tuple):  # decoded as it was released (the common case)
                    batch, n = ev
                    session.in_flight -= n
                    if session.reading_paused:
                        session.resume_if_drained()
                    counts.batches += 1
                    counts.rows += batch.num_rows
                    counts.bytes += n
                    chunk.append(batch)
                elif isinstance(ev, StreamEnded):
                    ended = True
                    break
                else:
                    batch = session.decode(ev)
                    if (
                        isinstance(ev, SchemaReceived)
                        and on_schema is not None
                        and session.decoder.schema is not None
                    ):
                        on_schema(session.decoder.schema)
                    if batch is not None:
                        chunk.append(batch)
                # A burst is handed over once it reaches _CHUNK_BYTES: the consumer lets go of its batches
                # before more are decoded, so that pair readers' pooled buffers (and pages) are reused.
                if not ready or counts.bytes - chunk_start >= _CHUNK_BYTES:
                    break
                item = ready.popleft()
                if isinstance(item, BaseException):
                    raise item
                ev = item
            await session.flush_frees()
            batch = None  # hold no batch past the yield: zero-copy batches free their memory on release
            del ev
            _count_received(session.stats, counted, tally)
            if chunk:
                if begun:
                    CLIENT.time_to_first_batch.observe(time.monotonic() - begun)
                    begun = 0.0
                yield chunk
        outcome = "ok"
    except RemoteError as e:
        outcome = e.code
        raise
    except ProtocolError:
        outcome = "protocol"
        raise
    except TransportError:
        outcome = "transport"
        raise
    except ResourceError:
        outcome = "resource"
        raise
    except DissocError:
        outcome = "error"
        raise
    finally:
        _live.discard(session)
        _count_received(session.stats, counted, tally)
        if outcome == "ok":
            CLIENT.streams_finished.inc(transport)
        else:
            CLIENT.streams_failed.inc(transport, outcome)
        if stats is not None:
            stats.batches, stats.rows, stats.bytes = (
                session.stats.batches,
                session.stats.rows,
                session.stats.bytes,
            )
        await session.close()
        with contextlib.suppress(ValueError):  # finalized in another context: nothing to restore there
            stream_id.reset(previous)


def _count_received(stats: FetchStats, counted: FetchStats, tally: Tally) -> None:
    """Add what ``stats`` gained since ``counted`` to the metrics' ``tally`` (once per burst)."""
    tally.batches += stats.batches - counted.batches
    tally.bytes += stats.bytes - counted.bytes
    counted.batches, counted.bytes = stats.batches, stats.bytes


async def stream_batches(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
    stats: FetchStats | None = None,
    on_schema: Callable[[pa.Schema], None] | None = None,
) -> AsyncGenerator[Batch, None]:
    """Yield the stream's batches in sequence order, each as soon as it is complete (``pa.RecordBatch``, or
    :class:`~dissoc.device.DeviceBatch` with ``ClientOptions(landing="device")``)."""
    chunks = stream_chunks(uri, ticket, data_uri=data_uri, options=options, stats=stats, on_schema=on_schema)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            chunk.reverse()
            watch = getattr(chunk, "watch", None)
            while chunk:
                if watch is not None and watch.failure is not None:
                    raise watch.failure
                # Popped, so that a batch the consumer let go of is not kept alive here (zero-copy batches
                # give their shared memory back when released).
                yield chunk.pop()


async def fetch_async(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
) -> pa.Table:
    """Fetch a whole stream as a ``pa.Table``; ``uri`` may also be a Flight control plane (``grpc://``),
    whose endpoints are then fetched concurrently and concatenated in the order listed."""
    if options is not None and options.landing != "host":
        raise DissocError("fetch returns a host table; use fetch_device for landing='device'")
    endpoints, schema = await resolve_endpoints(uri, ticket, data_uri=data_uri, options=options)
    if schema is not None:
        if not endpoints:
            return schema.empty_table()
        tables: list[pa.Table] = await _gather([_fetch_one(u, d, t, options) for u, d, t in endpoints])
        if len(tables) == 1:
            return tables[0]
        try:
            return pa.concat_tables(tables)
        except pa.ArrowInvalid as e:
            raise ProtocolError(f"the endpoints of {ticket!r} at {uri} sent different schemas: {e}") from None
    return await _fetch_one(uri, data_uri, ticket, options)


async def _fetch_one(
    uri: str | DissocURI,
    data_uri: str | DissocURI | None,
    ticket: str | bytes,
    options: ClientOptions | None,
) -> pa.Table:
    schema: list[pa.Schema] = []
    batches = [
        b
        async for b in stream_batches(
            uri, ticket, data_uri=data_uri, options=options, on_schema=schema.append
        )
    ]
    return pa.Table.from_batches(batches, schema=schema[0] if schema else None)


async def fetch_device_async(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
) -> list[DeviceBatch]:
    """Fetch a whole stream into device memory: its batches as :class:`~dissoc.device.DeviceBatch` objects
    (``options`` with ``landing="device"`` is implied)."""
    opts = dataclasses.replace(options or ClientOptions(), landing="device")
    out: list[DeviceBatch] = []
    async for b in stream_batches(uri, ticket, data_uri=data_uri, options=opts):
        assert not isinstance(b, pa.RecordBatch)
        out.append(b)
    return out


def fetch_device(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
) -> list[DeviceBatch]:
    """Synchronous :func:`fetch_device_async`."""

    def coro() -> Any:
        return fetch_device_async(uri, ticket, data_uri=data_uri, options=options)

    if options is not None and options.zero_copy:
        return _SharedRunner.get().run(coro())  # type: ignore[no-any-return]
    return _run(coro)  # type: ignore[no-any-return]


async def _gather(coros: list[Any]) -> list[Any]:
    """Run ``coros`` concurrently; the first failure cancels the rest and is raised as it is."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled():
                error = t.exception()
                if error is not None:
                    raise error
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _run(coro_factory: Callable[[], Any]) -> Any:
    """Run a coroutine to completion from synchronous code, even when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        runner = _main_runner() or _LoopRunner()
        try:
            return runner.run(coro_factory())
        finally:
            runner.close()
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro_factory()))
        except BaseException as e:
            error.append(e)

    t = threading.Thread(target=target, name="dissoc-fetch")
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


def fetch(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
) -> pa.Table:
    """Fetch a whole stream as a ``pa.Table`` (synchronous)."""
    if options is not None and options.zero_copy:
        return _SharedRunner.get().run(fetch_async(uri, ticket, data_uri=data_uri, options=options))
    return _run(lambda: fetch_async(uri, ticket, data_uri=data_uri, options=options))


class StreamReader:
    """A synchronous reader over a dissoc stream, like ``pyarrow.RecordBatchReader``.

    The client's event loop runs in the caller's thread, entered once per burst of complete batches (see
    :func:`stream_chunks`); while the caller works on batches the loop is idle and TCP holds the server
    back. Called from a thread that already runs an event loop, the loop runs in a helper thread instead.
    """

    def __init__(
        self,
        uri: str | DissocURI,
        ticket: str | bytes,
        *,
        data_uri: str | DissocURI | None = None,
        options: ClientOptions | None = None,
    ) -> None:
        self.stats = FetchStats()
        self._schema: pa.Schema | None = None
        self._pending: deque[Batch] = deque()
        self._watch: _Session | None = None
        self._done = False
        self._chunks = stream_chunks(
            uri, ticket, data_uri=data_uri, options=options, stats=self.stats, on_schema=self._set_schema
        )
        try:
            asyncio.get_running_loop()
            in_loop = True
        except RuntimeError:
            in_loop = False
        self._runner: Any
        if options is not None and options.zero_copy:
            self._runner = _SharedRunner.get()  # zero-copy sessions outlive the reader (see ClientOptions)
        else:
            self._runner = _ThreadRunner() if in_loop else (_main_runner() or _LoopRunner())

    def _set_schema(self, schema: pa.Schema) -> None:
        self._schema = schema

    def _pull(self) -> bool:
        """Fetch the next burst of batches; False at the end of the stream."""
        if self._done:
            return False
        try:
            chunk = self._runner.run(self._chunks.__anext__())
        except StopAsyncIteration:
            self.close()
            return False
        except BaseException:
            self.close()
            raise
        self._pending.extend(chunk)
        self._watch = getattr(chunk, "watch", None)
        return True

    @property
    def schema(self) -> pa.Schema:
        while self._schema is None:
            if not self._pull():
                raise ProtocolError("the stream ended before its schema arrived")
        return self._schema

    def read_next_batch(self) -> Batch:
        while not self._pending:
            if not self._pull():
                raise StopIteration
        watch = self._watch
        if watch is not None and watch.failure is not None:
            self.close()
            raise watch.failure
        return self._pending.popleft()

    def __iter__(self) -> Iterator[Batch]:
        pending = self._pending
        while True:
            while pending:  # (read_next_batch, without a call per batch)
                watch = self._watch
                if watch is not None and watch.failure is not None:
                    self.close()
                    raise watch.failure
                yield pending.popleft()
            if not self._pull():
                return

    def read_all(self) -> pa.Table:
        """The rest of the stream as a ``pa.Table`` (device batches are copied to the host)."""
        batches = [b if isinstance(b, pa.RecordBatch) else b.to_arrow() for b in self]
        return pa.Table.from_batches(batches, schema=self.schema if self._schema is None else self._schema)

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._runner.run(self._chunks.aclose())
        finally:
            self._runner.close()

    def __enter__(self) -> StreamReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            with contextlib.suppress(Exception):
                self.close()


class _LoopRunner:
    """``run``/``close`` on a private event loop in the caller's thread.

    Not ``asyncio.Runner``: on the main thread its ``run`` looks up and swaps the SIGINT handler around each
    call, and ``signal.getsignal`` formats the handler, which holds the previous call's task, whose result is
    a burst of batches: pyarrow formats their values, milliseconds per call. Ctrl-C here interrupts the loop
    with ``KeyboardInterrupt`` as in any synchronous call.

    The main thread's synchronous calls share one such loop (:func:`_main_runner`), so that connections left
    in its pool by one call serve the next; ``close`` does nothing to it, :meth:`shutdown` (at exit) does.
    """

    def __init__(self, *, shared: bool = False) -> None:
        self._loop = asyncio.new_event_loop()
        self._shared = shared
        own(self._loop)

    def run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        if not self._shared:
            self.shutdown()

    def close_idle(self) -> None:
        """Close the idle connections of this loop's pool."""
        if not self._loop.is_closed():
            self._loop.run_until_complete(pool_of(self._loop).aclose())

    def shutdown(self) -> None:
        loop = self._loop
        if loop.is_closed():
            return
        try:
            loop.run_until_complete(pool_of(loop).aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
            with contextlib.suppress(RuntimeError):
                # At interpreter exit Python 3.12+ starts no thread, and this one would join the executor;
                # concurrent.futures joins its workers itself then.
                loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


_main: _LoopRunner | None = None


def _main_runner() -> _LoopRunner | None:
    """The main thread's shared loop (None in other threads: each call there gets a loop of its own)."""
    global _main
    if threading.current_thread() is not threading.main_thread():
        return None
    if _main is None:
        _main = _LoopRunner(shared=True)
        atexit.register(_main.shutdown)
    return _main


def _forget_main_runner() -> None:
    """In a forked child the parent's loop and pooled connections are the parent's: never use them."""
    global _main
    _main = None


os.register_at_fork(after_in_child=_forget_main_runner)


class _ThreadRunner:
    """``asyncio.Runner``'s ``run``/``close`` on a loop in a helper thread (for callers inside a loop)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dissoc-reader", daemon=True)
        self._thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class _SharedRunner(_ThreadRunner):
    """One process-wide loop thread for zero-copy sessions, which must outlive the calls that started them."""

    _instance: _SharedRunner | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> _SharedRunner:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def close(self) -> None:
        """Never stopped by a reader: other sessions may still be using it."""


async def close_idle_connections() -> None:
    """Close the connections the running loop's pool keeps for later streams (``reuse_connections``)."""
    await pool_of(asyncio.get_running_loop()).aclose()


def close_idle_connections_sync() -> None:
    """Close the connections the synchronous API keeps for later streams (this thread's; done at exit
    anyway). Call it before stopping a server this process streamed from, so that closing them later does
    not meet a peer that is gone (UCX logs that as an error)."""
    runner = _main if threading.current_thread() is threading.main_thread() else None
    if runner is not None:
        runner.close_idle()


def open_stream(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
) -> StreamReader:
    """Open a dissoc stream for synchronous iteration (``pyarrow.ipc.open_stream``'s counterpart)."""
    return StreamReader(uri, ticket, data_uri=data_uri, options=options)


def _arena_key(uri: DissocURI) -> tuple[str, bytes | None, tuple[tuple[str, str], ...]]:
    """What tells two arenas apart: memory kind, handle and the kind's parameters."""
    return (str(uri.memory), uri.remote_handle, tuple(sorted(uri.params.items())))


def _pairs_nbytes(pairs: PairList) -> int:
    """The size of the pair-list message a :class:`PairList` was decoded from (what was counted in flight)."""
    return PAIRS_HEADER_SIZE + 16 * pairs.count
