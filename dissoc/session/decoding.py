"""Turning a stream's released messages into batches: one decode-and-account step for every body kind.

A :class:`~dissoc.protocol.MessageReady` carries its body as it arrived: landed in a slab
(:class:`~dissoc.session.landing.Landed`), a buffer of its own (host or device memory), or a pair list
pointing into the server's memory. :meth:`Decoding.message` decodes any of them over the memory it is in (no
copy, every offset checked against the bytes present) and counts what it carried; :meth:`Decoding.schema`
and :meth:`Decoding.arena` take the other events.

It also keeps the path the stream's bytes took (:attr:`Decoding.path`, a
:class:`~dissoc.session.options.FetchPath`). Landing on the device, the first body that went through host
memory is logged once (a warning) and counted (``dissoc_client_device_host_copies_total``), or, with
``ClientOptions(require_device_path=True)``, raised as :class:`~dissoc.errors.DevicePathError` instead of
handing its batch out.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

import pyarrow as pa

from dissoc.codec import MessageDecoder
from dissoc.errors import DevicePathError, DissocError, ProtocolError
from dissoc.memory.pairs import PairReader, open_pair_reader
from dissoc.metrics import CLIENT
from dissoc.protocol import (
    BODY_PACKED,
    BODY_PAIRS,
    ArenaAnnouncement,
    ClientEvent,
    MessageReady,
    PairList,
    fmt_seq,
)
from dissoc.session.landing import Landed
from dissoc.session.options import HOST_COPY, ClientOptions, FetchPath, FetchStats
from dissoc.uri import DissocURI

if TYPE_CHECKING:
    from dissoc.device import DeviceBatch
    from dissoc.device.landing import DeviceLanding

__all__ = ["Batch", "Decoding"]

#: What a stream yields: host batches, or device batches with ``ClientOptions(landing="device")``.
Batch: TypeAlias = "pa.RecordBatch | DeviceBatch"

_ArenaKey: TypeAlias = "tuple[str, bytes | None, tuple[tuple[str, str], ...]]"

log = logging.getLogger("dissoc.client")  # (the client's lines, wherever its machinery lives)

#: What a stream landing on the device through host memory is told to do instead.
DEVICE_PATH_ADVICE = (
    "for the device path, fetch over UCX (a ucx:// URI) with CuPy and a CUDA-capable UCX build, whose CUDA "
    "transports receive packed bodies into device memory, or from a server whose pairs are in device memory "
    "(--body pairs --memory cuda: CUDA IPC)"
)


def _arena_key(uri: DissocURI) -> _ArenaKey:
    """What tells two arenas apart: memory kind, handle and the kind's parameters."""
    return (str(uri.memory), uri.remote_handle, tuple(sorted(uri.params.items())))


def _arena_kind(uri: DissocURI) -> str:
    """``FetchPath.arena`` for a data URI with pairs: one arena per connection, or one for every client."""
    return "private" if uri.params.get("arena") == "private" else "shared"


class Decoding:
    """One stream's decoder, device landing and pair reader, and what was decoded (:attr:`stats`); the
    ranges pair reads are done with wait in :attr:`to_free` for the session's free_data."""

    def __init__(
        self,
        options: ClientOptions,
        data_uri: DissocURI,
        *,
        on_release: Callable[[list[int]], None],
        to_free: list[int],
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.options = options
        self.data_uri = data_uri
        self.decoder = MessageDecoder(validate=options.validate)
        self.stats = FetchStats()
        memory = data_uri.memory
        #: The path the stream's bytes took (the metadata transport and UCX lanes are known once it began:
        #: :meth:`began`; device landing ways as bodies land).
        self.path = FetchPath(
            transport=data_uri.scheme,
            data_transport=data_uri.scheme,
            bodies="packed" if memory is None else "pairs",
            memory=memory,
            arena=None if memory is None else _arena_kind(data_uri),
        )
        self._ways = {""}  # the device landing ways seen (and none: a message without a body)
        self._schema_metadata: object = None
        self.to_free = to_free
        self._on_release = on_release
        self._on_idle = on_idle
        self.device: DeviceLanding | None = None
        if options.landing == "device":
            from dissoc.device.landing import DeviceLanding

            self.device = DeviceLanding(validate=options.validate)
        elif options.landing != "host":
            raise DissocError(f"landing: expected 'host' or 'device', got {options.landing!r}")
        # A private arena (the URI says arena=private) is announced on the data connection once want_data
        # was accepted (see arena()); any other is named in the URI itself.
        self.pairs: PairReader | None = None
        self._arena: _ArenaKey | None = None
        if data_uri.memory is not None and data_uri.params.get("arena") != "private":
            self.pairs = self._watched(
                open_pair_reader(
                    data_uri,
                    zero_copy=options.zero_copy,
                    on_release=on_release,
                    timeout=options.connect_timeout,
                )
            )
            self._arena = _arena_key(data_uri)

    def _watched(self, reader: PairReader) -> PairReader:
        """``reader``, telling ``on_idle`` when its last zero-copy batch is released (readers that lease)."""
        if self._on_idle is not None and hasattr(reader, "on_idle"):
            reader.on_idle = self._on_idle
        return reader

    def began(self, transport: str, lanes: tuple[str, ...]) -> None:
        """The stream began: the metadata connection's scheme and the data connection's lanes (UCX's
        transports, :meth:`dissoc.transport.Connection.lanes`) complete :attr:`path`."""
        self.path = dataclasses.replace(self.path, transport=transport, ucx_transports=lanes)

    @property
    def lands_on_host(self) -> bool:
        """Whether packed bodies land in host memory and are decoded there (what slabs are for)."""
        return self.device is None and self.data_uri.memory is None

    def schema(self, metadata: object) -> pa.Schema:
        """The stream's Schema message (decoded once: a second call with it gives the same schema)."""
        schema = self.decoder.schema
        if schema is not None and metadata is self._schema_metadata:
            return schema
        if self.device is not None:
            self.device.schema(metadata)
        self.decoder.decode(metadata)
        self._schema_metadata = metadata
        schema = self.decoder.schema
        assert schema is not None
        return schema

    def messages(self, ready: deque[ClientEvent], out: list[Batch], limit: int) -> int:
        """Decode the :class:`~dissoc.protocol.MessageReady` events at the front of ``ready`` (each popped)
        into ``out``, as :meth:`message` would one by one, until another kind of event comes or the bytes
        decoded (``stats.bytes``) reach ``limit``; returns the bytes of their tagged messages (``nbytes``).
        Bodies landed for one read are decoded here in fewer steps (the per-batch path of small batches)."""
        stats = self.stats
        consumed = batches = rows = nbytes = 0
        try:
            while ready:
                ev = ready[0]
                if type(ev) is not MessageReady:
                    break
                ready.popleft()
                size = ev.nbytes
                consumed += size
                body = ev.body
                if type(body) is Landed and body.plain is not None:
                    batch: Batch = body.plain.read(body.framed)
                    batches += 1
                    rows += batch.num_rows
                    nbytes += size
                    out.append(batch)
                else:
                    got = self.message(ev)
                    if got is not None:
                        out.append(got)
                if stats.bytes + nbytes >= limit:
                    break
        finally:
            stats.batches += batches
            stats.rows += rows
            stats.bytes += nbytes
        return consumed

    def message(self, ev: MessageReady) -> Batch | None:
        """A released message as a batch (None: a dictionary batch, nothing to hand over), counted."""
        body = ev.body
        if type(body) is Landed:
            framed, plain = body
            batch: Batch | None = (
                plain.read(framed) if plain is not None else self.decoder.decode_landed(ev.metadata, framed)
            )
            size = ev.nbytes
        elif ev.body_type == BODY_PAIRS:
            assert isinstance(body, PairList)
            batch = self._pairs(ev, body)
            size = int(body.total)
        elif ev.body_type == BODY_PACKED:
            device = self.device
            if device is not None:
                batch = device.packed(ev.metadata, body)
                if device.way not in self._ways:
                    self._landed(device.way)
            else:
                batch = self.decoder.decode(ev.metadata, body)
            size = ev.nbytes
        else:
            raise ProtocolError(f"message {fmt_seq(ev.seq)}: unknown body type {ev.body_type}")
        if batch is not None:
            stats = self.stats
            stats.batches += 1
            stats.rows += batch.num_rows
            stats.bytes += size
        return batch

    def _pairs(self, ev: MessageReady, pairs: PairList) -> Batch | None:
        """Body type 1: read the listed ranges (copy, zero-copy or RMA); what is done with goes to free."""
        reader = self.pairs
        if reader is None:
            where = (
                "the data server announced no arena"
                if self.data_uri.memory is not None
                else "the data URI names no memory"
            )
            raise ProtocolError(f"message {fmt_seq(ev.seq)}: address/length pairs, but {where} for them")
        device = self.device
        if device is not None:
            batch, done = device.pairs(ev.metadata, pairs, reader)
            self.to_free.extend(done)
            if device.way not in self._ways:
                self._landed(device.way)
            return batch
        buffers, done = reader.read(pairs)
        self.to_free.extend(done)
        return self.decoder.decode_scattered(ev.metadata, buffers)

    def _landed(self, way: str) -> None:
        """A body reached the device a way this stream had not taken yet: noted in the path; through host
        memory, warned about and counted once, or refused (``require_device_path``)."""
        self._ways.add(way)
        path = self.path = dataclasses.replace(self.path, device_landing=(*self.path.device_landing, way))
        if way != HOST_COPY:
            return
        CLIENT.device_host_copies.inc(path.data_transport, path.bodies)
        if path.bodies == "pairs":
            how = f"this stream's pairs point into host memory (memory={path.memory}) and were read there"
        elif path.data_transport == "ucx":
            assert self.device is not None
            how = (
                "this stream's packed bodies over ucx were received into host memory (the device backend is "
                f"{self.device.backend.name!r}, not CuPy)"
            )
        else:
            how = f"this stream's packed bodies over {path.data_transport} were received into host memory"
        if self.options.require_device_path:
            raise DevicePathError(
                f"landing='device' with require_device_path: {how}, then uploaded to the device; "
                f"{DEVICE_PATH_ADVICE}"
            )
        log.warning(
            "landing='device', but %s, then uploaded to the device (warned once per stream; "
            "ClientOptions(require_device_path=True) makes it an error); %s",
            how,
            DEVICE_PATH_ADVICE,
        )

    def arena(self, arena: ArenaAnnouncement) -> None:
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
        self.pairs = self._watched(
            open_pair_reader(
                announced,
                zero_copy=self.options.zero_copy,
                on_release=self._on_release,
                timeout=self.options.connect_timeout,
            )
        )
        self._arena = key

    def close(self) -> None:
        """The stream is over: the decoders' dictionaries are needed no more (zero-copy ones lie in the
        server's memory, which goes back when the consumer's batches are released, not with the session)."""
        self.decoder.dictionaries.clear()
        self.device = None
