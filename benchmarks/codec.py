"""Codec benchmark: dissoc vs pyarrow, in one run, with ratios.

    python benchmarks/codec.py [--quick] [--repeat N] [--json]

Measures (median of N repetitions each):

  (a) encode, per message, for a 3-column and a 100-column batch (1024 rows, with nulls) and for 2 x int64
      (1024 rows): dissoc ``MessageEncoder.encode(batch)`` (metadata plus the list of body buffers, no copy)
      vs pyarrow ``batch.serialize()`` (target: at most 3x); and, as an extra row, vs pyarrow
      ``RecordBatchStreamWriter.write_batch`` into a ``MockOutputStream`` (pyarrow builds the metadata and
      hands the buffers to a sink that only counts them);
  (b) message decode, per message, for the same batches and for the simplest one (2 x int64, 1024 rows, no
      nulls), metadata repeating byte for byte as in a stream of same-shaped batches: dissoc
      ``MessageDecoder.decode(metadata, body)`` with its default checks vs pyarrow
      ``read_record_batch(read_message(buf), schema)`` followed by ``validate(full=True)`` (the same safety
      from pyarrow); ``MessageDecoder(validate=False)`` vs the bare pyarrow read; and ``decode_landed`` (the
      body landed after ``frame_room`` bytes of headroom) against the same two; for layouts with nothing in
      the body to check (2 x int64), ``Landing.read`` (what the client does with small bodies: framing and
      body in a slab, one read of a slice of it) against the bare pyarrow read;
  (c) reading a 1 GiB uncompressed stream (16 MiB batches) from memory: ``open_stream(buf).read_all()``;
  (d) writing it: into growing memory (dissoc -> ``io.BytesIO``, pyarrow -> ``pa.BufferOutputStream``); both
      into ``pa.BufferOutputStream`` (the same sink, where dissoc accepts it as a file object); and into
      preallocated memory (dissoc -> a file object over a preallocated numpy buffer, pyarrow ->
      ``pa.FixedSizeBufferWriter`` over a preallocated buffer).

The ratio column is dissoc time / pyarrow time: below 1 dissoc is faster, above 1 slower. Targets: encode
within 3x pyarrow's serialize(); decode with its checks no slower than pyarrow's read + full validation,
decode without checks within 3x pyarrow's bare read; reading and writing 1 GiB within 1.5x pyarrow.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as paipc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dissoc import codec
from dissoc.codec import jit

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Row:
    name: str
    unit: str  # "us/msg" or "GB/s"
    dissoc_s: float  # median seconds per operation
    pyarrow_s: float
    nbytes: int = 0  # bytes moved per operation (throughput rows)
    target: float | None = None  # maximum allowed ratio

    @property
    def ratio(self) -> float:
        return self.dissoc_s / self.pyarrow_s

    def value(self, seconds: float) -> float:
        return seconds * 1e6 if self.unit == "us/msg" else self.nbytes / seconds / 1e9

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        return "ok" if self.ratio <= self.target else "MISSED"


# --------------------------------------------------------------------------------------------------
# data


def mixed_batch(columns: int, rows: int, seed: int = 0) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    arrays: dict[str, pa.Array] = {}
    for c in range(columns):
        mask = rng.random(rows) < 0.1
        kind = c % 5
        if kind == 0:
            arr = pa.array(rng.integers(0, 1 << 40, rows), mask=mask)
        elif kind == 1:
            arr = pa.array(rng.random(rows), mask=mask)
        elif kind == 2:
            arr = pa.array([f"v{int(x)}" for x in rng.integers(0, 1000, rows)], mask=mask)
        elif kind == 3:
            arr = pa.array(rng.random(rows) < 0.5, mask=mask)
        else:
            offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 4, rows))]).astype(np.int32)
            values = pa.array(rng.integers(0, 100, int(offsets[-1]), dtype=np.int32))
            arr = pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(mask))
        arrays[f"c{c}"] = arr
    return pa.record_batch(arrays)


def bulk_batch(nbytes: int, seed: int = 1) -> pa.RecordBatch:
    """About ``nbytes`` of int64 / float64 / string / list<int32> with nulls (~52 bytes a row)."""
    rng = np.random.default_rng(seed)
    rows = nbytes // 52
    valid = rng.random(rows) > 0.05
    lengths = rng.integers(0, 24, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    chars = rng.integers(97, 123, int(offsets[-1]), dtype=np.uint8)
    strings = pa.Array.from_buffers(
        pa.string(), rows, [pa.array(valid).buffers()[1], pa.py_buffer(offsets), pa.py_buffer(chars)]
    )
    loffsets = np.concatenate([[0], np.cumsum(rng.integers(0, 8, rows))]).astype(np.int32)
    lists = pa.ListArray.from_arrays(
        pa.array(loffsets), pa.array(rng.integers(0, 1000, int(loffsets[-1]), dtype=np.int32))
    )
    return pa.record_batch(
        {
            "i": pa.array(rng.integers(0, 1 << 62, rows), mask=~valid),
            "f": pa.array(rng.random(rows)),
            "s": strings,
            "l": lists,
        }
    )


# --------------------------------------------------------------------------------------------------
# timing


def calls_per_round(fn: Callable[[], Any], min_time: float) -> int:
    """How many calls of ``fn`` (after one warm-up call) take at least ``min_time`` seconds (up to 2**20)."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= min_time or n >= 1 << 20:
            return n
        n *= 4


def per_call(fn: Callable[[], Any], repeat: int, min_time: float = 0.1) -> float:
    """Median seconds per call over ``repeat`` rounds, each round long enough to time reliably."""
    n = calls_per_round(fn, min_time / 4)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def once(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of single calls (for the bulk operations)."""
    samples = []
    fn()  # warm-up: page faults, allocator
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# --------------------------------------------------------------------------------------------------
# (a) + (b): per-message metadata costs


def int64_batch(rows: int = 1024) -> pa.RecordBatch:
    """Two int64 columns without nulls: the simplest batch."""
    return pa.record_batch({"a": pa.array(np.arange(rows)), "b": pa.array(np.arange(rows)[::-1].copy())})


def bench_encode(repeat: int) -> list[Row]:
    rows = []
    for name, batch in [
        ("3 columns", mixed_batch(3, 1024)),
        ("100 columns", mixed_batch(100, 1024)),
        ("2 x int64 1024 rows", int64_batch()),
    ]:
        enc = codec.MessageEncoder(batch.schema)
        encode_d = per_call(lambda enc=enc, batch=batch: enc.encode(batch), repeat)
        serialize = per_call(batch.serialize, repeat)
        writer = paipc.new_stream(pa.MockOutputStream(), batch.schema)
        write_batch = per_call(lambda writer=writer, batch=batch: writer.write_batch(batch), repeat)
        rows.append(Row(f"(a) encode, {name} vs serialize()", "us/msg", encode_d, serialize, target=3.0))
        rows.append(Row(f"(a) encode, {name} vs MockOutputStream writer", "us/msg", encode_d, write_batch))
    return rows


def bench_decode(
    batch: pa.RecordBatch, what: str, repeat: int, checked_target: float | None = 1.0
) -> list[Row]:
    """Decoding one message of ``batch`` again and again (its metadata repeats, as in a stream)."""
    schema = batch.schema
    enc = codec.MessageEncoder(schema)
    (msg,) = enc.encode(batch)
    metadata = bytes(msg.metadata)
    body = b"".join(memoryview(b).cast("B") for b in msg.body_buffers)
    checked = codec.MessageDecoder()
    trusting = codec.MessageDecoder(validate=False)
    for dec in (checked, trusting):
        dec.decode(enc.schema_message().metadata, b"")
    # the landed variant: the body as a receiver lands it, after room for the framing
    room = codec.frame_room(len(metadata))
    landing = pa.allocate_buffer(room + len(body))
    np.frombuffer(landing, np.uint8)[room:] = np.frombuffer(body, np.uint8)
    framed = batch.serialize()

    def read_p() -> pa.RecordBatch:
        return paipc.read_record_batch(paipc.read_message(framed), schema)

    def read_validate_p() -> None:
        read_p().validate(full=True)

    fns = {
        "bare": read_p,
        "full": read_validate_p,
        "decode": lambda: checked.decode(metadata, body),
        "decode_nv": lambda: trusting.decode(metadata, body),
        "landed": lambda: checked.decode_landed(metadata, landing),
        "landed_nv": lambda: trusting.decode_landed(metadata, landing),
    }
    # the client's path for layouts with nothing in the body to check: framing and body in a slab, one read
    # of an immutable slice of it (MessageDecoder.landing)
    checked.decode_landed(metadata, landing)
    plain = checked.landing(metadata)
    if plain is not None:
        slab = pa.allocate_buffer(4096 + plain.room + len(body))
        slab_bytes = np.frombuffer(slab, np.uint8)
        slab_bytes[4096 : 4096 + plain.room] = np.frombuffer(plain.head, np.uint8)
        slab_bytes[4096 + plain.room :] = np.frombuffer(body, np.uint8)
        fns["landing"] = lambda: plain.read(slab.slice(4096, plain.room + len(body)))
    m = interleaved(fns, repeat)
    extra = []
    if plain is not None:
        extra.append(Row(f"(b) Landing.read {what}, checked / pa read", "us/msg", m["landing"], m["bare"]))
    return [
        *extra,
        Row(f"(b) decode {what}, checked / pa+validate(full)", "us/msg", m["decode"], m["full"],
            target=checked_target),
        Row(f"(b) decode {what}, validate=False / pa read", "us/msg", m["decode_nv"], m["bare"], target=3.0),
        Row(f"(b) decode_landed {what}, checked / pa+validate(full)", "us/msg", m["landed"], m["full"],
            target=checked_target),
        Row(f"(b) decode_landed {what}, validate=False / pa read", "us/msg", m["landed_nv"], m["bare"],
            target=3.0),
    ]  # fmt: skip


def interleaved(fns: dict[str, Callable[[], Any]], repeat: int, min_time: float = 0.01) -> dict[str, float]:
    """Median seconds per call of each function, timed in alternating rounds (3 x ``repeat`` each), so that
    load from elsewhere on the machine falls on the dissoc and pyarrow sides alike."""
    counts = {name: calls_per_round(fn, min_time) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(3 * repeat):
        for name, fn in fns.items():
            n = counts[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(v) for name, v in samples.items()}


# --------------------------------------------------------------------------------------------------
# (c) + (d): bulk stream read and write


class PreallocatedSink(io.RawIOBase):
    """A binary file object that copies writes into a preallocated buffer (like FixedSizeBufferWriter)."""

    def __init__(self, size: int) -> None:
        self.buf = np.empty(size, dtype=np.uint8)
        self.view = self.buf.data
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        self.view[self.pos : self.pos + n] = mv
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def reset(self) -> None:
        self.pos = 0


def bench_bulk(total: int, batch_bytes: int, repeat: int) -> list[Row]:
    batch = bulk_batch(batch_bytes)
    count = max(1, total // batch.nbytes)
    schema = batch.schema

    out = pa.BufferOutputStream()
    with paipc.new_stream(out, schema) as w:
        for _ in range(count):
            w.write_batch(batch)
    stream = out.getvalue()
    size = stream.size

    def read_d() -> None:
        codec.open_stream(stream).read_all()

    def read_p() -> None:
        paipc.open_stream(stream).read_all()

    rows = [
        Row(
            f"(c) read {size / GiB:.2f} GiB stream from memory",
            "GB/s",
            once(read_d, repeat),
            once(read_p, repeat),
            size,
            1.5,
        )
    ]

    def write_d_growing() -> None:
        sink = io.BytesIO()
        with codec.new_stream(sink, schema) as w:
            for _ in range(count):
                w.write_batch(batch)

    def write_p_growing() -> None:
        sink = pa.BufferOutputStream()
        with paipc.new_stream(sink, schema) as w:
            for _ in range(count):
                w.write_batch(batch)

    rows.append(
        Row(
            f"(d) write {size / GiB:.2f} GiB stream, growing memory sink",
            "GB/s",
            once(write_d_growing, repeat),
            once(write_p_growing, repeat),
            size,
            1.5,
        )
    )

    def write_d_same_sink() -> None:
        sink = pa.BufferOutputStream()
        with codec.new_stream(sink, schema) as w:
            for _ in range(count):
                w.write_batch(batch)

    try:
        same_sink = once(write_d_same_sink, repeat)
    except Exception as exc:  # the sink contract only promises paths and binary file objects
        print(
            f"note: dissoc cannot write into pa.BufferOutputStream ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
    else:
        rows.append(
            Row(
                f"(d) write {size / GiB:.2f} GiB stream, both into pa.BufferOutputStream",
                "GB/s",
                same_sink,
                rows[-1].pyarrow_s,
                size,
                1.5,
            )
        )

    mine = PreallocatedSink(size + MiB)
    theirs = pa.allocate_buffer(size + MiB, resizable=False)

    def write_d_fixed() -> None:
        mine.reset()
        with codec.new_stream(mine, schema) as w:
            for _ in range(count):
                w.write_batch(batch)

    def write_p_fixed() -> None:
        sink = pa.FixedSizeBufferWriter(theirs)
        with paipc.new_stream(sink, schema) as w:
            for _ in range(count):
                w.write_batch(batch)

    rows.append(
        Row(
            f"(d) write {size / GiB:.2f} GiB stream, preallocated sink",
            "GB/s",
            once(write_d_fixed, repeat),
            once(write_p_fixed, repeat),
            size,
            1.5,
        )
    )
    check = paipc.open_stream(pa.py_buffer(mine.buf[: mine.pos])).read_all()
    assert check.num_rows == count * batch.num_rows, "dissoc's stream does not read back through pyarrow"
    return rows


def memcpy_ceiling(repeat: int) -> float:
    src = np.ones(64 * MiB, dtype=np.uint8)
    dst = np.empty_like(src)
    t = once(lambda: np.copyto(dst, src), repeat)
    return src.nbytes / t / 1e9


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="128 MiB in 4 MiB batches instead of 1 GiB in 16 MiB"
    )
    ap.add_argument("--repeat", type=int, default=5, help="repetitions per measurement (median reported)")
    ap.add_argument("--json", action="store_true", help="print machine-readable results")
    args = ap.parse_args(argv)
    total, batch_bytes = (128 * MiB, 4 * MiB) if args.quick else (GiB, 16 * MiB)

    # steady state: the compiled check of narrow string batches (numba, where installed) is made before any
    # timing, rather than on a thread of its own during the first decodes
    check = "compiled (numba)" if jit.compile_now() is not None else f"pyarrow's route (jit: {jit.state()})"
    started = time.perf_counter()
    rows = bench_encode(args.repeat)
    int64x2 = pa.record_batch({"a": np.arange(1024, dtype=np.int64), "b": np.arange(1024, dtype=np.int64)})
    rows += bench_decode(int64x2, "2 x int64", args.repeat, checked_target=None)
    rows += bench_decode(mixed_batch(3, 1024), "3 cols", args.repeat)
    rows += bench_decode(mixed_batch(100, 1024), "100 cols", args.repeat)
    rows += bench_bulk(total, batch_bytes, args.repeat)
    ceiling = memcpy_ceiling(args.repeat)
    elapsed = time.perf_counter() - started

    if args.json:
        print(
            json.dumps(
                {
                    "pyarrow": pa.__version__,
                    "repeat": args.repeat,
                    "quick": args.quick,
                    "memcpy_gbps": ceiling,
                    "binary_check": check,
                    "seconds": elapsed,
                    "results": [
                        {
                            **asdict(r),
                            "ratio": r.ratio,
                            "unit": r.unit,
                            "dissoc": r.value(r.dissoc_s),
                            "pyarrow_value": r.value(r.pyarrow_s),
                            "verdict": r.verdict,
                        }
                        for r in rows
                    ],
                },
                indent=2,
            )
        )
    else:
        print(
            f"dissoc codec vs pyarrow {pa.__version__}; median of {args.repeat}; "
            f"ratio = dissoc time / pyarrow time (lower is better for dissoc, < 1 means dissoc is faster); "
            f"narrow string batches checked by the {check}"
        )
        head = f"{'measurement':<62} {'dissoc':>12} {'pyarrow':>12} {'unit':>7} {'ratio':>7}  target"
        print(head)
        print("-" * len(head))
        for r in rows:
            target = f"<= {r.target:g}x {r.verdict}" if r.target is not None else ""
            print(
                f"{r.name:<62} {r.value(r.dissoc_s):>12.2f} {r.value(r.pyarrow_s):>12.2f} {r.unit:>7} "
                f"{r.ratio:>7.2f}  {target}"
            )
        print(f"numpy copy of 64 MiB (memory-bandwidth ceiling for one copy): {ceiling:.1f} GB/s")
        print(f"total {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
