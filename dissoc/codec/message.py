"""The Arrow ``Message`` flatbuffer: parsing its header, and building RecordBatch / DictionaryBatch messages.

Vectors of structs (FieldNode, Buffer) are read and written in bulk with numpy.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import flatbuffers
import numpy as np
import numpy.typing as npt

from dissoc.codec.fb import Table, root_table
from dissoc.codec.schema import build_message
from dissoc.errors import CodecError

__all__ = [
    "Compression",
    "HeaderType",
    "MessageInfo",
    "RecordBatchHeader",
    "encode_dictionary_batch",
    "encode_record_batch",
    "has_body",
    "parse_message",
    "parse_record_batch",
    "peek_header",
]

METADATA_V5 = 4
MAX_MESSAGE_VERSION = 4
MIN_MESSAGE_VERSION = 3


class HeaderType(enum.IntEnum):
    NONE = 0
    Schema = 1
    DictionaryBatch = 2
    RecordBatch = 3
    Tensor = 4
    SparseTensor = 5


class Compression(enum.IntEnum):
    LZ4_FRAME = 0
    ZSTD = 1


@dataclass(slots=True)
class MessageInfo:
    """The fields of a Message table."""

    version: int
    header_type: int
    header: Table | None
    body_length: int
    custom_metadata: dict[bytes, bytes] | None = None


@dataclass(slots=True)
class RecordBatchHeader:
    """A RecordBatch table with its struct vectors as numpy arrays (int64, shape (n, 2))."""

    length: int
    nodes: npt.NDArray[np.int64]
    buffers: npt.NDArray[np.int64]
    compression: int | None
    variadic_counts: npt.NDArray[np.int64] | None


def _as_view(metadata: object) -> memoryview:
    try:
        mv = memoryview(metadata)  # type: ignore[arg-type]
    except TypeError:
        raise CodecError(f"message metadata must be bytes-like, got {type(metadata).__name__}") from None
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


_I16 = struct.Struct("<h")
_U8 = struct.Struct("<B")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")


def _scalar(buf: memoryview, p: int, s: struct.Struct, default: int, what: str) -> int:
    if p == 0:
        return default
    if p + s.size > len(buf):
        raise CodecError(f"{what}: field at {p} runs past the {len(buf)}-byte flatbuffer")
    return int(s.unpack_from(buf, p)[0])


def parse_message(metadata: object) -> MessageInfo:
    """Parse the Message flatbuffer ``metadata`` (bytes-like) without copying it."""
    mv = _as_view(metadata)
    t = root_table(mv, "Message")
    p_version, p_type, p_header, p_body, _ = t.slots(5)
    version = _scalar(mv, p_version, _I16, 0, "Message")
    if version < MIN_MESSAGE_VERSION or version > MAX_MESSAGE_VERSION:
        raise CodecError(
            f"Message: metadata version must be V4 or V5 ({MIN_MESSAGE_VERSION}..{MAX_MESSAGE_VERSION}; "
            f"versions before V4 predate Arrow 0.8 and are not supported), got {version}"
        )
    header_type = _scalar(mv, p_type, _U8, 0, "Message")
    if header_type not in (1, 2, 3, 4, 5):
        raise CodecError(f"Message: header type must be 1..5, got {header_type}")
    header = t.table(2, "Message.header") if p_header else None
    if header is None:
        raise CodecError(f"Message: header of type {HeaderType(header_type).name} is missing")
    body_length = _scalar(mv, p_body, _I64, 0, "Message")
    if body_length < 0:
        raise CodecError(f"Message: bodyLength must be >= 0, got {body_length}")
    return MessageInfo(version, header_type, header, body_length)


def peek_header(metadata: object) -> tuple[int, int]:
    """(header type, body length) of a Message flatbuffer; cheap enough for the protocol layer."""
    info = parse_message(metadata)
    return info.header_type, info.body_length


def has_body(metadata: object) -> bool:
    """Whether a Message carries a body on the data stream (RecordBatch and DictionaryBatch do)."""
    return peek_header(metadata)[0] in (HeaderType.RecordBatch, HeaderType.DictionaryBatch)


_EMPTY = np.zeros((0, 2), np.int64)


def parse_record_batch(t: Table) -> RecordBatchHeader:
    """Read a RecordBatch table; nodes and buffers are checked for negative values here."""
    p_length, p_nodes, p_buffers, p_comp, p_variadic = t.slots(5)
    length = _scalar(t._buf, p_length, _I64, 0, "RecordBatch")
    if length < 0:
        raise CodecError(f"RecordBatch: length must be >= 0, got {length}")
    # Copied out of the flatbuffer: aligned, contiguous arrays make every later vector operation cheaper.
    raw = t.vector_bytes(1, 16) if p_nodes else None
    nodes = np.frombuffer(raw, "<i8").reshape(-1, 2).copy() if raw is not None else _EMPTY
    raw = t.vector_bytes(2, 16) if p_buffers else None
    buffers = np.frombuffer(raw, "<i8").reshape(-1, 2).copy() if raw is not None else _EMPTY
    if len(nodes) and int(np.minimum(nodes[:, 1], nodes[:, 0] - nodes[:, 1]).min()) < 0:
        bad = int(np.flatnonzero((nodes < 0).any(axis=1) | (nodes[:, 1] > nodes[:, 0]))[0])
        raise CodecError(
            f"RecordBatch: field node {bad} has length {int(nodes[bad, 0])} and null count "
            f"{int(nodes[bad, 1])}; expected 0 <= null count <= length"
        )
    if len(buffers) and int(buffers.min()) < 0:
        bad = int(np.flatnonzero((buffers < 0).any(axis=1))[0])
        raise CodecError(
            f"RecordBatch: buffer {bad} has offset {int(buffers[bad, 0])} and length {int(buffers[bad, 1])}; "
            "expected both >= 0"
        )
    compression = None
    ct = t.table(3, "BodyCompression") if p_comp else None
    if ct is not None:
        compression = ct.scalar(0, "b", 0)
        method = ct.scalar(1, "b", 0)
        if compression not in (0, 1):
            raise CodecError(f"BodyCompression: codec must be 0 (LZ4_FRAME) or 1 (ZSTD), got {compression}")
        if method != 0:
            raise CodecError(f"BodyCompression: method must be 0 (BUFFER), got {method}")
    raw = t.vector_bytes(4, 8) if p_variadic else None
    variadic = np.frombuffer(raw, "<i8") if raw is not None else None
    if variadic is not None and variadic.size and variadic.min() < 0:
        raise CodecError(f"RecordBatch: variadicBufferCounts must be >= 0, got {variadic.tolist()[:8]}")
    return RecordBatchHeader(length, nodes, buffers, compression, variadic)


# --------------------------------------------------------------------------------------------------- encode


def _struct_vector(b: flatbuffers.Builder, data: bytes, count: int, elem_size: int) -> int:
    """A vector of ``count`` structs of ``elem_size`` bytes (``data``), written in one piece."""
    b.StartVector(elem_size, count, 8)
    b.head = b.head - len(data)
    b.Bytes[b.head : b.head + len(data)] = data
    b.vectorNumElems = count
    return int(b.EndVector())


def _record_batch_table(
    b: flatbuffers.Builder,
    length: int,
    nodes: npt.NDArray[np.int64],
    buffers: npt.NDArray[np.int64],
    compression: int | None,
    variadic_counts: list[int] | None,
) -> int:
    variadic_off = None
    if variadic_counts:
        variadic_off = b.CreateNumpyVector(np.asarray(variadic_counts, "<i8"))
    buf_off = _struct_vector(b, np.ascontiguousarray(buffers, "<i8").tobytes(), len(buffers), 16)
    node_off = _struct_vector(b, np.ascontiguousarray(nodes, "<i8").tobytes(), len(nodes), 16)
    comp_off = None
    if compression is not None:
        b.StartObject(2)
        b.PrependInt8Slot(0, compression, -1)
        b.PrependInt8Slot(1, 0, -1)
        comp_off = b.EndObject()
    b.StartObject(5)
    b.PrependInt64Slot(0, length, -1)
    b.PrependUOffsetTRelativeSlot(1, node_off, 0)
    b.PrependUOffsetTRelativeSlot(2, buf_off, 0)
    if comp_off is not None:
        b.PrependUOffsetTRelativeSlot(3, comp_off, 0)
    if variadic_off is not None:
        b.PrependUOffsetTRelativeSlot(4, variadic_off, 0)
    return int(b.EndObject())


def encode_record_batch(
    length: int,
    nodes: npt.NDArray[np.int64],
    buffers: npt.NDArray[np.int64],
    body_length: int,
    compression: int | None = None,
    variadic_counts: list[int] | None = None,
) -> bytes:
    """A complete Message flatbuffer holding a RecordBatch header."""
    b = flatbuffers.Builder(64 + 32 * (len(nodes) + len(buffers)))
    rb = _record_batch_table(b, length, nodes, buffers, compression, variadic_counts)
    return build_message(b, HeaderType.RecordBatch, rb, body_length)


def encode_dictionary_batch(
    dict_id: int,
    is_delta: bool,
    length: int,
    nodes: npt.NDArray[np.int64],
    buffers: npt.NDArray[np.int64],
    body_length: int,
    compression: int | None = None,
    variadic_counts: list[int] | None = None,
) -> bytes:
    """A complete Message flatbuffer holding a DictionaryBatch header."""
    b = flatbuffers.Builder(64 + 32 * (len(nodes) + len(buffers)))
    rb = _record_batch_table(b, length, nodes, buffers, compression, variadic_counts)
    b.StartObject(3)
    b.PrependInt64Slot(0, dict_id, -1)
    b.PrependUOffsetTRelativeSlot(1, rb, 0)
    if is_delta:
        b.PrependBoolSlot(2, True, False)
    db = b.EndObject()
    return build_message(b, HeaderType.DictionaryBatch, db, body_length)
