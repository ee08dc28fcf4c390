"""Metadata-stream messages: prefix, end of stream, metadata, error."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dissoc.errors import DissocError, ProtocolError
from dissoc.protocol.framing import (
    PREFIX_SIZE,
    EndOfStream,
    ErrorMessage,
    MessageType,
    MetadataMessage,
    as_byte_view,
    decode_stream_message,
    encode_eos,
    encode_error,
    encode_error_payload,
    encode_metadata_header,
    encode_metadata_message,
    encode_prefix,
)

u32 = st.integers(0, 0xFFFFFFFF)


def test_header_layout() -> None:
    h = encode_metadata_header(0x01020304)
    assert isinstance(h, bytes)
    assert h == b"\x01\x04\x03\x02\x01"
    assert len(h) == PREFIX_SIZE
    assert encode_eos(7) == b"\x00\x07\x00\x00\x00"
    assert encode_prefix(0xE0, 1) == b"\xe0\x01\x00\x00\x00"
    assert encode_metadata_message(2, b"abc") == encode_metadata_header(2) + b"abc"


def test_message_type_values() -> None:
    assert [int(t) for t in MessageType] == [0, 1, 0xE0]
    assert [t.name for t in MessageType] == ["END_OF_STREAM", "METADATA", "ERROR"]


@pytest.mark.parametrize("bad_seq", [-1, 1 << 32])
def test_encoders_reject_bad_seq(bad_seq: int) -> None:
    with pytest.raises(ValueError):
        encode_metadata_header(bad_seq)
    with pytest.raises(ValueError):
        encode_eos(bad_seq)
    with pytest.raises(ValueError):
        encode_error(bad_seq, "c", "m")


def test_encode_prefix_rejects_bad_type() -> None:
    with pytest.raises(ValueError):
        encode_prefix(256, 0)
    with pytest.raises(ValueError):
        encode_prefix(-1, 0)


@given(u32, st.binary(max_size=256))
def test_metadata_round_trip(seq: int, payload: bytes) -> None:
    msg = decode_stream_message(encode_metadata_header(seq) + payload)
    assert isinstance(msg, MetadataMessage)
    assert msg.seq == seq
    assert isinstance(msg.metadata, memoryview)
    assert bytes(msg.metadata) == payload


def test_metadata_is_a_view_not_a_copy() -> None:
    buf = bytearray(encode_metadata_message(3, b"hello"))
    msg = decode_stream_message(buf)
    assert isinstance(msg, MetadataMessage)
    buf[PREFIX_SIZE] = ord("J")
    assert bytes(msg.metadata) == b"Jello"
    assert msg.metadata.obj is buf


def test_decoder_accepts_memoryview_of_other_format() -> None:
    import array

    arr = array.array("I", [0, 0])  # 8 bytes of zeros: type 0 but 8 bytes -> bad EOS
    with pytest.raises(ProtocolError, match="exactly 5 bytes"):
        decode_stream_message(memoryview(arr))
    raw = bytearray(8)
    raw[0] = 1
    msg = decode_stream_message(memoryview(raw).cast("H"))
    assert isinstance(msg, MetadataMessage)
    assert len(msg.metadata) == 3


def test_as_byte_view_rejects_non_contiguous() -> None:
    mv = memoryview(bytes(range(16))).cast("B", (4, 4))[::2]
    with pytest.raises(TypeError):
        as_byte_view(mv)


@given(u32)
def test_eos_round_trip(seq: int) -> None:
    assert decode_stream_message(encode_eos(seq)) == EndOfStream(seq)


@pytest.mark.parametrize("extra", [b"\x00", b"\x00" * 3, b"xyz" * 100])
def test_eos_with_extra_bytes_is_rejected(extra: bytes) -> None:
    with pytest.raises(ProtocolError, match=r"expected exactly 5 bytes, got \d+"):
        decode_stream_message(encode_eos(1) + extra)


@pytest.mark.parametrize("n", range(PREFIX_SIZE))
def test_short_messages_are_rejected(n: int) -> None:
    with pytest.raises(ProtocolError, match=f"at least 5 bytes .*got {n} byte"):
        decode_stream_message(b"\x01" * n)


@pytest.mark.parametrize("t", [2, 3, 0x7F, 0xDF, 0xE1, 0xFF])
def test_unknown_type_is_rejected(t: int) -> None:
    with pytest.raises(ProtocolError, match=f"got 0x{t:02x}"):
        decode_stream_message(bytes([t]) + b"\x00" * 10)


@given(u32, st.text(max_size=50), st.text(max_size=200))
def test_error_round_trip(seq: int, code: str, message: str) -> None:
    data = encode_error(seq, code, message)
    assert data[0] == 0xE0
    assert struct.unpack_from("<I", data, 1)[0] == seq
    data[PREFIX_SIZE:].decode("utf-8")  # always valid UTF-8
    assert decode_stream_message(data) == ErrorMessage(seq, code, message)


def test_error_payload_is_the_documented_json() -> None:
    payload = encode_error_payload("NOT_FOUND", "no dataset 'x'")
    assert json.loads(payload) == {"code": "NOT_FOUND", "message": "no dataset 'x'"}
    with pytest.raises(TypeError):
        encode_error_payload(1, "x")  # type: ignore[arg-type]


def test_error_accepts_non_ascii_utf8_and_extra_keys() -> None:
    payload = json.dumps({"code": "E", "message": "ünïcode ✓", "detail": 3}, ensure_ascii=False).encode()
    msg = decode_stream_message(encode_prefix(0xE0, 9) + payload)
    assert msg == ErrorMessage(9, "E", "ünïcode ✓")


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xff\xfe{}", "UTF-8"),
        (b"", "JSON"),
        (b"{not json", "JSON"),
        (b"[1, 2]", "JSON object"),
        (b'"text"', "JSON object"),
        (b'{"code": "x"}', "string fields"),
        (b'{"message": "x"}', "string fields"),
        (b'{"code": 1, "message": "x"}', "string fields"),
        (b'{"code": "x", "message": null}', "string fields"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON"),
    ],
)
def test_bad_error_payloads_are_protocol_errors(payload: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_stream_message(encode_prefix(0xE0, 0) + payload)


@given(st.binary(max_size=64))
def test_garbage_never_raises_anything_but_protocol_error(data: bytes) -> None:
    try:
        msg = decode_stream_message(data)
    except ProtocolError as exc:
        assert isinstance(exc, DissocError)
        assert "expected" in str(exc)
    else:
        assert isinstance(msg, EndOfStream | MetadataMessage | ErrorMessage)
        assert msg.seq == struct.unpack_from("<I", data, 1)[0]
