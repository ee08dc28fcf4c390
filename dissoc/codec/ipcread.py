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
from collections.abc import Callable

import pyarrow as pa

__all__ = ["NOTHING", "FramedSource", "distinct_sizes", "frame_head", "frame_parts", "frame_room"]

_CONTINUATION = b"\xff\xff\xff\xff"
_I32 = struct.Struct("<i")


def frame_room(metadata_length: int) -> int:
    """Bytes of headroom before a body that :func:`write_frame` needs for ``metadata_length`` bytes of
    Message flatbuffer: the 8-byte prefix plus the metadata padded to a multiple of 8."""
    if metadata_length < 0:
        raise ValueError(f"metadata_length must be >= 0, got {metadata_length}")
    return 8 + metadata_length + (-metadata_length) % 8


def frame_parts(metadata: bytes) -> tuple[bytes, bytes]:
    """What pyarrow's stream reader asks for before the body, in the pre-1.0 framing that it still reads
    (no continuation marker, which saves one read through Python): the metadata length, then the padded
    metadata."""
    pad = (-len(metadata)) % 8
    return _I32.pack(len(metadata) + pad), metadata + bytes(pad)


def frame_head(metadata: bytes) -> bytes:
    """The encapsulation framing and padded metadata that go before a body, ``frame_room`` bytes in all."""
    pad = (-len(metadata)) % 8
    return _CONTINUATION + _I32.pack(len(metadata) + pad) + metadata + bytes(pad)


_EMPTY: dict[int, object] = {}
#: The ``read`` of a :class:`FramedSource` with nothing loaded.
NOTHING: Callable[[int], object | None] = _EMPTY.get


class FramedSource:
    """A file object that reads as one encapsulated message: the framing, then a body object, never copied.

    One per decoder, loaded for each message (:meth:`message`). pyarrow's reader asks for the length (4
    bytes), the metadata, then the body; ``read`` is a dictionary lookup by the size asked for (no Python
    frame per read), so a request for any other size gets nothing, which pyarrow reports as an error. The
    sizes must differ from one another (:func:`distinct_sizes`).
    """

    mode = "rb"
    closed = False

    def __init__(self) -> None:
        self.read: Callable[[int], object | None] = NOTHING
        self.file = pa.PythonFile(self, mode="r")

    def message(self, frame: tuple[bytes, bytes], body: object, body_length: int) -> pa.NativeFile:
        """Load one message (``body`` exactly ``body_length`` bytes long) and return the stream to read."""
        pieces: dict[int, object] = {4: frame[0], len(frame[1]): frame[1], body_length: body}
        self.read = pieces.get
        return self.file

    def clear(self) -> None:
        """Drop the pieces, so that the body is not kept alive."""
        self.read = NOTHING

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.read = NOTHING


def distinct_sizes(frame: tuple[bytes, bytes], body_length: int) -> bool:
    """Whether :class:`FramedSource` can tell the pieces of this message apart by their sizes."""
    return len({4, len(frame[1]), body_length}) == 3
