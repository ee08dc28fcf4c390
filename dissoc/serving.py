"""What every dissoc server does with one want_data request: encode the dataset and send its streams.

The metadata server sends the metadata stream, the data server the data stream, and a combined server both
over one connection. Encoding is deterministic, so a metadata server and a data server serving the same
ticket independently number the same messages the same way: that is what lets the client join them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import pyarrow as pa

from dissoc.codec import MessageEncoder, iter_messages, parse
from dissoc.datasets import Catalog, Dataset, DeviceDataset, IpcFileDataset, IpcStreamDataset, TableDataset
from dissoc.errors import DissocError, TransportError
from dissoc.placements import Placements, Scope
from dissoc.protocol import (
    BODY_PAIRS,
    ERROR_TAG,
    ServerStream,
    decode_free,
    encode_error,
    encode_pairs,
    fmt_seq,
    fmt_tag,
    make_body_tag,
)
from dissoc.protocol.ledger import Ledger
from dissoc.transport import Connection, Listener, serve
from dissoc.transport.base import buffer_nbytes, device_nbytes
from dissoc.uri import DissocURI

__all__ = ["Role", "RoleServer", "ServeOptions", "serve_connection", "stream_dataset"]

log = logging.getLogger(__name__)


class Role(enum.Enum):
    """Which streams a connection carries."""

    METADATA = "metadata"
    DATA = "data"
    COMBINED = "combined"


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """Per-server settings shared by its connections.

    With an ``arena`` (and its ``ledger``), bodies are sent as address/length pairs (body type 1): each
    batch's buffers are copied into the arena and stay there until the client frees them with free_data
    or disconnects. With ``resident`` (the default), the batches of stored and in-memory datasets (whose
    messages are the same on every request) are placed once and listed to every client that asks, with no
    further copy (:mod:`dissoc.placements`); ``placements`` is made for the arena unless given.
    """

    want_data: int
    free_data: int | None = None
    compression: str | None = None
    arena: Any = None
    ledger: Ledger | None = None
    served: Any = None  # the dissoc.pair_memory.ServedArena that owns ``arena``: what the data URI publishes
    resident: bool = True
    placements: Placements | None = None

    def __post_init__(self) -> None:
        if self.arena is not None and self.placements is None:
            object.__setattr__(self, "placements", Placements(self.arena, resident=self.resident))


async def _batches(dataset: Dataset) -> AsyncIterator[pa.RecordBatch]:
    """The dataset's batches. In-memory and memory-mapped ones are read on the event loop; the others
    (Parquet, generated, user factories) in a worker thread, so that one slow read stalls no other client."""
    iterator: Iterator[pa.RecordBatch] = dataset.open()
    inline = isinstance(dataset, (TableDataset, IpcFileDataset))
    sentinel = object()
    try:
        while True:
            if inline:
                batch = next(iterator, sentinel)
            else:
                batch = await asyncio.to_thread(next, iterator, sentinel)
            if batch is sentinel:
                return
            assert isinstance(batch, pa.RecordBatch)
            yield batch
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def _stored_messages(dataset: Dataset) -> Iterator[tuple[Any, list[Any], bool]] | None:
    """Stored IPC data is forwarded as it is (no decode, no re-encode): its messages, or None."""
    if isinstance(dataset, IpcFileDataset):
        source: Any = dataset.buffer
        file_format = True
    elif isinstance(dataset, IpcStreamDataset):
        source, file_format = dataset.path, False
    else:
        return None
    return (
        (meta, [body], msg.has_body) for msg, meta, body in iter_messages(source, file_format=file_format)
    )


async def _encoded_messages(
    dataset: Dataset, options: ServeOptions
) -> AsyncIterator[tuple[Any, list[Any], bool]]:
    """(metadata, body buffers, has body) for every message of the dataset's stream, schema first."""
    stored = _stored_messages(dataset)
    if stored is not None:
        for item in stored:
            yield item
        return
    if _device_bodies(dataset, options):
        from dissoc.device import DeviceEncoder

        batches = dataset.batches
        device_encoder = DeviceEncoder(
            dataset.schema, schema_metadata=batches[0].schema_metadata if batches else None
        )
        yield device_encoder.schema_message().metadata, [], False
        for device_batch in batches:
            for dm in device_encoder.encode(device_batch):
                yield dm.metadata, [dm.body], True
        return
    encoder = MessageEncoder(dataset.schema, compression=options.compression)
    yield encoder.schema_message().metadata, [], False
    async for batch in _batches(dataset):
        for m in encoder.encode(batch):
            yield m.metadata, m.body_buffers, True


# Small messages from a source that never blocks are written together, up to these limits per system call.
_COALESCE_BYTES = 256 << 10
_COALESCE_MESSAGES = 64


def _same_every_time(dataset: Dataset) -> bool:
    """Stored or in-memory data: the next message is ready at once, and the same on every request."""
    return isinstance(dataset, (TableDataset, IpcFileDataset, IpcStreamDataset, DeviceDataset))


def _scope(dataset: Dataset, placements: Placements, current: Callable[[], bool] | None) -> Scope | None:
    """Where the dataset's resident placements are kept, or None when they must be made per request."""
    if not placements.resident or not _same_every_time(dataset):
        return None
    version: Hashable = None
    if isinstance(dataset, IpcStreamDataset):  # read from its path on every request: notice a rewrite
        try:
            st = os.stat(dataset.path)
        except OSError:
            return None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
    return placements.scope(dataset, version=version, current=current)


async def stream_dataset(
    conn: Connection,
    role: Role,
    dataset: Dataset,
    options: ServeOptions,
    *,
    current: Callable[[], bool] | None = None,
) -> int:
    """Send the stream(s) of ``role`` for ``dataset``; returns the number of messages sent.

    ``current()`` says whether ``dataset`` is still the one served under its name (resident placements are
    kept only for a dataset still served).
    """
    stream = ServerStream()
    meta = role is not Role.DATA
    data = role is not Role.METADATA
    # Coalescing only where the next message is ready at once (stored or in-memory data): a source read in
    # a worker thread flushes every message, so the client never waits on a half-filled batch of frames.
    coalesce = _same_every_time(dataset)
    device = _device_bodies(dataset, options)  # each body is then one device array
    placements = options.placements if data and options.arena is not None else None
    # Taken before the first await: the dataset is the one the catalog just gave.
    scope = _scope(dataset, placements, current) if placements is not None else None
    pending: list[tuple[int | None, Any]] = []
    pending_bytes = 0
    try:
        first = True
        async for metadata, body, with_body in _encoded_messages(dataset, options):
            if first:
                first = False
                header = stream.schema(metadata)
                if meta:
                    pending.append((None, [header, metadata]))
                continue
            sent = stream.message(metadata, with_body)
            if meta:
                pending.append((None, [sent.header, metadata]))
                pending_bytes += len(metadata) + 5
            if data and sent.tag is not None and placements is not None:
                # Body type 1: the buffers go into shared memory (once, for a resident placement), the
                # client gets where they are.
                if pending:
                    await conn.send_many(pending)
                    pending, pending_bytes = [], 0
                pairs = await placements.acquire(
                    conn,
                    scope,
                    sent.seq,
                    lambda: _place(conn, placements, _buffers_for_arena(metadata, body, device, placements)),  # noqa: B023
                )
                assert options.ledger is not None
                options.ledger.record(conn, pairs)
                await conn.send_tagged(make_body_tag(sent.seq, BODY_PAIRS), encode_pairs(pairs))
            elif data and sent.tag is not None:
                if device:
                    body = [_device_for_connection(body[0], conn)]
                pending.append((sent.tag, body))
                pending_bytes += sum(buffer_nbytes(b) for b in body)
            if not coalesce or pending_bytes >= _COALESCE_BYTES or len(pending) >= _COALESCE_MESSAGES:
                await conn.send_many(pending)
                pending = []
                pending_bytes = 0
        count = stream.next_seq
        if meta:
            pending.append((None, stream.end()))
        if pending:
            await conn.send_many(pending)
        log.debug("%s stream of %r done: %s messages", role.value, dataset.name, fmt_seq(count))
        return count
    except TransportError:
        raise
    except (DissocError, pa.ArrowException, OSError, ValueError) as e:
        # The dataset or its encoding failed: tell the client on the stream, which then ends.
        log.warning("%s stream of %r failed: %s", role.value, dataset.name, e)
        if pending:
            await conn.send_many(pending)
        await _send_error(
            conn, role, _error(stream, "stream_failed", f"serving {dataset.name!r} failed: {e}")
        )
        return stream.next_seq


def _device_bodies(dataset: Dataset, options: ServeOptions) -> TypeGuard[DeviceDataset]:
    """Whether the dataset's bodies are sent from device memory (device batches, served uncompressed)."""
    return isinstance(dataset, DeviceDataset) and options.compression is None


def _device_for_connection(body: Any, conn: Connection) -> Any:
    """A device body as the connection can send it: as is on a transport that moves device memory (UCX),
    once the producing work has finished; else copied to the host."""
    from dissoc.memory.device import get_backend

    backend = get_backend()
    if conn.device_memory and device_nbytes(body) is not None:
        backend.synchronize()
        return body
    return backend.download(body)


def _buffers_for_arena(metadata: Any, body: list[Any], device: bool, placements: Placements) -> list[Any]:
    """The message's buffers to place: slices of a device body for a device arena (copied device to
    device), else host buffers (a device body is copied to the host first)."""
    if device:
        if placements.arena.is_device:
            return [body[0][o : o + n] if n else b"" for o, n in _spans(metadata)]
        from dissoc.memory.device import get_backend

        body = [pa.py_buffer(get_backend().download(body[0]))]
    return _split_body(metadata, body)


async def _place(conn: Connection, placements: Placements, buffers: list[Any]) -> list[tuple[int, int]]:
    """Place a batch in the arena: at once if it fits, evicting resident placements nobody holds (oldest
    first) if that makes it fit, else waiting for frees, but not past the client's departure (a client that
    holds its batches and leaves, or a server closing, must not leave this task waiting)."""
    now = placements.place_now(buffers)
    if now is not None:
        return now
    arena = placements.arena
    with placements.waiting():  # meanwhile a resident placement is released when its last holder frees it
        placing = asyncio.ensure_future(arena.place_wait(buffers))
        returned = False
        try:
            while True:
                done, _ = await asyncio.wait({placing}, timeout=0.25)
                if done:
                    pairs: list[tuple[int, int]] = placing.result()
                    returned = True
                    return pairs
                if conn.closed:
                    raise TransportError(f"{conn.description}: closed while waiting for room in the arena")
        finally:
            if not placing.done():
                placing.cancel()
                with contextlib.suppress(asyncio.CancelledError, DissocError):
                    await placing
            if not returned and placing.done() and not placing.cancelled() and placing.exception() is None:
                # placed, but nobody will list it
                arena.release_many(offset for offset, _ in placing.result())


async def _send_error(conn: Connection, role: Role, message: bytes) -> None:
    """Errors go on the metadata stream; a data-only connection carries them as a tagged ERROR_TAG message."""
    if role is Role.DATA:
        await conn.send_tagged(ERROR_TAG, message)
    else:
        await conn.send(message)


def _error(stream: ServerStream, code: str, message: str) -> bytes:
    try:
        return stream.error(code, message)
    except RuntimeError:  # the stream already ended or failed: number the error after what was sent
        return encode_error(stream.next_seq, code, message)


def _spans(metadata: Any) -> list[tuple[int, int]]:
    """The (offset, length) of each buffer of a batch message's body."""
    batch = parse(metadata).batch
    assert batch is not None
    return [(int(o), int(n)) for o, n in batch.buffers.tolist()]


def _split_body(metadata: Any, body: list[Any]) -> list[Any]:
    """One buffer per entry of the metadata's ``buffers`` (empty ones as ``b""``), from a packed body given
    as one buffer (stored data) or as the encoder's pieces (buffers and padding)."""
    entries = _spans(metadata)
    if len(body) == 1 and isinstance(body[0], pa.Buffer):
        whole = body[0]
        return [whole.slice(o, n) if n else b"" for o, n in entries]
    at: dict[int, Any] = {}
    pos = 0
    for piece in body:
        size = memoryview(piece).nbytes
        at.setdefault(pos, piece)
        pos += size
    return [at[o] if n else b"" for o, n in entries]


async def _serve_free_data(conn: Connection, role: Role, options: ServeOptions) -> None:
    """Apply the client's free_data messages; a bad one is reported to this client and ends its connection."""
    assert options.free_data is not None and options.ledger is not None and options.placements is not None
    while True:
        try:
            msg = await conn.recv_tagged(options.free_data)
        except TransportError:
            return
        try:
            freed = options.ledger.free_ranges(conn, decode_free(msg.view()))
        except DissocError as e:
            log.warning("free_data from %s rejected: %s", conn.description, e)
            await _send_error(conn, role, encode_error(0, "bad_free_data", str(e)))
            await conn.close()
            return
        options.placements.release(conn, freed)


async def serve_connection(conn: Connection, role: Role, catalog: Catalog, options: ServeOptions) -> None:
    """A connection's life: wait for want_data, answer with the stream, wait again, until the peer leaves."""
    frees = None
    if options.arena is not None and role is not Role.METADATA:
        frees = asyncio.get_running_loop().create_task(_serve_free_data(conn, role, options))
    try:
        await _serve_requests(conn, role, catalog, options)
    finally:
        if frees is not None:
            frees.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await frees
            assert options.ledger is not None and options.placements is not None
            # The client is gone: everything still listed to it can be reused (resident placements once no
            # other client holds them, and the arena needs the room).
            ranges = options.ledger.drop(conn)
            if ranges:
                options.placements.release(conn, ranges)


async def _serve_requests(conn: Connection, role: Role, catalog: Catalog, options: ServeOptions) -> None:
    while True:
        try:
            request = await conn.recv_tagged(options.want_data)
        except TransportError:
            return
        ticket = bytes(request.view())
        log.debug("want_data tag=%s ticket=%r on %s", fmt_tag(request.tag), ticket[:64], conn.description)
        try:
            dataset = catalog.get(ticket)
        except DissocError as e:
            await _send_error(conn, role, encode_error(0, "unknown_ticket", str(e)))
            continue
        await stream_dataset(conn, role, dataset, options, current=_served_now(catalog, dataset))


def _served_now(catalog: Catalog, dataset: Dataset) -> Callable[[], bool]:
    def current() -> bool:
        try:
            return catalog.get(dataset.name) is dataset
        except DissocError:
            return False

    return current


class RoleServer:
    """A listener whose connections carry the streams of one role (base of the metadata and data servers)."""

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

    async def start(self) -> None:
        if self._listener is None:
            self._listener = await serve(
                self.transport, self._host, self._port, self._handle, **self._transport_options
            )
            log.info("%s server listening on %s:%d", self.role.value, self.host, self.port)

    async def _handle(self, conn: Connection) -> None:
        await serve_connection(conn, self.role, self.catalog, self.options)

    @property
    def host(self) -> str:
        return self._listener.host if self._listener is not None else self._host

    @property
    def port(self) -> int:
        return self._listener.port if self._listener is not None else self._port

    def uri(self, **params: str) -> DissocURI:
        """The URI clients use to reach this server (with where pairs point, for a data server using them)."""
        served = self.options.served if self.role is not Role.METADATA else None
        if self._listener is not None:
            params = {**self._listener.uri_params(), **params}
        if served is not None:
            params = {**served.params, **params}
        return DissocURI(
            self.transport,
            self.host,
            self.port,
            self.options.want_data,
            self.options.free_data if served is not None else None,
            remote_handle=served.remote_handle if served is not None else None,
            memory=served.memory if served is not None else None,
            params=params,
        )

    async def close(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
            await listener.wait_closed()
