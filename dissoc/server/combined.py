"""The combined server: both parts of every stream (metadata and bodies) over one connection."""

from __future__ import annotations

from collections.abc import Callable

from dissoc.data_server import DataPart, DataServer
from dissoc.datasets import Dataset
from dissoc.metadata_server import MetadataPart
from dissoc.role_server import Role, StreamPart
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
