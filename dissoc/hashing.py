"""The row hash that sends equal keys to the same task, written once for the host and the device.

A row's hash combines its key columns' value hashes, left to right: ``h = mix(h * 31 + column_hash)`` from
``h = 0`` in wrap-around uint64 arithmetic, where :func:`mix` is splitmix64's finaliser. Its destination among
``n`` tasks is ``h % n``. The value hash of a fixed-width column is :func:`mix` of 64 bits per value:

* integers, booleans (0 or 1) and the integer-backed temporal types (dates, times, timestamps, durations):
  the value as an int64, its two's-complement bits;
* floating point: the value as a float64, its bits, with ``-0.0`` taken as ``0.0`` and every NaN quieted (as
  ``x + 0.0`` does on x86-64 and ARM64; done on the bits here, so a GPU gives the same bits);
* nulls: the constant :data:`NULL_HASH`, whatever the slot holds.

The fixed-width functions take an array module ``xp`` (``numpy``, or ``cupy`` for device memory) and run the
same operations on either, so a task hashing on the GPU and one hashing on the host agree bit for bit.
:func:`column_hash` hashes a ``pa.Array`` on the host: fixed-width columns through the same functions, every
other type (strings, binaries, decimals, nested, intervals) through CRC-32 of each distinct value's bytes.
No hash has a per-process seed: every process computes the same numbers.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = [
    "NULL_HASH",
    "column_hash",
    "combine",
    "destination_order",
    "destinations",
    "fixed_width_dtype",
    "float_bits",
    "hashes_by_value",
    "mix",
    "row_hash",
    "unpack_bits",
    "value_hash",
    "with_nulls",
]

log = logging.getLogger(__name__)

#: The hash of a null value, in every column type.
NULL_HASH = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_PRIME = np.uint64(31)
_SIGN = np.uint64(0x8000000000000000)
_MAGNITUDE = np.uint64(0x7FFFFFFFFFFFFFFF)
_INF64 = np.uint64(0x7FF0000000000000)
_QUIET_NAN64 = np.uint64(0x7FF8000000000000)
#: Per narrower float width: its unsigned view, magnitude mask, infinity, mantissa mask, shift into float64.
_NARROW_FLOATS: dict[int, tuple[type[np.unsignedinteger[Any]], int, int, int, int]] = {
    4: (np.uint32, 0x7FFFFFFF, 0x7F800000, 0x007FFFFF, 29),
    2: (np.uint16, 0x7FFF, 0x7C00, 0x03FF, 42),
}


def mix(h: Any, xp: ModuleType = np) -> Any:
    """splitmix64's finaliser over a uint64 array of ``xp``: every input bit affects every output bit."""
    h = xp.asarray(h, dtype=xp.uint64)
    with np.errstate(over="ignore"):
        h = h ^ (h >> _S30)
        h = h * _M1
        h = h ^ (h >> _S27)
        h = h * _M2
        return h ^ (h >> _S31)


def combine(h: Any, column_hash: Any, xp: ModuleType = np) -> Any:
    """The row hash so far ``h`` joined with one more column's value hashes: ``mix(h * 31 + column_hash)``
    (uint64, wrapping around)."""
    with np.errstate(over="ignore"):
        return mix(xp.asarray(h, dtype=xp.uint64) * _PRIME + column_hash, xp)


def row_hash(column_hashes: Iterable[Any], length: int, xp: ModuleType = np) -> Any:
    """The row hash of ``length`` rows from their key columns' value hashes, in key order."""
    h = xp.zeros(length, dtype=xp.uint64)
    for ch in column_hashes:
        h = combine(h, ch, xp)
    return h


def destinations(h: Any, n: int, xp: ModuleType = np) -> Any:
    """Row hashes as destination task indices in ``[0, n)`` (int64)."""
    return (xp.asarray(h, dtype=xp.uint64) % np.uint64(n)).astype(xp.int64)


def destination_order(dest: Any, bins: int, xp: ModuleType = np) -> Any:
    """Row indices sorted by destination, rows keeping their order within each (``dest``: integers in
    ``[0, bins)``, an array of ``xp``).

    Destinations fit 8 or 16 bits for any real stage, and both numpy (``kind="stable"``) and CuPy (always)
    sort those stably by radix: one or two passes over a byte a row, where a 64-bit key takes eight."""
    key = dest.astype(xp.uint8 if bins <= 256 else xp.uint16) if bins <= 1 << 16 else dest
    return np.argsort(key, kind="stable") if xp is np else xp.argsort(key)  # CuPy's argsort is stable


def float_bits(values: Any, xp: ModuleType = np) -> Any:
    """Floats (16, 32 or 64 bits) as the uint64 bits of the float64 that hashes them: widened exactly,
    ``-0.0`` as ``0.0``, NaNs quieted with their payload kept (what ``float64(x) + 0.0`` gives on x86-64)."""
    width = int(values.dtype.itemsize)
    if width == 8:
        bits = values.view(xp.uint64)
    else:
        with np.errstate(invalid="ignore"):  # a signalling NaN; its bits are redone below
            bits = values.astype(xp.float64).view(xp.uint64)
    bits = xp.where(bits == _SIGN, np.uint64(0), bits)
    if width == 8:
        return xp.where((bits & _MAGNITUDE) > _INF64, bits | _QUIET_NAN64, bits)
    # Narrower NaNs are widened on the bits too: a device's conversion may not keep their payload.
    unsigned, magnitude, inf, mantissa, shift = _NARROW_FLOATS[width]
    raw = values.view(unsigned).astype(xp.uint64)
    nan = (raw & np.uint64(magnitude)) > np.uint64(inf)
    sign = (raw >> np.uint64(width * 8 - 1)) << np.uint64(63)
    widened = sign | _QUIET_NAN64 | ((raw & np.uint64(mantissa)) << np.uint64(shift))
    return xp.where(nan, widened, bits)


def value_hash(values: Any, xp: ModuleType = np) -> Any:
    """The value hash of a fixed-width array of ``xp``: integers (and booleans, or bits unpacked to 0/1) as
    int64, floats as normalised float64 bits (:func:`float_bits`), then :func:`mix`. Null slots are hashed
    as whatever they hold; :func:`with_nulls` replaces them."""
    kind = values.dtype.kind
    if kind == "f":
        return mix(float_bits(values, xp), xp)
    if kind not in "biu":
        raise TypeError(f"value_hash: expected integers, booleans or floats, got {values.dtype}")
    if values.dtype == np.uint64:
        return mix(values, xp)  # int64 of a uint64 is the same bits
    return mix(values.astype(xp.int64).view(xp.uint64), xp)


def with_nulls(hashes: Any, valid: Any | None, xp: ModuleType = np) -> Any:
    """``hashes`` with :data:`NULL_HASH` where ``valid`` (booleans or 0/1, or None: no nulls) is false."""
    if valid is None:
        return hashes
    return xp.where(valid.astype(xp.bool_), hashes, NULL_HASH)


def unpack_bits(bitmap: Any, offset: int, length: int, xp: ModuleType = np) -> Any:
    """Bits ``[offset, offset + length)`` of an Arrow bitmap (uint8 array of ``xp``, least significant bit
    first) as a uint8 array of 0 and 1."""
    start, stop = offset // 8, (offset + length + 7) // 8
    bits = xp.unpackbits(bitmap[start:stop], bitorder="little")
    first = offset - start * 8
    return bits[first : first + length]


_TEMPORAL_WIDTHS = {
    pa.lib.Type_DATE32: 4,
    pa.lib.Type_DATE64: 8,
    pa.lib.Type_TIME32: 4,
    pa.lib.Type_TIME64: 8,
    pa.lib.Type_TIMESTAMP: 8,
    pa.lib.Type_DURATION: 8,
}


def fixed_width_dtype(ty: pa.DataType) -> np.dtype[Any] | None:
    """The numpy dtype whose values :func:`value_hash` hashes for columns of type ``ty``: integers, floats and
    the integer-backed temporal types (their storage); ``bool`` for booleans (stored as bits); None for types
    hashed otherwise (see :func:`hashes_by_value`)."""
    if pa.types.is_boolean(ty):
        return np.dtype(np.bool_)
    if pa.types.is_integer(ty):
        return np.dtype(f"<{'i' if pa.types.is_signed_integer(ty) else 'u'}{ty.bit_width // 8}")
    if pa.types.is_floating(ty):
        return np.dtype(f"<f{ty.bit_width // 8}")
    width = _TEMPORAL_WIDTHS.get(ty.id)
    return None if width is None else np.dtype(f"<i{width}")


def hashes_by_value(ty: pa.DataType) -> bool:
    """Whether columns of type ``ty`` are hashed by their fixed-width values (:func:`value_hash`, which runs
    on a device too), rather than by CRC-32 of their values' bytes (host only). Dictionary-encoded and
    extension types are not: :func:`column_hash` decodes a dictionary first, and hashes extension values by
    their Python form."""
    return fixed_width_dtype(ty) is not None


def _validity(column: pa.Array) -> npt.NDArray[np.uint8] | None:
    bitmap = column.buffers()[0]
    if not column.null_count or bitmap is None:
        return None
    return unpack_bits(np.frombuffer(bitmap, np.uint8), column.offset, len(column))  # type: ignore[no-any-return]


def _fixed_width_values(column: pa.Array, dtype: np.dtype[Any]) -> Any:
    """The values of a fixed-width column as numpy (booleans unpacked to 0/1), without copying numbers."""
    data = column.buffers()[1]
    n, off = len(column), column.offset
    if data is None or n == 0:
        return np.zeros(n, np.uint8 if dtype == np.bool_ else dtype)
    if dtype == np.bool_:
        return unpack_bits(np.frombuffer(data, np.uint8), off, n)
    return np.frombuffer(data, dtype, count=off + n)[off:]


def _crc_hash(column: pa.Array) -> npt.NDArray[np.uint64]:
    """CRC-32 of each distinct value: its bytes for binary values, its ``repr`` for every other value."""
    import pyarrow.compute as pc  # here: importing it takes a while, and device hashing never needs it

    t = column.type
    groupable = (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_decimal(t)
    )
    if groupable:
        encoded = pc.dictionary_encode(column)
        distinct = encoded.dictionary.to_pylist()
        index = np.asarray(encoded.indices.fill_null(0).to_numpy(zero_copy_only=False))
    else:
        distinct = column.to_pylist()
        index = np.arange(len(column))
    crcs = np.fromiter(
        (zlib.crc32(v if isinstance(v, bytes) else repr(v).encode()) for v in distinct),
        dtype=np.uint64,
        count=len(distinct),
    )
    picked = crcs[index] if len(distinct) else np.zeros(len(column), np.uint64)
    return mix(picked)  # type: ignore[no-any-return]


def column_hash(column: pa.Array) -> npt.NDArray[np.uint64]:
    """A 64-bit hash per value of ``column`` on the host, equal in every process, nulls all
    :data:`NULL_HASH`. Dictionary-encoded columns hash as their values; fixed-width types as
    :func:`value_hash` (the same numbers a device computes), the others by CRC-32 (see the module
    docstring)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    dtype = fixed_width_dtype(column.type)
    if dtype is None:
        hashes = _crc_hash(column)
        if column.null_count:
            valid = np.asarray(column.is_valid().to_numpy(zero_copy_only=False))
            hashes = with_nulls(hashes, valid)
        return hashes
    hashes = value_hash(_fixed_width_values(column, dtype))
    return with_nulls(hashes, _validity(column))  # type: ignore[no-any-return]
