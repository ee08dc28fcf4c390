"""Sequence-number arithmetic, including roll-over."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dissoc.protocol.seq import (
    SEQ_HALF,
    SEQ_MAX,
    SEQ_MODULUS,
    check_seq,
    fmt_seq,
    next_seq,
    seq_add,
    seq_diff,
    seq_distance,
    seq_lt,
)

u32 = st.integers(0, SEQ_MAX)


def test_constants() -> None:
    assert SEQ_MAX == 0xFFFFFFFF
    assert SEQ_MODULUS == SEQ_MAX + 1
    assert SEQ_HALF == SEQ_MODULUS // 2


def test_next_seq_counts_up_and_rolls_over() -> None:
    assert next_seq(0) == 1
    assert next_seq(41) == 42
    assert next_seq(0xFFFFFFFE) == 0xFFFFFFFF
    assert next_seq(0xFFFFFFFF) == 0


@pytest.mark.parametrize("bad", [-1, SEQ_MODULUS, 2**64, 1.0, "1", None, True])
def test_check_seq_rejects_non_u32(bad: object) -> None:
    with pytest.raises(ValueError, match="sequence number"):
        check_seq(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        next_seq(bad)  # type: ignore[arg-type]


def test_check_seq_accepts_bounds() -> None:
    assert check_seq(0) == 0
    assert check_seq(SEQ_MAX) == SEQ_MAX


def test_distance_and_diff_across_rollover() -> None:
    assert seq_distance(0xFFFFFFFF, 0) == 1
    assert seq_distance(0, 0xFFFFFFFF) == SEQ_MAX
    assert seq_diff(0, 0xFFFFFFFF) == 1
    assert seq_diff(0xFFFFFFFF, 0) == -1
    assert seq_lt(0xFFFFFFF0, 5)
    assert not seq_lt(5, 0xFFFFFFF0)
    assert not seq_lt(7, 7)
    assert seq_add(0xFFFFFFFF, 2) == 1
    assert seq_add(1, -2) == 0xFFFFFFFF
    assert seq_add(5, SEQ_MODULUS) == 5


def test_fmt_seq_is_hex() -> None:
    assert fmt_seq(0) == "0x00000000"
    assert fmt_seq(0xDEADBEEF) == "0xdeadbeef"


@given(u32, st.integers(-SEQ_HALF + 1, SEQ_HALF - 1))
def test_diff_inverts_add(a: int, n: int) -> None:
    b = seq_add(a, n)
    assert 0 <= b <= SEQ_MAX
    assert seq_diff(b, a) == n
    assert seq_diff(a, b) == -n
    assert seq_lt(a, b) == (n > 0)
    assert seq_lt(b, a) == (n < 0)


@given(u32)
def test_half_window_is_the_ambiguous_edge(a: int) -> None:
    b = seq_add(a, SEQ_HALF)
    # exactly half the space apart: the signed difference is -2**31 both ways
    assert seq_diff(a, b) == seq_diff(b, a) == -SEQ_HALF


@given(u32, st.integers(0, 10_000))
def test_next_seq_repeated_equals_add(a: int, n: int) -> None:
    b = seq_add(a, n)
    assert seq_distance(a, b) == n
    c = a
    for _ in range(min(n, 50)):
        c = next_seq(c)
    assert c == seq_add(a, min(n, 50))
