"""Hypothesis strategies: Arrow schemas and matching record batches / tables over (nearly) every type.

Types nest up to ``max_depth`` levels (3 by default). Arrays are small (0-20 top-level rows), carry nulls,
are often sliced (so offsets, including bit offsets that are not multiples of 8, are non-zero), and are
built over explicit buffers where ``pa.array`` cannot express the layout (views spread over several variadic
buffers, list views with overlapping out-of-order ranges, month / day-time intervals, run-end encoding,
unions with sparse type codes). Big child arrays draw a small pool of values and fill from a seeded RNG, so
examples stay within hypothesis' data budget.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import functools
import itertools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import strategies as st

from helpers import ipcgen

MAX_ROWS = 20
EXPLICIT = 16  # up to this many elements are drawn one by one; beyond that, from a pool + seeded RNG
CHILD_BUDGET = 64  # cap on child elements a single nested array creates per row set


def _interval_type(unit: int) -> pa.DataType:
    """pyarrow has no factory for YEAR_MONTH / DAY_TIME intervals: read the type from a built schema."""
    msg = ipcgen.schema_message([ipcgen.FieldSpec("x", ipcgen.interval(unit))])
    return pa.ipc.read_schema(pa.py_buffer(ipcgen.frame(msg))).field(0).type


MONTH_INTERVAL = _interval_type(0)
DAY_TIME_INTERVAL = _interval_type(1)

INT_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
INDEX_TYPES = INT_TYPES
TIMEZONES = [None, "UTC", "Europe/Paris", "+05:30", "America/New_York"]

SIMPLE_LEAVES: list[pa.DataType] = [
    pa.null(),
    pa.bool_(),
    *INT_TYPES,
    pa.float16(),
    pa.float32(),
    pa.float64(),
    pa.date32(),
    pa.date64(),
    pa.time32("s"),
    pa.time32("ms"),
    pa.time64("us"),
    pa.time64("ns"),
    pa.duration("s"),
    pa.duration("ms"),
    pa.duration("us"),
    pa.duration("ns"),
    pa.month_day_nano_interval(),
    pa.binary(),
    pa.string(),
    pa.large_binary(),
    pa.large_string(),
    pa.binary_view(),
    pa.string_view(),
    pa.uuid(),
    pa.bool8(),
    pa.json_(),
]

# Types usable as dictionary values / map keys (no null type, no extension types).
DICT_VALUE_LEAVES: list[pa.DataType] = [
    pa.string(),
    pa.large_string(),
    pa.binary(),
    pa.string_view(),
    pa.int8(),
    pa.int32(),
    pa.uint16(),
    pa.int64(),
    pa.float64(),
    pa.date32(),
    pa.timestamp("ms", tz="UTC"),
    pa.decimal128(10, 2),
    pa.binary(3),
]
MAP_KEY_TYPES: list[pa.DataType] = [pa.int32(), pa.int64(), pa.string(), pa.binary(), pa.uint8(), pa.date32()]


# --------------------------------------------------------------------------------------------------
# Types


def timestamp_types() -> st.SearchStrategy[pa.DataType]:
    return st.builds(pa.timestamp, st.sampled_from(["s", "ms", "us", "ns"]), st.sampled_from(TIMEZONES))


_LEAF_KINDS: list[pa.DataType | str] = [
    *SIMPLE_LEAVES,
    "decimal32",
    "decimal64",
    "decimal128",
    "decimal256",
    "timestamp",
    "timestamp",
    "fixed_size_binary",
]


def _leaf(kind: pa.DataType | str) -> st.SearchStrategy[pa.DataType]:
    if isinstance(kind, pa.DataType):
        return st.just(kind)
    if kind == "timestamp":
        return timestamp_types()
    if kind == "fixed_size_binary":
        return st.integers(0, 9).map(pa.binary)  # width 0 included
    factory, max_precision = {
        "decimal32": (pa.decimal32, 9),
        "decimal64": (pa.decimal64, 18),
        "decimal128": (pa.decimal128, 38),
        "decimal256": (pa.decimal256, 76),
    }[kind]
    return st.integers(1, max_precision).flatmap(lambda p: st.integers(0, p).map(lambda s: factory(p, s)))


@functools.cache
def leaf_types() -> st.SearchStrategy[pa.DataType]:
    return st.sampled_from(_LEAF_KINDS).flatmap(_leaf)


def field_names() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(["a", "b", "c", "item", "x", ""]),
        st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6),
    )


def metadata() -> st.SearchStrategy[dict[str, str] | None]:
    key = st.one_of(
        st.sampled_from(["k", "pandas", "ARROW:extension:name", "origin", "ключ"]),
        st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8),
    )

    def fix(md: dict[str, str]) -> dict[str, str] | None:
        if "ARROW:extension:name" in md:  # stay clear of registered extension names
            md["ARROW:extension:name"] = "dissoc.test.unregistered"
        return md or None

    value = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
    return st.one_of(st.none(), st.dictionaries(key, value, max_size=3).map(fix))


@st.composite
def fields_of(draw: st.DrawFn, types: st.SearchStrategy[pa.DataType], name: str | None = None) -> pa.Field:
    typ = draw(types)
    nullable = True if pa.types.is_null(typ) else draw(st.booleans())
    md = draw(metadata())
    if md is not None and isinstance(typ, pa.BaseExtensionType):
        # an extension field's own ARROW:extension:* keys would clash with the type's
        md = {k: v for k, v in md.items() if not k.startswith("ARROW:")} or None
    return pa.field(name if name is not None else draw(field_names()), typ, nullable, md)


@functools.cache
def dictionary_types(depth: int) -> st.SearchStrategy[pa.DataType]:
    values: st.SearchStrategy[pa.DataType] = st.sampled_from(DICT_VALUE_LEAVES)
    if depth > 0:
        # nested values that may themselves hold dictionaries (but no dictionary directly of a dictionary:
        # pyarrow 26 writes that but cannot read it back)
        inner = data_types(depth - 1)
        values = st.one_of(
            values,
            fields_of(inner, "item").map(pa.list_),
            st.lists(fields_of(inner), min_size=1, max_size=2).map(pa.struct),
        )
    return st.builds(pa.dictionary, st.sampled_from(INDEX_TYPES), values, st.booleans())


def _union(mode: str) -> Callable[[list[pa.Field], list[int]], pa.DataType]:
    def make(children: list[pa.Field], codes: list[int]) -> pa.DataType:
        return pa.union(children, mode, type_codes=codes[: len(children)])

    return make


@functools.cache
def data_types(max_depth: int = 3) -> st.SearchStrategy[pa.DataType]:
    if max_depth <= 0:
        return leaf_types()
    child = st.deferred(lambda: data_types(max_depth - 1))
    child_field = fields_of(child)
    codes = st.lists(st.integers(0, 127), min_size=3, max_size=3, unique=True)
    nested = st.one_of(
        child_field.map(pa.list_),
        child_field.map(pa.large_list),
        st.builds(pa.list_, child_field, st.integers(0, 3)),
        child_field.map(pa.list_view),
        child_field.map(pa.large_list_view),
        st.lists(child_field, max_size=3).map(pa.struct),
        st.builds(
            pa.map_,
            st.sampled_from(MAP_KEY_TYPES),
            child_field.map(lambda f: f.with_name("value")),
            st.booleans(),
        ),
        st.builds(_union("sparse"), st.lists(child_field, min_size=1, max_size=3), codes),
        st.builds(_union("dense"), st.lists(child_field, min_size=1, max_size=3), codes),
        dictionary_types(max_depth - 1),
        st.builds(
            pa.run_end_encoded,
            st.sampled_from([pa.int16(), pa.int32(), pa.int64()]),
            st.one_of(leaf_types(), dictionary_types(0), st.lists(child_field, max_size=2).map(pa.struct)),
        ),
    )
    return st.one_of(leaf_types(), nested)


def schemas(max_depth: int = 3, max_fields: int = 4) -> st.SearchStrategy[pa.Schema]:
    return st.builds(
        pa.schema, st.lists(fields_of(data_types(max_depth)), max_size=max_fields), metadata=metadata()
    )


# --------------------------------------------------------------------------------------------------
# Values


def _rng(draw: st.DrawFn) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def _draw_values(draw: st.DrawFn, elements: st.SearchStrategy[Any], n: int) -> list[Any]:
    if n <= EXPLICIT:
        return draw(st.lists(elements, min_size=n, max_size=n))
    pool = draw(st.lists(elements, min_size=1, max_size=6))
    rng = _rng(draw)
    return [pool[i] for i in rng.integers(0, len(pool), n)]


def _draw_valid(draw: st.DrawFn, n: int, nullable: bool) -> list[bool] | None:
    """Validity per slot (True = valid), or None for no validity bitmap at all."""
    if not nullable or n == 0 or not draw(st.booleans()):
        return None
    if n <= EXPLICIT:
        return draw(st.lists(st.booleans(), min_size=n, max_size=n))
    p = draw(st.sampled_from([0.1, 0.5, 0.9]))
    return [bool(v) for v in _rng(draw).random(n) >= p]


def _mask(valid: list[bool] | None) -> pa.Array | None:
    return None if valid is None else pa.array([not v for v in valid], pa.bool_())


def _validity_buffer(valid: list[bool] | None) -> pa.Buffer | None:
    return None if valid is None else pa.array(valid, pa.bool_()).buffers()[1]


def _apply_nulls(values: list[Any], valid: list[bool] | None) -> list[Any]:
    return values if valid is None else [v if ok else None for v, ok in zip(values, valid, strict=True)]


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0, min(hi, 1), max(lo, -1)]))


def _int_range(t: pa.DataType) -> tuple[int, int]:
    bits = t.bit_width
    if pa.types.is_signed_integer(t):
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def _decimal_values(t: pa.DataType) -> st.SearchStrategy[decimal.Decimal]:
    limit = 10**t.precision - 1
    return _ints(-limit, limit).map(lambda v: decimal.Decimal(f"{v}E{-t.scale}"))


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)
_JSON = st.sampled_from(["null", "1", '"a"', "[1, 2]", '{"k": [true]}', "{}"])


def _python_values(t: pa.DataType) -> st.SearchStrategy[Any] | None:
    """Element strategy for the types that pa.array builds from Python values."""
    if pa.types.is_boolean(t):
        return st.booleans()
    if pa.types.is_integer(t):
        return _ints(*_int_range(t))
    if pa.types.is_float32(t):
        return st.floats(width=32, allow_nan=False)
    if pa.types.is_float64(t):
        return st.floats(allow_nan=False)
    if pa.types.is_decimal(t):
        return _decimal_values(t)
    if pa.types.is_date32(t):
        return _ints(-1_000_000, 1_000_000).map(lambda d: _dt.date(1970, 1, 1) + _dt.timedelta(days=d // 3))
    if pa.types.is_date64(t):
        return _ints(-100_000, 100_000).map(lambda d: _dt.date(1970, 1, 1) + _dt.timedelta(days=d))
    if pa.types.is_time32(t):
        return st.integers(0, 86_399 if t.unit == "s" else 86_399_999)
    if pa.types.is_time64(t):
        return st.integers(0, 86_399_999_999 if t.unit == "us" else 86_399_999_999_999)
    if pa.types.is_timestamp(t) or pa.types.is_duration(t):
        return _ints(-(2**62), 2**62)
    if t == pa.month_day_nano_interval():
        return st.tuples(_ints(-(2**31), 2**31 - 1), _ints(-(2**31), 2**31 - 1), _ints(-(2**63), 2**63 - 1))
    if pa.types.is_fixed_size_binary(t):
        return st.binary(min_size=t.byte_width, max_size=t.byte_width)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return st.binary(max_size=20)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return _TEXT
    return None


def _view_array(draw: st.DrawFn, t: pa.DataType, n: int, valid: list[bool] | None) -> pa.Array:
    """A binary/string view array over 1-3 variadic buffers, inline (<= 12 bytes) and out-of-line values."""
    elems = st.binary(max_size=24) if pa.types.is_binary_view(t) else _TEXT.map(lambda s: s.encode())
    values = _draw_values(draw, elems, n)
    nbuf = draw(st.integers(1, 3))
    rng = _rng(draw)
    datas = [
        bytearray(rng.integers(0, 256, draw(st.integers(0, 5)), dtype=np.uint8).tobytes())
        for _ in range(nbuf)
    ]
    views = bytearray()
    for i, v in enumerate(values):
        if valid is not None and not valid[i]:
            views += bytes(16)
        elif len(v) <= 12:
            views += struct.pack("<i", len(v)) + v + bytes(12 - len(v))
        else:
            k = int(rng.integers(0, nbuf))
            views += struct.pack("<i4sii", len(v), v[:4], k, len(datas[k]))
            datas[k] += v + rng.integers(0, 256, int(rng.integers(0, 3)), dtype=np.uint8).tobytes()
    buffers = [_validity_buffer(valid), pa.py_buffer(bytes(views)), *(pa.py_buffer(bytes(d)) for d in datas)]
    return pa.Array.from_buffers(t, n, buffers)


def _lengths(draw: st.DrawFn, n: int, max_len: int = 3) -> list[int]:
    per_row = max(0, min(max_len, CHILD_BUDGET // max(n, 1)))
    if n <= EXPLICIT:
        return draw(st.lists(st.integers(0, per_row), min_size=n, max_size=n))
    return [int(x) for x in _rng(draw).integers(0, per_row + 1, n)]


@st.composite
def arrays(
    draw: st.DrawFn, t: pa.DataType, n: int, nullable: bool = True, sliced: bool | None = None
) -> pa.Array:
    """An array of type ``t`` and length ``n``; sliced out of a longer one when ``sliced`` (drawn if None)."""
    if sliced is None:
        sliced = draw(st.integers(0, 2)) == 0
    if not sliced:
        return draw(_unsliced(t, n, nullable))
    before = draw(st.integers(0, 13))
    after = draw(st.integers(0, 3))
    whole = draw(_unsliced(t, before + n + after, nullable))
    return whole.slice(before, n)


def _child_nullable(f: pa.Field) -> bool:
    return bool(f.nullable)


@st.composite
def _unsliced(draw: st.DrawFn, t: pa.DataType, n: int, nullable: bool) -> pa.Array:
    if isinstance(t, pa.BaseExtensionType):
        if t == pa.json_():
            storage = pa.array(
                _apply_nulls(_draw_values(draw, _JSON, n), _draw_valid(draw, n, nullable)), t.storage_type
            )
        else:
            storage = draw(arrays(t.storage_type, n, nullable, sliced=False))
        return pa.ExtensionArray.from_storage(t, storage)
    if pa.types.is_null(t):
        return pa.nulls(n)

    valid = _draw_valid(draw, n, nullable)

    if pa.types.is_float16(t):
        vals = _draw_values(draw, st.floats(width=16, allow_nan=False), n)
        mask = None if valid is None else np.array([not v for v in valid])
        return pa.array(np.array(vals, dtype=np.float16), type=t, mask=mask)
    if (pa.types.is_binary_view(t) or pa.types.is_string_view(t)) and draw(st.booleans()):
        return _view_array(draw, t, n, valid)
    elems = _python_values(t)
    if elems is not None:
        return pa.array(_apply_nulls(_draw_values(draw, elems, n), valid), type=t)

    if pa.types.is_struct(t):
        children = [draw(arrays(f.type, n, _child_nullable(f))) for f in t]
        if not children:
            return pa.Array.from_buffers(t, n, [_validity_buffer(valid)], children=[])
        return pa.StructArray.from_arrays(children, fields=list(t), mask=_mask(valid))
    if pa.types.is_map(t):
        lens = _lengths(draw, n)
        total = sum(lens)
        keys = draw(arrays(t.key_type, total, nullable=False))
        items = draw(arrays(t.item_type, total, _child_nullable(t.item_field)))
        offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        return pa.MapArray.from_arrays(offsets, keys, items, type=t, mask=_mask(valid))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        lens = _lengths(draw, n)
        values = draw(arrays(t.value_type, sum(lens), _child_nullable(t.value_field)))
        dtype = np.int32 if pa.types.is_list(t) else np.int64
        offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(dtype))
        cls = pa.ListArray if pa.types.is_list(t) else pa.LargeListArray
        return cls.from_arrays(offsets, values, type=t, mask=_mask(valid))
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        values = draw(arrays(t.value_type, n * size, _child_nullable(t.value_field)))
        if size == 0:
            return pa.Array.from_buffers(t, n, [_validity_buffer(valid)], children=[values])
        return pa.FixedSizeListArray.from_arrays(values, type=t, mask=_mask(valid))
    if pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
        child_len = draw(st.integers(0, min(12, CHILD_BUDGET)))
        values = draw(arrays(t.value_type, child_len, _child_nullable(t.value_field)))
        rng = _rng(draw)
        sizes = [int(rng.integers(0, min(3, child_len) + 1)) for _ in range(n)]
        offs = [int(rng.integers(0, child_len - s + 1)) for s in sizes]
        dtype = pa.int32() if pa.types.is_list_view(t) else pa.int64()
        cls = pa.ListViewArray if pa.types.is_list_view(t) else pa.LargeListViewArray
        return cls.from_arrays(
            pa.array(offs, dtype), pa.array(sizes, dtype), values, type=t, mask=_mask(valid)
        )
    if pa.types.is_union(t):
        codes = list(t.type_codes)
        rng = _rng(draw)
        which = [int(rng.integers(0, len(codes))) for _ in range(n)]
        type_ids = pa.py_buffer(np.array([codes[w] for w in which], dtype=np.int8).tobytes())
        if t.mode == "sparse":
            children = [draw(arrays(f.type, n, _child_nullable(f))) for f in t]
            return pa.Array.from_buffers(t, n, [None, type_ids], children=children)
        counts = [which.count(k) for k in range(len(codes))]
        extra = [draw(st.integers(0, 2)) for _ in codes]
        children = [
            draw(arrays(f.type, c + e, _child_nullable(f))) for f, c, e in zip(t, counts, extra, strict=True)
        ]
        seen = [0] * len(codes)
        offsets = []
        for w in which:
            offsets.append(seen[w] + (extra[w] if seen[w] == counts[w] - 1 else 0))
            seen[w] += 1
        offs = pa.py_buffer(np.array(offsets, dtype=np.int32).tobytes())
        return pa.Array.from_buffers(t, n, [None, type_ids, offs], children=children)
    if pa.types.is_dictionary(t):
        dict_len = draw(st.integers(0, 6))
        dictionary = draw(arrays(t.value_type, dict_len, True))
        if dict_len == 0:
            valid = [False] * n
        idx = _draw_values(draw, st.integers(0, max(dict_len - 1, 0)), n)
        indices = pa.array(_apply_nulls(idx, valid), type=t.index_type)
        return pa.DictionaryArray.from_arrays(indices, dictionary, ordered=t.ordered)
    if pa.types.is_run_end_encoded(t):
        runs: list[int] = []
        left = n
        while left > 0:
            r = min(left, draw(st.integers(1, 4)) if len(runs) < EXPLICIT else left)
            runs.append(r)
            left -= r
        run_ends = pa.array(np.cumsum(runs, dtype=np.int64) if runs else [], t.run_end_type)
        values = draw(arrays(t.value_type, len(runs), True))
        return pa.RunEndEncodedArray.from_arrays(run_ends, values, type=t)
    raise AssertionError(f"strategies: no generator for {t}")


# --------------------------------------------------------------------------------------------------
# Batches and tables


def _batch(arrays_: Sequence[pa.Array], schema: pa.Schema, n: int) -> pa.RecordBatch:
    if len(schema) == 0:
        empty = pa.RecordBatch.from_struct_array(pa.array([{}] * n, pa.struct([])))
        return empty.replace_schema_metadata(schema.metadata)
    return pa.RecordBatch.from_arrays(list(arrays_), schema=schema)


@st.composite
def record_batches(draw: st.DrawFn, schema: pa.Schema, rows: int | None = None) -> pa.RecordBatch:
    n = draw(st.integers(0, MAX_ROWS)) if rows is None else rows
    cols = [draw(arrays(f.type, n, f.nullable)) for f in schema]
    return _batch(cols, schema, n)


@dataclass
class TableCase:
    """A schema and the batches of a table: either independent batches (dictionaries differ between them)
    or slices of one batch (they share dictionaries and buffers)."""

    schema: pa.Schema
    batches: list[pa.RecordBatch]
    shared: bool

    @property
    def table(self) -> pa.Table:
        return pa.Table.from_batches(self.batches, schema=self.schema)

    def __repr__(self) -> str:
        rows = [b.num_rows for b in self.batches]
        return f"TableCase(shared={self.shared}, schema={self.schema!r}, rows={rows})"


@st.composite
def table_cases(draw: st.DrawFn, max_depth: int = 3, max_batches: int = 3) -> TableCase:
    schema = draw(schemas(max_depth))
    if draw(st.booleans()):
        whole = draw(record_batches(schema, draw(st.integers(0, MAX_ROWS))))
        cuts = sorted(draw(st.lists(st.integers(0, whole.num_rows), max_size=max_batches - 1)))
        bounds = [0, *cuts, whole.num_rows]
        batches = [whole.slice(a, b - a) for a, b in itertools.pairwise(bounds)]
        return TableCase(schema, batches, shared=True)
    k = draw(st.integers(0, max_batches))
    return TableCase(schema, [draw(record_batches(schema)) for _ in range(k)], shared=False)


@st.composite
def schema_and_batch(draw: st.DrawFn, max_depth: int = 3) -> tuple[pa.Schema, pa.RecordBatch]:
    schema = draw(schemas(max_depth))
    return schema, draw(record_batches(schema))


# --------------------------------------------------------------------------------------------------
# Dictionary sequences (deltas and replacements across batches)


@dataclass
class DictSequence:
    schema: pa.Schema
    batches: list[pa.RecordBatch]

    def __repr__(self) -> str:
        dicts = [
            [c.dictionary.to_pylist() if isinstance(c, pa.DictionaryArray) else "<nested>" for c in b.columns]
            for b in self.batches
        ]
        return f"DictSequence(schema={self.schema!r}, dictionaries={dicts})"


_DICT_VALUES = {
    "string": (pa.string(), st.text(alphabet="abcdefgh", max_size=3)),
    "int64": (pa.int64(), st.integers(-50, 50)),
    "binary": (pa.binary(), st.binary(max_size=3)),
}


@st.composite
def dictionary_sequences(draw: st.DrawFn, max_batches: int = 5) -> DictSequence:
    """Batches of one top-level dictionary column and one list<dictionary> column, whose dictionaries
    grow (delta-able), stay, or get replaced from batch to batch."""
    value_kind = draw(st.sampled_from(sorted(_DICT_VALUES)))
    value_type, elems = _DICT_VALUES[value_kind]
    index_type = draw(
        st.sampled_from([pa.int8(), pa.uint8(), pa.int16(), pa.int32(), pa.uint32(), pa.int64()])
    )
    ordered = draw(st.booleans())
    dtype = pa.dictionary(index_type, value_type, ordered)
    schema = pa.schema([pa.field("d", dtype), pa.field("ld", pa.list_(pa.field("item", dtype)))])

    def evolve(current: list[Any]) -> list[Any]:
        action = draw(st.sampled_from(["same", "grow", "grow", "replace"]))
        if action == "same":
            return current
        if action == "grow":
            return current + draw(st.lists(elems, min_size=1, max_size=3))
        return draw(st.lists(elems, max_size=4))

    dicts = [draw(st.lists(elems, min_size=1, max_size=4)), draw(st.lists(elems, min_size=1, max_size=4))]
    batches = []
    for _ in range(draw(st.integers(1, max_batches))):
        dicts = [evolve(d) for d in dicts]
        n = draw(st.integers(0, 8))
        cols = []
        for i, values in enumerate(dicts):
            dictionary = pa.array(values, value_type)
            count = n if i == 0 else draw(st.integers(0, 8))
            if values:
                idx = draw(
                    st.lists(
                        st.one_of(st.none(), st.integers(0, len(values) - 1)), min_size=count, max_size=count
                    )
                )
            else:
                idx = [None] * count
            arr = pa.DictionaryArray.from_arrays(pa.array(idx, index_type), dictionary, ordered=ordered)
            if i == 1:
                lens = _split(draw, count, n)
                offsets = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
                arr = pa.ListArray.from_arrays(offsets, arr, type=schema.field("ld").type)
            cols.append(arr)
        batches.append(pa.RecordBatch.from_arrays(cols, schema=schema))
    return DictSequence(schema, batches)


def _split(draw: st.DrawFn, total: int, parts: int) -> list[int]:
    if parts == 0:
        return []
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]
