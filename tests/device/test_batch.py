"""Device batches (dissoc.device) and the codec's message layouts (dissoc.codec.layout).

CPU tests run on the fake device backend (host memory that refuses to pass for host memory); the ``gpu`` tests
repeat the round trips on CuPy and check the zero-copy hand-off (CUDA Array Interface, DLPack, torch).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.ipc as paipc
import pytest
from helpers import ipcgen
from helpers import strategies as S
from helpers.codec import assert_batch_equal, assert_batches_equal, pa_read_stream, pa_write_stream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dissoc import codec
from dissoc.codec.decoder import parse
from dissoc.codec.layout import FieldLayout, field_layout, message_layout, schema_info
from dissoc.codec.message import encode_record_batch
from dissoc.codec.schema import Layout
from dissoc.device import (
    DeviceBatch,
    DeviceColumn,
    DeviceDecoder,
    DeviceEncoder,
    DeviceInterfaceError,
    DeviceMessage,
)
from dissoc.errors import CodecError, DissocError
from dissoc.memory.cuda import FakeDeviceArray, FakeDeviceBackend, get_backend, use_backend

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class CountingBackend(FakeDeviceBackend):
    """The fake backend, counting transfers."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads = 0
        self.downloads = 0

    def upload(self, data: Any) -> Any:
        self.uploads += 1
        return super().upload(data)

    def download(self, array: Any, out: Any = None) -> Any:
        self.downloads += 1
        return super().download(array, out)


FAKE = CountingBackend()


@pytest.fixture(autouse=True, scope="module")
def _fake_backend() -> Iterator[None]:
    with use_backend(FAKE):
        yield


# --------------------------------------------------------------------------------------------------
# Explicit cases


def _views() -> pa.Array:
    """A string view array with inline and out-of-line values over two variadic buffers."""
    long1, long2 = b"a string longer than twelve", b"another long string value"
    data0, data1 = long1, b"xx" + long2
    views = (
        np.array([5], "<i4").tobytes()
        + b"short" + bytes(7)
        + np.array([len(long1)], "<i4").tobytes() + long1[:4] + np.array([0, 0], "<i4").tobytes()
        + bytes(16)
        + np.array([len(long2)], "<i4").tobytes() + long2[:4] + np.array([1, 2], "<i4").tobytes()
    )  # fmt: skip
    validity = pa.array([True, True, False, True]).buffers()[1]
    bufs = [validity, pa.py_buffer(views), pa.py_buffer(data0), pa.py_buffer(data1)]
    return pa.Array.from_buffers(pa.string_view(), 4, bufs)


def _cases() -> dict[str, pa.RecordBatch]:
    d_inner = pa.DictionaryArray.from_arrays(pa.array([0, 1, None, 1, 0], pa.int8()), pa.array(["p", "q"]))
    lists = pa.ListArray.from_arrays(pa.array([0, 2, 2, 5], pa.int32()), d_inner)
    outer = pa.DictionaryArray.from_arrays(pa.array([1, 0, None], pa.int32()), lists.slice(0, 2))
    sparse = pa.UnionArray.from_sparse(
        pa.array([0, 1, 0, 1], pa.int8()),
        [pa.array([1, None, 3, 4], pa.int64()), pa.array(["a", "b", None, "d"])],
        ["i", "s"],
        [0, 1],
    )
    dense = pa.UnionArray.from_dense(
        pa.array([5, 9, 5, 9], pa.int8()),
        pa.array([0, 0, 1, 1], pa.int32()),
        [pa.array([1.5, None], pa.float64()), pa.array([b"xy", b"z"])],
        ["f", "b"],
        [5, 9],
    )
    ree = pa.RunEndEncodedArray.from_arrays(pa.array([2, 3, 6], pa.int32()), pa.array(["x", None, "z"]))
    ints = pa.array([i if i % 3 else None for i in range(20)], pa.int32())
    bools = pa.array([(i % 3 == 0) if i % 5 else None for i in range(20)], pa.bool_())
    return {
        "primitives": pa.record_batch(
            {
                "i8": pa.array([1, -2, None], pa.int8()),
                "u64": pa.array([2**64 - 1, 0, 7], pa.uint64()),
                "f16": pa.array(np.array([1.5, -0.25, 3.0], np.float16)),
                "f32": pa.array([1.5, None, -3.25], pa.float32()),
                "f64": pa.array([None, 2.5, 1e300]),
                "b": pa.array([True, None, False]),
                "date32": pa.array([0, 19000, None], pa.date32()),
                "date64": pa.array([86400000, None, 0], pa.date64()),
                "time32": pa.array([1, 86399, None], pa.time32("s")),
                "time64": pa.array([1, None, 5], pa.time64("ns")),
                "ts": pa.array([1, 2, None], pa.timestamp("us", "UTC")),
                "dur": pa.array([-1, None, 3], pa.duration("ms")),
                "dec": pa.array([1, None, -3], pa.decimal128(10, 2)),
                "fsb": pa.array([b"abc", None, b"xyz"], pa.binary(3)),
                "mdn": pa.array([(1, 2, 3), None, (-1, 0, 5)], pa.month_day_nano_interval()),
                "null": pa.nulls(3),
            }
        ),
        "binary": pa.record_batch(
            {
                "s": pa.array(["a", None, "ccc"]),
                "b": pa.array([b"", b"xy", None]),
                "ls": pa.array(["q", "r", None], pa.large_string()),
                "lb": pa.array([None, b"zz", b"w"], pa.large_binary()),
                "sv": _views().slice(0, 3),
            }
        ),
        "views": pa.record_batch(
            {"sv": _views(), "bv": pa.array([b"x" * 20, None, b"y", b""], pa.binary_view())}
        ),
        "nested": pa.record_batch(
            {
                "l": pa.array([[1, 2], None, []], pa.list_(pa.int16())),
                "ll": pa.array([["a"], ["b", None], None], pa.large_list(pa.string())),
                "fsl": pa.array([[1, 2], [3, None], None], pa.list_(pa.int32(), 2)),
                "st": pa.array([{"x": 1, "y": "a"}, None, {"x": None, "y": "c"}]),
                "m": pa.array([[("k", 1)], None, [("a", 2), ("b", None)]], pa.map_(pa.string(), pa.int64())),
                "lv": pa.ListViewArray.from_arrays(
                    pa.array([2, 0, 1], pa.int32()), pa.array([1, 2, 0], pa.int32()), pa.array([7, 8, 9])
                ),
                "llv": pa.LargeListViewArray.from_arrays(
                    pa.array([0, 0, 2], pa.int64()),
                    pa.array([3, 1, 1], pa.int64()),
                    pa.array(["a", "b", "c"]),
                ),
            }
        ),
        "unions": pa.record_batch({"sparse": sparse, "dense": dense}),
        "unions_sliced": pa.record_batch({"sparse": sparse.slice(1, 3), "dense": dense.slice(1, 3)}),
        "dictionaries": pa.record_batch(
            {
                "d": pa.array(["a", "b", None, "a"]).dictionary_encode(),
                "du": pa.DictionaryArray.from_arrays(
                    pa.array([3, 0, 1, None], pa.uint8()), pa.array([1, 2, 3, 4])
                ),
                "empty": pa.DictionaryArray.from_arrays(
                    pa.array([None] * 4, pa.int16()), pa.array([], pa.string())
                ),
            }
        ),
        "nested_dictionaries": pa.RecordBatch.from_arrays(
            [lists, outer], names=["list_of_dict", "dict_of_list_of_dict"]
        ),
        "ree": pa.record_batch({"ree": ree.slice(0, 5), "ree_sliced": ree.slice(1, 5)}),
        "extension": pa.record_batch(
            {
                "uuid": pa.ExtensionArray.from_storage(pa.uuid(), pa.array([b"0" * 16, None], pa.binary(16))),
                "bool8": pa.ExtensionArray.from_storage(pa.bool8(), pa.array([1, None], pa.int8())),
                "json": pa.ExtensionArray.from_storage(pa.json_(), pa.array(['{"a": 1}', None])),
            }
        ),
        "sliced": pa.record_batch(
            {
                "i": ints.slice(3, 11),
                "b": bools.slice(5, 11),
                "s": pa.array(list("abcdefghijklmnop")).slice(3, 11),
            }
        ),
        "empty": pa.record_batch({"i": pa.array([], pa.int64()), "s": pa.array([], pa.string())}),
        "zero_columns": pa.RecordBatch.from_struct_array(pa.array([{}] * 5, pa.struct([]))),
        "inner_dictionary": pa.record_batch(
            {"ld": pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), d_inner.slice(0, 1))}
        ),
    }


CASES = _cases()
# The cases whose arrays are not slices (their device buffers equal pyarrow's buffers' bytes).
UNSLICED = ["primitives", "views", "nested", "unions", "dictionaries", "extension", "empty"]


def _all_fields(fields: Any) -> Iterator[FieldLayout]:
    for f in fields:
        yield f
        yield from _all_fields(f.children)


def _check_layout(db: DeviceBatch) -> None:
    """Every message's field layouts, flattened depth first, are exactly its header's nodes and buffers."""
    for m in db.messages:
        parsed = parse(m.metadata)
        assert parsed.batch is not None
        lay = message_layout(db.schema_info, m.metadata)
        flat = list(_all_fields(lay.fields))
        assert [[f.length, f.null_count] for f in flat] == parsed.batch.nodes.tolist()
        assert [list(s) for f in flat for s in f.buffers] == parsed.batch.buffers.tolist()
        assert m.body_length == parsed.body_length
        assert lay.is_dictionary == m.is_dictionary
        assert lay.dictionary_id == m.dictionary_id


def _walk_columns(col: DeviceColumn) -> Iterator[DeviceColumn]:
    yield col
    for c in col.children:
        yield from _walk_columns(c)
    for d in col.dictionary_chunks:
        yield from _walk_columns(d)


def _check_round_trip(batch: pa.RecordBatch) -> DeviceBatch:
    db = DeviceBatch.from_arrow(batch)
    assert db.backend is FAKE
    assert db.num_rows == batch.num_rows and len(db) == batch.num_rows
    assert db.num_columns == batch.num_columns
    assert db.schema.equals(batch.schema, check_metadata=True)
    assert all(isinstance(m.body, FakeDeviceArray) for m in db.messages)
    assert db.nbytes == sum(m.body.nbytes for m in db.messages)
    _check_layout(db)
    for i, col in enumerate(db.columns):
        assert col is db.column(i)
        assert col.field.equals(batch.schema.field(i))
        assert col.length == batch.num_rows
        assert col.offset == 0
        for c in _walk_columns(col):
            assert len(c.buffers) == len(c.spans)
            for buf, (_, n) in zip(c.buffers, c.spans, strict=True):
                assert (buf is None) == (n == 0)
                assert buf is None or (isinstance(buf, FakeDeviceArray) and buf.nbytes == n)
    assert_batch_equal(db.to_arrow(), batch, "DeviceBatch.to_arrow")
    return db


# --------------------------------------------------------------------------------------------------
# Round trips on the fake backend


@pytest.mark.parametrize("name", sorted(CASES))
def test_explicit_round_trip(name: str) -> None:
    _check_round_trip(CASES[name])


@SETTINGS
@given(S.schema_and_batch())
def test_generated_round_trip(case: tuple[pa.Schema, pa.RecordBatch]) -> None:
    _check_round_trip(case[1])


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(S.table_cases(max_depth=2))
def test_generated_tables_share_unchanged_dictionaries(case: S.TableCase) -> None:
    dbs = DeviceBatch.from_table(case.table) if case.batches else []
    assert len(dbs) == len(case.table.to_batches())
    got = [db.to_arrow() for db in dbs]
    assert_batches_equal(got, case.table.to_batches(), "from_table")
    if dbs:
        assert DeviceBatch.to_table(dbs).equals(case.table)
    # batches cut from one batch share their dictionaries: the uploads are shared too
    if case.shared and len(dbs) > 1:
        firsts = [{id(m.body) for m in db.messages[:-1]} for db in dbs]
        assert all(f == firsts[0] for f in firsts)


def test_transfers_are_one_per_message_body_and_to_arrow_copies() -> None:
    batch = CASES["nested_dictionaries"]
    up, down = FAKE.uploads, FAKE.downloads
    db = DeviceBatch.from_arrow(batch)
    nonempty = sum(1 for m in db.messages if m.body_length)
    assert len(db.messages) == 4  # dictionaries of both fields and the one inside the second, batch
    assert FAKE.uploads - up == nonempty
    host = db.to_arrow()
    assert FAKE.downloads - down == nonempty
    # the host batch does not alias device memory: scribbling over the bodies leaves it intact
    for m in db.messages:
        m.body.host[:] = 0xFF
    assert_batch_equal(host, batch)
    with pytest.raises(CodecError):  # and the device copy is now garbage, which to_arrow notices
        db.to_arrow()


def test_default_backend_and_explicit_backend() -> None:
    assert get_backend() is FAKE
    other = FakeDeviceBackend()
    db = DeviceBatch.from_arrow(CASES["binary"], backend=other)
    assert db.backend is other
    assert_batch_equal(db.to_arrow(), CASES["binary"])
    with pytest.raises(CodecError, match="device array of the 'fake' backend"):
        DeviceBatch(db.schema_metadata, [DeviceMessage(db.messages[0].metadata, b"\0" * 64)])


# --------------------------------------------------------------------------------------------------
# Column buffers against pyarrow's


def _pa_children(arr: pa.Array) -> list[pa.Array]:
    ty = arr.type
    if pa.types.is_struct(ty) or pa.types.is_union(ty):
        return [arr.field(i) for i in range(ty.num_fields)]
    if pa.types.is_run_end_encoded(ty):
        return [arr.run_ends, arr.values]
    if ty.num_fields == 1:  # lists, list views, fixed-size lists, maps
        return [arr.values]
    return []


def _compare_buffers(col: DeviceColumn, arr: pa.Array, where: str) -> int:
    """Compare a column's downloaded buffers with the pyarrow array's, recursively; returns how many."""
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    skip = 1 if pa.types.is_union(arr.type) or pa.types.is_null(arr.type) else 0  # pyarrow's placeholder
    theirs = arr.buffers()[skip : skip + len(col.buffers)]
    compared = 0
    for k, (mine, their) in enumerate(zip(col.buffers, theirs, strict=True)):
        if mine is None:
            absent_ok = their is None or their.size == 0 or len(arr) == 0 or (k == 0 and arr.null_count == 0)
            assert absent_ok, f"{where}[{k}]"
            continue
        got = FAKE.download(mine).tobytes()
        assert their is not None and got == their.to_pybytes()[: len(got)], f"{where} buffer {k}"
        compared += 1
    if isinstance(arr, pa.DictionaryArray):
        assert col.dictionary is not None and col.dictionary_id >= 0
        return compared + _compare_buffers(col.dictionary, arr.dictionary, f"{where}.dictionary")
    kids = _pa_children(arr)
    assert len(kids) == len(col.children), where
    for i, (c, a) in enumerate(zip(col.children, kids, strict=True)):
        compared += _compare_buffers(c, a, f"{where}.{i}")
    return compared


@pytest.mark.parametrize("name", UNSLICED)
def test_column_buffers_equal_pyarrow_buffers(name: str) -> None:
    batch = CASES[name]
    db = DeviceBatch.from_arrow(batch)
    compared = sum(
        _compare_buffers(db.column(i), batch.column(i), batch.schema.names[i])
        for i in range(batch.num_columns)
    )
    assert compared > 0 or batch.num_rows == 0


def test_column_accessors() -> None:
    batch = CASES["nested_dictionaries"]
    db = DeviceBatch.from_arrow(batch)
    col = db.column("dict_of_list_of_dict")
    assert col is db.columns[1] and col.name == "dict_of_list_of_dict"
    assert col.type == batch.schema.field(1).type and col.field.equals(batch.schema.field(1))
    assert (col.length, col.null_count, col.children) == (3, 1, [])
    assert col.dictionary is not None and col.dictionary_chunks == [col.dictionary]
    values = col.dictionary
    assert values.type == pa.list_(pa.field("item", pa.dictionary(pa.int8(), pa.string())))
    assert values.length == 2
    (items,) = values.children
    assert items.dictionary is not None and items.dictionary.type == pa.string()
    assert FAKE.download(items.dictionary.buffers[2]).tobytes()[:2] == b"pq"
    with pytest.raises(KeyError):
        db.column("nope")
    assert "DeviceBatch(rows=3" in repr(db) and "DeviceColumn('dict_of_list_of_dict'" in repr(col)


# --------------------------------------------------------------------------------------------------
# Typed views and the hand-off interfaces


def _expected_values(arr: pa.Array, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    if isinstance(arr, pa.DictionaryArray):
        arr = arr.indices
    if pa.types.is_temporal(arr.type):
        arr = arr.cast(pa.int32() if dtype.itemsize == 4 else pa.int64())
    return np.asarray(arr.drop_null().to_numpy(zero_copy_only=False))


TYPED = [
    ("primitives", ["i8", "u64", "f16", "f32", "f64", "date32", "date64", "time32", "time64", "ts", "dur"]),
    ("sliced", ["i"]),
    ("dictionaries", ["d", "du", "empty"]),
    ("extension", ["bool8"]),
    ("empty", ["i"]),
]


@pytest.mark.parametrize(("name", "columns"), TYPED, ids=[t[0] for t in TYPED])
def test_typed_views_equal_to_numpy(name: str, columns: list[str]) -> None:
    batch = CASES[name]
    db = DeviceBatch.from_arrow(batch)
    for c in columns:
        col, arr = db.column(c), batch.column(c)
        data = col.data
        assert isinstance(data, FakeDeviceArray)
        assert data.dtype == col.dtype and data.shape == (len(arr),), c
        assert col.data is data  # cached
        body = db.messages[-1].body
        assert data.data_ptr == body.data_ptr + col.spans[1][0] or len(arr) == 0, (
            f"{c}: not a view of the body"
        )
        got = FAKE.download(data.view(np.uint8)).view(data.dtype)
        valid = np.asarray(arr.is_valid(), bool)
        expected = _expected_values(arr, data.dtype)
        np.testing.assert_array_equal(got[valid], expected.astype(data.dtype, copy=False), err_msg=c)


@pytest.mark.parametrize(
    ("name", "column"),
    [("primitives", "b"), ("primitives", "dec"), ("primitives", "null"), ("binary", "s"), ("nested", "l"),
     ("extension", "uuid"), ("primitives", "mdn")],
)  # fmt: skip
def test_typed_view_refused_for_other_types(name: str, column: str) -> None:
    col = DeviceBatch.from_arrow(CASES[name]).column(column)
    assert col.dtype is None
    with pytest.raises(DeviceInterfaceError, match="no typed view"):
        _ = col.data
    with pytest.raises(TypeError):
        _ = col.__cuda_array_interface__


def test_fake_backend_refuses_cuda_array_interface_and_dlpack() -> None:
    col = DeviceBatch.from_arrow(CASES["primitives"]).column("f64")
    assert col.data is not None  # the typed view itself works
    with pytest.raises(DeviceInterfaceError, match="not in CUDA memory") as info:
        _ = col.__cuda_array_interface__
    assert isinstance(info.value, TypeError) and isinstance(info.value, DissocError)
    with pytest.raises(DeviceInterfaceError, match="DLPack"):
        col.__dlpack__()
    with pytest.raises(DeviceInterfaceError, match="DLPack"):
        col.__dlpack_device__()
    with pytest.raises(TypeError):
        memoryview(col.data)  # no buffer protocol either: the fake device memory stays behind the backend


# --------------------------------------------------------------------------------------------------
# DeviceDecoder: landing a stream's messages on the device


def _land(data: bytes, backend: Any = None) -> tuple[DeviceDecoder, list[DeviceBatch]]:
    """Read an IPC stream message by message; upload each body; decode on the device."""
    dec = DeviceDecoder(backend=backend)
    be = dec.backend
    out = []
    for msg in paipc.MessageReader.open_stream(pa.py_buffer(data)):
        body = msg.body
        dev = be.upload(body) if body is not None and body.size else be.empty(0)
        result = dec.decode(msg.metadata.to_pybytes(), None if msg.type == "schema" else dev)
        if msg.type == "record batch":
            assert isinstance(result, DeviceBatch)
            out.append(result)
        else:
            assert result is None
    return dec, out


def _dict_batch(values: list[str], indices: list[int | None]) -> pa.RecordBatch:
    arr = pa.DictionaryArray.from_arrays(pa.array(indices, pa.int16()), pa.array(values, pa.string()))
    lst = pa.ListArray.from_arrays(pa.array(range(len(indices) + 1), pa.int32()), arr.slice(0, len(indices)))
    return pa.RecordBatch.from_arrays([arr, lst], schema=DELTA_SCHEMA)


DELTA_SCHEMA = pa.schema(
    [
        pa.field("d", pa.dictionary(pa.int16(), pa.string())),
        pa.field("ld", pa.list_(pa.field("item", pa.dictionary(pa.int16(), pa.string())))),
    ]
)
DELTA_BATCHES = [
    _dict_batch(["a", "b"], [0, 1, None]),
    _dict_batch(["a", "b", "c"], [2, 2, 0]),  # delta ["c"]
    _dict_batch(["a", "b", "c", "d", "e"], [4, 3]),  # delta ["d", "e"]
    _dict_batch(["x"], [0]),  # replacement
    _dict_batch(["x", "y"], [1, None, 0]),  # delta ["y"]
    _dict_batch(["x", "y"], []),  # unchanged
]


def test_decoder_deltas_and_replacements_match_pyarrow() -> None:
    data = pa_write_stream(DELTA_SCHEMA, DELTA_BATCHES, emit_dictionary_deltas=True)
    stats = paipc.open_stream(data)
    stats.read_all()
    assert (stats.stats.num_dictionary_deltas, stats.stats.num_replaced_dictionaries) >= (3, 1)
    dec, got = _land(data)
    _, expected = pa_read_stream(data)
    assert dec.schema is not None and dec.schema.equals(DELTA_SCHEMA)
    assert_batches_equal([b.to_arrow() for b in got], expected, "DeviceDecoder vs pyarrow")
    assert_batches_equal([b.to_arrow() for b in got], DELTA_BATCHES, "DeviceDecoder vs input")
    # batch 2 needs both dictionaries' base and two deltas each; its column has one chunk per message
    col = got[2].column("d")
    assert col.dictionary is None
    assert [c.length for c in col.dictionary_chunks] == [2, 1, 2]
    assert sum(1 for m in got[2].messages if m.is_delta) == 4
    # after the replacement only the new dictionary is referenced
    col = got[3].column("d")
    assert col.dictionary is not None and col.dictionary.length == 1
    assert len(got[3].messages) == 3


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S.dictionary_sequences(), st.booleans())
def test_decoder_generated_dictionary_sequences(seq: S.DictSequence, deltas: bool) -> None:
    data = pa_write_stream(seq.schema, seq.batches, emit_dictionary_deltas=deltas)
    _, got = _land(data)
    _, expected = pa_read_stream(data)
    assert_batches_equal([b.to_arrow() for b in got], expected, "DeviceDecoder vs pyarrow")


@SETTINGS
@given(S.table_cases(max_depth=2))
def test_decoder_generated_streams(case: S.TableCase) -> None:
    data = pa_write_stream(case.schema, case.batches)
    _, got = _land(data)
    _, expected = pa_read_stream(data)
    assert_batches_equal([b.to_arrow() for b in got], expected, "DeviceDecoder vs pyarrow")
    for b in got:
        _check_layout(b)


def _nested_stream(*steps: tuple[Any, ...]) -> bytes:
    """A stream over fields "o" (dictionary 0 of lists of dictionary-1 strings) and "i" (dictionary 1).

    Steps: ``("d1", values, is_delta)``, ``("d0", [[dictionary-1 index, ...], ...])``, ``("b", o, i)``."""
    d1 = ipcgen.DictSpec(id=1, index_bits=32)
    item = ipcgen.FieldSpec("item", ipcgen.utf8(), dictionary=d1)
    fields = [
        ipcgen.FieldSpec(
            "o", ipcgen.list_(), children=(item,), dictionary=ipcgen.DictSpec(id=0, index_bits=32)
        ),
        ipcgen.FieldSpec("i", ipcgen.utf8(), dictionary=d1),
    ]
    messages = [(ipcgen.schema_message(fields), b"")]

    def i32(v: npt.ArrayLike) -> bytes:
        return np.array(v, "<i4").tobytes()

    for kind, *args in steps:
        if kind == "d1":
            values, delta = args
            offs = i32(np.concatenate([[0], np.cumsum([len(v) for v in values])]))
            body, spans = ipcgen.body(b"", offs, b"".join(values))
            meta = ipcgen.dictionary_message(
                1, len(values), [(len(values), 0)], spans, body_length=len(body), is_delta=delta
            )
        elif kind == "d0":
            (lists,) = args
            flat = [x for lst in lists for x in lst]
            offs = i32(np.concatenate([[0], np.cumsum([len(lst) for lst in lists])]))
            body, spans = ipcgen.body(b"", offs, b"", i32(flat))
            nodes = [(len(lists), 0), (len(flat), 0)]
            meta = ipcgen.dictionary_message(0, len(lists), nodes, spans, body_length=len(body))
        else:
            o, i = args
            body, spans = ipcgen.body(b"", i32(o), b"", i32(i))
            meta = ipcgen.record_batch_message(
                len(o), [(len(o), 0), (len(i), 0)], spans, body_length=len(body)
            )
        messages.append((meta, body))
    return ipcgen.stream(*messages)


def _nested_replacement_stream() -> bytes:
    """Dictionary 1 is replaced after dictionary 0 (which uses it) arrived: the batch sees the old
    dictionary 1 inside "o", the new one in "i"."""
    return _nested_stream(
        ("d1", [b"a", b"b"], False),
        ("d0", [[0, 1], [1]]),
        ("d1", [b"x", b"y", b"z"], False),
        ("b", [1, 0], [2, 0]),
    )


def test_decoder_nested_dictionary_replaced_after_use() -> None:
    data = _nested_replacement_stream()
    host = codec.open_stream(data).read_all().to_batches()
    assert host[0].column("o").to_pylist() == [["b"], ["a", "b"]]
    assert host[0].column("i").to_pylist() == ["z", "x"]
    _, got = _land(data)
    assert_batch_equal(got[0].to_arrow(), host[0])
    assert len(got[0].messages) == 4
    col_o = got[0].column("o")
    assert col_o.dictionary is not None
    inner = col_o.dictionary.children[0].dictionary
    assert inner is not None and inner.length == 2  # the old dictionary 1, as it was when "o" arrived
    col_i = got[0].column("i")
    assert col_i.dictionary is not None and col_i.dictionary.length == 3
    # and a DeviceEncoder reproduces a stream that reads the same
    enc = DeviceEncoder(got[0].schema, schema_metadata=got[0].schema_metadata)
    # (read by dissoc: pyarrow binds nested dictionaries when the batch is read, not when they arrive)
    assert_batch_equal(_read_encoded(enc, [got[0]], reader=codec.open_stream)[0], host[0])


def test_decoder_refuses_compressed_bodies() -> None:
    data = pa_write_stream(CASES["binary"].schema, [CASES["binary"]], compression="lz4")
    with pytest.raises(CodecError, match="uncompressed"):
        _land(data)


def _messages(batch: pa.RecordBatch) -> tuple[bytes, list[codec.EncodedMessage]]:
    enc = codec.MessageEncoder(batch.schema)
    return enc.schema_message().metadata, enc.encode(batch)


def _upload(m: codec.EncodedMessage) -> Any:
    return FAKE.upload(m.body) if m.body_length else FAKE.empty(0)


def test_decoder_rejects_bad_input() -> None:
    schema_meta, msgs = _messages(CASES["dictionaries"])
    *dicts, last = msgs
    dec = DeviceDecoder()
    with pytest.raises(CodecError):
        dec.decode(b"not a flatbuffer at all")
    with pytest.raises(CodecError, match="before the Schema"):
        dec.decode(last.metadata, _upload(last))
    assert dec.decode(schema_meta) is None
    with pytest.raises(CodecError, match="second Schema"):
        dec.decode(schema_meta)
    with pytest.raises(CodecError, match="used before any DictionaryBatch"):
        dec.decode(last.metadata, _upload(last))
    for m in dicts:
        assert dec.decode(m.metadata, _upload(m)) is None
    body = _upload(last)
    with pytest.raises(CodecError, match=r"expected \d+ bytes"):
        dec.decode(last.metadata, body[: last.body_length - 8])
    with pytest.raises(CodecError, match="device array"):
        dec.decode(last.metadata, last.body)
    with pytest.raises(CodecError, match="body is needed"):
        dec.decode(last.metadata)
    with pytest.raises(CodecError, match="uint8"):
        dec.decode(last.metadata, body.view(np.int64))
    # a longer body is fine: the message is cut to bodyLength
    longer = FAKE.upload(last.body + bytes(16))
    got = dec.decode(last.metadata, longer)
    assert got is not None and got.messages[-1].body_length == last.body_length
    assert_batch_equal(got.to_arrow(), CASES["dictionaries"])


def test_decoder_rejects_bad_dictionary_messages() -> None:
    schema = pa.schema([pa.field("d", pa.dictionary(pa.int16(), pa.string()))])
    values, offs = b"ab", np.array([0, 1, 2], "<i4").tobytes()
    body, spans = ipcgen.body(b"", offs, values)
    dec = DeviceDecoder()
    dec.decode(codec.MessageEncoder(schema).schema_message().metadata)
    unknown = ipcgen.dictionary_message(5, 2, [(2, 0)], spans, body_length=len(body))
    with pytest.raises(CodecError, match="not in the schema"):
        dec.decode(unknown, FAKE.upload(body))
    delta = ipcgen.dictionary_message(0, 2, [(2, 0)], spans, body_length=len(body), is_delta=True)
    with pytest.raises(CodecError, match="delta for id 0 before"):
        dec.decode(delta, FAKE.upload(body))


def _int_batch_metadata(
    length: int, spans: list[tuple[int, int]], body_length: int, nodes: Any = None
) -> bytes:
    nodes = np.array(nodes if nodes is not None else [(length, 0)], np.int64).reshape(-1, 2)
    return encode_record_batch(length, nodes, np.array(spans, np.int64).reshape(-1, 2), body_length)


INT_SCHEMA = pa.schema([pa.field("x", pa.int64())])


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        (_int_batch_metadata(3, [(0, 0), (8, 24)], 24), "outside the 24-byte body"),
        (_int_batch_metadata(3, [(0, 0), (0, 16)], 32), "holds 16 bytes, 24 are needed"),
        (_int_batch_metadata(3, [(0, 0)], 32), "needs 2 buffers"),
        (_int_batch_metadata(3, [(0, 0), (0, 24)], 32, [(3, 0), (3, 0)]), "1 field nodes"),
        (_int_batch_metadata(3, [(0, 0), (8, 24)], 32, [(3, 2)]), "holds 0 bytes, 1 are needed"),
    ],
    ids=["span-outside-body", "buffer-too-small", "buffer-count", "node-count", "validity-missing"],
)
def test_bad_metadata_is_codec_error(metadata: bytes, match: str) -> None:
    dec = DeviceDecoder()
    dec.decode(codec.MessageEncoder(INT_SCHEMA).schema_message().metadata)
    with pytest.raises(CodecError, match=match):
        dec.decode(metadata, FAKE.upload(bytes(64)))
    with pytest.raises(CodecError, match=match):
        field_layout(INT_SCHEMA, metadata)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_corrupted_metadata_gives_codec_error_or_a_batch(data: st.DataObject) -> None:
    schema_meta, msgs = _messages(CASES[data.draw(st.sampled_from(["primitives", "nested", "dictionaries"]))])
    meta = bytearray(msgs[-1].metadata)
    for _ in range(data.draw(st.integers(1, 4))):
        meta[data.draw(st.integers(0, len(meta) - 1))] = data.draw(st.integers(0, 255))
    dec = DeviceDecoder()
    dec.decode(schema_meta)
    try:
        for m in msgs[:-1]:
            dec.decode(m.metadata, _upload(m))
        got = dec.decode(bytes(meta), FAKE.upload(msgs[-1].body + bytes(64)))
        if got is not None:
            got.to_arrow()
            _ = [list(_walk_columns(c)) for c in got.columns]
    except CodecError:
        pass


# --------------------------------------------------------------------------------------------------
# DeviceEncoder


def _read_encoded(
    enc: DeviceEncoder, batches: list[DeviceBatch], counts: list[int] | None = None, reader: Any = None
) -> list[Any]:
    """Frame the encoder's messages (bodies downloaded) as a stream; read it with pyarrow (or ``reader``)."""
    parts = [ipcgen.frame(enc.schema_message().metadata)]
    for b in batches:
        msgs = enc.encode(b)
        if counts is not None:
            counts.append(len(msgs))
        for m in msgs:
            parts.append(ipcgen.frame(m.metadata, FAKE.download(m.body).tobytes() if m.body_length else b""))
    sink = io.BytesIO(b"".join(parts) + ipcgen.EOS)
    return list((reader or paipc.open_stream)(sink))


def test_encoder_sends_each_dictionary_once() -> None:
    schema = CASES["dictionaries"].schema
    table = pa.Table.from_batches([CASES["dictionaries"]] * 3)
    dbs = DeviceBatch.from_table(table)
    counts: list[int] = []
    got = _read_encoded(DeviceEncoder(schema), dbs, counts)
    assert counts == [4, 1, 1]  # three dictionaries once, then only the batches
    assert_batches_equal(got, table.to_batches())
    # independent uploads of equal dictionaries are different device bodies: sent again
    counts = []
    singles = [DeviceBatch.from_arrow(CASES["dictionaries"]) for _ in range(2)]
    assert_batches_equal(_read_encoded(DeviceEncoder(schema), singles, counts), [CASES["dictionaries"]] * 2)
    assert counts == [4, 4]
    assert DeviceEncoder(schema).schema_message().body is None


def test_encoder_replays_deltas_and_replacements() -> None:
    data = pa_write_stream(DELTA_SCHEMA, DELTA_BATCHES, emit_dictionary_deltas=True)
    _, got = _land(data)
    enc = DeviceEncoder(DELTA_SCHEMA, schema_metadata=got[0].schema_metadata)
    counts: list[int] = []
    assert_batches_equal(_read_encoded(enc, got, counts), DELTA_BATCHES, "re-encoded deltas")
    # base + base, delta + delta, delta + delta, replacement + replacement, delta + delta, nothing
    assert counts == [3, 3, 3, 3, 3, 1]
    # out of order: batch 4 after batch 5 needs nothing new; batch 1 after them needs a replacement chain
    enc = DeviceEncoder(DELTA_SCHEMA, schema_metadata=got[0].schema_metadata)
    order = [0, 4, 5, 1]
    counts = []
    assert_batches_equal(
        _read_encoded(enc, [got[i] for i in order], counts), [DELTA_BATCHES[i] for i in order]
    )
    assert counts[2] == 1


def test_encoder_resends_a_held_dictionary_chain_that_a_new_dictionary_was_decoded_inside() -> None:
    """Batch 1 needs [d1 base, d0 (decoded against the base only), d1 delta]; batch 2 [d1 base, d1 delta,
    d0' (against both)]. Sent after batch 2, batch 1's d0 must reach the receiver before the delta again."""
    data = _nested_stream(
        ("d1", [b"a", b"b"], False),
        ("d0", [[0, 1], [1]]),
        ("d1", [b"c"], True),
        ("b", [1, 0], [2, 0]),
        ("d0", [[2], [0]]),
        ("b", [0, 1], [1, 2]),
    )
    host = codec.open_stream(data).read_all().to_batches()
    assert host[0].column("o").dictionary.to_pylist() == [["a", "b"], ["b"]]
    assert len(host[0].column("o").dictionary.values.dictionary) == 2  # d0 saw only the base of d1
    _, got = _land(data)
    assert [len(b.messages) for b in got] == [4, 4]
    assert_batches_equal([b.to_arrow() for b in got], host)
    enc = DeviceEncoder(got[0].schema, schema_metadata=got[0].schema_metadata)
    counts: list[int] = []
    result = _read_encoded(enc, [got[1], got[0]], counts, reader=codec.open_stream)
    assert_batches_equal(result, [host[1], host[0]], "re-encoded out of order")
    assert counts == [4, 4]


def test_encoder_rejects_other_schemas() -> None:
    db = DeviceBatch.from_arrow(CASES["binary"])
    with pytest.raises(CodecError, match="does not match"):
        DeviceEncoder(CASES["primitives"].schema).encode(db)
    with pytest.raises(TypeError):
        DeviceEncoder("not a schema")
    # dictionary ids that differ from the encoder's
    _, got = _land(_nested_replacement_stream())
    with pytest.raises(CodecError, match="dictionary ids differ"):
        DeviceEncoder(got[0].schema).encode(got[0])


# --------------------------------------------------------------------------------------------------
# field_layout (dissoc.codec.layout)


def test_field_layout_of_known_batch() -> None:
    batch = pa.record_batch(
        {
            "a": pa.array([1, None, 3], pa.int32()),
            "u": pa.UnionArray.from_dense(
                pa.array([0, 0, 0], pa.int8()),
                pa.array([0, 1, 2], pa.int32()),
                [pa.array([1, 2, 3], pa.int8())],
            ),
            "r": pa.RunEndEncodedArray.from_arrays(pa.array([3], pa.int16()), pa.array(["z"])),
            "n": pa.nulls(3),
            "d": pa.array(["p", "p", "q"]).dictionary_encode(),
        }
    )
    _, msgs = _messages(batch)
    (dict_msg, last) = msgs
    a, u, r, n, d = field_layout(batch.schema, last.metadata)
    assert (a.layout, a.length, a.null_count, a.buffers) == (Layout.FIXED, 3, 1, ((0, 1), (8, 12)))
    assert a.width == 4 and a.type == pa.int32() and a.children == ()
    assert u.layout == Layout.DENSE_UNION and [s[1] for s in u.buffers] == [3, 12] and len(u.children) == 1
    assert u.children[0].buffers[1][1] == 3
    assert r.layout == Layout.RUN_END and r.buffers == () and [c.length for c in r.children] == [1, 1]
    assert n.layout == Layout.NULL and n.buffers == () and n.length == 3
    assert d.dictionary_id == 0 and d.layout == Layout.FIXED and d.width == 4 and d.children == ()
    (values,) = field_layout(batch.schema, dict_msg.metadata)
    assert values.type == pa.string() and values.length == 2 and values.dictionary_id == -1
    lay = message_layout(schema_info(batch.schema), dict_msg.metadata)
    assert lay.is_dictionary and lay.dictionary_id == 0 and not lay.is_delta and lay.length == 2
    with pytest.raises(CodecError, match="expected a RecordBatch or DictionaryBatch"):
        field_layout(batch.schema, codec.MessageEncoder(batch.schema).schema_message().metadata)
    with pytest.raises(CodecError, match="bodyLength"):
        message_layout(batch.schema, last.metadata, body_size=last.body_length - 1)


def test_field_layout_of_views_counts_variadic_buffers() -> None:
    _, msgs = _messages(CASES["views"])
    sv, bv = field_layout(CASES["views"].schema, msgs[-1].metadata)
    assert sv.layout == Layout.VIEW and len(sv.buffers) == 4  # validity, views, two data buffers
    assert len(bv.buffers) == 3


# --------------------------------------------------------------------------------------------------
# GPU: the same on CuPy, and the zero-copy hand-off


GPU_CASES = sorted(CASES)


@pytest.fixture
def cupy_backend() -> Iterator[Any]:
    from dissoc.memory.cuda import CupyBackend

    backend = CupyBackend()
    with use_backend(backend):
        yield backend


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu_round_trip(name: str, cupy_backend: Any) -> None:
    import cupy

    batch = CASES[name]
    db = DeviceBatch.from_arrow(batch)
    assert db.backend is cupy_backend
    assert all(isinstance(m.body, cupy.ndarray) for m in db.messages)
    _check_layout(db)
    assert_batch_equal(db.to_arrow(), batch, "to_arrow on CuPy")


@pytest.mark.gpu
def test_gpu_decoder_lands_stream(cupy_backend: Any) -> None:
    data = pa_write_stream(DELTA_SCHEMA, DELTA_BATCHES, emit_dictionary_deltas=True)
    _, got = _land(data, cupy_backend)
    assert_batches_equal([b.to_arrow() for b in got], DELTA_BATCHES, "DeviceDecoder on CuPy")


@pytest.mark.gpu
@pytest.mark.parametrize("column", ["i8", "u64", "f16", "f32", "f64", "date32", "ts", "dur"])
def test_gpu_zero_copy_handoff(column: str, cupy_backend: Any) -> None:
    import cupy

    batch = CASES["primitives"]
    db = DeviceBatch.from_arrow(batch)
    col = db.column(column)
    data = col.data
    assert isinstance(data, cupy.ndarray) and data.dtype == col.dtype and data.shape == (col.length,)
    body = db.messages[-1].body
    assert data.data.ptr == body.data.ptr + col.spans[1][0]
    cai = col.__cuda_array_interface__
    assert cai["version"] == 3 and cai["strides"] is None and "mask" not in cai
    assert cai["shape"] == (col.length,) and cai["data"][0] == data.data.ptr
    via_cai = cupy.asarray(col)
    assert via_cai.data.ptr == data.data.ptr
    via_dlpack = cupy.from_dlpack(col)
    assert via_dlpack.data.ptr == data.data.ptr
    arr = batch.column(column)
    valid = np.asarray(arr.is_valid(), bool)
    expected = _expected_values(arr, data.dtype).astype(data.dtype, copy=False)
    np.testing.assert_array_equal(cupy.asnumpy(via_cai)[valid], expected)
    np.testing.assert_array_equal(cupy.asnumpy(via_dlpack)[valid], expected)
    assert col.__dlpack_device__()[0] == 2  # kDLCUDA


@pytest.mark.gpu
def test_gpu_torch_takes_columns_without_copy(cupy_backend: Any) -> None:
    torch = pytest.importorskip("torch")
    batch = pa.record_batch(
        {"x": pa.array(np.arange(1000, dtype=np.int64)), "y": pa.array(np.ones(1000, np.float32))}
    )
    db = DeviceBatch.from_arrow(batch)
    for name in ("x", "y"):
        col = db.column(name)
        t = torch.from_dlpack(col)
        assert t.is_cuda and t.data_ptr() == col.data.data.ptr
        np.testing.assert_array_equal(t.cpu().numpy(), batch.column(name).to_numpy())


# --------------------------------------------------------------------------------------------------
# The Arrow C Device Data Interface (dissoc.device.cdevice), against pyarrow's implementation of it

#: Cases whose every column crosses the interface (view types are refused, both ways, on the device).
CDEVICE_CASES = sorted(k for k in CASES if k not in ("binary", "views"))


def _device_struct(capsule: Any) -> tuple[int, int, int]:
    """(device_id, device_type, sync_event) of an arrow_device_array capsule."""
    import ctypes

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = get(capsule, b"arrow_device_array")
    return (
        ctypes.c_int64.from_address(address + 80).value,
        ctypes.c_int32.from_address(address + 88).value,
        ctypes.c_uint64.from_address(address + 96).value,
    )


@pytest.mark.parametrize("name", CDEVICE_CASES)
def test_device_array_export_is_read_by_pyarrow(name: str) -> None:
    """The fake device is host memory, so the exported ArrowDeviceArray says ARROW_DEVICE_CPU (device id
    -1, no event, as pyarrow writes them) and pyarrow imports it: no copy, the batch's own bodies."""
    batch = CASES[name]
    db = DeviceBatch.from_arrow(batch)
    schema_capsule, array_capsule = db.__arrow_c_device_array__()
    assert _device_struct(array_capsule) == (-1, 1, 0)
    got = pa.RecordBatch._import_from_c_device_capsule(schema_capsule, array_capsule)
    assert_batch_equal(got, db.to_arrow(), f"{name}: pyarrow's import of the export")
    # zero copy: the columns' own last buffers are inside the batch's body
    body = FAKE.pointer(db.messages[-1].body)
    for k, col in enumerate(db.columns):
        if col.layout.layout in (Layout.FIXED, Layout.BOOL) and col.spans[1][1] and col.dictionary_id < 0:
            address = got.column(k).buffers()[1].address
            assert body <= address < body + db.messages[-1].body_length, col.name


@pytest.mark.parametrize("name", CDEVICE_CASES)
def test_device_array_import_from_pyarrow_and_from_a_device_batch(name: str) -> None:
    batch = CASES[name]
    before = FAKE.uploads
    from_pyarrow = DeviceBatch.from_arrow_device(batch)
    walked = FAKE.uploads == before  # device-to-device copies only; sliced host arrays go through pyarrow
    assert walked or "sliced" in name or name == "ree"
    want = DeviceBatch.from_arrow(batch).to_arrow()
    assert_batch_equal(from_pyarrow.to_arrow(), want, f"{name} from pyarrow")
    db = DeviceBatch.from_arrow(batch)
    before = FAKE.uploads
    again = DeviceBatch.from_arrow_device(db)
    assert FAKE.uploads == before
    assert again.messages[-1].body is not db.messages[-1].body  # a copy, in IPC layout
    _check_layout(again)
    assert_batch_equal(again.to_arrow(), db.to_arrow(), f"{name} from a device batch")


def test_device_array_export_keeps_the_batch_alive_until_released() -> None:
    import gc
    import weakref

    batch = CASES["nested"]
    db = DeviceBatch.from_arrow(batch)
    gone = weakref.ref(db)
    schema_capsule, array_capsule = db.__arrow_c_device_array__()
    del db
    gc.collect()
    assert gone() is not None  # the unconsumed capsule holds it
    got = pa.RecordBatch._import_from_c_device_capsule(schema_capsule, array_capsule)
    del array_capsule
    gc.collect()
    assert gone() is not None  # now pyarrow's batch does
    assert_batch_equal(got, batch, "nested")
    del got
    gc.collect()
    assert gone() is None
    db = DeviceBatch.from_arrow(batch)
    gone = weakref.ref(db)
    capsules = db.__arrow_c_device_array__()
    del db, capsules  # never consumed: the capsule's destructor releases it
    gc.collect()
    assert gone() is None


def test_device_array_refusals() -> None:
    views = DeviceBatch.from_arrow(CASES["views"])
    with pytest.raises(DeviceInterfaceError, match="view types"):
        views.__arrow_c_device_array__()
    db = DeviceBatch.from_arrow(CASES["primitives"])
    with pytest.raises(NotImplementedError, match="stream"):
        db.__arrow_c_device_array__(stream=7)
    assert db.__arrow_c_device_array__(stream=None)  # a keyword left at None is fine
    with pytest.raises(DeviceInterfaceError, match="exports no Arrow device array"):
        DeviceBatch.from_arrow_device(42)

    class Cuda(CountingBackend):
        def arrow_device(self) -> tuple[int, int]:
            return 2, 0  # ARROW_DEVICE_CUDA

    on_gpu = DeviceBatch.from_arrow(CASES["primitives"], backend=Cuda())
    with pytest.raises(DeviceInterfaceError, match="device type 2"):
        DeviceBatch.from_arrow_device(on_gpu)
    assert pa.schema(on_gpu).equals(on_gpu.schema)  # __arrow_c_schema__


def test_device_array_delta_dictionaries_are_refused() -> None:
    data = pa_write_stream(DELTA_SCHEMA, DELTA_BATCHES, emit_dictionary_deltas=True)
    _, got = _land(data, FAKE)
    extended = [b for b in got if any(len(c.dictionary_chunks) > 1 for c in b.columns)]
    assert extended, "the stream should extend a dictionary by a delta"
    with pytest.raises(DeviceInterfaceError, match="delta"):
        extended[0].__arrow_c_device_array__()


@pytest.mark.gpu
@pytest.mark.parametrize("name", CDEVICE_CASES)
def test_gpu_device_array_round_trip(name: str, cupy_backend: Any) -> None:
    """On CuPy: ARROW_DEVICE_CUDA on the current device, with an event to wait on; imported back by a copy
    on the device, equal."""
    import cupy

    db = DeviceBatch.from_arrow(CASES[name])
    schema_capsule, array_capsule = db.__arrow_c_device_array__()
    device_id, device_type, event = _device_struct(array_capsule)
    assert (device_id, device_type) == (cupy.cuda.runtime.getDevice(), 2) and event != 0

    class Producer:
        def __arrow_c_device_array__(self, requested_schema: Any = None, **kwargs: Any) -> Any:
            return schema_capsule, array_capsule

    again = DeviceBatch.from_arrow_device(Producer())
    assert all(isinstance(m.body, cupy.ndarray) for m in again.messages)
    assert_batch_equal(again.to_arrow(), db.to_arrow(), f"{name} through the device interface")
