"""Schema and Field flatbuffers <-> ``pyarrow.Schema``, and the per-field layout plans the body codec uses.

A *plan* (:class:`FieldPlan`) is the schema compiled once into what decoding and encoding a body needs: for
every field node, in the IPC's depth-first order, its layout (which buffers, of which widths), its children.
Dictionary-encoded fields carry the index layout; the dictionary's own value layout is a separate plan kept in
:class:`DictionaryInfo`, because its data arrives in DictionaryBatch messages.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import flatbuffers
import pyarrow as pa

from dissoc.codec.fb import Table
from dissoc.errors import CodecError

__all__ = [
    "DictionaryInfo",
    "FieldPlan",
    "Layout",
    "MAX_NESTING",
    "SchemaInfo",
    "decode_schema",
    "encode_schema",
    "map_type",
]

MAX_NESTING = 64
SWAP_REVERSE = -1  # byte-swap a whole element (decimals)
SWAP_MONTH_DAY_NANO = -2  # int32 months, int32 days, int64 nanoseconds
EXTENSION_NAME = "ARROW:extension:name"
EXTENSION_METADATA = "ARROW:extension:metadata"


class T(enum.IntEnum):
    """The flatbuffers ``Type`` union tags."""

    NONE = 0
    Null = 1
    Int = 2
    FloatingPoint = 3
    Binary = 4
    Utf8 = 5
    Bool = 6
    Decimal = 7
    Date = 8
    Time = 9
    Timestamp = 10
    Interval = 11
    List = 12
    Struct = 13
    Union = 14
    FixedSizeBinary = 15
    FixedSizeList = 16
    Map = 17
    Duration = 18
    LargeBinary = 19
    LargeUtf8 = 20
    LargeList = 21
    RunEndEncoded = 22
    BinaryView = 23
    Utf8View = 24
    ListView = 25
    LargeListView = 26


class Layout(enum.IntEnum):
    """How a node's buffers are laid out (IPC order; their roles and sizes: :mod:`dissoc.codec.sizes`)."""

    NULL = 0  # no buffers
    BOOL = 1  # validity, bits
    FIXED = 2  # validity, values (width bytes each)
    BINARY = 3  # validity, int32 offsets, data
    LARGE_BINARY = 4  # validity, int64 offsets, data
    VIEW = 5  # validity, views, variadic data buffers
    LIST = 6  # validity, int32 offsets; 1 child (also Map)
    LARGE_LIST = 7  # validity, int64 offsets; 1 child
    LIST_VIEW = 8  # validity, int32 offsets, int32 sizes; 1 child
    LARGE_LIST_VIEW = 9  # validity, int64 offsets, int64 sizes; 1 child
    FIXED_LIST = 10  # validity; 1 child
    STRUCT = 11  # validity; n children
    SPARSE_UNION = 12  # type ids; n children
    DENSE_UNION = 13  # type ids, int32 offsets; n children
    RUN_END = 14  # no buffers; 2 children


@dataclass(eq=False, slots=True)
class FieldPlan:
    """One node of the compiled schema (see the module docstring)."""

    field: pa.Field
    layout: Layout
    width: int = 0  # byte width of FIXED values (index width for dictionary-encoded fields)
    children: list[FieldPlan] = field(default_factory=list)
    dict_id: int = -1
    swap_width: int = 0  # element width for big-endian byte swapping of the values buffer


@dataclass(eq=False, slots=True)
class DictionaryInfo:
    """What a dictionary id stands for: the value type and its layout plan."""

    id: int
    value_plan: FieldPlan
    index_type: pa.DataType
    ordered: bool


@dataclass(eq=False, slots=True)
class SchemaInfo:
    """A decoded schema: pyarrow's view of it plus the plans."""

    schema: pa.Schema
    plans: list[FieldPlan]
    dictionaries: dict[int, DictionaryInfo]
    big_endian: bool = False
    features: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------- decode


_TIME_UNITS = {0: "s", 1: "ms", 2: "us", 3: "ns"}
_UNIT_CODES = {v: k for k, v in _TIME_UNITS.items()}

_interval_types: dict[int, pa.DataType] = {}


def _interval_type(unit: int) -> pa.DataType:
    """pyarrow has no factories for month and day-time intervals; ask its IPC reader for the type once."""
    if unit == 2:
        return pa.month_day_nano_interval()
    if unit not in _interval_types:
        b = flatbuffers.Builder(128)
        b.StartObject(1)
        b.PrependInt16Slot(0, unit, 0)
        itab = b.EndObject()
        name = b.CreateString("x")
        b.StartObject(7)
        b.PrependUOffsetTRelativeSlot(0, name, 0)
        b.PrependBoolSlot(1, True, False)
        b.PrependUint8Slot(2, T.Interval, 0)
        b.PrependUOffsetTRelativeSlot(3, itab, 0)
        fld = b.EndObject()
        b.StartVector(4, 1, 4)
        b.PrependUOffsetTRelative(fld)
        fields = b.EndVector()
        b.StartObject(4)
        b.PrependUOffsetTRelativeSlot(1, fields, 0)
        sch = b.EndObject()
        b.Finish(_message(b, 1, sch, 0))
        _interval_types[unit] = pa.ipc.read_schema(pa.py_buffer(_frame(bytes(b.Output())))).field(0).type
    return _interval_types[unit]


def _message(b: flatbuffers.Builder, header_type: int, header: int, body_length: int) -> int:
    b.StartObject(5)
    b.PrependInt64Slot(3, body_length, 0)
    b.PrependUOffsetTRelativeSlot(2, header, 0)
    b.PrependInt16Slot(0, 4, 0)
    b.PrependUint8Slot(1, header_type, 0)
    return int(b.EndObject())


def _frame(meta: bytes) -> bytes:
    pad = (-len(meta)) % 8
    return b"\xff\xff\xff\xff" + (len(meta) + pad).to_bytes(4, "little") + meta + b"\x00" * pad


def _key_values(t: Table, fid: int) -> dict[bytes, bytes] | None:
    kvs = t.tables(fid, "KeyValue")
    if not kvs:
        return None
    out: dict[bytes, bytes] = {}
    for kv in kvs:
        k = kv.string(0) or ""
        v = kv.string(1) or ""
        out[k.encode()] = v.encode()
    return out


def _int_type(bit_width: int, signed: bool, what: str) -> pa.DataType:
    table = {
        (8, True): pa.int8(),
        (16, True): pa.int16(),
        (32, True): pa.int32(),
        (64, True): pa.int64(),
        (8, False): pa.uint8(),
        (16, False): pa.uint16(),
        (32, False): pa.uint32(),
        (64, False): pa.uint64(),
    }
    try:
        return table[(bit_width, signed)]
    except KeyError:
        raise CodecError(f"{what}: Int bitWidth must be 8, 16, 32 or 64, got {bit_width}") from None


class _SchemaDecoder:
    def __init__(self) -> None:
        self.dictionaries: dict[int, DictionaryInfo] = {}
        self.nodes = 0
        self.seen: set[int] = set()

    def field(self, t: Table, depth: int) -> FieldPlan:
        try:
            return self._field(t, depth)
        except CodecError:
            raise
        except (pa.ArrowException, ValueError, TypeError, OverflowError) as e:
            raise CodecError(f"invalid field: {e}") from None

    def _field(self, t: Table, depth: int) -> FieldPlan:
        # A writer never shares one Field table between two places; following shared tables would let a few
        # bytes of metadata describe exponentially many fields.
        if t._pos in self.seen:
            raise CodecError(f"schema: Field table at {t._pos} is referenced twice")
        self.seen.add(t._pos)
        if depth > MAX_NESTING:
            raise CodecError(f"Field nesting deeper than {MAX_NESTING} levels")
        self.nodes += 1
        if self.nodes > 1_000_000:
            raise CodecError("schema has more than 1,000,000 fields")
        name = t.string(0) or ""
        nullable = bool(t.scalar(1, "?", False))
        type_id, type_table = t.union(2, "Field.type")
        child_tables = t.tables(5, "Field")
        children = [self.field(c, depth + 1) for c in child_tables]
        meta = _key_values(t, 6)
        where = f"field {name!r}"
        value_type, layout, width, swap = self._type(type_id, type_table, children, where)
        ext_type = None
        if meta and EXTENSION_NAME.encode() in meta:
            ext_type, meta = _resolve_extension(name, value_type, nullable, meta)
        dict_table = t.table(4, "DictionaryEncoding")
        if dict_table is not None:
            value_field = pa.field(name, ext_type or value_type, nullable)
            value_plan = FieldPlan(value_field, layout, width, children, -1, swap)
            dict_id = dict_table.scalar(0, "q", 0)
            index_table = dict_table.table(1, "Int")
            if index_table is None:
                index_type = pa.int32()
            else:
                index_type = _int_type(
                    index_table.scalar(0, "i", 0), bool(index_table.scalar(1, "?", False)), where
                )
            ordered = bool(dict_table.scalar(2, "?", False))
            info = DictionaryInfo(dict_id, value_plan, index_type, ordered)
            prev = self.dictionaries.get(dict_id)
            if prev is not None and not prev.value_plan.field.type.equals(value_plan.field.type):
                raise CodecError(
                    f"dictionary id {dict_id} is used with value types {prev.value_plan.field.type} "
                    f"and {value_plan.field.type}"
                )
            self.dictionaries.setdefault(dict_id, info)
            try:
                dtype = pa.dictionary(index_type, value_field.type, ordered)
            except (pa.ArrowException, TypeError, ValueError) as e:
                raise CodecError(f"{where}: invalid dictionary encoding: {e}") from None
            f = pa.field(name, dtype, nullable, meta)
            iw = index_type.bit_width // 8
            return FieldPlan(f, Layout.FIXED, iw, [], dict_id, iw)
        f = pa.field(name, ext_type or value_type, nullable, meta)
        return FieldPlan(f, layout, width, children, -1, swap)

    def _type(
        self, tid: int, tt: Table | None, children: list[FieldPlan], where: str
    ) -> tuple[pa.DataType, Layout, int, int]:
        """(pyarrow type, layout, value width, byte-swap width) of a Type union value."""

        def need(n: int) -> None:
            if len(children) != n:
                raise CodecError(f"{where}: type {_type_name(tid)} needs {n} children, got {len(children)}")

        def scalar(fid: int, fmt: str, default: int) -> int:
            return default if tt is None else tt.scalar(fid, fmt, default)

        if tid not in (
            T.Struct,
            T.Union,
            T.List,
            T.LargeList,
            T.FixedSizeList,
            T.Map,
            T.RunEndEncoded,
            T.ListView,
            T.LargeListView,
        ):
            need(0)
        try:
            return self._type_inner(tid, tt, children, where, need, scalar)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            if isinstance(e, CodecError):
                raise
            raise CodecError(f"{where}: invalid {_type_name(tid)} type: {e}") from None

    def _type_inner(
        self,
        tid: int,
        tt: Table | None,
        children: list[FieldPlan],
        where: str,
        need: Callable[[int], None],
        scalar: Callable[[int, str, int], int],
    ) -> tuple[pa.DataType, Layout, int, int]:
        if tid == T.Null:
            return pa.null(), Layout.NULL, 0, 0
        if tid == T.Int:
            bw = scalar(0, "i", 0)
            ty = _int_type(bw, bool(scalar(1, "?", 0)), where)
            return ty, Layout.FIXED, bw // 8, bw // 8
        if tid == T.FloatingPoint:
            prec = scalar(0, "h", 0)
            if prec not in (0, 1, 2):
                raise CodecError(f"{where}: FloatingPoint precision must be 0, 1 or 2, got {prec}")
            w = (2, 4, 8)[prec]
            return (pa.float16(), pa.float32(), pa.float64())[prec], Layout.FIXED, w, w
        if tid == T.Binary:
            return pa.binary(), Layout.BINARY, 0, 0
        if tid == T.Utf8:
            return pa.string(), Layout.BINARY, 0, 0
        if tid == T.LargeBinary:
            return pa.large_binary(), Layout.LARGE_BINARY, 0, 0
        if tid == T.LargeUtf8:
            return pa.large_string(), Layout.LARGE_BINARY, 0, 0
        if tid == T.BinaryView:
            return pa.binary_view(), Layout.VIEW, 16, 0
        if tid == T.Utf8View:
            return pa.string_view(), Layout.VIEW, 16, 0
        if tid == T.Bool:
            return pa.bool_(), Layout.BOOL, 0, 0
        if tid == T.Decimal:
            precision, scale, bw = scalar(0, "i", 0), scalar(1, "i", 0), scalar(2, "i", 128)
            factories = {32: pa.decimal32, 64: pa.decimal64, 128: pa.decimal128, 256: pa.decimal256}
            if bw not in factories:
                raise CodecError(f"{where}: Decimal bitWidth must be 32, 64, 128 or 256, got {bw}")
            return factories[bw](precision, scale), Layout.FIXED, bw // 8, SWAP_REVERSE
        if tid == T.Date:
            unit = scalar(0, "h", 1)
            if unit == 0:
                return pa.date32(), Layout.FIXED, 4, 4
            if unit == 1:
                return pa.date64(), Layout.FIXED, 8, 8
            raise CodecError(f"{where}: Date unit must be 0 (DAY) or 1 (MILLISECOND), got {unit}")
        if tid == T.Time:
            unit, bw = scalar(0, "h", 1), scalar(1, "i", 32)
            if (unit, bw) in ((0, 32), (1, 32)):
                return pa.time32(_TIME_UNITS[unit]), Layout.FIXED, 4, 4
            if (unit, bw) in ((2, 64), (3, 64)):
                return pa.time64(_TIME_UNITS[unit]), Layout.FIXED, 8, 8
            raise CodecError(f"{where}: Time with unit {unit} and bitWidth {bw} is not a valid combination")
        if tid == T.Timestamp:
            unit = scalar(0, "h", 0)
            if unit not in _TIME_UNITS:
                raise CodecError(f"{where}: TimeUnit must be 0..3, got {unit}")
            tz = tt.string(1) if tt is not None else None
            return pa.timestamp(_TIME_UNITS[unit], tz), Layout.FIXED, 8, 8
        if tid == T.Duration:
            unit = scalar(0, "h", 1)
            if unit not in _TIME_UNITS:
                raise CodecError(f"{where}: TimeUnit must be 0..3, got {unit}")
            return pa.duration(_TIME_UNITS[unit]), Layout.FIXED, 8, 8
        if tid == T.Interval:
            unit = scalar(0, "h", 0)
            if unit == 0:
                return _interval_type(0), Layout.FIXED, 4, 4
            if unit == 1:
                return _interval_type(1), Layout.FIXED, 8, 4
            if unit == 2:
                return _interval_type(2), Layout.FIXED, 16, SWAP_MONTH_DAY_NANO
            raise CodecError(f"{where}: Interval unit must be 0, 1 or 2, got {unit}")
        if tid == T.FixedSizeBinary:
            bw = scalar(0, "i", 0)
            if bw < 0:
                raise CodecError(f"{where}: FixedSizeBinary byteWidth must be >= 0, got {bw}")
            return pa.binary(bw), Layout.FIXED, bw, 0
        if tid in (T.List, T.LargeList, T.ListView, T.LargeListView):
            need(1)
            child = children[0].field
            factory, layout = {
                T.List: (pa.list_, Layout.LIST),
                T.LargeList: (pa.large_list, Layout.LARGE_LIST),
                T.ListView: (pa.list_view, Layout.LIST_VIEW),
                T.LargeListView: (pa.large_list_view, Layout.LARGE_LIST_VIEW),
            }[T(tid)]
            return factory(child), layout, 0, 0
        if tid == T.FixedSizeList:
            need(1)
            size = scalar(0, "i", 0)
            if size < 0:
                raise CodecError(f"{where}: FixedSizeList listSize must be >= 0, got {size}")
            return pa.list_(children[0].field, size), Layout.FIXED_LIST, 0, 0
        if tid == T.Struct:
            return pa.struct([c.field for c in children]), Layout.STRUCT, 0, 0
        if tid == T.Map:
            need(1)
            entries = children[0]
            if entries.layout != Layout.STRUCT or len(entries.children) != 2:
                raise CodecError(
                    f"{where}: Map's child must be a struct of two fields, got {entries.field.type}"
                )
            if entries.field.nullable:
                raise CodecError(f"{where}: Map's entries field must not be nullable")
            key, item = entries.children
            sorted_ = bool(scalar(0, "?", 0))
            # pyarrow's reader gives map fields their canonical names; so do we.
            ty = pa.map_(
                pa.field("key", key.field.type, False, key.field.metadata),
                pa.field("value", item.field.type, item.field.nullable, item.field.metadata),
                sorted_,
            )
            return ty, Layout.LIST, 0, 0
        if tid == T.Union:
            mode = scalar(0, "h", 0)
            if mode not in (0, 1):
                raise CodecError(f"{where}: Union mode must be 0 (Sparse) or 1 (Dense), got {mode}")
            raw = tt.vector_bytes(1, 4) if tt is not None else None
            codes = list(memoryview(raw).cast("i")) if raw is not None else list(range(len(children)))
            if len(codes) != len(children):
                raise CodecError(f"{where}: Union has {len(children)} children but {len(codes)} typeIds")
            if any(c < 0 or c > 127 for c in codes) or len(set(codes)) != len(codes):
                raise CodecError(f"{where}: Union typeIds must be distinct values in 0..127, got {codes}")
            ty = pa.union([c.field for c in children], "dense" if mode else "sparse", codes)
            return ty, (Layout.DENSE_UNION if mode else Layout.SPARSE_UNION), 0, 0
        if tid == T.RunEndEncoded:
            need(2)
            re, values = children
            if re.field.type not in (pa.int16(), pa.int32(), pa.int64()) or re.dict_id >= 0:
                raise CodecError(f"{where}: run ends must be int16, int32 or int64, got {re.field.type}")
            if re.field.nullable:
                raise CodecError(f"{where}: run ends must not be nullable")
            return pa.run_end_encoded(re.field.type, values.field.type), Layout.RUN_END, 0, 0
        raise CodecError(f"{where}: unsupported type id {tid} ({_type_name(tid)})")


def _type_name(tid: int) -> str:
    try:
        return T(tid).name
    except ValueError:
        return "unknown"


def _resolve_extension(
    name: str, storage: pa.DataType, nullable: bool, meta: dict[bytes, bytes]
) -> tuple[pa.DataType | None, dict[bytes, bytes] | None]:
    """Storage type + ``ARROW:extension:*`` metadata -> a registered extension type, as pyarrow's reader does.

    Unregistered extensions stay as their storage type with the metadata kept on the field.
    """
    try:
        probe = pa.schema([pa.field(name, storage, nullable, meta)])
        resolved = pa.ipc.read_schema(probe.serialize()).field(0)
    except (pa.ArrowException, ValueError, TypeError):
        return None, meta
    if isinstance(resolved.type, pa.BaseExtensionType):
        return resolved.type, resolved.metadata
    return None, meta


_ext_metadata_cache: dict[str, bytes] = {}


def _extension_metadata(ty: pa.BaseExtensionType) -> bytes:
    """The serialized parameters of an extension type (C++ extension types have no Python accessor)."""
    serialize = getattr(ty, "__arrow_ext_serialize__", None)
    if serialize is not None:
        return bytes(serialize())
    key = f"{ty.extension_name}:{ty}"
    if key not in _ext_metadata_cache:
        from dissoc.codec.fb import root_table

        msg = pa.schema([pa.field("x", ty)]).serialize()
        view = memoryview(msg)[8:]
        header = root_table(view, "Message").table(2, "Schema")
        fields = header.tables(1, "Field") if header is not None else []
        kv = _key_values(fields[0], 6) if fields else None
        _ext_metadata_cache[key] = (kv or {}).get(EXTENSION_METADATA.encode(), b"")
    return _ext_metadata_cache[key]


def decode_schema(t: Table, metadata_version: int = 4) -> SchemaInfo:
    """Decode a Schema table into pyarrow's schema plus the layout plans.

    ``metadata_version`` is the Message's; schemas read the same in all supported versions (V4's union
    validity buffers are a matter of the batches, see :class:`dissoc.codec.plan.Compiled`).
    """
    endianness = t.scalar(0, "h", 0)
    if endianness not in (0, 1):
        raise CodecError(f"Schema endianness must be 0 (Little) or 1 (Big), got {endianness}")
    dec = _SchemaDecoder()
    plans = [dec.field(f, 1) for f in t.tables(1, "Field")]
    meta = _key_values(t, 2)
    features_raw = t.vector_bytes(3, 8)
    features = list(memoryview(features_raw).cast("q")) if features_raw is not None else []
    try:
        schema = pa.schema([p.field for p in plans], metadata=meta)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise CodecError(f"invalid schema: {e}") from None
    return SchemaInfo(schema, plans, dec.dictionaries, endianness == 1, features)


def map_type(ty: pa.DataType, replace: Callable[[pa.DataType], pa.DataType | None]) -> pa.DataType:
    """``ty`` rebuilt with ``replace`` applied depth first: where it returns a type, that type stands in
    (return the argument to keep it as it is); where it returns None, the children are mapped and the type
    is rebuilt around them (unchanged when they are)."""
    new = replace(ty)
    if new is not None:
        return new
    t = pa.types
    if t.is_dictionary(ty):
        value = map_type(ty.value_type, replace)
        return ty if value.equals(ty.value_type) else pa.dictionary(ty.index_type, value, ty.ordered)
    if ty.num_fields == 0:
        return ty
    fields = [ty.field(i) for i in range(ty.num_fields)]
    inner = [f.with_type(map_type(f.type, replace)) for f in fields]
    if all(a.type.equals(b.type) for a, b in zip(fields, inner, strict=True)):
        return ty
    if t.is_map(ty):
        return pa.map_(inner[0].type.field(0), inner[0].type.field(1), ty.keys_sorted)
    if t.is_struct(ty):
        return pa.struct(inner)
    if t.is_union(ty):
        return pa.union(inner, ty.mode, list(ty.type_codes))
    if t.is_run_end_encoded(ty):
        return pa.run_end_encoded(inner[0].type, inner[1].type)
    if t.is_fixed_size_list(ty):
        return pa.list_(inner[0], ty.list_size)
    factory = {
        pa.lib.Type_LIST: pa.list_,
        pa.lib.Type_LARGE_LIST: pa.large_list,
        pa.lib.Type_LIST_VIEW: pa.list_view,
        pa.lib.Type_LARGE_LIST_VIEW: pa.large_list_view,
    }[ty.id]
    return factory(inner[0])


# --------------------------------------------------------------------------------------------------- encode


class DictionaryIds:
    """Assigns dictionary ids to the dictionary-encoded fields of a schema, depth first (as pyarrow does)."""

    def __init__(self, schema: pa.Schema) -> None:
        self.by_path: dict[tuple[int, ...], int] = {}
        nxt = 0

        def visit(ty: pa.DataType, path: tuple[int, ...]) -> None:
            nonlocal nxt
            if pa.types.is_dictionary(ty):
                did = nxt
                nxt += 1
                self.by_path[path] = did
                visit(ty.value_type, (*path, -1))
                return
            storage = ty.storage_type if isinstance(ty, pa.BaseExtensionType) else ty
            for i in range(storage.num_fields):
                visit(storage.field(i).type, (*path, i))

        for i, f in enumerate(schema):
            visit(f.type, (i,))


def _build_kvs(b: flatbuffers.Builder, meta: dict[bytes, bytes] | None) -> int | None:
    if not meta:
        return None
    offs = []
    for k, v in meta.items():
        ko = b.CreateString(k)
        vo = b.CreateString(v)
        b.StartObject(2)
        b.PrependUOffsetTRelativeSlot(0, ko, 0)
        b.PrependUOffsetTRelativeSlot(1, vo, 0)
        offs.append(b.EndObject())
    return _table_vector(b, offs)


def _table_vector(b: flatbuffers.Builder, offs: list[int]) -> int:
    b.StartVector(4, len(offs), 4)
    for o in reversed(offs):
        b.PrependUOffsetTRelative(o)
    return int(b.EndVector())


def _simple_table(b: flatbuffers.Builder, slots: list[tuple[str, int, int]]) -> int:
    """A table of scalar slots: (kind, field id, value) with kind in {'h', 'i', '?'}."""
    b.StartObject(max((s[1] for s in slots), default=-1) + 1)
    for kind, fid, value in slots:
        if kind == "h":
            b.PrependInt16Slot(fid, value, -(2**15))
        elif kind == "i":
            b.PrependInt32Slot(fid, value, -(2**31))
        else:
            b.PrependBoolSlot(fid, bool(value), not bool(value))
    return int(b.EndObject())


class _SchemaEncoder:
    def __init__(self, b: flatbuffers.Builder, ids: DictionaryIds) -> None:
        self.b = b
        self.ids = ids

    def field(self, f: pa.Field, path: tuple[int, ...]) -> int:
        b = self.b
        ty = f.type
        meta = dict(f.metadata) if f.metadata else None
        dict_enc = None
        if pa.types.is_dictionary(ty):
            dict_enc = (self.ids.by_path[path], ty.index_type, ty.ordered)
            ty = ty.value_type
            path = (*path, -1)
        if isinstance(ty, pa.BaseExtensionType):
            meta = dict(meta or {})
            meta[EXTENSION_NAME.encode()] = ty.extension_name.encode()
            meta[EXTENSION_METADATA.encode()] = _extension_metadata(ty)
            ty = ty.storage_type
        children = [self.field(ty.field(i), (*path, i)) for i in range(ty.num_fields)]
        type_id, type_off = self._type(ty)
        name = b.CreateString(f.name)
        kv = _build_kvs(b, meta)
        child_vec = _table_vector(b, children)
        dict_off = None
        if dict_enc is not None:
            did, index_type, ordered = dict_enc
            idx = _simple_table(
                b, [("i", 0, index_type.bit_width), ("?", 1, pa.types.is_signed_integer(index_type))]
            )
            b.StartObject(4)
            b.PrependInt64Slot(0, did, -1)
            b.PrependUOffsetTRelativeSlot(1, idx, 0)
            b.PrependBoolSlot(2, ordered, not ordered)
            dict_off = b.EndObject()
        b.StartObject(7)
        b.PrependUOffsetTRelativeSlot(0, name, 0)
        b.PrependBoolSlot(1, f.nullable, not f.nullable)
        b.PrependUint8Slot(2, type_id, 0)
        b.PrependUOffsetTRelativeSlot(3, type_off, 0)
        if dict_off is not None:
            b.PrependUOffsetTRelativeSlot(4, dict_off, 0)
        b.PrependUOffsetTRelativeSlot(5, child_vec, 0)
        if kv is not None:
            b.PrependUOffsetTRelativeSlot(6, kv, 0)
        return int(b.EndObject())

    def _type(self, ty: pa.DataType) -> tuple[int, int]:
        b = self.b
        types = pa.types

        def empty(tid: int) -> tuple[int, int]:
            b.StartObject(0)
            return tid, b.EndObject()

        if types.is_null(ty):
            return empty(T.Null)
        if types.is_integer(ty):
            return T.Int, _simple_table(b, [("i", 0, ty.bit_width), ("?", 1, types.is_signed_integer(ty))])
        if types.is_floating(ty):
            return T.FloatingPoint, _simple_table(b, [("h", 0, {16: 0, 32: 1, 64: 2}[ty.bit_width])])
        if types.is_boolean(ty):
            return empty(T.Bool)
        if ty == pa.binary():
            return empty(T.Binary)
        if ty == pa.string():
            return empty(T.Utf8)
        if ty == pa.large_binary():
            return empty(T.LargeBinary)
        if ty == pa.large_string():
            return empty(T.LargeUtf8)
        if ty == pa.binary_view():
            return empty(T.BinaryView)
        if ty == pa.string_view():
            return empty(T.Utf8View)
        if types.is_fixed_size_binary(ty) and not types.is_decimal(ty):
            return T.FixedSizeBinary, _simple_table(b, [("i", 0, ty.byte_width)])
        if types.is_decimal(ty):
            return T.Decimal, _simple_table(
                b, [("i", 0, ty.precision), ("i", 1, ty.scale), ("i", 2, ty.bit_width)]
            )
        if types.is_date32(ty):
            return T.Date, _simple_table(b, [("h", 0, 0)])
        if types.is_date64(ty):
            return T.Date, _simple_table(b, [("h", 0, 1)])
        if types.is_time(ty):
            return T.Time, _simple_table(b, [("h", 0, _UNIT_CODES[ty.unit]), ("i", 1, ty.bit_width)])
        if types.is_timestamp(ty):
            tz = b.CreateString(ty.tz) if ty.tz is not None else None
            b.StartObject(2)
            b.PrependInt16Slot(0, _UNIT_CODES[ty.unit], -1)
            if tz is not None:
                b.PrependUOffsetTRelativeSlot(1, tz, 0)
            return T.Timestamp, b.EndObject()
        if types.is_duration(ty):
            return T.Duration, _simple_table(b, [("h", 0, _UNIT_CODES[ty.unit])])
        if ty.id == pa.lib.Type_INTERVAL_MONTHS:
            return T.Interval, _simple_table(b, [("h", 0, 0)])
        if ty.id == pa.lib.Type_INTERVAL_DAY_TIME:
            return T.Interval, _simple_table(b, [("h", 0, 1)])
        if ty.id == pa.lib.Type_INTERVAL_MONTH_DAY_NANO:
            return T.Interval, _simple_table(b, [("h", 0, 2)])
        if types.is_map(ty):
            return T.Map, _simple_table(b, [("?", 0, ty.keys_sorted)])
        if types.is_list(ty):
            return empty(T.List)
        if types.is_large_list(ty):
            return empty(T.LargeList)
        if types.is_fixed_size_list(ty):
            return T.FixedSizeList, _simple_table(b, [("i", 0, ty.list_size)])
        if types.is_list_view(ty):
            return empty(T.ListView)
        if types.is_large_list_view(ty):
            return empty(T.LargeListView)
        if types.is_struct(ty):
            return empty(T.Struct)
        if types.is_union(ty):
            codes = list(ty.type_codes)
            b.StartVector(4, len(codes), 4)
            for c in reversed(codes):
                b.PrependInt32(c)
            vec = b.EndVector()
            b.StartObject(2)
            b.PrependInt16Slot(0, 1 if ty.mode == "dense" else 0, -1)
            b.PrependUOffsetTRelativeSlot(1, vec, 0)
            return T.Union, b.EndObject()
        if types.is_run_end_encoded(ty):
            return empty(T.RunEndEncoded)
        raise CodecError(f"cannot encode type {ty}: not supported by the Arrow IPC format")


def encode_schema(b: flatbuffers.Builder, schema: pa.Schema, ids: DictionaryIds) -> int:
    """Build a Schema table for ``schema`` in ``b``; returns its offset."""
    enc = _SchemaEncoder(b, ids)
    fields = [enc.field(f, (i,)) for i, f in enumerate(schema)]
    vec = _table_vector(b, fields)
    kv = _build_kvs(b, dict(schema.metadata) if schema.metadata else None)
    b.StartObject(4)
    b.PrependInt16Slot(0, 0, -1)
    b.PrependUOffsetTRelativeSlot(1, vec, 0)
    if kv is not None:
        b.PrependUOffsetTRelativeSlot(2, kv, 0)
    return int(b.EndObject())


def build_message(b: flatbuffers.Builder, header_type: int, header: int, body_length: int) -> bytes:
    """Finish ``b`` with a Message table around ``header`` and return the flatbuffer bytes."""
    b.Finish(_message(b, header_type, header, body_length))
    return bytes(b.Output())
