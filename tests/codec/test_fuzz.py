"""Malformed input: the Arrow project's fuzz corpus, and hypothesis mutations of valid streams and files.

Every case must either be read (and then every batch must pass pyarrow's full validation, so nothing reads out
of bounds) or raise ``CodecError``: no other exception, no crash, no hang (per-case timeout), and no unbounded
allocation (peak traced Python allocations and growth of the process' peak RSS stay under a bound).
"""

from __future__ import annotations

import contextlib
import functools
import io
import resource
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as paipc
import pytest
from helpers import ipcgen
from helpers.codec import (
    fuzz_files,
    fuzz_id,
    missing_param,
    pa_write_file,
    pa_write_stream,
    requires_arrow_testing,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dissoc import codec
from dissoc.errors import CodecError

MiB = 1 << 20
MEMORY_BASE = 256 * MiB


def memory_limit(size: int) -> int:
    return MEMORY_BASE + 8 * size


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


Got = tuple[list[pa.RecordBatch], list[pa.RecordBatch]]  # (the batches, more results to validate)


def read_everything(data: Any, mode: str) -> Got:
    """Read all that the API offers: stream -> read_all + iteration; file -> get_batch for each + read_all.
    ``data`` is the source, or a callable that makes a fresh one (for file objects)."""
    make: Callable[[], Any] = data if callable(data) else lambda: data
    if mode == "stream":
        table = codec.open_stream(make()).read_all()
        batches = list(codec.open_stream(make()))
    else:
        reader = codec.open_file(make())
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        table = reader.read_all()
    assert isinstance(table, pa.Table), f"read_all returned {type(table).__name__}"
    assert sum(b.num_rows for b in batches) == table.num_rows
    return batches, table.to_batches()


def outcome(fn: Callable[[], Got], size: int) -> tuple[str, list[pa.RecordBatch] | None]:
    """Run ``fn``; return ('ok', batches) or ('codec-error', None); fail on anything else or on memory."""
    rss_before = _maxrss_bytes()
    extra: list[pa.RecordBatch] = []
    tracemalloc.start()
    try:
        batches, extra = fn()
        result: tuple[str, list[pa.RecordBatch] | None] = ("ok", batches)
    except CodecError as exc:
        assert str(exc), "CodecError without a message"
        result = ("codec-error", None)
    except Exception as exc:
        pytest.fail(f"raised {type(exc).__name__} instead of CodecError: {exc!r}")
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    limit = memory_limit(size)
    assert peak < limit, f"peak traced allocation {peak / MiB:.1f} MiB for a {size}-byte input"
    grown = _maxrss_bytes() - rss_before
    assert grown < limit, f"peak RSS grew by {grown / MiB:.1f} MiB for a {size}-byte input"
    if result[1] is not None:
        for i, b in enumerate([*result[1], *extra]):
            assert isinstance(b, pa.RecordBatch)
            check_structure(b, f"batch {i}")
    return result


# Full validation also checks values that a reader need not vet (pyarrow's IPC reader does not either):
# these messages are about content, not layout, and are tolerated. A node's null_count that disagrees with
# its validity bitmap is also let through (pyarrow's reader trusts null_count too); nothing reads out of
# bounds because of it.
CONTENT_ONLY = (
    "Invalid UTF8",
    "does not represent a whole number of days",
    "is not within the acceptable range",
    "does not fit in precision",
    "doesn't match actual number of nulls",
    "padding bytes were not all zero",  # inline binary views: bytes past the value
    "but the out-of-line data begins with",  # a view's 4-byte prefix copy disagrees with its data
)


def check_structure(batch: pa.RecordBatch, what: str) -> None:
    """Everything pyarrow's full validation checks about layout must hold: offsets monotonic and within
    their data, dictionary indices, union type ids and offsets, run ends, view buffer indices and ranges."""
    try:
        batch.validate()
        batch.validate(full=True)
    except pa.ArrowInvalid as exc:
        if not any(m in str(exc) for m in CONTENT_ONLY):
            pytest.fail(f"{what} was returned but is structurally invalid: {exc}")


def pyarrow_reads(data: bytes, mode: str) -> list[pa.RecordBatch] | None:
    try:
        if mode == "stream":
            batches = list(paipc.open_stream(pa.py_buffer(data)))
        else:
            r = paipc.open_file(pa.py_buffer(data))
            batches = [r.get_batch(i) for i in range(r.num_record_batches)]
        for b in batches:
            b.validate(full=True)
        return batches
    except (pa.ArrowException, OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------------
# The corpus

FUZZ = fuzz_files()
CASES = [
    pytest.param(p, mode, id=f"{fuzz_id(p)}-as-{mode}") for p in FUZZ for mode in ("stream", "file")
] or [pytest.param(None, "stream", id="arrow-testing-missing")]


@requires_arrow_testing
@pytest.mark.timeout(10)
@pytest.mark.parametrize(("path", "mode"), CASES)
def test_fuzz_case_is_read_or_rejected_cleanly(path: Path, mode: str) -> None:
    data = path.read_bytes()
    status, batches = outcome(lambda: read_everything(data, mode), len(data))
    if status == "ok":
        assert batches is not None
        expected = pyarrow_reads(data, mode)
        if expected is not None:  # both accept it: they must agree
            assert len(batches) == len(expected)
            for got, exp in zip(batches, expected, strict=True):
                assert got.equals(exp, check_metadata=True)


@requires_arrow_testing
@pytest.mark.timeout(10)
@pytest.mark.parametrize("path", [pytest.param(p, id=fuzz_id(p)) for p in FUZZ] or [missing_param()])
def test_fuzz_case_from_file_object(path: Path) -> None:
    """The same through a binary file object (the readers' other code path)."""
    data = path.read_bytes()
    for mode in ("stream", "file"):

        def run(mode: str = mode) -> Got:
            return read_everything(lambda: io.BytesIO(data), mode)

        outcome(run, len(data))


# --------------------------------------------------------------------------------------------------
# Hypothesis mutations of valid input


def _corpus_tables() -> list[tuple[pa.Schema, list[pa.RecordBatch]]]:
    n = 12
    dict_t = pa.dictionary(pa.int16(), pa.string())
    d1 = pa.DictionaryArray.from_arrays(pa.array([0, 1, None, 1] * 3, pa.int16()), pa.array(["x", "yy"]))
    d2 = pa.DictionaryArray.from_arrays(pa.array([2, 0, 1, 2] * 3, pa.int16()), pa.array(["x", "yy", "zzz"]))
    t1 = pa.schema([pa.field("i", pa.int32()), pa.field("s", pa.string()), pa.field("d", dict_t)])
    b1 = [
        pa.RecordBatch.from_arrays(
            [
                pa.array([i if i % 3 else None for i in range(n)], pa.int32()),
                pa.array([f"s{i}" * (i % 4) for i in range(n)]),
                d,
            ],
            schema=t1,
        )
        for d in (d1, d2)
    ]
    t2 = pa.schema(
        [
            pa.field("l", pa.list_(pa.int64())),
            pa.field("st", pa.struct([pa.field("a", pa.float64()), pa.field("b", pa.bool_())])),
            pa.field("u", pa.dense_union([pa.field("x", pa.int8()), pa.field("y", pa.string())])),
        ]
    )
    lst = pa.array([[1, 2], None, [], [3]] * 3, pa.list_(pa.int64()))
    stc = pa.array([{"a": 1.5, "b": True}, None, {"a": None, "b": False}] * 4, t2.field("st").type)
    uni = pa.UnionArray.from_dense(
        pa.array([0, 1] * 6, pa.int8()),
        pa.array(list(range(6)) * 2, pa.int32()),
        [pa.array(range(6), pa.int8()), pa.array(list("abcdef"))],
        ["x", "y"],
    )
    b2 = [pa.RecordBatch.from_arrays([lst, stc, uni], schema=t2)]
    t3 = pa.schema(
        [
            pa.field("v", pa.string_view()),
            pa.field("r", pa.run_end_encoded(pa.int32(), pa.string())),
            pa.field("lv", pa.list_view(pa.int16())),
            pa.field("fsl", pa.list_(pa.int32(), 2)),
        ]
    )
    views = pa.array(["short", None, "a string longer than twelve bytes", ""] * 3, pa.string_view())
    ree = pa.RunEndEncodedArray.from_arrays(pa.array([3, 7, 12], pa.int32()), pa.array(["p", None, "q"]))
    lv = pa.ListViewArray.from_arrays(
        pa.array([0, 1, 0] * 4, pa.int32()),
        pa.array([2, 1, 0] * 4, pa.int32()),
        pa.array([5, 6, 7], pa.int16()),
    )
    fsl = pa.FixedSizeListArray.from_arrays(pa.array(range(2 * n), pa.int32()), 2)
    b3 = [pa.RecordBatch.from_arrays([views, ree, lv, fsl], schema=t3)]
    return [(t1, b1), (t2, b2), (t3, b3)]


@functools.cache
def corpus() -> list[tuple[str, bytes]]:
    out = []
    for k, (schema, batches) in enumerate(_corpus_tables()):
        for comp in (None, "lz4", "zstd"):
            out.append(("stream", pa_write_stream(schema, batches, comp, emit_dictionary_deltas=(k == 0))))
            with contextlib.suppress(pa.ArrowInvalid):
                out.append(("file", pa_write_file(schema, batches, comp, emit_dictionary_deltas=True)))
    return out


HUGE_32 = [-1, -8, 2**31 - 1, 2**30, 0x7FFFFFF8, 0, 8, 2**16]
HUGE_64 = [-1, -(2**63), 2**63 - 1, 2**62, 2**40, 1 << 32, 0, 8, 2**31]


@st.composite
def mutations(draw: st.DrawFn) -> tuple[str, bytes]:
    mode, data = draw(st.sampled_from(corpus()))
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "byte", "truncate", "insert", "delete", "int32", "int64"]))
        pos = draw(st.integers(0, max(len(buf) - 1, 0)))
        if kind == "flip" and buf:
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte" and buf:
            buf[pos] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del buf[pos : pos + draw(st.integers(1, 16))]
        elif kind == "int32":
            pos &= ~3
            buf[pos : pos + 4] = struct.pack("<i", draw(st.sampled_from(HUGE_32)))
        elif kind == "int64":
            pos &= ~7
            buf[pos : pos + 8] = struct.pack("<q", draw(st.sampled_from(HUGE_64)))
    other = "file" if mode == "stream" else "stream"
    return (draw(st.sampled_from([mode, mode, mode, other])), bytes(buf))


@pytest.mark.timeout(180)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_mutated_input_is_read_or_rejected_cleanly(case: tuple[str, bytes]) -> None:
    mode, data = case
    outcome(lambda: read_everything(data, mode), len(data))


# --------------------------------------------------------------------------------------------------
# MessageDecoder: arbitrary and mutated metadata / bodies


@functools.cache
def _split_messages() -> list[list[tuple[bytes, bytes]]]:
    """The corpus streams as (metadata, body) pairs, as the dissociated protocol carries them."""
    out = []
    for mode, data in corpus():
        if mode != "stream":
            continue
        msgs = []
        for m in paipc.MessageReader.open_stream(pa.py_buffer(data)):
            msgs.append((m.metadata.to_pybytes(), m.body.to_pybytes() if m.body is not None else b""))
        out.append(msgs)
    return out


def _decode_all(msgs: list[tuple[bytes, bytes]]) -> Got:
    dec = codec.MessageDecoder()
    out = []
    for md, body in msgs:
        got = dec.decode(md, body)
        if got is not None:
            assert isinstance(got, pa.RecordBatch)
            out.append(got)
    return out, []


@st.composite
def mutated_messages(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    msgs = list(draw(st.sampled_from(_split_messages())))
    k = draw(st.integers(0, len(msgs) - 1))
    md, body = msgs[k]
    mutate_metadata = draw(st.booleans()) or not body
    target = bytearray(md if mutate_metadata else body)
    for _ in range(draw(st.integers(1, 3))):
        if not target:
            break
        pos = draw(st.integers(0, len(target) - 1))
        kind = draw(st.sampled_from(["flip", "int32", "int64", "truncate"]))
        if kind == "flip":
            target[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "int32":
            pos &= ~3
            target[pos : pos + 4] = struct.pack("<i", draw(st.sampled_from(HUGE_32)))
        elif kind == "int64":
            pos &= ~7
            target[pos : pos + 8] = struct.pack("<q", draw(st.sampled_from(HUGE_64)))
        else:
            del target[pos:]
    msgs[k] = (bytes(target), body) if mutate_metadata else (md, bytes(target))
    return msgs


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_messages())
def test_message_decoder_on_mutated_messages(msgs: list[tuple[bytes, bytes]]) -> None:
    outcome(lambda: _decode_all(msgs), sum(len(m) + len(b) for m, b in msgs))


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.binary(max_size=64), st.booleans())
def test_message_decoder_on_random_bytes(metadata: bytes, body: bytes, with_schema: bool) -> None:
    def run() -> Got:
        dec = codec.MessageDecoder()
        if with_schema:
            dec.decode(_split_messages()[0][0][0], b"")
        got = dec.decode(metadata, body)
        return ([got] if isinstance(got, pa.RecordBatch) else []), []

    outcome(run, len(metadata) + len(body))


def test_huge_lengths_do_not_allocate() -> None:
    """A record batch that claims 2**40 rows of int64 over a 16-byte body must fail without allocating."""
    fields = [ipcgen.FieldSpec("a", ipcgen.int_(64))]
    body, spans = ipcgen.body(b"", np.arange(2, dtype="<i8").tobytes())
    huge = 1 << 40
    rb = ipcgen.record_batch_message(huge, [(huge, 0)], spans, body_length=len(body))
    data = ipcgen.stream((ipcgen.schema_message(fields), b""), (rb, body))
    status, _ = outcome(lambda: read_everything(data, "stream"), len(data))
    assert status == "codec-error"
