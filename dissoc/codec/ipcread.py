"""Handing a checked message to pyarrow's own IPC reader, without copying its body.

Once our codec has parsed a RecordBatch message and checked its layout against the schema and the body size
(:mod:`dissoc.codec.plan` caches that per metadata), what is left for a packed, uncompressed little-endian
host body is exactly what ``pyarrow.ipc.read_record_batch`` does in C++: slice the body into buffers and build
arrays. That costs far less per message than building the C Data Interface structs from Python.

pyarrow's reader wants the encapsulated framing (continuation marker, metadata length, the metadata padded
to 8 bytes, then the body) as one stream. Two ways to give it that without copying the body:

* :class:`FramedSource`: a tiny file object that hands pyarrow the framing, then the caller's body object as
  is; pyarrow wraps what ``read`` returns without copying, so the arrays point into the body received.
* :func:`frame_room` and ``MessageDecoder.decode_landed``: a caller that can land the body right after
  ``frame_room`` spare bytes (a network receiver that knows the metadata before the body arrives) lets the
  decoder write the framing into that room, and pyarrow reads the whole allocation as one buffer.

Content checks (offsets, views, union ids, run ends) are not pyarrow's job here: the decoder runs them.
"""

from __future__ import annotations

import struct

import pyarrow as pa

__all__ = ["FramedSource", "frame_parts", "frame_room"]

_CONTINUATION = b"\xff\xff\xff\xff"
_I32 = struct.Struct("<i")


def frame_room(metadata_length: int) -> int:
    """Bytes of headroom before a body that :func:`write_frame` needs for ``metadata_length`` bytes of
    Message flatbuffer: the 8-byte prefix plus the metadata padded to a multiple of 8."""
    if metadata_length < 0:
        raise ValueError(f"metadata_length must be >= 0, got {metadata_length}")
    return 8 + metadata_length + (-metadata_length) % 8


def frame_parts(metadata: bytes) -> tuple[bytes, bytes, bytes]:
    """The three pieces pyarrow's stream reader asks for, in order, before the body: continuation marker,
    metadata length, padded metadata."""
    pad = (-len(metadata)) % 8
    return _CONTINUATION, _I32.pack(len(metadata) + pad), metadata + bytes(pad)


class FramedSource:
    """A file object that reads as one encapsulated message: the framing, then a body object, never copied.

    One per decoder, refilled for each message (:meth:`message`). ``read`` returns exactly what was asked for
    or nothing (end of stream, which pyarrow reports as an error), so a framing that disagrees with what
    pyarrow parses can never make it read past a piece.
    """

    mode = "rb"
    closed = False

    def __init__(self) -> None:
        self._parts: list[object] = []
        self.file = pa.PythonFile(self, mode="r")

    def message(self, parts: tuple[bytes, bytes, bytes], body: object) -> pa.NativeFile:
        """Load one message (``body`` exactly as long as the metadata says) and return the stream to read."""
        self._parts = [body, parts[2], parts[1], parts[0]]
        return self.file

    def clear(self) -> None:
        """Drop what was not read (after an error), so the body is not kept alive."""
        self._parts = []

    def read(self, n: int = -1) -> object:
        parts = self._parts
        if not parts:
            return b""
        part = parts.pop()
        return part if len(part) == n else b""  # type: ignore[arg-type]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self._parts = []
