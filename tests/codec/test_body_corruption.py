"""Bodies damaged on the wire: words of a valid body overwritten with hostile values.

The decoder must either refuse the message (``CodecError``) or give a batch that is safe to use: every buffer
of it lies inside the body received, and, for these small batches (pyarrow's full validation is part of
their checks), it passes ``validate(full=True)`` and reads back. View columns are the exception the decoder
makes on purpose: their contents are checked for memory safety only (pyarrow's full validation of views also
judges padding and prefixes), so an accepted one must read back. The bug this guards against: Arrow's C
importer sizes a binary data buffer from the last offset, so offsets past the body looked valid to it.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc import codec
from dissoc.codec import cdata
from dissoc.errors import CodecError

pytestmark = pytest.mark.timeout(120)

ROWS = 64


def _columns(n: int = ROWS) -> dict[str, Callable[[], pa.Array]]:
    return {
        "string": lambda: pa.array([None if i % 7 == 0 else "v" * (i % 13) for i in range(n)]),
        "binary": lambda: pa.array([b"b" * (i % 5) for i in range(n)], pa.binary()),
        "large_string": lambda: pa.array(["w" * (i % 9) for i in range(n)], pa.large_string()),
        "list": lambda: pa.array([list(range(i % 4)) for i in range(n)], pa.list_(pa.int32())),
        "large_list": lambda: pa.array([list(range(i % 4)) for i in range(n)], pa.large_list(pa.int16())),
        "list_view": lambda: pa.array([list(range(i % 3)) for i in range(n)], pa.list_view(pa.int32())),
        "dictionary": lambda: pa.array(["a", "b", "c", None] * (n // 4)).dictionary_encode(),
        "string_view": lambda: pa.array(["s" * (i % 20) for i in range(n)], pa.string_view()),
        "binary_view": lambda: pa.array([b"q" * (i % 17) for i in range(n)], pa.binary_view()),
        "struct": lambda: pa.array([{"x": i, "y": "t" * (i % 3)} for i in range(n)]),
        "dense_union": lambda: pa.UnionArray.from_dense(
            pa.array([i % 2 for i in range(n)], pa.int8()),
            pa.array([i // 2 for i in range(n)], pa.int32()),
            [pa.array(range(n)), pa.array(["u"] * n)],
        ),
        "sparse_union": lambda: pa.UnionArray.from_sparse(
            pa.array([i % 2 for i in range(n)], pa.int8()), [pa.array(range(n)), pa.array(["u"] * n)]
        ),
        "run_end": lambda: pa.RunEndEncodedArray.from_arrays(
            pa.array(range(1, n + 1), pa.int32()), pa.array(range(n))
        ),
        "map": lambda: pa.array([[("k", i)] * (i % 3) for i in range(n)], pa.map_(pa.string(), pa.int64())),
    }


COLUMNS = _columns()


def _assert_inside(batch: pa.RecordBatch, body: pa.Buffer) -> None:
    """Every buffer of the batch lies within the body it was decoded over (or is empty, or is the codec's
    shared zeros for empty buffers): Arrow sizes some buffers from the values, so this catches values that
    reach past what was received."""
    low, high = body.address, body.address + body.size
    zeros = cdata.ZERO_ADDRESS
    for buf in batch.column(0).buffers():
        if buf is None or buf.size == 0 or zeros <= buf.address < zeros + 64:
            continue
        assert low <= buf.address and buf.address + buf.size <= high, (buf.address - low, buf.size, body.size)


HOSTILE = [0, 1, 2, 0x7F, 0xFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 20, ROWS, ROWS + 1]


LARGE = _columns(10_000)  # past the decoder's small-batch threshold: its own numpy checks only


@pytest.mark.parametrize("kind", sorted(COLUMNS))
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_damaged_body_is_refused_or_safe(kind: str, data: st.DataObject) -> None:
    _damage_and_decode(pa.record_batch({"c": COLUMNS[kind]()}), kind, data, full=True)


@pytest.mark.parametrize("kind", sorted(LARGE))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_damaged_large_body_is_refused_or_inside_what_was_received(kind: str, data: st.DataObject) -> None:
    # large batches are checked for memory safety, not for UTF-8 or view padding: only that is asserted
    _damage_and_decode(pa.record_batch({"c": LARGE[kind]()}), kind, data, full=False)


def _damage_and_decode(batch: pa.RecordBatch, kind: str, data: st.DataObject, *, full: bool) -> None:
    encoder = codec.MessageEncoder(batch.schema)
    messages = encoder.encode(batch)
    decoder = codec.MessageDecoder()
    decoder.decode(encoder.schema_message().metadata)
    for m in messages[:-1]:  # dictionaries arrive intact
        decoder.decode(m.metadata, b"".join(bytes(memoryview(b)) for b in m.body_buffers))
    message = messages[-1]
    body = bytearray(b"".join(bytes(memoryview(b)) for b in message.body_buffers))
    words = len(body) // 4
    for _ in range(data.draw(st.integers(1, 3), label="words damaged")):
        at = 4 * data.draw(st.integers(0, words - 1), label="word")
        value = data.draw(st.sampled_from(HOSTILE) | st.integers(0, 0xFFFFFFFF), label="value")
        body[at : at + 4] = value.to_bytes(4, "little")
    received = pa.py_buffer(bytes(body))
    try:
        got = decoder.decode(message.metadata, received)
    except CodecError:
        return
    assert got is not None
    _assert_inside(got, received)
    if not full:
        got.validate()
        return
    if kind.endswith("_view") and kind != "list_view":
        got.validate()
        got.column(0).cast(pa.binary_view()).to_pylist()  # every value's bytes, none outside the buffers
        return
    got.validate(full=True)
    got.to_pylist()
