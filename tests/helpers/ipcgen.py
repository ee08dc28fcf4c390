"""Hand-built Arrow IPC messages, valid or deliberately malformed, for the codec tests.

Everything is written with the ``flatbuffers`` runtime ``Builder`` straight from the field ids in
spec/FACTS.md section 1, so a test controls every number that goes on the wire (node counts, buffer
offsets, type parameters, endianness, compression codecs, footer blocks). Nothing here imports dissoc.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import flatbuffers
from flatbuffers.builder import Builder

CONTINUATION = b"\xff\xff\xff\xff"
EOS = CONTINUATION + b"\x00\x00\x00\x00"
FILE_MAGIC = b"ARROW1"


class Header:
    NONE = 0
    SCHEMA = 1
    DICTIONARY_BATCH = 2
    RECORD_BATCH = 3
    TENSOR = 4
    SPARSE_TENSOR = 5


class TypeId:
    NONE = 0
    NULL = 1
    INT = 2
    FLOATING_POINT = 3
    BINARY = 4
    UTF8 = 5
    BOOL = 6
    DECIMAL = 7
    DATE = 8
    TIME = 9
    TIMESTAMP = 10
    INTERVAL = 11
    LIST = 12
    STRUCT = 13
    UNION = 14
    FIXED_SIZE_BINARY = 15
    FIXED_SIZE_LIST = 16
    MAP = 17
    DURATION = 18
    LARGE_BINARY = 19
    LARGE_UTF8 = 20
    LARGE_LIST = 21
    RUN_END_ENCODED = 22
    BINARY_VIEW = 23
    UTF8_VIEW = 24
    LIST_VIEW = 25
    LARGE_LIST_VIEW = 26


V4 = 3
V5 = 4
LZ4_FRAME = 0
ZSTD = 1


# --------------------------------------------------------------------------------------------------
# Descriptions


@dataclass(frozen=True, eq=False)
class TypeSpec:
    """A Type union member: its id plus the scalar slots of its table.

    ``scalars`` holds ``(slot, kind, value)`` with kind one of ``b B h i q ?`` (struct module letters).
    """

    type_id: int
    scalars: tuple[tuple[int, str, int | bool], ...] = ()
    timezone: str | None = None  # Timestamp slot 1
    union_type_ids: tuple[int, ...] | None = None  # Union slot 1


@dataclass(frozen=True, eq=False)
class DictSpec:
    id: int
    index_bits: int = 32
    index_signed: bool = True
    ordered: bool = False
    omit_index_type: bool = False


@dataclass(frozen=True, eq=False)
class FieldSpec:
    name: str | None
    type: TypeSpec
    nullable: bool = True
    children: tuple[FieldSpec, ...] = ()
    dictionary: DictSpec | None = None
    metadata: tuple[tuple[str, str], ...] = field(default=())


def null() -> TypeSpec:
    return TypeSpec(TypeId.NULL)


def int_(bits: int = 32, signed: bool = True) -> TypeSpec:
    return TypeSpec(TypeId.INT, ((0, "i", bits), (1, "?", signed)))


def float_(precision: int = 2) -> TypeSpec:
    return TypeSpec(TypeId.FLOATING_POINT, ((0, "h", precision),))


def bool_() -> TypeSpec:
    return TypeSpec(TypeId.BOOL)


def utf8() -> TypeSpec:
    return TypeSpec(TypeId.UTF8)


def binary() -> TypeSpec:
    return TypeSpec(TypeId.BINARY)


def utf8_view() -> TypeSpec:
    return TypeSpec(TypeId.UTF8_VIEW)


def decimal(precision: int, scale: int, bit_width: int = 128) -> TypeSpec:
    return TypeSpec(TypeId.DECIMAL, ((0, "i", precision), (1, "i", scale), (2, "i", bit_width)))


def interval(unit: int) -> TypeSpec:
    return TypeSpec(TypeId.INTERVAL, ((0, "h", unit),))


def timestamp(unit: int, tz: str | None = None) -> TypeSpec:
    return TypeSpec(TypeId.TIMESTAMP, ((0, "h", unit),), timezone=tz)


def time_(unit: int, bit_width: int) -> TypeSpec:
    return TypeSpec(TypeId.TIME, ((0, "h", unit), (1, "i", bit_width)))


def date(unit: int) -> TypeSpec:
    return TypeSpec(TypeId.DATE, ((0, "h", unit),))


def fixed_size_binary(width: int) -> TypeSpec:
    return TypeSpec(TypeId.FIXED_SIZE_BINARY, ((0, "i", width),))


def list_() -> TypeSpec:
    return TypeSpec(TypeId.LIST)


def large_list() -> TypeSpec:
    return TypeSpec(TypeId.LARGE_LIST)


def fixed_size_list(size: int) -> TypeSpec:
    return TypeSpec(TypeId.FIXED_SIZE_LIST, ((0, "i", size),))


def struct_() -> TypeSpec:
    return TypeSpec(TypeId.STRUCT)


def map_(keys_sorted: bool = False) -> TypeSpec:
    return TypeSpec(TypeId.MAP, ((0, "?", keys_sorted),))


def union(mode: int, type_ids: Sequence[int] | None) -> TypeSpec:
    return TypeSpec(
        TypeId.UNION, ((0, "h", mode),), union_type_ids=None if type_ids is None else tuple(type_ids)
    )


def run_end_encoded() -> TypeSpec:
    return TypeSpec(TypeId.RUN_END_ENCODED)


def raw_type(type_id: int) -> TypeSpec:
    """A type union member with an empty table (for unknown type ids)."""
    return TypeSpec(type_id)


# --------------------------------------------------------------------------------------------------
# Flatbuffers writing


_PREPEND_SLOT = {
    "b": Builder.PrependInt8Slot,
    "B": Builder.PrependUint8Slot,
    "h": Builder.PrependInt16Slot,
    "i": Builder.PrependInt32Slot,
    "q": Builder.PrependInt64Slot,
    "?": Builder.PrependBoolSlot,
}


def _builder() -> Builder:
    b = flatbuffers.Builder(1024)
    b.ForceDefaults(True)
    return b


def _key_values(b: Builder, items: Sequence[tuple[str, str]]) -> int | None:
    if not items:
        return None
    offsets = []
    for key, value in items:
        k = b.CreateString(key)
        v = b.CreateString(value)
        b.StartObject(2)
        b.PrependUOffsetTRelativeSlot(0, k, 0)
        b.PrependUOffsetTRelativeSlot(1, v, 0)
        offsets.append(b.EndObject())
    return _offset_vector(b, offsets)


def _offset_vector(b: Builder, offsets: Sequence[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return int(b.EndVector())


def _scalar_vector(b: Builder, kind: str, values: Sequence[int]) -> int:
    size = struct.calcsize(kind)
    b.StartVector(size, len(values), size)
    prepend = {"i": b.PrependInt32, "q": b.PrependInt64}[kind]
    for v in reversed(values):
        prepend(v)
    return int(b.EndVector())


def _type_table(b: Builder, t: TypeSpec) -> int:
    tz = b.CreateString(t.timezone) if t.timezone is not None else None
    ids = _scalar_vector(b, "i", t.union_type_ids) if t.union_type_ids is not None else None
    nslots = max([s for s, _, _ in t.scalars] + [1 if (tz is not None or ids is not None) else -1]) + 1
    b.StartObject(max(nslots, 0))
    for slot, kind, value in t.scalars:
        _PREPEND_SLOT[kind](b, slot, value, 0)
    if tz is not None:
        b.PrependUOffsetTRelativeSlot(1, tz, 0)
    if ids is not None:
        b.PrependUOffsetTRelativeSlot(1, ids, 0)
    return int(b.EndObject())


def _dictionary_encoding(b: Builder, d: DictSpec) -> int:
    index = None
    if not d.omit_index_type:
        index = _type_table(b, int_(d.index_bits, d.index_signed))
    b.StartObject(4)
    b.PrependInt64Slot(0, d.id, 0)
    if index is not None:
        b.PrependUOffsetTRelativeSlot(1, index, 0)
    b.PrependBoolSlot(2, d.ordered, False)
    b.PrependInt16Slot(3, 0, 0)
    return int(b.EndObject())


def _fields(b: Builder, fields: Sequence[FieldSpec]) -> list[int]:
    """Write fields bottom-up without Python recursion (schemas may be nested 10,000 deep)."""
    built: dict[int, int] = {}
    stack: list[tuple[FieldSpec, bool]] = [(f, False) for f in reversed(fields)]
    while stack:
        f, children_done = stack.pop()
        if id(f) in built:
            continue
        if not children_done:
            stack.append((f, True))
            stack.extend((c, False) for c in reversed(f.children) if id(c) not in built)
            continue
        children = _offset_vector(b, [built[id(c)] for c in f.children])
        name = b.CreateString(f.name) if f.name is not None else None
        type_table = _type_table(b, f.type)
        dictionary = _dictionary_encoding(b, f.dictionary) if f.dictionary is not None else None
        metadata = _key_values(b, f.metadata)
        b.StartObject(7)
        if name is not None:
            b.PrependUOffsetTRelativeSlot(0, name, 0)
        b.PrependBoolSlot(1, f.nullable, False)
        b.PrependUint8Slot(2, f.type.type_id, 0)
        b.PrependUOffsetTRelativeSlot(3, type_table, 0)
        if dictionary is not None:
            b.PrependUOffsetTRelativeSlot(4, dictionary, 0)
        b.PrependUOffsetTRelativeSlot(5, children, 0)
        if metadata is not None:
            b.PrependUOffsetTRelativeSlot(6, metadata, 0)
        built[id(f)] = int(b.EndObject())
    return [built[id(f)] for f in fields]


def _schema_table(
    b: Builder,
    fields: Sequence[FieldSpec],
    endianness: int,
    metadata: Sequence[tuple[str, str]],
    features: Sequence[int] | None,
) -> int:
    field_vec = _offset_vector(b, _fields(b, fields))
    md = _key_values(b, metadata)
    feats = _scalar_vector(b, "q", features) if features is not None else None
    b.StartObject(4)
    b.PrependInt16Slot(0, endianness, 0)
    b.PrependUOffsetTRelativeSlot(1, field_vec, 0)
    if md is not None:
        b.PrependUOffsetTRelativeSlot(2, md, 0)
    if feats is not None:
        b.PrependUOffsetTRelativeSlot(3, feats, 0)
    return int(b.EndObject())


def _struct_vector(b: Builder, rows: Sequence[tuple[int, int]]) -> int:
    b.StartVector(16, len(rows), 8)
    for first, second in reversed(rows):
        b.Prep(8, 16)
        b.PrependInt64(second)
        b.PrependInt64(first)
    return int(b.EndVector())


def _record_batch_table(
    b: Builder,
    length: int,
    nodes: Sequence[tuple[int, int]],
    buffers: Sequence[tuple[int, int]],
    compression: tuple[int, int] | None,
    variadic: Sequence[int] | None,
) -> int:
    node_vec = _struct_vector(b, nodes)
    buf_vec = _struct_vector(b, buffers)
    comp = None
    if compression is not None:
        b.StartObject(2)
        b.PrependInt8Slot(0, compression[0], 0)
        b.PrependInt8Slot(1, compression[1], 0)
        comp = b.EndObject()
    var = _scalar_vector(b, "q", variadic) if variadic is not None else None
    b.StartObject(5)
    b.PrependInt64Slot(0, length, 0)
    b.PrependUOffsetTRelativeSlot(1, node_vec, 0)
    b.PrependUOffsetTRelativeSlot(2, buf_vec, 0)
    if comp is not None:
        b.PrependUOffsetTRelativeSlot(3, comp, 0)
    if var is not None:
        b.PrependUOffsetTRelativeSlot(4, var, 0)
    return int(b.EndObject())


def _message(b: Builder, header_type: int, header: int | None, body_length: int, version: int) -> bytes:
    b.StartObject(5)
    b.PrependInt16Slot(0, version, 0)
    b.PrependUint8Slot(1, header_type, 0)
    if header is not None:
        b.PrependUOffsetTRelativeSlot(2, header, 0)
    b.PrependInt64Slot(3, body_length, 0)
    b.Finish(b.EndObject())
    return bytes(b.Output())


# --------------------------------------------------------------------------------------------------
# Public builders


def schema_message(
    fields: Sequence[FieldSpec],
    *,
    endianness: int = 0,
    metadata: Sequence[tuple[str, str]] = (),
    features: Sequence[int] | None = None,
    version: int = V5,
) -> bytes:
    b = _builder()
    schema = _schema_table(b, fields, endianness, metadata, features)
    return _message(b, Header.SCHEMA, schema, 0, version)


def record_batch_message(
    length: int,
    nodes: Sequence[tuple[int, int]],
    buffers: Sequence[tuple[int, int]],
    *,
    body_length: int,
    compression: tuple[int, int] | None = None,
    variadic: Sequence[int] | None = None,
    version: int = V5,
) -> bytes:
    b = _builder()
    rb = _record_batch_table(b, length, nodes, buffers, compression, variadic)
    return _message(b, Header.RECORD_BATCH, rb, body_length, version)


def dictionary_message(
    dict_id: int,
    length: int,
    nodes: Sequence[tuple[int, int]],
    buffers: Sequence[tuple[int, int]],
    *,
    body_length: int,
    is_delta: bool = False,
    compression: tuple[int, int] | None = None,
    variadic: Sequence[int] | None = None,
    version: int = V5,
) -> bytes:
    b = _builder()
    rb = _record_batch_table(b, length, nodes, buffers, compression, variadic)
    b.StartObject(3)
    b.PrependInt64Slot(0, dict_id, 0)
    b.PrependUOffsetTRelativeSlot(1, rb, 0)
    b.PrependBoolSlot(2, is_delta, False)
    db = b.EndObject()
    return _message(b, Header.DICTIONARY_BATCH, db, body_length, version)


def bare_message(
    header_type: int, *, body_length: int = 0, version: int = V5, empty_header: bool = True
) -> bytes:
    """A Message whose header is an empty table (or absent): for unknown or unsupported header types."""
    b = _builder()
    header = None
    if empty_header:
        b.StartObject(0)
        header = b.EndObject()
    return _message(b, header_type, header, body_length, version)


def pad8(n: int) -> int:
    return (n + 7) & ~7


def body(*buffers: bytes) -> tuple[bytes, list[tuple[int, int]]]:
    """Lay buffers out one after another, each padded to 8 bytes; return the body and (offset, length)s."""
    out = bytearray()
    spans = []
    for buf in buffers:
        spans.append((len(out), len(buf)))
        out += buf
        out += b"\x00" * (pad8(len(out)) - len(out))
    return bytes(out), spans


def frame(metadata: bytes, body_bytes: bytes = b"", *, legacy: bool = False) -> bytes:
    """An encapsulated message: [continuation] int32 size, metadata padded to 8 bytes, body."""
    prefix_len = 4 if legacy else 8
    padded = pad8(prefix_len + len(metadata)) - prefix_len
    md = metadata + b"\x00" * (padded - len(metadata))
    head = (b"" if legacy else CONTINUATION) + struct.pack("<i", len(md))
    return head + md + body_bytes


def stream(*messages: tuple[bytes, bytes], eos: bool = True) -> bytes:
    return b"".join(frame(m, bd) for m, bd in messages) + (EOS if eos else b"")


@dataclass
class Block:
    offset: int
    metadata_length: int
    body_length: int


def footer(
    fields: Sequence[FieldSpec],
    dictionaries: Sequence[Block],
    record_batches: Sequence[Block],
    *,
    version: int = V5,
) -> bytes:
    b = _builder()
    schema = _schema_table(b, fields, 0, (), None)

    def blocks(items: Sequence[Block]) -> int:
        b.StartVector(24, len(items), 8)
        for blk in reversed(items):
            b.Prep(8, 24)
            b.PrependInt64(blk.body_length)
            b.Pad(4)
            b.PrependInt32(blk.metadata_length)
            b.PrependInt64(blk.offset)
        return int(b.EndVector())

    dvec = blocks(dictionaries)
    rvec = blocks(record_batches)
    b.StartObject(5)
    b.PrependInt16Slot(0, version, 0)
    b.PrependUOffsetTRelativeSlot(1, schema, 0)
    b.PrependUOffsetTRelativeSlot(2, dvec, 0)
    b.PrependUOffsetTRelativeSlot(3, rvec, 0)
    b.Finish(b.EndObject())
    return bytes(b.Output())


def file(
    fields: Sequence[FieldSpec],
    dictionaries: Sequence[tuple[bytes, bytes]],
    record_batches: Sequence[tuple[bytes, bytes]],
    *,
    schema_metadata: bytes | None = None,
) -> tuple[bytes, list[Block], list[Block]]:
    """A whole IPC file; returns it with the blocks written into its footer."""
    out = bytearray(FILE_MAGIC + b"\x00\x00")
    out += frame(schema_metadata if schema_metadata is not None else schema_message(fields))
    dblocks: list[Block] = []
    rblocks: list[Block] = []
    for target, msgs in ((dblocks, dictionaries), (rblocks, record_batches)):
        for md, bd in msgs:
            framed = frame(md, bd)
            target.append(Block(len(out), len(framed) - len(bd), len(bd)))
            out += framed
    out += EOS
    foot = footer(fields, dblocks, rblocks)
    out += foot + struct.pack("<i", len(foot)) + FILE_MAGIC
    return bytes(out), dblocks, rblocks


def file_from_footer(prefix: bytes, foot: bytes) -> bytes:
    """Append a (possibly bad) footer to the leading part of a file."""
    return prefix + foot + struct.pack("<i", len(foot)) + FILE_MAGIC
