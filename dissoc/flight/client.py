"""The control-plane calls a Flight client makes to a dissoc control plane: describe and resolve a dataset
(its endpoints: metadata URI, data URI, ticket), list datasets, publish one with DoPut, remove one.

Fetching the data itself is the dissoc client's job: :func:`dissoc.fetch` and the other entry points of
:mod:`dissoc.client` accept a ``grpc://`` location and fetch every endpoint it lists over Dissociated IPC.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypedDict, TypeVar, Unpack

import pyarrow as pa

from dissoc.datasets import (
    DatasetError,
)
from dissoc.errors import DissocError, ProtocolError, RemoteError, TransportError
from dissoc.flight.common import (
    ACTION_LIVE_APPEND_STAGED,
    ACTION_LIVE_CLOSE,
    ACTION_LIVE_STATUS,
    ACTION_REMOVE,
    DEFAULT_TIMEOUT,
    Endpoint,
    check_location,
    flight_module,
    read_pem,
    ticket_name,
)
from dissoc.tokens import is_signed, peek
from dissoc.uri import DissocURI, UriError

if TYPE_CHECKING:
    import pyarrow.flight as paflight

__all__ = [
    "CallOptions",
    "DatasetInfo",
    "describe",
    "list_actions",
    "list_datasets",
    "publish",
    "remove",
    "resolve",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    """A dataset as a control plane describes it; ``num_rows``/``nbytes`` are None when not known."""

    name: str
    schema: pa.Schema
    num_rows: int | None
    nbytes: int | None
    endpoints: list[Endpoint] = field(default_factory=list)


_TRANSPORT_FAILURES: Final = ("FlightUnavailableError", "FlightTimedOutError", "FlightCancelledError")
_CODES: Final = {
    "FlightServerError": "server_error",
    "FlightInternalError": "internal",
    "FlightUnauthenticatedError": "unauthenticated",
    "FlightUnauthorizedError": "unauthorized",
    "FlightWriteSizeExceededError": "too_large",
    "ArrowKeyError": "not_found",
    "ArrowInvalid": "invalid_argument",
    "ArrowNotImplementedError": "unimplemented",
}


def _translate(e: Exception, what: str, location: str) -> DissocError:
    """A pyarrow/Flight exception as the dissoc error it means."""
    text = str(e).split(". Detail: ", 1)[0].strip() or type(e).__name__
    kind = type(e).__name__
    if kind in _TRANSPORT_FAILURES or isinstance(e, OSError):
        return TransportError(f"{what} at {location}: {text}")
    code = _CODES.get(kind, "flight_error")
    extra = getattr(e, "extra_info", None)
    if extra:
        with contextlib.suppress(ValueError, TypeError, UnicodeDecodeError):
            info = json.loads(bytes(extra))
            if isinstance(info, dict) and isinstance(info.get("code"), str):
                code = info["code"]
                text = str(info.get("message") or text)
    return RemoteError(code, f"{what} at {location}: {text}")


#: A PEM file's path, for the ``tls_*`` arguments.
PemPath = str | os.PathLike[str] | None


def _tls_arguments(tls_ca: PemPath, tls_cert: PemPath, tls_key: PemPath) -> dict[str, bytes]:
    """``FlightClient``'s TLS arguments (they apply to ``grpc+tls://`` locations; None: gRPC's defaults, the
    system's roots and no client certificate)."""
    if (tls_cert is None) != (tls_key is None):
        raise DissocError("a client certificate needs its key: give tls_cert and tls_key together")
    arguments: dict[str, bytes] = {}
    for name, path, what in (
        ("tls_root_certs", tls_ca, "the CA bundle (--tls-ca)"),
        ("cert_chain", tls_cert, "the client certificate (--tls-cert)"),
        ("private_key", tls_key, "the client private key (--tls-key)"),
    ):
        pem = read_pem(path, what)
        if pem is not None:
            arguments[name] = pem
    return arguments


class CallOptions(TypedDict, total=False):
    """What every call of this module takes besides its own arguments, each optional:

    - ``timeout``: the seconds the call may take (:data:`~dissoc.flight.common.DEFAULT_TIMEOUT`; None: no
      bound, :func:`publish`'s default);
    - ``tls_ca``, ``tls_cert``, ``tls_key``: for a ``grpc+tls://`` location, the CA bundle the control
      plane's certificate must be signed by (None: the system's roots) and this client's certificate and
      key, for a plane that requires one (PEM files);
    - ``token``: a signed ticket sent as ``authorization: Bearer TOKEN`` to a control plane with a secret.
    """

    timeout: float | None
    tls_ca: PemPath
    tls_cert: PemPath
    tls_key: PemPath
    token: str | None


def _call(
    location: str,
    what: str,
    call: Callable[[Any, Any], T],
    options: CallOptions,
    *,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> T:
    """``call(client, call_options)`` with a FlightClient to ``location`` (closed after) and the call options
    of ``options`` (its timeout, else ``timeout``; ``authorization: Bearer TOKEN`` when there is a token):
    every pyarrow error in it becomes the dissoc error it means, naming ``what`` and ``location``."""
    flight = flight_module()
    check_location(location)
    tls = _tls_arguments(options.get("tls_ca"), options.get("tls_cert"), options.get("tls_key"))
    token = options.get("token")
    headers = [] if token is None else [(b"authorization", b"Bearer " + token.encode("ascii"))]
    call_options = flight.FlightCallOptions(timeout=options.get("timeout", timeout), headers=headers)
    try:
        client = flight.FlightClient(location, **tls)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise UriError(f"Flight location {location!r}: {e}") from None
    try:
        return call(client, call_options)
    except (pa.ArrowException, OSError) as e:
        raise _translate(e, what, location) from None
    finally:
        with contextlib.suppress(Exception):
            client.close()


def _credentials(ticket: str | bytes, token: str | None) -> tuple[str | bytes, str | None]:
    """(the dataset name to ask for, the bearer token): a signed ticket given as the ticket, with no token,
    is the token for the name it carries."""
    if token is None and is_signed(ticket):
        claims = peek(ticket)
        if claims is not None:
            text = ticket if isinstance(ticket, str) else bytes(ticket).decode("ascii")
            return claims.name, text
    if token is not None and not token.isascii():
        raise DissocError("a token is ASCII (a signed ticket from dissoc token)")
    return ticket, token


def _location_text(loc: paflight.Location | str | bytes, where: str) -> str:
    raw = getattr(loc, "uri", loc)
    try:
        return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError:
        raise ProtocolError(f"{where}: a location is not valid UTF-8: {raw[:80]!r}") from None


def _parse_info(info: paflight.FlightInfo, where: str) -> DatasetInfo:
    """Check a FlightInfo from a control plane and turn it into a DatasetInfo (ProtocolError if malformed)."""
    try:
        schema = info.schema
        descriptor = info.descriptor
        raw_endpoints = list(info.endpoints)
        rows, nbytes = int(info.total_records), int(info.total_bytes)
    except (pa.ArrowException, OSError, ValueError, TypeError) as e:
        raise ProtocolError(f"{where}: unreadable FlightInfo: {e}") from None
    endpoints: list[Endpoint] = []
    for i, ep in enumerate(raw_endpoints):
        locations = [_location_text(loc, where) for loc in ep.locations]
        if len(locations) < 2:
            raise ProtocolError(
                f"{where}: endpoint {i} has {len(locations)} location(s) {locations}; expected two dissoc "
                "URIs, the metadata URI then the data URI"
            )
        uri, data_uri = locations[0], locations[1]
        for role, text in (("metadata", uri), ("data", data_uri)):
            try:
                DissocURI.parse(text)
            except UriError as e:
                raise ProtocolError(
                    f"{where}: endpoint {i}'s {role} location {text!r} is not a dissoc URI "
                    f"(SCHEME://HOST:PORT?want_data=N): {e}"
                ) from None
        endpoints.append((uri, data_uri, bytes(ep.ticket.ticket)))
    name = ""
    with contextlib.suppress(Exception):
        if descriptor.descriptor_type == flight_module().DescriptorType.PATH:
            name = "/".join(ticket_name(p) for p in descriptor.path)
        else:
            name = ticket_name(descriptor.command)
    return DatasetInfo(
        name=name,
        schema=schema,
        num_rows=None if rows < 0 else rows,
        nbytes=None if nbytes < 0 else nbytes,
        endpoints=endpoints,
    )


def describe(location: str, ticket: str | bytes, **options: Unpack[CallOptions]) -> DatasetInfo:
    """GetFlightInfo for the dataset ``ticket`` (descriptor ``for_path(name)``), checked; ``options``: see
    :class:`CallOptions` (a signed ticket given as ``ticket``, with no ``token``, serves as the token for the
    name it carries)."""
    flight = flight_module()
    ticket, token = _credentials(ticket, options.get("token"))
    options["token"] = token
    what = f"GetFlightInfo({ticket!r})"
    descriptor = flight.FlightDescriptor.for_path(ticket)
    info = _call(location, what, lambda client, call: client.get_flight_info(descriptor, call), options)
    return _parse_info(info, f"{what} at {location}")


def resolve(location: str, ticket: str | bytes, **options: Unpack[CallOptions]) -> list[Endpoint]:
    """The endpoints of dataset ``ticket`` at the Flight control plane ``location``:
    ``[(metadata URI, data URI, ticket), ...]``, from GetFlightInfo (:func:`describe`, the same options).

    Raises TransportError (unreachable, or no answer within ``timeout`` seconds), RemoteError (the control
    plane refused, e.g. code ``unknown_ticket``), ProtocolError (an endpoint without two dissoc URIs), or
    UriError (``location`` is not ``grpc://HOST:PORT``). With a ``token``, the endpoints' tickets are signed
    tickets the control plane made for this dataset.
    """
    return describe(location, ticket, **options).endpoints


def list_datasets(location: str, **options: Unpack[CallOptions]) -> list[DatasetInfo]:
    """Every dataset the control plane at ``location`` lists (ListFlights), with its endpoints (with a
    ``token``, those it grants)."""
    what = "ListFlights"
    infos = _call(location, what, lambda client, call: list(client.list_flights(b"", call)), options)
    return [_parse_info(info, f"{what} at {location}") for info in infos]


def list_actions(location: str, **options: Unpack[CallOptions]) -> list[str]:
    """The action types the control plane at ``location`` offers (ListActions): the cheapest call that
    shows it serves (``dissoc health``)."""
    return _call(
        location,
        "ListActions",
        lambda client, call: [str(a.type) for a in client.list_actions(call)],
        options,
    )


def publish(
    location: str,
    name: str,
    data: pa.Table | pa.RecordBatch | pa.RecordBatchReader,
    *,
    replace: bool = False,
    **options: Unpack[CallOptions],
) -> int:
    """Upload ``data`` with DoPut; the control plane's dissoc server then serves it as ``name``.

    A name already served is refused (RemoteError ``already_exists``) unless ``replace``. ``timeout`` bounds
    the whole upload (default None: no bound). Returns the number of rows the server stored (-1 when the
    service acknowledged in some other way than a dissoc control plane does).
    """
    flight = flight_module()
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if not isinstance(data, (pa.Table, pa.RecordBatchReader)):
        raise DatasetError(
            f"publish: expected a pyarrow.Table, RecordBatch or RecordBatchReader, got {type(data).__name__}"
        )
    if replace:
        descriptor = flight.FlightDescriptor.for_command(json.dumps({"name": name, "replace": True}))
    else:
        descriptor = flight.FlightDescriptor.for_path(name)
    ack = _call(location, f"DoPut({name!r})", _uploader(descriptor, data.schema, data), options, timeout=None)
    try:
        return int(json.loads(ack.to_pybytes())["rows"]) if ack is not None else -1
    except (ValueError, KeyError, TypeError):
        return -1


def append(
    location: str,
    name: str,
    data: pa.Table | pa.RecordBatch | pa.RecordBatchReader | Iterable[pa.RecordBatch],
    *,
    schema: pa.Schema | None = None,
    producer: str | None = None,
    sequence: int | None = None,
    close: bool = False,
    **options: Unpack[CallOptions],
) -> dict[str, Any]:
    """Append ``data`` to the live stream ``name`` with DoPut (each batch as it is sent); ``close`` ends the
    stream after it. With ``producer`` and ``sequence`` the upload is appended at most once per pair, all
    together once it has arrived (a retry of a sequence already appended is skipped: ``"duplicate"``).
    Returns the server's acknowledgement: ``{"rows", "batches", "first", "head", "duplicate"...}``. A plain
    iterable of batches needs ``schema``."""
    flight = flight_module()
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    source_schema = schema if schema is not None else getattr(data, "schema", None)
    if not isinstance(source_schema, pa.Schema):
        raise DatasetError("append: a plain iterable of batches needs schema=")
    command: dict[str, Any] = {"name": name}
    if producer is not None or sequence is not None:
        command.update(producer=producer, sequence=sequence)
    if close:
        command["close"] = True
    descriptor = flight.FlightDescriptor.for_command(json.dumps(command))
    upload = _uploader(descriptor, source_schema, data)
    ack = _call(location, f"DoPut({name!r}, live)", upload, options, timeout=None)
    try:
        got = json.loads(ack.to_pybytes()) if ack is not None else {}
    except ValueError:
        got = {}
    return got if isinstance(got, dict) else {}


def append_staged(
    location: str,
    name: str,
    tickets: list[str],
    *,
    producer: str,
    sequence: int,
    **options: Unpack[CallOptions],
) -> dict[str, Any]:
    """Append datasets the plane already serves (``tickets``, in order) to the live stream ``name``, at most
    once per (``producer``, ``sequence``), without their data crossing this client (the
    ``live-append-staged`` action). Returns the acknowledgement, as :func:`append` does."""
    flight = flight_module()
    body = json.dumps({"name": name, "producer": producer, "sequence": sequence, "from": tickets})
    action = flight.Action(ACTION_LIVE_APPEND_STAGED, body.encode("utf-8"))

    def act(client: Any, call: Any) -> list[Any]:
        return list(client.do_action(action, call))

    results = _call(location, f"action {ACTION_LIVE_APPEND_STAGED}({name!r})", act, options)
    got = json.loads(results[0].body.to_pybytes()) if results else {}
    return got if isinstance(got, dict) else {}


def live_status(location: str, name: str, **options: Unpack[CallOptions]) -> dict[str, Any]:
    """A live stream's state: ``{"head", "first", "ended", "retained_batches", "retained_bytes",
    "readers"}`` (the ``live-status`` action); RemoteError ``not_live`` for a dataset that is not one."""
    return _live_action(location, ACTION_LIVE_STATUS, name, options)


def live_close(location: str, name: str, **options: Unpack[CallOptions]) -> dict[str, Any]:
    """End the live stream ``name`` (the ``live-close`` action): its readers get the end once they have
    read what it holds. Returns its state after."""
    return _live_action(location, ACTION_LIVE_CLOSE, name, options)


def _live_action(location: str, kind: str, name: str, options: CallOptions) -> dict[str, Any]:
    flight = flight_module()
    action = flight.Action(kind, name.encode("utf-8"))
    results = _call(
        location,
        f"action {kind}({name!r})",
        lambda client, call: list(client.do_action(action, call)),
        options,
    )
    got = json.loads(results[0].body.to_pybytes()) if results else {}
    return got if isinstance(got, dict) else {}


def _uploader(
    descriptor: Any, schema: pa.Schema, source: pa.Table | pa.RecordBatchReader | Iterable[pa.RecordBatch]
) -> Callable[[Any, Any], Any]:
    """A DoPut of ``source`` (batch by batch), returning the server's acknowledgement."""

    def upload(client: Any, call: Any) -> Any:
        writer, ack_reader = client.do_put(descriptor, schema, call)
        with writer:  # close() reports the server's verdict
            if isinstance(source, pa.Table):
                writer.write_table(source)
            else:
                for batch in source:
                    writer.write_batch(batch)
            writer.done_writing()
            return ack_reader.read()

    return upload


def remove(location: str, name: str | bytes, **options: Unpack[CallOptions]) -> None:
    """Stop serving dataset ``name`` (the ``remove`` action); RemoteError ``unknown_ticket`` if not served."""
    flight = flight_module()
    action = flight.Action(ACTION_REMOVE, name.encode("utf-8") if isinstance(name, str) else bytes(name))
    _call(
        location,
        f"action remove({name!r})",
        lambda client, call: list(client.do_action(action, call)),
        options,
    )
