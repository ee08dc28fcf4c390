"""Shared helpers for the codec and device tests: data locations, pyarrow oracles, strict comparisons."""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as paipc
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ARROW_TESTING = REPO_ROOT.parent / "shared" / "arrow-testing"
INTEGRATION = ARROW_TESTING / "arrow-ipc-stream" / "integration"

requires_arrow_testing = pytest.mark.skipif(
    not ARROW_TESTING.is_dir(), reason=f"arrow-testing data not found at {ARROW_TESTING}"
)

COMPRESSIONS: list[str | None] = [None, "lz4", "zstd"]


def missing_param() -> Any:
    """The lone parameter used when the data directory is absent (the test itself is skipped)."""
    return pytest.param(None, id="arrow-testing-missing")


def golden_files() -> list[Path]:
    if not INTEGRATION.is_dir():
        return []
    return sorted(
        p for p in INTEGRATION.glob("*/generated_*") if p.suffix in (".stream", ".arrow_file") and p.is_file()
    )


def golden_id(p: Path) -> str:
    return f"{p.parent.name}/{p.name}"


def fuzz_files() -> list[Path]:
    if not ARROW_TESTING.is_dir():
        return []
    stream_dir = ARROW_TESTING / "arrow-ipc-stream"
    file_dir = ARROW_TESTING / "arrow-ipc-file"
    streams = [*stream_dir.glob("clusterfuzz-*"), *stream_dir.glob("crash-*")]
    files = [p for p in file_dir.glob("*") if p.name != "README.md"] if file_dir.is_dir() else []
    return sorted(p for p in [*streams, *files] if p.is_file())


def fuzz_id(p: Path) -> str:
    return f"{p.parent.name}/{p.name}"


# --------------------------------------------------------------------------------------------------
# pyarrow as the oracle


def pa_write_stream(
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    compression: str | None = None,
    emit_dictionary_deltas: bool = False,
) -> bytes:
    sink = io.BytesIO()
    opts = paipc.IpcWriteOptions(compression=compression, emit_dictionary_deltas=emit_dictionary_deltas)
    with paipc.new_stream(sink, schema, options=opts) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue()


def pa_write_file(
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    compression: str | None = None,
    emit_dictionary_deltas: bool = False,
) -> bytes:
    sink = io.BytesIO()
    opts = paipc.IpcWriteOptions(compression=compression, emit_dictionary_deltas=emit_dictionary_deltas)
    with paipc.new_file(sink, schema, options=opts) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue()


def pa_read_stream(data: bytes) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    r = paipc.open_stream(pa.py_buffer(data))
    return r.schema, list(r)


def pa_read_file(data: bytes) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    r = paipc.open_file(pa.py_buffer(data))
    return r.schema, [r.get_batch(i) for i in range(r.num_record_batches)]


# --------------------------------------------------------------------------------------------------
# Comparisons


def _column_diff(actual: pa.RecordBatch | pa.Table, expected: pa.RecordBatch | pa.Table) -> str:
    """A best-effort description of the first differing column (never raises)."""
    try:
        for i, name in enumerate(expected.schema.names):
            a, e = actual.column(i), expected.column(i)
            if not a.equals(e):
                return f"column {i} ({name!r}, {e.type}):\n  actual:   {a!s:.1500}\n  expected: {e!s:.1500}"
        return "columns equal (difference in schema, row count or metadata)"
    except Exception as exc:  # some types (month intervals) cannot be wrapped in Python
        return f"(could not describe difference: {type(exc).__name__}: {exc})"


def _validate_like(actual: pa.RecordBatch | pa.Table, expected: pa.RecordBatch | pa.Table) -> None:
    """Full validation of dissoc's result, except where the expected data itself fails full validation (some
    golden files hold e.g. date64 values that are not whole days): then the structural validation only."""
    try:
        expected.validate(full=True)
    except pa.ArrowInvalid:
        actual.validate()
        return
    actual.validate(full=True)


def assert_schema_equal(actual: pa.Schema, expected: pa.Schema) -> None:
    assert isinstance(actual, pa.Schema), f"expected a pa.Schema, got {type(actual).__name__}"
    assert actual.equals(expected, check_metadata=True), (
        f"schemas differ:\n--- actual ---\n{actual.to_string(show_schema_metadata=True)}\n"
        f"--- expected ---\n{expected.to_string(show_schema_metadata=True)}\n"
        f"metadata actual={actual.metadata} expected={expected.metadata}"
    )


def assert_batch_equal(actual: Any, expected: pa.RecordBatch, what: str = "batch") -> None:
    assert isinstance(actual, pa.RecordBatch), (
        f"{what}: expected a pa.RecordBatch, got {type(actual).__name__}"
    )
    assert_schema_equal(actual.schema, expected.schema)
    assert actual.num_rows == expected.num_rows, (
        f"{what}: {actual.num_rows} rows, expected {expected.num_rows}"
    )
    _validate_like(actual, expected)
    assert actual.equals(expected, check_metadata=True), f"{what} differs: {_column_diff(actual, expected)}"


def assert_batches_equal(
    actual: Sequence[Any], expected: Sequence[pa.RecordBatch], what: str = "batches"
) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} batches, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_batch_equal(a, e, f"{what}[{i}]")


def assert_table_equal(actual: Any, expected: pa.Table, what: str = "table") -> None:
    assert isinstance(actual, pa.Table), f"{what}: expected a pa.Table, got {type(actual).__name__}"
    assert_schema_equal(actual.schema, expected.schema)
    assert actual.num_rows == expected.num_rows, (
        f"{what}: {actual.num_rows} rows, expected {expected.num_rows}"
    )
    _validate_like(actual, expected)
    assert actual.equals(expected, check_metadata=True), f"{what} differs: {_column_diff(actual, expected)}"


def table_of(schema: pa.Schema, batches: Sequence[pa.RecordBatch]) -> pa.Table:
    return pa.Table.from_batches(list(batches), schema=schema)


def walk_arrays(arr: pa.Array) -> Iterable[pa.Array]:
    """The array, its children and its dictionaries, recursively (as pyarrow exposes them)."""
    stack = [arr]
    while stack:
        a = stack.pop()
        yield a
        t = a.type
        if isinstance(a, pa.ExtensionArray):
            stack.append(a.storage)
        elif isinstance(a, pa.DictionaryArray):
            stack.extend([a.indices, a.dictionary])
        elif isinstance(a, pa.RunEndEncodedArray):
            stack.extend([a.run_ends, a.values])
        elif isinstance(a, pa.StructArray | pa.UnionArray):
            stack.extend(a.field(i) for i in range(t.num_fields))
        elif isinstance(
            a,
            pa.MapArray
            | pa.ListArray
            | pa.LargeListArray
            | pa.FixedSizeListArray
            | pa.ListViewArray
            | pa.LargeListViewArray,
        ):
            stack.append(a.values)
