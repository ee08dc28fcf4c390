"""Pair lists (body type 1) and free_data messages."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dissoc.errors import ProtocolError
from dissoc.protocol.pairs import (
    PAIRS_HEADER_SIZE,
    U64_MAX,
    PairList,
    decode_free,
    decode_pairs,
    encode_free,
    encode_pairs,
)

u64 = st.integers(0, U64_MAX)
small_len = st.integers(0, U64_MAX // 16)
pair_lists = st.lists(st.tuples(u64, small_len), max_size=12)


def _raw(total: int, count: int, pairs: list[tuple[int, int]]) -> bytes:
    return struct.pack("<QQ", total, count) + b"".join(struct.pack("<QQ", a, n) for a, n in pairs)


def test_layout() -> None:
    data = encode_pairs([(0x1000, 24), (0, 0), (0x2000, 8)])
    assert isinstance(data, bytes)
    assert data == _raw(32, 3, [(0x1000, 24), (0, 0), (0x2000, 8)])
    assert len(data) == PAIRS_HEADER_SIZE + 3 * 16


@given(pair_lists)
def test_round_trip_from_tuples(pairs: list[tuple[int, int]]) -> None:
    pl = decode_pairs(encode_pairs(pairs))
    assert pl.total == sum(n for _, n in pairs)
    assert pl.count == len(pairs) == len(pl)
    assert pl.pairs.shape == (len(pairs), 2)
    assert pl.pairs.dtype == np.uint64
    assert pl.to_list() == pairs
    assert pl.addresses.tolist() == [a for a, _ in pairs]
    assert pl.lengths.tolist() == [n for _, n in pairs]
    assert pl.flat() == tuple(v for pair in pairs for v in pair)


@given(pair_lists)
def test_round_trip_from_numpy(pairs: list[tuple[int, int]]) -> None:
    arr = np.array(pairs, dtype=np.uint64).reshape(-1, 2)
    assert encode_pairs(arr) == encode_pairs(pairs)
    assert decode_pairs(encode_pairs(arr)) == PairList(sum(n for _, n in pairs), arr)


def test_signed_numpy_input() -> None:
    arr = np.array([[1, 2], [3, 4]], dtype=np.int64)
    assert decode_pairs(encode_pairs(arr)).to_list() == [(1, 2), (3, 4)]
    with pytest.raises(ValueError, match="negative"):
        encode_pairs(np.array([[1, -2]], dtype=np.int64))
    with pytest.raises(ValueError, match="integer array"):
        encode_pairs(np.array([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="shape"):
        encode_pairs(np.array([1, 2, 3], dtype=np.uint64))


def test_empty_and_zero_pairs_are_legal() -> None:
    empty = decode_pairs(encode_pairs([]))
    assert (empty.total, empty.count) == (0, 0)
    assert empty.pairs.shape == (0, 2)
    zeros = decode_pairs(encode_pairs([(0, 0), (0, 0)]))
    assert zeros.total == 0
    assert zeros.to_list() == [(0, 0), (0, 0)]


@pytest.mark.parametrize(
    "bad",
    [[(1, -1)], [(-1, 1)], [(2**64, 1)], [(1, 2**64)], [(1.0, 2)], [(True, 1)], [(1, 2, 3)], [1, 2], ["ab"]],
)
def test_encode_rejects_bad_pairs(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        encode_pairs(bad)  # type: ignore[arg-type]


def test_encode_rejects_total_overflow() -> None:
    with pytest.raises(ValueError, match="does not fit in u64"):
        encode_pairs([(0, U64_MAX), (0, 1)])
    # the largest total that fits is fine
    assert decode_pairs(encode_pairs([(0, U64_MAX - 1), (0, 1)])).total == U64_MAX


@pytest.mark.parametrize("count", [0, 1, 31, 32, 33, 200])
def test_flat_values_at_every_length(count: int) -> None:
    # short lists are also decoded into Python ints for the per-message path; long ones come from numpy
    pairs = [(U64_MAX - i, i * 3) for i in range(count)]
    pl = decode_pairs(encode_pairs(pairs))
    assert pl.flat() == tuple(v for pair in pairs for v in pair)
    assert all(type(v) is int for v in pl.flat())
    assert pl == PairList(pl.total, np.array(pairs, dtype=np.uint64).reshape(-1, 2))  # flat is not compared


def test_decode_is_zero_copy_and_alignment_free() -> None:
    buf = bytearray(encode_pairs([(5, 6)]))
    pl = decode_pairs(buf)
    assert np.shares_memory(pl.pairs, np.frombuffer(buf, dtype=np.uint8))
    unaligned = memoryview(b"\x00" + encode_pairs([(7, 8), (9, 10)]))[1:]
    assert decode_pairs(unaligned).to_list() == [(7, 8), (9, 10)]


@pytest.mark.parametrize("n", [0, 1, 8, 15])
def test_decode_rejects_short_header(n: int) -> None:
    with pytest.raises(ProtocolError, match=f"at least 16 bytes .* got {n}"):
        decode_pairs(b"\x00" * n)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (_raw(3, 2, [(0, 3)]), "expected 48 bytes for count 2, got 32"),  # truncated
        (_raw(3, 1, [(0, 3)]) + b"\x00", "expected 32 bytes for count 1, got 33"),  # trailing byte
        (_raw(3, 1, [(0, 3), (0, 0)]), "expected 32 bytes for count 1, got 48"),  # extra pair
        (_raw(0, U64_MAX, []), "for count 18446744073709551615, got 16"),  # absurd count, nothing allocated
        (_raw(0, 2**60, [(0, 0)]), "got 32 bytes"),
        (_raw(4, 1, [(0, 3)]), "declared total 4 to equal the sum of the 1 lengths, got 3"),
        # lengths whose u64 sum wraps to the declared total must not pass
        (_raw(0, 2, [(0, U64_MAX), (0, 1)]), "got 18446744073709551616"),
        (_raw(U64_MAX - 1, 3, [(0, U64_MAX), (0, U64_MAX), (0, 0)]), "declared total"),
    ],
)
def test_decode_rejects_inconsistent_lists(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_pairs(data)


def test_exact_sum_handles_many_large_lengths() -> None:
    pairs = [(0, U64_MAX // 4)] * 4
    pl = decode_pairs(encode_pairs(pairs))
    assert pl.total == 4 * (U64_MAX // 4)
    bad = _raw((5 * (U64_MAX // 4)) % 2**64, 5, [(0, U64_MAX // 4)] * 5)
    with pytest.raises(ProtocolError, match="declared total"):
        decode_pairs(bad)


def test_pairlist_equality_and_repr() -> None:
    a = decode_pairs(encode_pairs([(1, 2)]))
    b = PairList(2, np.array([[1, 2]], dtype=np.uint64))
    assert a == b
    assert a != PairList(2, np.array([[1, 3]], dtype=np.uint64))
    assert a != "x"
    assert "total=2" in repr(a)
    with pytest.raises(TypeError):
        hash(a)


@given(st.binary(max_size=80))
def test_garbage_pairs_raise_only_protocol_error(data: bytes) -> None:
    try:
        pl = decode_pairs(data)
    except ProtocolError as exc:
        assert "expected" in str(exc)
    else:
        assert len(data) == 16 + 16 * pl.count
        assert pl.total == sum(n for _, n in pl.to_list())


# -- free_data -----------------------------------------------------------------------------------------------


@given(st.lists(u64, min_size=1, max_size=20))
def test_free_round_trip(addresses: list[int]) -> None:
    data = encode_free(addresses)
    assert len(data) == 8 * len(addresses)
    assert data == b"".join(struct.pack("<Q", a) for a in addresses)
    out = decode_free(data)
    assert out.dtype == np.uint64
    assert out.tolist() == addresses


def test_free_from_numpy() -> None:
    arr = np.array([3, 4, 5], dtype=np.uint64)
    assert decode_free(encode_free(arr)).tolist() == [3, 4, 5]
    assert decode_free(encode_free(np.array([[1, 2]], dtype=np.int32))).tolist() == [1, 2]
    with pytest.raises(ValueError):
        encode_free(np.array([-1], dtype=np.int64))


@pytest.mark.parametrize("bad", [[], [-1], [2**64], [1.5], [None], [1, True], [3, -2], [5, 2**64]])
def test_encode_free_rejects_bad_input(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        encode_free(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [0, 1, 7, 9, 15, 17])
def test_decode_free_rejects_bad_sizes(n: int) -> None:
    with pytest.raises(ProtocolError, match=f"non-empty multiple of 8 bytes .* got {n} bytes"):
        decode_free(b"\x01" * n)
