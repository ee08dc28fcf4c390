"""One stream on the client: its connections, the sans-IO stream it pumps, and flow control.

:class:`Session` is a thin pump around :class:`dissoc.protocol.ClientStream`, which decides every rule about
order, windows and the end of the stream. Each connection hands the session its received messages through one
door (``Receiver.on_messages``, inside the transport's reading callback, several at a time); the session
passes them to the stream, wakes the consumer once for whatever that released, and pauses or resumes reading
as the stream asks. The consumer (:mod:`dissoc.session.reading`) pops the released events and decodes them
(:class:`~dissoc.session.decoding.Decoding`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from dissoc.buffers import default_allocator
from dissoc.errors import DissocError, ProtocolError, TransportError
from dissoc.logs import stream_id
from dissoc.metrics import Sample, register
from dissoc.protocol import (
    BODY_PACKED,
    ClientState,
    ClientStream,
    Received,
    SchemaReceived,
    body_type_of,
    fmt_seq,
)
from dissoc.session.connect import pool_key, take_or_open
from dissoc.session.decoding import Decoding
from dissoc.session.frees import Frees, run_later
from dissoc.session.landing import Slabs, copied
from dissoc.session.options import ClientOptions
from dissoc.session.pool import owned, pool_of
from dissoc.transport import Connection
from dissoc.uri import DissocURI

__all__ = ["Session"]

log = logging.getLogger("dissoc.client")  # (the client's lines, wherever its machinery lives)

_FINISHED = ClientState.FINISHED  # (a module global: cheaper than the enum's attribute)


def _copy_kept(payload: memoryview, metadata: bytes | None) -> object:
    return copied(payload)


class _Door:
    """One connection's way into a session (its ``Connection.set_receiver``). On a split stream's connection
    it takes only the messages of that connection's stream: the others are left to the connection (a
    metadata URI that names a combined server, say: its bodies are not this stream's data stream)."""

    __slots__ = ("session", "tagged")

    def __init__(self, session: Session, tagged: bool | None) -> None:
        self.session = session
        self.tagged = tagged  # None: both streams; False: metadata only; True: bodies only

    def on_messages(self, messages: list[Received], lent: bool) -> int:
        session = self.session
        if session.done:
            return 0
        tagged = self.tagged
        if tagged is not None:
            for i, (tag, _, _) in enumerate(messages):
                if (tag is not None) is not tagged:
                    if not i:
                        return 0
                    messages = messages[:i]
                    break
        return session.take(messages, lent)

    def on_failure(self, exc: DissocError) -> None:
        self.session.connection_failed(exc)


class Session:
    """One stream's state on the client: connections, the sans-IO stream, decoding, flow control."""

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
        self.frees = Frees(data_uri, [])
        self.decoding = Decoding(
            options,
            data_uri,
            on_release=self.frees.released,
            to_free=self.frees.pending,
            on_idle=self.frees.drained,
        )
        decoder = self.decoding.decoder
        ordered = options.ordered_metadata
        # Where packed bodies land: lent ones are copied into the slabs as they are released (TCP's), and a
        # transport that receives into addresses (UCX) is given room there before they arrive (land_tagged).
        self._slabs = Slabs(decoder) if self.decoding.lands_on_host else None
        self.stream = ClientStream(
            decoder.has_body,
            window=options.window,
            max_pending_bytes=1 << 62,  # (bounded by max_in_flight_bytes instead)
            ordered=meta_uri.scheme in ("tcp", "tls") if ordered is None else ordered,
            max_ahead=4 * options.window,
            max_in_flight_bytes=options.max_in_flight_bytes,
            shared_link=not self.split,
            keep=self._slabs.land if self._slabs is not None else _copy_kept,
        )
        if self._slabs is not None:
            self._slabs.find = self.stream.held_metadata
        self._early_schema = self._slabs is not None
        #: Released events for the consumer, oldest first (the stream's own queue).
        self.ready = self.stream.events
        self.error: BaseException | None = None  # raised once the consumer has taken what came before it
        self.failure: TransportError | None = None  # the connection failed (see reading.Chunk)
        self.done = False  # failed, finished or closed: the doors take nothing more
        self.errored = False
        self.meta_conn: Connection | None = None
        self.data_conn: Connection | None = None
        self.conns: list[Connection] = []
        # Connections come from, and go back to, the loop's pool, whatever the stream lands: host or device
        # batches, copies or zero-copy views. A zero-copy stream's connection goes back only once the last of
        # its batches was released and its ranges freed (see close): they are tied to the connection.
        self.pooled = pooled and options.reuse_connections is not False
        self.reused = False  # some connection came from the pool
        self._wakeup: asyncio.Future[None] | None = None
        self._pauses = (False, False)

    # -- starting --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (or take pooled connections), open the doors and send want_data."""
        loop = asyncio.get_running_loop()
        self.frees.loop = loop
        if self.pooled and self.options.reuse_connections is None and not owned(loop):
            self.pooled = False  # an application's loop: pooling is asked for explicitly there
        meta = await self._open(self.meta_uri)
        data = await self._open(self.data_uri) if self.split else meta
        self.meta_conn, self.data_conn = meta, data
        self.frees.conn = data
        for conn in self.conns:  # the transport's own lines about them name this stream
            conn.stream_id = stream_id.get()
        device = self.decoding.device
        if device is not None and device.receives_on_device and data.device_memory:
            # Packed bodies go straight into device memory; the small tagged messages (pairs, errors) stay
            # on the host, where they are parsed.
            def allocate(tag: int, length: int) -> Any:
                if body_type_of(tag) == BODY_PACKED:
                    return device.allocate(length)
                return default_allocator(tag, length)

            data.set_allocator(allocate)
        if self._slabs is not None:
            # A transport that receives bodies into addresses (UCX) lands them after room for their metadata.
            data.set_lander(self._slabs.land_tagged)
        if self.split:
            meta.set_receiver(_Door(self, tagged=False))
            data.set_receiver(_Door(self, tagged=True))
        else:
            meta.set_receiver(_Door(self, tagged=None))
        await meta.send_tagged(self.meta_uri.want_data, self.ticket)
        if self.split:
            await data.send_tagged(self.data_uri.want_data, self.ticket)

    async def _open(self, uri: DissocURI) -> Connection:
        conn, reused = await take_or_open(uri, self.options, pooled=self.pooled)
        self.reused |= reused
        self.conns.append(conn)
        return conn

    # -- the pump (inside the transports' reading callbacks; never raises) -----------------------------------

    def take(self, messages: list[Received], lent: bool) -> int:
        """Messages from a connection into the stream; the consumer is woken for what they released."""
        stream = self.stream
        try:
            taken = stream.receive(messages, lent=lent)
        except Exception as exc:  # handed to the consumer, which raises it
            self.failed(exc)
            return len(messages)
        if self._early_schema and self.ready:
            self._schema_early()
        if self.ready:
            waiter = self._wakeup
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        if stream.state is _FINISHED:
            self.done = True
        if stream.pauses is not self._pauses:
            self._pause(stream.pauses)
        return taken

    def _schema_early(self) -> None:
        """The schema, decoded as soon as it is released, before the consumer takes it: the bodies that come
        right behind it then land for a one-read decode (see _land). A schema that fails to decode is left to
        the consumer, which raises the error in its place."""
        ev = self.ready[0]
        if isinstance(ev, SchemaReceived):
            self._early_schema = False
            with contextlib.suppress(DissocError, pa.ArrowException, ValueError):
                self.decoding.schema(ev.metadata)

    def failed(self, exc: BaseException) -> None:
        """End the stream with ``exc``: the consumer raises it once it has taken what came before it."""
        if self.done:
            return
        self.done = True
        self.errored = True
        if isinstance(exc, TransportError):
            # The server is gone: a burst of batches already handed over must not delay the error until the
            # consumer has worked through it (see reading.Chunk).
            self.failure = exc
        self.error = exc
        self._wake()

    def connection_failed(self, exc: DissocError) -> None:
        if self.done or self.stream.finished:
            return
        try:
            self.stream.flush()  # (held messages that nothing followed: the stream judges them now)
        except DissocError as error:
            self.failed(error)
            return
        self.failed(exc)

    def _wake(self) -> None:
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _pause(self, pauses: tuple[bool, bool]) -> None:
        """Pause or resume reading as the stream asks: ``(metadata, data)`` (one connection: the data's)."""
        self._pauses = pauses
        targets: tuple[tuple[Connection | None, bool], ...]
        if self.split:
            targets = ((self.meta_conn, pauses[0]), (self.data_conn, pauses[1]))
        else:
            targets = ((self.meta_conn, pauses[1]),)
        for conn, paused in targets:
            if conn is None:
                continue
            if paused:
                conn.pause_reading()
            else:
                conn.resume_reading()

    # -- the consumer's side ---------------------------------------------------------------------------------

    def consumed(self, nbytes: int) -> None:
        """The consumer is done with ``nbytes`` of released bodies: reading may resume."""
        stream = self.stream
        if stream.consumed(nbytes):
            self._pause(stream.pauses)

    async def wait(self) -> None:
        """Until something is ready for the consumer; raises the stream's error once nothing before it is
        left, and silence longer than the timeout is an error too."""
        ready = self.ready
        deadline = None
        while not ready:  # (a wake-up may have released nothing: an error, or nothing at all)
            error = self.error
            if error is not None:
                # Raised once and let go of: the traceback it gathers in the consumer's frames would keep
                # alive what they hold (zero-copy batches over a server's memory, whose release the session
                # waits for).
                self.error = None
                raise error
            loop = asyncio.get_running_loop()
            limit = self.options.timeout
            if deadline is None and limit is not None:
                deadline = loop.time() + limit
            waiter = self._wakeup = loop.create_future()
            try:
                if deadline is None:  # no limit on silence (following a live stream)
                    await waiter
                else:
                    await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise self._silence() from None
            finally:
                self._wakeup = None
                del waiter

    def _silence(self) -> DissocError:
        """Why nothing came within the timeout."""
        stream = self.stream
        missing = [fmt_seq(m) for m in stream.missing()[:8]]
        if stream.state is ClientState.ENDED and not stream.metadata_complete:
            # The server said how many messages it sent, and metadata for some never came.
            return ProtocolError(
                f"the stream ended, but after {self.options.timeout} s messages are still missing: {missing}"
            )
        return TransportError(
            f"nothing arrived within {self.options.timeout} s (waiting for message "
            f"{fmt_seq(stream.next_seq)}; missing {missing})"
        )

    # -- the end ---------------------------------------------------------------------------------------------

    async def close(self) -> None:
        self.done = True
        self.decoding.close()
        reader = self.decoding.pairs
        idle: threading.Event | None = getattr(reader, "idle", None)
        if reader is not None and reader.zero_copy and idle is not None and not idle.is_set():
            # Zero-copy batches still use the server's memory: the data connection (which holds those ranges
            # on the server) stays open until the last of them is released.
            run_later(self._linger(idle))
            return
        await self._shutdown()

    async def _linger(self, idle: threading.Event) -> None:
        try:
            await self.frees.linger(idle)
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        with contextlib.suppress(DissocError):
            await self.frees.flush()
        clean = (
            self.pooled
            and not self.frees.pending  # every range read was freed: nothing held on the server
            and self.stream.finished
            and not self.errored
            and not self.stream.waiting
        )
        for c in self.conns:
            if clean and not c.closed:
                # The server waits for this connection's next want_data: the next stream here takes it.
                uri = self.meta_uri if c is self.meta_conn else self.data_uri
                pool_of(asyncio.get_running_loop()).give(pool_key(uri, self.options), c)
                continue
            c.set_receiver(None)
            c.set_lander(None)
            with contextlib.suppress(DissocError):
                await c.close()
        if self.decoding.pairs is not None:
            if self.errored:
                self.decoding.pairs.forget()  # (the server may be gone: keep nothing mapped for it)
            self.decoding.pairs.close()


class _LiveSessions:
    """The sessions reading now, for the client's gauges (:mod:`dissoc.metrics`, read at scrape time)."""

    def __init__(self) -> None:
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, session: Session) -> None:
        with self._lock:
            self._sessions.add(session)

    def discard(self, session: Session) -> None:
        with self._lock:
            self._sessions.discard(session)

    def metrics_samples(self) -> Iterator[Sample]:
        with self._lock:
            sessions = list(self._sessions)
        yield "dissoc_client_streams_open", (), float(len(sessions))
        yield "dissoc_client_in_flight_bytes", (), float(sum(s.stream.in_flight for s in sessions))


#: The sessions reading now (registered with the metrics).
live = _LiveSessions()
register(live)
