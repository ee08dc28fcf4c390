"""What the Flight control plane's server and client share: the location schemes, action names, the endpoint
shape, and ``pyarrow.flight`` imported on first use (a missing one is a :class:`~dissoc.errors.DissocError`
that says what to install)."""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Final

from dissoc.datasets import (
    DatasetError,
)
from dissoc.errors import DissocError
from dissoc.uri import UriError

__all__ = [
    "ACTION_LIST_TICKETS",
    "ACTION_LIVE_APPEND_STAGED",
    "ACTION_LIVE_CLOSE",
    "ACTION_LIVE_STATUS",
    "ACTION_REMOVE",
    "DEFAULT_TIMEOUT",
    "FLIGHT_SCHEMES",
    "Endpoint",
    "check_location",
    "flight_module",
    "is_flight_location",
    "read_pem",
    "ticket_name",
]

log = logging.getLogger(__name__)

#: Location schemes that name a Flight service (``grpc`` is what dissoc prints).
FLIGHT_SCHEMES: Final = frozenset({"grpc", "grpc+tcp", "grpc+tls", "grpc+unix"})
#: Seconds a control-plane call (resolve, list, remove) may take before it fails.
DEFAULT_TIMEOUT: Final = 10.0
#: DoAction type that stops serving a dataset; the body is its ticket.
ACTION_REMOVE: Final = "remove"
#: DoAction type whose one result is the JSON list of the tickets served.
ACTION_LIST_TICKETS: Final = "list-tickets"
#: DoAction types of live streams (body: the stream's name): its state as JSON (``head``, ``first``,
#: ``ended``, retention, readers), and ending it.
ACTION_LIVE_STATUS: Final = "live-status"
ACTION_LIVE_CLOSE: Final = "live-close"
#: DoAction type appending datasets the plane serves to a live stream, at most once per (producer,
#: sequence); body JSON ``{"name", "producer", "sequence", "from": [tickets]}`` (an exactly-once commit that
#: sends names, not data: the Spark streaming sink's).
ACTION_LIVE_APPEND_STAGED: Final = "live-append-staged"

_ACTIONS: Final = (
    (ACTION_REMOVE, 'Stop serving a dataset to new requests; body: its ticket. Result: JSON {"removed"}.'),
    (ACTION_LIST_TICKETS, "The tickets served. Result: one JSON list of strings."),
)

#: An endpoint as :func:`resolve` returns it: (metadata URI, data URI, ticket).
Endpoint = tuple[str, str, bytes]


def flight_module() -> ModuleType:
    """``pyarrow.flight``, or a DissocError naming what to install."""
    try:
        import pyarrow.flight as flight
    except ImportError as e:
        raise DissocError(
            f"the Flight control plane needs pyarrow built with Arrow Flight (pyarrow.flight): {e}; "
            "install a pyarrow wheel from PyPI (it includes Flight) or conda's 'pyarrow' with libarrow-flight"
        ) from None
    module: ModuleType = flight  # pyarrow has no type information: to the checker the import is Any
    return module


def is_flight_location(uri: object) -> bool:
    """Whether ``uri`` is a string naming a Flight service (``grpc://``, ``grpc+tcp://``, ...)."""
    if not isinstance(uri, str) or "://" not in uri:
        return False
    return uri.split("://", 1)[0].lower() in FLIGHT_SCHEMES


def check_location(location: object) -> str:
    if not is_flight_location(location):
        raise UriError(
            f"Flight location: expected grpc://HOST:PORT (schemes {', '.join(sorted(FLIGHT_SCHEMES))}), "
            f"got {location!r}"
        )
    assert isinstance(location, str)
    return location


def read_pem(path: str | os.PathLike[str] | None, what: str) -> bytes | None:
    """The bytes of the PEM file at ``path`` (None for None): gRPC takes certificates as bytes, not paths.
    A file that cannot be read is a :class:`~dissoc.errors.DissocError` naming ``what`` it was for."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DissocError(f"cannot read {what} {os.fspath(path)!r}: {e}") from None
    if b"-----BEGIN" not in data:
        raise DissocError(f"{what} {os.fspath(path)!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def ticket_name(ticket: str | bytes) -> str:
    if isinstance(ticket, str):
        return ticket
    try:
        return bytes(ticket).decode("utf-8")
    except UnicodeDecodeError:
        raise DatasetError(f"ticket {bytes(ticket)[:64]!r} is not valid UTF-8") from None
