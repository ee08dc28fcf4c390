"""The encapsulated message framing, and the IPC stream and file formats, read and write.

Readers accept bytes-like objects (read without copying), paths (memory-mapped) and binary file objects (read
incrementally, each body straight into an aligned buffer).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from types import TracebackType
from typing import IO, Any, TypeAlias, cast

import flatbuffers
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from dissoc.buffers import aligned_empty
from dissoc.codec.decoder import MessageDecoder
from dissoc.codec.encoder import EncodedMessage, MessageEncoder
from dissoc.codec.fb import root_table
from dissoc.codec.message import HeaderType, ParsedMessage, parse, parse_message
from dissoc.codec.schema import decode_schema, encode_schema
from dissoc.errors import CodecError

__all__ = [
    "FileReader",
    "FileWriter",
    "StreamReader",
    "StreamWriter",
    "frame_prefix",
    "iter_messages",
    "open_file",
    "open_stream",
    "new_file",
    "new_stream",
]

CONTINUATION = 0xFFFFFFFF
MAGIC = b"ARROW1"
EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
MAX_METADATA = 1 << 30

#: What the readers accept: bytes-like data (read without copying), a path (memory-mapped) or a binary file
#: object (read incrementally).
Source: TypeAlias = bytes | bytearray | memoryview | pa.Buffer | str | os.PathLike[str] | IO[bytes]
#: What the writers accept: a path or a binary file object.
Sink: TypeAlias = str | os.PathLike[str] | IO[bytes]


def frame_prefix(metadata_len: int) -> tuple[bytes, int]:
    """The 8-byte encapsulation prefix and the padding after ``metadata_len`` bytes of flatbuffer."""
    pad = (-(metadata_len + 8)) % 8
    return b"\xff\xff\xff\xff" + _I32.pack(metadata_len + pad), pad


# --------------------------------------------------------------------------------------------------- sources


def _buffer_source(source: Source) -> pa.Buffer | None:
    """A zero-copy pa.Buffer over ``source`` when it is bytes-like or a path; None for file objects."""
    if isinstance(source, pa.Buffer):
        return source
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return pa.py_buffer(b"")
                return pa.py_buffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except OSError as e:
            raise CodecError(f"cannot open {os.fspath(source)!r}: {e.strerror}") from None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return pa.py_buffer(source)
    if hasattr(source, "read"):
        return None
    try:
        return pa.py_buffer(source)
    except TypeError:
        raise CodecError(
            f"source must be bytes-like, a path or a binary file object, got {type(source).__name__}"
        ) from None


class _Messages:
    """Yields (parsed message, body) from framed IPC messages in a buffer or a file object."""

    def __init__(self, source: Source, start: int = 0) -> None:
        self.buf = _buffer_source(source)
        self.file: IO[bytes] | None = None if self.buf is not None else cast(IO[bytes], source)
        self.view = memoryview(self.buf) if self.buf is not None else None
        self.pos = start

    def _read(self, n: int) -> bytes:
        assert self.file is not None
        try:
            data = self.file.read(n)
        except OSError as e:
            raise CodecError(f"reading the stream failed: {e}") from None
        return data or b""

    def next(self) -> tuple[ParsedMessage, bytes | memoryview, pa.Buffer] | None:
        """The next message, or None at end of stream."""
        if self.view is not None:
            return self._next_from_buffer()
        return self._next_from_file()

    def _next_from_buffer(self) -> tuple[ParsedMessage, bytes | memoryview, pa.Buffer] | None:
        assert self.buf is not None
        item = _message_at(self.buf, self.pos, self.buf.size)
        if item is None:
            self.pos = min(self.pos + 8, self.buf.size)
            return None
        msg, meta, body, end = item
        self.pos = end
        return msg, meta, body

    def _next_from_file(self) -> tuple[ParsedMessage, bytes | memoryview, pa.Buffer] | None:
        head = self._read(4)
        if len(head) == 0:
            return None
        if len(head) < 4:
            raise CodecError(f"stream: truncated message prefix ({len(head)} of 4 bytes)")
        first = _U32.unpack(head)[0]
        if first == CONTINUATION:
            more = self._read(4)
            if len(more) < 4:
                raise CodecError("stream: truncated message length")
            size = _I32.unpack(more)[0]
        else:
            size = _I32.unpack(head)[0]
        if size == 0:
            return None
        if size < 0 or size > MAX_METADATA:
            raise CodecError(f"stream: message declares {size} bytes of metadata")
        meta = self._read(size)
        if len(meta) < size:
            raise CodecError(f"stream: truncated metadata ({len(meta)} of {size} bytes)")
        msg = parse(meta)
        blen = msg.body_length
        body = aligned_empty(blen)
        got = 0
        assert self.file is not None
        readinto = getattr(self.file, "readinto", None)
        while got < blen:
            if readinto is not None:
                k = readinto(body[got:].data)
            else:
                chunk = self._read(min(blen - got, 1 << 24))
                k = len(chunk)
                body[got : got + k] = np.frombuffer(chunk, np.uint8)
            if not k:
                raise CodecError(f"stream: truncated body ({got} of {blen} bytes)")
            got += k
        return msg, meta, pa.py_buffer(body)


def _message_at(
    buf: pa.Buffer, pos: int, limit: int, full: bool = True, cache: dict[bytes, ParsedMessage] | None = None
) -> tuple[ParsedMessage, memoryview, pa.Buffer, int] | None:
    """The framed message at ``pos`` of ``buf`` (which must end by ``limit``); None at end of stream."""
    view = memoryview(buf)
    n = limit
    if pos + 4 > n:
        if pos != n:
            raise CodecError(f"stream: {n - pos} stray bytes at offset {pos}, expected a message or the end")
        return None
    first = _U32.unpack_from(view, pos)[0]
    hdr = 4
    if first == CONTINUATION:
        if pos + 8 > n:
            raise CodecError(f"stream: truncated message length at offset {pos}")
        size = _I32.unpack_from(view, pos + 4)[0]
        hdr = 8
    else:
        size = _I32.unpack_from(view, pos)[0]
    if size == 0:
        return None
    if size < 0 or size > MAX_METADATA or pos + hdr + size > n:
        raise CodecError(
            f"stream: message at offset {pos} declares {size} bytes of metadata, {n - pos - hdr} remain"
        )
    meta = view[pos + hdr : pos + hdr + size]
    if full:
        msg = parse(meta)
    elif cache is not None:
        key = bytes(meta)
        hit = cache.get(key)
        if hit is None:
            hit = ParsedMessage(parse_message(meta))
            if len(cache) < 64:
                cache[key] = hit
        msg = hit
    else:
        msg = ParsedMessage(parse_message(meta))
    body_start = pos + hdr + size
    blen = msg.body_length
    if blen > n - body_start:
        raise CodecError(
            f"stream: message at offset {pos} declares a {blen}-byte body, {n - body_start} bytes remain"
        )
    return msg, meta, buf.slice(body_start, blen), body_start + blen


# --------------------------------------------------------------------------------------------------- readers


class StreamReader:
    """Reads an IPC stream: iterate it for ``pa.RecordBatch``; ``.schema``; ``.read_all()``."""

    def __init__(self, source: Source, *, validate: bool = True) -> None:
        self._messages = _Messages(source)
        self._decoder = MessageDecoder(validate=validate)
        first = self._messages.next()
        if first is None:
            raise CodecError("stream: ended before its Schema message")
        msg, _, _ = first
        if msg.header_type != HeaderType.Schema:
            raise CodecError(
                f"stream: the first message must be a Schema, got {HeaderType(msg.header_type).name}"
            )
        self._decoder.decode_parsed(msg)
        self._done = False

    @property
    def schema(self) -> pa.Schema:
        s = self._decoder.schema
        assert s is not None
        return s

    def read_next_batch(self) -> pa.RecordBatch:
        """The next batch; raises StopIteration at the end of the stream."""
        while not self._done:
            item = self._messages.next()
            if item is None:
                self._done = True
                break
            msg, _, body = item
            batch = self._decoder.decode_parsed(msg, body)
            if batch is not None:
                return batch
        raise StopIteration

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        while True:
            try:
                yield self.read_next_batch()
            except StopIteration:
                return

    def read_all(self) -> pa.Table:
        return pa.Table.from_batches(list(self), schema=self.schema)

    def __enter__(self) -> StreamReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._done = True


def _blocks(raw: memoryview | None) -> npt.NDArray[np.int64]:
    if raw is None:
        return np.zeros((0, 3), np.int64)
    a = np.frombuffer(raw, "<i8").reshape(-1, 3).copy()
    a[:, 1] = a[:, 1] & 0xFFFFFFFF
    a[:, 1] = np.where(a[:, 1] >= 1 << 31, a[:, 1] - (1 << 32), a[:, 1])
    return a


class FileReader:
    """Reads an IPC file: ``.schema``, ``.num_record_batches``, ``.get_batch(i)``, ``.read_all()``."""

    def __init__(self, source: Source, *, validate: bool = True) -> None:
        buf = _buffer_source(source)
        if buf is None:
            try:
                buf = pa.py_buffer(cast(IO[bytes], source).read())
            except OSError as e:
                raise CodecError(f"reading the file failed: {e}") from None
        self._buf = buf
        view = memoryview(buf)
        n = len(view)
        if n < 8 + 6 + 4 + 6 or bytes(view[:6]) != MAGIC or bytes(view[n - 6 :]) != MAGIC:
            raise CodecError(
                f"file: expected {MAGIC!r} at both ends of a file of at least 24 bytes ({n} bytes)"
            )
        footer_len = _I32.unpack_from(view, n - 10)[0]
        if footer_len <= 0 or footer_len > n - 18:
            raise CodecError(f"file: footer length {footer_len} does not fit in a {n}-byte file")
        footer = view[n - 10 - footer_len : n - 10]
        t = root_table(footer, "Footer")
        st = t.table(1, "Schema")
        if st is None:
            raise CodecError("file: the footer has no schema")
        version = t.scalar(0, "h", 4)
        self._decoder = MessageDecoder(validate=validate, allow_dictionary_replacement=False)
        self._decoder.set_schema(decode_schema(st, version), version)
        self._dict_blocks = _blocks(t.vector_bytes(2, 24))
        self._batch_blocks = _blocks(t.vector_bytes(3, 24))
        self._limit = n - 10 - footer_len
        self._dicts_loaded = False

    @property
    def schema(self) -> pa.Schema:
        s = self._decoder.schema
        assert s is not None
        return s

    @property
    def num_record_batches(self) -> int:
        return len(self._batch_blocks)

    def _message(self, block: npt.NDArray[np.int64], what: str) -> tuple[ParsedMessage, pa.Buffer]:
        off, meta_len, body_len = (int(x) for x in block)
        if off < 8 or meta_len < 8 or body_len < 0 or off + meta_len + body_len > self._limit:
            raise CodecError(
                f"file: {what} block (offset {off}, metadata {meta_len}, body {body_len}) lies outside the "
                f"{self._limit} bytes before the footer"
            )
        item = _message_at(self._buf, off, self._limit)
        if item is None:
            raise CodecError(f"file: {what} block at offset {off} holds an end-of-stream marker")
        msg, _, body, end = item
        if msg.body_length != body_len or end != off + meta_len + body_len:
            raise CodecError(
                f"file: {what} block (metadata {meta_len}, body {body_len} bytes) disagrees with its message "
                f"(ends at {end}, body {msg.body_length} bytes)"
            )
        return msg, body

    def _load_dictionaries(self) -> None:
        if self._dicts_loaded:
            return
        for i, block in enumerate(self._dict_blocks):
            msg, body = self._message(block, f"dictionary {i}")
            if msg.header_type != HeaderType.DictionaryBatch:
                raise CodecError(
                    f"file: dictionary block {i} holds a {HeaderType(msg.header_type).name} message"
                )
            self._decoder.decode_parsed(msg, body)
        self._dicts_loaded = True

    def get_batch(self, i: int) -> pa.RecordBatch:
        """Batch ``i`` (random access)."""
        n = self.num_record_batches
        if not -n <= i < n:
            raise IndexError(f"batch index {i} out of range for {n} batches")
        self._load_dictionaries()
        msg, body = self._message(self._batch_blocks[i], f"record batch {i}")
        if msg.header_type != HeaderType.RecordBatch:
            raise CodecError(
                f"file: record batch block {i} holds a {HeaderType(msg.header_type).name} message"
            )
        batch = self._decoder.decode_parsed(msg, body)
        assert batch is not None
        return batch

    get_record_batch = get_batch

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        for i in range(self.num_record_batches):
            yield self.get_batch(i)

    def read_all(self) -> pa.Table:
        return pa.Table.from_batches(list(self), schema=self.schema)

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


# --------------------------------------------------------------------------------------------------- writers


class _Sink:
    def __init__(self, sink: Sink) -> None:
        self.f: IO[bytes]
        if isinstance(sink, (str, os.PathLike)):
            self.owned = True
            self.f = open(sink, "wb")  # noqa: SIM115
        else:
            self.owned = False
            self.f = sink
        if not hasattr(self.f, "write"):
            raise TypeError(f"sink must be a path or a binary file object, got {type(sink).__name__}")
        self.pos = 0

    def write(self, data: Any) -> None:
        """Write bytes or a body buffer (any buffer: see :attr:`EncodedMessage.body_buffers`)."""
        n = self.f.write(data)
        self.pos += n if isinstance(n, int) else memoryview(data).nbytes

    def close(self) -> None:
        if self.owned:
            self.f.close()
        elif hasattr(self.f, "flush"):
            self.f.flush()


class StreamWriter:
    """Writes an IPC stream; ``write_batch``, ``write_table``, ``close`` (writes the end-of-stream marker)."""

    _allow_replacement = True

    def __init__(
        self,
        sink: Sink,
        schema: pa.Schema,
        *,
        compression: str | None = None,
        emit_dictionary_deltas: bool = False,
    ) -> None:
        self._encoder = MessageEncoder(
            schema,
            compression=compression,
            emit_dictionary_deltas=emit_dictionary_deltas,
            allow_dictionary_replacement=self._allow_replacement,
        )
        self._sink = _Sink(sink)
        self._closed = False
        self._start()
        self._write_message(self._encoder.schema_message())

    @property
    def schema(self) -> pa.Schema:
        return self._encoder.schema

    def _start(self) -> None:
        pass

    def _write_message(self, m: EncodedMessage) -> tuple[int, int, int]:
        """Write one framed message; (offset, metadata length incl. prefix, body length)."""
        start = self._sink.pos
        prefix, pad = frame_prefix(len(m.metadata))
        w = self._sink.write
        w(prefix + m.metadata + b"\x00" * pad)
        for b in m.body_buffers:
            w(b)
        return start, len(prefix) + len(m.metadata) + pad, m.body_length

    def _record(self, kind: int, block: tuple[int, int, int]) -> None:
        pass

    def write_batch(self, batch: pa.RecordBatch) -> None:
        if self._closed:
            raise CodecError("write_batch on a closed writer")
        for m in self._encoder.encode(batch):
            self._record(m.header_type, self._write_message(m))

    write = write_batch

    def write_table(self, table: pa.Table, max_chunksize: int | None = None) -> None:
        for batch in table.to_batches(max_chunksize):
            self.write_batch(batch)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sink.write(EOS)
        self._finish()
        self._sink.close()

    def _finish(self) -> None:
        pass

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class FileWriter(StreamWriter):
    """Writes an IPC file (magic, stream, footer with blocks, magic)."""

    _allow_replacement = False

    def _start(self) -> None:
        self._dict_blocks: list[tuple[int, int, int]] = []
        self._batch_blocks: list[tuple[int, int, int]] = []
        self._sink.write(MAGIC + b"\x00\x00")

    def _record(self, kind: int, block: tuple[int, int, int]) -> None:
        (self._batch_blocks if kind == HeaderType.RecordBatch else self._dict_blocks).append(block)

    def _finish(self) -> None:
        b = flatbuffers.Builder(1024)
        schema = encode_schema(b, self._encoder.schema, self._encoder.ids)
        vecs = []
        for blocks in (self._dict_blocks, self._batch_blocks):
            b.StartVector(24, len(blocks), 8)
            for off, meta, body in reversed(blocks):
                b.Prep(8, 24)
                b.PrependInt64(body)
                b.Pad(4)
                b.PrependInt32(meta)
                b.PrependInt64(off)
            vecs.append(b.EndVector())
        b.StartObject(5)
        b.PrependInt16Slot(0, 4, -1)
        b.PrependUOffsetTRelativeSlot(1, schema, 0)
        b.PrependUOffsetTRelativeSlot(2, vecs[0], 0)
        b.PrependUOffsetTRelativeSlot(3, vecs[1], 0)
        b.Finish(b.EndObject())
        footer = bytes(b.Output())
        self._sink.write(footer)
        self._sink.write(_I32.pack(len(footer)))
        self._sink.write(MAGIC)


# --------------------------------------------------------------------------------------------------- API


def iter_messages(
    source: Source, *, file_format: bool = False
) -> Iterator[tuple[ParsedMessage, memoryview, pa.Buffer]]:
    """The framed messages of a stream (or of the stream inside an IPC file), as stored: no decoding.

    Yields (parsed header, metadata flatbuffer, body) with the body a zero-copy slice of ``source``; this is
    what lets a server forward stored IPC data without decoding and re-encoding it.
    """
    buf = _buffer_source(source)
    if buf is None:
        raise CodecError("iter_messages needs bytes-like data or a path, not a file object")
    pos = 0
    if file_format:
        if buf.size < 8 or bytes(memoryview(buf)[:6]) != MAGIC:
            raise CodecError(f"file: expected {MAGIC!r} at the start")
        pos = 8
    cache: dict[bytes, ParsedMessage] = {}  # stored streams repeat their batch metadata byte for byte
    while True:
        item = _message_at(buf, pos, buf.size, full=False, cache=cache)
        if item is None:
            return
        msg, meta, body, pos = item
        yield msg, meta, body


def open_stream(source: Source, *, validate: bool = True) -> StreamReader:
    """Open an IPC stream (bytes-like, path or binary file object) for reading."""
    return StreamReader(source, validate=validate)


def open_file(source: Source, *, validate: bool = True) -> FileReader:
    """Open an IPC file (bytes-like, path or binary file object) for random access."""
    return FileReader(source, validate=validate)


def new_stream(
    sink: Sink, schema: pa.Schema, *, compression: str | None = None, emit_dictionary_deltas: bool = False
) -> StreamWriter:
    """Start writing an IPC stream to ``sink`` (a path or binary file object)."""
    return StreamWriter(sink, schema, compression=compression, emit_dictionary_deltas=emit_dictionary_deltas)


def new_file(
    sink: Sink, schema: pa.Schema, *, compression: str | None = None, emit_dictionary_deltas: bool = False
) -> FileWriter:
    """Start writing an IPC file to ``sink`` (a path or binary file object)."""
    return FileWriter(sink, schema, compression=compression, emit_dictionary_deltas=emit_dictionary_deltas)
