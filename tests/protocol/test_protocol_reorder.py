"""ReorderBuffer: matching metadata and bodies, releasing in order, bounded memory, end of stream."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc.errors import ProtocolError, ResourceError
from dissoc.protocol.reorder import DEFAULT_WINDOW, Complete, ReorderBuffer
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
    assert rb.end(0) == []
    assert rb.finished


# -- errors --------------------------------------------------------------------------------------------------


def test_first_metadata_must_be_seq_zero() -> None:
    rb: RB = ReorderBuffer()
    with pytest.raises(ProtocolError, match=r"expected seq 0x00000000 \(the schema\), got 0x00000001"):
        rb.add_metadata(1, "x", False)
    # rejected input leaves the buffer usable
    assert seqs(rb.add_metadata(0, "s", False)) == [0]


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
    with pytest.raises(ProtocolError, match="after end of stream"):
        rb.add_metadata(1, "m", False)
    with pytest.raises(ProtocolError, match="second"):
        rb.end(1)


def test_eos_must_be_the_seq_after_the_last_metadata() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", True)
    rb.add_metadata(2, "m", True)
    with pytest.raises(ProtocolError, match="expected the seq after the last metadata message, 0x00000003"):
        rb.end(2)
    with pytest.raises(ProtocolError, match=r"missing 2: 0x00000003, 0x00000004"):
        rb.end(5)
    rb.end(3)
    assert rb.ended and not rb.finished


def test_eos_reports_gaps_in_metadata() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", False)
    rb.add_metadata(4, "m", False)
    with pytest.raises(ProtocolError, match=r"missing 2: 0x00000002, 0x00000003"):
        rb.end(5)


def test_eos_reports_bodies_without_metadata() -> None:
    rb: RB = ReorderBuffer()
    rb.add_metadata(0, "s", False)
    rb.add_metadata(1, "m", True)
    rb.add_body(5, 0, b"x", 1)
    rb.add_body(3, 0, b"x", 1)
    with pytest.raises(ProtocolError, match=r"without: 0x00000003, 0x00000005"):
        rb.end(2)


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
    # far "behind" (more than half the space) counts as already released
    with pytest.raises(ProtocolError, match="already released"):
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
    rnd = draw(st.randoms(use_true_random=False))
    # metadata after the schema in any order; EOS after every metadata; bodies anywhere
    meta = [("meta", i) for i in range(1, n)]
    rnd.shuffle(meta)
    stream = [("meta", 0), *meta, ("eos", n)]
    bodies = [("body", i) for i in range(n) if has_body[i]]
    events: list[tuple[str, int]] = []
    while stream or bodies:
        if bodies and (not stream or rnd.random() < 0.5):
            events.append(bodies.pop(rnd.randrange(len(bodies))))
        else:
            events.append(stream.pop(0))
    return Plan(start, has_body, events)


@settings(max_examples=150, deadline=None)
@given(plans())
def test_any_arrival_order_releases_in_order(plan: Plan) -> None:
    rb: RB = ReorderBuffer(start_seq=plan.start)
    released: list[Complete[str, bytes]] = []
    n = len(plan.has_body)
    for kind, off in plan.events:
        seq = seq_add(plan.start, off)
        if kind == "meta":
            released += rb.add_metadata(seq, f"m{off}", plan.has_body[off], nbytes=3)
        elif kind == "body":
            released += rb.add_body(seq, off % 2, f"b{off}".encode(), off + 1)
        else:
            released += rb.end(seq)
        # released messages are always a prefix of the stream, released as soon as complete
        assert [c.seq for c in released] == [seq_add(plan.start, i) for i in range(len(released))]
    assert rb.finished
    assert len(released) == n
    assert rb.pending_bytes == 0
    for i, c in enumerate(released):
        assert c.metadata == f"m{i}"
        if plan.has_body[i]:
            assert (c.body, c.body_type, c.nbytes) == (f"b{i}".encode(), i % 2, i + 1)
        else:
            assert (c.body, c.body_type, c.nbytes) == (None, None, 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["meta", "body", "eos"]), st.integers(0, 40), st.booleans())))
def test_random_input_raises_only_protocol_or_resource_errors(ops: list[tuple[str, int, bool]]) -> None:
    rb: RB = ReorderBuffer(window=16, max_pending_bytes=200)
    count = 0
    for kind, seq, flag in ops:
        try:
            if kind == "meta":
                out = rb.add_metadata(seq, "m", flag, nbytes=seq)
            elif kind == "body":
                out = rb.add_body(seq, int(flag), b"", seq * 3)
            else:
                out = rb.end(seq)
        except (ProtocolError, ResourceError) as exc:
            assert "expected" in str(exc) or "limit" in str(exc)
            continue
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
