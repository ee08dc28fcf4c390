"""ServerStream and ClientStream, alone and joined through a link that reorders messages."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc.errors import CodecError, DissocError, ProtocolError, RemoteError, ResourceError
from dissoc.protocol import (
    ClientEvent,
    ClientState,
    ClientStream,
    MessageReady,
    Received,
    SchemaReceived,
    ServerMessage,
    ServerState,
    ServerStream,
    StreamEnded,
    StreamStateError,
)
from dissoc.protocol.framing import (
    decode_stream_message,
    encode_eos,
    encode_error,
    encode_metadata_header,
    encode_metadata_message,
)
from dissoc.protocol.pairs import PairList, encode_pairs
from dissoc.protocol.reorder import SeqClass
from dissoc.protocol.seq import SEQ_MAX, seq_add
from dissoc.protocol.tags import BODY_PACKED, BODY_PAIRS, make_body_tag


def state_of(stream: ServerStream | ClientStream) -> ServerState | ClientState:
    """Read the state through a call, so that type checkers do not keep an earlier narrowing."""
    return stream.state


def has_body(mv: memoryview) -> bool:
    """Stand-in for the codec: metadata starting with B (batch) or D (dictionary) has a body."""
    return len(mv) > 0 and mv[0] in (ord("B"), ord("D"))


def meta(seq: int, text: bytes) -> bytes:
    return encode_metadata_message(seq, text)


# -- ServerStream --------------------------------------------------------------------------------------------


def test_server_sequence() -> None:
    s = ServerStream()
    assert s.state is ServerState.IDLE
    assert s.schema(b"S") == encode_metadata_header(0)
    assert state_of(s) is ServerState.STREAMING
    m1 = s.message(b"B1", True)
    assert m1 == ServerMessage(encode_metadata_header(1), 1, make_body_tag(1, BODY_PACKED))
    header, seq, tag = s.message(b"D2", True, BODY_PAIRS)
    assert (header, seq, tag) == (encode_metadata_header(2), 2, (1 << 56) | 2)
    m3 = s.message(b"N3", False, BODY_PAIRS)
    assert m3.tag is None and m3.seq == 3
    assert (s.sent, s.next_seq) == (4, 4)
    assert s.end() == encode_eos(4)
    assert state_of(s) is ServerState.ENDED


def test_server_rollover() -> None:
    s = ServerStream(start_seq=SEQ_MAX)
    assert decode_stream_message(s.schema(b"S")).seq == SEQ_MAX
    m = s.message(b"B", True)
    assert m.seq == 0
    assert m.tag == make_body_tag(0, BODY_PACKED)
    assert s.end() == encode_eos(1)


def test_server_error_from_idle_and_streaming() -> None:
    s = ServerStream()
    data = s.error("NOT_FOUND", "no such ticket")
    assert data == encode_error(0, "NOT_FOUND", "no such ticket")
    assert s.state is ServerState.FAILED
    s2 = ServerStream()
    s2.schema(b"S")
    s2.message(b"B", True)
    assert decode_stream_message(s2.error("E", "m")).seq == 2


@pytest.mark.parametrize(
    ("setup", "op"),
    [
        ([], "message"),
        ([], "end"),
        (["schema"], "schema"),
        (["schema", "end"], "message"),
        (["schema", "end"], "end"),
        (["schema", "end"], "error"),
        (["error"], "schema"),
        (["error"], "message"),
        (["error"], "end"),
        (["error"], "error"),
    ],
)
def test_server_misuse(setup: list[str], op: str) -> None:
    s = ServerStream()
    calls: dict[str, Callable[[], object]] = {
        "schema": lambda: s.schema(b"S"),
        "message": lambda: s.message(b"B", True),
        "end": s.end,
        "error": lambda: s.error("c", "m"),
    }
    for step in setup:
        calls[step]()
    before = (s.state, s.next_seq, s.sent)
    with pytest.raises(StreamStateError, match=f"ServerStream.{op}"):
        calls[op]()
    assert (s.state, s.next_seq, s.sent) == before


def test_server_rejects_bad_arguments_without_consuming_a_seq() -> None:
    s = ServerStream()
    with pytest.raises(ValueError):
        s.schema(b"")
    s.schema(b"S")
    with pytest.raises(ValueError):
        s.message(b"B", True, body_type=7)
    with pytest.raises(ValueError):
        s.message(b"", False)
    assert s.next_seq == 1
    assert not issubclass(StreamStateError, DissocError)
    assert issubclass(StreamStateError, RuntimeError)


# -- ClientStream --------------------------------------------------------------------------------------------


def test_client_basic_flow() -> None:
    c = ClientStream(has_body)
    assert c.state is ClientState.AWAITING_SCHEMA
    buf = bytearray(meta(0, b"Schema"))
    [ev] = c.receive_metadata_message(buf)
    assert isinstance(ev, SchemaReceived)
    assert ev.seq == 0 and bytes(ev.metadata) == b"Schema"
    assert isinstance(ev.metadata, memoryview) and ev.metadata.obj is buf  # a view, not a copy
    assert state_of(c) is ClientState.STREAMING
    assert c.receive_metadata_message(meta(1, b"B1")) == []
    assert c.missing() == [1]
    assert c.pending_bytes == 2
    body = np.arange(4, dtype=np.int64)
    [ev] = c.receive_body(make_body_tag(1, BODY_PACKED), body)
    assert isinstance(ev, MessageReady)
    assert ev.seq == 1 and ev.body is body and ev.body_type == BODY_PACKED
    [ev] = c.receive_metadata_message(meta(2, b"N2"))
    assert isinstance(ev, MessageReady)
    assert (ev.seq, bytes(ev.metadata), ev.body_type, ev.body) == (2, b"N2", None, None)
    assert c.receive_metadata_message(meta(3, b"D3")) == []
    assert not c.metadata_complete
    assert c.receive_metadata_message(encode_eos(4)) == []
    assert state_of(c) is ClientState.ENDED and not c.finished
    assert c.metadata_complete  # only a body is outstanding: the metadata stream can be left
    assert c.missing() == [3]
    events = c.receive_body(make_body_tag(3, BODY_PAIRS), encode_pairs([(10, 8), (0, 0)]))
    assert len(events) == 2
    assert isinstance(events[0], MessageReady)
    assert events[0].body == PairList(8, np.array([[10, 8], [0, 0]], dtype=np.uint64))
    assert events[1] == StreamEnded(4)
    assert c.finished and state_of(c) is ClientState.FINISHED
    assert c.released == 4 and c.next_seq == 4 and c.pending_bytes == 0
    c.close()


def test_close_after_eos_names_missing_bodies() -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(0, b"S"))
    c.receive_metadata_message(meta(1, b"B1"))
    c.receive_metadata_message(meta(2, b"D2"))
    c.receive_body(make_body_tag(2, BODY_PACKED), b"d")
    c.receive_metadata_message(encode_eos(3))
    with pytest.raises(ProtocolError, match=r"missing bodies for seqs 0x00000001$"):
        c.close()
    assert c.failed


def test_body_sizes() -> None:
    class Device:
        nbytes = 123

    c = ClientStream(has_body, max_pending_bytes=200)
    c.receive_body(make_body_tag(1, BODY_PACKED), Device())
    assert c.pending_bytes == 123
    c.receive_body(make_body_tag(2, BODY_PACKED), b"12345")
    assert c.pending_bytes == 128
    c.receive_body(make_body_tag(3, BODY_PACKED), object(), nbytes=7)
    assert c.pending_bytes == 135
    with pytest.raises(ResourceError, match="limit of 200"):
        c.receive_body(make_body_tag(4, BODY_PACKED), Device())
    assert c.failed


def test_body_of_unknown_size_is_a_programming_error() -> None:
    c = ClientStream(has_body)
    with pytest.raises(TypeError, match="pass nbytes"):
        c.receive_body(make_body_tag(1, BODY_PACKED), object())
    c2 = ClientStream(has_body)
    with pytest.raises(TypeError, match="host memory"):
        c2.receive_body(make_body_tag(1, BODY_PAIRS), object())


def test_pairs_from_numpy_and_memoryview() -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(0, b"S"))
    c.receive_metadata_message(meta(1, b"B"))
    c.receive_metadata_message(meta(2, b"B"))
    arr = np.frombuffer(encode_pairs([(1, 2)]), dtype=np.uint64).copy()
    [e1] = c.receive_body(make_body_tag(1, BODY_PAIRS), arr)
    [e2] = c.receive_body(make_body_tag(2, BODY_PAIRS), memoryview(encode_pairs([(3, 4)])))
    assert isinstance(e1, MessageReady) and isinstance(e2, MessageReady)
    assert isinstance(e1.body, PairList) and e1.body.to_list() == [(1, 2)]
    assert isinstance(e2.body, PairList) and e2.body.to_list() == [(3, 4)]


def test_remote_error() -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(0, b"S"))
    with pytest.raises(RemoteError) as info:
        c.receive_metadata_message(encode_error(1, "NOT_FOUND", "no dataset 'x'"))
    assert (info.value.code, info.value.message) == ("NOT_FOUND", "no dataset 'x'")
    assert c.failed
    with pytest.raises(ProtocolError, match=r"already failed .*NOT_FOUND"):
        c.receive_metadata_message(meta(1, b"N"))
    with pytest.raises(ProtocolError, match="already failed"):
        c.receive_body(make_body_tag(1, 0), b"")
    c.close()  # a failed stream has nothing more to report


def test_remote_error_before_schema() -> None:
    c = ClientStream(has_body)
    with pytest.raises(RemoteError, match="UNKNOWN_TICKET: nope"):
        c.receive_metadata_message(encode_error(0, "UNKNOWN_TICKET", "nope"))


@pytest.mark.parametrize(
    ("first", "match"),
    [
        (
            meta(0, b"B0"),
            r"first message \(seq 0x00000000\) must be a schema: expected a schema without body",
        ),
        (encode_eos(0), "expected the schema first"),
        (b"\x01\x00\x00", "at least 5 bytes"),
    ],
)
def test_bad_first_message(first: bytes, match: str) -> None:
    c = ClientStream(has_body)
    with pytest.raises(ProtocolError, match=match):
        c.receive_metadata_message(first)
    assert c.failed


def test_metadata_before_the_schema_is_held() -> None:
    c = ClientStream(has_body)
    assert c.receive_metadata_message(meta(2, b"N2")) == []
    assert c.receive_metadata_message(meta(1, b"B1")) == []
    assert c.receive_body(make_body_tag(1, BODY_PACKED), b"x") == []
    assert state_of(c) is ClientState.AWAITING_SCHEMA
    assert c.missing() == [0]
    events = c.receive_metadata_message(meta(0, b"S"))
    assert [type(e) for e in events] == [SchemaReceived, MessageReady, MessageReady]
    assert [e.seq for e in events if isinstance(e, SchemaReceived | MessageReady)] == [0, 1, 2]
    assert state_of(c) is ClientState.STREAMING
    assert c.receive_metadata_message(encode_eos(3)) == [StreamEnded(3)]
    assert c.finished


def test_schema_with_a_body_is_refused_when_it_arrives() -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(1, b"N1"))  # no body at another seq is fine
    c.receive_metadata_message(meta(2, b"B2"))
    with pytest.raises(ProtocolError, match=r"first message \(seq 0x00000000\) must be a schema"):
        c.receive_metadata_message(meta(0, b"B0"))
    assert c.failed


def test_schema_rule_applies_at_start_seq() -> None:
    c = ClientStream(has_body, start_seq=SEQ_MAX)
    c.receive_metadata_message(meta(0, b"B0"))
    with pytest.raises(ProtocolError, match=r"first message \(seq 0xffffffff\) must be a schema"):
        c.receive_metadata_message(meta(SEQ_MAX, b"D"))


def test_body_for_the_schema_is_refused() -> None:
    c = ClientStream(has_body)
    c.receive_body(make_body_tag(0, BODY_PACKED), b"x")
    with pytest.raises(ProtocolError, match="got metadata saying it has none"):
        c.receive_metadata_message(meta(0, b"S"))


def test_end_of_stream_first() -> None:
    c = ClientStream(has_body)
    assert c.receive_metadata_message(encode_eos(3)) == []
    assert state_of(c) is ClientState.ENDED
    assert c.missing() == [0, 1, 2]
    assert not c.metadata_complete
    assert c.classify(3) is SeqClass.PAST_END
    assert c.receive_metadata_message(meta(2, b"B2")) == []
    assert c.receive_body(make_body_tag(2, BODY_PAIRS), encode_pairs([(1, 2)])) == []
    [ev] = c.receive_metadata_message(meta(0, b"S"))
    assert isinstance(ev, SchemaReceived)
    assert state_of(c) is ClientState.ENDED
    assert not c.metadata_complete
    events = c.receive_metadata_message(meta(1, b"N1"))
    assert c.metadata_complete
    assert [e.seq for e in events if isinstance(e, MessageReady)] == [1, 2]
    assert events[-1] == StreamEnded(3)
    assert c.finished
    c.close()


def test_close_after_early_eos_names_missing_metadata() -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(0, b"S"))
    c.receive_metadata_message(encode_eos(3))
    with pytest.raises(ProtocolError, match=r"missing metadata for seqs 0x00000001, 0x00000002$"):
        c.close()
    assert c.failed


@pytest.mark.parametrize(
    ("late", "match"),
    [
        (meta(2, b"N"), r"seq 0x00000002: expected only seqs before the end of stream \(seq 0x00000002"),
        (meta(7, b"N"), r"seq 0x00000007: expected only seqs before the end of stream"),
        (encode_eos(2), "got a second"),
        (encode_eos(5), "got a second"),
        (encode_error(2, "c", "m"), r"expected only metadata after end of stream .*error message.*c: m"),
        (meta(1, b"N"), r"0x00000001 was already released \(duplicate\?\)"),
        (meta(0, b"B"), r"0x00000000 was already released"),
    ],
)
def test_anything_but_missing_metadata_after_eos_is_a_protocol_error(late: bytes, match: str) -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(0, b"S"))
    c.receive_metadata_message(meta(1, b"N"))
    assert c.receive_metadata_message(encode_eos(2)) == [StreamEnded(2)]
    with pytest.raises(ProtocolError, match=match):
        c.receive_metadata_message(late)
    assert c.failed


@pytest.mark.parametrize(
    "late",
    [meta(3, b"N"), encode_eos(3), encode_eos(2), encode_error(1, "c", "m"), meta(0, b"S"), meta(1, b"B")],
)
def test_errors_after_an_early_eos(late: bytes) -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(1, b"B"))
    c.receive_metadata_message(encode_eos(3))
    if late == meta(0, b"S"):
        c.receive_metadata_message(late)  # fine once
    with pytest.raises(ProtocolError):
        c.receive_metadata_message(late)
    assert c.failed


def test_eos_count_below_metadata_seen() -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(4, b"N"))
    with pytest.raises(ProtocolError, match="at least 0x00000005, got 0x00000003"):
        c.receive_metadata_message(encode_eos(3))


def test_body_after_finish_is_a_protocol_error() -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(0, b"S"))
    c.receive_metadata_message(encode_eos(1))
    assert c.finished
    with pytest.raises(ProtocolError):
        c.receive_body(make_body_tag(1, 0), b"x")


@pytest.mark.parametrize(
    ("tag", "payload", "match"),
    [
        (1 << 40, b"", "reserved"),
        (2 << 56, b"", "body type"),
        (make_body_tag(1, BODY_PAIRS), b"\x00" * 17, "pair list"),
        (make_body_tag(1, BODY_PAIRS), encode_pairs([(1, 2)])[:-1], "pair list"),
    ],
)
def test_bad_bodies(tag: int, payload: bytes, match: str) -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(0, b"S"))
    with pytest.raises(ProtocolError, match=match):
        c.receive_body(tag, payload)
    assert c.failed


def test_has_body_errors_propagate_and_fail_the_stream() -> None:
    def strict(mv: memoryview) -> bool:
        if len(mv) == 0:
            raise CodecError("expected a Message flatbuffer, got 0 bytes")
        return has_body(mv)

    c = ClientStream(strict)
    with pytest.raises(CodecError):
        c.receive_metadata_message(encode_metadata_header(0))
    assert c.failed


def test_close_before_eos() -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(0, b"S"))
    c.receive_metadata_message(meta(1, b"B"))
    with pytest.raises(ProtocolError, match="expected an end-of-stream message"):
        c.close()
    assert c.failed


def test_window_is_forwarded() -> None:
    c = ClientStream(has_body, window=2)
    assert c.accepts(1) and not c.accepts(2)
    assert c.classify(1) is SeqClass.ACCEPT and c.classify(2) is SeqClass.AHEAD
    with pytest.raises(ResourceError):
        c.receive_body(make_body_tag(2, 0), b"")


def test_classify() -> None:
    c = ClientStream(has_body, window=4)
    assert c.classify(SEQ_MAX) is SeqClass.RELEASED
    c.receive_metadata_message(meta(0, b"S"))
    assert [c.classify(s) for s in (0, 1, 4, 5)] == [
        SeqClass.RELEASED,
        SeqClass.ACCEPT,
        SeqClass.ACCEPT,
        SeqClass.AHEAD,
    ]
    c.receive_metadata_message(encode_eos(3))
    assert [c.classify(s) for s in (0, 2, 3, 5)] == [
        SeqClass.RELEASED,
        SeqClass.ACCEPT,
        SeqClass.PAST_END,
        SeqClass.PAST_END,
    ]
    # a duplicate is classified as such, and passing it on fails the stream at once
    with pytest.raises(ProtocolError, match="already released"):
        c.receive_body(make_body_tag(0, BODY_PACKED), b"x")
    assert c.classify(2) is SeqClass.FAILED
    assert SeqClass.FAILED < 0


# -- server joined to client through a reordering link -------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    kind: bytes  # b"B" batch, b"D" dictionary, b"N" no body
    body_type: int
    payload: bytes
    pairs: list[tuple[int, int]]


specs = st.builds(
    Spec,
    st.sampled_from([b"B", b"B", b"D", b"N"]),
    st.sampled_from([BODY_PACKED, BODY_PAIRS]),
    st.binary(max_size=24),
    st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**40)), max_size=4),
)


class ShufflingLink:
    """Carries the two streams; delivers them interleaved at random, optionally reordered within each."""

    def __init__(self) -> None:
        self.metadata: list[bytes] = []
        self.bodies: list[tuple[int, bytes]] = []

    def send_metadata(self, header: bytes, flatbuffer: bytes = b"") -> None:
        self.metadata.append(header + flatbuffer)  # a gather-send, as a transport would do

    def send_body(self, tag: int, payload: bytes) -> None:
        self.bodies.append((tag, payload))

    def deliver(self, client: ClientStream, rnd: random.Random, shuffle: bool) -> list[ClientEvent]:
        meta_q = list(self.metadata)
        body_q = list(self.bodies)
        if shuffle:  # any order on both streams, the schema and the end of stream included
            rnd.shuffle(meta_q)
            rnd.shuffle(body_q)
        events: list[ClientEvent] = []
        while meta_q or body_q:
            if body_q and (not meta_q or rnd.random() < 0.5):
                tag, payload = body_q.pop(0)
                events += client.receive_body(tag, payload)
            else:
                events += client.receive_metadata_message(meta_q.pop(0))
        return events


@settings(max_examples=120, deadline=None)
@given(
    st.lists(specs, max_size=20),
    st.randoms(use_true_random=False),
    st.booleans(),
    st.sampled_from([0, SEQ_MAX - 5, SEQ_MAX]),
)
def test_server_to_client_through_shuffling_link(
    batches: list[Spec], rnd: random.Random, shuffle: bool, start: int
) -> None:
    server = ServerStream(start_seq=start)
    link = ShufflingLink()
    link.send_metadata(server.schema(b"Schema"), b"Schema")
    for i, spec in enumerate(batches):
        flatbuffer = spec.kind + str(i).encode()
        has = spec.kind != b"N"
        header, seq, tag = server.message(flatbuffer, has, spec.body_type)
        assert seq == seq_add(start, i + 1)
        link.send_metadata(header, flatbuffer)
        if tag is not None:
            link.send_body(tag, spec.payload if spec.body_type == BODY_PACKED else encode_pairs(spec.pairs))
    link.send_metadata(server.end())

    client = ClientStream(has_body, start_seq=start)
    events = link.deliver(client, rnd, shuffle)

    assert client.finished
    assert client.metadata_complete
    assert isinstance(events[0], SchemaReceived)
    assert events[0].seq == start and bytes(events[0].metadata) == b"Schema"
    assert events[-1] == StreamEnded(len(batches) + 1)
    ready = events[1:-1]
    assert len(ready) == len(batches)
    for i, (ev, spec) in enumerate(zip(ready, batches, strict=True)):
        assert isinstance(ev, MessageReady)
        assert ev.seq == seq_add(start, i + 1)
        assert bytes(ev.metadata) == spec.kind + str(i).encode()
        if spec.kind == b"N":
            assert ev.body is None and ev.body_type is None
        elif spec.body_type == BODY_PACKED:
            assert ev.body_type == BODY_PACKED and ev.body == spec.payload
        else:
            assert ev.body_type == BODY_PAIRS
            assert isinstance(ev.body, PairList)
            assert ev.body.to_list() == spec.pairs
            assert ev.body.total == sum(n for _, n in spec.pairs)


# -- garbage never escapes as anything but a DissocError -----------------------------------------------------


small_seq = st.integers(0, 6)
metadata_messages = st.one_of(
    st.binary(max_size=12),
    st.builds(meta, small_seq, st.sampled_from([b"S", b"B", b"D", b"N", b""])),
    st.builds(encode_eos, small_seq),
    st.builds(lambda s: encode_error(s, "c", "m"), small_seq),
)
tags = st.one_of(
    st.integers(0, 2**64 - 1),
    st.builds(make_body_tag, small_seq, st.sampled_from([BODY_PACKED, BODY_PAIRS])),
)
ops = st.one_of(
    st.tuples(st.just("meta"), metadata_messages),
    st.tuples(
        st.just("body"),
        st.tuples(tags, st.one_of(st.binary(max_size=40), st.builds(encode_pairs, st.just([(1, 2)])))),
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(ops, max_size=15))
def test_garbage_raises_only_dissoc_errors(sequence: list[tuple[str, object]]) -> None:
    c = ClientStream(has_body, window=8, max_pending_bytes=100)
    released = 0
    for kind, arg in sequence:
        try:
            if kind == "meta":
                assert isinstance(arg, bytes)
                events = c.receive_metadata_message(arg)
            else:
                assert isinstance(arg, tuple)
                tag, payload = arg
                events = c.receive_body(tag, payload)
        except DissocError:
            assert c.failed
            continue
        for ev in events:
            if isinstance(ev, SchemaReceived | MessageReady):
                assert ev.seq == released
                released += 1
            else:
                assert isinstance(ev, StreamEnded)
                assert ev.count == released
                assert c.finished


# -- a batch of messages in one step -------------------------------------------------------------------------


def _events_key(events: list[ClientEvent]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for ev in events:
        if isinstance(ev, MessageReady):
            body = ev.body.to_list() if isinstance(ev.body, PairList) else bytes(ev.body or b"")  # type: ignore[call-overload]
            out.append(("ready", ev.seq, bytes(ev.metadata), ev.body_type, body))
        else:
            out.append((type(ev).__name__, getattr(ev, "seq", None)))
    return out


def _outcome(batched: bool | str, inputs: list[tuple[bytes, int, bytes]]) -> list[object]:
    """What a stream makes of (metadata, tag, body) triples, fed one message at a time, or each pair as one
    batch (``batched="lent"``: with payloads lent for the call only, kept through ``keep``); errors included.
    """
    kept: list[bytes] = []

    def keep(payload: memoryview, metadata: bytes | None) -> object:
        kept.append(bytes(payload))
        return kept[-1]

    c = ClientStream(has_body, window=4, max_pending_bytes=64, keep=keep)
    results: list[object] = [_events_key(c.receive_metadata_message(meta(0, b"S")))]
    for buf, tag, body in inputs:
        try:
            if batched:
                lent = batched == "lent"
                payload = memoryview(bytearray(body)) if lent else body
                rest: list[Received] = [(None, buf, len(buf)), (tag, payload, len(body))]
                while rest:  # (a stream that finished on the way leaves the rest: offered again, it fails)
                    rest = rest[c.receive(rest, lent=lent) :]
                events = list(c.events)
                c.events.clear()
                if lent:  # what was only lent was kept before it went into an event
                    assert all(
                        any(e.body is k for k in kept)
                        for e in events
                        if isinstance(e, MessageReady) and e.body_type == BODY_PACKED
                    )
            else:
                events = c.receive_metadata_message(buf)
                events = events + c.receive_body(tag, body, len(body))
            results.append(_events_key(events))
        except DissocError as exc:
            results.append((type(exc).__name__, str(exc)))
        results.append((c.state, c.next_seq, c.released, c.pending_bytes))
    return results


@pytest.mark.parametrize(
    "inputs",
    [
        [(meta(1, b"B1"), 1, b"x" * 8), (meta(2, b"B2"), 2, b"y" * 8)],  # in order: the held run
        [(meta(2, b"B2"), 2, b"y" * 8), (meta(1, b"B1"), 1, b"x" * 8)],  # ahead first: held, then both
        [(meta(1, b"B1"), 2, b"x" * 8)],  # the body of another message
        [(meta(1, b"N1"), 1, b"x" * 8)],  # a body for metadata without one
        [(meta(1, b"B1"), 1, b"x" * 8), (meta(1, b"B1"), 1, b"x" * 8)],  # a duplicate
        [(meta(1, b"B1"), 1, b"x" * 100)],  # over max_pending_bytes
        [(meta(9, b"B9"), 9, b"x" * 8)],  # beyond the window
        [(encode_eos(1), 1, b"x" * 8)],  # not metadata
        [(meta(1, b"B1"), (1 << 56) | 1, encode_pairs([(64, 8)]))],  # pairs: the general path
        [(b"\x00\x01", 1, b"x" * 8)],  # too short for a prefix
    ],
)
def test_a_batch_is_its_messages_one_by_one(inputs: list[tuple[bytes, int, bytes]]) -> None:
    assert _outcome(True, inputs) == _outcome(False, inputs)
    assert _outcome("lent", inputs) == _outcome(False, inputs)


def _picky(mv: memoryview | bytes) -> bool:
    """A codec stand-in that refuses the metadata ``X``."""
    if bytes(mv) == b"X":
        raise CodecError("not a flatbuffer")
    return has_body(memoryview(mv))


def test_a_batch_after_failure_and_from_a_failing_codec() -> None:
    c = ClientStream(has_body)
    c.receive_metadata_message(meta(0, b"S"))
    c.receive_body(make_body_tag(7, BODY_PACKED), b"x", 1)  # held until its metadata comes
    with pytest.raises(ProtocolError, match="duplicate"):
        c.receive([(None, meta(7, b"B7"), 7), (7, b"x", 1)])
    with pytest.raises(ProtocolError, match="already failed"):
        c.receive([(None, meta(1, b"B1"), 7), (1, b"x", 1)])

    c2 = ClientStream(_picky)
    c2.receive_metadata_message(meta(0, b"S"))
    c2.receive_metadata_message(meta(1, b"B1"))  # the held run begins
    with pytest.raises(CodecError, match="not a flatbuffer"):
        c2.receive([(None, meta(2, b"X"), 7), (1, b"x", 1)])
    assert state_of(c2) is ClientState.FAILED
