"""ReorderBuffer: matching metadata and bodies, releasing in order, bounded memory, end of stream."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc.errors import ProtocolError, ResourceError
from dissoc.protocol.reorder import DEFAULT_WINDOW, Complete, ReorderBuffer, SeqClass
from dissoc.protocol.seq import SEQ_MAX, seq_add
from dissoc.protocol.tags import BODY_PACKED, BODY_PAIRS

RB = ReorderBuffer[str, bytes]


def seqs(done: list[Complete[str, bytes]]) -> list[int]:
    return [c.seq for c in done]


def test_in_order_flow() -> None:
    rb: RB = ReorderBuffer()
    out = rb.add_metadata(0, "schema", False)
    assert [(c.seq, c.metadata, c.body_type, c.body, c.has_body) for c in out] == [
        (0, "schema", None, None, False)
    ]
    assert rb.add_metadata(1, "b1", True) == []
    assert rb.next_seq == 1
    out = rb.add_body(1, BODY_PACKED, b"xyz", 3)
    assert [(c.seq, c.body, c.nbytes, c.has_body) for c in out] == [(1, b"xyz", 3, True)]
    assert not rb.finished
    assert rb.end(2) == []
    assert rb.finished
    assert rb.released == 2
    assert rb.pending_bytes == 0
    rb.close()  # finished: no error


def test_body_before_metadata_and_out_of_order_metadata() -> None:
    rb: RB = ReorderBuffer()
    assert rb.add_body(2, BODY_PAIRS, b"p2", 2) == []
    assert rb.add_body(1, BODY_PACKED, b"p1", 2) == []
    assert rb.pending_bytes == 4
    assert rb.add_metadata(0, "s", False, nbytes=10)[0].seq == 0
    assert rb.add_metadata(2, "m2", True, nbytes=5) == []  # waits for seq 1
    assert rb.backlog == 2
    out = rb.add_metadata(1, "m1", True)
    assert seqs(out) == [1, 2]
    assert [c.body_type for c in out] == [BODY_PACKED, BODY_PAIRS]
    assert rb.pending_bytes == 0
    assert rb.backlog == 0


def test_message_without_body_after_a_waiting_one() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    assert rb.add_metadata(1, "b", True) == []
    assert rb.add_metadata(2, "nobody", False) == []
    assert rb.missing() == [1]
    assert seqs(rb.add_body(1, 0, b"", 0)) == [1, 2]


def test_empty_stream() -> None:
    rb: RB = ReorderBuffer()
    assert not rb.metadata_complete
    assert rb.end(0) == []
    assert rb.finished
    assert rb.metadata_complete


# -- errors --------------------------------------------------------------------------------------------------


def test_metadata_before_the_schema_is_held_until_it_arrives() -> None:
    rb: RB = ReorderBuffer()
    assert rb.add_metadata(2, "m2", False, nbytes=2) == []
    assert rb.add_metadata(1, "m1", True, nbytes=1) == []
    assert rb.add_body(1, BODY_PACKED, b"b", 4) == []
    assert (rb.next_seq, rb.released, rb.backlog, rb.pending_bytes) == (0, 0, 2, 7)
    assert rb.missing() == [0]
    out = rb.add_metadata(0, "s", False, nbytes=3)
    assert [(c.seq, c.metadata, c.body) for c in out] == [(0, "s", None), (1, "m1", b"b"), (2, "m2", None)]
    assert (rb.backlog, rb.pending_bytes) == (0, 0)


def test_metadata_without_body_at_another_seq_is_fine() -> None:
    # only ClientStream insists that the message at start_seq is a schema; the buffer never looks inside
    rb: RB = ReorderBuffer()
    assert seqs(rb.add_metadata(0, "b", True)) == []
    assert seqs(rb.add_metadata(1, "x", False)) == []
    assert seqs(rb.add_body(0, 0, b"", 0)) == [0, 1]


def test_duplicate_metadata() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(2, "m", True)
    with pytest.raises(ProtocolError, match=r"0x00000002.*duplicate"):
        rb.add_metadata(2, "m", True)
    with pytest.raises(ProtocolError, match="already released"):
        rb.add_metadata(0, "s", False)


def test_duplicate_body() -> None:
    rb: RB = ReorderBuffer()
    rb.add_body(3, 0, b"a", 1)
    with pytest.raises(ProtocolError, match=r"0x00000003.*duplicate"):
        rb.add_body(3, 0, b"a", 1)
    assert rb.pending_bytes == 1
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", True)
    rb.add_body(1, 0, b"b", 1)
    with pytest.raises(ProtocolError, match="already released"):
        rb.add_body(1, 0, b"b", 1)


def test_body_for_message_without_body() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(2, "m", False)
    with pytest.raises(ProtocolError, match="expected no body"):
        rb.add_body(2, 0, b"x", 1)
    rb.add_body(3, BODY_PAIRS, b"x", 1)
    with pytest.raises(ProtocolError, match="a pairs body arrived for it"):
        rb.add_metadata(3, "m", False)
    # the schema has been released; a body for it is a late duplicate
    with pytest.raises(ProtocolError, match="already released"):
        rb.add_body(0, 0, b"x", 1)


def test_metadata_after_end() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.end(1)
    assert rb.finished
    with pytest.raises(ProtocolError, match=r"seq 0x00000001: expected only seqs before the end of stream"):
        rb.add_metadata(1, "m", False)
    with pytest.raises(ProtocolError, match="second"):
        rb.end(1)
    with pytest.raises(ProtocolError, match="already released"):
        rb.add_metadata(0, "s", False)


def test_end_of_stream_before_metadata() -> None:
    rb: RB = ReorderBuffer()
    assert rb.end(4) == []
    assert rb.ended and not rb.finished
    assert rb.eos_seq == 4
    assert rb.missing() == [0, 1, 2, 3]
    assert not rb.metadata_complete
    assert rb.add_metadata(2, "m2", True) == []
    with pytest.raises(ProtocolError, match=r"seq 0x00000004: expected only seqs before the end of stream"):
        rb.add_metadata(4, "m4", False)
    with pytest.raises(ProtocolError, match="before the end of stream"):
        rb.add_body(5, 0, b"x", 1)
    with pytest.raises(ProtocolError, match="second"):
        rb.end(4)
    assert seqs(rb.add_metadata(0, "s", False)) == [0]
    assert seqs(rb.add_metadata(1, "m1", False)) == [1]
    assert seqs(rb.add_metadata(3, "m3", False)) == []
    assert rb.missing() == [2]
    assert rb.metadata_complete  # only a body is outstanding
    assert seqs(rb.add_body(2, 0, b"x", 1)) == [2, 3]
    assert rb.finished
    assert rb.released == 4
    rb.close()


def test_end_of_stream_before_the_schema_only() -> None:
    rb: RB = ReorderBuffer()
    rb.end(1)
    assert not rb.finished
    assert seqs(rb.add_metadata(0, "s", False)) == [0]
    assert rb.finished


def test_eos_count_below_a_seq_seen() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", True)
    rb.add_metadata(2, "m", True)
    with pytest.raises(
        ProtocolError, match=r"after every metadata message received, at least 0x00000003, got"
    ):
        rb.end(2)
    with pytest.raises(ProtocolError, match="at least 0x00000003"):
        rb.end(1)
    assert not rb.ended  # refused: nothing recorded
    rb.end(5)  # gaps (3, 4) are fine: that metadata may still come
    assert rb.ended and not rb.finished
    assert rb.missing() == [1, 2, 3, 4]


def test_eos_behind_the_released_seqs() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", False)
    with pytest.raises(
        ProtocolError, match=r"expected seq 0x00000002 or later \(2 message\(s\) already released"
    ):
        rb.end(1)
    with pytest.raises(ProtocolError, match="behind"):
        rb.end(0)
    assert not rb.ended
    rb.end(2)
    assert rb.finished


def test_eos_reports_bodies_without_metadata() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", True)
    rb.add_body(5, 0, b"x", 1)
    rb.add_body(3, 0, b"x", 1)
    with pytest.raises(ProtocolError, match=r"at or after it: 0x00000003, 0x00000005"):
        rb.end(2)
    with pytest.raises(ProtocolError, match=r"at or after it: 0x00000005$"):
        rb.end(4)
    rb.end(6)
    assert rb.missing() == [1, 2, 3, 4, 5]


def test_body_beyond_eos() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", True)
    rb.end(2)
    with pytest.raises(ProtocolError, match="before the end of stream"):
        rb.add_body(2, 0, b"x", 1)
    assert seqs(rb.add_body(1, 0, b"x", 1)) == [1]
    assert rb.finished


def test_close_names_what_is_missing() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", True)
    rb.add_metadata(2, "m", True)
    rb.add_body(2, 0, b"x", 1)
    with pytest.raises(ProtocolError, match=r"expected an end-of-stream message.*0x00000001"):
        rb.close()
    rb.end(3)
    assert rb.missing() == [1]
    with pytest.raises(ProtocolError, match=r"missing bodies for seqs 0x00000001$"):
        rb.close()


def test_close_after_early_eos_names_missing_metadata_and_bodies() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(2, "m", True)
    rb.end(4)
    with pytest.raises(
        ProtocolError,
        match=r"expected metadata for every seq before the end of stream \(0x00000004\) and a body .*, "
        r"missing metadata for seqs 0x00000000, 0x00000001, 0x00000003; bodies for seqs 0x00000002$",
    ):
        rb.close()


def test_close_before_eos_names_gaps_below_what_is_held() -> None:
    rb: RB = ReorderBuffer()
    rb.add_body(3, 0, b"x", 1)
    assert rb.missing() == [0, 1, 2, 3]
    with pytest.raises(ProtocolError, match=r"incomplete: 0x00000000, 0x00000001, 0x00000002, 0x00000003\)"):
        rb.close()
    empty: RB = ReorderBuffer()
    assert empty.missing() == []
    with pytest.raises(ProtocolError, match=r"incomplete: none"):
        empty.close()


def test_close_truncates_long_lists() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    for s in range(1, 40):
        rb.add_metadata(s, "m", True)
    rb.end(40)
    with pytest.raises(ProtocolError, match=r"0x00000010, \.\.\.$"):
        rb.close()
    assert rb.missing(limit=100) == list(range(1, 40))


# -- limits --------------------------------------------------------------------------------------------------


def test_window_bounds_bodies_ahead() -> None:
    rb: RB = ReorderBuffer(window=4)
    assert rb.window == 4
    assert rb.accepts(3) and not rb.accepts(4)
    rb.add_body(3, 0, b"x", 1)
    with pytest.raises(ResourceError, match="less than 4 ahead of 0x00000000, got one 4 ahead"):
        rb.add_body(4, 0, b"x", 1)
    with pytest.raises(ResourceError):
        rb.add_body(0x7FFFFFFF, 0, b"x", 1)
    # more than half the space ahead is refused at once: nothing was released, so it is no duplicate
    with pytest.raises(ProtocolError, match=r"got one 2147483649 ahead \(out of range"):
        rb.add_body(0x80000001, 0, b"x", 1)
    rb.add_metadata(0, "s", False)
    assert rb.accepts(4)
    rb.add_body(4, 0, b"x", 1)


def test_window_bounds_metadata_ahead() -> None:
    rb: RB = ReorderBuffer(window=3)
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", True)
    rb.add_metadata(2, "m", True)
    rb.add_metadata(3, "m", True)
    with pytest.raises(ResourceError):
        rb.add_metadata(4, "m", True)
    assert rb.backlog == 3


def test_window_and_bytes_bound_metadata_held_before_the_schema() -> None:
    rb: RB = ReorderBuffer(window=3, max_pending_bytes=10)
    rb.add_metadata(2, "m", False, nbytes=6)
    with pytest.raises(ResourceError, match="less than 3 ahead of 0x00000000, got one 3 ahead"):
        rb.add_metadata(3, "m", False)
    with pytest.raises(ResourceError, match="limit of 10 bytes"):
        rb.add_metadata(1, "m", False, nbytes=5)
    assert (rb.backlog, rb.pending_bytes) == (1, 6)
    rb.add_metadata(1, "m", False, nbytes=4)
    assert seqs(rb.add_metadata(0, "s", False)) == [0, 1, 2]
    rb.add_metadata(5, "m", False)  # the window moved


def test_eos_is_not_bounded_by_the_window() -> None:
    rb: RB = ReorderBuffer(window=2)
    rb.end(10)  # holds no memory
    assert rb.classify(5) is SeqClass.AHEAD
    assert rb.classify(10) is SeqClass.PAST_END
    for s in range(10):
        rb.add_metadata(s, "m", False)
    assert rb.finished


def test_classify() -> None:
    rb: RB = ReorderBuffer(window=4)
    assert [rb.classify(s) for s in (0, 3, 4, 0x7FFFFFFF, 0x80000000, SEQ_MAX)] == [
        SeqClass.ACCEPT,
        SeqClass.ACCEPT,
        SeqClass.AHEAD,
        SeqClass.AHEAD,
        SeqClass.RELEASED,
        SeqClass.RELEASED,
    ]
    assert (
        SeqClass.RELEASED < 0 and SeqClass.PAST_END < 0 and int(SeqClass.ACCEPT) == 0 and SeqClass.AHEAD > 0
    )
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", True)
    assert [rb.classify(s) for s in (0, 1, 4, 5)] == [
        SeqClass.RELEASED,
        SeqClass.ACCEPT,
        SeqClass.ACCEPT,
        SeqClass.AHEAD,
    ]
    rb.end(3)
    # past the end wins over ahead of the window: waiting would not help
    assert [rb.classify(s) for s in (0, 1, 2, 3, 4, 5, 100)] == [
        SeqClass.RELEASED,
        SeqClass.ACCEPT,
        SeqClass.ACCEPT,
        SeqClass.PAST_END,
        SeqClass.PAST_END,
        SeqClass.PAST_END,
        SeqClass.PAST_END,
    ]
    assert rb.accepts(3)  # accepts() looks at the window only
    rb.add_metadata(2, "m", False)
    rb.add_body(1, 0, b"", 0)
    assert rb.finished
    assert rb.classify(2) is SeqClass.RELEASED and rb.classify(3) is SeqClass.PAST_END
    for bad in (-1, 2**32):
        with pytest.raises(ValueError):
            rb.classify(bad)


def test_classify_across_rollover() -> None:
    rb: RB = ReorderBuffer(window=4, start_seq=SEQ_MAX - 1)
    assert [rb.classify(s) for s in (SEQ_MAX - 2, SEQ_MAX - 1, SEQ_MAX, 0, 1, 2)] == [
        SeqClass.RELEASED,
        SeqClass.ACCEPT,
        SeqClass.ACCEPT,
        SeqClass.ACCEPT,
        SeqClass.ACCEPT,
        SeqClass.AHEAD,
    ]
    rb.end(1)
    assert rb.classify(0) is SeqClass.ACCEPT and rb.classify(1) is SeqClass.PAST_END


def test_max_pending_bytes() -> None:
    rb: RB = ReorderBuffer(max_pending_bytes=100)
    assert rb.max_pending_bytes == 100
    rb.add_body(2, 0, b"", 60)
    with pytest.raises(ResourceError, match=r"limit of 100 bytes .* would make 101"):
        rb.add_body(3, 0, b"", 41)
    assert rb.pending_bytes == 60
    rb.add_body(3, 0, b"", 40)
    with pytest.raises(ResourceError):
        rb.add_metadata(0, "s", False, nbytes=1)
    assert seqs(rb.add_metadata(0, "s", False)) == [0]
    assert seqs(rb.add_metadata(1, "m", False)) == [1]
    assert seqs(rb.add_metadata(2, "m", True)) == [2]
    assert rb.pending_bytes == 40
    assert seqs(rb.add_metadata(3, "m", True)) == [3]
    assert rb.pending_bytes == 0


def test_zero_sized_bodies_are_still_bounded_by_the_window() -> None:
    rb: RB = ReorderBuffer(window=DEFAULT_WINDOW, max_pending_bytes=0)
    for s in range(1, DEFAULT_WINDOW):
        rb.add_body(s, 0, b"", 0)
    with pytest.raises(ResourceError):
        rb.add_body(DEFAULT_WINDOW, 0, b"", 0)
    assert rb.backlog == DEFAULT_WINDOW - 1


@pytest.mark.parametrize(
    "kwargs", [{"window": 0}, {"window": 2**31}, {"max_pending_bytes": -1}, {"start_seq": 2**32}]
)
def test_bad_parameters(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        ReorderBuffer(**kwargs)


def test_negative_nbytes_is_a_programming_error() -> None:
    rb: RB = ReorderBuffer()
    with pytest.raises(ValueError):
        rb.add_body(1, 0, b"", -1)
    with pytest.raises(ValueError):
        rb.add_metadata(0, "s", False, nbytes=-1)


# -- roll-over and arbitrary arrival order -------------------------------------------------------------------


def test_rollover() -> None:
    rb: RB = ReorderBuffer(start_seq=SEQ_MAX - 1)
    rb.add_metadata(SEQ_MAX - 1, "s", False)
    rb.add_body(1, 0, b"b1", 2)
    rb.add_metadata(0, "m0", False)
    assert rb.add_metadata(SEQ_MAX, "mx", True) == []
    assert seqs(rb.add_body(SEQ_MAX, 0, b"bx", 2)) == [SEQ_MAX, 0]
    assert seqs(rb.add_metadata(1, "m1", True)) == [1]
    rb.end(2)
    assert rb.finished
    assert rb.released == 4


def test_rollover_with_early_eos_and_metadata_before_the_schema() -> None:
    rb: RB = ReorderBuffer(start_seq=SEQ_MAX)
    rb.add_metadata(1, "m1", False)
    rb.end(2)
    with pytest.raises(ProtocolError, match="before the end of stream"):
        rb.add_metadata(2, "m2", False)
    with pytest.raises(ProtocolError, match="out of range: not one of the 0 message"):  # before the first
        rb.add_metadata(SEQ_MAX - 1, "m", False)
    assert rb.missing() == [SEQ_MAX, 0]
    rb.add_metadata(0, "m0", False)
    assert seqs(rb.add_metadata(SEQ_MAX, "s", False)) == [SEQ_MAX, 0, 1]
    assert rb.finished


@dataclass(frozen=True)
class Plan:
    start: int
    has_body: list[bool]
    events: list[tuple[str, int]]  # ("meta" | "body" | "eos", seq offset)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    start = draw(st.sampled_from([0, 0, SEQ_MAX - 3, SEQ_MAX]))
    n = draw(st.integers(1, 25))
    has_body = [False] + [draw(st.booleans()) for _ in range(n - 1)]
    # any permutation of every metadata message (schema included), every body and the end of stream
    events = [("meta", i) for i in range(n)] + [("body", i) for i in range(n) if has_body[i]] + [("eos", n)]
    events = draw(st.permutations(events))
    return Plan(start, has_body, events)


def snapshot(rb: RB) -> tuple[object, ...]:
    return (
        rb.next_seq,
        rb.released,
        rb.pending_bytes,
        rb.backlog,
        rb.eos_seq,
        rb.finished,
        rb.metadata_complete,
        tuple(rb.missing(1000)),
    )


@settings(max_examples=200, deadline=None)
@given(plans())
def test_any_arrival_order_releases_in_order(plan: Plan) -> None:
    rb: RB = ReorderBuffer(start_seq=plan.start)
    released: list[Complete[str, bytes]] = []
    n = len(plan.has_body)
    delivered: set[tuple[str, int]] = set()
    for kind, off in plan.events:
        seq = seq_add(plan.start, off)
        delivered.add((kind, off))
        if kind == "meta":
            assert rb.classify(seq) is SeqClass.ACCEPT
            released += rb.add_metadata(seq, f"m{off}", plan.has_body[off], nbytes=3)
        elif kind == "body":
            assert rb.classify(seq) is SeqClass.ACCEPT
            released += rb.add_body(seq, off % 2, f"b{off}".encode(), off + 1)
        else:
            released += rb.end(seq)
        # released messages are always a prefix of the stream, released as soon as complete
        assert [c.seq for c in released] == [seq_add(plan.start, i) for i in range(len(released))]
        assert rb.finished == (len(released) == n and rb.ended)
        all_metadata = all(("meta", i) in delivered for i in range(n))
        assert rb.metadata_complete == (all_metadata and ("eos", n) in delivered)
    assert rb.finished
    assert len(released) == n
    assert rb.pending_bytes == 0
    rb.close()
    for i, c in enumerate(released):
        assert c.metadata == f"m{i}"
        if plan.has_body[i]:
            assert (c.body, c.body_type, c.nbytes) == (f"b{i}".encode(), i % 2, i + 1)
        else:
            assert (c.body, c.body_type, c.nbytes) == (None, None, 0)


@settings(max_examples=200, deadline=None)
@given(plans(), st.data())
def test_duplicates_and_input_past_the_end_raise_and_change_nothing(plan: Plan, data: st.DataObject) -> None:
    """Replaying anything already delivered, or sending metadata or a body at or after the end-of-stream
    count, is a ProtocolError at any point, and leaves the buffer as it was."""
    rb: RB = ReorderBuffer(start_seq=plan.start)
    n = len(plan.has_body)
    delivered: list[tuple[str, int]] = []
    for event in plan.events:
        kind, off = event
        seq = seq_add(plan.start, off)
        if kind == "meta":
            rb.add_metadata(seq, f"m{off}", plan.has_body[off])
        elif kind == "body":
            rb.add_body(seq, 0, b"b", 1)
        else:
            rb.end(seq)
        delivered.append(event)
        before = snapshot(rb)
        dkind, doff = data.draw(st.sampled_from(delivered))
        extra = data.draw(st.integers(0, 3))
        dseq = seq_add(plan.start, doff)
        with pytest.raises(ProtocolError):
            if dkind == "meta":
                rb.add_metadata(dseq, "dup", data.draw(st.booleans()))
            elif dkind == "body":
                rb.add_body(dseq, 0, b"dup", 1)
            else:
                rb.end(seq_add(plan.start, n + extra))  # a second end of stream, whatever it says
        assert snapshot(rb) == before
        if rb.ended:
            past = seq_add(plan.start, n + extra)
            assert rb.classify(past) is SeqClass.PAST_END
            with pytest.raises(ProtocolError, match="before the end of stream"):
                rb.add_metadata(past, "extra", False)
            with pytest.raises(ProtocolError, match="before the end of stream"):
                rb.add_body(past, 0, b"extra", 1)
            assert snapshot(rb) == before
    assert rb.finished


@settings(max_examples=150, deadline=None)
@given(plans(), st.integers(1, 6))
def test_a_driver_waiting_on_classify_never_stalls_or_overflows(plan: Plan, window: int) -> None:
    """Input arriving in any order, held back by the driver while ``classify`` says AHEAD, retried after
    releases: everything is taken, nothing ever hits the window."""
    rb: RB = ReorderBuffer(start_seq=plan.start, window=window)
    waiting: list[tuple[str, int]] = []
    got: list[int] = []

    def deliver(kind: str, off: int) -> bool:
        seq = seq_add(plan.start, off)
        if kind == "eos":
            got.extend(seqs(rb.end(seq)))
            return True
        if rb.classify(seq) > 0:
            before = snapshot(rb)
            with pytest.raises(ResourceError):
                if kind == "meta":
                    rb.add_metadata(seq, "m", plan.has_body[off])
                else:
                    rb.add_body(seq, 0, b"b", 1)
            assert snapshot(rb) == before
            return False
        if kind == "meta":
            got.extend(seqs(rb.add_metadata(seq, "m", plan.has_body[off])))
        else:
            got.extend(seqs(rb.add_body(seq, 0, b"b", 1)))
        return True

    for kind, off in plan.events:
        if not deliver(kind, off):
            waiting.append((kind, off))
        progress = True
        while progress:
            progress = False
            for item in list(waiting):
                if deliver(*item):
                    waiting.remove(item)
                    progress = True
        assert rb.backlog <= window
    assert waiting == []
    assert rb.finished
    assert got == [seq_add(plan.start, i) for i in range(len(plan.has_body))]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["meta", "body", "eos"]), st.integers(0, 40), st.booleans())))
def test_random_input_raises_only_protocol_or_resource_errors(ops: list[tuple[str, int, bool]]) -> None:
    rb: RB = ReorderBuffer(window=16, max_pending_bytes=200)
    count = 0
    for kind, seq, flag in ops:
        before = snapshot(rb)
        cls = rb.classify(seq)
        try:
            if kind == "meta":
                out = rb.add_metadata(seq, "m", flag, nbytes=seq)
            elif kind == "body":
                out = rb.add_body(seq, int(flag), b"", seq * 3)
            else:
                out = rb.end(seq)
        except (ProtocolError, ResourceError) as exc:
            assert "expected" in str(exc)
            assert snapshot(rb) == before  # refused input changes nothing
            if kind != "eos":
                # classify predicts the outcome wherever it can
                if cls < 0:
                    assert isinstance(exc, ProtocolError)
                elif cls > 0:
                    assert isinstance(exc, ResourceError)
            continue
        if kind != "eos":
            assert cls is SeqClass.ACCEPT
        assert [c.seq for c in out] == list(range(count, count + len(out)))
        count += len(out)
        assert rb.released == count
        assert 0 <= rb.pending_bytes <= 200
        assert rb.backlog <= 16


def test_random_shuffles_many_messages() -> None:
    rnd = random.Random(1234)
    n = 500
    has_body = [False] + [rnd.random() < 0.8 for _ in range(n - 1)]
    bodies = [i for i in range(n) if has_body[i]]
    rnd.shuffle(bodies)
    rb: RB = ReorderBuffer(window=n)
    got: list[int] = []
    for i in range(n):
        got += seqs(rb.add_metadata(i, "m", has_body[i]))
        if bodies and rnd.random() < 0.6:
            b = bodies.pop()
            got += seqs(rb.add_body(b, 0, b"", 1))
    got += seqs(rb.end(n))
    for b in bodies:
        got += seqs(rb.add_body(b, 0, b"", 1))
    assert got == list(range(n))
    assert rb.finished
