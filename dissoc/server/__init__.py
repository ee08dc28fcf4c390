"""The :class:`Server` users start: it runs the spec's two servers (:mod:`dissoc.metadata_server` and
:mod:`dissoc.data_server`, on two ports with ``split=True``) or one :class:`CombinedServer`, over a catalog
of datasets and, for pair bodies, an arena with its placements and ledger."""

from __future__ import annotations

from dissoc.server.combined import CombinedServer
from dissoc.server.server import DEFAULT_FREE_DATA, DEFAULT_WANT_DATA, Server

__all__ = ["DEFAULT_FREE_DATA", "DEFAULT_WANT_DATA", "CombinedServer", "Server"]
