"""The Arrow project's golden IPC files, read by dissoc and compared with pyarrow (the oracle).

Every ``generated_*.stream`` and ``generated_*.arrow_file`` under
``../shared/arrow-testing/arrow-ipc-stream/integration/<version>/`` is read through every kind of source
(path str, Path, bytes, bytearray, memoryview, pa.Buffer, binary file objects), compared batch by batch and
as a table with pyarrow's reading (schemas with field and schema metadata, values), file batches are also
compared by random access, and what dissoc read is written again by dissoc (stream and file, each
compression) and must read back through pyarrow unchanged.

pyarrow 26 reads every golden file, the big-endian ones included (it byte-swaps them, and the result equals
the little-endian twin), so dissoc must read all of them too and agree exactly.
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as paipc
import pytest
from helpers.codec import (
    COMPRESSIONS,
    INTEGRATION,
    assert_batch_equal,
    assert_batches_equal,
    assert_schema_equal,
    assert_table_equal,
    golden_files,
    golden_id,
    missing_param,
    pa_read_file,
    pa_read_stream,
    pa_write_file,
    requires_arrow_testing,
    table_of,
)

from dissoc import codec
from dissoc.errors import CodecError

GOLDEN = golden_files()
STREAMS = [pytest.param(p, id=golden_id(p)) for p in GOLDEN if p.suffix == ".stream"] or [missing_param()]
FILES = [pytest.param(p, id=golden_id(p)) for p in GOLDEN if p.suffix == ".arrow_file"] or [missing_param()]
ALL = [pytest.param(p, id=golden_id(p)) for p in GOLDEN] or [missing_param()]
BIG_ENDIAN = [pytest.param(p, id=golden_id(p)) for p in GOLDEN if p.parent.name == "1.0.0-bigendian"] or [
    missing_param()
]

pytestmark = [requires_arrow_testing, pytest.mark.timeout(60)]


def _sources(path: Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(description, factory) for every kind of source the readers accept; factories make fresh ones."""
    data = path.read_bytes()
    yield "str path", lambda: str(path)
    yield "Path", lambda: path
    yield "bytes", lambda: data
    yield "bytearray", lambda: bytearray(data)
    yield "memoryview", lambda: memoryview(data)
    yield "pa.Buffer", lambda: pa.py_buffer(data)
    yield "io.BytesIO", lambda: io.BytesIO(data)
    yield "open file", lambda: open(path, "rb")  # noqa: SIM115 - closed by the test


def _close(src: Any) -> None:
    if hasattr(src, "close"):
        src.close()


def _is_stream(p: Path) -> bool:
    return p.suffix == ".stream"


@pytest.mark.parametrize("path", STREAMS)
def test_golden_stream_matches_pyarrow(path: Path) -> None:
    schema, expected = pa_read_stream(path.read_bytes())
    for what, make in _sources(path):
        src = make()
        try:
            reader = codec.open_stream(src)
            assert_schema_equal(reader.schema, schema)
            assert_batches_equal(list(reader), expected, f"{what}: iteration")
        finally:
            _close(src)


@pytest.mark.parametrize("path", STREAMS)
def test_golden_stream_read_all_and_read_next_batch(path: Path) -> None:
    data = path.read_bytes()
    schema, expected = pa_read_stream(data)

    table = codec.open_stream(data).read_all()
    assert_table_equal(table, table_of(schema, expected))

    reader = codec.open_stream(data)
    got = []
    while True:
        try:
            got.append(reader.read_next_batch())
        except StopIteration:
            break
    assert_batches_equal(got, expected, "read_next_batch")
    with pytest.raises(StopIteration):
        reader.read_next_batch()


@pytest.mark.parametrize("path", FILES)
def test_golden_file_matches_pyarrow(path: Path) -> None:
    expected_reader = paipc.open_file(path)
    schema = expected_reader.schema
    n = expected_reader.num_record_batches
    expected = [expected_reader.get_batch(i) for i in range(n)]
    order = list(range(n))
    random.Random(path.name).shuffle(order)
    for what, make in _sources(path):
        src = make()
        try:
            reader = codec.open_file(src)
            assert_schema_equal(reader.schema, schema)
            assert reader.num_record_batches == n, f"{what}: num_record_batches"
            # random access, out of order and repeated
            for i in [*reversed(range(n)), *order]:
                assert_batch_equal(reader.get_batch(i), expected[i], f"{what}: get_batch({i})")
            assert_batches_equal(list(reader), expected, f"{what}: iteration")
            assert_table_equal(reader.read_all(), table_of(schema, expected), f"{what}: read_all")
        finally:
            _close(src)


@pytest.mark.parametrize("path", BIG_ENDIAN)
def test_golden_big_endian_equals_little_endian_twin(path: Path) -> None:
    twin = INTEGRATION / "1.0.0-littleendian" / path.name
    if _is_stream(path):
        schema, expected = pa_read_stream(twin.read_bytes())
        reader: Any = codec.open_stream(path.read_bytes())
        got = list(reader)
    else:
        schema, expected = pa_read_file(twin.read_bytes())
        reader = codec.open_file(path.read_bytes())
        got = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    assert_schema_equal(reader.schema, schema)
    assert_batches_equal(got, expected, "big-endian read vs little-endian twin")


def _dissoc_read(path: Path) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    data = path.read_bytes()
    if _is_stream(path):
        reader: Any = codec.open_stream(data)
        return reader.schema, list(reader)
    reader = codec.open_file(data)
    return reader.schema, [reader.get_batch(i) for i in range(reader.num_record_batches)]


def _oracle(path: Path) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    data = path.read_bytes()
    return pa_read_stream(data) if _is_stream(path) else pa_read_file(data)


@pytest.mark.parametrize("compression", COMPRESSIONS, ids=lambda c: f"compression={c}")
@pytest.mark.parametrize("path", ALL)
def test_golden_rewrite_stream(path: Path, compression: str | None) -> None:
    schema, batches = _dissoc_read(path)
    exp_schema, expected = _oracle(path)

    sink = io.BytesIO()
    with codec.new_stream(sink, schema, compression=compression) as writer:
        for b in batches:
            writer.write_batch(b)
    got_schema, got = pa_read_stream(sink.getvalue())
    assert_schema_equal(got_schema, exp_schema)
    assert_batches_equal(got, expected, "pyarrow reading dissoc's stream")

    sink = io.BytesIO()
    writer = codec.new_stream(sink, schema, compression=compression)
    writer.write_table(table_of(schema, batches))
    writer.close()
    assert_table_equal(paipc.open_stream(sink.getvalue()).read_all(), table_of(exp_schema, expected))


@pytest.mark.parametrize("compression", COMPRESSIONS, ids=lambda c: f"compression={c}")
@pytest.mark.parametrize("path", ALL)
def test_golden_rewrite_file(path: Path, compression: str | None, tmp_path: Path) -> None:
    schema, batches = _dissoc_read(path)
    exp_schema, expected = _oracle(path)
    try:
        # (uncompressed: whether a file can hold these batches does not depend on compression, and pyarrow 26
        # crashes compressing the legacy 0.17.1 unions it read)
        pa_write_file(exp_schema, expected)
        pyarrow_can = True
    except pa.ArrowInvalid:  # e.g. a dictionary replaced between batches: not representable in a file
        pyarrow_can = False

    out = tmp_path / "out.arrow"
    if not pyarrow_can:
        with pytest.raises(CodecError), codec.new_file(out, schema, compression=compression) as writer:
            for b in batches:
                writer.write_batch(b)
        return
    with codec.new_file(out, schema, compression=compression) as writer:
        for b in batches:
            writer.write_batch(b)
    got_schema, got = pa_read_file(out.read_bytes())
    assert_schema_equal(got_schema, exp_schema)
    assert_batches_equal(got, expected, "pyarrow reading dissoc's file")
    # and dissoc reads its own file back
    reader = codec.open_file(out)
    assert_batches_equal([reader.get_batch(i) for i in range(reader.num_record_batches)], expected, "dissoc")
