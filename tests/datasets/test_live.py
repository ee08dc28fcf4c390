"""Live streams (dissoc.datasets.live) without a network: offsets, readers at their own pace, the retention's
three policies, the producer's end and failure, at-most-once appends, tickets NAME@START."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pyarrow as pa
import pytest

from dissoc.datasets import Catalog, DatasetError, LiveDataset, LiveView
from dissoc.datasets.live import FellBehind, RetentionFull, parse_start
from dissoc.datasets.messages import message_chunks
from dissoc.tokens import split_start

pytestmark = pytest.mark.timeout(30)


def _batch(i: int, rows: int = 4) -> pa.RecordBatch:
    return pa.record_batch({"v": pa.array([i] * rows, pa.int64())})


async def _read(stream: LiveDataset | LiveView, *, limit: int | None = None) -> list[int]:
    """The first value of every batch a reader gets (decoded from the messages a server would send)."""
    from dissoc.codec import MessageDecoder

    decoder = MessageDecoder()
    got: list[int] = []
    chunks = message_chunks(stream, None)
    try:
        async for chunk in chunks:
            for metadata, body, _ in chunk:
                data = pa.py_buffer(b"".join(bytes(b) for b in body))
                out = decoder.decode(metadata, data)
                if isinstance(out, pa.RecordBatch):
                    got.append(out.column(0)[0].as_py())
                    if limit is not None and len(got) >= limit:
                        return got
    finally:
        await chunks.aclose()
    return got


def test_tickets_and_starts() -> None:
    assert split_start("events@12") == ("events", "12")
    assert split_start("a@b@latest") == ("a@b", "latest")
    assert split_start("events") == ("events", None) and split_start("@5") == ("@5", None)
    assert split_start("events@soon") == ("events@soon", None)
    assert parse_start("earliest") == "earliest" and parse_start(" LATEST ") == "latest"
    assert parse_start("7") == 7 and parse_start(0) == 0
    for bad in ("-1", "soon", -3, "1.5"):
        with pytest.raises(DatasetError, match=r"offset, 'earliest' or 'latest'|must be >= 0"):
            parse_start(bad)
    catalog = Catalog()
    stream = LiveDataset("events")
    catalog.add(None, stream)
    view = catalog.get("events@3")
    assert isinstance(view, LiveView) and view.live is stream and view.start == 3
    assert catalog.get("events") is stream
    with pytest.raises(DatasetError, match="unknown ticket"):
        catalog.get("other@3")
    with pytest.raises(DatasetError, match="must not contain '@'"):
        LiveDataset("a@b")
    with pytest.raises(DatasetError, match="on_full is one of"):
        LiveDataset("x", on_full="drop")


async def test_readers_join_early_late_and_at_an_offset() -> None:
    stream = LiveDataset("s")
    early = asyncio.create_task(_read(stream))
    latest = asyncio.create_task(_read(stream.view("latest")))
    await asyncio.sleep(0.05)  # both attached before anything was appended
    for i in range(5):
        assert stream.append(_batch(i)) == i
        await asyncio.sleep(0)
    stream.close()
    assert await early == [0, 1, 2, 3, 4]
    assert await latest == [0, 1, 2, 3, 4]  # latest, when nothing was there yet: from offset 0
    assert await _read(stream) == [0, 1, 2, 3, 4]  # late: the retention, then the end
    assert await _read(stream.view(3)) == [3, 4]
    assert await _read(stream.view("latest")) == []  # after the last: just the end
    assert stream.head == 5 and stream.first == 0 and stream.ended
    with pytest.raises(DatasetError, match="is closed"):
        stream.append(_batch(9))


async def test_a_reader_past_the_head_waits_for_its_offset() -> None:
    stream = LiveDataset("s")
    stream.append(_batch(0))
    ahead = asyncio.create_task(_read(stream.view(3)))
    for i in range(1, 5):
        await asyncio.sleep(0.01)
        stream.append(_batch(i))
    stream.close()
    assert await ahead == [3, 4]


async def test_evict_fails_a_reader_that_fell_behind_naming_the_first_offset_held() -> None:
    stream = LiveDataset("s", max_batches=3)
    for i in range(6):
        stream.append(_batch(i))
    assert stream.first == 3 and stream.retained[0] == 3
    with pytest.raises(FellBehind, match="offset 1 is no longer held; the first offset held is 3"):
        await _read(stream.view(1))
    # a reader that was attached and fell behind while reading: an error, never a silent gap
    slow = LiveDataset("slow", max_batches=2)
    slow.append(_batch(0))
    reader = slow.chunks(0, None)
    await reader.__anext__()  # the schema
    for i in range(1, 6):
        slow.append(_batch(i))
    with pytest.raises(FellBehind, match="fell behind the retention at offset 0; the first offset held is 4"):
        await reader.__anext__()
    await reader.aclose()
    assert slow.lags() == []  # detached


async def test_evict_by_bytes() -> None:
    one = _batch(0, rows=1000).get_total_buffer_size()
    stream = LiveDataset("s", max_bytes=3 * one, max_batches=None)
    for i in range(10):
        stream.append(_batch(i, rows=1000))
    assert stream.retained == (3, 3 * one) and stream.first == 7


def test_refuse_raises_when_a_reader_still_needs_the_oldest() -> None:
    stream = LiveDataset("s", max_batches=2, on_full="refuse")
    reader = stream._attach(0)
    stream.append(_batch(0))
    stream.append(_batch(1))
    with pytest.raises(RetentionFull, match="a reader still needs offset 0"):
        stream.append(_batch(2))
    assert stream._take(reader, 1) is not None  # the reader moves past offset 0: room again
    stream.append(_batch(2))
    stream._detach(reader)
    for i in range(3, 6):  # no reader: the oldest go
        stream.append(_batch(i))
    assert stream.first == 4


def test_block_makes_the_producer_wait_for_the_slowest_reader() -> None:
    stream = LiveDataset("s", max_batches=2, on_full="block", block_timeout=5)
    reader = stream._attach("earliest")
    stream.append(_batch(0))
    stream.append(_batch(1))
    appended = threading.Event()

    def produce() -> None:
        stream.append(_batch(2))
        appended.set()

    t = threading.Thread(target=produce)
    t.start()
    assert not appended.wait(0.2)  # waiting for the reader
    taken = stream._take(reader, 1)
    assert taken is not None and [e.offset for e in taken] == [0]
    assert appended.wait(5)
    t.join()
    assert stream.first == 1 and stream.head == 3
    with pytest.raises(RetentionFull, match=r"stayed full .* for 0.1 s: the slowest reader is at offset 1"):
        stream.append(_batch(3), timeout=0.1)
    stream._detach(reader)


async def test_producer_failure_reaches_readers_after_what_was_held() -> None:
    stream = LiveDataset("s")
    reading = asyncio.create_task(_read(stream))
    stream.append(_batch(0))
    stream.append(_batch(1))
    await asyncio.sleep(0.02)
    stream.fail(RuntimeError("the pipeline broke"))
    with pytest.raises(DatasetError, match="the producer failed at offset 2: the pipeline broke"):
        await reading
    with pytest.raises(DatasetError, match="the producer failed"):
        await _read(stream)  # a late reader too, after the batches held


def test_context_manager_closes_or_fails() -> None:
    with LiveDataset("ok") as ok:
        ok.append(_batch(0))
    assert ok.ended and ok._error is None
    failing = LiveDataset("bad")
    with pytest.raises(ValueError), failing:
        failing.append(_batch(0))
        raise ValueError("boom")
    assert failing.ended and isinstance(failing._error, ValueError)


def test_schema_set_by_the_first_append_and_kept() -> None:
    stream = LiveDataset("s")
    with pytest.raises(DatasetError, match="no schema yet"):
        _ = stream.schema
    stream.append(_batch(0))
    assert stream.schema.equals(_batch(0).schema)
    with pytest.raises(DatasetError, match="schema differs"):
        stream.append(pa.record_batch({"w": [1.5]}))
    declared = LiveDataset("d", pa.schema([("v", pa.int64())]))
    with pytest.raises(DatasetError, match="schema differs"):
        declared.append(pa.record_batch({"v": pa.array([1], pa.int32())}))
    assert declared.append(pa.table({"v": pa.array([1, 2], pa.int64())})) == 0


def test_append_once_skips_a_retried_sequence() -> None:
    stream = LiveDataset("s")
    assert stream.append_once([_batch(0), _batch(1)], producer="q", sequence=0) == (0, 1)
    assert stream.append_once([_batch(0), _batch(1)], producer="q", sequence=0) is None
    assert stream.append_once([_batch(2)], producer="other", sequence=0) == (2, 2)
    assert stream.append_once([], producer="q", sequence=1) == (3, 2)
    assert stream.last_sequence("q") == 1 and stream.head == 3


def test_sync_readers_follow_in_threads() -> None:
    """``open()`` (what a Flight DoGet reads) blocks for new batches, from any thread."""
    stream = LiveDataset("s")
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.extend(b.column(0)[0].as_py() for b in stream.view(1).open()))
    t.start()
    for i in range(4):
        stream.append(_batch(i))
        time.sleep(0.01)
    stream.close()
    t.join(10)
    assert got == [1, 2, 3]


async def test_dictionaries_reach_a_reader_starting_anywhere() -> None:
    values = [pa.array(["a", "b", "a"]).dictionary_encode(), pa.array(["c", "d"]).dictionary_encode()]
    stream = LiveDataset("d")
    for v in values:
        stream.append(pa.record_batch({"k": v}))
    stream.close()
    from dissoc.codec import MessageDecoder

    decoder = MessageDecoder()
    got: list[Any] = []
    async for chunk in message_chunks(stream.view(1), None):
        for metadata, body, _ in chunk:
            out = decoder.decode(metadata, pa.py_buffer(b"".join(bytes(b) for b in body)))
            if isinstance(out, pa.RecordBatch):
                got.append(out.column(0).to_pylist())
    assert got == [["c", "d"]]
