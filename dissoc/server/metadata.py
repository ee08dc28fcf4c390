"""The metadata server: answers want_data with a ticket's metadata stream.

Every message of the stream goes out as a metadata-stream message (the 5-byte prefix, then the Message
flatbuffer), numbered from 0 (the Schema), then an end-of-stream message carrying the count. Bodies are not
sent here: a data server (:mod:`dissoc.server.data`) sends them under the same sequence numbers, or a
combined server sends both parts over one connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dissoc.datasets import Dataset
from dissoc.protocol import ServerMessage, ServerStream
from dissoc.server.role import Role, RoleServer
from dissoc.server.stream import Outbox, StreamPart
from dissoc.transport import Connection

__all__ = ["MetadataPart", "MetadataServer"]

#: Metadata up to this size is sent joined to its prefix (a copy cheaper than one more buffer to send).
_JOIN_BYTES = 4096


class MetadataPart(StreamPart):
    """The metadata stream: every message's prefix and flatbuffer, then end of stream."""

    def schema(self, out: Outbox, header: bytes, metadata: Any) -> None:
        out.add(None, [header, metadata], len(metadata) + len(header))

    def message(self, out: Outbox, sent: ServerMessage, metadata: Any, body: list[Any]) -> None:
        header = sent.header
        kind = type(metadata)
        if (kind is bytes or kind is memoryview) and len(metadata) <= _JOIN_BYTES:
            # one small buffer (copied) rather than two: fewer pieces for the transport to gather
            framed = header + metadata
            out.add(None, framed, len(framed))
        else:
            out.add(None, [header, metadata], len(metadata) + len(header))

    def end(self, out: Outbox, stream: ServerStream) -> None:
        eos = stream.end()
        out.add(None, eos, len(eos))


class MetadataServer(RoleServer):
    """Sends the metadata stream only; bodies come from a :class:`~dissoc.server.data.DataServer`."""

    role = Role.METADATA

    def parts(self, conn: Connection, dataset: Dataset, current: Callable[[], bool]) -> list[StreamPart]:
        return [MetadataPart()]
