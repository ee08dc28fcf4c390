"""The Dissociated IPC client: ask for a ticket, receive both streams concurrently, yield batches in order.

    table = dissoc.fetch("tcp://127.0.0.1:9000?want_data=1465007700", "trips")

    async for batch in dissoc.client.stream_batches(uri, "trips", data_uri=data_uri):
        ...

    with dissoc.client.open_stream(uri, "trips") as reader:
        for batch in reader: ...

This module is the client's public face: its options, the entry points, :class:`StreamReader`. The machinery
lives below it in :mod:`dissoc.session` (connections and their pool, the pump around the sans-IO
:class:`dissoc.protocol.ClientStream`, landing and decoding, free_data, the synchronous runners). Metadata and
bodies are matched by sequence number; each batch is decoded over the memory its body was received into (no
copy) as soon as it and everything before it are complete. Memory is bounded: no more than
``max_in_flight_bytes`` of received bodies wait for the consumer, and the transport stops reading beyond its
own budget, so a slow consumer slows the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeAlias

import pyarrow as pa

from dissoc.errors import DissocError, ProtocolError
from dissoc.flight.common import is_flight_location
from dissoc.session.connect import open_connection
from dissoc.session.decoding import Batch
from dissoc.session.frees import settle
from dissoc.session.options import ClientOptions, FetchPath, FetchStats
from dissoc.session.pool import pool_of
from dissoc.session.reading import read_stream
from dissoc.session.runners import LoopRunner, SharedRunner, ThreadRunner, close_idle_main, main_runner, run
from dissoc.tokens import is_signed, peek, split_start
from dissoc.uri import DissocURI

if TYPE_CHECKING:
    from dissoc.device import DeviceBatch
    from dissoc.session.session import Session

__all__ = [
    "Batch",
    "ClientOptions",
    "FetchPath",
    "FetchStats",
    "StreamReader",
    "close_idle_connections",
    "close_idle_connections_sync",
    "fetch",
    "fetch_async",
    "fetch_device",
    "fetch_device_async",
    "open_connection",
    "open_stream",
    "resolve_endpoints",
    "settle",
    "stream_batches",
    "stream_chunks",
]


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
    base, start = split_start(name)
    if start is not None and claims.name == base:
        return f"{token}@{start}"  # a live stream from an offset: the token, then the offset
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
        one = read_stream(*endpoints[0], options=options, stats=stats, on_schema=on_schema)
        async with contextlib.aclosing(one):
            async for chunk in one:
                yield chunk
        return
    if schema is not None and on_schema is not None:
        on_schema(schema)
    check = _SameSchema(uri, ticket, schema, on_schema)
    total = FetchStats()
    try:
        for meta, data, t in endpoints:
            part = FetchStats()
            one = read_stream(meta, data, t, options=options, stats=part, on_schema=check)
            try:
                async with contextlib.aclosing(one):
                    async for chunk in one:
                        yield chunk
            finally:
                total.batches += part.batches
                total.rows += part.rows
                total.bytes += part.bytes
                total.paths += part.paths
    finally:
        if stats is not None:
            stats.batches, stats.rows, stats.bytes = total.batches, total.rows, total.bytes
            stats.paths = total.paths


class _SameSchema:
    """Checks that the endpoints of one Flight location send one schema (the first is passed on)."""

    def __init__(
        self,
        uri: str | DissocURI,
        ticket: str | bytes,
        schema: pa.Schema | None,
        on_schema: Callable[[pa.Schema], None] | None,
    ) -> None:
        self.where = f"{ticket!r} at {uri}"
        self.first = schema
        self.on_schema = on_schema

    def __call__(self, got: pa.Schema) -> None:
        if self.first is None:
            self.first = got
            if self.on_schema is not None:
                self.on_schema(got)
        elif not got.equals(self.first):
            raise ProtocolError(f"the endpoints of {self.where} sent different schemas")


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
        return SharedRunner.get().run(coro())  # type: ignore[no-any-return]
    return run(coro)  # type: ignore[no-any-return]


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


def fetch(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
) -> pa.Table:
    """Fetch a whole stream as a ``pa.Table`` (synchronous)."""
    if options is not None and options.zero_copy:
        return SharedRunner.get().run(fetch_async(uri, ticket, data_uri=data_uri, options=options))
    return run(lambda: fetch_async(uri, ticket, data_uri=data_uri, options=options))


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
        self._landing = options.landing if options is not None else "host"
        self._schema: pa.Schema | None = None
        self._pending: deque[Batch] = deque()
        self._watch: Session | None = None
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
            self._runner = SharedRunner.get()  # zero-copy sessions outlive the reader (see ClientOptions)
        else:
            self._runner = ThreadRunner() if in_loop else (main_runner() or LoopRunner())

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

    def to_reader(self) -> pa.RecordBatchReader:
        """The rest of the stream as a ``pa.RecordBatchReader``, batch by batch (device batches are copied to
        the host). Reading it to its end, or letting it go after reading from it, closes this stream."""
        return pa.RecordBatchReader.from_batches(self.schema, self._host_batches())

    def _host_batches(self) -> Iterator[pa.RecordBatch]:
        # Runs only once the consumer asks for a batch: a consumer that takes the schema and lets go (DuckDB
        # does so while planning a query) leaves the stream open for the next export.
        try:
            for b in self:
                yield b if isinstance(b, pa.RecordBatch) else b.to_arrow()
        finally:
            self.close()

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object:
        """The Arrow PyCapsule stream interface: polars, DuckDB, pandas, pyarrow and others read the rest of
        the stream as it arrives (see :meth:`to_reader`). ``requested_schema`` is passed on to pyarrow, which
        casts to it or raises."""
        return self.to_reader().__arrow_c_stream__(requested_schema)

    def __arrow_c_device_stream__(self, requested_schema: object | None = None, **kwargs: Any) -> object:
        """The Arrow PyCapsule interface for device data: the rest of the stream as an
        ``ArrowDeviceArrayStream`` (see :mod:`dissoc.device.cstream`). With ``landing="device"`` each batch
        is a :class:`~dissoc.device.DeviceBatch`'s own device memory (``ARROW_DEVICE_CUDA`` with CuPy), else
        host memory (``ARROW_DEVICE_CPU``). ``requested_schema`` is not applied. Releasing the stream after
        reading from it closes this stream."""
        for key, value in kwargs.items():
            if value is not None:
                raise NotImplementedError(f"__arrow_c_device_stream__: the keyword {key!r} is not supported")
        from dissoc.device.cstream import export_device_stream

        if self._landing == "device":
            from dissoc.memory.cuda import get_backend

            device_type = get_backend().arrow_device()[0]
        else:
            device_type = 1  # ARROW_DEVICE_CPU
        return export_device_stream(
            self.schema,
            device_type,
            self._next_or_none,
            lambda batch: batch.__arrow_c_device_array__(),
            self._finish_export,
        )

    def _next_or_none(self) -> Batch | None:
        try:
            return self.read_next_batch()
        except StopIteration:
            return None

    def _finish_export(self, started: bool) -> None:
        if started:
            self.close()

    def __arrow_c_schema__(self) -> object:
        """The stream's schema as an Arrow PyCapsule (waits for the schema message)."""
        return self.schema.__arrow_c_schema__()

    def close(self) -> None:
        """Stop reading: the server is told (the connection is closed or handed back) and stops sending."""
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


async def close_idle_connections() -> None:
    """Close the connections the running loop's pool keeps for later streams (``reuse_connections``)."""
    await pool_of(asyncio.get_running_loop()).aclose()


def close_idle_connections_sync() -> None:
    """Close the connections the synchronous API keeps for later streams (this thread's; done at exit
    anyway). Call it before stopping a server this process streamed from, so that closing them later does
    not meet a peer that is gone (UCX logs that as an error)."""
    close_idle_main()


def open_stream(
    uri: str | DissocURI,
    ticket: str | bytes,
    *,
    data_uri: str | DissocURI | None = None,
    options: ClientOptions | None = None,
) -> StreamReader:
    """Open a dissoc stream for synchronous iteration (``pyarrow.ipc.open_stream``'s counterpart)."""
    return StreamReader(uri, ticket, data_uri=data_uri, options=options)
