"""``dissoc.Server``: serve named datasets over Dissociated IPC, combined or split (async context manager).

async with dissoc.Server({"trips": table}) as server:
    print(server.uri)              # tcp://127.0.0.1:PORT?want_data=...
    await server.serve_forever()

What it is told is a :class:`~dissoc.server.options.ServerOptions`, checked before anything is built; this
module builds from it, a step a method: the catalog, the TLS contexts and listening limits, the arena pairs
point into (or the per-connection arenas), and the role servers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Self

import pyarrow as pa

from dissoc.datasets import Catalog, Dataset, UnknownTicket
from dissoc.datasets.live import LiveDataset
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
from dissoc.server.options import DEFAULT_FREE_DATA, ServerOptions
from dissoc.server.role import RoleServer, ServeOptions
from dissoc.tokens import Secret
from dissoc.transport.base import ReceiveBudget, default_max_connections
from dissoc.transport.tls import server_context
from dissoc.uri import DissocURI

__all__ = ["Server"]

log = logging.getLogger(__name__)


class Server:
    """Serves datasets by ticket (the dataset's name).

    ``datasets`` maps names to anything :func:`dissoc.datasets.dataset_from` accepts (a ``pa.Table``, a
    ``RecordBatchReader`` factory, an Arrow IPC or Parquet path). ``options`` says how to serve them (a
    :class:`~dissoc.server.options.ServerOptions`; None: its defaults), and ``overrides`` change any of its
    fields by name, so that ``Server(datasets, split=True, body="pairs")`` is
    ``Server(datasets, ServerOptions(split=True, body="pairs"))``. A keyword that names no field is a
    transport option (:attr:`ServerOptions.transport_options`); one the transport does not take either is a
    ``TypeError`` naming it. A value that fails its check is a :class:`~dissoc.errors.DissocError`.

    With a secret, want_data requests whose ticket is not signed with it are refused (:attr:`unauthorized`
    counts them).
    """

    def __init__(
        self, datasets: dict[str, Any] | None = None, options: ServerOptions | None = None, **overrides: Any
    ) -> None:
        options = ServerOptions.resolve(options, overrides)
        #: What this server was built from (checked, with the overrides applied).
        self.options = options
        #: Which of the servers run in this process (see :data:`~dissoc.server.options.ROLES`).
        self.role = options.role
        self.split = options.split
        self._advertised = (options.advertise_uri, options.advertise_data_uri)
        assert options.secret is None or isinstance(options.secret, Secret)  # made one by the options
        #: The signing secret (None: tickets are plain names). Its repr shows no key.
        self.secret: Secret | None = options.secret
        self.catalog = Catalog()
        for name, obj in (datasets or {}).items():
            self._add_parts(self.catalog.add(name, obj))
        limit = options.max_receiving_bytes
        #: Shared by every connection of this server (both ports when split).
        self.receive_budget = ReceiveBudget(limit) if limit is not None else None
        scheme, listening = self._listening()
        self.arena: ShmArena | DeviceArena | None = None
        self.served: ServedArena | None = None
        self.placements: Placements | None = None
        self.ledger: Ledger | None = None
        #: With ``private_memory``: the per-connection arenas (there is no shared arena then).
        self.private: PrivateArenas | None = None
        self._make_arenas()
        self._servers = self._role_servers(self._serve_options(), scheme, listening)
        self._closed = asyncio.Event()

    def _listening(self) -> tuple[str, dict[str, Any]]:
        """The scheme the listeners serve and their options: the bounds on connections and received bytes,
        the TLS context (the certificate files are read here), then the caller's transport options."""
        options = self.options
        max_connections = options.max_connections
        if max_connections == "auto":
            max_connections = max(1, default_max_connections() // (2 if options.split else 1))
        listening: dict[str, Any] = {
            "max_connections": max_connections,
            "max_connections_per_peer": options.max_connections_per_peer,
            "receive_budget": self.receive_budget,
        }
        if options.scheme in ("tcp", "tls"):
            listening["keepalive"] = options.keepalive
        listening.update(options.transport_options)
        if options.tls_cert is not None:
            listening["tls"] = server_context(
                options.tls_cert, options.tls_key, client_ca=options.tls_client_ca
            )
            listening["handshake_timeout"] = options.tls_handshake_timeout
        return options.scheme, listening

    def _make_arenas(self) -> None:
        """With pair bodies, where pairs point: one shared arena, with its ledger and placements, or the
        per-connection arenas of ``private_memory``. The metadata half, or a bare catalog, lists no pairs
        (the data half has the arena)."""
        options = self.options
        if options.body != "pairs" or options.role not in ("all", "data"):
            return
        memory, size = options.pairs_memory, options.arena_bytes
        if options.private_memory:
            # one arena per data connection, each the per-client quota, all of them within arena_bytes
            quota = options.max_unfreed_bytes if options.max_unfreed_bytes is not None else size // 4
            self.private = PrivateArenas(memory, capacity=quota, budget=size)
        else:
            self.served = ServedArena(memory, size)
            self.arena = self.served.arena
            self.ledger = Ledger(size)
            self.placements = Placements(self.arena, resident=options.resident)

    def _serve_options(self) -> ServeOptions:
        """What every connection of the role servers is served with."""
        options = self.options
        free_data = options.free_data
        if options.body == "pairs" and free_data is None:
            free_data = DEFAULT_FREE_DATA
        # a private arena is one client's quota: what it may hold unfreed is the arena's capacity
        unfreed = self.private.capacity if self.private is not None else options.max_unfreed_bytes
        return ServeOptions(
            want_data=options.want_data,
            free_data=free_data,
            compression=options.compression,
            ledger=self.ledger,
            served=self.served,
            placements=self.placements,
            max_ticket_bytes=options.max_ticket_bytes,
            max_free_data_bytes=options.max_free_data_bytes,
            want_data_timeout=options.want_data_timeout,
            idle_timeout=options.idle_timeout,
            max_unfreed_bytes=unfreed,
            secret=self.secret,
            private=self.private,
        )

    def _role_servers(self, serve: ServeOptions, scheme: str, listening: dict[str, Any]) -> list[RoleServer]:
        """The servers this process runs: a metadata and a data server (``split``), or one combined server;
        only one half of a split server with ``role`` ``metadata`` or ``data``; none with ``none``."""
        options = self.options

        def listener(kind: type[RoleServer], port: int) -> RoleServer:
            return kind(self.catalog, serve, transport=scheme, host=options.host, port=port, **listening)

        if options.role == "none":
            return []
        if not options.split:
            return [listener(CombinedServer, options.port)]
        halves: list[tuple[str, type[RoleServer], int]] = [
            ("metadata", MetadataServer, options.port),
            ("data", DataServer, options.data_port),
        ]
        return [listener(kind, port) for role, kind, port in halves if options.role in ("all", role)]

    def add(self, name: str, obj: Any, *, replace: bool = False) -> Dataset:
        """Serve another dataset (at once, to new requests). Safe from any thread (the catalog locks).

        A dataset with :attr:`~dissoc.datasets.Dataset.parts` (a directory served per file) is served with
        each part under the part's own name (``NAME/PATH``) too. A replaced dataset's resident placements
        are dropped (each when no client holds it any more), and so are its parts."""
        old = self.catalog.get(name) if replace and name in self.catalog else None
        dataset = self.catalog.add(name, obj, replace=replace)
        if old is not None and old is not dataset:
            self._remove_parts(old)
        if self.placements is not None:
            self.placements.forget(dataset.name)
        try:
            self._add_parts(dataset)
        except BaseException:
            self.catalog.remove(dataset.name)
            raise
        return dataset

    def publish(
        self, name: str, schema: pa.Schema | None = None, *, replace: bool = False, **options: Any
    ) -> LiveDataset:
        """Serve a live stream under ``name`` and return it: ``append(batch)`` batches as they are made (from
        any thread), then ``close()`` (or ``fail(error)``; ``with server.publish(...) as stream:`` does
        either). Readers ask for ``NAME`` or ``NAME@OFFSET`` (``earliest``, ``latest``, a number) and follow
        it as it grows. ``options`` are :class:`~dissoc.datasets.LiveDataset`'s: the retention
        (``max_batches``, ``max_bytes``, ``on_full``, ``block_timeout``) and ``device=True`` for a stream of
        :class:`~dissoc.device.DeviceBatch` objects, sent from device memory."""
        stream = LiveDataset(name, schema, **options)
        self.add(name, stream, replace=replace)
        return stream

    def remove(self, name: str) -> Dataset:
        """Stop serving a dataset to new requests (streams already running finish), and its parts. Safe
        from any thread.

        Its resident placements are dropped (each when no client holds it any more)."""
        dataset = self.catalog.remove(name)
        if self.placements is not None:
            self.placements.forget(dataset.name)
        self._remove_parts(dataset)
        return dataset

    def _add_parts(self, dataset: Dataset) -> None:
        """Serve each of the dataset's parts under its name: all of them, or none when a name is taken."""
        added: list[str] = []
        try:
            for part in dataset.parts:
                added.append(self.catalog.add(part.name, part).name)
        except BaseException:
            for done in added:
                self.catalog.remove(done)
            raise

    def _remove_parts(self, dataset: Dataset) -> None:
        """Stop serving the dataset's parts (those still served as they were added)."""
        for part in dataset.parts:
            try:
                if self.catalog.get(part.name) is not part:
                    continue
                self.catalog.remove(part.name)
            except UnknownTicket:  # removed meanwhile
                continue
            if self.placements is not None:
                self.placements.forget(part.name)

    async def start(self) -> Self:
        for s in self._servers:
            await s.start()
        register(self)  # its gauges are read when metrics are scraped (dissoc.metrics)
        return self

    def metrics_samples(self) -> Iterator[Sample]:
        """This server's gauges for :mod:`dissoc.metrics` (read at scrape time): connections open, bytes
        awaiting free_data, arena occupancy and evictions, bytes being received, and each live stream's head,
        retention, readers and lag."""
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
        for name in self.catalog.names():
            stream = self.catalog.get(name) if name in self.catalog else None
            if isinstance(stream, LiveDataset):
                held, nbytes = stream.retained
                lags = stream.lags()
                yield "dissoc_live_head_offset", (name,), float(stream.head)
                yield "dissoc_live_first_offset", (name,), float(stream.first)
                yield "dissoc_live_retained_batches", (name,), float(held)
                yield "dissoc_live_retained_bytes", (name,), float(nbytes)
                yield "dissoc_live_readers", (name,), float(len(lags))
                yield "dissoc_live_max_lag_batches", (name,), float(max(lags, default=0))

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
