"""The spec's data server: answers want_data with a ticket's bodies (packed, or as pair lists into an arena)
and applies the client's free_data, while a metadata server sends the metadata stream under the same
sequence numbers.

This is its public name; it lives in the server room (:mod:`dissoc.server.data`), beside what it shares
with the metadata server.
"""

from __future__ import annotations

from dissoc.server.data import DataPart, DataServer, PrivateMemory

__all__ = ["DataPart", "DataServer", "PrivateMemory"]
