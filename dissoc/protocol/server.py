"""What a server sends for one stream: sequence numbers and framing (:class:`ServerStream`).

Sans-IO: it returns the bytes and tags to send and touches no socket or event loop. The client's side is
:mod:`dissoc.protocol.client`.
"""

from __future__ import annotations

import enum
import logging
import struct
from typing import NamedTuple

from dissoc.protocol.framing import (
    BytesLike,
    MessageType,
    as_byte_view,
    encode_eos,
    encode_error,
    encode_metadata_header,
)
from dissoc.protocol.seq import SEQ_MAX, check_seq, fmt_seq
from dissoc.protocol.tags import BODY_PACKED, BODY_TYPE_SHIFT, KNOWN_BODY_TYPES, make_body_tag

__all__ = ["ServerMessage", "ServerState", "ServerStream", "StreamStateError"]

_log = logging.getLogger(__name__)

#: The 5-byte metadata-message prefix (type byte, little-endian u32 sequence number).
_METADATA_HEADER = struct.Struct("<BI")


class StreamStateError(RuntimeError):
    """A state machine was driven out of order by local code (a programming error, not bad input)."""


class ServerState(enum.Enum):
    """Life cycle of a :class:`ServerStream`."""

    IDLE = "idle"
    """Nothing sent yet; the schema comes next."""
    STREAMING = "streaming"
    """Schema sent; messages may follow."""
    ENDED = "ended"
    """End of stream sent."""
    FAILED = "failed"
    """Error message sent."""


class ServerMessage(NamedTuple):
    """What to send for one IPC message: the 5-byte ``header`` (send the flatbuffer right after it), its
    ``seq``, and the data-stream ``tag`` for its body (``None`` when it has no body)."""

    header: bytes
    seq: int
    tag: int | None


# ServerMessage made without the NamedTuple's Python-level __new__ (the per-message path).
_new_message = tuple.__new__
_pack_metadata_header = _METADATA_HEADER.pack
_METADATA_TYPE = int(MessageType.METADATA)
_STREAMING = ServerState.STREAMING  # a module global: faster to read than the enum's attribute


class ServerStream:
    """Sequence numbering and message framing for one stream a server sends.

    ``IDLE --schema()--> STREAMING --message()*--> STREAMING --end()--> ENDED``; ``error()`` from ``IDLE`` or
    ``STREAMING`` leads to ``FAILED``. Calls out of that order raise :class:`StreamStateError`.

    :param start_seq: sequence number of the schema (0 in the protocol; other values let tests cover
        roll-over).

    Each message is logged at debug level when the logger was enabled for it as the stream was made.
    """

    def __init__(self, *, start_seq: int = 0) -> None:
        self._next = check_seq(start_seq)
        self._sent = 0
        self._state = ServerState.IDLE
        # Whether each message is logged: asked once per stream, not once per message.
        self._debug = _log.isEnabledFor(logging.DEBUG)

    @property
    def state(self) -> ServerState:
        """The current state."""
        return self._state

    @property
    def next_seq(self) -> int:
        """The sequence number the next message will carry."""
        return self._next

    @property
    def sent(self) -> int:
        """How many metadata messages (schema included) have been produced."""
        return self._sent

    def _require(self, op: str, *states: ServerState) -> None:
        if self._state not in states:
            allowed = " or ".join(s.value for s in states)
            raise StreamStateError(
                f"ServerStream.{op}() needs state {allowed}, but the stream is {self._state.value}"
            )

    def _take(self) -> int:
        seq = self._next
        self._next = (seq + 1) & SEQ_MAX
        self._sent += 1
        return seq

    def schema(self, metadata: BytesLike) -> bytes:
        """The header for the Schema message (``metadata`` is its flatbuffer; send it after the header)."""
        self._require("schema", ServerState.IDLE)
        if len(as_byte_view(metadata)) == 0:
            raise ValueError("schema metadata must not be empty")
        seq = self._take()
        self._state = ServerState.STREAMING
        _log.debug("server: schema seq=0x%08x", seq)
        return encode_metadata_header(seq)

    def message(self, metadata: BytesLike, has_body: bool, body_type: int = BODY_PACKED) -> ServerMessage:
        """The header, sequence number and body tag for the next message.

        ``body_type`` (:data:`~dissoc.protocol.tags.BODY_PACKED` or :data:`~dissoc.protocol.tags.BODY_PAIRS`)
        says how its body will be sent; it is ignored when ``has_body`` is false.
        """
        if self._state is not _STREAMING:
            self._require("message", ServerState.STREAMING)
        if not (len(metadata) if type(metadata) is bytes else len(as_byte_view(metadata))):
            raise ValueError("message metadata must not be empty")
        if has_body and body_type not in KNOWN_BODY_TYPES:
            make_body_tag(0, body_type)  # raises: validated before a sequence number is consumed
        # _take(), inlined: this runs once per message of every stream a server sends.
        seq = self._next
        self._next = (seq + 1) & SEQ_MAX
        self._sent += 1
        # seq is valid by construction and body_type was checked: header and tag need no further checks.
        tag = (body_type << BODY_TYPE_SHIFT) | seq if has_body else None
        if self._debug:
            if tag is None:
                _log.debug("server: message seq=0x%08x (no body)", seq)
            else:
                _log.debug("server: message seq=0x%08x tag=0x%016x", seq, tag)
        return _new_message(ServerMessage, (_pack_metadata_header(_METADATA_TYPE, seq), seq, tag))

    def end(self) -> bytes:
        """The end-of-stream message (it carries the next unused sequence number)."""
        self._require("end", ServerState.STREAMING)
        self._state = ServerState.ENDED
        _log.debug("server: end of stream seq=%s after %d messages", fmt_seq(self._next), self._sent)
        return encode_eos(self._next)

    def error(self, code: str, message: str) -> bytes:
        """An error message for the client (carrying the next unused sequence number); the stream is over."""
        self._require("error", ServerState.IDLE, ServerState.STREAMING)
        data = encode_error(self._next, code, message)
        self._state = ServerState.FAILED
        _log.debug("server: error seq=%s code=%r", fmt_seq(self._next), code)
        return data
