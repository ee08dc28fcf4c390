"""An Arrow Flight control plane in front of a running :class:`dissoc.server.Server`.

The server half: :class:`FlightControlPlane` and :func:`serve_with_flight`.

Flight clients discover datasets here and get, per endpoint, the ticket and two locations: the dissoc
metadata URI, then the data URI (``tcp://H:P?want_data=N...``, exactly :attr:`Server.uri` and
:attr:`Server.data_uri`); the batches then move over Dissociated IPC. A dataset has one endpoint, its own
ticket, or, when it is served in parts (:attr:`Dataset.parts <dissoc.datasets.Dataset.parts>`: a directory
served per file), one endpoint per part, the part's ticket, in order. For clients that speak only Flight,
DoGet streams the same datasets over gRPC, DoPut publishes a dataset into the running server, and actions
remove datasets and list tickets::

    async with Server({"trips": table}) as server, FlightControlPlane(server) as plane:
        print(plane.location)                        # grpc://127.0.0.1:PORT
        await server.serve_forever()

    endpoints = dissoc.flight.resolve("grpc://127.0.0.1:PORT", "trips")   # [(uri, data_uri, ticket)]
    table = dissoc.fetch("grpc://127.0.0.1:PORT", "trips")

Threads: pyarrow runs the Flight server's handlers in its own (gRPC) threads, while the dissoc server runs on
an asyncio loop. The two share only the server's :class:`~dissoc.datasets.Catalog`, which is thread-safe (an
``RLock`` guards every read and change; ``Server.add``/``Server.remove`` only delegate to it), so handlers
read and change it directly. They never wait for the event loop, which keeps a synchronous Flight client
called from the loop's own thread from deadlocking.

``pyarrow.flight`` is imported on first use: without it, importing this module still works and using it
raises a :class:`~dissoc.errors.DissocError` that says what to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self

import pyarrow as pa

from dissoc.datasets import (
    Dataset,
    DatasetError,
    IpcFileDataset,
    IpcStreamDataset,
    TableDataset,
    UnknownTicket,
)
from dissoc.datasets.live import LiveDataset
from dissoc.errors import DissocError, TransportError
from dissoc.flight.common import (
    ACTION_LIST_TICKETS,
    ACTION_LIVE_APPEND_STAGED,
    ACTION_LIVE_CLOSE,
    ACTION_LIVE_STATUS,
    ACTION_REMOVE,
    flight_module,
    read_pem,
    ticket_name,
)
from dissoc.logs import peer_log
from dissoc.metrics import FLIGHT
from dissoc.tokens import Claims, Scope, Secret, TokenError, is_signed

if TYPE_CHECKING:
    import pyarrow.flight as paflight

    from dissoc.server import Server, ServerOptions

__all__ = [
    "AUTH_HEADER",
    "DEFAULT_MAX_PUT_BYTES",
    "FlightControlPlane",
    "flight_server_class",
    "serve_with_flight",
]

log = logging.getLogger(__name__)

#: Largest upload one DoPut may make by default (1 GiB of record batches, as pyarrow counts ``nbytes``).
DEFAULT_MAX_PUT_BYTES: Final = 1 << 30
#: The header a control plane with a secret reads a caller's token from: ``authorization: Bearer TOKEN``.
AUTH_HEADER: Final = "authorization"
#: The key the authentication middleware is registered under (``context.get_middleware``).
_AUTH_KEY: Final = "dissoc-auth"
#: The key the metrics middleware is registered under.
_METRICS_KEY: Final = "dissoc-metrics"

_ACTIONS: Final = (
    (ACTION_REMOVE, 'Stop serving a dataset to new requests; body: its ticket. Result: JSON {"removed"}.'),
    (ACTION_LIST_TICKETS, "The tickets served. Result: one JSON list of strings."),
    (
        ACTION_LIVE_STATUS,
        'A live stream\'s state; body: its name. Result: JSON {"head", "first", "ended", "retained_batches", '
        '"retained_bytes", "readers"}.',
    ),
    (ACTION_LIVE_CLOSE, "End a live stream (readers then get its end); body: its name. Result: its state."),
    (
        ACTION_LIVE_APPEND_STAGED,
        'Append served datasets to a live stream at most once; body: JSON {"name", "producer", "sequence", '
        '"from": [tickets]}. Result: JSON as DoPut\'s acknowledgement.',
    ),
)


def _method_name(info: Any) -> str:
    """A call's method as a metric label: ``do_get``, ``list_flights``... (from ``FlightMethod.DO_GET``)."""
    return str(getattr(info, "method", "call")).rpartition(".")[2].lower()


def _call_code(error: BaseException | None) -> str:
    """A finished call's outcome as a metric label: ``ok``, the dissoc error code it carried, else the
    error's class."""
    if error is None:
        return "ok"
    extra = getattr(error, "extra_info", None)
    if isinstance(extra, bytes) and extra:
        try:
            code = json.loads(extra).get("code")
        except (ValueError, AttributeError):
            code = None
        if isinstance(code, str):
            return code
    return type(error).__name__


def _error(code: str, message: str) -> Exception:
    """A Flight error whose ``extra_info`` carries ``{"code", "message"}`` (what :func:`resolve` reports)."""
    flight = flight_module()
    extra = json.dumps({"code": code, "message": message}).encode()
    error: Exception
    if code in ("read_only", "unauthorized"):
        error = flight.FlightUnauthorizedError(message, extra)
    elif code == "unauthenticated":
        error = flight.FlightUnauthenticatedError(message, extra)
    else:
        error = flight.FlightServerError(message, extra)
    return error


@contextlib.contextmanager
def _as_flight_errors(what: str) -> Iterator[None]:
    """Turn dissoc errors raised inside a handler into Flight errors a client sees clearly."""
    try:
        yield
    except UnknownTicket as e:
        raise _error("unknown_ticket", str(e)) from None
    except DissocError as e:
        log.warning("Flight %s failed: %s", what, e)
        raise _error("bad_request" if isinstance(e, DatasetError) else "failed", f"{what}: {e}") from None


class _Handlers:
    """What the Flight server does, in plain typed Python (the pyarrow subclass only delegates here)."""

    def __init__(
        self,
        server: Server,
        *,
        read_only: bool,
        max_put_bytes: int | None,
        closing: threading.Event,
        secret: Secret | None = None,
    ) -> None:
        self.server = server
        self.read_only = read_only
        self.max_put_bytes = max_put_bytes
        self.closing = closing
        self.secret = secret
        #: Calls refused for their token: none or not valid (``unauthenticated``), or one that does not
        #: grant the dataset or the scope the call needs (``unauthorized``).
        self.unauthenticated = 0
        self.unauthorized = 0
        self._lock = threading.Lock()

    # -- who may ask

    def authenticate(self, headers: dict[str, list[str | bytes]], method: str = "call") -> Claims:
        """The checked claims of the call's bearer token (middleware, for every call), else
        ``unauthenticated``: no ``authorization: Bearer`` header, or a token that is not valid."""
        assert self.secret is not None
        values = headers.get(AUTH_HEADER, [])
        try:
            if len(values) != 1:
                raise TokenError("the call carries no authorization: Bearer TOKEN header")
            value = values[0]
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise TokenError("the authorization header is not Bearer TOKEN")
            claims = self.secret.verify(token.strip())
            if claims.bind is not None:
                # A Flight call's client certificate is not visible here: a bound token cannot be checked.
                raise TokenError("a token bound to a client is valid on the data servers only")
        except TokenError as e:
            with self._lock:
                self.unauthenticated += 1
            # A ListActions without credentials is what health probes send (dissoc.health): refused like any
            # other call, but not worth a warning every few seconds.
            probe = method == "LIST_ACTIONS" and not values
            level = logging.DEBUG if probe else logging.WARNING
            peer_log.log(level, ("flight", "unauthenticated", probe), "Flight %s refused: %s", method, e)
            raise _error("unauthenticated", f"authentication required: {e}") from None
        return claims

    def authorize(self, claims: Claims | None, name: str, scope: Scope = "read") -> None:
        """Whether ``claims`` (None without a secret) let the caller ``scope`` dataset ``name``: a token
        grants its name, the names under it and every name for ``*``; ``write`` needs a write token, ``read``
        either. Refused: ``unauthorized``, naming neither the dataset nor the token."""
        if self.secret is None:
            return
        why = None
        if claims is None:
            why = "no token"
        elif not claims.grants(name):
            why = "the token does not grant this dataset"
        elif scope == "write" and claims.scope != "write":
            why = "this call needs a token of scope 'write'"
        if why is not None:
            with self._lock:
                self.unauthorized += 1
            peer_log.log(logging.WARNING, ("flight", "unauthorized"), "Flight call refused: %s", why)
            raise _error("unauthorized", f"not allowed: {why}")

    def _grants(self, claims: Claims | None, name: str) -> bool:
        return self.secret is None or (claims is not None and claims.grants(name))

    def _ticket(self, name: str, claims: Claims | None) -> bytes:
        """The ticket an endpoint carries: the name, or with a secret a signed ticket of scope ``read`` for
        it that expires with the caller's token."""
        if self.secret is None or claims is None:
            return name.encode("utf-8")
        return self.secret.mint(name, expires=claims.expires, scope="read").encode("ascii")

    # -- discovery

    def _descriptor_name(self, descriptor: paflight.FlightDescriptor) -> str:
        flight = flight_module()
        if descriptor.descriptor_type == flight.DescriptorType.PATH:
            parts = [ticket_name(p) for p in descriptor.path]
            if not parts:
                raise DatasetError("the descriptor's path is empty; expected [dataset name]")
            return "/".join(parts)
        return ticket_name(descriptor.command)

    def _info(
        self, name: str, descriptor: paflight.FlightDescriptor, claims: Claims | None = None
    ) -> paflight.FlightInfo:
        flight = flight_module()
        described = self.server.catalog.describe(name)
        locations = [flight.Location(self.server.uri), flight.Location(self.server.data_uri)]
        # A dataset served in parts (a directory per file) is listed as one endpoint per part, in order:
        # parts named NAME/..., which whatever grants NAME grants too.
        parts = [part.name for part in self.server.catalog.get(name).parts]
        tickets = parts if parts and all(p.startswith(f"{name}/") for p in parts) else [name]
        endpoints = [flight.FlightEndpoint(self._ticket(t, claims), locations) for t in tickets]
        rows, nbytes = described["num_rows"], described["nbytes"]
        dataset = self.server.catalog.get(name)
        # A live stream says where it is (head, first offset held...) in the info's app_metadata.
        status = json.dumps(dataset.describe()).encode() if isinstance(dataset, LiveDataset) else b""
        return flight.FlightInfo(
            described["schema"],
            descriptor,
            endpoints,
            -1 if rows is None else int(rows),
            -1 if nbytes is None else int(nbytes),
            app_metadata=status,
        )

    def list_flights(self, criteria: bytes, claims: Claims | None = None) -> Iterator[paflight.FlightInfo]:
        flight = flight_module()
        with _as_flight_errors("ListFlights"):
            prefix = ticket_name(criteria) if criteria else ""
        for name in self.server.catalog.names():
            if not name.startswith(prefix) or not self._grants(claims, name):
                continue
            try:
                yield self._info(name, flight.FlightDescriptor.for_path(name), claims)
            except UnknownTicket:  # removed meanwhile
                continue

    def get_flight_info(
        self, descriptor: paflight.FlightDescriptor, claims: Claims | None = None
    ) -> paflight.FlightInfo:
        with _as_flight_errors("GetFlightInfo"):
            name = self._descriptor_name(descriptor)
            self.authorize(claims, name)
            return self._info(name, descriptor, claims)

    def get_schema(
        self, descriptor: paflight.FlightDescriptor, claims: Claims | None = None
    ) -> paflight.SchemaResult:
        flight = flight_module()
        with _as_flight_errors("GetSchema"):
            name = self._descriptor_name(descriptor)
            self.authorize(claims, name)
            return flight.SchemaResult(self.server.catalog.get(name).schema)

    # -- data

    def do_get(self, ticket: bytes, claims: Claims | None = None) -> paflight.FlightDataStream:
        with _as_flight_errors("DoGet"):
            name: bytes | str = ticket
            if self.secret is not None:
                if is_signed(ticket):  # an endpoint's ticket: it must be one this plane signed
                    try:
                        name = self.secret.verify(ticket, scope="read").name
                    except TokenError as e:
                        with self._lock:
                            self.unauthorized += 1
                        raise _error("unauthorized", f"ticket refused: {e}") from None
                else:
                    name = ticket_name(ticket)
                self.authorize(claims, str(name))
            dataset = self.server.catalog.get(name)
            log.debug("Flight DoGet %r", dataset.name)
            return _flight_stream(dataset, self.closing)

    def _put_target(self, descriptor: paflight.FlightDescriptor) -> tuple[str, bool]:
        """(name, replace) from a path descriptor ``[name]`` or a command ``{"name", "replace"}``."""
        flight = flight_module()
        if descriptor.descriptor_type == flight.DescriptorType.PATH:
            return self._descriptor_name(descriptor), False
        try:
            command = json.loads(bytes(descriptor.command))
            name, replace = command["name"], command.get("replace", False)
        except (ValueError, TypeError, KeyError, AttributeError):
            raise DatasetError(
                f'DoPut command: expected JSON {{"name": str, "replace": bool}}, got {descriptor.command!r}'
            ) from None
        if not isinstance(name, str) or not isinstance(replace, bool):
            raise DatasetError(f"DoPut command: name must be a string and replace a boolean, got {command}")
        return name, replace

    def do_put(
        self,
        descriptor: paflight.FlightDescriptor,
        reader: paflight.MetadataRecordBatchReader,
        writer: paflight.FlightMetadataWriter,
        claims: Claims | None = None,
    ) -> None:
        with _as_flight_errors("DoPut"):
            if self.read_only:
                raise _error("read_only", "this control plane is read-only: DoPut is refused")
            name, replace = self._put_target(descriptor)
            self.authorize(claims, name, "write")
            target = self.server.catalog.get(name) if name in self.server.catalog else None
            if isinstance(target, LiveDataset) and not replace:
                self._put_live(target, descriptor, reader, writer)
                return
            if not replace and name in self.server.catalog:
                raise _error("already_exists", f"a dataset named {name!r} is already served")
            batches: list[pa.RecordBatch] = []
            total = 0
            for chunk in reader:
                batch = chunk.data
                if batch is None:
                    continue
                total += batch.nbytes
                if self.max_put_bytes is not None and total > self.max_put_bytes:
                    raise _error(
                        "too_large",
                        f"DoPut of {name!r}: more than the {self.max_put_bytes} bytes this control plane "
                        "accepts in one upload (FlightControlPlane(max_put_bytes=...), dissoc serve "
                        "--flight-max-put-mib)",
                    )
                batches.append(batch)
            table = pa.Table.from_batches(batches, schema=reader.schema)
            try:
                self.server.add(name, table, replace=replace)
            except DatasetError:
                if not replace and name in self.server.catalog:
                    raise _error("already_exists", f"a dataset named {name!r} is already served") from None
                raise
            log.info("Flight DoPut: serving %r (%d rows, %d batches)", name, table.num_rows, len(batches))
            ack = {"ticket": name, "rows": table.num_rows, "batches": len(batches), "bytes": total}
            writer.write(pa.py_buffer(json.dumps(ack).encode()))

    def _put_live(
        self,
        stream: LiveDataset,
        descriptor: paflight.FlightDescriptor,
        reader: paflight.MetadataRecordBatchReader,
        writer: paflight.FlightMetadataWriter,
    ) -> None:
        """DoPut into a live stream: each batch appended as it arrives. A command ``{"name", "producer",
        "sequence"}`` appends the upload at most once per (producer, sequence), all together once it has
        arrived (bounded by ``max_put_bytes``); ``"close": true`` ends the stream after. An upload that
        breaks mid-way fails the stream (its readers get the error, not an end)."""
        command = _put_command(descriptor)
        producer, sequence = command.get("producer"), command.get("sequence")
        once = producer is not None or sequence is not None
        if once and (not isinstance(producer, str) or not isinstance(sequence, int)):
            raise DatasetError('DoPut command: "producer" (a string) and "sequence" (an int) go together')
        appended = rows = total = 0
        held: list[pa.RecordBatch] = []
        first = stream.head
        try:
            for chunk in reader:
                batch = chunk.data
                if batch is None:
                    continue
                total += batch.nbytes
                if once:
                    if self.max_put_bytes is not None and total > self.max_put_bytes:
                        raise _error(
                            "too_large",
                            f"DoPut into live stream {stream.name!r}: more than the {self.max_put_bytes} "
                            "bytes an upload with a producer and sequence may hold (--flight-max-put-mib)",
                        )
                    held.append(batch)
                    continue
                stream.append(batch)
                appended += 1
                rows += batch.num_rows
        except DissocError:
            raise
        except Exception as e:
            if not once and appended:
                stream.fail(f"the producer's upload broke after {appended} batches: {e}")
            raise
        duplicate = False
        if once:
            assert isinstance(producer, str) and isinstance(sequence, int)
            got = stream.append_once(held, producer=producer, sequence=sequence)
            duplicate = got is None
            if got is not None:
                first, appended, rows = got[0], len(held), sum(b.num_rows for b in held)
        if command.get("close") is True:
            stream.close()
        log.info("Flight DoPut: %d batches into live stream %r (head %d)", appended, stream.name, stream.head)
        ack = {
            "ticket": stream.name,
            "rows": rows,
            "batches": appended,
            "bytes": total,
            "first": first,
            "head": stream.head,
            "duplicate": duplicate,
        }
        writer.write(pa.py_buffer(json.dumps(ack).encode()))

    def _append_staged(self, body: bytes, claims: Claims | None) -> dict[str, Any]:
        """The ``live-append-staged`` action: the batches of served datasets (in the order listed) appended
        to a live stream together, at most once per (producer, sequence)."""
        try:
            request = json.loads(body)
            name, producer, sequence = request["name"], request["producer"], request["sequence"]
            sources = request["from"]
        except (ValueError, TypeError, KeyError):
            raise DatasetError(
                'live-append-staged: expected JSON {"name", "producer", "sequence", "from": [tickets]}'
            ) from None
        if not (
            isinstance(name, str)
            and isinstance(producer, str)
            and isinstance(sequence, int)
            and isinstance(sources, list)
            and all(isinstance(t, str) for t in sources)
        ):
            raise DatasetError("live-append-staged: name, producer (strings), sequence (int), from (tickets)")
        self.authorize(claims, name, "write")
        stream = self.server.catalog.get(name)
        if not isinstance(stream, LiveDataset):
            raise _error("not_live", f"{name!r} is not a live stream")
        batches: list[pa.RecordBatch] = []
        for ticket in sources:
            self.authorize(claims, ticket)
            batches.extend(self.server.catalog.get(ticket).open())
        got = stream.append_once(batches, producer=producer, sequence=sequence)
        log.info(
            "Flight action: %d staged batches into live stream %r (%s)",
            len(batches),
            name,
            "a repeat: skipped" if got is None else f"offsets {got[0]}..{got[1]}",
        )
        return {
            "ticket": name,
            "rows": 0 if got is None else sum(b.num_rows for b in batches),
            "batches": 0 if got is None else len(batches),
            "first": stream.head if got is None else got[0],
            "head": stream.head,
            "duplicate": got is None,
        }

    # -- actions

    def do_action(self, kind: str, body: bytes, claims: Claims | None = None) -> list[bytes]:
        with _as_flight_errors(f"action {kind!r}"):
            if kind == ACTION_REMOVE:
                if self.read_only:
                    raise _error("read_only", "this control plane is read-only: the remove action is refused")
                self.authorize(claims, ticket_name(body), "write")
                removed = self.server.remove(ticket_name(body)).name
                log.info("Flight action: removed %r", removed)
                return [json.dumps({"removed": ticket_name(body)}).encode()]
            if kind == ACTION_LIVE_APPEND_STAGED:
                if self.read_only:
                    raise _error(
                        "read_only", "this control plane is read-only: live-append-staged is refused"
                    )
                return [json.dumps(self._append_staged(body, claims)).encode()]
            if kind in (ACTION_LIVE_STATUS, ACTION_LIVE_CLOSE):
                name = ticket_name(body)
                closing = kind == ACTION_LIVE_CLOSE
                if closing and self.read_only:
                    raise _error("read_only", "this control plane is read-only: live-close is refused")
                self.authorize(claims, name, "write" if closing else "read")
                stream = self.server.catalog.get(name)
                if not isinstance(stream, LiveDataset):
                    raise _error("not_live", f"{name!r} is not a live stream")
                if closing:
                    stream.close()
                    log.info("Flight action: closed live stream %r at offset %d", name, stream.head)
                return [json.dumps(stream.describe()).encode()]
            if kind == ACTION_LIST_TICKETS:
                names = [n for n in self.server.catalog.names() if self._grants(claims, n)]
                return [json.dumps(names).encode()]
            known = ", ".join(repr(k) for k, _ in _ACTIONS)
            raise _error("unknown_action", f"unknown action {kind!r} (known: {known})")


def _put_command(descriptor: paflight.FlightDescriptor) -> dict[str, Any]:
    """A DoPut's command as a JSON object ({} for a path descriptor)."""
    flight = flight_module()
    if descriptor.descriptor_type == flight.DescriptorType.PATH:
        return {}
    command = json.loads(bytes(descriptor.command))
    return command if isinstance(command, dict) else {}


def _flight_stream(dataset: Dataset, closing: threading.Event) -> paflight.FlightDataStream:
    """The Flight data stream of ``dataset``: pyarrow's C++ loops where the data allows, else a generator."""
    flight = flight_module()
    if dataset.closed:
        raise DatasetError(f"dataset {dataset.name!r} is closed")
    inner = dataset
    while isinstance(getattr(inner, "inner", None), Dataset):  # a renamed dataset: serve what it wraps
        inner = inner.inner  # type: ignore[attr-defined]
    schema = dataset.schema
    try:
        if isinstance(inner, TableDataset):
            if inner.max_chunksize is None:
                return flight.RecordBatchStream(inner.table)
            batches = inner.table.to_batches(inner.max_chunksize)
            return flight.RecordBatchStream(pa.RecordBatchReader.from_batches(schema, batches))
        if isinstance(inner, IpcFileDataset):
            # Zero-copy over the memory map: only the footer and each batch's metadata are read.
            return flight.RecordBatchStream(pa.ipc.open_file(inner.buffer).read_all())
        if isinstance(inner, IpcStreamDataset):
            return flight.RecordBatchStream(pa.ipc.open_stream(pa.memory_map(str(inner.path), "r")))
    except (OSError, pa.ArrowException) as e:
        log.debug(
            "Flight DoGet %r: pyarrow cannot read it directly (%s); decoding with dissoc", dataset.name, e
        )
    return flight.GeneratorStream(schema, _generate(dataset, closing))


def _generate(dataset: Dataset, closing: threading.Event) -> Iterator[pa.RecordBatch]:
    iterator = dataset.open()
    try:
        while not closing.is_set():
            try:
                batch = next(iterator, None)
            except UnknownTicket as e:
                raise _error("unknown_ticket", str(e)) from None
            except DissocError as e:
                raise _error("stream_failed", f"serving {dataset.name!r} failed: {e}") from None
            if batch is None:
                return
            yield batch
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


@functools.cache
def flight_server_class() -> type[paflight.FlightServerBase]:
    """The ``pyarrow.flight.FlightServerBase`` subclass the control plane runs (built on first use).

    ``cls(location, handlers)``; most code wants :class:`FlightControlPlane` instead.
    """
    flight = flight_module()
    base: Any = flight.FlightServerBase  # pyarrow has no type information: a class the checker cannot see
    middleware_base: Any = flight.ServerMiddleware
    factory_base: Any = flight.ServerMiddlewareFactory

    class Authenticated(middleware_base):  # type: ignore[misc]
        """One call's checked token claims."""

        def __init__(self, claims: Claims) -> None:
            super().__init__()
            self.claims = claims

    class Authenticator(factory_base):  # type: ignore[misc]
        """Checks every call's ``authorization: Bearer TOKEN`` header before its handler runs."""

        def __init__(self, handlers: _Handlers) -> None:
            super().__init__()
            self.handlers = handlers

        def start_call(self, info: Any, headers: dict[str, list[str | bytes]]) -> Authenticated:
            method = str(getattr(info, "method", "call")).rpartition(".")[2]
            try:
                return Authenticated(self.handlers.authenticate(headers, method))
            except Exception as e:
                # a call refused here never completes for the other middleware: counted here
                FLIGHT.calls.inc(_method_name(info), _call_code(e))
                raise

    class Counted(middleware_base):  # type: ignore[misc]
        """Counts one call in :data:`dissoc.metrics.FLIGHT` when it completes."""

        def __init__(self, method: str) -> None:
            super().__init__()
            self.method = method

        def call_completed(self, exception: BaseException | None) -> None:
            FLIGHT.calls.inc(self.method, _call_code(exception))

    class Counter(factory_base):  # type: ignore[misc]
        """Starts a :class:`Counted` for every call (the metrics of the control plane)."""

        def start_call(self, info: Any, headers: dict[str, list[str | bytes]]) -> Counted:
            return Counted(_method_name(info))

    def claims_of(context: paflight.ServerCallContext) -> Claims | None:
        found = context.get_middleware(_AUTH_KEY)
        return found.claims if isinstance(found, Authenticated) else None

    class DissocFlightServer(base):  # type: ignore[misc]
        """Flight service whose endpoints point at a dissoc server (see :mod:`dissoc.flight`). With a
        secret, every call needs a valid bearer token (a middleware checks it before the handler runs)."""

        def __init__(self, location: str, handlers: _Handlers, **kwargs: Any) -> None:
            # (a call the authenticator refuses is counted by the authenticator)
            middleware = {_METRICS_KEY: Counter(), **kwargs.get("middleware", {})}
            if handlers.secret is not None:
                middleware[_AUTH_KEY] = Authenticator(handlers)
            kwargs["middleware"] = middleware
            super().__init__(location, **kwargs)
            self.handlers = handlers

        def list_flights(
            self, context: paflight.ServerCallContext, criteria: bytes
        ) -> Iterator[paflight.FlightInfo]:
            return self.handlers.list_flights(criteria, claims_of(context))

        def get_flight_info(
            self, context: paflight.ServerCallContext, descriptor: paflight.FlightDescriptor
        ) -> paflight.FlightInfo:
            return self.handlers.get_flight_info(descriptor, claims_of(context))

        def get_schema(
            self, context: paflight.ServerCallContext, descriptor: paflight.FlightDescriptor
        ) -> paflight.SchemaResult:
            return self.handlers.get_schema(descriptor, claims_of(context))

        def do_get(
            self, context: paflight.ServerCallContext, ticket: paflight.Ticket
        ) -> paflight.FlightDataStream:
            return self.handlers.do_get(ticket.ticket, claims_of(context))

        def do_put(
            self,
            context: paflight.ServerCallContext,
            descriptor: paflight.FlightDescriptor,
            reader: paflight.MetadataRecordBatchReader,
            writer: paflight.FlightMetadataWriter,
        ) -> None:
            self.handlers.do_put(descriptor, reader, writer, claims_of(context))

        def do_action(
            self, context: paflight.ServerCallContext, action: paflight.Action
        ) -> Iterator[paflight.Result]:
            body = action.body.to_pybytes() if action.body is not None else b""
            results = self.handlers.do_action(action.type, body, claims_of(context))
            return iter([flight.Result(pa.py_buffer(r)) for r in results])

        def list_actions(self, context: paflight.ServerCallContext) -> list[paflight.ActionType]:
            return [flight.ActionType(kind, description) for kind, description in _ACTIONS]

    return DissocFlightServer


def _grpc_location(host: str, port: int, scheme: str = "grpc") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class FlightControlPlane:
    """A Flight service describing (and serving) the datasets of a running dissoc ``server``.

    Listens on ``host:port`` (port 0 picks a free one; :attr:`location` says which) once started, with
    ``await plane.start()`` or ``async with``. ``read_only=True`` refuses DoPut and the remove action;
    ``max_put_bytes`` bounds what one DoPut may upload (default 1 GiB; None: no bound).

    TLS: with ``tls_cert`` and ``tls_key`` (PEM files) the plane listens on ``grpc+tls://``; with
    ``tls_client_ca`` too, gRPC requires every client to present a certificate signed by a CA in that bundle
    (mutual TLS), as the dissoc server's ``tls_client_ca`` does.

    With the server's secret (:attr:`Server.secret <dissoc.server.Server.secret>`), every call needs an
    ``authorization: Bearer TOKEN`` header carrying a signed ticket made with it (:mod:`dissoc.tokens`): none,
    or one forged, expired or bound to a client, is refused with ``FlightUnauthenticatedError``. A token
    grants its name, the names under it (``NAME/...``) and, for ``*``, every name; ListFlights and the
    ``list-tickets`` action show only what it grants, GetFlightInfo, GetSchema and DoGet of anything else are
    refused with ``FlightUnauthorizedError``, and DoPut and ``remove`` need scope ``write``. The tickets of
    the endpoints handed out are signed tickets of scope ``read`` for their dataset that expire with the
    caller's token: what a caller may describe, it may fetch over dissoc, and nothing else.

    Closing waits up to ``shutdown_timeout`` seconds for running calls (a DoGet to a stalled client can take
    longer; it is then left to finish on its own and a warning is logged).
    """

    def __init__(
        self,
        server: Server,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        read_only: bool = False,
        max_put_bytes: int | None = DEFAULT_MAX_PUT_BYTES,
        shutdown_timeout: float = 10.0,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_client_ca: str | os.PathLike[str] | None = None,
    ) -> None:
        self.server = server
        self.host = host
        self._port = port
        self._tls = _tls_options(tls_cert, tls_key, tls_client_ca)
        self._scheme = "grpc+tls" if self._tls else "grpc"
        self.shutdown_timeout = shutdown_timeout
        self._closing = threading.Event()
        self.handlers = _Handlers(
            server,
            read_only=read_only,
            max_put_bytes=max_put_bytes,
            closing=self._closing,
            secret=server.secret,
        )
        self.flight_server: paflight.FlightServerBase | None = None

    async def start(self) -> Self:
        """Start listening (idempotent)."""
        if self.flight_server is not None:
            return self
        cls = flight_server_class()
        try:
            self.flight_server = cls(
                _grpc_location(self.host, self._port, self._scheme), self.handlers, **self._tls
            )
        except (OSError, pa.ArrowException) as e:
            raise TransportError(
                f"starting the Flight control plane on {self.host}:{self._port} failed: {e}"
            ) from None
        self._port = int(self.flight_server.port)
        self._closing.clear()
        log.info("Flight control plane at %s for %s", self.location, self.server.uri)
        return self

    @property
    def unauthenticated(self) -> int:
        """Calls refused since the start for carrying no valid token."""
        return self.handlers.unauthenticated

    @property
    def unauthorized(self) -> int:
        """Calls refused since the start for a token that does not allow them (dataset or scope)."""
        return self.handlers.unauthorized

    @property
    def port(self) -> int:
        """The port listened on (the one picked, once started with port 0)."""
        return self._port

    @property
    def location(self) -> str:
        """``grpc://HOST:PORT`` (``grpc+tls://`` with TLS), what Flight clients connect to."""
        if self.flight_server is None:
            raise DissocError("the Flight control plane is not started")
        return _grpc_location(self.host, self._port, self._scheme)

    async def serve_forever(self) -> None:
        """Serve until the dissoc server is closed (or the task is cancelled)."""
        await self.server.serve_forever()

    async def close(self) -> None:
        """Stop accepting calls and wait (up to ``shutdown_timeout``) for running ones."""
        server, self.flight_server = self.flight_server, None
        if server is None:
            return
        self._closing.set()  # generator-backed DoGet streams stop at their next batch
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def shutdown() -> None:
            try:
                server.shutdown()
            except Exception:  # nothing a caller could do about it
                log.debug("Flight server shutdown failed", exc_info=True)
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(finished)

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        # A daemon thread, not the loop's executor: a shutdown that outlives the timeout must not hold up
        # the loop's own shutdown.
        threading.Thread(target=shutdown, name="dissoc-flight-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), self.shutdown_timeout)
        except TimeoutError:
            log.warning(
                "Flight control plane %s: calls still running after %s s; not waiting for them",
                _grpc_location(self.host, self._port, self._scheme),
                self.shutdown_timeout,
            )

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _tls_options(
    cert: str | os.PathLike[str] | None,
    key: str | os.PathLike[str] | None,
    client_ca: str | os.PathLike[str] | None,
) -> dict[str, Any]:
    """``FlightServerBase``'s TLS arguments for the PEM files given (empty without ``cert``)."""
    if cert is None:
        if key is not None or client_ca is not None:
            raise DissocError(
                "tls_key and tls_client_ca (--tls-key, --tls-client-ca) need tls_cert (--tls-cert)"
            )
        return {}
    if key is None:
        raise DissocError("the Flight control plane's TLS needs tls_key (--tls-key) with tls_cert")
    flight = flight_module()
    cert_pem = read_pem(cert, "the server certificate (--tls-cert)")
    key_pem = read_pem(key, "the server private key (--tls-key)")
    options: dict[str, Any] = {"tls_certificates": [flight.CertKeyPair(cert_pem, key_pem)]}
    if client_ca is not None:
        options["verify_client"] = True
        options["root_certificates"] = read_pem(client_ca, "the CA for client certificates (--tls-client-ca)")
    return options


@contextlib.asynccontextmanager
async def serve_with_flight(
    datasets: dict[str, Any] | None = None,
    options: ServerOptions | None = None,
    *,
    flight_host: str | None = None,
    flight_port: int = 0,
    read_only: bool = False,
    max_put_bytes: int | None = DEFAULT_MAX_PUT_BYTES,
    **server_options: Any,
) -> AsyncIterator[FlightControlPlane]:
    """A :class:`dissoc.server.Server` (``Server(datasets, options, **server_options)``) and its control
    plane, started together; yields the plane (``plane.server`` is the dissoc server). The plane listens on
    the server's host unless ``flight_host`` is given, with the server's TLS certificates (``tls_cert``,
    ``tls_key``, ``tls_client_ca``) when it has them (``grpc+tls://``), and with the server's ``secret`` when
    it has one."""
    from dissoc.server import Server

    server = Server(datasets, options, **server_options)
    served = server.options
    async with (
        server,
        FlightControlPlane(
            server,
            flight_host if flight_host is not None else served.host,
            flight_port,
            read_only=read_only,
            max_put_bytes=max_put_bytes,
            tls_cert=served.tls_cert,
            tls_key=served.tls_key,
            tls_client_ca=served.tls_client_ca,
        ) as plane,
    ):
        yield plane
