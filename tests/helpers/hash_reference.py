"""The exchange's row hash as the first wave wrote it (a numpy-only second implementation): the oracle that
``dissoc.hashing`` must equal bit for bit, so that a stage routes rows exactly as before, on the host and on
the device alike."""

from __future__ import annotations

import zlib

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_NULL_HASH = np.uint64(0x9E3779B97F4A7C15)


def mix(h: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser: every input bit affects every output bit."""
    with np.errstate(over="ignore"):
        h = h ^ (h >> np.uint64(30))
        h = h * _M1
        h = h ^ (h >> np.uint64(27))
        h = h * _M2
        return h ^ (h >> np.uint64(31))


def column_hash(column: pa.Array) -> npt.NDArray[np.uint64]:
    """A 64-bit hash per value, equal in every process (no per-process seed), nulls all alike."""
    t = column.type
    if pa.types.is_dictionary(t):
        column = column.dictionary_decode()
        t = column.type
    values: npt.NDArray[np.uint64]
    if pa.types.is_integer(t) or pa.types.is_temporal(t) or pa.types.is_boolean(t):
        if not pa.types.is_integer(t):
            column = column.cast(pa.int64()) if not pa.types.is_boolean(t) else column.cast(pa.int8())
        filled = column.fill_null(0) if column.null_count else column
        values = mix(np.asarray(filled.to_numpy(zero_copy_only=False)).astype(np.int64).view(np.uint64))
    elif pa.types.is_floating(t):
        filled = column.cast(pa.float64())
        filled = filled.fill_null(0.0) if filled.null_count else filled
        floats = np.asarray(filled.to_numpy(zero_copy_only=False), dtype=np.float64) + 0.0  # -0.0 == 0.0
        values = mix(floats.view(np.uint64))
    else:
        # Everything else (strings, binaries, decimals, nested): hash each distinct value's bytes once.
        encoded = pc.dictionary_encode(column) if _encodable(t) else None
        if encoded is not None:
            distinct = encoded.dictionary.to_pylist()
            indices = encoded.indices.fill_null(0).to_numpy(zero_copy_only=False)
        else:
            distinct = column.to_pylist()
            indices = np.arange(len(column))
        table = np.fromiter(
            (zlib.crc32(v if isinstance(v, bytes) else repr(v).encode()) for v in distinct),
            dtype=np.uint64,
            count=len(distinct),
        )
        values = mix(table[indices] if len(distinct) else np.zeros(len(column), np.uint64))
    if column.null_count:
        values = np.where(np.asarray(column.is_null().to_numpy(zero_copy_only=False)), _NULL_HASH, values)
    return values


def _encodable(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_decimal(t)
    )
