"""The data server: answers want_data with a ticket's bodies, and applies the client's free_data.

Each message with a body is sent as one tagged message whose tag carries its sequence number and body type:

- **packed** (body type 0): the body itself, straight from where it lies (the encoder's pieces, a slice of
  a memory-mapped file, or device memory over a transport that moves it; through the host otherwise);
- **pairs** (body type 1): the batch's buffers are placed in the server's arena (once, for a resident
  placement: :mod:`dissoc.memory.placements`) and the client gets their (offset, length) pairs; the ranges
  stay alive until the client lists them in a free_data message or disconnects (:mod:`dissoc.protocol.ledger`
  keeps the account per client).

Errors on a data-only connection travel as a tagged message (tag ``0xE0 << 56``) carrying the error JSON.

With private arenas (``ServeOptions.private``), each connection's pair lists point into an arena of its own,
made when the first pair list of its first accepted stream is due (so only after want_data was accepted) and
destroyed when the connection closes; the client learns it from the arena announcement (tag ``0xE1 << 56``,
:mod:`dissoc.protocol.arena`) sent before the first pair list of every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import pyarrow as pa

from dissoc.buffers import buffer_nbytes, device_nbytes
from dissoc.codec import parse
from dissoc.datasets import Catalog, Dataset, IpcStreamDataset
from dissoc.datasets.messages import device_bodies, same_every_time
from dissoc.errors import DissocError, ResourceError, TransportError
from dissoc.logs import RateLimitedLog
from dissoc.memory.arena import Body
from dissoc.memory.pairs import ServedArena
from dissoc.memory.placements import Placements, Scope
from dissoc.memory.private import PrivateArenas
from dissoc.metrics import SERVER
from dissoc.protocol import (
    ARENA_TAG,
    BODY_PAIRS,
    ServerMessage,
    decode_free,
    encode_arena,
    encode_error,
    encode_pairs,
    fmt_seq,
    make_body_tag,
)
from dissoc.protocol.ledger import Ledger, QuotaExceeded
from dissoc.server.role import Role, RoleServer, ServeOptions
from dissoc.server.stream import Outbox, StreamPart
from dissoc.transport import Connection

__all__ = ["DataPart", "DataServer"]

log = logging.getLogger(__name__)
#: What a client can make the server log at will (a bad free_data) is rate-limited.
_peer_log = RateLimitedLog(log)

#: How often a stream whose client is at its quota looks whether it freed enough.
_QUOTA_POLL_S = 0.02
#: How long a request from a client still holding earlier streams past its quota waits for frees in flight.
_FREE_GRACE_S = 1.0


class PrivateMemory:
    """One connection's own arena (private arenas): its ledger from the start, its arena (with placements
    made per request: nothing is resident, nothing is shared) from the first pair list on, and the
    announcement that tells the client where it is. Offsets of different arenas are unrelated, hence a ledger
    per connection."""

    def __init__(self, arenas: PrivateArenas) -> None:
        self._arenas = arenas
        self.ledger = Ledger(arenas.capacity)
        self.served: ServedArena | None = None
        self.placements: Placements | None = None
        self.announcement = b""
        self.closed = False

    async def open(self) -> Placements:
        """The arena's placements, the arena made first if need be (in a worker thread: a large segment
        takes tens of milliseconds to reserve). Raises :class:`~dissoc.memory.private.ArenasExhausted` when
        the server holds as many private arenas as it may."""
        if self.placements is not None:
            return self.placements
        making = asyncio.get_running_loop().run_in_executor(None, self._arenas.open)
        try:
            served = await asyncio.shield(making)
        except asyncio.CancelledError:
            # the connection went while the arena was being made: destroy it once it is
            making.add_done_callback(self._discard)
            raise
        if self.closed:
            self._arenas.release(served)
            raise TransportError("the connection closed while its private arena was being made")
        self.served = served
        self.placements = Placements(served.arena, resident=False)
        self.announcement = encode_arena(served.memory, served.remote_handle, served.params)
        return self.placements

    def _discard(self, making: asyncio.Future[ServedArena]) -> None:
        if not making.cancelled() and making.exception() is None:
            self._arenas.release(making.result())

    def close(self) -> None:
        """Destroy the arena (deregistered, unlinked, unmapped); the connection is gone."""
        self.closed = True
        placements, self.placements = self.placements, None
        served, self.served = self.served, None
        if placements is not None:
            placements.close()
        if served is not None:
            self._arenas.release(served)


def _host_nbytes(body: list[Any]) -> int:
    """The size of a body's buffers (``pa.Buffer`` sizes read directly: the per-message path)."""
    total = 0
    for b in body:
        total += b.size if type(b) is pa.Buffer else buffer_nbytes(b)
    return total


class DataPart(StreamPart):
    """The bodies of one stream on one connection, packed or as pair lists (into the server's shared arena,
    or into the connection's own: ``private``)."""

    def __init__(
        self,
        conn: Connection,
        dataset: Dataset,
        options: ServeOptions,
        current: Callable[[], bool],
        private: PrivateMemory | None = None,
        transport: str = "tcp",
    ) -> None:
        self._conn = conn
        self._options = options
        self._device = device_bodies(dataset, options.compression)  # each body is then one device array
        self._pairs = options.pairs
        # bytes and batches sent (metrics), added to per message
        self._tally = SERVER.sent(transport, "pairs" if self._pairs else "packed")
        self._private = private
        self._placements = options.placements
        self._scope = _scope(dataset, self._placements, current) if self._placements is not None else None
        self._ledger = private.ledger if private is not None else options.ledger
        self._quota = options.unfreed_quota
        self._announce = private is not None  # before the stream's first pair list
        # What the client held before this stream (never more than it holds now): bytes this stream cannot
        # wait for, since only its own batches are sure to be freed as the client reads on.
        self._held_before = self._ledger.live_bytes_of(conn) if self._ledger is not None else 0
        # Bytes this stream listed (what the client holds beyond that was listed before it, whatever it freed
        # of this stream's meanwhile): frees of an earlier stream that arrive once this one began lower it.
        self._listed = 0

    def message(
        self, out: Outbox, sent: ServerMessage, metadata: Any, body: list[Any]
    ) -> Awaitable[None] | None:
        tag = sent.tag
        if tag is None:
            return None
        if not self._pairs:
            if self._device:
                body = [_device_for_connection(body[0], self._conn)]
            # stored data: one slice of the file
            nbytes = body[0].size if len(body) == 1 and type(body[0]) is pa.Buffer else _host_nbytes(body)
            out.add(tag, body, nbytes)
            tally = self._tally
            tally.batches += 1
            tally.bytes += nbytes
            return None
        if self._scope is not None and self._private is None and self._listed_resident(out, sent, body):
            return None
        return self._send_pairs(out, sent, metadata, body)

    def _listed_resident(self, out: Outbox, sent: ServerMessage, body: list[Any]) -> bool:
        """The per-message path of pair lists: a batch already resident in the shared arena, listed to a
        client whose quota has room, is queued behind its metadata with no wait; False when it needs more
        (placing, waiting for room or for frees: :meth:`_send_pairs`)."""
        conn, ledger, placements = self._conn, self._ledger, self._placements
        assert ledger is not None and placements is not None
        nbytes = int(body[0].nbytes) if self._device else _host_nbytes(body)
        if not ledger.fits_quota(conn, nbytes, self._quota) and ledger.live_bytes_of(conn):
            return False
        pairs = placements.lookup(conn, self._scope, sent.seq)
        if pairs is None:
            return False
        live = ledger.live_bytes_of(conn)
        ledger.record(conn, pairs)
        self._listed += ledger.live_bytes_of(conn) - live
        listing = encode_pairs(pairs)
        out.add(make_body_tag(sent.seq, BODY_PAIRS), listing, len(listing))
        tally = self._tally
        tally.batches += 1
        tally.bytes += nbytes
        return True

    async def _send_pairs(self, out: Outbox, sent: ServerMessage, metadata: Any, body: list[Any]) -> None:
        """Body type 1: the buffers go into the arena (once, for a resident placement), the client gets where
        they are. What is queued goes first: the client must see the metadata before the pairs."""
        conn = self._conn
        await out.flush()
        ledger = self._ledger
        assert ledger is not None
        # a device body is one device array (it has nbytes, not the buffer protocol)
        nbytes = int(body[0].nbytes) if self._device else sum(buffer_nbytes(b) for b in body)
        private = self._private
        gone: Callable[[], bool] = lambda: conn.closed  # noqa: E731
        if private is None:
            placements = self._placements
            assert placements is not None
        else:
            placements = await private.open()
            if nbytes > private.ledger.capacity_bytes:
                raise ResourceError(
                    f"message {fmt_seq(sent.seq)} has {nbytes} bytes of buffers, more than this connection's "
                    f"private arena holds ({private.ledger.capacity_bytes} bytes: max_unfreed_bytes)"
                )
            if self._announce:
                self._announce = False
                await conn.send_tagged(ARENA_TAG, private.announcement)
            gone = _Stall(conn, ledger, nbytes, self._options.unfreed_wait, sent.seq)
        if not ledger.fits_quota(conn, nbytes, self._quota) and ledger.live_bytes_of(conn):
            # (a client holding nothing gets its batch, however large: the arena bounds that)
            await self._wait_for_quota(ledger, sent, nbytes)
        pairs = await placements.acquire(
            conn,
            self._scope,
            sent.seq,
            lambda: _buffers_for_arena(metadata, body, self._device, placements),
            gone=gone,
            what=conn.description,
        )
        live = ledger.live_bytes_of(conn)
        ledger.record(conn, pairs)
        self._listed += ledger.live_bytes_of(conn) - live
        await conn.send_tagged(make_body_tag(sent.seq, BODY_PAIRS), encode_pairs(pairs))
        tally = self._tally
        tally.batches += 1
        tally.bytes += nbytes

    async def _wait_for_quota(self, ledger: Ledger, sent: ServerMessage, nbytes: int) -> None:
        """The client would hold more than its quota awaiting free_data. The stream fails with
        ``quota_exceeded`` when what the client held before it leaves no room and it frees nothing within a
        second (it asks again without freeing; frees already in flight are waited for). Within one stream the
        quota only holds back a client while others wait for room in the arena: then the stream waits for its
        client to free (backpressure, as a full arena gives) and fails when it frees nothing for
        ``unfreed_wait`` seconds. Alone, a client may fill the arena with one stream (a spec-following client
        may free only at the end of a stream that fits)."""
        conn, quota = self._conn, self._quota
        loop = asyncio.get_running_loop()
        held = ledger.live_bytes_of(conn)
        since = loop.time()
        while True:
            # what is held beyond this stream's own listings was listed before it (at most)
            self._held_before = min(self._held_before, max(0, held - self._listed))
            why = None
            contended = self._placements is not None and self._placements.hungry > 0
            if self._held_before and self._held_before + nbytes > quota:
                # frees already on their way (a client may send free_data and want_data back to back, and
                # they are read by different tasks) are waited for briefly; a client that does not free is
                # refused then
                if loop.time() - since > _FREE_GRACE_S:
                    why = f"{self._held_before} of them listed before this stream"
            elif not contended:
                return
            elif loop.time() - since > self._options.unfreed_wait:
                why = f"nothing freed for {self._options.unfreed_wait:g} s"
            if why is not None:
                raise QuotaExceeded(
                    f"message {fmt_seq(sent.seq)} ({nbytes} bytes) would make this client hold "
                    f"{held + nbytes} bytes awaiting free_data, over its quota of {quota} bytes ({why}): "
                    "free what you hold"
                )
            if conn.closed:
                raise TransportError(f"{conn.description}: closed while waiting for free_data")
            await asyncio.sleep(_QUOTA_POLL_S)
            now = ledger.live_bytes_of(conn)
            if now + nbytes <= quota or not now:
                return
            if now < held:
                since = loop.time()  # it frees: keep waiting
            held = now


class _Stall:
    """The ``gone`` check of a placement waiting for room in a private arena: true once the connection
    closed; raises :class:`~dissoc.protocol.ledger.QuotaExceeded` when its client (the only one who can make
    room there) freed nothing for ``wait`` seconds."""

    def __init__(self, conn: Connection, ledger: Ledger, nbytes: int, wait: float, seq: int) -> None:
        self._conn = conn
        self._ledger = ledger
        self._nbytes = nbytes
        self._wait = wait
        self._seq = seq
        self._held = ledger.live_bytes_of(conn)
        self._since = time.monotonic()

    def __call__(self) -> bool:
        if self._conn.closed:
            return True
        now = time.monotonic()
        held = self._ledger.live_bytes_of(self._conn)
        if held < self._held:
            self._since = now  # it frees: keep waiting
        self._held = held
        if now - self._since > self._wait:
            raise QuotaExceeded(
                f"message {fmt_seq(self._seq)} ({self._nbytes} bytes) does not fit in this connection's "
                f"private arena of {self._ledger.capacity_bytes} bytes (max_unfreed_bytes), which holds "
                f"{held} bytes awaiting free_data, and nothing was freed for {self._wait:g} s: "
                "free what you hold"
            )
        return False


class DataServer(RoleServer):
    """Sends bodies only (the data stream); the metadata comes from a
    :class:`~dissoc.server.metadata.MetadataServer`."""

    role = Role.DATA

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
        super().__init__(catalog, options, transport=transport, host=host, port=port, **transport_options)
        self._private: dict[Connection, PrivateMemory] = {}

    def private_awaiting_bytes(self) -> int:
        """Bytes listed in the connections' private arenas and not freed yet (0 without private arenas)."""
        return sum(p.ledger.live_bytes for p in list(self._private.values()))

    def private_memory(self, conn: Connection) -> PrivateMemory | None:
        """``conn``'s own arena with private arenas (None otherwise, or once it closed)."""
        return self._private.get(conn)

    def parts(self, conn: Connection, dataset: Dataset, current: Callable[[], bool]) -> list[StreamPart]:
        return [
            DataPart(
                conn, dataset, self.options, current, self.private_memory(conn), transport=self.transport
            )
        ]

    def _holds_ranges(self, conn: Connection) -> bool:
        private = self._private.get(conn)
        if private is not None:
            return private.ledger.live_bytes_of(conn) > 0
        return super()._holds_ranges(conn)

    async def serve_connection(self, conn: Connection) -> None:
        """Answer want_data and, with pair bodies, apply free_data, until the peer leaves; then everything
        still listed to it is given back (and its private arena destroyed)."""
        options = self.options
        if not options.pairs:
            await super().serve_connection(conn)
            return
        private: PrivateMemory | None = None
        if options.private is not None:
            private = self._private[conn] = PrivateMemory(options.private)
        ledger = private.ledger if private is not None else options.ledger
        assert ledger is not None
        frees = asyncio.get_running_loop().create_task(self._serve_free_data(conn, ledger, private))
        try:
            await super().serve_connection(conn)
        finally:
            frees.cancel()
            try:
                with contextlib.suppress(asyncio.CancelledError, DissocError):
                    await frees
            finally:
                # The client is gone: everything still listed to it can be reused (resident placements once
                # no other client holds them, and the arena needs the room). Nothing the free_data task
                # raised may skip this, or the ranges stay allocated with no client left to free them.
                ranges = ledger.drop(conn)
                placements = private.placements if private is not None else options.placements
                if ranges and placements is not None:
                    placements.release(conn, ranges)
                if private is not None:
                    self._private.pop(conn, None)
                    # unmapping a large segment takes a while: off the event loop (it completes even if
                    # this task is cancelled meanwhile)
                    closing = asyncio.get_running_loop().run_in_executor(None, _close_quietly, private)
                    await asyncio.shield(closing)

    async def _serve_free_data(self, conn: Connection, ledger: Ledger, private: PrivateMemory | None) -> None:
        """Apply the client's free_data messages; a bad one is reported to this client and ends its
        connection."""
        options = self.options
        assert options.free_data is not None
        while True:
            try:
                msg = await conn.recv_tagged(options.free_data)
            except TransportError:
                return
            SERVER.free_data.inc(self.role.value)
            held = ledger.live_bytes_of(conn)
            try:
                freed = ledger.free_ranges(conn, decode_free(msg.view()))
            except DissocError as e:
                SERVER.refusals.inc("bad_free_data")
                _peer_log.log(
                    logging.WARNING, "bad_free_data", "free_data from %s rejected: %s", conn.description, e
                )
                with contextlib.suppress(TransportError):  # the client may be gone already
                    await self.send_error(conn, encode_error(0, "bad_free_data", str(e)))
                await conn.close()
                return
            SERVER.freed_bytes.inc(self.role.value, amount=held - ledger.live_bytes_of(conn))
            placements = private.placements if private is not None else options.placements
            if freed and placements is not None:
                placements.release(conn, freed)


def _close_quietly(private: PrivateMemory) -> None:
    try:
        private.close()
    except Exception:  # logged: the connection is gone either way, and the server's close sweeps again
        log.warning("destroying a private arena failed", exc_info=True)


def _scope(dataset: Dataset, placements: Placements, current: Callable[[], bool]) -> Scope | None:
    """Where the dataset's resident placements are kept, or None when they must be made per request."""
    if not placements.resident or not same_every_time(dataset):
        return None
    version: Hashable = None
    if isinstance(dataset, IpcStreamDataset):  # read from its path on every request: notice a rewrite
        try:
            st = os.stat(dataset.path)
        except OSError:
            return None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
    return placements.scope(dataset, version=version, current=current)


def _device_for_connection(body: Any, conn: Connection) -> Any:
    """A device body as the connection can send it: as is on a transport that moves device memory (UCX),
    once the producing work has finished; else copied to the host."""
    from dissoc.memory.cuda import get_backend

    backend = get_backend()
    if conn.device_memory and device_nbytes(body) is not None:
        backend.synchronize()
        return body
    return backend.download(body)


def _buffers_for_arena(
    metadata: Any, body: list[Any], device: bool, placements: Placements
) -> list[Any] | Body:
    """The message's buffers to place: a device body placed whole in a device arena (one device-to-device
    copy, its buffers where the IPC body has them, so that a client can view or copy it as one range with the
    metadata as it is), else host buffers (a device body is copied to the host first)."""
    if device:
        if placements.arena.is_device:
            return Body(body[0], _spans(metadata))
        from dissoc.memory.cuda import get_backend

        body = [pa.py_buffer(get_backend().download(body[0]))]
    return _split_body(metadata, body)


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
