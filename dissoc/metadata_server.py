"""The metadata server: answers want_data with the metadata stream (5-byte prefix + Message flatbuffer).

As a *combined* server it also sends the data stream on the same connection, interleaved message by message,
as in the spec's second diagram.
"""

from __future__ import annotations

from dissoc.serving import Role, RoleServer

__all__ = ["CombinedServer", "MetadataServer"]


class MetadataServer(RoleServer):
    """Serves only the metadata stream (the split layout's first server)."""

    role = Role.METADATA


class CombinedServer(RoleServer):
    """Serves both streams over each connection."""

    role = Role.COMBINED
