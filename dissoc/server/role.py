"""What the spec's two servers share: a listener whose connections ask for tickets with want_data, each
answered with the walk of the ticket's dataset (:mod:`dissoc.server.stream`) through the parts of the stream
the server sends (the metadata server's, the data server's, or both for the combined server).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dissoc.datasets import Catalog, Dataset
from dissoc.datasets.messages import same_every_time
from dissoc.errors import DissocError, ResourceError, TransportError
from dissoc.logs import new_stream_id, peer_log, stream_id
from dissoc.metrics import SERVER
from dissoc.protocol import EMPTY_TICKET, ERROR_TAG, encode_error, fmt_tag
from dissoc.server.deadlines import Deadlines, Watch
from dissoc.server.options import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_FREE_DATA_BYTES,
    DEFAULT_MAX_TICKET_BYTES,
    DEFAULT_WANT_DATA_TIMEOUT,
)
from dissoc.server.stream import Outbox, StreamPart, stream_dataset
from dissoc.tokens import Secret, TokenError, split_start
from dissoc.transport import Connection, Listener, TaggedMessage, serve
from dissoc.transport.base import ReceiveBudgetError
from dissoc.uri import DissocURI

if TYPE_CHECKING:
    from dissoc.memory.pairs import ServedArena
    from dissoc.memory.placements import Placements
    from dissoc.memory.private import PrivateArenas
    from dissoc.protocol.ledger import Ledger

__all__ = ["Role", "RoleServer", "ServeOptions", "UNAUTHORIZED"]

log = logging.getLogger(__name__)


class Role(enum.Enum):
    """Which streams a connection carries."""

    METADATA = "metadata"
    DATA = "data"
    COMBINED = "combined"


#: The error code of a want_data refused for its token (missing, forged, expired, wrong scope or client).
UNAUTHORIZED = "unauthorized"


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Per-server settings shared by its connections: what a :class:`~dissoc.server.Server` makes of its
    :class:`~dissoc.server.options.ServerOptions` (with the arena it built) for each of its role servers.

    With ``placements`` (over the arena of ``served``, and a ``ledger``), bodies are sent as address/length
    pairs (body type 1): each batch's buffers are placed in the arena and stay there until the client frees
    them with free_data or disconnects; stored and in-memory batches stay resident (placed once, listed to
    every client that asks) unless the placements were made with ``resident=False``. One client holds at
    most ``max_unfreed_bytes`` awaiting free_data (:attr:`unfreed_quota`; see
    :class:`dissoc.server.data.DataPart`).
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


class RoleServer(abc.ABC):
    """A listener whose connections carry the streams of one role (base of the metadata and data servers).

    A connection's life: wait for want_data, answer with the stream of the ticket it names, wait again,
    until the peer leaves. Subclasses say which parts of a stream they send (:meth:`parts`).

    Hostile or silent clients (see :class:`ServeOptions`): a want_data or free_data frame larger than its
    limit is refused from its header (logged, rate-limited; answered with a ``request_too_large`` error when
    the transport can still send; the connection dropped); a connection past a deadline is dropped
    (:mod:`dissoc.server.deadlines`).
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
        self._deadlines = Deadlines(options.want_data_timeout, options.idle_timeout, self._holds_ranges)
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
        watch = self._deadlines.watch(conn)
        try:
            await self._serve_requests(conn, watch)
        finally:
            self._deadlines.forget(conn)

    async def _serve_requests(self, conn: Connection, watch: Watch | None) -> None:
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
                watch.request()
            try:
                await self._answer(conn, request)
            finally:
                if watch is not None:
                    watch.answered()

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
                # The dataset served is the one the signed ticket names (exactly: no prefix, no wildcard),
                # read from an offset when the ticket is TOKEN@OFFSET (a live stream).
                text = ticket if isinstance(ticket, str) else ticket.decode("utf-8", "replace")
                token, start = split_start(text)
                peer = getattr(conn, "peer_identity", None)
                if start is None:
                    ticket = secret.verify(ticket, scope="read", peer=peer).name
                else:
                    ticket = f"{secret.verify(token, scope='read', peer=peer).name}@{start}"
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

    def _holds_ranges(self, conn: Connection) -> bool:
        """Whether ``conn``'s client holds listed ranges (it is not idle: it will send free_data)."""
        ledger = self.options.ledger
        return ledger is not None and ledger.live_bytes_of(conn) > 0

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
        self._deadlines.close()
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
            await listener.wait_closed()


def _served_now(catalog: Catalog, dataset: Dataset) -> Callable[[], bool]:
    target = getattr(dataset, "live", dataset)  # a live stream's view: the stream itself

    def current() -> bool:
        try:
            return catalog.get(target.name) is target
        except DissocError:
            return False

    return current
