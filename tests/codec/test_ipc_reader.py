"""The decoder's pyarrow IPC reader path (``dissoc.codec.ipcread``) and ``decode_landed``.

Packed host bodies whose layout our checks accepted are built by pyarrow's C++ IPC reader: these tests hold it
to the C Data Interface path (``ipc_reader=False``), which must give the same batches and refuse the same
input, through ``decode`` (first and repeated metadata) and ``decode_landed`` (framing written into headroom
before the body). Batches stay zero-copy: their buffers lie in the body received, or in the landing.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from helpers.codec import assert_batch_equal, walk_arrays
from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc import codec
from dissoc.codec import decoder as decoder_module
from dissoc.codec.plan import SMALL_BATCH_ROWS
from dissoc.errors import CodecError

pytestmark = pytest.mark.timeout(120)

ROWS = 64


def _columns(n: int = ROWS) -> dict[str, Callable[[], pa.Array]]:
    return {
        "int64": lambda: pa.array(np.arange(n, dtype=np.int64)),
        "float_nulls": lambda: pa.array([None if i % 3 == 0 else i / 2 for i in range(n)]),
        "bool": lambda: pa.array([i % 3 == 1 for i in range(n)]),
        "string": lambda: pa.array([None if i % 7 == 0 else "v" * (i % 13) for i in range(n)]),
        "utf8_multibyte": lambda: pa.array(["é€" * (i % 4) for i in range(n)]),
        "large_binary": lambda: pa.array([b"w" * (i % 9) for i in range(n)], pa.large_binary()),
        "list": lambda: pa.array([list(range(i % 4)) for i in range(n)], pa.list_(pa.int32())),
        "list_view": lambda: pa.array([list(range(i % 3)) for i in range(n)], pa.list_view(pa.int32())),
        "string_view": lambda: pa.array(["s" * (i % 20) for i in range(n)], pa.string_view()),
        "struct": lambda: pa.array([{"x": i, "y": "t" * (i % 3)} for i in range(n)]),
        "decimal": lambda: pa.array([i * 10**20 for i in range(n)], pa.decimal128(38, 0)),
        "dense_union": lambda: pa.UnionArray.from_dense(
            pa.array([i % 2 for i in range(n)], pa.int8()),
            pa.array([i // 2 for i in range(n)], pa.int32()),
            [pa.array(range(n)), pa.array(["u"] * n)],
        ),
        "run_end": lambda: pa.RunEndEncodedArray.from_arrays(
            pa.array(range(1, n + 1), pa.int32()), pa.array(range(n))
        ),
        "map": lambda: pa.array([[("k", i)] * (i % 3) for i in range(n)], pa.map_(pa.string(), pa.int64())),
    }


COLUMNS = _columns()


def _encode(batch: pa.RecordBatch) -> tuple[bytes, bytes, bytes]:
    """(schema metadata, batch metadata, packed body) of ``batch``."""
    encoder = codec.MessageEncoder(batch.schema)
    (message,) = encoder.encode(batch)
    body = b"".join(bytes(memoryview(b)) for b in message.body_buffers)
    return bytes(encoder.schema_message().metadata), bytes(message.metadata), body


def _decoder(schema_md: bytes, **kwargs: Any) -> codec.MessageDecoder:
    dec = codec.MessageDecoder(**kwargs)
    assert dec.decode(schema_md) is None
    return dec


def _land(metadata: bytes, body: bytes, extra: int = 0) -> pa.Buffer:
    room = codec.frame_room(len(metadata))
    landing = pa.allocate_buffer(room + len(body) + extra)
    np.frombuffer(landing, np.uint8)[:] = 0xAB  # the room's old contents must not matter
    np.frombuffer(landing, np.uint8)[room : room + len(body)] = np.frombuffer(body, np.uint8)
    return landing


def _assert_inside(batch: pa.RecordBatch, source: pa.Buffer) -> None:
    low, high = source.address, source.address + source.size
    for column in batch.columns:
        for arr in walk_arrays(column):
            for buf in arr.buffers():
                if buf is None or buf.size == 0:
                    continue
                assert low <= buf.address and buf.address + buf.size <= high


def _outcome(fn: Callable[[], pa.RecordBatch | None]) -> pa.RecordBatch | str | None:
    try:
        return fn()
    except CodecError:
        return "CodecError"


def _equal_values(a: object, b: object) -> bool:
    """Python values equal, NaN equal to NaN (damaged float bits are often NaNs)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal_values(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_values(a[k], b[k]) for k in a)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return _equal_values(list(a), list(b))
    return a == b


def _same(a: pa.RecordBatch | str | None, b: pa.RecordBatch | str | None, what: str) -> None:
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        assert a == b, f"{what}: {a!r} vs {b!r}"
    else:
        assert a.schema.equals(b.schema), what
        assert _equal_values(_values(a), _values(b)), what


_AS_BYTES = {
    pa.string(): pa.binary(),
    pa.large_string(): pa.large_binary(),
    pa.string_view(): pa.binary_view(),
}


def _values(batch: pa.RecordBatch) -> list[object]:
    """The columns' values (string views, checked for memory safety only, as bytes)."""
    return [
        c.cast(_AS_BYTES[c.type]).to_pylist() if c.type in _AS_BYTES else c.to_pylist() for c in batch.columns
    ]


def test_frame_room() -> None:
    assert [codec.frame_room(n) for n in (0, 1, 7, 8, 9, 200)] == [8, 16, 16, 16, 24, 208]
    with pytest.raises(ValueError):
        codec.frame_room(-1)


@pytest.mark.parametrize("kind", sorted(COLUMNS))
def test_same_batches_as_the_c_data_interface_path_zero_copy(kind: str) -> None:
    batch = pa.record_batch({"c": COLUMNS[kind](), "n": pa.array(range(ROWS))})
    schema_md, md, body = _encode(batch)
    fast = _decoder(schema_md)
    slow = _decoder(schema_md, ipc_reader=False)
    for _ in range(3):  # first sight of the metadata, then the cached layout
        received = pa.py_buffer(bytes(body))
        got = fast.decode(md, received)
        assert_batch_equal(got, batch)
        _assert_inside(got, received)
        assert_batch_equal(fast.decode(md, bytes(body)), batch)
        assert_batch_equal(slow.decode(md, received), batch)
        landing = _land(md, body)
        landed = fast.decode_landed(md, landing)
        assert_batch_equal(landed, batch)
        _assert_inside(landed, landing)


def test_repeated_metadata_each_batch_reads_its_own_body() -> None:
    batches = [
        pa.record_batch({"a": pa.array(np.arange(1024) * k), "b": pa.array(np.arange(1024) - k)})
        for k in range(1, 5)
    ]
    encoded = [_encode(b) for b in batches]
    assert len({md for _, md, _ in encoded}) == 1  # same shape: the metadata repeats byte for byte
    dec = _decoder(encoded[0][0])
    got = [dec.decode(md, body) for _, md, body in encoded]
    got += [dec.decode_landed(md, _land(md, body, extra=24)) for _, md, body in encoded]
    for g, b in zip(got, batches + batches, strict=True):
        assert_batch_equal(g, b)


def test_a_longer_body_is_read_up_to_its_length() -> None:
    batch = pa.record_batch({"s": pa.array(["ab", None, "cde"] * 10)})
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md)
    for _ in range(2):
        assert_batch_equal(dec.decode(md, body + b"\x99" * 40), batch)
        assert_batch_equal(dec.decode(md, pa.py_buffer(body + b"\x99" * 40)), batch)
        assert_batch_equal(dec.decode(md, memoryview(body + b"\x99" * 40)), batch)


@pytest.mark.parametrize("landed", [False, True], ids=["packed", "landed"])
def test_short_bodies_and_bad_landings_are_refused(landed: bool) -> None:
    batch = pa.record_batch({"a": pa.array(range(100))})
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md)
    dec.decode(md, body)  # cached from here on
    with pytest.raises(CodecError, match="expected"):
        if landed:
            dec.decode_landed(md, _land(md, body[:-8]))
        else:
            dec.decode(md, body[:-8])
    if landed:
        with pytest.raises(CodecError, match="room"):
            dec.decode_landed(md, pa.allocate_buffer(8))
        with pytest.raises(CodecError, match=r"pa\.Buffer"):
            dec.decode_landed(md, bytearray(codec.frame_room(len(md)) + len(body)))


def test_an_immutable_landing_is_decoded_without_writing_to_it() -> None:
    batch = pa.record_batch({"a": pa.array(range(100))})
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md)
    immutable = pa.py_buffer(bytes(codec.frame_room(len(md))) + body)
    for _ in range(2):
        assert_batch_equal(dec.decode_landed(md, immutable), batch)
    assert immutable.to_pybytes()[: codec.frame_room(len(md))] == bytes(codec.frame_room(len(md)))


def test_schema_and_dictionary_messages_through_decode_landed() -> None:
    batch = pa.record_batch({"d": pa.array(["x", "y", None, "x"]).dictionary_encode()})
    encoder = codec.MessageEncoder(batch.schema)
    dec = codec.MessageDecoder()
    schema_md = bytes(encoder.schema_message().metadata)
    assert dec.decode_landed(schema_md, pa.allocate_buffer(codec.frame_room(len(schema_md)))) is None
    for _ in range(2):
        got = None
        for m in encoder.encode(batch):
            mbody = b"".join(bytes(memoryview(b)) for b in m.body_buffers)
            got = dec.decode_landed(bytes(m.metadata), _land(bytes(m.metadata), mbody))
        assert_batch_equal(got, batch)


def _offsets_past_the_data(rows: int) -> tuple[pa.RecordBatch, bytes, bytes, bytes]:
    values = [b"x" * (i % 5 + 1) for i in range(rows)]
    batch = pa.record_batch({"s": pa.array(values, pa.string()), "n": pa.array(range(rows))})
    schema_md, md, body = _encode(batch)
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype("<i4").tobytes()
    at = body.find(offsets)
    assert at >= 0
    damaged = bytearray(body)
    damaged[at + len(offsets) - 4 : at + len(offsets)] = (int(sum(map(len, values))) + 1).to_bytes(
        4, "little"
    )
    return batch, schema_md, md, bytes(damaged)


@pytest.mark.parametrize("rows", [SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1], ids=["small", "large"])
@pytest.mark.parametrize("how", ["first", "cached", "landed"])
def test_offsets_out_of_range_are_refused_on_both_sides_of_the_small_batch_threshold(
    rows: int, how: str
) -> None:
    batch, schema_md, md, damaged = _offsets_past_the_data(rows)
    good = _encode(batch)[2]
    dec = _decoder(schema_md)
    if how != "first":
        assert_batch_equal(dec.decode(md, good), batch)
    with pytest.raises(CodecError, match="offset"):
        if how == "landed":
            dec.decode_landed(md, _land(md, damaged))
        else:
            dec.decode(md, damaged)
    assert_batch_equal(dec.decode(md, good), batch)  # a refused body leaves the decoder usable


def test_validate_false_skips_content_checks_but_not_sizes() -> None:
    rows = 50
    values = [b"ab"] * rows
    batch = pa.record_batch({"s": pa.array(values, pa.binary())})
    schema_md, md, body = _encode(batch)
    offsets = np.arange(0, 2 * rows + 1, 2, dtype="<i4").tobytes()
    at = body.find(offsets)
    damaged = bytearray(body)
    damaged[at + 4 * 10 : at + 4 * 11] = (99).to_bytes(4, "little")  # slot 10's offset out of order
    trusting = _decoder(schema_md, validate=False)
    checking = _decoder(schema_md)
    for _ in range(2):
        assert_batch_equal(trusting.decode(md, body), batch)
        trusted = trusting.decode(md, bytes(damaged))  # contents not checked
        assert trusted is not None and trusted.num_rows == rows
        with pytest.raises(CodecError):
            checking.decode(md, bytes(damaged))
        with pytest.raises(CodecError, match="expected"):
            trusting.decode(md, body[:-8])  # sizes are always checked


def test_what_pyarrow_refuses_falls_back_to_our_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = pa.record_batch({"s": pa.array(["a", "bc", None] * 5)})
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md)

    def refuse(*args: object, **kwargs: object) -> None:
        raise pa.ArrowInvalid("refused")

    monkeypatch.setattr(decoder_module, "_read_record_batch", refuse)
    for _ in range(2):
        assert_batch_equal(dec.decode(md, body), batch)
    assert_batch_equal(dec.decode_landed(md, _land(md, body)), batch)
    monkeypatch.undo()
    assert_batch_equal(dec.decode(md, body), batch)


def _framed_in_slab(landing: codec.Landing, body: bytes, at: int = 128) -> tuple[pa.Buffer, pa.Buffer]:
    """(the slab, an immutable slice of it) holding ``landing.head`` then ``body``, from byte ``at`` on, with
    other bytes around them (other bodies' places in a receiver's slab)."""
    slab = pa.allocate_buffer(at + landing.room + len(body) + 256)
    view = np.frombuffer(slab, np.uint8)
    view[:] = 0xCD
    view[at : at + landing.room] = np.frombuffer(landing.head, np.uint8)
    view[at + landing.room : at + landing.room + len(body)] = np.frombuffer(body, np.uint8)
    return slab, slab.slice(at, landing.room + len(body))


@pytest.mark.parametrize(
    "columns",
    [
        {"a": pa.array(np.arange(1024)), "b": pa.array(np.arange(1024.0))},
        {"f": pa.array([None, 1.5, 2.5] * 40), "t": pa.array([True, None, False] * 40)},
        {"d": pa.array(range(50), pa.date32()), "u": pa.array(range(50), pa.uint8())},
    ],
    ids=["int64-double", "nulls-bools", "date-uint8"],
)
def test_a_landing_reads_a_slice_of_a_slab_as_decode_landed_would(columns: dict[str, pa.Array]) -> None:
    batch = pa.record_batch(columns)
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md)
    landing = dec.landing(md)  # prepared from the metadata alone: no batch of it decoded yet
    assert landing is not None and landing is dec.landing(md)
    assert_batch_equal(dec.decode_landed(md, _land(md, body)), batch)
    assert dec.landing(md) is landing
    assert landing.room == codec.frame_room(len(md)) == len(landing.head)
    assert landing.need == landing.room + len(body)
    slab, framed = _framed_in_slab(landing, body)
    assert not framed.is_mutable
    got = landing.read(framed)
    assert_batch_equal(got, batch)
    _assert_inside(got, framed)
    del slab, framed  # the batch holds the memory alone
    assert_batch_equal(got, batch)
    with pytest.raises(CodecError, match="expected"):
        landing.read(_framed_in_slab(landing, body[:-8])[1])


def test_no_landing_before_the_schema_nor_for_what_is_no_plain_batch() -> None:
    batch = pa.record_batch({"x": pa.array(np.arange(10, dtype=np.int64))})
    schema_md, md, body = _encode(batch)
    assert codec.MessageDecoder().landing(md) is None  # no schema yet
    dec = _decoder(schema_md)
    assert dec.landing(schema_md) is None  # not a batch
    assert dec.landing(md[:-8]) is None  # malformed: its decode says so
    with pytest.raises(CodecError):
        dec.decode(md[:-8], body)
    assert_batch_equal(dec.decode(md, body), batch)


@pytest.mark.parametrize(
    ("columns", "validate"),
    [
        ({"s": pa.array(["a", "bc"] * 10)}, True),  # contents to check
        ({"s": pa.array(["a", "bc"] * 10)}, False),  # not fixed width: shape not settled by the metadata
        ({"st": pa.array([{"x": 1}, None] * 10)}, False),  # children: shapes for pyarrow's validation
        ({"l": pa.array([[1], [2, 3]] * 10)}, True),
        ({"v": pa.array(["x" * 20] * 20, pa.string_view())}, True),  # views checked by our numpy checks
    ],
    ids=["string", "string-unchecked", "struct", "list", "string-view"],
)
def test_no_landing_for_layouts_with_something_to_check(columns: dict[str, pa.Array], validate: bool) -> None:
    batch = pa.record_batch(columns)
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md, validate=validate)
    assert_batch_equal(dec.decode(md, body), batch)
    assert dec.landing(md) is None
    assert_batch_equal(dec.decode_landed(md, _land(md, body)), batch)


def test_a_landing_for_trusted_contents_too_and_none_off_pyarrows_reader() -> None:
    batch = pa.record_batch({"t": pa.array(range(20), pa.time32("s")), "x": pa.array(range(20), pa.int16())})
    schema_md, md, body = _encode(batch)
    trusting = _decoder(schema_md, validate=False)
    trusting.decode(md, body)
    landing = trusting.landing(md)
    assert landing is not None
    assert_batch_equal(landing.read(_framed_in_slab(landing, body)[1]), batch)
    slow = _decoder(schema_md, ipc_reader=False)
    assert_batch_equal(slow.decode(md, body), batch)
    assert slow.landing(md) is None


def test_what_pyarrow_refuses_through_a_landing_goes_to_our_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = pa.record_batch({"a": pa.array(range(100)), "b": pa.array([0.5, None] * 50)})
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md)
    dec.decode(md, body)
    landing = dec.landing(md)
    assert landing is not None

    def refuse(*args: object, **kwargs: object) -> None:
        raise pa.ArrowInvalid("refused")

    monkeypatch.setattr(decoder_module, "_read_record_batch", refuse)
    assert_batch_equal(landing.read(_framed_in_slab(landing, body)[1]), batch)
    assert dec.landing(md) is None  # that layout stays on the C Data Interface path
    monkeypatch.undo()
    assert_batch_equal(dec.decode(md, body), batch)


HOSTILE = [0, 1, 2, 0x7F, 0xFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 20, ROWS, ROWS + 1]


@pytest.mark.parametrize("kind", sorted(COLUMNS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_damaged_body_gets_the_same_answer_on_every_path(kind: str, data: st.DataObject) -> None:
    batch = pa.record_batch({"c": COLUMNS[kind]()})
    schema_md, md, body = _encode(batch)
    damaged = bytearray(body)
    words = len(damaged) // 4
    for _ in range(data.draw(st.integers(1, 3), label="words damaged")):
        at = 4 * data.draw(st.integers(0, words - 1), label="word")
        value = data.draw(st.sampled_from(HOSTILE) | st.integers(0, 0xFFFFFFFF), label="value")
        damaged[at : at + 4] = value.to_bytes(4, "little")
    bad = bytes(damaged)
    slow = _outcome(lambda: _decoder(schema_md, ipc_reader=False).decode(md, bad))
    fast = _decoder(schema_md)
    fast.decode(md, body)  # the layout is cached: the damaged body takes the cached path
    _same(_outcome(lambda: fast.decode(md, bad)), slow, "cached decode")
    _same(_outcome(lambda: _decoder(schema_md).decode(md, bad)), slow, "first decode")
    _same(_outcome(lambda: fast.decode_landed(md, _land(md, bad))), slow, "decode_landed")


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_damaged_metadata_gets_the_same_answer_on_every_path(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(sorted(COLUMNS)), label="kind")
    batch = pa.record_batch({"c": COLUMNS[kind](), "n": pa.array(range(ROWS))})
    schema_md, md, body = _encode(batch)
    damaged = bytearray(md)
    for _ in range(data.draw(st.integers(1, 2), label="bytes damaged")):
        at = data.draw(st.integers(0, len(damaged) - 1), label="byte")
        damaged[at] = data.draw(st.integers(0, 255), label="value")
    bad = bytes(damaged)
    slow = _outcome(lambda: _decoder(schema_md, ipc_reader=False).decode(bad, body))
    _same(_outcome(lambda: _decoder(schema_md).decode(bad, body)), slow, "decode")
    if len(bad) == len(md):
        twice = _decoder(schema_md)
        _outcome(lambda: twice.decode(bad, body))
        _same(_outcome(lambda: twice.decode_landed(bad, _land(bad, body))), slow, "decode_landed")


@pytest.mark.parametrize("kind", ["run_end", "dense_union"])
def test_nulls_on_a_node_without_a_validity_bitmap_are_refused_on_every_path(kind: str) -> None:
    """A run-end encoded or union node holds no nulls of its own (its children do): a null count above 0 is
    refused by every path alike (hypothesis found the C Data path accepting what pyarrow's reader refused)."""
    batch = pa.record_batch({"c": COLUMNS[kind](), "n": pa.array(range(ROWS))})
    schema_md, md, body = _encode(batch)
    node = struct.pack("<qq", ROWS, 0)
    assert md.count(node) >= 1  # (the first is the column's own node)
    bad = md.replace(node, struct.pack("<qq", ROWS, 1), 1)
    for dec in (
        _decoder(schema_md),
        _decoder(schema_md, ipc_reader=False),
        _decoder(schema_md, validate=False),
    ):
        with pytest.raises(CodecError, match="no validity bitmap"):
            dec.decode(bad, body)
    with pytest.raises(CodecError, match="no validity bitmap"):
        _decoder(schema_md).decode_landed(bad, _land(bad, body))
    assert_batch_equal(_decoder(schema_md).decode(md, body), batch)


def test_one_decoder_shared_by_threads_gives_each_call_its_own_batch() -> None:
    batches = [pa.record_batch({"a": pa.array(np.full(4096, k, np.int64))}) for k in range(8)]
    encoded = [_encode(b) for b in batches]
    dec = _decoder(encoded[0][0])
    md = encoded[0][1]
    dec.decode(md, encoded[0][2])

    def work(k: int) -> bool:
        body = encoded[k][2]
        return all(dec.decode(md, body).equals(batches[k]) for _ in range(200))  # type: ignore[union-attr]

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(8)))


@pytest.mark.parametrize("new_length", [1000, 1025, 0])
def test_columns_that_are_not_as_long_as_the_batch_are_refused(new_length: int) -> None:
    # fixed-width columns only: the decoder checks the column lengths against the batch length itself
    # (cached), instead of pyarrow's cheap validation per batch
    batch = pa.record_batch({"a": pa.array(np.arange(1024)), "b": pa.array(np.arange(1024.0))})
    schema_md, md, body = _encode(batch)
    old = struct.pack("<q", 1024)
    spots = [i for i in range(len(md) - 7) if md[i : i + 8] == old]
    bad = None
    for i in spots:
        candidate = md[:i] + struct.pack("<q", new_length) + md[i + 8 :]
        header = codec.parse(candidate).batch
        if header is not None and header.length == new_length and bool((header.nodes[:, 0] == 1024).all()):
            bad = candidate
    assert bad is not None, "the batch length field was not found"
    _refused(schema_md, bad, body, ("first", "cached", "landed", "c data"))


def _refused(schema_md: bytes, bad: bytes, body: bytes, hows: tuple[str, ...]) -> None:
    """Metadata ``bad`` with ``body`` raises CodecError on each path: decoded ``first``, ``cached`` (decoded
    before), ``landed`` (decode_landed after a first decode) or through the C Data Interface (``c data``)."""
    for how in hows:
        dec = _decoder(schema_md, ipc_reader=how != "c data")
        with pytest.raises(CodecError):
            if how in ("cached", "landed"):
                with contextlib.suppress(CodecError):
                    dec.decode(bad, body)
            if how == "landed":
                dec.decode_landed(bad, _land(bad, body))
            else:
                dec.decode(bad, body)


def _strings_batch(rows: int, values: Callable[[int], str | None]) -> pa.RecordBatch:
    return pa.record_batch({"s": pa.array([values(i) for i in range(rows)], pa.string()), "n": range(rows)})


STRING_ROWS = 3000  # enough values that strings are validated as binary plus an ASCII check


def test_string_columns_validated_as_binary_take_the_ascii_shortcut_only_when_it_is_exact() -> None:
    ascii_batch = _strings_batch(STRING_ROWS, lambda i: None if i % 5 == 0 else "ab" * (i % 4))
    multibyte = _strings_batch(STRING_ROWS, lambda i: "é€😀" * (i % 3))
    for batch in (ascii_batch, multibyte):
        schema_md, md, body = _encode(batch)
        dec = _decoder(schema_md)
        for _ in range(2):
            assert_batch_equal(dec.decode(md, body), batch)
            assert_batch_equal(dec.decode_landed(md, _land(md, body)), batch)
        prep = dec._prepared[md]
        assert prep.frame is not None and prep.as_binary
    # an invalid UTF-8 byte inside a value is refused on every path
    schema_md, md, body = _encode(ascii_batch)
    data = "".join("ab" * (i % 4) for i in range(STRING_ROWS) if i % 5).encode()
    at = body.find(data)
    assert at >= 0
    damaged = bytearray(body)
    damaged[at + 11] = 0xFF
    bad = bytes(damaged)
    for how in ("decode", "landed", "c data"):
        dec = _decoder(schema_md, ipc_reader=how != "c data")
        dec.decode(md, body)
        with pytest.raises(CodecError, match=r"UTF8|utf8|UTF-8"):
            if how == "landed":
                dec.decode_landed(md, _land(md, bad))
            else:
                dec.decode(md, bad)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_damaged_string_bodies_validated_as_binary_get_the_same_answer_on_every_path(
    data: st.DataObject,
) -> None:
    batch = _strings_batch(STRING_ROWS, lambda i: None if i % 7 == 0 else "xy€" * (i % 3) if i % 11 else "z")
    schema_md, md, body = _encode(batch)
    damaged = bytearray(body)
    for _ in range(data.draw(st.integers(1, 3), label="bytes damaged")):
        at = data.draw(st.integers(0, len(damaged) - 1), label="byte")
        damaged[at] = data.draw(st.sampled_from([0x80, 0xC3, 0xFF, 0x00, 0x7F]) | st.integers(0, 255))
    bad = bytes(damaged)
    slow = _outcome(lambda: _decoder(schema_md, ipc_reader=False).decode(md, bad))
    fast = _decoder(schema_md)
    fast.decode(md, body)
    assert fast._prepared[md].as_binary
    _same(_outcome(lambda: fast.decode(md, bad)), slow, "cached decode")
    _same(_outcome(lambda: fast.decode_landed(md, _land(md, bad))), slow, "decode_landed")


@pytest.mark.parametrize("kind", ["bytes", "buffer", "numpy", "memoryview"])
def test_a_short_body_after_the_layout_is_cached_is_a_codec_error(kind: str) -> None:
    """Once a layout is cached the fast lane answers: a body shorter than the metadata says must still be
    a CodecError (not pyarrow's IndexError from slicing it), whatever object carries it."""
    batch = pa.record_batch({"a": pa.array(range(10)), "s": pa.array([f"v{i}" for i in range(10)])})
    schema_md, metadata, body = _encode(batch)
    dec = _decoder(schema_md)
    dec.decode(metadata, body)  # caches the layout
    short = body[:8]
    carried: object = {
        "bytes": short,
        "buffer": pa.py_buffer(short),
        "numpy": np.frombuffer(short, np.uint8),
        "memoryview": memoryview(short),
    }[kind]
    with pytest.raises(CodecError, match=r"expected \d+ bytes"):
        dec.decode(metadata, carried)


def _wide_batch(rows: int = STRING_ROWS) -> pa.RecordBatch:
    """Strings and lists (checked fully) beside eight fixed-width and boolean columns (checked by shape)."""
    cols: dict[str, pa.Array] = {
        "s": pa.array([None if i % 7 == 0 else "xy€" * (i % 3) if i % 11 else "z" for i in range(rows)]),
        "l": pa.array([list(range(i % 4)) if i % 5 else None for i in range(rows)], pa.list_(pa.int32())),
        "t": pa.array(["k" * (i % 6) for i in range(rows)], pa.large_string()),
    }
    for k in range(8):
        if k % 3 == 2:
            cols[f"b{k}"] = pa.array([None if i % 9 == k else i % 2 == 0 for i in range(rows)])
        else:
            cols[f"n{k}"] = pa.array([None if i % 13 == k else i * k for i in range(rows)], pa.int64())
    return pa.record_batch(cols)


def test_wide_batches_read_their_risky_columns_alone() -> None:
    """With enough other columns the string and list columns are read a second time on their own (a message
    of their nodes over the same body), through decode and decode_landed, and give the batch sent."""
    batch = _wide_batch()
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md)
    for _ in range(2):
        assert_batch_equal(dec.decode(md, body), batch)
        assert_batch_equal(dec.decode_landed(md, _land(md, body)), batch)
        assert_batch_equal(dec.decode(md, pa.py_buffer(body + bytes(16))), batch)  # a longer body
    prep = dec._prepared[md]
    assert prep.as_binary and prep.sub is not None and prep.rest_checked
    frame, head = prep.sub
    assert len(head) == codec.frame_room(len(md)) and len(frame[1]) == len(head) - 8
    sub = codec.parse(bytes(head[8:])).batch
    assert sub is not None and len(sub.nodes) == 4  # s, l and its values, t
    # too few other columns: the whole batch is read again instead
    narrow = _strings_batch(STRING_ROWS, lambda i: "ab" * (i % 4))
    schema_md, md, body = _encode(narrow)
    dec = _decoder(schema_md)
    assert_batch_equal(dec.decode(md, body), narrow)
    assert dec._prepared[md].as_binary and dec._prepared[md].sub is None


def test_wide_batches_written_by_pyarrow_decode_either_way() -> None:
    """pyarrow's metadata leaves defaults out: where the message of the risky columns would not fit in its
    length, the batch is read again whole; either way the batch comes back."""
    batch = _wide_batch()
    message = pa.ipc.read_message(batch.serialize())
    md, body = message.metadata.to_pybytes(), message.body.to_pybytes()
    dec = _decoder(bytes(codec.MessageEncoder(batch.schema).schema_message().metadata))
    for _ in range(2):
        assert_batch_equal(dec.decode(md, body), batch)
        assert_batch_equal(dec.decode_landed(md, _land(md, body)), batch)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_damaged_wide_bodies_get_the_same_answer_on_every_path(data: st.DataObject) -> None:
    batch = _wide_batch()
    schema_md, md, body = _encode(batch)
    damaged = bytearray(body)
    for _ in range(data.draw(st.integers(1, 3), label="words damaged")):
        at = 4 * data.draw(st.integers(0, len(damaged) // 4 - 1), label="word")
        value = data.draw(st.sampled_from(HOSTILE) | st.integers(0, 0xFFFFFFFF), label="value")
        damaged[at : at + 4] = value.to_bytes(4, "little")
    bad = bytes(damaged)
    slow = _outcome(lambda: _decoder(schema_md, ipc_reader=False).decode(md, bad))
    fast = _decoder(schema_md)
    fast.decode(md, body)
    assert fast._prepared[md].sub is not None
    _same(_outcome(lambda: fast.decode(md, bad)), slow, "cached decode")
    _same(_outcome(lambda: fast.decode_landed(md, _land(md, bad))), slow, "decode_landed")


def test_damaged_offsets_of_wide_batches_are_refused() -> None:
    """Offsets that run backwards or past the data, in a string, large string or list column of a wide batch,
    are refused by both reads, and invalid UTF-8 by the string check."""
    batch = _wide_batch()
    schema_md, md, body = _encode(batch)
    h = codec.parse(md).batch
    assert h is not None
    # IPC buffers: s (validity, offsets, data), l (validity, offsets), l's values (validity, data), t (...)
    s_offsets, s_data, l_offsets, t_offsets = (int(h.buffers[k, 0]) for k in (1, 2, 4, 8))
    cases = {
        "s backwards": (s_offsets + 4 * 100, struct.pack("<i", 0)),
        "s past the data": (s_offsets + 4 * STRING_ROWS, struct.pack("<i", 1 << 24)),
        "l backwards": (l_offsets + 4 * 50, struct.pack("<i", 0)),
        "t past the data": (t_offsets + 8 * STRING_ROWS, struct.pack("<q", 1 << 40)),
        "s invalid utf-8": (s_data + 3, b"\xff"),
    }
    for what, (at, patch) in cases.items():
        bad = body[:at] + patch + body[at + len(patch) :]
        for how in ("decode", "landed"):
            dec = _decoder(schema_md)
            dec.decode(md, body)
            with pytest.raises(CodecError):
                if how == "landed":
                    dec.decode_landed(md, _land(md, bad))
                else:
                    dec.decode(md, bad)
            assert dec._prepared[md].sub is not None, what


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "struct"])
def test_wide_batches_with_a_node_shorter_than_its_parent_are_refused(nested: bool) -> None:
    """The last column's node says fewer rows than the batch (or, for a struct column, its child's node says
    fewer than the struct): refused, the struct's child by pyarrow's cheap validation, which batches with
    columns that are not single fixed-width nodes still get."""
    batch = _wide_batch()
    if nested:
        batch = batch.append_column("st", pa.StructArray.from_arrays([batch.column("n0")], ["x"]))
    schema_md, md, body = _encode(batch)
    h = codec.parse(md).batch
    assert h is not None
    nodes = h.nodes.copy()
    last = len(nodes) - 1  # the last int64 column, or the struct's child
    assert nodes[last, 0] == STRING_ROWS
    nodes[last, 0] = STRING_ROWS - 8
    nodes[last, 1] = min(int(nodes[last, 1]), STRING_ROWS - 8)
    template = codec.message.message_template(codec.HeaderType.RecordBatch, len(nodes), len(h.buffers))
    bad = template.fill(len(body), h.length, nodes, h.buffers)
    _refused(schema_md, bad, body, ("first", "cached", "landed"))
