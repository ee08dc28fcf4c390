"""Helpers shared by the tests that speak dissoc's UCX wire with ucxx alone (no dissoc client, transport,
protocol or codec code): ucxx's low-level module and a context for raw clients, reading the IPC ``Message``
flatbuffer by hand, gathering a pair list's body from a shared-memory segment, and running a server in a
child process."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import struct
import subprocess
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from helpers.e2e import PYTHON, REPO, read_lines

__all__ = [
    "BODY_PACKED",
    "BODY_PAIRS",
    "KIND_EOS",
    "KIND_ERROR",
    "KIND_METADATA",
    "RESERVED_BITS",
    "SEQ_MASK",
    "SPLIT_STREAM",
    "plain_table",
    "as_bytes",
    "child_server",
    "gather_pairs",
    "message_fields",
    "ucx_array",
    "ucx_context",
    "ucxx_lib",
]


def ucxx_lib() -> Any:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as libucxx

    return libucxx


def ucx_array(obj: Any) -> Any:
    from ucxx._lib.arr import Array

    return Array(obj)


_context: Any = None


def ucx_context() -> Any:
    global _context
    if _context is None:
        lib = ucxx_lib()
        _context = lib.UCXContext({}, (lib.Feature.TAG, lib.Feature.AM))
    return _context


def as_bytes(buffer: Any) -> bytes:
    if buffer is None:
        return b""
    return bytes(memoryview(buffer).cast("B"))


def _field(buf: bytes, table: int, field: int) -> int:
    """Absolute position of a flatbuffer table's field, or 0 if absent (vtable slot of field i at 4 + 2 i)."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    at = 4 + 2 * field
    if at >= struct.unpack_from("<H", buf, vtable)[0]:
        return 0
    offset = struct.unpack_from("<H", buf, vtable + at)[0]
    return table + offset if offset else 0


def _deref(buf: bytes, pos: int) -> int:
    offset: int = struct.unpack_from("<I", buf, pos)[0]
    return pos + offset


def message_fields(metadata: bytes) -> tuple[int, int, list[tuple[int, int]]]:
    """(header_type, bodyLength, the RecordBatch's buffers as (offset, length)) of an Arrow ``Message``
    flatbuffer, per spec/FACTS.md section 1: Message{version 0, header_type 1, header 2, bodyLength 3},
    DictionaryBatch{id 0, data 1}, RecordBatch{length 0, nodes 1, buffers 2 (16-byte structs)}."""
    message = _deref(metadata, 0)
    at = _field(metadata, message, 1)
    header_type = metadata[at] if at else 0
    at = _field(metadata, message, 3)
    body_length = struct.unpack_from("<q", metadata, at)[0] if at else 0
    buffers: list[tuple[int, int]] = []
    if header_type in (2, 3):
        batch = _deref(metadata, _field(metadata, message, 2))
        if header_type == 2:
            batch = _deref(metadata, _field(metadata, batch, 1))
        at = _field(metadata, batch, 2)
        if at:
            vector = _deref(metadata, at)
            count = struct.unpack_from("<I", metadata, vector)[0]
            buffers = [struct.unpack_from("<qq", metadata, vector + 4 + 16 * i) for i in range(count)]
    return header_type, body_length, buffers


def gather_pairs(
    message: bytes, buffers: list[tuple[int, int]], body_length: int, shm: mmap.mmap, offsets: list[int]
) -> bytes:
    """Body type 1: u64 total, u64 count, then one (offset, length) pair per entry of ``buffers``."""
    total, count = struct.unpack_from("<QQ", message)
    assert len(message) == 16 + 16 * count, "the pair list's size matches its count"
    assert count == len(buffers), "one pair per entry of the RecordBatch's buffers"
    pairs = [struct.unpack_from("<QQ", message, 16 + 16 * i) for i in range(count)]
    assert total == sum(length for _, length in pairs)
    body = bytearray(body_length)
    for (offset, length), (at, size) in zip(pairs, buffers, strict=True):
        assert length == size, "a pair's length is its buffer's length"
        if length == 0:
            assert offset == 0, "an empty buffer is the pair (0, 0)"
            continue
        assert offset + length <= len(shm), "a pair lies inside the segment"
        body[at : at + length] = shm[offset : offset + length]
        offsets.append(offset)
    return bytes(body)


@contextlib.contextmanager
def child_server(argv: list[str], count: int) -> Iterator[tuple[Any, list[dict[str, Any]]]]:
    """Run ``python ARGV`` (a server printing ``count`` JSON lines when ready); yield the process and the
    lines. On exit it is stopped with SIGTERM (unless the test did) and must have exited with status 0."""
    proc = subprocess.Popen([PYTHON, *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = [json.loads(line) for line in read_lines(proc, count, 30)]
        yield proc, lines
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, f"status {proc.returncode}: {err.decode(errors='replace')[-2000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


# The wire's constants (spec/dissociated-ipc.txt, FACTS.md section 4, DESIGN.md section 3), restated on
# purpose: the tests that speak the wire with ucxx alone take them from here, not from dissoc, so that a
# change to them there is a wire change and fails those tests.
KIND_EOS = 0x00
KIND_METADATA = 0x01
KIND_ERROR = 0xE0
BODY_PACKED = 0
BODY_PAIRS = 1
SEQ_MASK = 0x00000000FFFFFFFF
RESERVED_BITS = 0x00FFFFFF00000000

#: ``split_stream(path)`` for the child scripts that serve the Dissociated IPC wire with pyarrow and ucxx
#: alone (they import ``struct`` and ``pyarrow as pa`` themselves): the file's table as an IPC stream, cut
#: into (metadata, body) at its encapsulation boundaries.
SPLIT_STREAM = '''
def split_stream(path):
    """The file's table as an IPC stream, cut into (metadata, body) at its encapsulation boundaries:
    0xFFFFFFFF, int32 metadata length (padded to 8), the metadata, the body (its length from the
    message)."""
    with pa.memory_map(path) as source:
        table = pa.ipc.open_file(source).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    stream = sink.getvalue().to_pybytes()
    out, pos = [], 0
    while True:
        marker, length = struct.unpack_from("<Ii", stream, pos)
        assert marker == 0xFFFFFFFF
        if length == 0:
            return out
        metadata = stream[pos + 8 : pos + 8 + length]
        message = pa.ipc.read_message(pa.py_buffer(stream[pos:]))
        size = 0 if message.body is None else message.body.size
        out.append((metadata, stream[pos + 8 + length : pos + 8 + length + size]))
        pos += 8 + length + size
'''


def plain_table() -> pa.Table:
    """8 batches of 8192 rows of (int64, float64): 1 MiB of buffers, 128 KiB bodies (UCX rendezvous)."""
    batches = [
        pa.record_batch(
            {
                "id": pa.array(range(b * 8192, (b + 1) * 8192), pa.int64()),
                "x": pa.array([i * 0.25 for i in range(b * 8192, (b + 1) * 8192)], pa.float64()),
            }
        )
        for b in range(8)
    ]
    return pa.Table.from_batches(batches)
