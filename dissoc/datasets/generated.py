"""Deterministic synthetic data (the demo's and the benchmarks' datasets), generated batch by batch."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from dissoc.datasets.base import (
    Dataset,
    DatasetError,
)

log = logging.getLogger(__name__)

# -------------------------------------------------------------------------------------------------- synthetic

DEFAULT_GENERATED_SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.float64()), ("label", pa.string())])
_MAX_STRING_LEN = 15  # generated strings have 0..15 letters (7.5 on average)


class GeneratedDataset(Dataset):
    """Deterministic synthetic data: ``batches`` batches of ``rows_per_batch`` rows, made one at a time.

    Batch ``i`` depends only on ``(seed, i)``: the same seed gives equal batches, in any order (see
    :meth:`batch`). Supported field types: integers, floats, booleans, temporal types (timestamp, date, time,
    duration), (large) strings and (large) binaries (0 to 15 letters ``a``-``p``); no nulls are generated.
    Integer fields named ``id`` hold the global row number (``i * rows_per_batch + row``), so a receiver can
    check order; other integer fields are uniformly random. The default schema is
    ``id: int64, value: float64, label: string``.
    """

    def __init__(
        self,
        name: str,
        schema: pa.Schema | None = None,
        batches: int = 16,
        rows_per_batch: int = 1 << 16,
        seed: int = 0,
    ) -> None:
        super().__init__(name)
        schema = DEFAULT_GENERATED_SCHEMA if schema is None else schema
        if not isinstance(schema, pa.Schema):
            raise DatasetError(f"dataset {name!r}: schema must be a pyarrow.Schema")
        if batches < 0 or rows_per_batch < 0:
            raise DatasetError(
                f"dataset {name!r}: batches and rows_per_batch must be >= 0 "
                f"(got {batches} and {rows_per_batch})"
            )
        for field in schema:
            if _column_kind(field.type) is None:
                raise DatasetError(
                    f"dataset {name!r}: cannot generate field {field.name!r} of type {field.type}; "
                    "supported: integer, floating point, boolean, temporal, string and binary types"
                )
            if (
                _column_kind(field.type) == "bytes"
                and not _is_large(field.type)
                and rows_per_batch * _MAX_STRING_LEN >= 1 << 31
            ):
                raise DatasetError(
                    f"dataset {name!r}: {rows_per_batch} rows per batch overflow the 32-bit offsets of field "
                    f"{field.name!r} ({field.type}); use large_{field.type} or fewer rows"
                )
        self._schema = schema
        self.batches = batches
        self.rows_per_batch = rows_per_batch
        self.seed = seed

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def num_rows(self) -> int:
        return self.batches * self.rows_per_batch

    @property
    def nbytes(self) -> int:
        """Expected size: exact for fixed-width columns, average string lengths for the others."""
        per_row = 0.0
        for field in self._schema:
            t = field.type
            if pa.types.is_boolean(t):
                per_row += 1 / 8
            elif _column_kind(t) == "bytes":
                per_row += (8 if _is_large(t) else 4) + _MAX_STRING_LEN / 2
            else:
                per_row += t.bit_width // 8
        return int(per_row * self.num_rows)

    def batch(self, i: int) -> pa.RecordBatch:
        """Batch ``i`` (0 <= i < batches), computed from ``(seed, i)`` alone."""
        if not 0 <= i < self.batches:
            raise IndexError(f"batch index {i} out of range for {self.batches} batches")
        n = self.rows_per_batch
        rng = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, i])
        columns = [_generate(field, rng, n, i * n) for field in self._schema]
        return pa.RecordBatch.from_arrays(columns, schema=self._schema)

    def open(self) -> Iterator[pa.RecordBatch]:
        self._check_open()
        return self._iterate()

    def _iterate(self) -> Iterator[pa.RecordBatch]:
        for i in range(self.batches):
            yield self.batch(i)

    def __repr__(self) -> str:
        return (
            f"GeneratedDataset(name={self.name!r}, batches={self.batches}, "
            f"rows_per_batch={self.rows_per_batch}, seed={self.seed})"
        )


def _is_large(t: pa.DataType) -> bool:
    return bool(pa.types.is_large_string(t) or pa.types.is_large_binary(t))


def _column_kind(t: pa.DataType) -> str | None:
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_temporal(t) and not pa.types.is_interval(t):
        return "temporal"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or _is_large(t):
        return "bytes"
    return None


def _generate(field: pa.Field, rng: np.random.Generator, n: int, first_row: int) -> pa.Array:
    """A column of ``n`` values for ``field``; ``first_row`` is the global number of its first row."""
    t = field.type
    kind = _column_kind(t)
    data: np.ndarray[Any, Any]
    if kind == "bool":
        return pa.array(rng.integers(0, 2, n, dtype=np.uint8).astype(np.bool_), type=t)
    if kind == "float":
        data = rng.random(n)
        if t.bit_width != 64:
            data = data.astype(np.float32 if t.bit_width == 32 else np.float16)
        return pa.Array.from_buffers(t, n, [None, pa.py_buffer(data)])
    if kind == "int" or kind == "temporal":
        signed = kind == "temporal" or pa.types.is_signed_integer(t)
        dtype: np.dtype[Any] = np.dtype(f"<{'i' if signed else 'u'}{t.bit_width // 8}")
        if kind == "int" and field.name == "id":
            data = np.arange(first_row, first_row + n, dtype=np.uint64).astype(dtype)
        elif kind == "temporal":
            # plausible values (dates and timestamps within 50 years of the epoch, times within a day)
            # date64 holds whole days in milliseconds; nanoseconds stay whole microseconds so that
            # to_pylist() works without pandas.
            scale = 86_400_000 if pa.types.is_date64(t) else 1_000 if getattr(t, "unit", "") == "ns" else 1
            data = rng.integers(0, _temporal_span(t) // (1 if scale == 86_400_000 else scale), n, dtype=dtype)
            if scale != 1:
                data *= scale
        else:
            info = np.iinfo(dtype)
            data = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
        return pa.Array.from_buffers(t, n, [None, pa.py_buffer(data)])
    # variable-length strings or binaries of 0..15 letters a-p: a nibble of random bits per length and per
    # character keeps this several times faster than drawing bounded integers.
    lengths = _random_bytes(rng, n) & np.uint8(_MAX_STRING_LEN)
    offsets = np.zeros(n + 1, dtype=np.int64 if _is_large(t) else np.int32)
    np.cumsum(lengths, out=offsets[1:])
    chars = _random_bytes(rng, int(offsets[-1]))
    chars &= np.uint8(15)
    chars += np.uint8(ord("a"))
    return pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets), pa.py_buffer(chars)])


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``n`` random bytes (drawn as 64-bit integers, the generator's fastest path)."""
    words = rng.integers(0, np.iinfo(np.int64).max, (n + 7) // 8, dtype=np.int64, endpoint=True)
    return words.view(np.uint8)[:n]


def _temporal_span(t: pa.DataType) -> int:
    """The exclusive upper bound of generated values of temporal type ``t``."""
    days = 50 * 365
    if pa.types.is_date32(t) or pa.types.is_date64(t):
        return days
    ticks: int = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}[t.unit]
    if pa.types.is_timestamp(t):
        return days * 86_400 * ticks
    return 86_400 * ticks  # time of day, duration
