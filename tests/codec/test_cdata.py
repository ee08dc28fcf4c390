"""Lifetime of batches built through the C Data Interface (dissoc.codec.cdata)."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pyarrow as pa
import pytest

from dissoc import codec
from dissoc.codec import cdata
from dissoc.errors import CodecError


def _table() -> pa.Table:
    n = 1000
    return pa.table(
        {
            "i": pa.array(np.arange(n)),
            "s": pa.array([None if i % 5 == 0 else f"v{i}" for i in range(n)]),
            "d": pa.array([f"k{i % 7}" for i in range(n)]).dictionary_encode(),
            "l": pa.array([[i, i + 1] for i in range(n)], pa.list_(pa.int32())),
        }
    )


def _messages(table: pa.Table) -> tuple[codec.MessageEncoder, list[codec.EncodedMessage]]:
    enc = codec.MessageEncoder(table.schema)
    msgs: list[codec.EncodedMessage] = []
    for batch in table.to_batches():
        msgs.extend(enc.encode(batch))
    return enc, msgs


def _decode_all(
    enc: codec.MessageEncoder, msgs: list[codec.EncodedMessage], bodies: list[bytearray]
) -> list[pa.RecordBatch]:
    dec = codec.MessageDecoder()
    dec.decode(enc.schema_message().metadata)
    out = []
    for m, body in zip(msgs, bodies, strict=True):
        b = dec.decode(m.metadata, body)
        if b is not None:
            out.append(b)
    return out


@pytest.mark.parametrize("native_release", [True, False], ids=["mark-released", "arrow-release-only"])
def test_body_lives_exactly_as_long_as_its_batch(
    monkeypatch: pytest.MonkeyPatch, native_release: bool
) -> None:
    if not native_release:
        # As on a system that refuses executable memory: every node gets Arrow's own release.
        monkeypatch.setattr(cdata, "_MARK_RELEASED", 0)
    table = _table()
    enc, msgs = _messages(table)
    bodies = [bytearray(m.body) for m in msgs]
    before = [sys.getrefcount(b) for b in bodies]
    batches = _decode_all(enc, msgs, bodies)
    assert pa.Table.from_batches(batches).equals(table)
    assert sys.getrefcount(bodies[-1]) > before[-1], "a live batch must keep its body alive"
    del batches
    gc.collect()
    assert [sys.getrefcount(b) for b in bodies] == before, "released batches must let their bodies go"


def test_a_batch_rejected_after_import_does_not_leak_its_body() -> None:
    table = pa.table({"s": pa.array(["a", "bb", "ccc"])})
    enc, (msg,) = _messages(table)
    body = bytearray(msg.body)
    # Corrupt the offsets so that they decrease: content checks reject the batch.
    offsets = np.frombuffer(body, np.int32, 4, 0)
    assert offsets.tolist() == [0, 1, 3, 6]
    body[4:8] = (5).to_bytes(4, "little")
    before = sys.getrefcount(body)
    dec = codec.MessageDecoder()
    dec.decode(enc.schema_message().metadata)
    with pytest.raises(CodecError):
        dec.decode(msg.metadata, body)
    gc.collect()
    assert sys.getrefcount(body) == before


def test_batches_outlive_their_decoder_and_reader() -> None:
    table = _table()
    enc, msgs = _messages(table)
    batches = _decode_all(enc, msgs, [bytearray(m.body) for m in msgs])
    gc.collect()
    # Nothing but the batches references the bodies and the exported dictionaries now.
    assert pa.Table.from_batches(batches).equals(table)
    assert batches[0].column("d").dictionary.to_pylist() == [f"k{i}" for i in range(7)]
