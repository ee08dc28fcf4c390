"""A received tagged message (:class:`TaggedMessage`): its u64 tag and its payload.

In a module of its own so that :mod:`dissoc.transport._inbox`, which holds such messages, and
:mod:`dissoc.transport.base`, which hands them out (and re-exports the class), both import it from below.
"""

from __future__ import annotations

from typing import NamedTuple

from dissoc.buffers import BytesLike, buffer_nbytes, byte_view

__all__ = ["TaggedMessage"]


class TaggedMessage(NamedTuple):
    """A received tagged message: its full u64 tag and its payload (the buffer the allocator returned)."""

    tag: int
    payload: BytesLike

    def view(self) -> memoryview:
        """A flat byte view of the payload (no copy); TypeError for a payload in device memory."""
        return byte_view(self.payload)

    @property
    def nbytes(self) -> int:
        """The payload's length in bytes (host or device memory)."""
        return buffer_nbytes(self.payload)
