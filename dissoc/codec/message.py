"""The Arrow ``Message`` flatbuffer: parsing its header, and building RecordBatch / DictionaryBatch messages.

:func:`parse` gives a :class:`ParsedMessage`: the Message's fields and, for batches, their RecordBatch header.

Vectors of structs (FieldNode, Buffer) are read and written in bulk with numpy.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dissoc.codec.fb import Table, root_table
from dissoc.errors import CodecError

__all__ = [
    "HeaderType",
    "MessageInfo",
    "MessageTemplate",
    "ParsedMessage",
    "RecordBatchHeader",
    "encode_dictionary_batch",
    "encode_record_batch",
    "message_template",
    "has_body",
    "parse",
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


@dataclass(slots=True)
class MessageInfo:
    """The fields of a Message table."""

    version: int
    header_type: int
    header: Table | None
    body_length: int


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


@dataclass(slots=True)
class ParsedMessage:
    """A parsed Message: its header fields, and for batches the nodes and buffers (offsets, lengths)."""

    info: MessageInfo
    batch: RecordBatchHeader | None = None
    dictionary_id: int | None = None
    is_delta: bool = False

    @property
    def header_type(self) -> int:
        return self.info.header_type

    @property
    def body_length(self) -> int:
        return self.info.body_length

    @property
    def has_body(self) -> bool:
        return self.info.header_type in (HeaderType.RecordBatch, HeaderType.DictionaryBatch)


def parse(metadata: object) -> ParsedMessage:
    """Parse a Message flatbuffer and, for batches, their RecordBatch header."""
    info = parse_message(metadata)
    assert info.header is not None
    if info.header_type == HeaderType.RecordBatch:
        return ParsedMessage(info, parse_record_batch(info.header))
    if info.header_type == HeaderType.DictionaryBatch:
        h = info.header
        data = h.table(1, "RecordBatch")
        if data is None:
            raise CodecError("DictionaryBatch: its RecordBatch (data) is missing")
        return ParsedMessage(
            info, parse_record_batch(data), h.scalar(0, "q", 0), bool(h.scalar(2, "?", False))
        )
    if info.header_type in (HeaderType.Tensor, HeaderType.SparseTensor):
        raise CodecError(
            f"unsupported message type {HeaderType(info.header_type).name}: not part of IPC streams"
        )
    return ParsedMessage(info)


# --------------------------------------------------------------------------------------------------- encode


_I32 = struct.Struct("<i")


class _Layout:
    """Writes one flatbuffer front to back; every offset points forward, vtables sit before their tables."""

    __slots__ = ("buf", "pos")

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
        self.pos = 0

    def align(self, alignment: int, remainder: int = 0) -> None:
        self.pos += (remainder - self.pos) % alignment

    def vtable(self, table_size: int, fields: list[int]) -> int:
        """A vtable with the given field offsets (0 = absent); returns its position."""
        self.align(2)
        at = self.pos
        struct.pack_into(f"<HH{len(fields)}H", self.buf, at, 4 + 2 * len(fields), table_size, *fields)
        self.pos += 4 + 2 * len(fields)
        return at

    def table(self, vtable: int, size: int) -> int:
        """Start a table of ``size`` bytes (8-byte aligned) using ``vtable``; returns its position."""
        self.align(8)
        at = self.pos
        _I32.pack_into(self.buf, at, at - vtable)
        self.pos += size
        return at

    def link(self, field: int, target: int) -> None:
        """Store at ``field`` the forward offset to ``target``."""
        _U32.pack_into(self.buf, field, target - field)

    def vector(self, data: bytes, count: int) -> int:
        """A vector of 8-byte-aligned elements: count at 4 mod 8, then the elements; returns its position."""
        self.align(8, 4)
        at = self.pos
        _U32.pack_into(self.buf, at, count)
        self.buf[at + 4 : at + 4 + len(data)] = data
        self.pos += 4 + len(data)
        return at


class MessageTemplate:
    """A RecordBatch (or DictionaryBatch) Message laid out once, whose numbers are filled in per message.

    Messages of one shape (header type, node count, buffer count, compression, variadic count) differ only in
    scalars and in the contents of their struct vectors, so :func:`_message_bytes` lays the shape out once
    with every field written (none is left to a default), and :meth:`fill` packs the bytes between the
    numbers as constants and the numbers of one message with a single ``struct.pack``.
    """

    __slots__ = ("_chunks", "_dictionary", "_plain", "_struct")

    def __init__(
        self,
        header_type: int,
        n_nodes: int,
        n_buffers: int,
        compression: int | None,
        n_variadic: int,
    ) -> None:
        dictionary = (0, False) if header_type == HeaderType.DictionaryBatch else None
        zeros = np.zeros((n_nodes, 2), np.int64)
        spans = np.zeros((n_buffers, 2), np.int64)
        variadic = [0] * n_variadic or None
        at: dict[str, int] = {}
        data = _message_bytes(header_type, 0, 0, zeros, spans, compression, variadic, dictionary, at)
        fields = [(at["body_length"], "q", 1)]
        if dictionary is not None:
            fields += [(at["dictionary"], "q", 1), (at["dictionary"] + 8, "B", 1)]
        fields += [
            (at["length"], "q", 1),
            (at["nodes"], "q", 2 * n_nodes),
            (at["buffers"], "q", 2 * n_buffers),
        ]
        if n_variadic:
            fields.append((at["variadic"], "q", n_variadic))
        fmt = ["<"]
        chunks = []
        prev = 0
        for pos, code, count in fields:
            if pos < prev:  # pragma: no cover - _message_bytes lays the numbers out in this order
                raise AssertionError("message template fields out of order")
            fmt.append(f"{pos - prev}s{count}{code}")
            chunks.append(data[prev:pos])
            prev = pos + count * struct.calcsize(code)
        fmt.append(f"{len(data) - prev}s")
        chunks.append(data[prev:])
        self._struct = struct.Struct("".join(fmt))
        self._chunks = tuple(chunks)
        self._dictionary = dictionary is not None
        self._plain = dictionary is None and not n_variadic

    def plain_parts(self) -> tuple[Callable[..., bytes], tuple[bytes, ...]]:
        """For a RecordBatch template without variadic counts: ``pack`` and the five constant ``chunks``,
        where ``pack(chunks[0], body_length, chunks[1], length, chunks[2], *nodes, chunks[3], *buffers,
        chunks[4])`` is what :meth:`fill` returns (for callers that write the numbers out themselves)."""
        if not self._plain:
            raise ValueError("only a RecordBatch template without variadic counts has plain parts")
        return self._struct.pack, self._chunks

    def fill(
        self,
        body_length: int,
        length: int,
        nodes: list[int] | npt.NDArray[np.int64],
        buffers: list[int] | npt.NDArray[np.int64],
        variadic_counts: list[int] | None = None,
        dictionary: tuple[int, bool] | None = None,
    ) -> bytes:
        """The Message with these numbers: ``nodes`` and ``buffers`` flat (length, null count, length, ...)
        and (offset, length, offset, ...) (or int64 arrays of shape (n, 2)); ``variadic_counts`` as many as
        the template has; ``dictionary`` (id, is delta) for a DictionaryBatch."""
        c = self._chunks
        if self._plain and not isinstance(nodes, list) and not isinstance(buffers, list):
            # Arrays (wide batches): their bytes as they are, between the constant chunks.
            return b"".join(
                (
                    c[0],
                    _I64.pack(body_length),
                    c[1],
                    _I64.pack(length),
                    c[2],
                    np.ascontiguousarray(nodes, "<i8").tobytes(),
                    c[3],
                    np.ascontiguousarray(buffers, "<i8").tobytes(),
                    c[4],
                )
            )
        if not isinstance(nodes, list):
            nodes = nodes.ravel().tolist()
        if not isinstance(buffers, list):
            buffers = buffers.ravel().tolist()
        if self._plain:
            return self._struct.pack(c[0], body_length, c[1], length, c[2], *nodes, c[3], *buffers, c[4])
        args: list[object] = [c[0], body_length]
        i = 1
        if self._dictionary:
            if dictionary is None:
                raise ValueError("a DictionaryBatch message needs its dictionary (id, is delta)")
            args += [c[1], dictionary[0], c[2], 1 if dictionary[1] else 0]
            i = 3
        args += [c[i], length, c[i + 1], *nodes, c[i + 2], *buffers]
        i += 3
        if variadic_counts:
            args += [c[i], *variadic_counts]
            i += 1
        args.append(c[i])
        return self._struct.pack(*args)


_TEMPLATES: dict[tuple[int, int, int, int | None, int], MessageTemplate] = {}


def message_template(
    header_type: int, n_nodes: int, n_buffers: int, compression: int | None = None, n_variadic: int = 0
) -> MessageTemplate:
    """The (cached) :class:`MessageTemplate` of one message shape."""
    key = (header_type, n_nodes, n_buffers, compression, n_variadic)
    t = _TEMPLATES.get(key)
    if t is None:
        if len(_TEMPLATES) >= 4096:
            _TEMPLATES.clear()
        t = _TEMPLATES[key] = MessageTemplate(header_type, n_nodes, n_buffers, compression, n_variadic)
    return t


def _message_bytes(
    header_type: int,
    body_length: int,
    length: int,
    nodes: npt.NDArray[np.int64],
    buffers: npt.NDArray[np.int64],
    compression: int | None,
    variadic_counts: list[int] | None,
    dictionary: tuple[int, bool] | None = None,
    positions: dict[str, int] | None = None,
) -> bytes:
    """A Message around a RecordBatch (or a DictionaryBatch holding one), laid out directly.

    Every field is written, defaults included; ``positions`` (when given) receives where the numbers went
    (``body_length``, ``length``, ``nodes``, ``buffers`` and, where present, ``variadic``, ``dictionary``).
    """
    where: dict[str, int] = {} if positions is None else positions
    node_bytes = np.ascontiguousarray(nodes, "<i8").tobytes()
    buffer_bytes = np.ascontiguousarray(buffers, "<i8").tobytes()
    variadic = np.asarray(variadic_counts or [], "<i8").tobytes()
    out = _Layout(256 + len(node_bytes) + len(buffer_bytes) + len(variadic))
    out.pos = 4  # the root offset
    # Message: header (uoffset) at 4, bodyLength at 8, version at 16, header_type at 18.
    message = out.table(out.vtable(20, [16, 18, 4, 8]), 20)
    out.link(0, message)
    _I64.pack_into(out.buf, message + 8, body_length)
    where["body_length"] = message + 8
    struct.pack_into("<hB", out.buf, message + 16, METADATA_V5, header_type)
    if dictionary is not None:
        # DictionaryBatch: data (uoffset) at 4, id at 8, isDelta at 16.
        dict_id, is_delta = dictionary
        header = out.table(out.vtable(24, [8, 4, 16]), 24)
        out.link(message + 4, header)
        _I64.pack_into(out.buf, header + 8, dict_id)
        where["dictionary"] = header + 8
        out.buf[header + 16] = 1 if is_delta else 0
        parent_field = header + 4
    else:
        parent_field = message + 4
    # RecordBatch: nodes at 4, length at 8, buffers at 16, compression at 20, variadicBufferCounts at 24.
    fields = [8, 4, 16, 20 if compression is not None else 0, 24 if variadic_counts else 0]
    batch = out.table(out.vtable(32, fields), 32)
    out.link(parent_field, batch)
    _I64.pack_into(out.buf, batch + 8, length)
    where["length"] = batch + 8
    if compression is not None:
        comp = out.table(out.vtable(8, [4, 5]), 8)
        out.buf[comp + 4] = compression
        out.buf[comp + 5] = 0  # method BUFFER
        out.link(batch + 20, comp)
    out.link(batch + 4, at := out.vector(node_bytes, len(nodes)))
    where["nodes"] = at + 4
    out.link(batch + 16, at := out.vector(buffer_bytes, len(buffers)))
    where["buffers"] = at + 4
    if variadic_counts:
        out.link(batch + 24, at := out.vector(variadic, len(variadic_counts)))
        where["variadic"] = at + 4
    out.align(8)
    return bytes(out.buf[: out.pos])


def encode_record_batch(
    length: int,
    nodes: npt.NDArray[np.int64],
    buffers: npt.NDArray[np.int64],
    body_length: int,
    compression: int | None = None,
    variadic_counts: list[int] | None = None,
) -> bytes:
    """A complete Message flatbuffer holding a RecordBatch header."""
    return _message_bytes(
        HeaderType.RecordBatch, body_length, length, nodes, buffers, compression, variadic_counts
    )


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
    return _message_bytes(
        HeaderType.DictionaryBatch,
        body_length,
        length,
        nodes,
        buffers,
        compression,
        variadic_counts,
        (dict_id, is_delta),
    )
