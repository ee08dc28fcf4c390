"""End to end over real TCP, things going away: a client leaving mid-stream (the server must release the
stream and go on serving), a server dying mid-stream or never answering (the client must raise
``TransportError``, never hang)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from helpers.e2e import (
    RawServer,
    cli_server,
    eventually,
    listener_connections,
    ordered_table,
    tagged,
    within,
)

from dissoc.client import ClientOptions, fetch_async, stream_batches
from dissoc.datasets import ReaderFactoryDataset
from dissoc.errors import DissocError, TransportError
from dissoc.server import Server

pytestmark = pytest.mark.timeout(60)

LAYOUTS = [pytest.param(False, id="combined"), pytest.param(True, id="split")]

SCHEMA = pa.schema([("id", pa.int64()), ("pad", pa.binary())])
ROWS = 1024


class LongStream:
    """A reader factory for a (practically) endless stream of ~256 KiB batches that records what it did."""

    def __init__(self, batches: int = 100_000) -> None:
        self.batches = batches
        self.lock = threading.Lock()
        self.opened = 0
        self.closed = 0
        self.produced = 0

    def __call__(self) -> Iterator[pa.RecordBatch]:
        with self.lock:
            self.opened += 1
        try:
            pad = pa.array([b"p" * 256] * ROWS, pa.binary())
            for i in range(self.batches):
                with self.lock:
                    self.produced += 1
                yield pa.record_batch(
                    [pa.array(range(i * ROWS, (i + 1) * ROWS), pa.int64()), pad], schema=SCHEMA
                )
        finally:
            with self.lock:
                self.closed += 1

    def dataset(self, name: str = "long") -> ReaderFactoryDataset:
        return ReaderFactoryDataset(name, self, schema=SCHEMA)

    @property
    def all_closed(self) -> bool:
        with self.lock:
            return self.opened > 0 and self.closed == self.opened


SMALL = ordered_table(3, 50)


async def _assert_released_and_serving(server: Server, stream: LongStream, split: bool) -> None:
    released = await eventually(lambda: stream.all_closed, 10)
    assert released, (
        f"the server did not close the stream's reader: opened {stream.opened}, closed {stream.closed}"
    )
    produced = stream.produced
    await asyncio.sleep(0.2)
    assert stream.produced == produced, "the server kept producing batches after the client left"
    assert produced < stream.batches
    gone = await eventually(lambda: listener_connections(server) in (0, None), 10)
    assert gone, f"connection handlers still running after the client left: {listener_connections(server)}"
    got = await within(
        10, fetch_async(server.uri, "small", data_uri=server.data_uri, options=ClientOptions(timeout=10))
    )
    assert got.equals(SMALL)


# ------------------------------------------------------------------------------------ client leaves early


@pytest.mark.parametrize("split", LAYOUTS)
async def test_client_breaks_out_mid_stream_server_releases_and_goes_on(split: bool) -> None:
    stream = LongStream()
    async with Server({"long": stream.dataset(), "small": SMALL}, split=split) as server:
        agen = stream_batches(server.uri, "long", data_uri=server.data_uri, options=ClientOptions(timeout=10))
        seen = 0
        async with contextlib.aclosing(agen):
            batch: pa.RecordBatch
            async for batch in agen:
                assert batch.column("id")[0].as_py() == seen * ROWS
                seen += 1
                if seen == 3:
                    break
            # closing the generator (the end of this block) must not hang
            await within(10, agen.aclose(), "closing the client's stream after break")
        assert seen == 3
        await _assert_released_and_serving(server, stream, split)


@pytest.mark.parametrize("split", LAYOUTS)
async def test_client_task_cancelled_mid_stream_server_releases_and_goes_on(split: bool) -> None:
    stream = LongStream()
    got_two = asyncio.Event()

    async def consume(uri: str, data_uri: str) -> None:
        n = 0
        async for _ in stream_batches(uri, "long", data_uri=data_uri, options=ClientOptions(timeout=10)):
            n += 1
            if n == 2:
                got_two.set()
            await asyncio.sleep(0.01)

    async with Server({"long": stream.dataset(), "small": SMALL}, split=split) as server:
        task = asyncio.create_task(consume(server.uri, server.data_uri))
        await within(10, got_two.wait(), "the first batches")
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done, "cancelling a consuming task did not finish within 10 s (the client's cleanup hangs)"
        assert task.cancelled()
        await _assert_released_and_serving(server, stream, split)


@pytest.mark.parametrize("split", LAYOUTS)
async def test_raw_peer_hangs_up_mid_stream_server_releases_and_goes_on(split: bool) -> None:
    """Server side alone: a peer that asks for a stream, reads a little and closes its socket(s)."""
    stream = LongStream()
    async with Server({"long": stream.dataset(), "small": SMALL}, split=split) as server:
        meta, data = server.uris
        socks = []
        for uri in [meta, data] if split else [meta]:
            s = socket.create_connection((uri.host, uri.port), timeout=5)
            s.sendall(tagged(uri.want_data, b"long"))
            socks.append(s)
        loop = asyncio.get_running_loop()
        for s in socks:
            got = 0
            while got < 64 << 10:
                chunk = await loop.run_in_executor(None, s.recv, 65536)
                assert chunk, "the server closed the connection instead of streaming"
                got += len(chunk)
        for s in socks:
            s.close()
        await _assert_released_and_serving(server, stream, split)


async def test_many_clients_leaving_early_leave_nothing_behind() -> None:
    stream = LongStream()
    async with Server({"long": stream.dataset(), "small": SMALL}) as server:
        for _ in range(8):
            agen = stream_batches(server.uri, "long", options=ClientOptions(timeout=10))
            async with contextlib.aclosing(agen):
                async for _batch in agen:
                    break
        await _assert_released_and_serving(server, stream, False)
        assert stream.opened == 8


# ---------------------------------------------------------------------------------------- server dies


def _big_ipc_file(path: Path, batches: int = 80, batch_bytes: int = 2 << 20) -> Path:
    rows = batch_bytes // 8
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("id", pa.int64())])) as w:
        for i in range(batches):
            w.write_batch(
                pa.record_batch([pa.array(range(i * rows, (i + 1) * rows), pa.int64())], names=["id"])
            )
    return path


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _big_ipc_file(tmp_path_factory.mktemp("big") / "big.arrow")


@pytest.mark.parametrize("split", LAYOUTS)
async def test_server_killed_mid_stream_client_raises_transport_error(split: bool, big_file: Path) -> None:
    args = [str(big_file)] + (["--split"] if split else [])
    opts = ClientOptions(timeout=10, max_in_flight_bytes=4 << 20, max_buffered_bytes=4 << 20)
    with cli_server(*args, count=1) as (proc, lines):
        line = lines[0]
        assert line["ticket"] == "big"
        received = 0
        started = time.monotonic()
        with pytest.raises(TransportError):
            async with contextlib.aclosing(
                stream_batches(line["uri"], "big", data_uri=line["data_uri"], options=opts)
            ) as agen:

                async def consume() -> None:
                    nonlocal received
                    async for batch in agen:
                        received += batch.num_rows
                        if proc.poll() is None:
                            proc.send_signal(signal.SIGKILL)
                            await asyncio.to_thread(proc.wait, 10)

                await within(30, consume(), "the client after the server was killed")
        assert proc.returncode == -signal.SIGKILL
        assert 0 < received < 80 * (2 << 20) // 8, f"received {received} rows"
        assert time.monotonic() - started < 25


async def test_server_never_answers_transport_error_within_timeout() -> None:
    async with RawServer(answer=False) as raw:
        started = time.monotonic()
        with pytest.raises(TransportError):
            await within(10, fetch_async(raw.uri(), "x", options=ClientOptions(timeout=1.0)))
        elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 5, f"took {elapsed:.2f} s with timeout=1"


async def test_server_answers_want_data_with_silence_transport_error_within_timeout() -> None:
    async with RawServer(lambda: ()) as raw:  # reads the request, then says nothing
        started = time.monotonic()
        with pytest.raises(TransportError):
            await within(10, fetch_async(raw.uri(), "x", options=ClientOptions(timeout=1.0)))
        assert raw.requests == [(7, b"x")]
    assert time.monotonic() - started < 5


async def test_split_data_server_never_answers() -> None:
    table = ordered_table(3, 10)
    async with Server({"t": table}) as server, RawServer(answer=False) as raw:
        with pytest.raises(TransportError):
            await within(
                10, fetch_async(server.uri, "t", data_uri=raw.uri(), options=ClientOptions(timeout=1.0))
            )


async def test_connection_refused_is_a_transport_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connecting is refused
        with pytest.raises(TransportError):
            await within(
                10, fetch_async(f"tcp://127.0.0.1:{port}?want_data=1", "x", options=ClientOptions(timeout=2))
            )


async def test_server_closed_while_streaming_client_gets_dissoc_error() -> None:
    """Closing an in-process server mid-stream ends the client's stream with a DissocError (not a hang)."""
    stream = LongStream()
    server = await Server({"long": stream.dataset()}).start()
    try:
        agen = stream_batches(server.uri, "long", options=ClientOptions(timeout=5))
        with pytest.raises(DissocError):
            async with contextlib.aclosing(agen):

                async def consume() -> None:
                    n = 0
                    async for _ in agen:
                        n += 1
                        if n == 2:
                            await server.close()

                await within(20, consume(), "the client after the server closed")
    finally:
        await within(10, server.close(), "closing the server")
    assert await eventually(lambda: stream.all_closed, 10)
