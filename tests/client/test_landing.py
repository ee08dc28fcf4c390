"""Where the client lands packed bodies on the host (:mod:`dissoc.session.landing`): copied into a slab after
room for their framing (lent payloads), or given that room before they arrive (:meth:`Slabs.reserve`, for
transports that receive into an address); and the connection's lander, which asks for such room."""

from __future__ import annotations

import ctypes

import numpy as np
import pyarrow as pa
import pytest
from helpers.transport import joined_inproc

from dissoc.codec import MessageDecoder, MessageEncoder
from dissoc.errors import TransportError
from dissoc.session.landing import SLAB_BYTES, Landed, Slabs


def _batches(rows: int, count: int, strings: bool = False) -> list[pa.RecordBatch]:
    made = []
    for i in range(count):
        columns: dict[str, pa.Array] = {"a": pa.array(np.arange(i, i + rows, dtype=np.int64))}
        if strings:
            columns["s"] = pa.array([f"v{i}-{j}" for j in range(rows)])
        made.append(pa.record_batch(columns))
    return made


def _decoder_and_messages(batches: list[pa.RecordBatch]) -> tuple[MessageDecoder, list[tuple[bytes, bytes]]]:
    """A decoder that has the schema, and each batch as (metadata, packed body)."""
    encoder = MessageEncoder(batches[0].schema)
    decoder = MessageDecoder()
    decoder.decode(encoder.schema_message().metadata)
    messages = []
    for batch in batches:
        (message,) = encoder.encode(batch)
        body = b"".join(bytes(memoryview(b)) for b in message.body_buffers)
        messages.append((bytes(message.metadata), body))
    return decoder, messages


def _decode(decoder: MessageDecoder, metadata: bytes, landed: Landed) -> pa.RecordBatch:
    framed, plain = landed
    got = plain.read(framed) if plain is not None else decoder.decode_landed(metadata, framed)
    assert got is not None
    return got


@pytest.mark.parametrize("strings", [False, True], ids=["fixed-width", "strings"])
def test_reserved_room_takes_the_body_where_it_is_decoded(strings: bool) -> None:
    batches = _batches(1000, 6, strings)
    decoder, messages = _decoder_and_messages(batches)
    decoder.decode(*messages[0])  # known now: fixed-width batches land for one read (strings still checked)
    slabs = Slabs(decoder)
    seen: list[tuple[int, int]] = []
    landed_all = []
    for (metadata, body), batch in zip(messages, batches, strict=True):
        reserved = slabs.reserve(metadata, len(body))
        assert reserved is not None
        landed, address = reserved
        assert (landed.plain is not None) is (not strings)
        framed = landed.framed
        room = address - framed.address
        assert room > 0 and framed.size == room + len(body) and address % 8 == 0
        assert all(address >= end or address + len(body) <= start for start, end in seen), "overlap"
        seen.append((address, address + len(body)))
        ctypes.memmove(address, body, len(body))  # as the transport writes it
        landed_all.append((metadata, landed, batch))
    for metadata, landed, batch in landed_all:  # decoded later, each still whole
        assert _decode(decoder, metadata, landed).equals(batch)


def test_a_body_too_large_for_a_slab_is_left_to_the_allocator() -> None:
    decoder, messages = _decoder_and_messages(_batches(100, 1))
    metadata, _ = messages[0]
    assert Slabs(decoder).reserve(metadata, SLAB_BYTES // 2) is None


def test_a_full_slab_is_followed_by_a_fresh_one() -> None:
    batches = _batches(8000, 1)  # 64 KiB bodies: 16 to a slab
    decoder, messages = _decoder_and_messages(batches)
    metadata, body = messages[0]
    decoder.decode(metadata, body)  # (known now: each landing is read in one step, a slice of its slab)
    slabs = Slabs(decoder)
    kept = []
    for _ in range(40):
        reserved = slabs.reserve(metadata, len(body))
        assert reserved is not None
        landed, address = reserved
        ctypes.memmove(address, body, len(body))
        kept.append(landed)
    slabs_used = {landed.framed.parent.address for landed in kept if landed.framed.parent is not None}
    assert len(slabs_used) >= 3, "40 bodies of 64 KiB take at least three slabs"
    assert all(_decode(decoder, metadata, landed).equals(batches[0]) for landed in kept)


async def test_transports_that_read_into_buffers_never_ask_the_lander() -> None:
    """The in-process transport reads into what the allocator gives: a lander is asked only where a transport
    receives into an address of its choosing (UCX; tests/transport/test_ucx_calls.py)."""
    calls: list[tuple[int, int]] = []

    def lander(tag: int, length: int) -> None:
        calls.append((tag, length))
        raise RuntimeError("no room")

    async with joined_inproc() as (a, b):
        b.set_lander(lander)
        await a.send_tagged(5, b"hello")
        assert bytes((await b.recv_tagged(5)).payload) == b"hello"
    assert calls == []


def test_a_failing_lander_is_a_transport_error() -> None:
    from dissoc.transport.inproc import inproc_pair

    _a, b = inproc_pair()

    def lander(tag: int, length: int) -> None:
        raise RuntimeError("no room")

    b.set_lander(lander)
    with pytest.raises(TransportError, match="the lander failed for tagged message 0x0000000000000007"):
        b._allocate_at(7, 16)
    b.set_lander(lambda tag, length: None)
    payload, keep, address = b._allocate_at(7, 16)
    assert len(memoryview(payload)) == 16 and keep is not None and address
    landed = bytearray(16)
    b.set_lander(lambda tag, length: (landed, 1234))
    assert b._allocate_at(7, 16) == (landed, landed, 1234)
