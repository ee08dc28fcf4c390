"""The spec's metadata server: answers want_data with a ticket's metadata stream (the prefixes and
flatbuffers of its messages, then end of stream), while a data server sends the bodies under the same
sequence numbers.

This is its public name; it lives in the server room (:mod:`dissoc.server.metadata`), beside what it shares
with the data server.
"""

from __future__ import annotations

from dissoc.server.metadata import MetadataPart, MetadataServer

__all__ = ["MetadataPart", "MetadataServer"]
