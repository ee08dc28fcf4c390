"""Live streams end to end over real TCP: readers follow a stream while its producer appends (combined and
split servers, packed bodies and pairs), from an offset; a reader that fell behind the retention and a
producer that failed get errors, never a silent end; through the Flight plane a remote producer appends
(at most once per sequence when asked) and ends the stream; the server's metrics show each stream."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import within

import dissoc
from dissoc.client import ClientOptions, stream_batches
from dissoc.errors import RemoteError
from dissoc.server import Server

pytestmark = pytest.mark.timeout(60)

FOLLOW = ClientOptions(timeout=None)


def _batch(i: int) -> pa.RecordBatch:
    return pa.record_batch({"i": pa.array([i] * 100, pa.int64()), "s": [f"row {i}"] * 100})


async def _follow(uri: str, ticket: str, data_uri: str | None = None, limit: int | None = None) -> list[int]:
    got: list[int] = []
    async for batch in stream_batches(uri, ticket, data_uri=data_uri, options=FOLLOW):
        got.append(_first(batch))
        if limit is not None and len(got) >= limit:
            break
    return got


def _first(batch: Any) -> int:
    assert isinstance(batch, pa.RecordBatch)
    value: int = batch.column(0)[0].as_py()
    return value


def _produce(stream: Any, values: range, pause: float = 0.005) -> threading.Thread:
    def run() -> None:
        for i in values:
            stream.append(_batch(i))
            time.sleep(pause)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="combined"),
        pytest.param({"split": True}, id="split"),
        pytest.param({"body": "pairs", "arena_bytes": 8 << 20}, id="pairs"),
    ],
)
async def test_readers_follow_a_stream_as_it_is_appended(options: dict[str, Any]) -> None:
    async with Server({}, **options) as server:
        stream = server.publish("ev", max_batches=1000)
        uri, data_uri = server.uri, server.data_uri
        early = [asyncio.create_task(_follow(uri, "ev", data_uri)) for _ in range(2)]
        at_five = asyncio.create_task(_follow(uri, "ev@5", data_uri))
        await asyncio.sleep(0.1)
        producer = _produce(stream, range(20))
        await asyncio.to_thread(producer.join)
        late = await within(20, _follow(uri, "ev@15", data_uri, limit=5), "late reader")
        stream.close()
        for task in early:
            assert await within(20, task, "early reader") == list(range(20))
        assert await within(20, at_five, "reader at 5") == list(range(5, 20))
        assert late == list(range(15, 20))
        assert await within(20, _follow(uri, "ev", data_uri), "after the end") == list(range(20))
        table = await dissoc.fetch_async(uri, "ev@latest", data_uri=data_uri)
        assert table.num_rows == 0 and table.schema.equals(_batch(0).schema)


async def test_a_reader_behind_the_retention_gets_an_error_naming_the_first_offset() -> None:
    async with Server({}) as server:
        stream = server.publish("ev", max_batches=4)
        for i in range(10):
            stream.append(_batch(i))
        with pytest.raises(RemoteError, match="first offset held is 6") as caught:
            await _follow(server.uri, "ev@2")
        assert caught.value.code == "fell_behind"
        assert await within(10, _follow(server.uri, "ev", limit=4), "from earliest") == [6, 7, 8, 9]


async def test_a_producer_failure_reaches_followers_as_an_error() -> None:
    async with Server({}) as server:
        stream = server.publish("ev")
        got: list[int] = []

        async def follow() -> None:
            async for batch in stream_batches(server.uri, "ev", options=FOLLOW):
                got.append(_first(batch))

        task = asyncio.create_task(follow())
        await asyncio.to_thread(_produce(stream, range(3)).join)
        await asyncio.sleep(0.1)
        stream.fail(RuntimeError("the GPU pipeline crashed"))
        with pytest.raises(RemoteError, match="the producer failed at offset 3: the GPU pipeline crashed"):
            await within(10, task, "follower")
        assert got == [0, 1, 2]


async def test_a_follower_that_stops_early_detaches_and_metrics_show_the_stream() -> None:
    async with Server({}) as server:
        stream = server.publish("ev", max_batches=100)
        stream.append(_batch(0))
        assert await within(10, _follow(server.uri, "ev", limit=1), "one batch") == [0]
        deadline = time.monotonic() + 5
        while stream.lags() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert stream.lags() == []
        reader = asyncio.create_task(_follow(server.uri, "ev@latest"))
        while not stream.lags() and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.02)
        samples = {(name, labels): value for name, labels, value in server.metrics_samples()}
        assert samples[("dissoc_live_head_offset", ("ev",))] == 1.0
        assert samples[("dissoc_live_retained_batches", ("ev",))] == 1.0
        assert samples[("dissoc_live_readers", ("ev",))] == 1.0
        stream.close()
        assert await within(10, reader, "latest reader") == []


async def test_a_remote_producer_appends_through_the_flight_plane() -> None:
    pytest.importorskip("pyarrow.flight", reason="pyarrow.flight is not available in this pyarrow")
    from dissoc.flight import append, append_staged, live_close, live_status, serve_with_flight

    async with serve_with_flight({}) as plane:
        plane.server.publish("ev", _batch(0).schema)  # (GetFlightInfo needs a schema: declared, or published)
        location = plane.location
        follower = asyncio.create_task(_follow(location, "ev"))  # resolved through the plane
        await asyncio.sleep(0.1)
        ack = await asyncio.to_thread(append, location, "ev", pa.Table.from_batches([_batch(0), _batch(1)]))
        assert (ack["batches"], ack["first"], ack["head"]) == (2, 0, 2)
        once = [await asyncio.to_thread(append, location, "ev", _batch(2), producer="job", sequence=7)]
        once += [await asyncio.to_thread(append, location, "ev", _batch(2), producer="job", sequence=7)]
        assert [a["duplicate"] for a in once] == [False, True]
        plane.server.add("ev/staged", pa.Table.from_batches([_batch(3), _batch(4)]))  # served already
        staged = [
            await asyncio.to_thread(append_staged, location, "ev", ["ev/staged"], producer="job", sequence=8)
            for _ in range(2)
        ]
        assert [(a["duplicate"], a["batches"]) for a in staged] == [(False, 2), (True, 0)]
        status = await asyncio.to_thread(live_status, location, "ev")
        assert status["head"] == 5 and not status["ended"]
        await asyncio.to_thread(live_close, location, "ev")
        assert await within(20, follower, "follower") == [0, 1, 2, 3, 4]
        with pytest.raises(dissoc.DissocError, match="is closed"):
            await asyncio.to_thread(append, location, "ev", _batch(3))
        with pytest.raises(dissoc.DissocError, match="not a live stream"):
            plane.server.add("table", pa.table({"x": [1]}))
            await asyncio.to_thread(live_status, location, "table")


async def test_a_token_for_the_stream_reads_it_from_any_offset() -> None:
    from dissoc.tokens import Secret, grants

    assert grants("ev", "ev@3") and grants("ev", "ev@latest") and not grants("ev", "ev@x")
    assert not grants("ev", "other@3") and not grants("e", "ev@3")
    secret = Secret.generate()
    async with Server({}, secret=secret) as server:
        stream = server.publish("ev")
        for i in range(4):
            stream.append(_batch(i))
        stream.close()
        token = secret.mint("ev", ttl=60)
        assert await _follow(server.uri, f"{token}@2") == [2, 3]  # the signed ticket, then the offset
        got = await dissoc.fetch_async(server.uri, "ev@1", options=ClientOptions(token=token))
        assert got.column(0).unique().to_pylist() == [1, 2, 3]
        with pytest.raises(RemoteError, match="unknown ticket 'other@2'"):  # a token names one dataset
            await _follow(server.uri, f"{secret.mint('other', ttl=60)}@2")
        with pytest.raises(RemoteError, match="ticket refused"):
            await _follow(server.uri, "ev@2")  # the bare name is no credential


async def test_a_device_stream_sends_from_device_memory() -> None:
    """A stream of DeviceBatch objects (on the fake device): bodies sent from device memory, read on the
    host and landing on the device; host batches are refused by it, as device batches by a host stream."""
    from dissoc.device import DeviceBatch
    from dissoc.memory.cuda import FakeDeviceBackend, use_backend

    source = [_batch(i) for i in range(3)]
    with use_backend(FakeDeviceBackend()):
        async with Server({}) as server:
            stream = server.publish("dev", device=True)
            with pytest.raises(dissoc.DissocError, match="append a DeviceBatch"):
                stream.append(source[0])
            for b in DeviceBatch.from_batches(source[0].schema, source):
                stream.append(b)
            stream.close()
            host = await dissoc.fetch_async(server.uri, "dev@1")
            assert host.equals(pa.Table.from_batches(source[1:]))
            landed = [
                b async for b in stream_batches(server.uri, "dev", options=ClientOptions(landing="device"))
            ]
            assert all(isinstance(b, DeviceBatch) for b in landed)
            assert DeviceBatch.to_table(landed).equals(pa.Table.from_batches(source))
            with pytest.raises(dissoc.DissocError, match=r"takes a pyarrow\.RecordBatch"):
                server.publish("host").append(DeviceBatch.from_arrow(source[0]))
