"""Zero copy: decoded arrays point into the received body; encoded bodies point at the batch's own memory.

A 64 MiB uncompressed batch (int64, float64, string and list<int32>, with nulls) is decoded from one body
bytes object by ``MessageDecoder.decode(metadata, body)`` and from an in-memory stream by ``open_stream``
(over ``bytes`` and over ``pa.Buffer``); every non-empty buffer of every array, recursively through children
and dictionaries, must lie inside the source's address range.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from helpers import ipcgen
from helpers.codec import assert_batch_equal, walk_arrays

from dissoc import codec

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def big_batch(target_bytes: int = 64 * MiB, seed: int = 1) -> pa.RecordBatch:
    """About ``target_bytes`` of int64, float64, string and list<int32> columns, each with nulls."""
    rng = np.random.default_rng(seed)
    # per row: 8 (i64) + 8 (f64) + 4 + ~12 (string) + 4 + 4*4 (list of ~4 int32) + validity ~= 52 bytes
    rows = target_bytes // 52
    valid = rng.random(rows) > 0.05
    ints = pa.array(rng.integers(-(2**62), 2**62, rows), mask=~valid)
    floats = pa.array(rng.random(rows), mask=np.roll(~valid, 1))
    lengths = rng.integers(0, 24, rows).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    chars = rng.integers(97, 123, int(offsets[-1]), dtype=np.uint8)
    validity = pa.array(np.roll(valid, 2), pa.bool_()).buffers()[1]
    strings = pa.Array.from_buffers(pa.string(), rows, [validity, pa.py_buffer(offsets), pa.py_buffer(chars)])
    list_lengths = rng.integers(0, 8, rows).astype(np.int32)
    list_offsets = np.concatenate([[0], np.cumsum(list_lengths)]).astype(np.int32)
    n_values = int(list_offsets[-1])
    values = pa.array(rng.integers(-1000, 1000, n_values, dtype=np.int32), mask=rng.random(n_values) < 0.1)
    lists = pa.ListArray.from_arrays(pa.array(list_offsets), values, mask=pa.array(~np.roll(valid, 3)))
    return pa.record_batch({"i": ints, "f": floats, "s": strings, "l": lists})


@pytest.fixture(scope="module")
def batch() -> pa.RecordBatch:
    return big_batch()


def buffers_of(obj: pa.RecordBatch | pa.Array) -> Iterable[tuple[str, pa.Buffer]]:
    arrays = obj.columns if isinstance(obj, pa.RecordBatch) else [obj]
    for col_index, col in enumerate(arrays):
        for arr in walk_arrays(col):
            for k, buf in enumerate(arr.buffers()):
                if buf is not None and buf.size > 0:
                    yield f"column {col_index} {arr.type} buffer {k}", buf


def assert_inside(obj: pa.RecordBatch | pa.Array, source: Any, what: str) -> None:
    src = pa.py_buffer(source)
    lo, hi = src.address, src.address + src.size
    outside = [
        f"{name}: [{buf.address:#x}, +{buf.size}) not in [{lo:#x}, {hi:#x})"
        for name, buf in buffers_of(obj)
        if not (lo <= buf.address and buf.address + buf.size <= hi)
    ]
    assert not outside, f"{what}: {len(outside)} buffer(s) copied out of the source:\n" + "\n".join(
        outside[:10]
    )


def encode_all(batch: pa.RecordBatch) -> tuple[Any, list[Any]]:
    enc = codec.MessageEncoder(batch.schema)
    return enc.schema_message(), enc.encode(batch)


def joined_body(msg: Any) -> bytes:
    return b"".join(memoryview(b).cast("B") for b in msg.body_buffers)


def test_batch_is_big_enough(batch: pa.RecordBatch) -> None:
    assert batch.nbytes >= 60 * MiB
    assert all(c.null_count > 0 for c in batch.columns)


def test_decoder_is_zero_copy_over_body_bytes(batch: pa.RecordBatch) -> None:
    schema_msg, msgs = encode_all(batch)
    (msg,) = msgs
    body = joined_body(msg)
    assert len(body) == msg.body_length
    dec = codec.MessageDecoder()
    assert dec.decode(schema_msg.metadata, b"") is None
    t0 = time.perf_counter()
    got = dec.decode(msg.metadata, body)
    elapsed = time.perf_counter() - t0
    assert_inside(got, body, "MessageDecoder.decode over bytes")
    assert_batch_equal(got, batch)
    # a copy of 64 MiB alone would take ~10 ms here; decoding metadata must not be anywhere near a copy per
    # buffer plus validation of every value
    assert elapsed < 2.0, f"decoding a 64 MiB batch took {elapsed:.3f}s"


def test_decoder_is_zero_copy_over_pa_buffer(batch: pa.RecordBatch) -> None:
    schema_msg, (msg,) = encode_all(batch)
    body = pa.py_buffer(joined_body(msg))
    dec = codec.MessageDecoder()
    dec.decode(schema_msg.metadata, b"")
    got = dec.decode(msg.metadata, body)
    assert_inside(got, body, "MessageDecoder.decode over pa.Buffer")


@pytest.mark.parametrize("kind", ["bytes", "pa.Buffer", "memoryview"])
def test_open_stream_is_zero_copy(batch: pa.RecordBatch, kind: str) -> None:
    schema_msg, (msg,) = encode_all(batch)
    stream = ipcgen.frame(bytes(schema_msg.metadata)) + ipcgen.frame(bytes(msg.metadata), joined_body(msg))
    stream += ipcgen.EOS
    source: Any = {"bytes": stream, "pa.Buffer": pa.py_buffer(stream), "memoryview": memoryview(stream)}[kind]
    reader = codec.open_stream(source)
    (got,) = list(reader)
    assert_inside(got, stream, f"open_stream over {kind}")
    table = codec.open_stream(source).read_all()
    for chunk in table.to_batches():
        assert_inside(chunk, stream, f"open_stream({kind}).read_all()")


def test_open_file_is_zero_copy(batch: pa.RecordBatch) -> None:
    sink = io.BytesIO()
    with codec.new_file(sink, batch.schema) as w:
        w.write_batch(batch)
    data = sink.getvalue()
    got = codec.open_file(data).get_batch(0)
    assert_inside(got, data, "open_file(bytes).get_batch(0)")


def test_dictionaries_are_zero_copy() -> None:
    dictionary = pa.array([f"value-{i}" for i in range(1000)])
    indices = pa.array(np.arange(100_000) % 1000, pa.int32())
    b = pa.record_batch(
        {"d": pa.DictionaryArray.from_arrays(indices, dictionary), "n": pa.array(range(100_000))}
    )
    enc = codec.MessageEncoder(b.schema)
    dec = codec.MessageDecoder()
    dec.decode(enc.schema_message().metadata, b"")
    bodies = []
    got = None
    for m in enc.encode(b):
        body = joined_body(m)
        bodies.append(body)
        got = dec.decode(m.metadata, body)
    assert got is not None and len(bodies) == 2
    assert_inside(got.column(0).indices, bodies[1], "dictionary indices")
    assert_inside(got.column(0).dictionary, bodies[0], "dictionary values")
    assert_batch_equal(got, b)


def _batch_buffers_needed(batch: pa.RecordBatch) -> list[tuple[str, pa.Buffer]]:
    """Buffers an encoder must ship for an unsliced batch: validity only where there are nulls."""
    out = []
    for col_index, col in enumerate(batch.columns):
        for arr in walk_arrays(col):
            for k, buf in enumerate(arr.buffers()[:1] if isinstance(arr, pa.ListArray) else arr.buffers()):
                if buf is None or buf.size == 0 or (k == 0 and arr.null_count == 0):
                    continue
                out.append((f"column {col_index} {arr.type} buffer {k}", buf))
            if isinstance(arr, pa.ListArray):
                off = arr.buffers()[1]
                out.append((f"column {col_index} {arr.type} offsets", off))
    return out


def test_encoder_body_buffers_point_at_batch_memory(batch: pa.RecordBatch) -> None:
    _, (msg,) = encode_all(batch)
    addresses: dict[int, int] = {}
    total = 0
    for b in msg.body_buffers:
        pb = pa.py_buffer(b)
        total += pb.size
        if pb.size:
            addresses.setdefault(pb.address, pb.size)
    assert total == msg.body_length
    missing = []
    for name, buf in _batch_buffers_needed(batch):
        size = addresses.get(buf.address)
        if size is None or not (buf.size - 64 <= size <= buf.size + 7):
            missing.append(f"{name} at {buf.address:#x} (+{buf.size}): body entry {size}")
    assert not missing, "encoder copied these buffers instead of referencing them:\n" + "\n".join(missing)
