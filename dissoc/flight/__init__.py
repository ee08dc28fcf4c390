"""An Arrow Flight control plane in front of a dissoc server ("Flight RPC purely for control flow").

- :mod:`~dissoc.flight.server`: :class:`FlightControlPlane` and :func:`serve_with_flight` (ListFlights,
  GetFlightInfo with dissoc URIs as endpoint locations, DoGet for Flight-only clients, DoPut, actions);
- :mod:`~dissoc.flight.client`: the control-plane calls (:func:`describe`, :func:`resolve`,
  :func:`list_datasets`, :func:`publish`, :func:`remove`; live streams: :func:`append`, :func:`live_status`,
  :func:`live_close`);
- :mod:`~dissoc.flight.common`: what both share (schemes, action names, :func:`is_flight_location`).

Fetching through a control plane is :func:`dissoc.fetch` (and every entry point of :mod:`dissoc.client`)
with a ``grpc://`` location.
"""

from __future__ import annotations

from dissoc.flight.client import (
    DatasetInfo,
    append,
    append_staged,
    describe,
    list_datasets,
    live_close,
    live_status,
    publish,
    remove,
    resolve,
)
from dissoc.flight.common import (
    ACTION_LIST_TICKETS,
    ACTION_LIVE_APPEND_STAGED,
    ACTION_LIVE_CLOSE,
    ACTION_LIVE_STATUS,
    ACTION_REMOVE,
    DEFAULT_TIMEOUT,
    FLIGHT_SCHEMES,
    Endpoint,
    is_flight_location,
)
from dissoc.flight.server import FlightControlPlane, flight_server_class, serve_with_flight

__all__ = [
    "ACTION_LIST_TICKETS",
    "ACTION_LIVE_APPEND_STAGED",
    "ACTION_LIVE_CLOSE",
    "ACTION_LIVE_STATUS",
    "ACTION_REMOVE",
    "DEFAULT_TIMEOUT",
    "FLIGHT_SCHEMES",
    "DatasetInfo",
    "append",
    "append_staged",
    "Endpoint",
    "FlightControlPlane",
    "describe",
    "flight_server_class",
    "is_flight_location",
    "list_datasets",
    "live_close",
    "live_status",
    "publish",
    "remove",
    "resolve",
    "serve_with_flight",
]
