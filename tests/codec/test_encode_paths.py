"""The encoder's fast paths against its general walk, pyarrow and our decoder.

``MessageEncoder.encode`` takes one of three paths: the one-pass loop for schemas of flat columns, the bulk
walk through one C Data export for wide batches (:mod:`dissoc.codec.bulk`), and the column walk driven by a
per-schema plan, which hands anything unusual to the general ``_Flattener.visit``. All of them fill a
per-shape Message template. Here every path must give what the general walk gives (the same nodes, and for
ordinary arrays the same metadata and body bytes), and pyarrow and our decoder must read every message.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from helpers import ipcgen
from helpers import strategies as S
from helpers.codec import assert_batch_equal, pa_read_stream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dissoc import codec
from dissoc.codec import bulk, encoder, flatcode, jit, message

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True, params=["bulk-from-8", "bulk-from-8-compiled", "no-bulk"])
def bulk_columns(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Batches from 8 columns take the bulk walk (as from ``encoder.BULK_COLUMNS`` in use), through numpy or
    compiled by numba (``bulk.flatten_walk``), or none does."""
    walk = None
    if request.param == "bulk-from-8-compiled":
        pytest.importorskip("numba", reason="the compiled walk needs numba (the jit extra)")
        if os.environ.get("DISSOC_JIT", "").strip() == "0":
            pytest.skip("DISSOC_JIT=0 in the environment turns the compiled walk off")
        jit.compile_now()
        walk = bulk.flatten_walk()
        assert walk is not None, f"numba is installed but the walk did not compile ({jit.state()})"
    monkeypatch.setattr(bulk, "flatten_walk", lambda: walk)
    value = 10**9 if request.param == "no-bulk" else 8
    monkeypatch.setattr(encoder, "BULK_COLUMNS", value)
    monkeypatch.setattr(encoder, "BULK_FLAT_COLUMNS", value)
    return value


def general_encoder(schema: pa.Schema) -> codec.MessageEncoder:
    """An encoder that takes none of the fast paths: every column goes to ``_Flattener.visit``."""
    enc = codec.MessageEncoder(schema)
    enc._bulk = None
    enc._flat = None
    enc._plans = [(encoder._OTHER, 0, (i,), ()) for i in range(len(schema))]
    return enc


def body_of(msg: Any) -> bytes:
    body = b"".join(bytes(memoryview(b)) for b in msg.body_buffers)
    assert len(body) == msg.body_length
    assert msg.body_length % 8 == 0
    return body


def nodes_of(msg: Any) -> list[list[int]]:
    parsed = message.parse(msg.metadata)
    assert parsed.batch is not None
    nodes: list[list[int]] = parsed.batch.nodes.tolist()
    return nodes


class Checker:
    """Encodes batches of one schema with the encoder under test and with the general walk, side by side."""

    def __init__(self, schema: pa.Schema) -> None:
        self.enc = codec.MessageEncoder(schema)
        self.ref = general_encoder(schema)
        self.dec = codec.MessageDecoder()
        self.dec.decode(self.enc.schema_message().metadata, b"")
        self.framed = [ipcgen.frame(bytes(self.enc.schema_message().metadata))]
        self.batches: list[pa.RecordBatch] = []

    def check(self, batch: pa.RecordBatch, *, identical: bool = True) -> list[Any]:
        """Encode ``batch``: the general walk gives the same nodes and, with ``identical``, the same metadata
        and body bytes; MessageDecoder reads it back."""
        msgs = self.enc.encode(batch)
        ref = self.ref.encode(batch)
        assert len(msgs) == len(ref)
        for got, want in zip(msgs, ref, strict=True):
            assert got.header_type == want.header_type
            assert nodes_of(got) == nodes_of(want)
            if identical:
                assert bytes(got.metadata) == bytes(want.metadata)
                assert body_of(got) == body_of(want)
        *dicts, last = msgs
        for m in dicts:
            assert self.dec.decode(m.metadata, body_of(m)) is None
        assert_batch_equal(self.dec.decode(last.metadata, body_of(last)), batch, "MessageDecoder")
        self.framed += [ipcgen.frame(bytes(m.metadata), body_of(m)) for m in msgs]
        self.batches.append(batch)
        return msgs

    def finish(self) -> None:
        """pyarrow reads every message encoded so far, as one stream."""
        _, got = pa_read_stream(b"".join(self.framed) + ipcgen.EOS)
        assert len(got) == len(self.batches)
        for i, (g, want) in enumerate(zip(got, self.batches, strict=True)):
            assert_batch_equal(g, want, f"pyarrow, batch {i}")


def check_batch(batch: pa.RecordBatch, *, identical: bool = True) -> None:
    c = Checker(batch.schema)
    c.check(batch, identical=identical)
    c.finish()


# --------------------------------------------------------------------------------------------------
# columns of every kind


def columns(n: int, seed: int = 0) -> dict[str, pa.Array]:
    """One column of each layout, ``n`` rows, with nulls."""
    rng = np.random.default_rng(seed)
    mask = rng.random(n) < 0.3
    ints = rng.integers(-1000, 1000, n)
    strs = [f"s{int(x)}" * int(x % 4) for x in rng.integers(0, 50, n)]
    lists = [list(range(int(k))) for k in rng.integers(0, 4, n)]
    return {
        "i8": pa.array(ints % 100, pa.int8(), mask=mask),
        "i64": pa.array(ints, pa.int64(), mask=mask),
        "u16": pa.array(np.abs(ints), pa.uint16()),
        "f32": pa.array(rng.random(n).astype(np.float32), mask=mask),
        "f64": pa.array(rng.random(n)),
        "bool": pa.array(rng.random(n) < 0.5, mask=mask),
        "str": pa.array(strs, pa.string(), mask=mask),
        "lstr": pa.array(strs, pa.large_string()),
        "bin": pa.array([s.encode() for s in strs], pa.binary(), mask=mask),
        "fsb": pa.array([int(x).to_bytes(3, "little", signed=True) for x in ints], pa.binary(3), mask=mask),
        "dec": pa.array(
            [None if m else int(x) for m, x in zip(mask, ints, strict=True)], pa.decimal128(10, 2)
        ),
        "date": pa.array(ints.astype(np.int32), pa.date32()),
        "ts": pa.array(ints, pa.timestamp("us"), mask=mask),
        "null": pa.nulls(n),
        "list": pa.array(lists, pa.list_(pa.int32()), mask=mask),
        "llist": pa.array([[str(v) for v in x] for x in lists], pa.large_list(pa.string())),
        "fsl": pa.array([[int(x), 1, 2] for x in ints], pa.list_(pa.int16(), 3), mask=mask),
        "struct": pa.StructArray.from_arrays(
            [pa.array(ints, pa.int64(), mask=mask), pa.array(strs, pa.string())],
            ["a", "b"],
            mask=pa.array(rng.random(n) < 0.2),
        ),
        "map": pa.array([[(str(v), v) for v in x] for x in lists], pa.map_(pa.string(), pa.int64())),
        "lstruct": pa.array([[{"x": v} for v in x] for x in lists], pa.list_(pa.struct([("x", pa.int64())]))),
        "dict": pa.array(strs, pa.string(), mask=mask).dictionary_encode(),
        "view": pa.array(strs, pa.string_view(), mask=mask),
        "ree": pc.run_end_encode(pa.array(ints % 3)),
        "interval": pa.array([(1, 2, int(x)) for x in ints], pa.month_day_nano_interval()),
    }


FLAT = ["i8", "i64", "u16", "f32", "f64", "bool", "str", "lstr", "bin", "fsb", "dec", "date", "ts", "null"]
NESTED = ["list", "llist", "fsl", "struct", "map", "lstruct"]
OTHER = ["dict", "view", "ree", "interval"]
LENGTHS = [0, 1, 7, 8, 9, 64, 1000]


def batch_of(names: list[str], n: int, seed: int = 0) -> pa.RecordBatch:
    cols = columns(n, seed)
    return pa.record_batch({f"{name}{i}": cols[name] for i, name in enumerate(names)})


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(
    "names",
    [FLAT[:3], FLAT, FLAT + NESTED, NESTED * 2, FLAT + NESTED + OTHER, OTHER],
    ids=["flat3", "flat", "flat+nested", "nested", "all", "other"],
)
def test_every_kind_matches_the_general_walk(names: list[str], n: int) -> None:
    check_batch(batch_of(names, n))


@pytest.mark.parametrize(
    "names", [FLAT, FLAT + NESTED, NESTED * 2, FLAT[:3]], ids=["flat", "mix", "nest", "3"]
)
@pytest.mark.parametrize(("start", "length"), [(0, 10), (3, 20), (8, 100), (13, 0), (1, 998), (999, 1)])
def test_slices_match_the_general_walk(names: list[str], start: int, length: int) -> None:
    check_batch(batch_of(names, 1000).slice(start, length))


def test_paths_taken(bulk_columns: int) -> None:
    """The batches above do exercise each path (bulk: wide and unsliced; flat: flat columns only)."""
    wide = batch_of(FLAT + NESTED, 100)
    enc = codec.MessageEncoder(wide.schema)
    assert enc._flat is None
    if bulk_columns > len(wide.schema):
        assert enc._bulk is None
        return
    assert enc._bulk is not None
    assert bulk.flatten(wide, enc._bulk) is not None
    assert bulk.flatten(wide.slice(1, 50), enc._bulk) is None  # sliced: the column walk
    assert bulk.flatten(wide.slice(0, 50), enc._bulk) is None  # children longer than their parents
    flat_wide = batch_of(FLAT, 100)
    plan = bulk.make_plan(codec.MessageEncoder(flat_wide.schema)._plans, encoder._KIND_NAMES)
    assert plan is not None
    assert bulk.flatten(flat_wide.slice(0, 50), plan) is not None  # a prefix: buffers cut
    flat = codec.MessageEncoder(batch_of(FLAT[:3], 1).schema)
    assert flat._flat is not None and flat._bulk is None
    assert codec.MessageEncoder(batch_of(FLAT + OTHER, 1).schema)._bulk is None
    assert codec.MessageEncoder(batch_of(FLAT, 1).schema, compression="zstd")._bulk is None


@pytest.mark.parametrize(
    "names", [FLAT[:3], FLAT + NESTED, FLAT + NESTED + OTHER], ids=["flat", "bulk", "walk"]
)
def test_one_encoder_many_shapes(names: list[str]) -> None:
    """Same-shaped batches differ only in numbers: one encoder (and one template) serves them all, whatever
    their lengths, null counts and slices, in any order."""
    whole = batch_of(names, 500, seed=1)
    c = Checker(whole.schema)
    batches = [
        batch_of(names, 100, seed=2),
        batch_of(names, 0, seed=3),
        whole,
        whole.slice(0, 17),
        whole.slice(5, 100),
        batch_of(names, 1, seed=4),
        batch_of(names, 100, seed=5),
    ]
    for b in batches:
        c.check(b)
    c.finish()


def test_templates_are_cached_and_filled_in_place() -> None:
    t = message.message_template(message.HeaderType.RecordBatch, 2, 5)
    assert message.message_template(message.HeaderType.RecordBatch, 2, 5) is t
    nodes = np.array([[10, 1], [10, 0]], np.int64)
    spans = np.array([[0, 8], [8, 80], [88, 0], [88, 44], [136, 40]], np.int64)
    filled = t.fill(176, 10, nodes, spans)
    assert filled == t.fill(176, 10, nodes.ravel().tolist(), spans.ravel().tolist())
    assert filled == message.encode_record_batch(10, nodes, spans, 176)
    parsed = message.parse(filled)
    assert parsed.body_length == 176
    assert parsed.batch is not None and parsed.batch.length == 10
    assert parsed.batch.nodes.tolist() == nodes.tolist()
    assert parsed.batch.buffers.tolist() == spans.tolist()
    # zeros are written, not left out: a batch of length 0 still has every field
    zero = t.fill(0, 0, np.zeros((2, 2), np.int64), np.zeros((5, 2), np.int64))
    assert len(zero) == len(filled)
    assert message.parse(zero).batch.length == 0  # type: ignore[union-attr]


def test_dictionary_template() -> None:
    t = message.message_template(message.HeaderType.DictionaryBatch, 1, 3, None, 0)
    nodes = np.array([[3, 0]], np.int64)
    spans = np.array([[0, 0], [0, 16], [16, 3]], np.int64)
    got = t.fill(24, 3, nodes, spans, None, (7, True))
    assert got == message.encode_dictionary_batch(7, True, 3, nodes, spans, 24)
    parsed = message.parse(got)
    assert (parsed.dictionary_id, parsed.is_delta) == (7, True)


def test_offsets_not_starting_at_zero() -> None:
    """Offsets that start above 0 (arrays built over shared buffers): the message stays readable."""
    data = pa.py_buffer(b"xxhelloworld")
    offsets = pa.py_buffer(np.array([2, 7, 7, 12], np.int32).tobytes())
    s = pa.Array.from_buffers(pa.string(), 3, [None, offsets, data])
    values = pa.array(range(10), pa.int64())
    lst = pa.ListArray.from_arrays(pa.array([2, 4, 4, 9], pa.int32()), values)  # child longer than needed
    cols = {f"c{i}": pa.array(range(3)) for i in range(10)}
    batch = pa.record_batch({"s": s, "l": lst, **cols})
    check_batch(batch, identical=False)
    check_batch(pa.record_batch({"s": s}), identical=False)


def test_buffers_longer_than_needed_are_cut() -> None:
    """An array at offset 0 whose buffers hold more than its length needs sends only what it needs."""
    big = batch_of(FLAT + NESTED, 1000)
    small = pa.RecordBatch.from_arrays([c.slice(0, 10) for c in big.columns], schema=big.schema)
    (msg,) = Checker(big.schema).check(small)
    assert msg.body_length < 4000


# --------------------------------------------------------------------------------------------------
# generated data, wide enough for the bulk walk


@st.composite
def wide_cases(draw: st.DrawFn) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    fields = draw(st.lists(S.fields_of(S.data_types(2)), min_size=8, max_size=12))
    schema = pa.schema(fields)
    whole = draw(S.record_batches(schema))
    cuts = sorted(draw(st.lists(st.integers(0, whole.num_rows), max_size=2)))
    bounds = [0, *cuts, whole.num_rows]
    return schema, [whole, *(whole.slice(a, b - a) for a, b in itertools.pairwise(bounds))]


# (each wide schema compiles encoders of its own: about a second an example on two cores)
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(wide_cases())
def test_generated_wide_batches(case: tuple[pa.Schema, list[pa.RecordBatch]]) -> None:
    schema, batches = case
    c = Checker(schema)
    for b in batches:
        # Generated arrays may have offsets that start above 0, which the bulk walk sends as they are.
        c.check(b, identical=False)
    c.finish()


def _bulk_type(t: pa.DataType) -> bool:
    return bulk.make_plan([encoder._plan(t, (0,))], encoder._KIND_NAMES) is not None


def bulk_types() -> st.SearchStrategy[pa.DataType]:
    """Types whose every layout the bulk walk takes: plain leaves in lists, structs and fixed-size lists."""
    leaves = S.leaf_types().filter(_bulk_type)
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            inner.map(pa.list_),
            inner.map(pa.large_list),
            st.tuples(inner, st.integers(1, 3)).map(lambda x: pa.list_(x[0], x[1])),
            st.lists(inner, min_size=1, max_size=3).map(
                lambda ts: pa.struct([(f"f{i}", t) for i, t in enumerate(ts)])
            ),
        ),
        max_leaves=4,
    )


@st.composite
def bulk_cases(draw: st.DrawFn) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """Wide batches of only the layouts the bulk walk takes: unsliced, as generated, and sliced."""
    types = draw(st.lists(bulk_types(), min_size=8, max_size=10))
    fields = [
        pa.field(f"c{i}", t, nullable=pa.types.is_null(t) or draw(st.booleans())) for i, t in enumerate(types)
    ]
    schema = pa.schema(fields)
    whole = draw(S.record_batches(schema))
    # Generated arrays are often slices; pyarrow's IPC round trip gives the same data with every offset 0.
    fresh = pa.ipc.read_record_batch(whole.serialize(), schema)
    return schema, [fresh, whole, fresh.slice(0, whole.num_rows // 2), fresh.slice(whole.num_rows // 3)]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(bulk_cases())
def test_generated_bulk_batches(case: tuple[pa.Schema, list[pa.RecordBatch]]) -> None:
    schema, batches = case
    c = Checker(schema)
    assert (c.enc._bulk is not None) == (len(schema) >= encoder.BULK_COLUMNS)
    for i, b in enumerate(batches):
        # The first comes from pyarrow's IPC reader: offsets from 0, the very same bytes as the general walk.
        c.check(b, identical=i == 0)
    c.finish()


@pytest.mark.parametrize("compression", [None, 0, 1])
@pytest.mark.parametrize("variadic", [[], [3], [2, 0, 5]])
def test_templates_equal_the_direct_layout(compression: int | None, variadic: list[int]) -> None:
    """Every template shape fills to exactly the bytes the direct layout writes for the same numbers."""
    rng = np.random.default_rng(len(variadic))
    nodes = rng.integers(0, 1 << 40, (3, 2))
    spans = rng.integers(0, 1 << 40, (7, 2))
    t = message.message_template(message.HeaderType.RecordBatch, 3, 7, compression, len(variadic))
    assert t.fill(99, 1234, nodes, spans, variadic) == message.encode_record_batch(
        1234, nodes, spans, 99, compression, variadic or None
    )
    assert t.fill(99, 1234, nodes.ravel().tolist(), spans.ravel().tolist(), variadic) == t.fill(
        99, 1234, nodes, spans, variadic
    )
    d = message.message_template(message.HeaderType.DictionaryBatch, 3, 7, compression, len(variadic))
    assert d.fill(99, 1234, nodes, spans, variadic, (1 << 40, False)) == message.encode_dictionary_batch(
        1 << 40, False, 1234, nodes, spans, 99, compression, variadic or None
    )


def test_zero_columns() -> None:
    batch = pa.RecordBatch.from_struct_array(pa.array([{}] * 5, pa.struct([])))
    check_batch(batch)


# --------------------------------------------------------------------------------------------------
# the code generated per flat schema (dissoc.codec.flatcode)


@pytest.fixture
def no_bulk(monkeypatch: pytest.MonkeyPatch) -> None:
    """No batch takes the bulk walk (schemas it takes get no generated code)."""
    monkeypatch.setattr(encoder, "BULK_FLAT_COLUMNS", 10**9)


def flat_only(schema: pa.Schema) -> codec.MessageEncoder:
    """An encoder whose schema-specific code must take every batch: the general loop raises."""
    enc = codec.MessageEncoder(schema)
    assert enc._flat is not None

    def loop(batch: pa.RecordBatch, plans: Any) -> Any:
        raise AssertionError("the general one-pass loop took a batch the generated code should take")

    enc._encode_flat = loop  # type: ignore[method-assign]
    return enc


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1000])
@pytest.mark.parametrize("names", [FLAT[:3], FLAT, ["str"], ["null"], ["bool", "null", "lstr"]])
@pytest.mark.usefixtures("no_bulk")
def test_generated_flat_code_matches_the_loop(names: list[str], n: int) -> None:
    """Unsliced batches with rows take the generated code, which gives the general loop's bytes."""
    batch = batch_of(names, n, seed=n)
    enc = flat_only(batch.schema)
    loop = codec.MessageEncoder(batch.schema)
    (got,) = enc.encode(batch)
    want = loop._encode_flat(batch, loop._flat)  # type: ignore[arg-type]
    assert bytes(got.metadata) == bytes(want.metadata)
    assert body_of(got) == body_of(want)
    assert got.body_length == want.body_length
    check_batch(batch)


@pytest.mark.usefixtures("no_bulk")
def test_generated_flat_code_edge_buffers() -> None:
    """Validity bitmaps present with no nulls (sent as empty), all-null columns, empty strings only, data
    buffers longer than needed and offsets starting above 0: each as the general walk sends it."""
    n = 20
    no_nulls = pa.Array.from_buffers(
        pa.int32(), n, [pa.py_buffer(b"\xff" * 3), pa.py_buffer(np.arange(n, dtype=np.int32).tobytes())], 0
    )
    all_null = pa.array([None] * n, pa.float64())
    empty_strings = pa.array([""] * n, pa.string())
    long_bool = pa.array([True, False] * 50).slice(0, n)
    shifted = pa.Array.from_buffers(
        pa.large_binary(),
        n,
        [None, pa.py_buffer(np.arange(3, n + 4, dtype=np.int64).tobytes()), pa.py_buffer(bytes(range(64)))],
    )
    wide = pa.array([b"abcdefgh" * 2] * n, pa.binary(16))
    no_bytes = pa.array([b""] * n, pa.binary(0))
    batch = pa.record_batch(
        {
            "a": no_nulls,
            "b": all_null,
            "c": empty_strings,
            "d": long_bool,
            "e": shifted,
            "f": wide,
            "g": no_bytes,
        }
    )
    assert batch.column(3).buffers()[1].size > 3  # the slice kept the longer buffer
    enc = flat_only(batch.schema)
    (msg,) = enc.encode(batch)
    assert nodes_of(msg) == [[n, 0], [n, n], [n, 0], [n, 0], [n, 0], [n, 0], [n, 0]]
    check_batch(batch, identical=False)


@pytest.mark.usefixtures("no_bulk")
def test_generated_flat_code_declines_slices_and_empty_batches() -> None:
    """A sliced column or a batch without rows goes to the general loop, whose output the tests above check
    against the general walk."""
    batch = batch_of(FLAT, 100)
    enc = codec.MessageEncoder(batch.schema)
    assert enc._flat_code(batch) is not None
    assert enc._flat_code(batch.slice(1, 10)) is None
    assert enc._flat_code(batch.slice(0, 0)) is None
    mixed = pa.RecordBatch.from_arrays(
        [c.slice(1, 10) if i == 5 else c.slice(0, 10) for i, c in enumerate(batch.columns)],
        schema=batch.schema,
    )
    assert enc._flat_code(mixed) is None  # one sliced column is enough
    check_batch(mixed)


def test_compile_flat_refuses_what_it_does_not_know() -> None:
    template = message.message_template(message.HeaderType.RecordBatch, 1, 3)
    for columns in ([("list", 4)], [("binary", 2)], [("fixed", -1)]):
        with pytest.raises(ValueError, match="compile_flat"):
            flatcode.compile_flat(columns, template, lambda *a: a, encoder._PADS)
    with pytest.raises(ValueError, match="plain parts"):
        flatcode.compile_flat(
            [("null", 0)],
            message.message_template(message.HeaderType.DictionaryBatch, 1, 0),
            lambda *a: a,
            encoder._PADS,
        )


def test_generated_code_only_where_the_bulk_walk_does_not_take_the_schema(bulk_columns: int) -> None:
    """Wide flat schemas take the bulk walk and get no generated code (it would only see the sliced batches
    the bulk walk leaves); narrower ones get it, made once per process for one set of column kinds."""
    wide = codec.MessageEncoder(batch_of(FLAT, 1).schema)
    assert wide._flat is not None
    assert (wide._flat_code is encoder._decline) == (wide._bulk is not None)
    assert (wide._bulk is not None) == (bulk_columns <= len(FLAT))
    narrow = [codec.MessageEncoder(batch_of(FLAT[:3], 1, seed=k).schema) for k in range(2)]
    assert narrow[0]._flat_code is not encoder._decline
    assert narrow[0]._flat_code is narrow[1]._flat_code
    batch = batch_of(FLAT[:3], 10)
    assert narrow[1]._flat_code(batch) is not None
