"""The server room: the :class:`Server` users start and what the spec's two servers share.

``Server`` (:mod:`~dissoc.server.server`) is built from a :class:`ServerOptions`
(:mod:`~dissoc.server.options`) and runs the metadata and data servers (:mod:`~dissoc.server.metadata`,
:mod:`~dissoc.server.data`; public as :mod:`dissoc.metadata_server` and :mod:`dissoc.data_server`) on two
ports with ``split=True``, or one :class:`CombinedServer`. All are :class:`~dissoc.server.role.RoleServer`
listeners: they walk a dataset's messages (:mod:`~dissoc.server.stream`) through the parts of the stream
they send, and drop connections past their deadlines (:mod:`~dissoc.server.deadlines`).
"""

from __future__ import annotations

from dissoc.server.combined import CombinedServer
from dissoc.server.options import DEFAULT_FREE_DATA, DEFAULT_WANT_DATA, ROLES, ServerOptions
from dissoc.server.server import Server

__all__ = ["DEFAULT_FREE_DATA", "DEFAULT_WANT_DATA", "ROLES", "CombinedServer", "Server", "ServerOptions"]
