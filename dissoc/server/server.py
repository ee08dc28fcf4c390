"""``dissoc.Server``: serve named datasets over Dissociated IPC, combined or split (async context manager).

async with dissoc.Server({"trips": table}) as server:
    print(server.uri)              # tcp://127.0.0.1:PORT?want_data=...
    await server.serve_forever()
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Literal, Self

from dissoc.datasets import Catalog, Dataset
from dissoc.errors import DissocError
from dissoc.memory.cuda_arena import DeviceArena
from dissoc.memory.pairs import ServedArena
from dissoc.memory.placements import Placements
from dissoc.memory.private import PrivateArenas
from dissoc.memory.shm import ShmArena
from dissoc.metrics import Sample, register, unregister
from dissoc.protocol.ledger import Ledger
from dissoc.server.combined import CombinedServer
from dissoc.server.data import DataServer
from dissoc.server.metadata import MetadataServer
from dissoc.server.options import (
    DEFAULT_FREE_DATA,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS_PER_PEER,
    DEFAULT_MAX_FREE_DATA_BYTES,
    DEFAULT_MAX_RECEIVING_BYTES,
    DEFAULT_MAX_TICKET_BYTES,
    DEFAULT_WANT_DATA,
    DEFAULT_WANT_DATA_TIMEOUT,
    ROLES,
)
from dissoc.server.role import RoleServer, ServeOptions
from dissoc.tokens import Secret
from dissoc.transport.base import ReceiveBudget, default_max_connections
from dissoc.transport.tls import DEFAULT_HANDSHAKE_TIMEOUT, server_context
from dissoc.uri import DissocURI

__all__ = [
    "ROLES",
    "DEFAULT_FREE_DATA",
    "DEFAULT_MAX_CONNECTIONS_PER_PEER",
    "DEFAULT_MAX_RECEIVING_BYTES",
    "DEFAULT_WANT_DATA",
    "Server",
]

log = logging.getLogger(__name__)


class Server:
    """Serves datasets by ticket (the dataset's name).

    ``datasets`` maps names to anything :func:`dissoc.datasets.dataset_from` accepts (a ``pa.Table``, a
    ``RecordBatchReader`` factory, an Arrow IPC or Parquet path). With ``split=True`` the metadata and data
    streams come from two servers on two ports (``uri`` and ``data_uri``); otherwise one server carries both.

    With ``body="pairs"``, batch buffers are placed in an arena of ``arena_bytes`` and listed as
    address/length pairs. With ``resident=True`` (the default), a batch of a stored or in-memory dataset is
    placed once and stays there, listed to every client that asks with no further copy, until the arena
    needs the room for something else and no client holds it (:attr:`placements`); ``resident=False`` places
    a copy per request, freed when the client frees it.

    With ``private_memory=True`` (``memory`` ``shm`` or ``ucx``), there is no shared arena: each data
    connection gets an arena of its own (a segment, or a UCX region with its own remote key) of
    ``max_unfreed_bytes`` (default: a quarter of ``arena_bytes``), made once its want_data was accepted and
    announced to it on the data connection (the data URI names none), destroyed when it closes. Together
    they hold at most ``arena_bytes``: one more connection asking for data gets the error
    ``arenas_exhausted``. A client then reads only what was listed to it (see :mod:`dissoc.memory.private`).

    What clients may hold (None turns a bound off):

    - ``max_connections`` open at once, ``"auto"``: :func:`~dissoc.transport.base.default_max_connections`,
      ``min(1024, max(soft - 64, soft // 2))`` for the soft file-descriptor limit (shared out between the two
      ports when split); at the bound accepting pauses until one closes (UCX: new ones are refused);
    - ``max_connections_per_peer`` (64) from one address per port: one more is accepted and closed at once;
    - ``want_data_timeout`` (10 s) to send a complete want_data after connecting, or to finish a request
      begun later; ``idle_timeout`` (300 s) with no request, no stream and no listed ranges held;
    - ``max_ticket_bytes`` (64 KiB) and ``max_free_data_bytes`` (8 MiB): larger want_data and free_data
      payloads are refused from their frame header, before they are read;
    - ``max_receiving_bytes`` (1 GiB) being received, or received and not yet taken, across all connections:
      a message that would go past it fails its connection (nothing is allocated for it);
    - ``max_unfreed_bytes`` (None: a quarter of the arena) one client may hold in listed ranges it has not
      freed; over it, that client's stream fails with ``quota_exceeded`` and the others are served.

    Across processes: with ``split=True``, ``role="metadata"`` or ``role="data"`` runs only that half (two
    processes serving the same datasets make one split server; the metadata half hands clients
    ``advertise_data_uri``, the data server's URI), and ``role="none"`` runs no listener, only the catalog,
    for a :class:`~dissoc.flight.FlightControlPlane` that hands out ``advertise_uri`` and
    ``advertise_data_uri``. Publishing through such a plane adds to its own catalog only: run it read-only.

    TLS (``tcp`` transport): with ``tls_cert`` and ``tls_key`` (PEM files) both ports speak TLS and the URIs
    are ``tls://``; with ``tls_client_ca`` too, mutual TLS: a client must present a certificate signed by a
    CA in that bundle (its subject is the connection's ``peer_identity``). A connection that has not
    completed its handshake within ``tls_handshake_timeout`` seconds (10) is dropped. See
    :mod:`dissoc.transport.tls`.
    Who may ask: with ``secret`` (a :class:`dissoc.tokens.Secret`, or its bytes: see
    :func:`dissoc.tokens.load_secret`), want_data must carry a signed ticket of scope ``read`` made with it
    (:func:`dissoc.tokens.mint`, ``dissoc token``); anything else is refused with the error code
    ``unauthorized`` (:data:`unauthorized` counts them) and the server goes on serving. Without one, the
    ticket is the dataset's name, as always.
    """

    def __init__(
        self,
        datasets: dict[str, Any] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: str = "tcp",
        split: bool = False,
        data_port: int = 0,
        want_data: int = DEFAULT_WANT_DATA,
        free_data: int | None = None,
        compression: str | None = None,
        body: str = "packed",
        memory: str | None = None,
        arena_bytes: int = 1 << 30,
        resident: bool = True,
        max_connections: int | Literal["auto"] | None = "auto",
        max_connections_per_peer: int | None = DEFAULT_MAX_CONNECTIONS_PER_PEER,
        want_data_timeout: float | None = DEFAULT_WANT_DATA_TIMEOUT,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        max_ticket_bytes: int = DEFAULT_MAX_TICKET_BYTES,
        max_free_data_bytes: int = DEFAULT_MAX_FREE_DATA_BYTES,
        max_receiving_bytes: int | None = DEFAULT_MAX_RECEIVING_BYTES,
        max_unfreed_bytes: int | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_client_ca: str | os.PathLike[str] | None = None,
        tls_handshake_timeout: float | None = DEFAULT_HANDSHAKE_TIMEOUT,
        secret: Secret | bytes | str | None = None,
        private_memory: bool = False,
        role: str = "all",
        advertise_uri: str | None = None,
        advertise_data_uri: str | None = None,
        **transport_options: Any,
    ) -> None:
        if role not in ROLES:
            raise DissocError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if role in ("metadata", "data") and not split:
            raise DissocError(f"role={role!r} runs one half of a split server: it needs split=True (--split)")
        for what, given in (("advertise_uri", advertise_uri), ("advertise_data_uri", advertise_data_uri)):
            if given is not None:
                try:
                    DissocURI.parse(given)  # a malformed one fails here, not in a client
                except DissocError as e:
                    raise DissocError(f"{what}: {e}") from None
        if role == "metadata" and advertise_data_uri is None:
            raise DissocError(
                "role='metadata' needs advertise_data_uri (--advertise-data-uri): the data server's"
            )
        if role == "none" and (advertise_uri is None or advertise_data_uri is None):
            raise DissocError(
                "role='none' (a catalog for a control plane, no listener) needs advertise_uri and "
                "advertise_data_uri (--advertise-uri, --advertise-data-uri): the servers' that serve it"
            )
        #: Which of the servers run in this process (see :data:`ROLES`).
        self.role = role
        self._advertised = (advertise_uri, advertise_data_uri)
        for what, number in (("port", port), ("data_port", data_port)):
            if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= 65535:
                # the OS would wrap 70000 to 4464, or take 65536 as "any port"
                raise DissocError(f"{what} must be 0 (any free port) to 65535, got {number!r}")
        #: The signing secret (None: tickets are plain names). Its repr shows no key.
        self.secret: Secret | None = (
            secret if secret is None or isinstance(secret, Secret) else Secret(secret)
        )
        self.catalog = Catalog()
        for name, obj in (datasets or {}).items():
            self.catalog.add(name, obj)
        self.arena: ShmArena | DeviceArena | None = None
        self.served: ServedArena | None = None
        self.placements: Placements | None = None
        self.ledger: Ledger | None = None
        #: With ``private_memory``: the per-connection arenas (there is no shared arena then).
        self.private: PrivateArenas | None = None
        if body not in ("packed", "pairs"):
            raise DissocError(f"body must be 'packed' or 'pairs', got {body!r}")
        # The metadata half, or a bare catalog, lists no pairs: no arena for it (the data half has one).
        arena_here = role in ("all", "data")
        if body == "pairs":
            memory = memory or "shm"
            if memory == "ucx" and transport != "ucx":
                raise DissocError("memory='ucx' (pairs read with UCX RMA) needs transport='ucx'")
            if compression is not None:
                raise DissocError("compression applies to packed bodies; pairs point at uncompressed buffers")
            if not arena_here:
                pass
            elif private_memory:
                # one arena per data connection, each the per-client quota, all of them within arena_bytes
                quota = max_unfreed_bytes if max_unfreed_bytes is not None else arena_bytes // 4
                self.private = PrivateArenas(memory, capacity=quota, budget=arena_bytes)
                max_unfreed_bytes = self.private.capacity
            else:
                self.served = ServedArena(memory, arena_bytes)
                self.arena = self.served.arena
                self.ledger = Ledger(arena_bytes)
                self.placements = Placements(self.arena, resident=resident)
            free_data = DEFAULT_FREE_DATA if free_data is None else free_data
        elif memory is not None:
            raise DissocError(f"memory={memory!r} needs body='pairs'")
        elif private_memory:
            raise DissocError("private_memory (an arena per connection) needs body='pairs'")
        options = ServeOptions(
            want_data=want_data,
            free_data=free_data,
            compression=compression,
            ledger=self.ledger,
            served=self.served,
            placements=self.placements,
            max_ticket_bytes=max_ticket_bytes,
            max_free_data_bytes=max_free_data_bytes,
            want_data_timeout=want_data_timeout,
            idle_timeout=idle_timeout,
            max_unfreed_bytes=max_unfreed_bytes,
            secret=self.secret,
            private=self.private,
        )
        for name, value in (
            ("want_data_timeout", want_data_timeout),
            ("idle_timeout", idle_timeout),
        ):
            if value is not None and value <= 0:
                raise DissocError(f"{name} must be > 0 (or None), got {value!r}")
        if max_ticket_bytes < 0 or max_free_data_bytes < 0:
            raise DissocError("max_ticket_bytes and max_free_data_bytes must be >= 0")
        transport = _tls_setup(
            transport, transport_options, tls_cert, tls_key, tls_client_ca, tls_handshake_timeout
        )
        if max_connections == "auto":
            max_connections = max(1, default_max_connections() // (2 if split else 1))
        #: Shared by every connection of this server (both ports when split).
        self.receive_budget = ReceiveBudget(max_receiving_bytes) if max_receiving_bytes is not None else None
        transport_options = {
            "max_connections": max_connections,
            "max_connections_per_peer": max_connections_per_peer,
            "receive_budget": self.receive_budget,
            **transport_options,
        }
        self.split = split
        self._servers: list[RoleServer]
        if split:
            self._servers = [
                MetadataServer(
                    self.catalog, options, transport=transport, host=host, port=port, **transport_options
                ),
                DataServer(
                    self.catalog, options, transport=transport, host=host, port=data_port, **transport_options
                ),
            ]
        else:
            self._servers = [
                CombinedServer(
                    self.catalog, options, transport=transport, host=host, port=port, **transport_options
                )
            ]
        if role == "metadata":
            self._servers = self._servers[:1]
        elif role == "data":
            self._servers = self._servers[1:]
        elif role == "none":
            self._servers = []
        self._closed = asyncio.Event()

    def add(self, name: str, obj: Any, *, replace: bool = False) -> Dataset:
        """Serve another dataset (at once, to new requests). Safe from any thread (the catalog locks).

        A replaced dataset's resident placements are dropped (each when no client holds it any more)."""
        dataset = self.catalog.add(name, obj, replace=replace)
        if self.placements is not None:
            self.placements.forget(dataset.name)
        return dataset

    def remove(self, name: str) -> Dataset:
        """Stop serving a dataset to new requests (streams already running finish). Safe from any thread.

        Its resident placements are dropped (each when no client holds it any more)."""
        dataset = self.catalog.remove(name)
        if self.placements is not None:
            self.placements.forget(dataset.name)
        return dataset

    async def start(self) -> Self:
        for s in self._servers:
            await s.start()
        register(self)  # its gauges are read when metrics are scraped (dissoc.metrics)
        return self

    def metrics_samples(self) -> Iterator[Sample]:
        """This server's gauges for :mod:`dissoc.metrics` (read at scrape time): connections open, bytes
        awaiting free_data, arena occupancy and evictions, bytes being received."""
        for s in self._servers:
            yield "dissoc_server_connections_open", (s.role.value, s.transport), float(s.open_connections)
        awaiting = self.ledger.live_bytes if self.ledger is not None else 0
        for s in self._servers:
            if isinstance(s, DataServer):
                awaiting += s.private_awaiting_bytes()
        yield "dissoc_server_awaiting_free_data_bytes", (), float(awaiting)
        if self.arena is not None and self.served is not None:
            memory = (self.served.memory,)
            yield "dissoc_server_arena_used_bytes", memory, float(self.arena.used_bytes)
            yield "dissoc_server_arena_capacity_bytes", memory, float(self.arena.capacity)
        if self.placements is not None and self.served is not None:
            memory = (self.served.memory,)
            yield "dissoc_server_arena_resident_bytes", memory, float(self.placements.resident_bytes)
            yield "dissoc_server_arena_placements_total", memory, float(self.placements.placed)
            yield "dissoc_server_arena_evictions_total", memory, float(self.placements.evicted)
        if self.private is not None:
            memory = (self.private.memory,)
            used = sum(a.arena.used_bytes for a in self.private.arenas())
            yield "dissoc_server_arena_used_bytes", memory, float(used)
            yield "dissoc_server_arena_capacity_bytes", memory, float(self.private.budget)
        if self.receive_budget is not None:
            yield "dissoc_server_receiving_bytes", (), float(self.receive_budget.used)

    @property
    def uri(self) -> str:
        """The metadata URI (also the data URI of a combined server); the advertised one if given."""
        return str(self.uris[0])

    @property
    def data_uri(self) -> str:
        """The data URI (equal to :attr:`uri` unless split); the advertised one if given."""
        return str(self.uris[1])

    @property
    def uris(self) -> tuple[DissocURI, DissocURI]:
        """The metadata and data URIs clients are given: the advertised ones where set, else the running
        servers' (a data-only server without ``advertise_uri`` gives its own for both)."""
        meta, data = self._advertised
        own_meta = self._servers[0].uri() if self._servers else None
        own_data = self._servers[-1].uri() if self._servers else None
        if self.role == "data":
            own_meta = own_data
        first = DissocURI.parse(meta) if meta is not None else own_meta
        second = DissocURI.parse(data) if data is not None else own_data
        assert first is not None and second is not None  # checked in __init__
        return first, second

    @property
    def unauthorized(self) -> int:
        """want_data requests refused for their token since the start (both servers when split)."""
        return sum(s.unauthorized for s in self._servers)

    async def serve_forever(self) -> None:
        """Serve until :meth:`close` is called (or the task is cancelled)."""
        await self._closed.wait()

    async def close(self) -> None:
        unregister(self)  # its counters' last values stay in the totals
        for s in self._servers:
            await s.close()
        if self.placements is not None:
            self.placements.close()
        if self.served is not None:
            self.served.close()  # unregisters from UCX, unlinks the segment
        if self.private is not None:
            self.private.close()  # the arenas of connections still open, and their UCX context
        self._closed.set()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _tls_setup(
    transport: str,
    options: dict[str, Any],
    cert: str | os.PathLike[str] | None,
    key: str | os.PathLike[str] | None,
    client_ca: str | os.PathLike[str] | None,
    handshake_timeout: float | None,
) -> str:
    """The transport to serve with, and its TLS options set in ``options``, for the ``tls_*`` arguments."""
    if cert is None:
        if key is not None or client_ca is not None:
            raise DissocError(
                "tls_key and tls_client_ca (--tls-key, --tls-client-ca) need tls_cert (--tls-cert)"
            )
        if transport == "tls" and "tls" not in options:
            raise DissocError("transport='tls' needs tls_cert and tls_key (--tls-cert, --tls-key)")
        return transport
    if transport not in ("tcp", "tls"):
        raise DissocError(f"TLS (tls_cert, --tls-cert) is for the tcp transport, not {transport!r}")
    if handshake_timeout is not None and handshake_timeout <= 0:
        raise DissocError(f"tls_handshake_timeout must be > 0 (or None), got {handshake_timeout!r}")
    options["tls"] = server_context(cert, key, client_ca=client_ca)
    options["handshake_timeout"] = handshake_timeout
    return "tls"
