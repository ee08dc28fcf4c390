"""Per-stream state machines: what a server sends for one stream, and what a client makes of what arrives.

Both are sans-IO: :class:`ServerStream` returns the bytes and tags to send, :class:`ClientStream` takes the
bytes that arrived and returns events. Neither touches a socket or an event loop.
"""

from __future__ import annotations

import enum
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import numpy as np

from dissoc.errors import DissocError, ProtocolError, RemoteError
from dissoc.protocol.framing import (
    PREFIX_SIZE,
    BytesLike,
    EndOfStream,
    ErrorMessage,
    MessageType,
    MetadataMessage,
    as_byte_view,
    decode_stream_message,
    encode_eos,
    encode_error,
    encode_metadata_header,
)
from dissoc.protocol.pairs import decode_pairs
from dissoc.protocol.reorder import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_WINDOW,
    Complete,
    ReorderBuffer,
    SeqClass,
)
from dissoc.protocol.seq import SEQ_MAX, check_seq, fmt_seq
from dissoc.protocol.tags import (
    BODY_PACKED,
    BODY_PAIRS,
    BODY_TYPE_SHIFT,
    KNOWN_BODY_TYPES,
    fmt_tag,
    make_body_tag,
    parse_body_tag,
)

__all__ = [
    "ClientEvent",
    "ClientState",
    "ClientStream",
    "MessageReady",
    "SchemaReceived",
    "SeqClass",
    "ServerMessage",
    "ServerState",
    "ServerStream",
    "StreamEnded",
    "StreamStateError",
]

_log = logging.getLogger(__name__)

#: The 5-byte metadata-message prefix (type byte, little-endian u32 sequence number).
_METADATA_HEADER = struct.Struct("<BI")

#: The largest tag of a packed body (body type 0 in bits 56-63, reserved bits 32-55 clear): the seq itself.
_PACKED_TAG_MAX = 0xFFFF_FFFF


class StreamStateError(RuntimeError):
    """A state machine was driven out of order by local code (a programming error, not bad input)."""


# ------------------------------------------------------------------------------------------------------------
# Server side
# ------------------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------------------
# Client side
# ------------------------------------------------------------------------------------------------------------


class ClientState(enum.Enum):
    """Life cycle of a :class:`ClientStream`."""

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


_CLIENT_STREAMING = ClientState.STREAMING  # (as _STREAMING above)


@dataclass(frozen=True, slots=True)
class SchemaReceived:
    """The first message (the Schema) was released."""

    seq: int
    metadata: memoryview


@dataclass(frozen=True, slots=True)
class MessageReady:
    """A message after the schema was released, in sequence order.

    ``body`` is ``None`` without a body, a :class:`~dissoc.protocol.pairs.PairList` for body type 1, and the
    payload exactly as it was given to :meth:`ClientStream.receive_body` for body type 0.
    """

    seq: int
    metadata: memoryview
    body_type: int | None
    body: object | None


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """End of stream received and every message released; ``count`` messages in all (schema included)."""

    count: int


ClientEvent = SchemaReceived | MessageReady | StreamEnded
"""What :class:`ClientStream` reports."""


def _payload_nbytes(payload: object) -> int:
    if isinstance(payload, bytes | bytearray):
        return len(payload)
    n = getattr(payload, "nbytes", None)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    raise TypeError(f"cannot tell the size of a body of type {type(payload).__name__}; pass nbytes")


def _host_view(payload: object) -> memoryview:
    if isinstance(payload, memoryview | bytes | bytearray | np.ndarray):
        return as_byte_view(payload)
    raise TypeError(f"a pair-list body must be in host memory, got {type(payload).__name__}")


class ClientStream:
    """Reassembles one stream on the client: raw metadata-stream messages and tagged bodies in, events out.

    :param has_body: tells from a metadata flatbuffer (a memoryview; ``bytes`` from :meth:`release_packed`)
        whether the message has a body (RecordBatch and DictionaryBatch do, Schema does not); supplied by the
        codec.
    :param window: see :class:`~dissoc.protocol.reorder.ReorderBuffer`.
    :param max_pending_bytes: see :class:`~dissoc.protocol.reorder.ReorderBuffer`.
    :param start_seq: the schema's sequence number (0 in the protocol).

    Messages may arrive in any order within the window: metadata out of order (even before the schema, which
    is held until it arrives), bodies before or after their metadata, and the end-of-stream message before
    metadata or bodies for the sequence numbers below its count; events come out in sequence order all the
    same, and :class:`StreamEnded` once every message before the end-of-stream count has been released. The
    message at ``start_seq`` must be the schema (no body); that is checked when it arrives. An error message
    raises :class:`~dissoc.errors.RemoteError`; a peer breaking the rules raises
    :class:`~dissoc.errors.ProtocolError` (duplicates, input at or after the end-of-stream count, a second
    end of stream, ...) or :class:`~dissoc.errors.ResourceError` past the limits. After any error the stream
    is failed and every further call raises :class:`~dissoc.errors.ProtocolError`.
    """

    def __init__(
        self,
        has_body: Callable[[Any], bool],
        *,
        window: int = DEFAULT_WINDOW,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        start_seq: int = 0,
    ) -> None:
        self._has_body = has_body
        self._reorder: ReorderBuffer[memoryview, object] = ReorderBuffer(
            window=window, max_pending_bytes=max_pending_bytes, start_seq=start_seq
        )
        self._start = check_seq(start_seq)
        self._state = ClientState.AWAITING_SCHEMA
        self._schema_released = False
        # What failed the stream, as text: the exception itself would keep alive, through the traceback it
        # gathers once the consumer raises it, whatever the consumer's frames hold (zero-copy batches over a
        # server's memory, whose release the session waits for).
        self._failure: str | None = None

    # -- introspection ---------------------------------------------------------------------------------------

    @property
    def state(self) -> ClientState:
        """The current state."""
        return self._state

    @property
    def finished(self) -> bool:
        """End of stream received and every message released."""
        return self._state is ClientState.FINISHED

    @property
    def metadata_complete(self) -> bool:
        """End of stream received and the metadata for every sequence number before its count too.

        Nothing more is due on the metadata stream: a driver can stop reading it (bodies may still be
        outstanding). Until then it must keep reading even after the end-of-stream message, which may
        overtake metadata messages. See ``ReorderBuffer.metadata_complete``.
        """
        return self._reorder.metadata_complete

    @property
    def failed(self) -> bool:
        """Whether an error ended the stream."""
        return self._state is ClientState.FAILED

    @property
    def next_seq(self) -> int:
        """The sequence number of the next message to release."""
        return self._reorder.next_seq

    @property
    def released(self) -> int:
        """How many messages have been released (schema included)."""
        return self._reorder.released

    @property
    def pending_bytes(self) -> int:
        """Bytes held waiting for release."""
        return self._reorder.pending_bytes

    def accepts(self, seq: int) -> bool:
        """Whether input for ``seq`` fits the reorder window now (see ``ReorderBuffer.accepts``).

        False both ahead of the window and for sequence numbers already released; drivers deciding whether
        to wait should use :meth:`classify`.
        """
        return self._reorder.accepts(seq)

    def classify(self, seq: int) -> SeqClass:
        """Where input (metadata or body) for ``seq`` stands now; cheap (constant time), changes nothing.

        For backpressure in drivers that read the metadata and data streams separately: wait while the
        result is positive, pass the input on otherwise.

        * :attr:`SeqClass.AHEAD` (1): ``seq`` is ``window`` or more ahead of :attr:`next_seq` (and before the
          end-of-stream count, if known): passing it on now raises :class:`~dissoc.errors.ResourceError`;
          wait for events to be released, then ask again.
        * :attr:`SeqClass.ACCEPT` (0): inside the window: pass it on now (it may still be refused for what
          it is: a duplicate of something held, a body for a message without one, the byte limit).
        * :attr:`SeqClass.RELEASED` (-2): already released: the input is a duplicate; pass it on and the
          stream fails with :class:`~dissoc.errors.ProtocolError` at once (waiting would never help).
        * :attr:`SeqClass.PAST_END` (-1): the end of stream has arrived and ``seq`` is at or after its count;
          pass it on, the stream fails with :class:`~dissoc.errors.ProtocolError`.
        * :attr:`SeqClass.FAILED` (-3): the stream has already failed; every input raises
          :class:`~dissoc.errors.ProtocolError`.

        ``seq`` is the sequence number of a metadata message (bytes 1-4) or of a body (the tag's low 32
        bits). End-of-stream and error messages are never held back by the window and need no check.
        """
        if self._state is ClientState.FAILED:
            return SeqClass.FAILED
        return self._reorder.classify(seq)

    def missing(self) -> list[int]:
        """Some sequence numbers still lacking their metadata or body (see ``ReorderBuffer.missing``)."""
        return self._reorder.missing()

    # -- input -----------------------------------------------------------------------------------------------

    def _check_usable(self, what: str) -> None:
        if self._state is ClientState.FAILED:
            raise ProtocolError(f"{what}: the stream already failed ({self._failure})")

    def _fail(self, exc: BaseException) -> NoReturn:
        self._state = ClientState.FAILED
        self._failure = str(exc)
        raise exc

    def receive_metadata_message(self, buf: BytesLike) -> list[ClientEvent]:
        """Process one message from the metadata stream; return the events it caused, in order.

        The returned metadata views ``buf`` (no copy); keep ``buf`` unchanged while it is in use.
        """
        if self._state is ClientState.FAILED:
            self._check_usable("metadata-stream message")
        try:
            return self._on_metadata_stream(buf)
        except Exception as exc:
            self._fail(exc)

    def receive_body(self, tag: int, payload: object, nbytes: int | None = None) -> list[ClientEvent]:
        """Process one tagged message from the data stream; return the events it caused, in order.

        ``payload`` is the body as the transport delivered it (host bytes, or device memory for packed
        bodies); ``nbytes`` is its size, taken from ``len()``/``.nbytes`` when omitted. Pair-list bodies
        (type 1) must be in host memory and are decoded into a :class:`~dissoc.protocol.pairs.PairList`.
        """
        if self._state is ClientState.FAILED:
            self._check_usable(f"body with tag {fmt_tag(tag) if isinstance(tag, int) else tag!r}")
        try:
            return self._on_body(tag, payload, nbytes)
        except Exception as exc:
            self._fail(exc)

    def receive_message_with_body(
        self, buf: BytesLike, tag: int, payload: object, nbytes: int
    ) -> list[ClientEvent]:
        """A metadata-stream message and the tagged message that followed it on the same in-order connection:
        the same as :meth:`receive_metadata_message` then :meth:`receive_body`, with the same events and
        errors, in one step when the pair is the next message to release (the common case of a stream sent
        in order over one connection)."""
        if self._state is ClientState.STREAMING and type(tag) is int and 0 <= tag <= _PACKED_TAG_MAX:
            try:
                mv = as_byte_view(buf)
                if len(mv) > PREFIX_SIZE:
                    kind, seq = _METADATA_HEADER.unpack_from(mv)
                    if kind == MessageType.METADATA and seq == tag:
                        metadata = mv[PREFIX_SIZE:]
                        if self._has_body(metadata):
                            done = self._reorder.release_next(
                                seq, metadata, BODY_PACKED, payload, nbytes, len(metadata)
                            )
                            if done is not None:
                                return [MessageReady(seq, metadata, BODY_PACKED, payload)]
            except Exception as exc:
                self._fail(exc)
        events = self.receive_metadata_message(buf)
        return events + self.receive_body(tag, payload, nbytes)

    def release_packed(self, seq: int, metadata: bytes, nbytes: int) -> bool:
        """Release message ``seq`` in one step, without an event, when it is the next to release and nothing
        is held: the metadata message of ``seq`` (its flatbuffer ``metadata``, after the prefix) and a packed
        body of ``nbytes`` bytes under tag ``seq`` arrived back to back.

        For drivers that decode at once what :meth:`receive_message_with_body` would hand back as one
        :class:`MessageReady` (the caller knows the metadata, the body type and the body). False when the
        message needs the general path (nothing changed then; call :meth:`receive_message_with_body`).
        """
        if self._state is not _CLIENT_STREAMING or not metadata:
            return False
        try:
            if not self._has_body(metadata):
                return False
        except Exception as exc:
            self._fail(exc)
        return self._reorder.advance(seq, nbytes + len(metadata))

    def close(self) -> None:
        """Declare that no more input will arrive; raise :class:`~dissoc.errors.ProtocolError` unless done.

        The error names what never arrived. Closing a failed stream does nothing more.
        """
        if self._state is ClientState.FAILED or self._state is ClientState.FINISHED:
            return
        try:
            self._reorder.close()
        except DissocError as exc:
            self._fail(exc)

    # -- internals -------------------------------------------------------------------------------------------

    def _on_metadata_stream(self, buf: BytesLike) -> list[ClientEvent]:
        msg = decode_stream_message(buf)
        reorder = self._reorder
        if isinstance(msg, MetadataMessage):
            has_body = bool(self._has_body(msg.metadata))
            if has_body and msg.seq == self._start and reorder.released == 0:
                raise ProtocolError(
                    f"first message (seq {fmt_seq(msg.seq)}) must be a schema: expected a schema without "
                    "body, got metadata for a message with a body"
                )
            events = self._convert(reorder.add_metadata(msg.seq, msg.metadata, has_body, len(msg.metadata)))
            return self._maybe_finish(events)
        if isinstance(msg, EndOfStream):
            if reorder.released == 0 and msg.seq == reorder.next_seq and not reorder.ended:
                raise ProtocolError(
                    f"end of stream (seq {fmt_seq(msg.seq)}): expected the schema first, got an end of "
                    "stream counting no metadata messages at all"
                )
            events = self._convert(reorder.end(msg.seq))
            return self._maybe_finish(events)
        assert isinstance(msg, ErrorMessage)
        if reorder.ended:
            raise ProtocolError(
                f"metadata stream: expected only metadata after end of stream "
                f"(seq {fmt_seq(reorder.eos_seq or 0)}), got an error message with seq {fmt_seq(msg.seq)} "
                f"({msg.code}: {msg.message})"
            )
        _log.debug("client: error message seq=%s code=%r", fmt_seq(msg.seq), msg.code)
        raise RemoteError(msg.code, msg.message)

    def _on_body(self, tag: int, payload: object, nbytes: int | None) -> list[ClientEvent]:
        if type(tag) is int and 0 <= tag <= _PACKED_TAG_MAX:  # a packed body's tag: bits 32-63 clear
            seq, body_type = tag, BODY_PACKED
        else:
            seq, body_type = parse_body_tag(tag)
        body: object
        if body_type == BODY_PAIRS:
            view = _host_view(payload)
            body = decode_pairs(view)
            size = len(view)
        else:
            body = payload
            size = _payload_nbytes(payload) if nbytes is None else nbytes
        events = self._convert(self._reorder.add_body(seq, body_type, body, size))
        return self._maybe_finish(events)

    def _convert(self, done: list[Complete[memoryview, object]]) -> list[ClientEvent]:
        if not done:
            return []
        if self._schema_released:
            return [MessageReady(c.seq, c.metadata, c.body_type, c.body) for c in done]
        events: list[ClientEvent] = []
        for c in done:
            if not self._schema_released:
                self._schema_released = True
                events.append(SchemaReceived(c.seq, c.metadata))
            else:
                events.append(MessageReady(c.seq, c.metadata, c.body_type, c.body))
        return events

    def _maybe_finish(self, events: list[ClientEvent]) -> list[ClientEvent]:
        reorder = self._reorder
        if not events and self._state is ClientState.STREAMING and not reorder.ended:
            return events  # nothing released, no end of stream: nothing finished, the state stays
        if reorder.finished:
            if self._state is not ClientState.FINISHED:
                self._state = ClientState.FINISHED
                events.append(StreamEnded(reorder.released))
                _log.debug("client: stream finished after %d messages", reorder.released)
        elif reorder.ended:
            self._state = ClientState.ENDED
        elif self._schema_released:
            self._state = ClientState.STREAMING
        return events
