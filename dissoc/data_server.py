"""The data server: answers want_data with the data stream, one tagged body per message that has one.

Tags carry the sequence number in bits 0-31 and the body type in bits 56-63. If the ticket is unknown or the
dataset fails, it sends the project's error message (prefix 0xE0, JSON) as a tagged message whose tag is
``0xE0 << 56``, so that a client waiting for bodies fails at once instead of timing out. (Tagged, because an
untagged reader left waiting on a data connection would keep the transport reading past its budget.)
"""

from __future__ import annotations

from dissoc.serving import Role, RoleServer

__all__ = ["DataServer"]


class DataServer(RoleServer):
    """Serves only the data stream (the split layout's second server)."""

    role = Role.DATA
