"""The combined server: both parts of every stream (metadata and bodies) over one connection."""

from __future__ import annotations

from collections.abc import Callable

from dissoc.datasets import Dataset
from dissoc.server.data import DataPart, DataServer
from dissoc.server.metadata import MetadataPart
from dissoc.server.role import Role
from dissoc.server.stream import StreamPart
from dissoc.transport import Connection

__all__ = ["CombinedServer"]


class CombinedServer(DataServer):
    """Sends each stream's metadata and bodies over one connection (one URI is both metadata and data URI);
    with pair bodies it applies free_data as a data server does."""

    role = Role.COMBINED

    def parts(self, conn: Connection, dataset: Dataset, current: Callable[[], bool]) -> list[StreamPart]:
        return [
            MetadataPart(),
            DataPart(
                conn, dataset, self.options, current, self.private_memory(conn), transport=self.transport
            ),
        ]
