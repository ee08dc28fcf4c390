"""Body type 1 (address/length pair lists) and free_data messages.

A pair list is: u64 LE total size of all listed buffers, u64 LE count, then ``count`` pairs of u64 LE
(address-or-offset, length), one per entry of the RecordBatch's ``buffers``, ``(0, 0)`` for an empty buffer.

A free_data message is one or more u64 LE addresses the client no longer needs.

Decoding reads the integers in bulk with :func:`numpy.frombuffer` (no per-element work, no copy) after
checking the sizes, so a hostile count can never make the decoder allocate.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

from dissoc.errors import ProtocolError
from dissoc.protocol.framing import BytesLike, as_byte_view

__all__ = [
    "PAIRS_HEADER_SIZE",
    "U64_MAX",
    "PairList",
    "decode_free",
    "decode_pairs",
    "encode_free",
    "encode_pairs",
]

U64_MAX: Final = 0xFFFFFFFFFFFFFFFF
PAIRS_HEADER_SIZE: Final = 16
"""u64 total + u64 count."""

_PAIR_SIZE: Final = 16
_HEADER = struct.Struct("<QQ")
_U64_LE: Final = np.dtype("<u8")

U64Array = npt.NDArray[np.uint64]


def _exact_sum(values: U64Array) -> int:
    """The exact sum of u64 values as a Python int (numpy's uint64 sum silently wraps on overflow)."""
    n = int(values.shape[0])
    if n == 0:
        return 0
    if int(values.max()) * n <= U64_MAX:  # common case: cannot overflow
        return int(values.sum(dtype=np.uint64))
    total = 0
    step = 1 << 30  # n * 2**32 < 2**64 per chunk, so the split sums below cannot wrap
    for start in range(0, n, step):
        chunk = values[start : start + step]
        total += (int((chunk >> np.uint64(32)).sum(dtype=np.uint64)) << 32) + int(
            (chunk & np.uint64(0xFFFFFFFF)).sum(dtype=np.uint64)
        )
    return total


@dataclass(frozen=True, slots=True, eq=False)
class PairList:
    """A decoded body of type 1.

    ``pairs`` is an ``(n, 2)`` uint64 array of (address-or-offset, length); when decoded it views the received
    buffer (read-only if that was ``bytes``). ``total`` is the declared total size, equal to the sum of the
    lengths.
    """

    total: int
    pairs: U64Array
    #: The pairs flattened (address, length, address, length, ...) as Python ints, where decoding had them.
    flat_values: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    def flat(self) -> tuple[int, ...]:
        """The pairs flattened (address, length, address, length, ...) as Python ints: for the short lists
        of the per-message path, where a loop over ints beats numpy's per-call cost."""
        values = self.flat_values
        return values if values is not None else tuple(self.pairs.reshape(-1).tolist())

    @property
    def count(self) -> int:
        """Number of buffers listed."""
        return int(self.pairs.shape[0])

    @property
    def addresses(self) -> U64Array:
        """Column of addresses/offsets (a view)."""
        return self.pairs[:, 0]

    @property
    def lengths(self) -> U64Array:
        """Column of lengths (a view)."""
        return self.pairs[:, 1]

    def to_list(self) -> list[tuple[int, int]]:
        """The pairs as Python ints."""
        return [(int(a), int(n)) for a, n in self.pairs.tolist()]

    def __len__(self) -> int:
        return self.count

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PairList):
            return NotImplemented
        return self.total == other.total and np.array_equal(self.pairs, other.pairs)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = self.pairs[:8].tolist()
        more = ", ..." if self.count > 8 else ""
        return f"PairList(total={self.total}, count={self.count}, pairs={shown!r}{more})"


def _check_u64(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or not 0 <= int(v) <= U64_MAX:
        raise ValueError(f"{what}: expected unsigned 64-bit integers, got {v!r}")
    return int(v)


def _int_array_to_u64(values: npt.NDArray[np.integer], what: str) -> U64Array:
    if values.dtype.kind not in "ui":
        raise ValueError(f"{what}: expected an integer array, got dtype {values.dtype}")
    if values.dtype.kind == "i" and values.size and int(values.min()) < 0:
        raise ValueError(f"{what}: negative values are not unsigned 64-bit integers")
    return np.ascontiguousarray(values, dtype=_U64_LE)


def encode_pairs(pairs: Sequence[tuple[int, int]] | npt.NDArray[np.integer]) -> bytes:
    """Encode a pair list body (type 1), computing the total from the lengths.

    ``pairs`` is a sequence of ``(address_or_offset, length)`` tuples or an ``(n, 2)`` integer array.
    Raises :class:`ValueError` for values outside u64, a wrong shape, or lengths whose sum exceeds u64.
    """
    if isinstance(pairs, np.ndarray):
        arr = _int_array_to_u64(pairs, "pair list")
        if arr.size == 0:
            arr = arr.reshape(0, 2)
    else:
        if type(pairs) is list and all(type(p) is tuple and len(p) == 2 for p in pairs):
            flat = [v for p in pairs for v in p]
            if all(type(v) is int for v in flat):  # the server's own lists: packed directly
                total = sum(flat[1::2])
                if total <= U64_MAX:
                    with contextlib.suppress(struct.error):  # (a value outside u64: checked below)
                        return _HEADER.pack(total, len(pairs)) + struct.pack(f"<{len(flat)}Q", *flat)
        items: list[tuple[int, int]] = []
        for item in pairs:
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise ValueError(f"pair list: expected (address, length) pairs, got {item!r}")
            items.append((_check_u64(item[0], "pair list"), _check_u64(item[1], "pair list")))
        arr = np.array(items, dtype=_U64_LE).reshape(len(items), 2)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"pair list: expected shape (n, 2), got {arr.shape}")
    total = _exact_sum(arr[:, 1])
    if total > U64_MAX:
        raise ValueError(f"pair list: total length {total} does not fit in u64")
    return _HEADER.pack(total, arr.shape[0]) + arr.tobytes()


def decode_pairs(buf: BytesLike) -> PairList:
    """Decode a pair list body (type 1) without copying.

    Raises :class:`~dissoc.errors.ProtocolError` unless the buffer is exactly ``16 + 16 * count`` bytes and
    the declared total equals the sum of the lengths.
    """
    mv = as_byte_view(buf)
    n = len(mv)
    if n < PAIRS_HEADER_SIZE:
        raise ProtocolError(
            f"pair list: expected at least {PAIRS_HEADER_SIZE} bytes (u64 total, u64 count), got {n}"
        )
    total, count = _HEADER.unpack_from(mv)
    available = (n - PAIRS_HEADER_SIZE) // _PAIR_SIZE
    if count > available or n != PAIRS_HEADER_SIZE + _PAIR_SIZE * count:
        raise ProtocolError(
            f"pair list: expected {PAIRS_HEADER_SIZE + _PAIR_SIZE * count} bytes for count {count}, "
            f"got {n} bytes"
        )
    pairs: U64Array = np.frombuffer(mv, dtype=_U64_LE, count=2 * count, offset=PAIRS_HEADER_SIZE).reshape(
        count, 2
    )
    flat: tuple[int, ...] | None = None
    if count <= _SHORT:  # the per-message path: Python ints are cheaper than numpy calls on a few values
        flat = _short(count).unpack_from(mv, PAIRS_HEADER_SIZE)
        actual = sum(flat[1::2])
    else:
        actual = _exact_sum(pairs[:, 1])
    if actual != total:
        raise ProtocolError(
            f"pair list: expected the declared total {total} to equal the sum of the {count} lengths, "
            f"got {actual}"
        )
    return PairList(total, pairs, flat)


#: Pair lists up to this many pairs are also decoded into Python ints (:meth:`PairList.flat`).
_SHORT: Final = 32
_SHORT_STRUCTS: dict[int, struct.Struct] = {}


def _short(count: int) -> struct.Struct:
    s = _SHORT_STRUCTS.get(count)
    if s is None:
        s = _SHORT_STRUCTS[count] = struct.Struct(f"<{2 * count}Q")
    return s


def encode_free(addresses: Iterable[int] | npt.NDArray[np.integer]) -> bytes:
    """Encode a free_data message: one or more u64 addresses/offsets.

    Raises :class:`ValueError` if there are none or one is not a u64.
    """
    if isinstance(addresses, np.ndarray):
        arr = _int_array_to_u64(addresses, "free_data").reshape(-1)
    else:
        if type(addresses) is list and addresses and all(type(a) is int for a in addresses):
            with contextlib.suppress(struct.error):  # (a value outside u64: named below)
                return struct.pack(f"<{len(addresses)}Q", *addresses)  # the client's own list of ints
        arr = np.array([_check_u64(a, "free_data") for a in addresses], dtype=_U64_LE)
    if arr.size == 0:
        raise ValueError("free_data: expected at least one address, got none")
    return arr.tobytes()


def decode_free(buf: BytesLike) -> U64Array:
    """Decode a free_data message into a uint64 array (a view of ``buf``).

    Raises :class:`~dissoc.errors.ProtocolError` if it is empty or not a multiple of 8 bytes.
    """
    mv = as_byte_view(buf)
    n = len(mv)
    if n == 0 or n % 8:
        raise ProtocolError(
            f"free_data: expected a non-empty multiple of 8 bytes (u64 addresses), got {n} bytes"
        )
    out: U64Array = np.frombuffer(mv, dtype=_U64_LE)
    return out
