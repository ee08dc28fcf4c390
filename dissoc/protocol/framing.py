"""Metadata-stream messages: a 5-byte prefix (u8 type, u32 LE sequence number) and a payload.

Types:

* ``0`` end of stream: exactly 5 bytes; the sequence number is the next unused one (the count of metadata
  messages sent, modulo 2**32).
* ``1`` IPC metadata: the payload is the Arrow ``Message`` flatbuffer.
* ``0xE0`` error (a project extension): the sequence number is the next unused one, the payload is UTF-8 JSON
  ``{"code": "...", "message": "..."}``. Encoded payloads are at most :data:`MAX_ERROR_PAYLOAD` bytes (the
  message is cut to fit); a received error's message is cut to :data:`MAX_ERROR_MESSAGE` characters (its code
  to :data:`MAX_ERROR_CODE`), whatever a peer sent.

Encoders return the 5-byte header on its own so that callers can gather-send it with the flatbuffer without
concatenating; :func:`encode_metadata_message` is the concatenating convenience. The decoder never copies the
flatbuffer: :attr:`MetadataMessage.metadata` is a slice of the buffer it was given.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Final

from dissoc.buffers import BytesLike
from dissoc.buffers import byte_view as as_byte_view
from dissoc.errors import ProtocolError
from dissoc.protocol.seq import check_seq, fmt_seq

__all__ = [
    "EMPTY_TICKET",
    "MAX_ERROR_CODE",
    "MAX_ERROR_MESSAGE",
    "MAX_ERROR_PAYLOAD",
    "PREFIX_SIZE",
    "BytesLike",
    "EndOfStream",
    "ErrorMessage",
    "MessageType",
    "MetadataMessage",
    "StreamMessage",
    "as_byte_view",
    "decode_stream_message",
    "encode_eos",
    "encode_error",
    "encode_error_payload",
    "encode_metadata_header",
    "encode_metadata_message",
    "encode_prefix",
    "peek_prefix",
    "shorten",
]

PREFIX_SIZE: Final = 5
"""Size of the metadata-stream prefix: u8 message type, u32 LE sequence number."""

_PREFIX = struct.Struct("<BI")

MAX_ERROR_PAYLOAD: Final = 4096
"""Most bytes of JSON in an error message a server sends (the message is cut to fit)."""

MAX_ERROR_MESSAGE: Final = 1024
"""Most characters of a received error's message kept (the rest is cut, saying how much)."""

MAX_ERROR_CODE: Final = 64
"""Most characters of a received error's code kept."""

EMPTY_TICKET: Final = "empty_ticket"
"""The error code a server answers a want_data without a ticket with, at once (project extension: the
health probe's request, ``dissoc health``)."""


class MessageType(enum.IntEnum):
    """The first byte of a metadata-stream message."""

    END_OF_STREAM = 0
    METADATA = 1
    ERROR = 0xE0


_KNOWN_TYPES = "0x00 (end of stream), 0x01 (IPC metadata) or 0xe0 (error)"


@dataclass(frozen=True, slots=True)
class EndOfStream:
    """Type 0: the server has sent every metadata message; ``seq`` is the count sent (modulo 2**32)."""

    seq: int


@dataclass(frozen=True, slots=True)
class MetadataMessage:
    """Type 1: one Arrow IPC ``Message`` flatbuffer (``metadata`` is a view into the received buffer)."""

    seq: int
    metadata: memoryview


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """Type 0xE0: the server failed the stream; ``seq`` is the next unused sequence number."""

    seq: int
    code: str
    message: str


StreamMessage = EndOfStream | MetadataMessage | ErrorMessage
"""Anything that can arrive on the metadata stream."""


def peek_prefix(buf: BytesLike) -> tuple[int, int] | None:
    """``(type, seq)`` of a metadata-stream message's prefix without decoding the rest, or None when ``buf``
    is shorter than a prefix (a cheap look for ordering checks; :func:`decode_stream_message` validates)."""
    mv = as_byte_view(buf)
    if len(mv) < PREFIX_SIZE:
        return None
    msg_type, seq = _PREFIX.unpack_from(mv)
    return msg_type, seq


def encode_prefix(msg_type: int, seq: int) -> bytes:
    """The 5-byte prefix for a message of type ``msg_type`` with sequence number ``seq``."""
    if not 0 <= msg_type <= 0xFF:
        raise ValueError(f"message type must fit in a byte, got {msg_type!r}")
    return _PREFIX.pack(msg_type, check_seq(seq))


def encode_metadata_header(seq: int) -> bytes:
    """The 5-byte header of an IPC metadata message; send the flatbuffer bytes right after it."""
    return _PREFIX.pack(MessageType.METADATA, check_seq(seq))


def encode_metadata_message(seq: int, metadata: BytesLike) -> bytes:
    """A whole IPC metadata message (header and flatbuffer concatenated, which copies the flatbuffer)."""
    return encode_metadata_header(seq) + bytes(metadata)


def encode_eos(seq: int) -> bytes:
    """The 5-byte end-of-stream message; ``seq`` is the next unused sequence number."""
    return _PREFIX.pack(MessageType.END_OF_STREAM, check_seq(seq))


def shorten(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and how much was cut (at most
    ``limit`` characters in all, for ``limit`` >= 40)."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - 40)
    return f"{text[:keep]}... ({len(text) - keep} characters cut)"


def encode_error_payload(code: str, message: str) -> bytes:
    """The JSON payload of an error message (ASCII-only JSON, so always valid UTF-8), at most
    :data:`MAX_ERROR_PAYLOAD` bytes: a longer message is cut, saying how much."""
    if not isinstance(code, str) or not isinstance(message, str):
        raise TypeError("error code and message must be str")
    code = shorten(code, MAX_ERROR_CODE)
    payload = json.dumps({"code": code, "message": message}, ensure_ascii=True).encode("ascii")
    limit = MAX_ERROR_PAYLOAD
    while len(payload) > MAX_ERROR_PAYLOAD:
        # Escapes make a character take up to 12 bytes of JSON: halve until it fits (a few rounds at most).
        limit = min(limit, len(message)) // 2
        short = shorten(message, max(limit, 40))
        payload = json.dumps({"code": code, "message": short}, ensure_ascii=True).encode("ascii")
    return payload


def encode_error(seq: int, code: str, message: str) -> bytes:
    """A whole error message: prefix (type 0xE0, the next unused ``seq``) and JSON payload."""
    return _PREFIX.pack(MessageType.ERROR, check_seq(seq)) + encode_error_payload(code, message)


def _decode_error_payload(seq: int, payload: memoryview) -> ErrorMessage:
    where = f"error message (seq {fmt_seq(seq)})"
    try:
        text = str(payload, "utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"{where}: expected a UTF-8 JSON payload, got invalid UTF-8 ({exc})") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"{where}: expected a JSON payload, got unparseable text ({exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(
            f'{where}: expected a JSON object {{"code", "message"}}, got {type(obj).__name__}'
        )
    code = obj.get("code")
    message = obj.get("message")
    if not isinstance(code, str) or not isinstance(message, str):
        raise ProtocolError(
            f'{where}: expected string fields "code" and "message", got '
            f"code={type(code).__name__}, message={type(message).__name__}"
        )
    return ErrorMessage(seq, shorten(code, MAX_ERROR_CODE), shorten(message, MAX_ERROR_MESSAGE))


def decode_stream_message(buf: BytesLike) -> StreamMessage:
    """Decode one metadata-stream message.

    Raises :class:`~dissoc.errors.ProtocolError` for a message shorter than the prefix, an unknown type byte,
    an end-of-stream message that is not exactly 5 bytes, or an error message whose payload is not the
    expected UTF-8 JSON object. The returned :class:`MetadataMessage` views ``buf`` (no copy), so ``buf`` must
    not be reused while the metadata is in use.
    """
    mv = as_byte_view(buf)
    n = len(mv)
    if n < PREFIX_SIZE:
        raise ProtocolError(
            f"metadata-stream message: expected at least {PREFIX_SIZE} bytes (type + sequence number), "
            f"got {n} byte(s)"
        )
    msg_type, seq = _PREFIX.unpack_from(mv)
    if msg_type == MessageType.METADATA:
        return MetadataMessage(seq, mv[PREFIX_SIZE:])
    if msg_type == MessageType.END_OF_STREAM:
        if n != PREFIX_SIZE:
            raise ProtocolError(
                f"end-of-stream message (seq {fmt_seq(seq)}): expected exactly {PREFIX_SIZE} bytes, got {n}"
            )
        return EndOfStream(seq)
    if msg_type == MessageType.ERROR:
        return _decode_error_payload(seq, mv[PREFIX_SIZE:])
    raise ProtocolError(
        f"metadata-stream message: expected type {_KNOWN_TYPES}, got 0x{msg_type:02x} ({n} bytes)"
    )
