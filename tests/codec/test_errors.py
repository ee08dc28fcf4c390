"""Targeted malformed input, built message by message with the flatbuffers Builder (tests/codec/ipcgen.py).

Each case must raise ``CodecError`` from every entry point that sees it (``open_stream`` + ``read_all`` and
``MessageDecoder.decode`` for messages; ``open_file`` + ``get_batch`` for files) and nothing else. As a
check on the test itself, pyarrow must reject each case too (unless marked as one pyarrow lets through, where
the reason is given).
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import lz4.frame
import numpy as np
import pyarrow as pa
import pyarrow.ipc as paipc
import pytest
import zstandard
from helpers import ipcgen as g
from helpers.codec import assert_batches_equal, assert_schema_equal

from dissoc import codec
from dissoc.errors import CodecError, DissocError

pytestmark = pytest.mark.timeout(30)

Msg = tuple[bytes, bytes]


def i32(*values: int) -> bytes:
    return np.array(values, "<i4").tobytes()


def i64(*values: int) -> bytes:
    return np.array(values, "<i8").tobytes()


def schema(*fields: g.FieldSpec, **kw: object) -> Msg:
    return g.schema_message(list(fields), **kw), b""  # type: ignore[arg-type]


def batch(
    length: int,
    nodes: list[tuple[int, int]],
    *buffers: bytes,
    spans: list[tuple[int, int]] | None = None,
    body_length: int | None = None,
    body: bytes | None = None,
    **kw: object,
) -> Msg:
    laid, laid_spans = g.body(*buffers)
    md = g.record_batch_message(
        length,
        nodes,
        laid_spans if spans is None else spans,
        body_length=len(laid) if body_length is None else body_length,
        **kw,  # type: ignore[arg-type]
    )
    return md, laid if body is None else body


def dictionary(dict_id: int, length: int, nodes: list[tuple[int, int]], *buffers: bytes, **kw: object) -> Msg:
    laid, spans = g.body(*buffers)
    return g.dictionary_message(dict_id, length, nodes, spans, body_length=len(laid), **kw), laid  # type: ignore[arg-type]


def utf8_values(*values: bytes) -> tuple[bytes, bytes]:
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype("<i4").tobytes()
    return offsets, b"".join(values)


A_I32 = g.FieldSpec("a", g.int_(32))
A_UTF8 = g.FieldSpec("s", g.utf8())
DICT_FIELD = g.FieldSpec("d", g.utf8(), dictionary=g.DictSpec(id=0, index_bits=32))
GOOD_SCHEMA = schema(A_I32)
GOOD_BATCH = batch(3, [(3, 0)], b"", i32(1, 2, 3))


def pyarrow_rejects_stream(data: bytes) -> bool:
    try:
        for b in paipc.open_stream(pa.py_buffer(data)):
            b.validate(full=True)
    except (pa.ArrowException, OSError, ValueError):
        return True
    return False


def pyarrow_rejects_file(data: bytes) -> bool:
    try:
        r = paipc.open_file(pa.py_buffer(data))
        for i in range(r.num_record_batches):
            r.get_batch(i).validate(full=True)
    except (pa.ArrowException, OSError, ValueError):
        return True
    return False


def expect_codec_error(fn: Callable[[], object], what: str) -> CodecError:
    try:
        fn()
    except CodecError as exc:
        assert str(exc), f"{what}: CodecError without a message"
        return exc
    except Exception as exc:
        pytest.fail(f"{what}: raised {type(exc).__name__} instead of CodecError: {exc!r}")
    pytest.fail(f"{what}: accepted malformed input")


def decode_all(msgs: list[Msg]) -> list[pa.RecordBatch]:
    dec = codec.MessageDecoder()
    return [b for md, body in msgs if (b := dec.decode(md, body)) is not None]


@dataclass
class Case:
    msgs: list[Msg]
    pyarrow_lenient: str = ""  # why pyarrow lets it through, if it does
    eos: bool = True  # end the stream form with the EOS marker


def _utf8_case(offsets: bytes, data: bytes, length: int = 3) -> Case:
    return Case([schema(A_UTF8), batch(length, [(length, 0)], b"", offsets, data)])


def _lz4(data: bytes) -> bytes:
    return bytes(lz4.frame.compress(data))


def _compressed_i32(prefix: int, payload: bytes, codec_id: int = g.LZ4_FRAME, method: int = 0) -> Case:
    return Case(
        [
            GOOD_SCHEMA,
            batch(3, [(3, 0)], b"", struct.pack("<q", prefix) + payload, compression=(codec_id, method)),
        ]
    )


def _compressed_utf8_data(prefix: int) -> Case:
    """A compressed utf8 column whose data buffer claims ``prefix`` uncompressed bytes."""
    offsets, data = utf8_values(b"a", b"bc", b"")
    packed_offsets = struct.pack("<q", len(offsets)) + _lz4(offsets)
    packed_data = struct.pack("<q", prefix) + _lz4(data)
    return Case(
        [schema(A_UTF8), batch(3, [(3, 0)], b"", packed_offsets, packed_data, compression=(g.LZ4_FRAME, 0))]
    )


def _union_field(mode: int, ids: list[int]) -> g.FieldSpec:
    return g.FieldSpec(
        "u", g.union(mode, ids), children=(g.FieldSpec("x", g.int_(32)), g.FieldSpec("y", g.int_(8)))
    )


def _view_case(view: bytes, data: bytes, variadic: list[int] | None) -> Case:
    f = g.FieldSpec("v", g.utf8_view())
    bufs = [b"", view] + ([data] if variadic is None or variadic != [0] else [])
    return Case([schema(f), batch(1, [(1, 0)], *bufs, variadic=variadic)])


def _long_view(length: int, index: int, offset: int) -> bytes:
    return struct.pack("<i4sii", length, b"abcd", index, offset)


LIST_FIELD = g.FieldSpec("l", g.list_(), children=(g.FieldSpec("item", g.int_(32)),))
STRUCT_FIELD = g.FieldSpec("st", g.struct_(), children=(g.FieldSpec("a", g.int_(32)),))
FSL_FIELD = g.FieldSpec("f", g.fixed_size_list(2), children=(g.FieldSpec("item", g.int_(32)),))
REE_FIELD = g.FieldSpec(
    "r",
    g.run_end_encoded(),
    children=(g.FieldSpec("run_ends", g.int_(32), nullable=False), g.FieldSpec("values", g.int_(32))),
)
DICT_VALUES = dictionary(0, 2, [(2, 0)], b"", *utf8_values(b"a", b"b"))


MESSAGE_CASES: dict[str, Case] = {
    # framing and bodies
    # (no EOS after it, or the stream reader would take the EOS bytes as the rest of the body)
    "body-shorter-than-bodyLength": Case([GOOD_SCHEMA, (GOOD_BATCH[0], GOOD_BATCH[1][:8])], eos=False),
    "buffer-beyond-body": Case(
        [GOOD_SCHEMA, batch(3, [(3, 0)], b"", i32(1, 2, 3), spans=[(0, 0), (16, 12)])]
    ),
    "buffer-negative-offset": Case(
        [GOOD_SCHEMA, batch(3, [(3, 0)], b"", i32(1, 2, 3), spans=[(0, 0), (-8, 12)])]
    ),
    "buffer-negative-length": Case(
        [GOOD_SCHEMA, batch(3, [(3, 0)], b"", i32(1, 2, 3), spans=[(0, 0), (0, -12)])]
    ),
    "buffer-offset-overflow": Case(
        [GOOD_SCHEMA, batch(3, [(3, 0)], b"", i32(1, 2, 3), spans=[(0, 0), (2**63 - 8, 16)])]
    ),
    "negative-bodyLength": Case([GOOD_SCHEMA, batch(3, [(3, 0)], b"", i32(1, 2, 3), body_length=-16)]),
    # nodes
    "too-few-nodes": Case(
        [schema(A_I32, g.FieldSpec("b", g.int_(32))), batch(3, [(3, 0)], b"", i32(1, 2, 3))]
    ),
    "too-few-buffers": Case([GOOD_SCHEMA, batch(3, [(3, 0)], b"")]),
    "negative-node-length": Case([GOOD_SCHEMA, batch(3, [(-1, 0)], b"", i32(1, 2, 3))]),
    "negative-batch-length": Case([GOOD_SCHEMA, batch(-3, [(3, 0)], b"", i32(1, 2, 3))]),
    "node-length-differs-from-batch": Case([GOOD_SCHEMA, batch(3, [(4, 0)], b"", i32(1, 2, 3, 4))]),
    "null-count-exceeds-length": Case([GOOD_SCHEMA, batch(3, [(3, 5)], b"\x00", i32(1, 2, 3))]),
    # (-1 is what Arrow C++ uses for "unknown", and pyarrow accepts it; -2 is plainly invalid)
    "negative-null-count": Case([GOOD_SCHEMA, batch(3, [(3, -2)], b"\x07", i32(1, 2, 3))]),
    "validity-too-short": Case([GOOD_SCHEMA, batch(100, [(100, 1)], b"\xfe", i32(*range(100)))]),
    "values-too-short": Case([GOOD_SCHEMA, batch(3, [(3, 0)], b"", i32(1, 2))]),
    "bool-values-too-short": Case([schema(g.FieldSpec("b", g.bool_())), batch(20, [(20, 0)], b"", b"\x01")]),
    # offsets
    "utf8-offsets-too-short": _utf8_case(i32(0, 1), b"abc"),
    "utf8-offsets-non-monotonic": _utf8_case(i32(0, 3, 1, 4), b"abcd"),
    "utf8-offsets-beyond-data": _utf8_case(i32(0, 1, 2, 100), b"abc"),
    "utf8-offsets-negative": _utf8_case(i32(-4, 0, 1, 2), b"abc"),
    "list-offsets-beyond-child": Case(
        [schema(LIST_FIELD), batch(2, [(2, 0), (3, 0)], b"", i32(0, 2, 9), b"", i32(1, 2, 3))]
    ),
    "list-offsets-non-monotonic": Case(
        [schema(LIST_FIELD), batch(2, [(2, 0), (3, 0)], b"", i32(0, 3, 1), b"", i32(1, 2, 3))]
    ),
    "fixed-size-list-child-too-short": Case(
        [schema(FSL_FIELD), batch(3, [(3, 0), (4, 0)], b"", b"", i32(1, 2, 3, 4))]
    ),
    "struct-child-shorter-than-parent": Case(
        [schema(STRUCT_FIELD), batch(3, [(3, 0), (2, 0)], b"", b"", i32(1, 2))]
    ),
    # dictionaries
    "dictionary-index-out-of-range": Case(
        [schema(DICT_FIELD), DICT_VALUES, batch(3, [(3, 0)], b"", i32(0, 5, 1))]
    ),
    "dictionary-index-negative": Case(
        [schema(DICT_FIELD), DICT_VALUES, batch(3, [(3, 0)], b"", i32(0, -1, 1))]
    ),
    "dictionary-missing": Case([schema(DICT_FIELD), batch(3, [(3, 0)], b"", i32(0, 1, 1))]),
    "dictionary-unknown-id": Case(
        [
            schema(DICT_FIELD),
            dictionary(99, 2, [(2, 0)], b"", *utf8_values(b"a", b"b")),
            batch(3, [(3, 0)], b"", i32(0, 1, 1)),
        ]
    ),
    "dictionary-delta-without-base": Case(
        [
            schema(DICT_FIELD),
            dictionary(0, 2, [(2, 0)], b"", *utf8_values(b"a", b"b"), is_delta=True),
            batch(3, [(3, 0)], b"", i32(0, 1, 1)),
        ]
    ),
    # unions
    "sparse-union-unknown-type-id": Case(
        [
            schema(_union_field(0, [3, 7])),
            batch(3, [(3, 0), (3, 0), (3, 0)], b"\x03\x05\x07", b"", i32(1, 2, 3), b"", b"\x01\x02\x03"),
        ]
    ),
    "dense-union-offset-beyond-child": Case(
        [
            schema(_union_field(1, [0, 1])),
            batch(3, [(3, 0), (2, 0), (1, 0)], b"\x00\x00\x01", i32(0, 5, 0), b"", i32(1, 2), b"", b"\x01"),
        ]
    ),
    "dense-union-negative-offset": Case(
        [
            schema(_union_field(1, [0, 1])),
            batch(3, [(3, 0), (2, 0), (1, 0)], b"\x00\x00\x01", i32(0, -1, 0), b"", i32(1, 2), b"", b"\x01"),
        ]
    ),
    # the format requires each child's offsets to increase; pyarrow's reader does not check, its full
    # validation does
    "dense-union-offsets-decreasing": Case(
        [
            schema(_union_field(1, [0, 1])),
            batch(3, [(3, 0), (2, 0), (1, 0)], b"\x00\x00\x01", i32(1, 0, 0), b"", i32(1, 2), b"", b"\x01"),
        ]
    ),
    # run-end encoded
    "ree-run-ends-not-increasing": Case(
        [schema(REE_FIELD), batch(3, [(3, 0), (3, 0), (3, 0)], b"", i32(2, 2, 3), b"", i32(7, 8, 9))]
    ),
    "ree-run-ends-short-of-length": Case(
        [schema(REE_FIELD), batch(3, [(3, 0), (2, 0), (2, 0)], b"", i32(1, 2), b"", i32(7, 8))]
    ),
    # views
    "view-buffer-index-out-of-range": _view_case(_long_view(20, 3, 0), b"abcd" * 8, [1]),
    "view-range-beyond-buffer": _view_case(_long_view(20, 0, 100), b"abcd" * 8, [1]),
    "view-negative-length": _view_case(struct.pack("<i", -5) + bytes(12), b"", [0]),
    "view-variadic-count-huge": _view_case(_long_view(20, 0, 0), b"abcd" * 8, [1 << 40]),
    "view-variadic-count-negative": _view_case(_long_view(20, 0, 0), b"abcd" * 8, [-1]),
    # compression
    "compression-unknown-codec": _compressed_i32(12, i32(1, 2, 3), codec_id=7),
    "compression-unknown-method": _compressed_i32(12, _lz4(i32(1, 2, 3)), method=5),
    "lz4-garbage": _compressed_i32(12, b"\x00garbage-not-a-frame"),
    "zstd-garbage": _compressed_i32(12, b"\x00garbage-not-a-frame", codec_id=g.ZSTD),
    "decompressed-length-mismatch": _compressed_i32(100, _lz4(i32(1, 2, 3))),
    "decompressed-length-huge": _compressed_i32(2**62, _lz4(i32(1, 2, 3))),
    # 4 GiB claimed by 8 bytes: must be refused before allocating (the peak-memory check below)
    "decompressed-length-4gib": _compressed_i32(2**32 - 1, _lz4(i32(1, 2, 3))),
    "zstd-decompressed-length-4gib": _compressed_i32(
        2**32 - 1, zstandard.ZstdCompressor().compress(i32(1, 2, 3)), codec_id=g.ZSTD
    ),
    "zstd-decompressed-length-huge": _compressed_i32(
        2**62, zstandard.ZstdCompressor().compress(i32(1, 2, 3)), codec_id=g.ZSTD
    ),
    # a variable-size data buffer: its size is not implied by the node length, yet must be bounded
    "utf8-data-decompressed-length-4gib": _compressed_utf8_data(2**32 - 1),
    "utf8-data-decompressed-length-huge": _compressed_utf8_data(2**62),
    "compressed-buffer-without-prefix": Case(
        [GOOD_SCHEMA, batch(3, [(3, 0)], b"", b"\x01\x02\x03", compression=(g.LZ4_FRAME, 0))]
    ),
    # message sequence and headers
    "record-batch-before-schema": Case([GOOD_BATCH]),
    "dictionary-before-schema": Case([DICT_VALUES, GOOD_SCHEMA]),
    "schema-twice": Case([GOOD_SCHEMA, GOOD_SCHEMA, GOOD_BATCH]),
    "header-type-unknown": Case([GOOD_SCHEMA, (g.bare_message(42), b"")]),
    "header-type-none": Case([GOOD_SCHEMA, (g.bare_message(g.Header.NONE, empty_header=False), b"")]),
    "header-tensor": Case([GOOD_SCHEMA, (g.bare_message(g.Header.TENSOR, body_length=8), bytes(8))]),
    "header-sparse-tensor": Case(
        [GOOD_SCHEMA, (g.bare_message(g.Header.SPARSE_TENSOR, body_length=8), bytes(8))]
    ),
    "record-batch-header-missing": Case(
        [GOOD_SCHEMA, (g.bare_message(g.Header.RECORD_BATCH, empty_header=False), b"")]
    ),
    # metadata before V4 (Arrow < 0.8) is not supported, by pyarrow either
    "metadata-version-v1": Case([(g.schema_message([A_I32], version=0), b""), GOOD_BATCH]),
    "metadata-version-v3": Case([(g.schema_message([A_I32], version=2), b""), GOOD_BATCH]),
    "metadata-version-future": Case([GOOD_SCHEMA, batch(3, [(3, 0)], b"", i32(1, 2, 3), version=5)]),
    "metadata-garbage": Case([GOOD_SCHEMA, (bytes(range(7, 71)), b"")]),
    "metadata-too-short": Case([GOOD_SCHEMA, (b"\x01\x02\x03", b"")]),
    "metadata-root-offset-outside": Case([(struct.pack("<I", 1 << 30) + bytes(12), b"")]),
}

# --- schemas that are malformed or unsupported: the schema message alone must be rejected -------------------


def _f(t: g.TypeSpec, *children: g.FieldSpec) -> g.FieldSpec:
    return g.FieldSpec("x", t, children=children)


INT_CHILD = g.FieldSpec("i", g.int_(32))
SCHEMA_CASES: dict[str, g.FieldSpec] = {
    "type-id-unknown": _f(g.raw_type(99)),
    "type-id-none": _f(g.raw_type(g.TypeId.NONE)),
    "int-bitwidth-7": _f(g.int_(7)),
    "int-bitwidth-128": _f(g.int_(128)),
    "float-precision-7": _f(g.float_(7)),
    "decimal-bitwidth-100": _f(g.decimal(10, 2, 100)),
    "decimal128-precision-0": _f(g.decimal(0, 0, 128)),
    "decimal128-precision-39": _f(g.decimal(39, 0, 128)),
    "decimal32-precision-10": _f(g.decimal(10, 0, 32)),
    "time32-nanoseconds": _f(g.time_(3, 32)),
    "time64-seconds": _f(g.time_(0, 64)),
    "time-bitwidth-16": _f(g.time_(1, 16)),
    "date-unit-5": _f(g.date(5)),
    "timestamp-unit-9": _f(g.timestamp(9)),
    "duration-unit-9": _f(g.TypeSpec(g.TypeId.DURATION, ((0, "h", 9),))),
    "interval-unit-9": _f(g.interval(9)),
    "fixed-size-binary-negative": _f(g.fixed_size_binary(-1)),
    "fixed-size-list-negative": _f(g.fixed_size_list(-1), INT_CHILD),
    "list-without-child": _f(g.list_()),
    "list-two-children": _f(g.list_(), INT_CHILD, INT_CHILD),
    "large-list-without-child": _f(g.large_list()),
    "map-without-child": _f(g.map_()),
    "map-child-not-struct": _f(g.map_(), INT_CHILD),
    "map-struct-one-field": _f(
        g.map_(), g.FieldSpec("entries", g.struct_(), nullable=False, children=(INT_CHILD,))
    ),
    "union-mode-3": _f(g.union(3, [0]), INT_CHILD),
    "union-type-ids-mismatch": _f(g.union(0, [0, 1]), INT_CHILD),
    "ree-one-child": _f(g.run_end_encoded(), INT_CHILD),
    "ree-run-ends-float": _f(
        g.run_end_encoded(),
        g.FieldSpec("run_ends", g.float_(2), nullable=False),
        g.FieldSpec("values", g.int_(32)),
    ),
    "dictionary-index-bitwidth-7": g.FieldSpec("d", g.utf8(), dictionary=g.DictSpec(0, index_bits=7)),
    "primitive-with-children": _f(g.int_(32), INT_CHILD),
}
# Malformed by the format, yet pyarrow makes something of them (the right answer is still CodecError):
SCHEMA_PYARROW_LENIENT = {
    "date-unit-5": "pyarrow reads it as date64",
    "duration-unit-9": "pyarrow reads it as duration[s]",
    "timestamp-unit-9": "pyarrow reads it as timestamp[s]",
    "float-precision-7": "pyarrow reads it as double",
    "fixed-size-list-negative": "pyarrow builds fixed_size_list[-1]",
    "primitive-with-children": "pyarrow ignores the children",
    "union-mode-3": "pyarrow reads it as a dense union",
}


def _deep(levels: int) -> g.FieldSpec:
    f = g.FieldSpec("leaf", g.int_(32))
    for _ in range(levels):
        f = g.FieldSpec("l", g.list_(), children=(f,))
    return f


def _exponential(levels: int) -> g.FieldSpec:
    """A struct tree whose two children are one shared table at each level: 2**levels leaves, tiny bytes."""
    f = g.FieldSpec("leaf", g.int_(32))
    for _ in range(levels):
        f = g.FieldSpec("s", g.struct_(), children=(f, f))
    return f


# --------------------------------------------------------------------------------------------------
# Tests


def test_builder_baseline_is_valid() -> None:
    """The unmodified messages the cases start from are read the same by pyarrow and dissoc."""
    msgs = [
        schema(A_I32, A_UTF8, DICT_FIELD, LIST_FIELD),
        DICT_VALUES,
        batch(
            3,
            [(3, 0), (3, 0), (3, 0), (3, 0), (4, 0)],
            b"",
            i32(1, 2, 3),
            b"",
            *utf8_values(b"x", b"", b"yz"),
            b"",
            i32(1, 0, 1),
            b"",
            i32(0, 1, 1, 4),
            b"",
            i32(5, 6, 7, 8),
        ),
    ]
    data = g.stream(*msgs)
    expected = pa.ipc.open_stream(data).read_all()
    assert expected.column("l").to_pylist() == [[5], [], [6, 7, 8]]
    got = codec.open_stream(data).read_all()
    assert_schema_equal(got.schema, expected.schema)
    assert got.equals(expected)
    assert_batches_equal(decode_all(msgs), expected.to_batches())


@pytest.mark.parametrize("name", sorted(MESSAGE_CASES))
def test_malformed_messages(name: str) -> None:
    case = MESSAGE_CASES[name]
    data = g.stream(*case.msgs, eos=case.eos)
    if not case.pyarrow_lenient:
        assert pyarrow_rejects_stream(data), f"test bug? pyarrow accepts case {name}"
    tracemalloc.start()
    try:
        expect_codec_error(lambda: decode_all(case.msgs), "MessageDecoder")
        expect_codec_error(lambda: codec.open_stream(data).read_all(), "open_stream().read_all()")
        expect_codec_error(lambda: list(codec.open_stream(data)), "iterating open_stream()")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{name}: peak traced allocation {peak >> 20} MiB"


@pytest.mark.parametrize("name", sorted(SCHEMA_CASES))
def test_malformed_schemas(name: str) -> None:
    md = g.schema_message([SCHEMA_CASES[name]])
    data = g.stream((md, b""))
    if name not in SCHEMA_PYARROW_LENIENT:
        assert pyarrow_rejects_stream(data), f"test bug? pyarrow accepts schema case {name}"
    expect_codec_error(lambda: codec.MessageDecoder().decode(md, b""), "MessageDecoder")
    expect_codec_error(lambda: codec.open_stream(data).read_all(), "open_stream().read_all()")


def test_schema_endianness_out_of_range() -> None:
    md = g.schema_message([A_I32], endianness=5)
    expect_codec_error(lambda: codec.MessageDecoder().decode(md, b""), "MessageDecoder")


@pytest.mark.parametrize("levels", [10_000, 200])
def test_deeply_nested_schema_is_rejected_not_recursion_error(levels: int) -> None:
    md = g.schema_message([_deep(levels)])
    assert pyarrow_rejects_stream(g.stream((md, b""))), "test bug? pyarrow accepts this depth"
    expect_codec_error(lambda: codec.MessageDecoder().decode(md, b""), f"{levels} levels")
    expect_codec_error(lambda: codec.open_stream(g.stream((md, b""))).read_all(), f"{levels} levels")


def test_moderately_nested_schema_is_read() -> None:
    """Depth 30 (lists of lists ...) is legitimate and pyarrow reads it: so must dissoc."""
    md = g.schema_message([_deep(30)])
    data = g.stream((md, b""))
    expected = paipc.open_stream(data).schema
    assert_schema_equal(codec.open_stream(data).schema, expected)


@pytest.mark.timeout(15)
def test_exponentially_shared_schema_does_not_hang() -> None:
    """60 levels of a struct whose two children are the same flatbuffer table: 2**60 fields if expanded."""
    md = g.schema_message([_exponential(60)])
    assert len(md) < 10_000
    assert pyarrow_rejects_stream(g.stream((md, b""))), "test bug? pyarrow accepts it"
    expect_codec_error(lambda: codec.MessageDecoder().decode(md, b""), "shared-subtree schema")


def test_truncated_and_bad_framing() -> None:
    good = g.stream(GOOD_SCHEMA, GOOD_BATCH)
    first_len = len(g.frame(GOOD_SCHEMA[0]))
    cases = {
        "empty": b"",
        "three-bytes": b"\xff\xff\xff",
        "continuation-only": g.CONTINUATION,
        "length-cut": g.CONTINUATION + b"\x10\x00",
        "metadata-cut": good[: first_len - 5],
        "negative-metadata-size": g.CONTINUATION + struct.pack("<i", -8) + bytes(16),
        "metadata-size-beyond-data": g.CONTINUATION + struct.pack("<i", 0x7FFFFFF8) + bytes(64),
        "second-message-metadata-cut": good[: first_len + 12],
        "body-cut": good[: len(good) - len(g.EOS) - 4],
        "garbage": bytes(range(256)),
    }
    for name, data in cases.items():
        assert pyarrow_rejects_stream(data), f"test bug? pyarrow accepts {name}"
        expect_codec_error(lambda d=data: codec.open_stream(d).read_all(), name)  # type: ignore[misc]


# --- endianness --------------------------------------------------------------------------------


def test_big_endian_stream_is_swapped_or_refused_naming_endianness() -> None:
    fields = [
        g.FieldSpec("i32", g.int_(32)),
        g.FieldSpec("i64", g.int_(64)),
        g.FieldSpec("f64", g.float_(2)),
        g.FieldSpec("s", g.utf8()),
        g.FieldSpec("l", g.list_(), children=(g.FieldSpec("item", g.int_(16)),)),
    ]
    offs = np.array([0, 1, 3, 3], ">i4").tobytes()
    msgs = [
        (g.schema_message(fields, endianness=1), b""),
        batch(
            3,
            [(3, 0), (3, 0), (3, 0), (3, 0), (3, 0), (3, 0)],
            b"",
            np.array([1, -2, 3], ">i4").tobytes(),
            b"",
            np.array([2**40, -5, 7], ">i8").tobytes(),
            b"",
            np.array([1.5, -0.25, 1e300], ">f8").tobytes(),
            b"",
            offs,
            b"abc",
            b"",
            offs,
            b"",
            np.array([258, -3, 7], ">i2").tobytes(),
        ),
    ]
    data = g.stream(*msgs)
    expected = paipc.open_stream(data).read_all()  # pyarrow swaps to native order
    assert expected.column("i64").to_pylist() == [2**40, -5, 7]
    assert expected.column("l").to_pylist() == [[258], [-3, 7], []]
    try:
        got = codec.open_stream(data).read_all()
    except CodecError as exc:
        assert "endian" in str(exc).lower(), f"refusal does not name endianness: {exc}"
        return
    assert_schema_equal(got.schema, expected.schema)
    assert got.equals(expected), got


# --- files -------------------------------------------------------------------------------------


def _good_file() -> tuple[bytes, list[g.Block]]:
    data, _, blocks = g.file([A_I32], [], [GOOD_BATCH])
    return data, blocks


def _with_footer_blocks(blocks: list[g.Block]) -> bytes:
    data, _ = _good_file()
    (footer_len,) = struct.unpack("<i", data[-10:-6])
    prefix = data[: len(data) - 10 - footer_len]
    return g.file_from_footer(prefix, g.footer([A_I32], [], blocks))


def test_file_baseline_is_valid() -> None:
    data, _ = _good_file()
    expected = paipc.open_file(data).get_batch(0)
    assert codec.open_file(data).get_batch(0).equals(expected)


def _file_cases() -> dict[str, bytes]:
    data, blocks = _good_file()
    (footer_len,) = struct.unpack("<i", data[-10:-6])
    blk = blocks[0]
    size = len(data)

    def footer_size(v: int) -> bytes:
        return data[:-10] + struct.pack("<i", v) + data[-6:]

    def block(**kw: int) -> bytes:
        b = g.Block(blk.offset, blk.metadata_length, blk.body_length)
        for k, v in kw.items():
            setattr(b, k, v)
        return _with_footer_blocks([b])

    return {
        "too-short": b"ARROW1",
        "only-magics": b"ARROW1\x00\x00ARROW1",
        "bad-leading-magic": b"ARROWX" + data[6:],
        "bad-trailing-magic": data[:-6] + b"ARROWX",
        "footer-size-negative": footer_size(-8),
        "footer-size-zero": footer_size(0),
        "footer-size-beyond-file": footer_size(size * 2),
        "footer-size-into-leading-magic": footer_size(size - 10 - 2),
        "footer-garbage": data[: size - 10 - footer_len] + bytes(range(footer_len)) + data[-10:],
        "block-offset-beyond-file": block(offset=size + 64),
        "block-offset-negative": block(offset=-8),
        "block-offset-misaligned": block(offset=blk.offset + 4),
        "block-metadata-length-negative": block(metadata_length=-16),
        "block-metadata-length-beyond-file": block(metadata_length=size * 4),
        "block-body-length-beyond-file": block(body_length=size * 4),
        "block-body-length-negative": block(body_length=-8),
        "block-points-at-schema": block(offset=8, metadata_length=blk.offset - 8, body_length=0),
    }


FILE_CASES = _file_cases()
FILE_PYARROW_LENIENT = {"bad-leading-magic": "pyarrow only checks the trailing magic"}


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_malformed_files(name: str) -> None:
    data = FILE_CASES[name]
    if name not in FILE_PYARROW_LENIENT:
        assert pyarrow_rejects_file(data), f"test bug? pyarrow accepts file case {name}"

    def read() -> None:
        r = codec.open_file(data)
        for i in range(r.num_record_batches):
            r.get_batch(i)
        r.read_all()

    expect_codec_error(read, "open_file + get_batch")


def test_codec_error_is_value_error_and_dissoc_error() -> None:
    assert issubclass(CodecError, ValueError)
    assert issubclass(CodecError, DissocError)


@pytest.mark.parametrize("ty", [pa.binary(), pa.string(), pa.large_binary(), pa.large_string()], ids=str)
@pytest.mark.parametrize("last", [5051, 1 << 20, 0x7FFFFFF0])
@pytest.mark.parametrize("scattered", [False, True], ids=["packed", "pairs"])
def test_binary_offsets_past_the_data_are_refused(ty: pa.DataType, last: int, scattered: bool) -> None:
    # Arrow's C importer sizes the data buffer from the last offset, so its own full validation cannot see
    # this; accepted, the batch would read past the body (reported as UTF-8 garbage, or a crash)
    values = [b"x" * i for i in range(1, 101)]
    batch = pa.record_batch({"s": pa.array(values, ty)})
    encoder = codec.MessageEncoder(batch.schema)
    message = encoder.encode(batch)[-1]
    body = bytearray(b"".join(bytes(memoryview(b)) for b in message.body_buffers))
    dtype = "<i8" if ty in (pa.large_binary(), pa.large_string()) else "<i4"
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(dtype).tobytes()
    at = body.find(offsets)
    assert at >= 0
    width = np.dtype(dtype).itemsize
    body[at + len(offsets) - width : at + len(offsets)] = last.to_bytes(width, "little")
    decoder = codec.MessageDecoder()
    decoder.decode(encoder.schema_message().metadata)
    with pytest.raises(CodecError, match="offsets"):
        if scattered:
            spans = codec.parse(message.metadata).batch
            assert spans is not None
            buffers = [pa.py_buffer(bytes(body[o : o + n])) if n else None for o, n in spans.buffers.tolist()]
            decoder.decode_scattered(message.metadata, buffers)
        else:
            decoder.decode(message.metadata, bytes(body))


@pytest.mark.parametrize("rows", [50, 20000], ids=["small", "large"])
def test_list_view_offsets_of_empty_valid_slots_must_lie_in_the_child(rows: int) -> None:
    values = [[j for j in range(i % 3)] for i in range(rows)]
    batch = pa.record_batch({"v": pa.array(values, pa.list_view(pa.int32()))})
    encoder = codec.MessageEncoder(batch.schema)
    message = encoder.encode(batch)[-1]
    body = bytearray(b"".join(bytes(memoryview(b)) for b in message.body_buffers))
    spans = codec.parse(message.metadata).batch
    assert spans is not None
    offsets_at = int(spans.buffers[1, 0])  # validity, offsets, sizes, then the child's buffers
    body[offsets_at : offsets_at + 4] = (-1).to_bytes(4, "little", signed=True)  # slot 0 is empty
    decoder = codec.MessageDecoder()
    decoder.decode(encoder.schema_message().metadata)
    with pytest.raises(CodecError, match=r"list view 0|offset for slot 0"):  # ours, or pyarrow's (small)
        decoder.decode(message.metadata, bytes(body))


def test_a_node_length_near_int64_max_is_refused_not_wrapped() -> None:
    # (length + 1) * 4 once wrapped around int64 into a size requirement that every buffer met, and Arrow's
    # importer then read the offsets at a wrapped-around address; the size check must refuse it
    types = pa.array([0, 1] * 6, pa.int8())
    offsets = pa.array([i // 2 for i in range(12)], pa.int32())
    strings = pa.array(["ab", None, "c", "de", "f", "gh"])
    union = pa.UnionArray.from_dense(types, offsets, [pa.array(range(6), pa.int64()), strings])
    batch = pa.record_batch({"u": union})
    encoder = codec.MessageEncoder(batch.schema)
    message = encoder.encode(batch)[-1]
    child = struct.pack("<qq", 6, 1)  # the string child's FieldNode: length 6, 1 null
    metadata = bytes(message.metadata)
    assert metadata.count(child) == 1
    metadata = metadata.replace(child, struct.pack("<qq", 2**63 - 1, 1))
    decoder = codec.MessageDecoder()
    decoder.decode(encoder.schema_message().metadata)
    body = b"".join(bytes(memoryview(b)) for b in message.body_buffers)
    with pytest.raises(CodecError, match="are needed"):
        decoder.decode(metadata, body)
