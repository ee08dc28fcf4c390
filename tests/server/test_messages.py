"""A stored dataset as the messages a server sends: an IPC file is parsed once and its messages kept for the
dataset's life; every stream of it sends the same frames, concurrent streams each get all of it, a corrupt
message fails every stream after the messages before it, and the kept messages go with their dataset."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import within

import dissoc.datasets.messages as messages
from dissoc.client import fetch_async
from dissoc.codec import iter_messages
from dissoc.data_server import DataPart
from dissoc.datasets import IpcFileDataset, IpcStreamDataset
from dissoc.metadata_server import MetadataPart
from dissoc.protocol import EndOfStream, ErrorMessage, decode_stream_message, encode_metadata_header
from dissoc.server import Server
from dissoc.server.role import ServeOptions
from dissoc.server.stream import Outbox, stream_dataset

pytestmark = pytest.mark.timeout(60)

#: More batches than one parsing step takes, so that a first stream parses the file in several steps.
BATCHES = 2 * messages._CHUNK + 37


def _table(batches: int = BATCHES, rows: int = 3) -> pa.Table:
    chunks = [
        pa.record_batch({"i": pa.array(range(k * rows, (k + 1) * rows), pa.int64()), "s": [f"b{k}"] * rows})
        for k in range(batches)
    ]
    return pa.Table.from_batches(chunks)


def _write(path: Path, table: pa.Table, *, stream: bool = False) -> Path:
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_stream if stream else pa.ipc.new_file
        with writer(sink, table.schema) as w:
            for batch in table.to_batches():
                w.write_batch(batch)
    return path


class Recorder:
    """The Outbox's connection: keeps the frames of every send_many, in order."""

    def __init__(self) -> None:
        self.frames: list[tuple[int | None, bytes]] = []
        self.closed = False
        self.device_memory = False
        self.description = "recorder"

    async def send_many(self, frames: Sequence[tuple[int | None, Any]]) -> None:
        for tag, data in frames:
            pieces = data if isinstance(data, list) else [data]
            self.frames.append((tag, b"".join(bytes(memoryview(p)) for p in pieces)))


async def _serve(dataset: Any) -> tuple[list[tuple[int | None, bytes]], list[bytes]]:
    """One combined stream of ``dataset``: the frames sent, and the error messages sent."""
    conn = Recorder()
    errors: list[bytes] = []

    async def send_error(message: bytes) -> None:
        errors.append(message)

    parts = [MetadataPart(), DataPart(conn, dataset, ServeOptions(want_data=1), lambda: True)]  # type: ignore[arg-type]
    await stream_dataset(Outbox(conn, coalesce=True), dataset, parts, compression=None, send_error=send_error)  # type: ignore[arg-type]
    return conn.frames, errors


def _expected(path: Path, *, file_format: bool = True) -> list[tuple[int | None, bytes]]:
    """The frames of a combined stream of the file, from a parse of its own."""
    frames: list[tuple[int | None, bytes]] = []
    for seq, (msg, meta, body) in enumerate(iter_messages(str(path), file_format=file_format)):
        frames.append((None, encode_metadata_header(seq) + bytes(meta)))
        if msg.has_body:
            frames.append((seq, bytes(memoryview(body))))
    return frames


async def test_a_stored_file_served_twice_sends_identical_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path / "t.arrow", _table())
    dataset = IpcFileDataset(path)
    try:
        first, errors = await _serve(dataset)
        kept = messages.stored_messages(dataset)
        assert len(kept.items) == BATCHES + 1  # the schema and every batch, parsed once
        monkeypatch.setattr(messages, "iter_messages", None)  # the second stream parses nothing
        second, more_errors = await _serve(dataset)
        assert messages.stored_messages(dataset) is kept
    finally:
        dataset.close()
    assert not errors and not more_errors
    expected = _expected(path)
    assert first == [*expected, (None, first[-1][1])]
    assert second == first
    eos = decode_stream_message(first[-1][1])
    assert isinstance(eos, EndOfStream)
    assert eos.seq == BATCHES + 1


async def test_an_ipc_stream_file_sends_what_it_holds(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.arrows", _table(), stream=True)
    with IpcStreamDataset(path) as dataset:
        frames, errors = await _serve(dataset)
    assert not errors
    assert frames[:-1] == _expected(path, file_format=False)


async def test_concurrent_streams_of_one_file_each_get_all_of_it(tmp_path: Path) -> None:
    """The first streams of a file parse it together (each reading the kept messages as they are added)."""
    table = _table()
    path = _write(tmp_path / "t.arrow", table)
    for split in (False, True):
        async with Server({"t": str(path)}, split=split) as server:
            fetches = [fetch_async(server.uri, "t", data_uri=server.data_uri) for _ in range(4)]
            got = await within(30, asyncio.gather(*fetches), "four fetches")
        for result in got:
            assert result.equals(table)


async def test_walking_concurrently_in_the_same_loop(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.arrow", _table())
    with IpcFileDataset(path) as dataset:
        results = await asyncio.gather(*(_serve(dataset) for _ in range(3)))
    assert results[0] == results[1] == results[2]
    assert results[0][0][:-1] == _expected(path)


def _corrupt_message(path: Path, index: int) -> None:
    """Make message ``index`` of the file's stream (0 = the schema) declare an impossible metadata size."""
    data = bytearray(path.read_bytes())
    buffer = pa.py_buffer(bytes(data))
    ends = [
        body.address - buffer.address + body.size for _, _, body in iter_messages(buffer, file_format=True)
    ]
    start = ends[index - 1]
    assert data[start : start + 4] == b"\xff\xff\xff\xff"  # the continuation marker, then the size
    data[start + 4 : start + 8] = (0x7FFF_FFFF).to_bytes(4, "little")
    path.write_bytes(bytes(data))


async def test_a_corrupt_message_fails_every_stream_after_the_messages_before_it(tmp_path: Path) -> None:
    bad = messages._CHUNK + 5  # in the second parsing step
    path = _write(tmp_path / "t.arrow", _table())
    _corrupt_message(path, bad)
    with IpcFileDataset(path) as dataset:
        for _ in range(2):
            frames, errors = await _serve(dataset)
            assert len([tag for tag, _ in frames if tag is not None]) == bad - 1  # every batch before it
            assert len(errors) == 1
            error = decode_stream_message(errors[0])
            assert isinstance(error, ErrorMessage)
            assert (error.seq, error.code) == (bad, "stream_failed")


async def test_kept_messages_go_with_their_dataset(tmp_path: Path) -> None:
    """The kept messages do not pile up across datasets: they go when the dataset is closed or collected."""
    path = _write(tmp_path / "t.arrow", _table(batches=3))
    gc.collect()
    before = len(messages._PARSED)
    datasets = [IpcFileDataset(path, name=f"d{k}") for k in range(20)]
    for dataset in datasets:
        await _serve(dataset)
    assert len(messages._PARSED) == before + 20
    closed = datasets.pop()
    closed.close()
    frames, errors = await _serve(closed)  # a closed dataset fails its stream, and its messages go
    assert not frames
    error = decode_stream_message(errors[0])
    assert isinstance(error, ErrorMessage)
    assert (error.seq, error.code) == (0, "stream_failed")
    assert len(messages._PARSED) == before + 19
    del datasets, closed, frames
    gc.collect()
    assert len(messages._PARSED) == before


async def test_dataset_messages_are_the_chunks_one_by_one(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.arrow", _table())
    dataset = IpcFileDataset(path)
    try:
        one_by_one = [item async for item in messages.dataset_messages(dataset, None)]
        chunked = [item async for chunk in messages.message_chunks(dataset, None) for item in chunk]
    finally:
        dataset.close()
    assert len(one_by_one) == BATCHES + 1
    assert [(bytes(m), b, w) for m, b, w in one_by_one] == [(bytes(m), b, w) for m, b, w in chunked]
