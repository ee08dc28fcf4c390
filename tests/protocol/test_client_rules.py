"""The client's rules in the sans-IO ClientStream: the held run, the order an in-order transport promises,
input ahead of the window, flow towards the consumer, the data stream's error and arena messages; and a
ClientStream joined to a ServerStream through two links that a driver pumps in batches, pausing them as the
stream asks."""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc.errors import ProtocolError, RemoteError, ResourceError
from dissoc.protocol import (
    ARENA_TAG,
    ERROR_TAG,
    ArenaAnnouncement,
    ClientEvent,
    ClientState,
    ClientStream,
    MessageReady,
    PairList,
    Received,
    SchemaReceived,
    ServerStream,
    StreamEnded,
    encode_arena,
    encode_eos,
    encode_error,
    encode_metadata_header,
    encode_pairs,
)


def has_body(mv: memoryview | bytes) -> bool:
    """Stand-in for the codec: metadata starting with B (batch) or D (dictionary) has a body."""
    return len(mv) > 0 and mv[0] in (ord("B"), ord("D"))


def meta(seq: int, text: bytes) -> bytes:
    return encode_metadata_header(seq) + text


def md(seq: int) -> Received:
    return (None, meta(seq, b"B%d" % seq), 0)


def body(seq: int, n: int = 8) -> Received:
    return (seq, b"x" * n, n)


def drain(c: ClientStream) -> list[ClientEvent]:
    out = list(c.events)
    c.events.clear()
    return out


def ready_seqs(events: list[ClientEvent]) -> list[int]:
    return [e.seq for e in events if isinstance(e, MessageReady)]


def started(**kw: object) -> ClientStream:
    c = ClientStream(has_body, **kw)  # type: ignore[arg-type]
    c.receive([(None, meta(0, b"S"), 0)])
    assert isinstance(drain(c)[0], SchemaReceived)
    return c


# -- the held run --------------------------------------------------------------------------------------------


def test_metadata_running_on_is_held_and_each_body_releases_its_message() -> None:
    c = started()
    c.receive([md(1), md(2), md(3)])
    assert c.events == deque() and c.waiting and c.pending_bytes == 6
    assert c.missing() == [1, 2, 3]  # (asking hands the held run to the reorder buffer)
    c.receive([body(1), body(2), body(3)])
    assert ready_seqs(drain(c)) == [1, 2, 3]
    assert not c.waiting and c.pending_bytes == 0


def test_the_end_of_stream_before_the_bodies_leaves_the_held_run_held() -> None:
    """Over one connection the metadata stream may end long before its bodies come (split layouts): the
    held run goes on releasing in one step, and the stream finishes with the last body."""
    c = started()
    c.receive([md(1), md(2), (None, encode_eos(3), 0)])
    assert c.state is ClientState.ENDED and c.metadata_complete
    c.receive([body(1)])
    assert ready_seqs(drain(c)) == [1]
    c.receive([body(2)])
    events = drain(c)
    assert ready_seqs(events) == [2] and events[-1] == StreamEnded(3)
    assert c.finished


def test_an_end_of_stream_inside_the_held_run_is_refused_as_it_would_be_unheld() -> None:
    c = started()
    c.receive([md(1), md(2)])
    with pytest.raises(ProtocolError, match="after every metadata message received"):
        c.receive([(None, encode_eos(2), 0)])
    assert c.failed


def test_what_follows_the_end_in_a_batch_is_left_to_the_driver() -> None:
    c = started()
    taken = c.receive([md(1), body(1), (None, encode_eos(2), 0), (None, b"next stream", 0)])
    assert taken == 3 and c.finished
    with pytest.raises(ProtocolError):  # offered again, it is not this stream's
        c.receive([(None, b"next stream", 0)])


def test_lent_bodies_are_kept_with_their_metadata_when_known() -> None:
    kept: list[tuple[bytes, bytes | None]] = []

    def keep(payload: memoryview, metadata: bytes | None) -> object:
        kept.append((bytes(payload), metadata))
        return ("kept", bytes(payload))

    c = started(keep=keep)
    c.receive([md(1), (1, memoryview(b"one"), 3), (3, memoryview(b"three"), 5)], lent=True)
    c.receive([md(2), (2, memoryview(b"two"), 3), md(3)], lent=True)
    # (2 comes while 3 waits in the reorder buffer: no held run then, and no metadata known for its body)
    assert kept == [(b"one", b"B1"), (b"three", None), (b"two", None)]
    assert [e.body for e in drain(c) if isinstance(e, MessageReady)] == [
        ("kept", b"one"),
        ("kept", b"two"),
        ("kept", b"three"),
    ]


def test_held_metadata_names_what_a_body_will_be_released_with() -> None:
    c = started()
    assert c.held_metadata(1) is None  # nothing held yet
    c.receive([md(1), md(2), md(3)])
    assert [c.held_metadata(seq) for seq in (1, 2, 3)] == [b"B1", b"B2", b"B3"]
    assert c.held_metadata(4) is None and c.held_metadata(0) is None
    assert c.held_metadata((1 << 56) | 2) is None  # a pair list's tag: not a packed body
    c.receive([body(1)])
    assert c.held_metadata(1) is None and c.held_metadata(2) == b"B2"
    c.receive([md(5)])  # out of order: the held run goes to the reorder buffer
    assert c.held_metadata(2) is None
    c.receive([md(4), body(2), body(3), body(4), body(5)])
    assert ready_seqs(drain(c)) == [1, 2, 3, 4, 5]


def test_pair_lists_for_the_held_run_release_their_messages_whatever_is_lent() -> None:
    for lent in (False, True):
        c = started()
        c.receive([md(1), md(2)])
        tagged: list[Received] = []
        for seq in (1, 2):
            body = encode_pairs([(64 * seq, 8), (0, 0)])
            tagged.append(((1 << 56) | seq, memoryview(body) if lent else body, len(body)))
        c.receive(tagged, lent=lent)
        events = drain(c)
        assert ready_seqs(events) == [1, 2] and not c.waiting
        lists = [e.body for e in events if isinstance(e, MessageReady)]
        assert [pl.flat() for pl in lists if isinstance(pl, PairList)] == [(64, 8, 0, 0), (128, 8, 0, 0)]
        with pytest.raises(ProtocolError, match="pair list"):
            c.receive([md(3), ((1 << 56) | 3, b"short", 5)])


# -- an in-order transport -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("late", "match"),
    [
        (md(1), "expected metadata message 0x00000002, got 0x00000001.*a duplicate"),
        (md(4), "expected metadata message 0x00000002, got 0x00000004.*a jump 2 ahead"),
        ((None, encode_eos(5), 0), "expected end of stream 0x00000002, got 0x00000005"),
    ],
)
def test_an_ordered_metadata_stream_must_come_in_order(late: Received, match: str) -> None:
    c = started(ordered=True)
    c.receive([md(1)])
    with pytest.raises(ProtocolError, match=match):
        c.receive([late])


def test_an_unordered_metadata_stream_may_come_in_any_order() -> None:
    c = started()
    c.receive([md(3), md(1), body(3), body(1), md(2), body(2)])
    assert ready_seqs(drain(c)) == [1, 2, 3]


# -- ahead of the window -------------------------------------------------------------------------------------


def test_without_max_ahead_input_beyond_the_window_is_refused() -> None:
    c = started(window=4)
    with pytest.raises(ResourceError, match="less than 4 ahead"):
        c.receive([md(5)])


@pytest.mark.parametrize("shared", [False, True])
def test_input_ahead_of_the_window_waits_and_pauses_its_own_link(shared: bool) -> None:
    c = started(window=4, max_ahead=16, shared_link=shared)
    taken = c.receive([body(s) for s in range(1, 11)])
    # on a link of its own the rest of a batch goes back to the driver once the data stream must pause
    assert taken == (10 if shared else 5)
    assert c.pauses == ((False, False) if shared else (False, True))
    rest = [body(s) for s in range(taken + 1, 11)]
    while rest:  # (a driver would not read a paused link; these were read before it paused)
        rest = rest[c.receive(rest) :]
    rest = [md(s) for s in range(1, 11)]
    while rest:
        rest = rest[c.receive(rest) :]
    assert ready_seqs(drain(c)) == list(range(1, 11))
    assert c.pauses == (False, False) and not c.waiting


def test_metadata_ahead_of_the_window_waits_for_a_quarter_of_it() -> None:
    c = started(window=8, max_ahead=32, shared_link=False)
    c.receive([md(s) for s in range(1, 10)])  # 1-8 held, 9 waits
    assert c.pauses == (True, False)
    c.receive([body(1), body(2)])  # the window moves by two: not yet worth resuming for
    assert c.pauses == (True, False)
    c.receive([body(3)])  # a quarter of the window past 9's place: 9 joins the held run
    assert c.pauses == (False, False)
    c.receive([body(s) for s in range(4, 10)])
    assert ready_seqs(drain(c)) == list(range(1, 10))


def test_input_beyond_max_ahead_is_refused() -> None:
    c = started(window=4, max_ahead=16)
    with pytest.raises(ResourceError, match=r"16 sequence numbers ahead.*at most 4 may be pending"):
        c.receive([body(17)])


def test_waiting_input_on_a_shared_link_is_bounded_in_bytes() -> None:
    c = started(window=2, max_ahead=64, max_in_flight_bytes=100)
    with pytest.raises(ResourceError, match="arrived ahead of the reorder window"):
        c.receive([body(s, 40) for s in range(3, 8)])


# -- flow towards the consumer -------------------------------------------------------------------------------


def test_reading_pauses_at_the_bound_and_resumes_at_half() -> None:
    c = started(max_in_flight_bytes=100)
    batch = [m for s in range(1, 6) for m in (md(s), body(s, 30))]
    taken = c.receive(batch)
    assert taken == 8  # the 4th body reached the bound: the rest waits for the consumer
    assert c.pauses == (True, True) and c.in_flight == 120
    assert not c.consumed(30)  # 90
    assert not c.consumed(30)  # 60: not yet down to half
    assert c.consumed(10)  # 50
    assert c.pauses == (False, False)


def test_consumed_reports_the_end_of_a_pause_once() -> None:
    c = started(max_in_flight_bytes=100)
    c.receive([md(1), body(1, 100)])
    assert c.pauses == (True, True)
    assert not c.consumed(40)
    assert c.consumed(20)  # 40 left: under half
    assert c.pauses == (False, False)
    assert not c.consumed(40)


# -- the data stream's own messages --------------------------------------------------------------------------


def test_an_error_on_the_data_stream_is_a_remote_error() -> None:
    c = started()
    with pytest.raises(RemoteError, match="quota_exceeded"):
        c.receive([(ERROR_TAG, encode_error(1, "quota_exceeded", "free what you hold"), 40)])
    assert c.failed


def test_an_arena_announcement_comes_before_the_pair_lists_it_names() -> None:
    c = started()
    announcement = encode_arena("shm", b"/seg")
    c.receive([(ARENA_TAG, announcement, len(announcement)), md(1)])
    events = drain(c)
    assert isinstance(events[0], ArenaAnnouncement) and events[0].remote_handle == b"/seg"


# -- joined to a server through two links a driver pumps -----------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 80),
    st.randoms(use_true_random=False),
    st.sampled_from([1, 2, 4, 16]),
    st.booleans(),
    st.booleans(),
)
def test_a_driver_that_pauses_as_asked_reads_every_stream_whole(
    count: int, rnd: random.Random, window: int, shared: bool, lent: bool
) -> None:
    """Metadata and bodies on two links (or one), delivered in batches of random size, each link read only
    while the stream does not ask it to pause, a consumer taking events at random moments: every message
    comes once, in order, and the driver is never left with nothing to do while messages are unread."""
    server = ServerStream()
    meta_link: list[Received] = [(None, server.schema(b"S") + b"S", 0)]
    data_link: list[Received] = []
    for _ in range(count):
        header, seq, tag = server.message(b"B", True)
        meta_link.append((None, header + b"B", 0))
        assert tag is not None
        data_link.append((tag, b"%d" % seq, 4))
    meta_link.append((None, server.end(), 0))
    if shared:  # one link, in the order sent
        meta_link = [m for pair in zip(meta_link[1:-1], data_link, strict=True) for m in pair]
        meta_link = [(None, server_schema(), 0), *meta_link, (None, encode_eos(count + 1), 0)]
        data_link = []
    c = ClientStream(
        has_body,
        window=window,
        ordered=True,
        max_ahead=4 * window,
        max_in_flight_bytes=16,
        shared_link=shared,
        keep=lambda p, m: bytes(p),
    )
    got: list[ClientEvent] = []
    while not c.finished:
        paused = c.pauses
        links = [q for q, stop in ((meta_link, paused[0]), (data_link, paused[1])) if q and not stop]
        if c.events and (not links or rnd.random() < 0.3):
            ev = c.events.popleft()
            got.append(ev)
            if isinstance(ev, MessageReady):
                c.consumed(ev.nbytes)
            continue
        assert links, "nothing to read and nothing to consume: the stream asked for a pause it never ends"
        q = rnd.choice(links)
        n = rnd.randint(1, 6)
        batch = q[:n]
        if lent:
            batch = [(t, memoryview(p) if t is not None else p, s) for t, p, s in batch]
        taken = c.receive(batch, lent=lent)
        assert taken >= 1
        del q[:taken]
    got += c.events
    assert isinstance(got[0], SchemaReceived)
    assert ready_seqs(got) == list(range(1, count + 1))
    assert [e.body for e in got if isinstance(e, MessageReady)] == [b"%d" % s for s in range(1, count + 1)]
    assert got[-1] == StreamEnded(count + 1)


def server_schema() -> bytes:
    return ServerStream().schema(b"S") + b"S"
