"""The compiled check of binary-like columns (``dissoc.codec.jit``, numba where installed).

It stands in for a second read and pyarrow's full validation of narrow batches whose risky columns are all
top-level strings or binaries, so it must pass exactly what those pass with ASCII values and send everything
else back to pyarrow's route: the kernel is held to a plain Python statement of its rules, and decoders that
use it to the C Data Interface path on damaged bodies.
"""

from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from helpers.codec import assert_batch_equal
from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc.codec import decoder as decoder_module
from dissoc.codec import jit
from dissoc.errors import CodecError

from .test_ipc_reader import _decoder, _encode, _land, _outcome, _same

try:
    importlib.import_module("numba")  # by name: the jit extra is optional (for mypy too)
    HAVE_NUMBA = True
except ImportError:
    HAVE_NUMBA = False

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def check() -> jit.BinaryCheck:
    pytest.importorskip("numba", reason="the compiled check needs numba (the jit extra)")
    if os.environ.get("DISSOC_JIT", "").strip() == "0":
        pytest.skip("DISSOC_JIT=0 in the environment turns the compiled check off")
    compiled = jit.compile_now()
    assert compiled is not None, f"numba is installed but the check did not compile ({jit.state()})"
    return compiled


def _rules(body: bytes, at: int, spans: list[tuple[int, int, int, int, int, int, int, int]]) -> bool:
    """What the kernel decides, in plain Python."""
    for offsets_at, n, data_at, data_length, width, utf8, validity_at, nulls in spans:
        if n == 0:
            continue
        if nulls > 0:
            bits = at + validity_at
            if bits + (n + 7) // 8 > len(body):
                return False
            valid = np.unpackbits(np.frombuffer(body, np.uint8, (n + 7) // 8, bits), bitorder="little")[:n]
            if int(valid.sum()) != n - nulls:
                return False
        start, data = at + offsets_at, at + data_at
        if start < 0 or start + width * (n + 1) > len(body) or data < 0 or data + data_length > len(body):
            return False
        offsets = np.frombuffer(body, np.int32 if width == 4 else np.int64, n + 1, start).tolist()
        if offsets[0] < 0 or any(b < a for a, b in itertools.pairwise(offsets)) or offsets[-1] > data_length:
            return False
        if utf8 and not body[data + offsets[0] : data + offsets[-1]].isascii():
            return False
    return True


@st.composite
def _columns(draw: st.DrawFn) -> tuple[bytes, int, list[tuple[int, int, int, int, int, int, int, int]]]:
    at = draw(st.sampled_from([0, 8, 24]))
    body = bytearray(at)
    spans = []
    for _ in range(draw(st.integers(1, 3))):
        width = draw(st.sampled_from([4, 8]))
        lengths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=40))
        first = draw(st.sampled_from([0, 0, 3]))
        offsets = np.cumsum([first, *lengths]).astype(np.int64)
        if draw(st.booleans()):  # damage one offset
            offsets[draw(st.integers(0, len(offsets) - 1))] = draw(
                st.sampled_from([-1, -(1 << 31), 1 << 30, 0, int(offsets[-1]) + 1])
            )
        data_length = int(max(0, first + sum(lengths) - draw(st.sampled_from([0, 0, 0, 1]))))
        data = bytearray(b"v" * data_length)
        if data_length and draw(st.booleans()):
            data[draw(st.integers(0, data_length - 1))] = draw(st.sampled_from([0x80, 0xC3, 0xFF]))
        body += bytes(-len(body) % 8)
        validity_at = len(body) - at
        valid = np.array([draw(st.booleans()) for _ in lengths], bool)
        body += np.packbits(valid, bitorder="little").tobytes()
        nulls = int((~valid).sum()) + draw(st.sampled_from([0, 0, 0, 1, -1]))
        body += bytes(-len(body) % 8)
        offsets_at = len(body) - at
        body += offsets.astype(np.int32 if width == 4 else np.int64).tobytes()
        body += bytes(-len(body) % 8)
        data_at = len(body) - at
        body += bytes(data)
        utf8 = int(draw(st.booleans()))
        spans.append((offsets_at, len(lengths), data_at, data_length, width, utf8, validity_at, nulls))
    if draw(st.booleans()):  # a body cut short
        body = body[: draw(st.integers(at, len(body)))]
    return bytes(body), at, spans


@settings(max_examples=300, deadline=None)
@given(case=_columns())
def test_the_kernel_decides_as_its_rules_say(check: jit.BinaryCheck, case: Any) -> None:
    body, at, spans = case
    table = np.array(spans, np.int64)
    table.flags.writeable = False
    expected = _rules(body, at, spans)
    assert check(np.frombuffer(body, np.uint8), at, table) is expected
    assert check(np.frombuffer(bytearray(body), np.uint8), at, table) is expected  # writable too


KINDS = ["string", "large_string", "binary"]


def _narrow(kind: str, rows: int = 300) -> pa.RecordBatch:
    values = [None if i % 11 == 0 else "v" * (i % 7) for i in range(rows)]
    column = {
        "string": pa.array(values, pa.string()),
        "large_string": pa.array(values, pa.large_string()),
        "binary": pa.array([None if v is None else v.encode() + b"\xff" for v in values], pa.binary()),
    }[kind]
    return pa.record_batch(
        {"i": pa.array(range(rows)), "f": pa.array([0.5, None] * (rows // 2)), "s": column}
    )


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]
    real = decoder_module._read_record_batch

    def counting(*args: Any, **kwargs: Any) -> pa.RecordBatch:
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(decoder_module, "_read_record_batch", counting)
    return count


@pytest.mark.parametrize("kind", KINDS)
def test_narrow_batches_are_read_once_with_the_compiled_check(
    check: jit.BinaryCheck, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = _narrow(kind, rows=1024)
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md)
    assert_batch_equal(dec.decode(md, body), batch)  # (the first sight prepares the layout)
    assert dec._prepared[md].spans is not None
    reads = _reads(monkeypatch)
    assert_batch_equal(dec.decode(md, body), batch)
    assert_batch_equal(dec.decode_landed(md, _land(md, body)), batch)
    assert reads[0] == 2  # one read each: no second read under binary types
    monkeypatch.setattr(decoder_module, "binary_check", lambda: None)  # as without numba
    assert_batch_equal(dec.decode(md, body), batch)
    # without it: strings are read a second time under binary types (at this length), binaries are not
    assert reads[0] == (3 if kind == "binary" else 4)


def test_non_ascii_utf8_goes_to_pyarrows_route_and_is_accepted(check: jit.BinaryCheck) -> None:
    batch = pa.record_batch({"i": pa.array(range(40)), "s": pa.array(["é€" * (i % 3) for i in range(40)])})
    schema_md, md, body = _encode(batch)
    dec = _decoder(schema_md)
    for _ in range(2):
        assert_batch_equal(dec.decode(md, body), batch)
        assert_batch_equal(dec.decode_landed(md, _land(md, body)), batch)
    bad = bytearray(body)
    k = bytes(body).index("€".encode())
    bad[k] = 0xFF  # no longer UTF-8
    with pytest.raises(CodecError, match="invalid data"):
        dec.decode(md, bytes(bad))


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_damaged_bodies_get_the_c_data_paths_answer(
    check: jit.BinaryCheck, kind: str, data: st.DataObject
) -> None:
    batch = _narrow(kind, rows=64)
    schema_md, md, body = _encode(batch)
    fast = _decoder(schema_md)
    slow = _decoder(schema_md, ipc_reader=False)
    fast.decode(md, body)
    bad = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4))):
        bad[data.draw(st.integers(0, len(bad) - 1))] = data.draw(st.integers(0, 255))
    expected = _outcome(lambda: slow.decode(md, bytes(bad)))
    _same(_outcome(lambda: fast.decode(md, bytes(bad))), expected, "decode")
    _same(_outcome(lambda: fast.decode_landed(md, _land(md, bytes(bad)))), expected, "decode_landed")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_damaged_metadata_gets_the_c_data_paths_answer(check: jit.BinaryCheck, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    batch = _narrow(kind, rows=64)
    schema_md, md, body = _encode(batch)
    damaged = bytearray(md)
    for _ in range(data.draw(st.integers(1, 2), label="bytes damaged")):
        damaged[data.draw(st.integers(0, len(damaged) - 1), label="byte")] = data.draw(st.integers(0, 255))
    bad = bytes(damaged)
    slow = _outcome(lambda: _decoder(schema_md, ipc_reader=False).decode(bad, body))
    twice = _decoder(schema_md)
    first = _outcome(lambda: twice.decode(bad, body))
    _same(first, slow, "decode")
    _same(_outcome(lambda: twice.decode(bad, body)), slow, "cached decode")
    if len(bad) == len(md):
        _same(_outcome(lambda: twice.decode_landed(bad, _land(bad, body))), slow, "decode_landed")


def _in_a_process(code: str, env: dict[str, str] | None = None) -> str:
    got = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert got.returncode == 0, got.stderr
    return got.stdout.strip()


DECODE_ONE = """
import pyarrow as pa
from dissoc import codec
from dissoc.codec import jit
b = pa.record_batch({"i": pa.array(range(50)), "s": pa.array(["x%d" % i for i in range(50)])})
e = codec.MessageEncoder(b.schema); (m,) = e.encode(b)
d = codec.MessageDecoder(); d.decode(e.schema_message().metadata)
body = b"".join(bytes(memoryview(x)) for x in m.body_buffers)
assert all(d.decode(m.metadata, body).equals(b) for _ in range(3))
print(jit.compile_now(), jit.state())
"""


@pytest.mark.parametrize(
    ("env", "prelude"),
    [({"DISSOC_JIT": "0"}, ""), ({}, "import sys; sys.modules['numba'] = None\n")],
    ids=["turned-off", "no-numba"],
)
def test_without_the_compiled_check_batches_take_pyarrows_route(env: dict[str, str], prelude: str) -> None:
    assert _in_a_process(prelude + DECODE_ONE, env) == "None unavailable"


def test_importing_dissoc_compiles_and_imports_nothing() -> None:
    code = "import sys, dissoc, dissoc.codec, dissoc.client; from dissoc.codec import jit; "
    code += "print(jit.state(), 'numba' in sys.modules)"
    assert _in_a_process(code) == "idle False"


@pytest.mark.skipif(not HAVE_NUMBA, reason="the compiled check needs numba (the jit extra)")
def test_the_first_check_asked_for_compiles_on_a_thread_of_its_own() -> None:
    code = (
        "import threading, time\nfrom dissoc.codec import jit\n"
        "first = jit.binary_check()\nstate = jit.state()\n"
        "names = [t.name for t in threading.enumerate()]\n"
        "deadline = time.monotonic() + 100\n"
        "while jit.binary_check() is None and time.monotonic() < deadline: time.sleep(0.05)\n"
        "print(first, state, 'dissoc-jit' in names, jit.state())"
    )
    assert _in_a_process(code, {"DISSOC_JIT": "1"}) == "None compiling True ready"
