"""Round trips between dissoc and pyarrow (the oracle), streams and files, compression none / lz4 / zstd.

(a) dissoc writes, pyarrow reads; (b) pyarrow writes, dissoc reads; (c) MessageEncoder -> MessageDecoder, and
the encoder's messages framed by hand and read by pyarrow; (d) dictionaries across batches: deltas,
replacements, nested dictionaries, a dictionary shared by two fields; the file format's refusal of
replacements.
"""

from __future__ import annotations

import dataclasses
import io
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as paipc
import pytest
from helpers import ipcgen
from helpers import strategies as S
from helpers.codec import (
    COMPRESSIONS,
    assert_batch_equal,
    assert_batches_equal,
    assert_schema_equal,
    assert_table_equal,
    pa_read_file,
    pa_read_stream,
    pa_write_file,
    pa_write_stream,
    table_of,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dissoc import codec
from dissoc.errors import CodecError

SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
compressions = st.sampled_from(COMPRESSIONS)

pytestmark = pytest.mark.timeout(240)


# --------------------------------------------------------------------------------------------------
# helpers


def dissoc_write_stream(
    schema: pa.Schema,
    batches: list[pa.RecordBatch],
    compression: str | None = None,
    *,
    emit_dictionary_deltas: bool = False,
    as_table: bool = False,
) -> bytes:
    sink = io.BytesIO()
    with codec.new_stream(
        sink, schema, compression=compression, emit_dictionary_deltas=emit_dictionary_deltas
    ) as writer:
        if as_table:
            writer.write_table(table_of(schema, batches))
        else:
            for b in batches:
                writer.write_batch(b)
    return sink.getvalue()


def dissoc_write_file(
    schema: pa.Schema,
    batches: list[pa.RecordBatch],
    compression: str | None = None,
    *,
    as_table: bool = False,
) -> bytes:
    sink = io.BytesIO()
    with codec.new_file(sink, schema, compression=compression) as writer:
        if as_table:
            writer.write_table(table_of(schema, batches))
        else:
            for b in batches:
                writer.write_batch(b)
    return sink.getvalue()


def dissoc_read_stream(data: bytes) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    reader = codec.open_stream(data)
    return reader.schema, list(reader)


def dissoc_read_file(data: bytes) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    reader = codec.open_file(data)
    return reader.schema, [reader.get_batch(i) for i in range(reader.num_record_batches)]


def pyarrow_file_outcome(schema: pa.Schema, batches: list[pa.RecordBatch], compression: str | None) -> str:
    """'ok' if pyarrow writes these batches as a file; 'deltas' if only with emit_dictionary_deltas=True;
    'refused' if not at all (a dictionary replaced between batches)."""
    try:
        pa_write_file(schema, batches, compression)
        return "ok"
    except pa.ArrowInvalid:
        pass
    try:
        pa_write_file(schema, batches, compression, emit_dictionary_deltas=True)
        return "deltas"
    except pa.ArrowInvalid:
        return "refused"


def frame_encoded(msg: Any) -> bytes:
    body = b"".join(bytes(memoryview(b)) for b in msg.body_buffers)
    assert len(body) == msg.body_length, (
        f"body_buffers hold {len(body)} bytes, body_length says {msg.body_length}"
    )
    return ipcgen.frame(bytes(msg.metadata), body)


# --------------------------------------------------------------------------------------------------
# the oracle itself


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S.table_cases(), compressions)
def test_generated_data_is_valid_and_pyarrow_round_trips_it(
    case: S.TableCase, compression: str | None
) -> None:
    """Guards the tests: generated batches pass full validation and pyarrow reads back what it writes."""
    for b in case.batches:
        b.validate(full=True)
    assert_batches_equal(
        pa_read_stream(pa_write_stream(case.schema, case.batches, compression))[1], case.batches
    )


# --------------------------------------------------------------------------------------------------
# (a) dissoc writes -> pyarrow reads


@SETTINGS
@given(S.table_cases(), compressions, st.booleans())
def test_dissoc_stream_read_by_pyarrow(case: S.TableCase, compression: str | None, as_table: bool) -> None:
    data = dissoc_write_stream(case.schema, case.batches, compression, as_table=as_table)
    schema, got = pa_read_stream(data)
    assert_schema_equal(schema, case.schema)
    if as_table:
        assert_table_equal(table_of(schema, got), case.table)
    else:
        assert_batches_equal(got, case.batches, "pyarrow reading dissoc's stream")


@SETTINGS
@given(S.table_cases(), compressions, st.booleans())
def test_dissoc_file_read_by_pyarrow(case: S.TableCase, compression: str | None, as_table: bool) -> None:
    if as_table:
        # Writing a table writes its non-empty chunks (pyarrow's write_table does the same): that, not the
        # batches it was built from, is what the file must hold.
        case = dataclasses.replace(case, batches=table_of(case.schema, case.batches).to_batches())
    outcome = pyarrow_file_outcome(case.schema, case.batches, compression)
    if outcome == "refused":
        with pytest.raises(CodecError):
            dissoc_write_file(case.schema, case.batches, compression, as_table=as_table)
        return
    try:
        data = dissoc_write_file(case.schema, case.batches, compression, as_table=as_table)
    except CodecError:
        if outcome == "deltas":  # pyarrow needs deltas for it; dissoc's file writer may refuse instead
            return
        raise
    expected = case.batches
    if outcome == "deltas":
        # a file reader applies every delta before the first batch, so earlier batches see the grown
        # dictionaries: compare with pyarrow's reading of pyarrow's own delta file
        expected = pa_read_file(pa_write_file(case.schema, case.batches, compression, True))[1]
    schema, got = pa_read_file(data)
    assert_schema_equal(schema, case.schema)
    if as_table:
        assert_table_equal(table_of(schema, got), table_of(case.schema, expected))
    else:
        assert_batches_equal(got, expected, "pyarrow reading dissoc's file")
    assert_table_equal(paipc.open_file(data).read_all(), table_of(case.schema, expected))


# --------------------------------------------------------------------------------------------------
# (b) pyarrow writes -> dissoc reads


@SETTINGS
@given(S.table_cases(), compressions)
def test_pyarrow_stream_read_by_dissoc(case: S.TableCase, compression: str | None) -> None:
    data = pa_write_stream(case.schema, case.batches, compression)
    _, expected = pa_read_stream(data)
    schema, got = dissoc_read_stream(data)
    assert_schema_equal(schema, case.schema)
    assert_batches_equal(got, expected, "dissoc reading pyarrow's stream")
    assert_batches_equal(got, case.batches, "dissoc reading pyarrow's stream vs input")
    assert_table_equal(codec.open_stream(data).read_all(), case.table)


@SETTINGS
@given(S.table_cases(), compressions)
def test_pyarrow_file_read_by_dissoc(case: S.TableCase, compression: str | None) -> None:
    try:
        data = pa_write_file(case.schema, case.batches, compression)
    except pa.ArrowInvalid:  # dictionary replaced between batches: try pyarrow's file deltas instead
        try:
            data = pa_write_file(case.schema, case.batches, compression, emit_dictionary_deltas=True)
        except pa.ArrowInvalid:
            return
    _, expected = pa_read_file(data)
    schema, got = dissoc_read_file(data)
    assert_schema_equal(schema, case.schema)
    assert_batches_equal(got, expected, "dissoc reading pyarrow's file")
    reader = codec.open_file(data)
    n = reader.num_record_batches
    for i in reversed(range(n)):  # random access after the dictionaries of later batches were seen
        assert_batch_equal(reader.get_batch(i), expected[i], f"get_batch({i})")
    assert_table_equal(reader.read_all(), table_of(case.schema, expected))


# --------------------------------------------------------------------------------------------------
# (c) MessageEncoder -> MessageDecoder


def _check_encoded(msg: Any) -> bytes:
    assert len(memoryview(msg.metadata)) > 0, "empty metadata"
    assert msg.body_length % 8 == 0, f"body_length {msg.body_length} is not a multiple of 8"
    body = b"".join(bytes(memoryview(b)) for b in msg.body_buffers)
    assert len(body) == msg.body_length
    return body


@SETTINGS
@given(S.table_cases(), compressions, st.booleans())
def test_message_encoder_decoder_round_trip(case: S.TableCase, compression: str | None, deltas: bool) -> None:
    enc = codec.MessageEncoder(case.schema, compression=compression, emit_dictionary_deltas=deltas)
    dec = codec.MessageDecoder()
    schema_msg = enc.schema_message()
    assert schema_msg.body_length == 0
    assert dec.decode(schema_msg.metadata, _check_encoded(schema_msg)) is None
    assert_schema_equal(dec.schema, case.schema)
    framed = [frame_encoded(schema_msg)]
    for i, batch in enumerate(case.batches):
        msgs = enc.encode(batch)
        assert msgs, "encode returned no messages"
        *dict_msgs, last = msgs
        for m in dict_msgs:
            assert dec.decode(m.metadata, _check_encoded(m)) is None, (
                "a dictionary message decoded to a batch"
            )
        got = dec.decode(last.metadata, _check_encoded(last))
        assert_batch_equal(got, batch, f"decoded batch {i}")
        framed.extend(frame_encoded(m) for m in msgs)
    # the very same messages, framed as an IPC stream, are what pyarrow reads
    schema, got_pa = pa_read_stream(b"".join(framed) + ipcgen.EOS)
    assert_schema_equal(schema, case.schema)
    assert_batches_equal(got_pa, case.batches, "pyarrow reading the encoder's messages")


@SETTINGS
@given(S.table_cases(max_depth=2), compressions)
def test_message_decoder_reads_pyarrow_messages(case: S.TableCase, compression: str | None) -> None:
    """pyarrow's messages, split into metadata and body, through MessageDecoder (body: bytes or pa.Buffer)."""
    data = pa_write_stream(case.schema, case.batches, compression)
    dec = codec.MessageDecoder()
    got = []
    for k, msg in enumerate(paipc.MessageReader.open_stream(pa.py_buffer(data))):
        body = msg.body if k % 2 else (msg.body.to_pybytes() if msg.body is not None else b"")
        out = dec.decode(msg.metadata.to_pybytes(), body if body is not None else b"")
        if msg.type == "record batch":
            got.append(out)
        else:
            assert out is None, f"{msg.type} message decoded to {type(out).__name__}"
    assert_schema_equal(dec.schema, case.schema)
    assert_batches_equal(got, case.batches, "MessageDecoder on pyarrow's messages")


# --------------------------------------------------------------------------------------------------
# (d) dictionaries across batches


def _stats(data: bytes) -> Any:
    reader = paipc.open_stream(data)
    reader.read_all()
    return reader.stats


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S.dictionary_sequences(), compressions, st.booleans())
def test_dictionary_sequences_dissoc_writes(
    seq: S.DictSequence, compression: str | None, deltas: bool
) -> None:
    data = dissoc_write_stream(seq.schema, seq.batches, compression, emit_dictionary_deltas=deltas)
    schema, got = pa_read_stream(data)
    assert_schema_equal(schema, seq.schema)
    assert_batches_equal(got, seq.batches, "pyarrow reading dissoc's dictionary stream")
    # No more dictionary messages than pyarrow sends (unchanged dictionaries are not re-sent), at least as
    # many of them deltas where deltas are asked for (pyarrow treats growth from an empty dictionary as a
    # replacement; a delta there is fine too), and none without.
    ours = _stats(data)
    theirs = _stats(pa_write_stream(seq.schema, seq.batches, compression, emit_dictionary_deltas=deltas))
    assert ours.num_dictionary_batches <= theirs.num_dictionary_batches, (ours, theirs)
    if deltas:
        assert ours.num_dictionary_deltas >= theirs.num_dictionary_deltas, (ours, theirs)
    else:
        assert ours.num_dictionary_deltas == 0, ours


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S.dictionary_sequences(), compressions, st.booleans(), st.sampled_from(["stream", "file"]))
def test_dictionary_sequences_pyarrow_writes(
    seq: S.DictSequence, compression: str | None, deltas: bool, fmt: str
) -> None:
    if fmt == "stream":
        data = pa_write_stream(seq.schema, seq.batches, compression, emit_dictionary_deltas=deltas)
        schema, got = dissoc_read_stream(data)
        _, expected = pa_read_stream(data)
    else:
        try:
            data = pa_write_file(seq.schema, seq.batches, compression, emit_dictionary_deltas=deltas)
        except pa.ArrowInvalid:
            return
        schema, got = dissoc_read_file(data)
        _, expected = pa_read_file(data)
    assert_schema_equal(schema, seq.schema)
    assert_batches_equal(got, expected, "dissoc vs pyarrow")
    if fmt == "stream" or not deltas:
        assert_batches_equal(got, seq.batches, "dissoc vs input")
    else:  # file deltas are all applied up front: same values, grown dictionaries
        assert [b.to_pylist() for b in got] == [b.to_pylist() for b in seq.batches]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(S.dictionary_sequences(), compressions, st.booleans())
def test_dictionary_sequences_encoder_decoder(
    seq: S.DictSequence, compression: str | None, deltas: bool
) -> None:
    enc = codec.MessageEncoder(seq.schema, compression=compression, emit_dictionary_deltas=deltas)
    dec = codec.MessageDecoder()
    dec.decode(enc.schema_message().metadata, b"")
    for i, batch in enumerate(seq.batches):
        *dicts, last = enc.encode(batch)
        for m in dicts:
            assert dec.decode(m.metadata, _check_encoded(m)) is None
        assert_batch_equal(dec.decode(last.metadata, _check_encoded(last)), batch, f"batch {i}")


def _dict_batch(schema: pa.Schema, values: list[str], indices: list[int | None]) -> pa.RecordBatch:
    dtype = schema.field(0).type
    arr = pa.DictionaryArray.from_arrays(pa.array(indices, dtype.index_type), pa.array(values, pa.string()))
    return pa.RecordBatch.from_arrays([arr], schema=schema)


DICT_SCHEMA = pa.schema([pa.field("d", pa.dictionary(pa.int16(), pa.string()))])


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_explicit_delta_and_replacement_sequence(compression: str | None) -> None:
    batches = [
        _dict_batch(DICT_SCHEMA, ["a", "b"], [0, 1, None]),
        _dict_batch(DICT_SCHEMA, ["a", "b", "c"], [2, 2, 0]),  # delta ["c"]
        _dict_batch(DICT_SCHEMA, ["a", "b", "c", "d", "e"], [4, 3]),  # delta ["d", "e"]
        _dict_batch(DICT_SCHEMA, ["x"], [0]),  # replacement
        _dict_batch(DICT_SCHEMA, ["x", "y"], [1, None, 0]),  # delta ["y"]
        _dict_batch(DICT_SCHEMA, ["x", "y"], []),  # unchanged, empty batch
    ]
    data = dissoc_write_stream(DICT_SCHEMA, batches, compression, emit_dictionary_deltas=True)
    _, got = pa_read_stream(data)
    assert_batches_equal(got, batches)
    stats = _stats(data)
    assert (stats.num_dictionary_deltas, stats.num_replaced_dictionaries) == (3, 1), stats
    # and dissoc reads pyarrow's equivalent
    pdata = pa_write_stream(DICT_SCHEMA, batches, compression, emit_dictionary_deltas=True)
    assert (_stats(pdata).num_dictionary_deltas, _stats(pdata).num_replaced_dictionaries) == (3, 1)
    assert_batches_equal(dissoc_read_stream(pdata)[1], batches)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_file_writer_refuses_dictionary_replacement(compression: str | None) -> None:
    batches = [_dict_batch(DICT_SCHEMA, ["a", "b"], [0, 1]), _dict_batch(DICT_SCHEMA, ["z", "b"], [0, 1])]
    with pytest.raises(pa.ArrowInvalid):
        pa_write_file(DICT_SCHEMA, batches, compression)
    with pytest.raises(CodecError), codec.new_file(io.BytesIO(), DICT_SCHEMA, compression=compression) as w:
        for b in batches:
            w.write_batch(b)


def test_file_writer_accepts_equal_dictionaries_in_distinct_arrays() -> None:
    batches = [_dict_batch(DICT_SCHEMA, ["a", "b"], [0, 1]), _dict_batch(DICT_SCHEMA, ["a", "b"], [1, None])]
    data = dissoc_write_file(DICT_SCHEMA, batches)
    assert_batches_equal(pa_read_file(data)[1], batches)


def test_nested_dictionaries_round_trip() -> None:
    inner = pa.dictionary(pa.int8(), pa.string())
    schema = pa.schema(
        [
            pa.field("list_of_dict", pa.list_(pa.field("item", inner))),
            pa.field("struct_of_dict", pa.struct([pa.field("a", inner), pa.field("b", pa.int32())])),
            pa.field("dict_of_list_of_dict", pa.dictionary(pa.int32(), pa.list_(pa.field("item", inner)))),
        ]
    )
    d_inner = pa.DictionaryArray.from_arrays(pa.array([0, 1, None, 1, 0], pa.int8()), pa.array(["p", "q"]))
    lists = pa.ListArray.from_arrays(pa.array([0, 2, 2, 5], pa.int32()), d_inner)
    structs = pa.StructArray.from_arrays(
        [d_inner.slice(1, 3), pa.array([1, 2, None], pa.int32())], fields=list(schema.field(1).type)
    )
    outer = pa.DictionaryArray.from_arrays(pa.array([1, 0, None], pa.int32()), lists.slice(0, 2))
    batch = pa.RecordBatch.from_arrays([lists, structs, outer], schema=schema)
    for compression in COMPRESSIONS:
        assert_batches_equal(
            pa_read_stream(dissoc_write_stream(schema, [batch, batch], compression))[1], [batch, batch]
        )
        assert_batches_equal(
            pa_read_file(dissoc_write_file(schema, [batch, batch], compression))[1], [batch, batch]
        )
        assert_batches_equal(dissoc_read_stream(pa_write_stream(schema, [batch], compression))[1], [batch])


def test_dictionary_of_dictionary_round_trips_in_dissoc_or_is_refused() -> None:
    """A dictionary whose values are dictionary-encoded: pyarrow 26 writes it but cannot read it back, so
    dissoc either round-trips it through its own writer and reader or refuses it with CodecError."""
    inner = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0], pa.int8()), pa.array(["x", "y"]))
    outer = pa.DictionaryArray.from_arrays(pa.array([2, 0, None, 1], pa.int32()), inner)
    batch = pa.record_batch([outer], names=["dd"])
    try:
        data = dissoc_write_stream(batch.schema, [batch])
        assert_batches_equal(dissoc_read_stream(data)[1], [batch])
    except CodecError:
        pass


def test_shared_dictionary_between_fields() -> None:
    """Two fields that reference one dictionary id (pyarrow's writer cannot produce this; built by hand and
    read by pyarrow as the oracle)."""
    dict_spec = ipcgen.DictSpec(id=7, index_bits=16)
    fields = [
        ipcgen.FieldSpec("c1", ipcgen.utf8(), dictionary=dict_spec),
        ipcgen.FieldSpec("c2", ipcgen.utf8(), dictionary=dict_spec),
    ]
    values = [b"red", b"green", b"blue"]
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype("<i4")
    dbody, dspans = ipcgen.body(b"", offsets.tobytes(), b"".join(values))
    dmsg = ipcgen.dictionary_message(7, 3, [(3, 0)], dspans, body_length=len(dbody))
    i1 = np.array([0, 2, 1, 1], "<i2").tobytes()
    i2 = np.array([2, 2, 0, 1], "<i2").tobytes()
    rbody, rspans = ipcgen.body(b"", i1, b"", i2)
    rmsg = ipcgen.record_batch_message(4, [(4, 0), (4, 0)], rspans, body_length=len(rbody))
    data = ipcgen.stream((ipcgen.schema_message(fields), b""), (dmsg, dbody), (rmsg, rbody))
    schema, expected = pa_read_stream(data)
    got_schema, got = dissoc_read_stream(data)
    assert_schema_equal(got_schema, schema)
    assert_batches_equal(got, expected)
    assert got[0].column(0).to_pylist() == ["red", "blue", "green", "green"]
    # dissoc writes what it read; pyarrow reads it back the same
    assert_batches_equal(pa_read_stream(dissoc_write_stream(got_schema, got))[1], expected)


# --------------------------------------------------------------------------------------------------
# Sources, sinks, compression actually applied, writer lifecycle


def _compressible_batch(rows: int = 200_000) -> pa.RecordBatch:
    return pa.record_batch(
        {
            "i": pa.array(np.arange(rows, dtype=np.int64) // 1000),
            "s": pa.array(["abcdefgh"] * rows),
            "f": pa.array(np.zeros(rows)),
        }
    )


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
@pytest.mark.parametrize("fmt", ["stream", "file"])
def test_compression_is_applied(compression: str, fmt: str) -> None:
    batch = _compressible_batch()
    if fmt == "stream":
        plain = dissoc_write_stream(batch.schema, [batch])
        packed = dissoc_write_stream(batch.schema, [batch], compression)
        got = pa_read_stream(packed)[1]
    else:
        plain = dissoc_write_file(batch.schema, [batch])
        packed = dissoc_write_file(batch.schema, [batch], compression)
        got = pa_read_file(packed)[1]
    assert len(packed) < len(plain) // 4, (len(packed), len(plain))
    assert_batches_equal(got, [batch])


def test_unknown_compression_name_is_rejected() -> None:
    batch = _compressible_batch(10)
    with pytest.raises((CodecError, ValueError)):
        codec.new_stream(io.BytesIO(), batch.schema, compression="snappy")
    with pytest.raises((CodecError, ValueError)):
        codec.MessageEncoder(batch.schema, compression="brotli")


def test_path_sinks_and_sources(tmp_path: Path) -> None:
    batch = _compressible_batch(1000)
    stream_path = tmp_path / "x.arrows"
    with codec.new_stream(stream_path, batch.schema) as w:
        w.write_batch(batch)
    assert_batches_equal(pa_read_stream(stream_path.read_bytes())[1], [batch])
    assert_batches_equal(list(codec.open_stream(str(stream_path))), [batch])
    file_path = tmp_path / "x.arrow"
    with codec.new_file(str(file_path), batch.schema) as w:
        w.write_batch(batch)
    assert_batches_equal(pa_read_file(file_path.read_bytes())[1], [batch])
    assert_batches_equal([codec.open_file(file_path).get_batch(0)], [batch])


def test_writer_leaves_caller_sink_open_and_writes_eos() -> None:
    batch = _compressible_batch(10)
    sink = io.BytesIO()
    w = codec.new_stream(sink, batch.schema)
    w.write_batch(batch)
    w.close()
    assert not sink.closed, "the writer closed a sink it did not open (pyarrow leaves it open)"
    data = sink.getvalue()
    assert data.endswith(ipcgen.EOS), "stream does not end with the end-of-stream marker"
    sink = io.BytesIO()
    with codec.new_file(sink, batch.schema) as fw:
        fw.write_batch(batch)
    assert not sink.closed
    data = sink.getvalue()
    assert data[:8] == b"ARROW1\x00\x00" and data[-6:] == b"ARROW1"
    (footer_len,) = struct.unpack("<i", data[-10:-6])
    assert 0 < footer_len < len(data)


def test_writer_rejects_batch_with_other_schema() -> None:
    batch = _compressible_batch(10)
    other = pa.record_batch({"x": pa.array([1, 2, 3])})
    with (
        codec.new_stream(io.BytesIO(), batch.schema) as w,
        pytest.raises((CodecError, ValueError, TypeError)),
    ):
        w.write_batch(other)


def test_empty_stream_and_file() -> None:
    schema = pa.schema([pa.field("a", pa.int32())], metadata={"k": "v"})
    s = dissoc_write_stream(schema, [])
    assert pa_read_stream(s)[0].equals(schema, check_metadata=True)
    assert codec.open_stream(s).read_all().equals(schema.empty_table(), check_metadata=True)
    f = dissoc_write_file(schema, [])
    assert paipc.open_file(f).num_record_batches == 0
    r = codec.open_file(f)
    assert r.num_record_batches == 0
    assert_schema_equal(r.schema, schema)


def test_stream_without_eos_marker_is_read() -> None:
    """The format allows a stream to end at a message boundary without the EOS marker."""
    batch = _compressible_batch(10)
    data = pa_write_stream(batch.schema, [batch, batch])
    assert data.endswith(ipcgen.EOS)
    assert_batches_equal(dissoc_read_stream(data[: -len(ipcgen.EOS)])[1], [batch, batch])


def test_legacy_framing_without_continuation_marker() -> None:
    """Pre-0.15 framing (int32 length, no 0xFFFFFFFF): pyarrow writes it with use_legacy_format=True."""
    batch = _compressible_batch(10)
    sink = io.BytesIO()
    with paipc.new_stream(sink, batch.schema, options=paipc.IpcWriteOptions(use_legacy_format=True)) as w:
        w.write_batch(batch)
    data = sink.getvalue()
    assert not data.startswith(ipcgen.CONTINUATION)
    assert_batches_equal(dissoc_read_stream(data)[1], [batch])


def test_zero_column_batches_with_rows() -> None:
    schema = pa.schema([], metadata={"only": "metadata"})
    batches = [
        pa.RecordBatch.from_struct_array(pa.array([{}] * n, pa.struct([]))).replace_schema_metadata(
            schema.metadata
        )
        for n in (0, 5, 3)
    ]
    for data in (dissoc_write_stream(schema, batches), pa_write_stream(schema, batches)):
        assert [b.num_rows for b in pa_read_stream(data)[1]] == [0, 5, 3]
        assert [b.num_rows for b in dissoc_read_stream(data)[1]] == [0, 5, 3]
    assert [b.num_rows for b in pa_read_file(dissoc_write_file(schema, batches))[1]] == [0, 5, 3]


def test_bit_offsets_in_sliced_booleans_and_validity() -> None:
    """Slices at every offset 0..15 of bool values and validity bitmaps (bit offsets not multiples of 8)."""
    base = pa.array([(i % 3 == 0) if i % 5 else None for i in range(40)], pa.bool_())
    ints = pa.array([i if i % 4 else None for i in range(40)], pa.int16())
    schema = pa.schema([pa.field("b", pa.bool_()), pa.field("i", pa.int16())])
    batches = [
        pa.RecordBatch.from_arrays([base.slice(k, 17), ints.slice(k, 17)], schema=schema) for k in range(16)
    ]
    for compression in COMPRESSIONS:
        assert_batches_equal(pa_read_stream(dissoc_write_stream(schema, batches, compression))[1], batches)
        enc = codec.MessageEncoder(schema, compression=compression)
        dec = codec.MessageDecoder()
        dec.decode(enc.schema_message().metadata, b"")
        for b in batches:
            (m,) = enc.encode(b)
            assert_batch_equal(dec.decode(m.metadata, _check_encoded(m)), b)
