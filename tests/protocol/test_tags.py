"""Data-stream tags: sequence number, reserved bits, body type."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dissoc.errors import ProtocolError
from dissoc.protocol.tags import (
    BODY_PACKED,
    BODY_PAIRS,
    BODY_TYPE_SHIFT,
    KNOWN_BODY_TYPES,
    RESERVED_MASK,
    SEQ_MASK,
    BodyTag,
    body_type_name,
    fmt_tag,
    make_body_tag,
    parse_body_tag,
)

u32 = st.integers(0, 0xFFFFFFFF)


def test_constants_follow_the_spec_text() -> None:
    assert SEQ_MASK == 0x00000000FFFFFFFF
    assert RESERVED_MASK == 0x00FFFFFF00000000
    assert BODY_TYPE_SHIFT == 56
    assert (BODY_PACKED, BODY_PAIRS) == (0, 1)
    assert frozenset({0, 1}) == KNOWN_BODY_TYPES
    # FACTS erratum: pairs is 1 << 56, not 1 << 55
    assert make_body_tag(0, BODY_PAIRS) == 1 << 56
    assert make_body_tag(0x12345678, BODY_PACKED) == 0x12345678
    assert make_body_tag(0xFFFFFFFF, BODY_PAIRS) == 0x01000000FFFFFFFF


@given(u32, st.sampled_from([BODY_PACKED, BODY_PAIRS]))
def test_round_trip(seq: int, body_type: int) -> None:
    tag = make_body_tag(seq, body_type)
    assert 0 <= tag < 2**64
    assert tag & SEQ_MASK == seq
    assert tag & RESERVED_MASK == 0
    parsed = parse_body_tag(tag)
    assert parsed == BodyTag(seq, body_type)
    assert (parsed.seq, parsed.body_type) == (seq, body_type)


@pytest.mark.parametrize("bit", range(32, 56))
def test_each_reserved_bit_is_rejected(bit: int) -> None:
    with pytest.raises(ProtocolError, match="reserved bits 32-55"):
        parse_body_tag((1 << bit) | 5)


@pytest.mark.parametrize("body_type", [2, 3, 0x80, 0xFF])
def test_unknown_body_type_is_rejected(body_type: int) -> None:
    with pytest.raises(ProtocolError, match=f"got 0x{body_type:02x}"):
        parse_body_tag((body_type << 56) | 1)


def test_shift_55_tag_is_rejected_as_reserved() -> None:
    # the spec diagram's (1 << 55) lands in the reserved bits
    with pytest.raises(ProtocolError, match="reserved"):
        parse_body_tag(1 << 55)


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "3", None, True])
def test_non_u64_tags_are_rejected(bad: object) -> None:
    with pytest.raises(ProtocolError, match="unsigned 64-bit"):
        parse_body_tag(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("seq", "body_type"), [(-1, 0), (2**32, 0), (0, 2), (0, -1), (0, 256)])
def test_make_body_tag_rejects_bad_input(seq: int, body_type: int) -> None:
    with pytest.raises(ValueError):
        make_body_tag(seq, body_type)


def test_names_and_formatting() -> None:
    assert body_type_name(BODY_PACKED) == "packed"
    assert body_type_name(BODY_PAIRS) == "pairs"
    assert body_type_name(7) == "unknown(0x07)"
    assert fmt_tag(1 << 56 | 7) == "0x0100000000000007"


@given(st.integers(0, 2**64 - 1))
def test_any_u64_parses_or_raises_protocol_error(tag: int) -> None:
    try:
        seq, body_type = parse_body_tag(tag)
    except ProtocolError as exc:
        assert "expected" in str(exc)
        assert tag & RESERVED_MASK or (tag >> 56) not in KNOWN_BODY_TYPES
    else:
        assert make_body_tag(seq, body_type) == tag
