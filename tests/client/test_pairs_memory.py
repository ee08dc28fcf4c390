"""Pair-list bodies read without a copy (zero-copy shared memory) and with UCX RMA (memory=ucx)."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest
from helpers.e2e import ServerThread

from dissoc.client import ClientOptions, fetch, fetch_async, open_stream, stream_batches
from dissoc.errors import DissocError, ProtocolError
from dissoc.memory.pairs import open_pair_reader
from dissoc.memory.shm import ShmArena
from dissoc.protocol import PairList
from dissoc.server import Server
from dissoc.uri import DissocURI

pytestmark = pytest.mark.timeout(120)

ZERO_COPY = ClientOptions(zero_copy=True, timeout=20)


def _segments() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("dissoc-")}
    except FileNotFoundError:
        return set()


def _table(rows: int = 40_000, batches: int = 4) -> pa.Table:
    parts = []
    for b in range(batches):
        ids = np.arange(b * rows, (b + 1) * rows)
        parts.append(
            pa.record_batch(
                {
                    "id": pa.array(ids),
                    "s": pa.array([None if i % 9 == 0 else f"v{i}" for i in ids.tolist()]),
                    "l": pa.array([[int(i), None] for i in ids.tolist()], pa.list_(pa.int64())),
                }
            )
        )
    return pa.Table.from_batches(parts)


async def _until(condition: Callable[[], object], timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.01)
    return bool(condition())


def _inside(buffer: pa.Buffer, start: int, size: int) -> bool:
    address: int = buffer.address
    return start <= address and address + buffer.size <= start + size


# ------------------------------------------------------------------------------------- zero-copy over shm


async def test_zero_copy_batches_point_into_the_segment_and_free_when_released() -> None:
    table = _table()
    async with Server({"t": table}, body="pairs", arena_bytes=64 << 20) as srv:
        arena = srv.arena
        assert arena is not None
        got = await fetch_async(srv.uri, "t", data_uri=srv.data_uri, options=ZERO_COPY)
        assert got.equals(table)
        # No copy: the id column's values are read from the client's mapping of the server's segment. The
        # server keeps every range listed while the batches live.
        mapped = got.column("id").chunk(0).buffers()[1]
        assert mapped is not None
        await asyncio.sleep(0.2)
        assert arena.allocations > 0
        in_use = arena.used_bytes
        assert in_use >= table.nbytes // 2
        placements = srv.placements
        assert placements is not None and placements.held_bytes == in_use
        del got, mapped
        gc.collect()
        # Freed: nothing is held; the batches stay resident (nobody holds them) until the arena needs room.
        assert await _until(lambda: placements.held_bytes == 0), f"{placements.held_bytes} bytes never freed"


async def test_zero_copy_buffers_live_in_the_shared_mapping() -> None:
    table = _table(rows=10_000, batches=1)
    async with Server({"t": table}, body="pairs") as srv:
        batch: pa.RecordBatch
        async for batch in stream_batches(srv.uri, "t", data_uri=srv.data_uri, options=ZERO_COPY):
            values = batch.column(0).buffers()[1]
            assert values is not None
            # The value buffer is a view of memory the server wrote: change it there, see it here.
            arena = srv.arena
            assert isinstance(arena, ShmArena)
            raw = arena.array
            first = int(batch.column(0)[0].as_py())
            hits = np.flatnonzero(raw.view(np.int64)[: raw.size // 8] == first)
            assert hits.size > 0
            before = batch.column(0)[0].as_py()
            raw.view(np.int64)[hits[0]] = -7
            assert batch.column(0)[0].as_py() == -7 != before
            raw.view(np.int64)[hits[0]] = before
            break


async def test_zero_copy_frees_batch_by_batch_while_streaming() -> None:
    batch = pa.record_batch([pa.array(np.arange(100_000))], names=["id"])
    table = pa.Table.from_batches([batch] * 30)
    # 30 batches of 800 KB through a 4 MiB arena: only works if released batches free their ranges at once.
    async with Server({"t": table}, body="pairs", arena_bytes=4 << 20) as srv:
        n = 0
        b: pa.RecordBatch
        async for b in stream_batches(srv.uri, "t", data_uri=srv.data_uri, options=ZERO_COPY):
            assert b.column(0).equals(batch.column(0))
            n += 1
            del b
        assert n == 30


def test_zero_copy_through_the_synchronous_calls() -> None:
    table = _table(rows=5_000, batches=3)
    with ServerThread({"t": table}, body="pairs") as srv:
        arena = srv.server.arena
        got = fetch(srv.uri, "t", data_uri=srv.data_uri, options=ZERO_COPY)
        assert got.equals(table)
        with open_stream(srv.uri, "t", data_uri=srv.data_uri, options=ZERO_COPY) as reader:
            again = reader.read_all()
        assert again.equals(table)
        placements = srv.server.placements
        # both results still use the server's memory
        assert arena.used_bytes > 0 and placements.held_bytes > 0
        del got, again
        gc.collect()
        deadline = time.monotonic() + 10
        while placements.held_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert placements.held_bytes == 0


# ------------------------------------------------------------------------------------------ pair readers


def test_a_reader_refuses_ranges_outside_the_segment() -> None:
    arena = ShmArena.create(1 << 20)
    try:
        uri = DissocURI("tcp", "127.0.0.1", 1, 1, 2, remote_handle=arena.handle, memory="shm")
        for zero_copy in (False, True):
            reader = open_pair_reader(uri, zero_copy=zero_copy, on_release=lambda _: None, timeout=5)
            try:
                with pytest.raises(ProtocolError):
                    reader.read(PairList(64, np.array([[(1 << 20) - 8, 64]], dtype=np.uint64)))
            finally:
                reader.close()
    finally:
        arena.close()


def test_a_ucx_data_uri_must_say_where_the_region_is() -> None:
    uri = DissocURI("ucx", "127.0.0.1", 1, 1, 2, remote_handle=b"rkey", memory="ucx")
    with pytest.raises(ProtocolError, match="rma_worker"):
        open_pair_reader(uri, zero_copy=False, on_release=lambda _: None, timeout=5)


def test_memory_ucx_needs_the_ucx_transport() -> None:
    with pytest.raises(DissocError, match="transport='ucx'"):
        Server({}, body="pairs", memory="ucx", transport="tcp")


# --------------------------------------------------------------------------------------- pairs over RMA


@pytest.mark.ucx
@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
async def test_rma_pairs_round_trip_and_everything_is_freed(split: bool) -> None:
    table = _table()
    async with Server(
        {"t": table}, transport="ucx", body="pairs", memory="ucx", split=split, arena_bytes=64 << 20
    ) as srv:
        assert isinstance(srv.arena, ShmArena)
        segment = srv.arena.name.lstrip("/")
        assert segment in _segments()
        data = DissocURI.parse(srv.data_uri)
        assert data.memory == "ucx" and data.remote_handle and data.free_data is not None
        assert {"rma_worker", "rma_base", "rma_length"} <= set(data.params)
        for _ in range(2):
            got = await fetch_async(srv.uri, "t", data_uri=srv.data_uri, options=ClientOptions(timeout=20))
            assert got.equals(table)
            # Read with GETs into the client's own memory: nothing of the batch points into the arena.
            base, length = int(data.params["rma_base"]), int(data.params["rma_length"])
            assert not _inside(got.column("id").chunk(0).buffers()[1], base, length)
        placements = srv.placements
        assert placements is not None
        assert await _until(lambda: placements.held_bytes == 0), f"{placements.held_bytes} bytes never freed"
    assert segment not in _segments(), "the server's segment must be unlinked when it closes"


@pytest.mark.ucx
async def test_rma_pairs_stream_through_a_small_arena() -> None:
    batch = pa.record_batch([pa.array(np.arange(200_000))], names=["id"])
    table = pa.Table.from_batches([batch] * 20)
    async with Server({"t": table}, transport="ucx", body="pairs", memory="ucx", arena_bytes=4 << 20) as srv:
        n = 0
        b: pa.RecordBatch
        async for b in stream_batches(srv.uri, "t", data_uri=srv.data_uri, options=ClientOptions(timeout=20)):
            assert b.column(0).equals(batch.column(0))
            n += 1
        assert n == 20


@pytest.mark.ucx
async def test_rma_pairs_for_many_clients_at_once() -> None:
    table = _table(rows=20_000, batches=3)
    async with Server({"t": table}, transport="ucx", body="pairs", memory="ucx", arena_bytes=64 << 20) as srv:
        results = await asyncio.gather(
            *(
                fetch_async(srv.uri, "t", data_uri=srv.data_uri, options=ClientOptions(timeout=30))
                for _ in range(8)
            )
        )
        assert all(r.equals(table) for r in results)
        placements = srv.placements
        assert placements is not None
        assert await _until(lambda: placements.held_bytes == 0)


async def test_a_client_holding_every_batch_times_out_and_the_server_still_closes() -> None:
    # The consumer keeps its zero-copy batches, so the arena stays full: the client must give up after its
    # timeout, and the server must be able to close while its stream waits for room.
    batch = pa.record_batch([pa.array(np.arange(100_000))], names=["id"])
    table = pa.Table.from_batches([batch] * 30)
    held: list[pa.RecordBatch] = []
    options = ClientOptions(zero_copy=True, timeout=2)
    async with asyncio.timeout(30):
        async with Server({"t": table}, body="pairs", arena_bytes=4 << 20) as srv:
            with pytest.raises(DissocError, match="nothing arrived"):
                async for b in stream_batches(srv.uri, "t", data_uri=srv.data_uri, options=options):
                    held.append(b)
            assert 0 < len(held) < 30
            assert all(b.column(0).equals(batch.column(0)) for b in held)
