"""The defaults a :class:`~dissoc.server.Server` starts from, the command line's too (one definition each)."""

from __future__ import annotations

__all__ = [
    "DEFAULT_FREE_DATA",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS_PER_PEER",
    "DEFAULT_MAX_FREE_DATA_BYTES",
    "DEFAULT_MAX_RECEIVING_BYTES",
    "DEFAULT_MAX_TICKET_BYTES",
    "DEFAULT_WANT_DATA",
    "DEFAULT_WANT_DATA_TIMEOUT",
    "ROLES",
]

#: The want_data and free_data tag values a server advertises unless told otherwise ("WANT", "FREE").
DEFAULT_WANT_DATA = 0x57414E54
DEFAULT_FREE_DATA = 0x46524545
#: Largest want_data payload (ticket) a server reads (64 KiB).
DEFAULT_MAX_TICKET_BYTES = 64 << 10
#: Largest free_data payload a server reads (8 MiB: 1 Mi ranges of 8 bytes).
DEFAULT_MAX_FREE_DATA_BYTES = 8 << 20
#: Seconds a client has to send a complete want_data after connecting (and to finish any request it began).
DEFAULT_WANT_DATA_TIMEOUT = 10.0
#: Seconds a connection may sit with no request, no stream and no listed ranges held.
DEFAULT_IDLE_TIMEOUT = 300.0
#: Connections one peer address may have open at once, per listening port.
DEFAULT_MAX_CONNECTIONS_PER_PEER = 64
#: Bytes being received (or received and not yet taken) across all of a server's connections.
DEFAULT_MAX_RECEIVING_BYTES = 1 << 30
#: What a Server runs: ``all`` (both halves, or the combined server), one half of a split server in its own
#: process (``metadata``, ``data``: the two encode the same datasets alike, so their sequence numbers
#: match), or ``none`` (only the catalog, for a Flight control plane in front of servers running elsewhere).
ROLES = ("all", "metadata", "data", "none")
