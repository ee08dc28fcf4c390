"""Resident placements (body type 1): a stored or in-memory batch is placed in the arena once and listed
to every client that asks, with no further copy; unreferenced placements are evicted when the arena needs
room, and never one that a client holds."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from helpers.e2e import Listings

from dissoc.client import ClientOptions, fetch_async, stream_batches
from dissoc.errors import RemoteError
from dissoc.protocol import decode_pairs, encode_free
from dissoc.server import Server
from dissoc.transport import connect_tcp
from dissoc.uri import DissocURI

pytestmark = pytest.mark.timeout(60)

COPY = ClientOptions(timeout=20)
ZERO_COPY = ClientOptions(zero_copy=True, timeout=20)
ROWS = 100_000  # one int64 column: 800 KB per batch


def _batches(n: int, rows: int = 20_000, seed: int = 0) -> list[pa.RecordBatch]:
    out = []
    for b in range(n):
        ids = np.arange(b * rows, (b + 1) * rows) + seed
        out.append(
            pa.record_batch(
                {
                    "id": pa.array(ids),
                    "s": pa.array([None if i % 7 == 0 else f"v{i}" for i in ids.tolist()]),
                }
            )
        )
    return out


def _big_batches(n: int) -> list[pa.RecordBatch]:
    return [pa.record_batch([pa.array(np.arange(b * ROWS, (b + 1) * ROWS))], names=["id"]) for b in range(n)]


def _ipc_file(path: Path, batches: Sequence[pa.RecordBatch]) -> str:
    with pa.ipc.new_file(path, batches[0].schema) as w:
        for b in batches:
            w.write_batch(b)
    return str(path)


class _Placed:
    """Counts what the server copies into its arena (wraps the arena's ``place`` and ``place_wait``)."""

    def __init__(self, arena: Any) -> None:
        self.calls = 0
        self.bytes = 0
        self.offsets: list[int] = []
        place, place_wait = arena.place, arena.place_wait

        def counted(buffers: Sequence[Any]) -> list[tuple[int, int]]:
            return self._note(place(buffers))

        async def counted_wait(buffers: Sequence[Any], timeout: float | None = None) -> list[tuple[int, int]]:
            return self._note(await place_wait(buffers, timeout))

        arena.place, arena.place_wait = counted, counted_wait

    def _note(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        self.calls += 1
        self.bytes += sum(n for _, n in pairs)
        self.offsets += [o for o, n in pairs if n]
        return pairs


async def _until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


def _released() -> None:
    gc.collect()


async def _fetch_all(srv: Server, ticket: str, options: ClientOptions = COPY) -> pa.Table:
    return await fetch_async(srv.uri, ticket, data_uri=srv.data_uri, options=options)


# ----------------------------------------------------------------------------------------------------- (1)


@pytest.mark.parametrize(
    ("transport", "memory", "split"),
    [
        ("tcp", "shm", False),
        ("tcp", "shm", True),
        pytest.param("ucx", "shm", False, marks=pytest.mark.ucx),
        pytest.param("ucx", "ucx", True, marks=pytest.mark.ucx),
    ],
    ids=["tcp-shm-combined", "tcp-shm-split", "ucx-shm-combined", "ucx-rma-split"],
)
async def test_a_stored_dataset_is_placed_once_for_every_client(
    transport: str, memory: str, split: bool, tmp_path: Path
) -> None:
    batches = _batches(4)
    expected = pa.Table.from_batches(batches)
    path = _ipc_file(tmp_path / "stored.arrow", batches)
    async with Server(
        {"stored": path},
        transport=transport,
        body="pairs",
        memory=memory,
        split=split,
        arena_bytes=32 << 20,
    ) as srv:
        assert srv.arena is not None and srv.placements is not None
        arena, placements = srv.arena, srv.placements
        placed = _Placed(arena)
        first = await _fetch_all(srv, "stored")
        assert first.equals(expected)
        assert placed.calls == len(batches)
        copied, allocations = placed.bytes, arena.allocations
        assert copied >= sum(b.nbytes for b in batches) // 2
        assert await _until(lambda: placements.held_bytes == 0)  # freed, but resident
        assert arena.allocations == allocations and len(placements) == len(batches)

        second = await _fetch_all(srv, "stored")
        assert second.equals(expected)
        assert placed.calls == len(batches) and placed.bytes == copied, "the second request copied again"
        assert placements.hits == len(batches)
        assert arena.allocations == allocations
        assert await _until(lambda: placements.held_bytes == 0)
        # Nobody holds them: evicting gives the arena back entirely.
        placements.evict_idle()
        assert arena.used_bytes == 0 and len(placements) == 0
        assert (await _fetch_all(srv, "stored")).equals(expected)
        assert placed.calls == 2 * len(batches)


# ----------------------------------------------------------------------------------------------------- (2)


async def test_two_zero_copy_clients_share_a_placement_and_each_frees_only_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = _batches(3)
    expected = pa.Table.from_batches(batches)
    path = _ipc_file(tmp_path / "stored.arrow", batches)
    listings = Listings(monkeypatch)
    async with Server({"stored": path}, body="pairs", arena_bytes=32 << 20) as srv:
        assert srv.arena is not None and srv.placements is not None and srv.ledger is not None
        arena, placements, ledger = srv.arena, srv.placements, srv.ledger
        placed = _Placed(arena)
        got = list(await asyncio.gather(*(_fetch_all(srv, "stored", ZERO_COPY) for _ in range(2))))
        assert all(t.equals(expected) for t in got)
        assert placed.calls == len(batches), "two clients, one placement per batch"
        clients = listings.clients()
        assert len(clients) == 2
        listed = [listings.held(c) for c in clients]
        assert listed[0] and listed[0] == listed[1], "both clients hold the same ranges"
        shared = listings.held_bytes(clients[0])
        # each holds all of it, and it is live once: the same memory
        assert [ledger.live_bytes_of(c) for c in clients] == [shared, shared] and ledger.live_bytes == shared
        used, allocations = arena.used_bytes, arena.allocations

        # The first client lets go: its listing ends, the ranges stay for the other.
        del got[0]
        _released()
        assert await _until(lambda: sorted(ledger.live_bytes_of(c) for c in clients) == [0, shared]), (
            "the first client's frees never arrived"
        )
        (holder,) = [c for c in clients if ledger.live_bytes_of(c)]
        (gone,) = [c for c in clients if c is not holder]
        assert listings.held(holder) == listed[0] and listings.held(gone) == []
        assert ledger.live_bytes == shared
        assert arena.used_bytes == used and arena.allocations == allocations
        assert placements.held_bytes == used
        assert got[0].equals(expected)

        del got
        _released()
        assert await _until(lambda: placements.held_bytes == 0)
        assert arena.used_bytes == used, "unreferenced placements stay resident"


# ----------------------------------------------------------------------------------------------------- (3)


async def test_a_dataset_larger_than_the_arena_evicts_only_what_nobody_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10 batches of 800 KB through a 4 MiB arena (room for 5): resident placements must be evicted, but
    # never the two batches a zero-copy client keeps.
    batches = _big_batches(10)
    path = _ipc_file(tmp_path / "big.arrow", batches)
    listings = Listings(monkeypatch)
    # The client keeps two batches while streaming: more than the default quota (a quarter of the arena).
    async with Server({"big": path}, body="pairs", arena_bytes=4 << 20, max_unfreed_bytes=4 << 20) as srv:
        assert srv.arena is not None and srv.placements is not None and srv.ledger is not None
        arena, placements, ledger = srv.arena, srv.placements, srv.ledger
        kept: list[pa.RecordBatch] = []
        n = 0
        b: pa.RecordBatch
        async for b in stream_batches(srv.uri, "big", data_uri=srv.data_uri, options=ZERO_COPY):
            if n in (1, 6):
                kept.append(b)
            n += 1
            del b
        assert n == 10
        _released()
        assert await _until(lambda: len(listings.held(listings.clients()[0])) == 2)
        (holder,) = listings.clients()
        assert ledger.live_bytes_of(holder) == listings.held_bytes(holder) == ledger.live_bytes
        held = {o for o, _ in listings.held(holder)}
        placed = _Placed(arena)  # from here on: every new placement

        for options in (COPY, COPY, ZERO_COPY):
            # (a zero-copy client streams: it cannot hold 10 batches in an arena with room for 5)
            i = 0
            async for b in stream_batches(srv.uri, "big", data_uri=srv.data_uri, options=options):
                assert b.equals(batches[i])
                i += 1
                del b
            assert i == len(batches)
            _released()
            # the kept batches are untouched: their ranges were never handed out again
            assert [b.column(0) for b in kept] == [batches[1].column(0), batches[6].column(0)]
        assert placed.calls > 0 and placements.evicted > 0
        assert not held & set(placed.offsets), "a range a client holds was placed over"
        assert placements.hits >= 3 * 2  # the held batches were listed from their placements every time
        others = [c for c in listings.clients() if c is not holder]
        assert await _until(lambda: not any(ledger.live_bytes_of(c) for c in others))
        assert {o for o, _ in listings.held(holder)} == held
        assert ledger.live_bytes_of(holder) == listings.held_bytes(holder) == ledger.live_bytes
        del kept
        _released()
        assert await _until(lambda: placements.held_bytes == 0)


# ----------------------------------------------------------------------------------------------------- (4)


async def _raw_fetch(port: int, want: int, ticket: bytes, bodies: int) -> tuple[Any, list[int]]:
    """A raw client: asks for ``ticket`` and takes its ``bodies`` pair lists; returns it and the offsets."""
    conn = await connect_tcp("127.0.0.1", port)
    await conn.send_tagged(want, ticket)
    offsets: list[int] = []
    for _ in range(bodies):
        msg = await asyncio.wait_for(conn.recv_tagged(0, 0), 10)
        assert msg.tag >> 56 == 1
        offsets += [int(o) for o, n in decode_pairs(msg.view()).pairs.tolist() if n]
    return conn, offsets


async def _remote_error(conn: Any) -> RemoteError:
    while True:
        buf = await asyncio.wait_for(conn.recv(), 10)
        if buf[:1] == b"\xe0":
            return RemoteError("bad_free_data", bytes(buf[5:]).decode())


async def test_freeing_a_range_listed_only_to_another_client_is_rejected_for_that_client_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = _batches(3)
    expected = pa.Table.from_batches(batches)
    path = _ipc_file(tmp_path / "stored.arrow", batches)
    listings = Listings(monkeypatch)
    async with Server({"stored": path}, body="pairs", arena_bytes=32 << 20) as srv:
        assert srv.ledger is not None and srv.placements is not None
        ledger = srv.ledger
        uri = DissocURI.parse(srv.uri)
        assert uri.free_data is not None
        held = await _fetch_all(srv, "stored", ZERO_COPY)
        (holder,) = listings.clients()
        mine = listings.held(holder)
        assert ledger.live_bytes_of(holder) == listings.held_bytes(holder) > 0

        # The rogue is listed the same resident ranges, frees them (fine), then frees them again.
        rogue, offsets = await _raw_fetch(uri.port, uri.want_data, b"stored", len(batches))
        assert sorted(offsets) == [o for o, _ in mine]
        (rogue_at_server,) = [c for c in listings.clients() if c is not holder]
        assert listings.held(rogue_at_server) == mine
        await rogue.send_tagged(uri.free_data, encode_free(offsets))
        assert await _until(lambda: ledger.live_bytes_of(rogue_at_server) == 0)
        assert listings.held(rogue_at_server) == []
        await rogue.send_tagged(uri.free_data, encode_free(offsets[:1]))
        error = await _remote_error(rogue)
        assert "another client" in str(error) and f"{offsets[0]:#x}" in str(error)
        await rogue.close()

        # Nothing changed for the holder: its listing (and it alone holds the ranges), and the memory under
        # its batches.
        assert listings.held(holder) == mine and listings.held(rogue_at_server) == []
        assert ledger.live_bytes_of(holder) == listings.held_bytes(holder) == ledger.live_bytes
        assert held.equals(expected)
        assert (await _fetch_all(srv, "stored")).equals(expected)
        del held
        _released()
        assert await _until(lambda: srv.placements is not None and srv.placements.held_bytes == 0)


# ----------------------------------------------------------------------------------------------------- (5)


async def test_removing_or_replacing_a_dataset_releases_its_placements(tmp_path: Path) -> None:
    a = _batches(2)
    old, new = _batches(3, seed=1000), _batches(2, seed=5000)
    path = _ipc_file(tmp_path / "a.arrow", a)
    async with Server(
        {"a": path, "b": pa.Table.from_batches(old)}, body="pairs", arena_bytes=32 << 20
    ) as srv:
        assert srv.arena is not None and srv.placements is not None
        arena, placements = srv.arena, srv.placements
        assert (await _fetch_all(srv, "a")).equals(pa.Table.from_batches(a))
        assert await _until(lambda: placements.held_bytes == 0)
        assert arena.used_bytes > 0  # resident, nobody holds it
        srv.remove("a")
        assert arena.used_bytes == 0 and len(placements) == 0, "an unreferenced placement is released at once"

        held = await _fetch_all(srv, "b", ZERO_COPY)
        assert held.equals(pa.Table.from_batches(old))
        used = arena.used_bytes
        srv.add("b", pa.Table.from_batches(new), replace=True)
        assert arena.used_bytes == used, "a held placement stays until its holder lets go"
        assert held.equals(pa.Table.from_batches(old))
        del held
        _released()
        assert await _until(lambda: arena.used_bytes == 0), "the replaced dataset's placements stay"
        assert len(placements) == 0

        # The new data is served, not the old placements
        assert (await _fetch_all(srv, "b")).equals(pa.Table.from_batches(new))
        assert len(placements) == len(new)


async def test_a_rewritten_stream_file_is_placed_again(tmp_path: Path) -> None:
    path = tmp_path / "s.arrows"

    def write(batches: list[pa.RecordBatch]) -> None:
        with pa.ipc.new_stream(path, batches[0].schema) as w:
            for b in batches:
                w.write_batch(b)

    first, second = _batches(2), _batches(3, seed=77)
    write(first)
    async with Server({"s": str(path)}, body="pairs", arena_bytes=32 << 20) as srv:
        assert (await _fetch_all(srv, "s")).equals(pa.Table.from_batches(first))
        assert (await _fetch_all(srv, "s")).equals(pa.Table.from_batches(first))
        assert srv.placements is not None and srv.placements.hits == 2
        write(second)
        assert (await _fetch_all(srv, "s")).equals(pa.Table.from_batches(second))


# ----------------------------------------------------------------------------------------------------- (6)


@pytest.mark.parametrize(
    ("resident", "source"),
    [(False, "file"), (True, "factory")],
    ids=["resident-false", "reader-factory"],
)
async def test_without_residency_every_request_places_its_own_copy(
    resident: bool, source: str, tmp_path: Path
) -> None:
    # (6) resident=False places per request as before; (7) a RecordBatchReader factory is never resident.
    batches = _batches(3)
    expected = pa.Table.from_batches(batches)
    obj: Any = _ipc_file(tmp_path / "f.arrow", batches)
    if source == "factory":
        obj = lambda: expected.to_reader()  # noqa: E731
    async with Server({"t": obj}, body="pairs", arena_bytes=32 << 20, resident=resident) as srv:
        assert srv.arena is not None and srv.placements is not None
        arena, placements = srv.arena, srv.placements
        placed = _Placed(arena)
        for round_ in (1, 2):
            got = await _fetch_all(srv, "t", ZERO_COPY)
            assert got.equals(expected)
            assert placed.calls == round_ * len(batches)
            assert len(placements) == 0 and placements.hits == 0
            del got
            _released()
            assert await _until(lambda: arena.used_bytes == 0), "a freed per-request copy stays in the arena"


# ---------------------------------------------------------------------------------------------- one client


async def test_a_client_asking_again_while_holding_gets_a_copy_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # free_data lists a range once per client: a connection that still holds a resident batch and asks for
    # it again gets a private copy, freed on its own.
    batches = _batches(2)
    path = _ipc_file(tmp_path / "f.arrow", batches)
    listings = Listings(monkeypatch)
    async with Server({"f": path}, body="pairs", arena_bytes=32 << 20) as srv:
        assert srv.ledger is not None and srv.placements is not None and srv.arena is not None
        ledger, placements, arena = srv.ledger, srv.placements, srv.arena
        uri = DissocURI.parse(srv.uri)
        assert uri.free_data is not None
        conn, first = await _raw_fetch(uri.port, uri.want_data, b"f", len(batches))
        await conn.send_tagged(uri.want_data, b"f")
        second: list[int] = []
        for _ in batches:
            msg = await asyncio.wait_for(conn.recv_tagged(0, 0), 10)
            second += [int(o) for o, n in decode_pairs(msg.view()).pairs.tolist() if n]
        assert not set(first) & set(second)
        assert all(placements.is_resident(o) for o in first)
        assert not any(placements.is_resident(o) for o in second)
        (client,) = listings.clients()
        assert sorted(o for o, _ in listings.held(client)) == sorted(first + second)
        assert ledger.live_bytes_of(client) == listings.held_bytes(client)
        resident = placements.resident_bytes
        await conn.send_tagged(uri.free_data, encode_free(second))
        assert await _until(lambda: arena.used_bytes == resident)  # the private copy went at once
        await conn.close()
        assert await _until(lambda: placements.held_bytes == 0)
        assert all(placements.is_resident(o) for o in first)  # left resident, for the next client
