"""What :class:`~dissoc.protocol.client.ClientStream` reports: one event per message released, in sequence
order, then the end of the stream. Plain slotted dataclasses, and a named tuple for the one made per batch
(:class:`MessageReady`, which the stream makes with ``tuple.__new__``, without a Python-level call)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from dissoc.protocol.arena import ArenaAnnouncement

__all__ = ["ClientEvent", "ClientState", "MessageReady", "SchemaReceived", "StreamEnded"]


class ClientState(enum.Enum):
    """Life cycle of a :class:`~dissoc.protocol.client.ClientStream`."""

    AWAITING_SCHEMA = "awaiting schema"
    """Nothing released yet: the schema has not arrived (other messages may be held waiting for it)."""
    STREAMING = "streaming"
    """The schema has been released; no end of stream yet."""
    ENDED = "ended"
    """End of stream received; metadata (even the schema's) and bodies before its count may still be
    outstanding."""
    FINISHED = "finished"
    """End of stream received and every message before it released."""
    FAILED = "failed"
    """An error ended the stream; every further input raises."""


@dataclass(slots=True)
class SchemaReceived:
    """The first message (the Schema) was released."""

    seq: int
    metadata: memoryview | bytes


class MessageReady(NamedTuple):
    """A message after the schema was released, in sequence order.

    ``body`` is ``None`` without a body, a :class:`~dissoc.protocol.pairs.PairList` for body type 1, and for
    body type 0 the payload as it was received, or what the stream's ``keep`` made of a payload that was only
    lent to it (see :class:`~dissoc.protocol.client.ClientStream`). ``nbytes`` is the size of the tagged
    message the body came in (0 without one): what the stream counts in flight until the driver reports it
    consumed.
    """

    seq: int
    metadata: memoryview | bytes
    body_type: int | None
    body: object | None
    nbytes: int = 0


@dataclass(slots=True)
class StreamEnded:
    """End of stream received and every message released; ``count`` messages in all (schema included)."""

    count: int


ClientEvent = SchemaReceived | MessageReady | StreamEnded | ArenaAnnouncement
"""What :class:`~dissoc.protocol.client.ClientStream` reports. An :class:`ArenaAnnouncement` (a private arena,
named on the data stream) comes where it arrived, before the pair lists that point into it are released."""
