"""Private arenas (``Server(private_memory=True)``, ``dissoc serve --private-memory``): each data connection's
pair lists point into an arena of its own, announced in band once its want_data is accepted.

Real shared memory throughout; real UCX RMA where ucxx is installed (``ucx`` marker)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, RawServer, cli_server, eventually, read_lines, tagged, untagged, within

from dissoc.client import ClientOptions, fetch, fetch_async, stream_batches
from dissoc.codec import MessageEncoder
from dissoc.errors import DissocError, ProtocolError, RemoteError
from dissoc.memory.shm import SHM_DIR, ShmView
from dissoc.protocol import (
    ARENA_TAG,
    BODY_PAIRS,
    ERROR_TAG,
    decode_arena,
    encode_arena,
    encode_eos,
    encode_metadata_header,
    encode_pairs,
    make_body_tag,
)
from dissoc.server import Server
from dissoc.tokens import Secret
from dissoc.uri import DissocURI

pytestmark = pytest.mark.timeout(120)

ZERO_COPY = ClientOptions(zero_copy=True, timeout=20)
SPLIT = pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])

A_MARK = 0x0A0A0A0A0A0A0A0A
B_MARK = 0x0B0B0B0B0B0B0B0B


def _marked(mark: int, rows: int = 100_000, batches: int = 2) -> pa.Table:
    """``batches`` batches of one int64 column holding ``mark`` in every row (800 KB a batch by default)."""
    batch = pa.record_batch([pa.array(np.full(rows, mark, dtype=np.int64))], names=["v"])
    return pa.Table.from_batches([batch] * batches)


def _count(segment: str, mark: int) -> int:
    """How many 8-byte words of the named segment hold ``mark``."""
    with ShmView.attach(segment) as view:
        words = view.numpy()
        return int(np.count_nonzero(words[: words.size // 8 * 8].view(np.int64) == mark))


def _exists(segment: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, segment))


async def _released(srv: Server) -> bool:
    """Collect what the test let go of, then wait until every private arena is gone."""
    gc.collect()
    private = srv.private
    assert private is not None
    return await eventually(lambda: private.open_count == 0, 10)


# ---------------------------------------------------------------------------------------- the announcement


def test_the_announcement_round_trips_and_refuses_what_is_not_one() -> None:
    payload = encode_arena("ucx", b"\x00rkey\xff", {"rma_worker": "d29ya2Vy", "rma_base": "4096"})
    got = decode_arena(payload)
    assert (got.memory, got.remote_handle) == ("ucx", b"\x00rkey\xff")
    assert got.params == {"rma_worker": "d29ya2Vy", "rma_base": "4096"}
    assert ARENA_TAG == 0xE1 << 56 and ERROR_TAG == 0xE0 << 56
    for bad in (
        b"\xff",
        b"[]",
        b'{"memory": "cuda", "remote_handle": "aGFuZGxl"}',
        b'{"memory": "shm", "remote_handle": "!!"}',
        b'{"memory": "shm", "remote_handle": ""}',
        b'{"memory": "shm", "remote_handle": "aGFuZGxl", "rma_base": 1}',
        b'{"memory": "shm", "remote_handle": "aGFuZGxl", "want_data": "1"}',
        b" " * (64 << 10) + b"{}",
    ):
        with pytest.raises(ProtocolError, match="arena announcement"):
            decode_arena(bad)
    with pytest.raises(ValueError):
        encode_arena("cuda", b"h")
    with pytest.raises(ValueError):
        encode_arena("shm", b"")


def _raw_stream(*, announce: bytes | None) -> list[bytes]:
    """A private-arena stream as a raw peer sends it: schema, one batch's metadata, an optional arena
    announcement, then the batch's pair list."""
    schema = pa.schema([("v", pa.int64())])
    encoder = MessageEncoder(schema)
    (message,) = encoder.encode(pa.record_batch([pa.array([1, 2, 3], pa.int64())], schema=schema))
    frames = [
        untagged(encode_metadata_header(0) + bytes(encoder.schema_message().metadata)),
        untagged(encode_metadata_header(1) + bytes(message.metadata)),
    ]
    if announce is not None:
        frames.append(tagged(ARENA_TAG, announce))
    frames += [tagged(make_body_tag(1, BODY_PAIRS), encode_pairs([(0, 24)])), untagged(encode_eos(2))]
    return frames


@pytest.mark.parametrize(
    ("announce", "expected"),
    [
        (None, "announced no arena"),
        (encode_arena("ucx", b"rkey", {"rma_base": "0"}), "expected memory=shm"),
        (b'{"memory": "shm"}', "non-empty remote_handle"),
    ],
    ids=["none", "other-memory", "malformed"],
)
async def test_a_client_refuses_pairs_without_a_good_announcement(
    announce: bytes | None, expected: str
) -> None:
    async with RawServer(lambda: _raw_stream(announce=announce)) as raw:
        uri = raw.uri() + "&free_data=5&memory=shm&arena=private"
        with pytest.raises(ProtocolError, match=expected):
            await within(10, fetch_async(uri, "x", options=ClientOptions(timeout=5)), "the client")


# ------------------------------------------------------------------------------------------- shared memory


@SPLIT
async def test_the_data_uri_names_no_arena(split: bool) -> None:
    async with Server(
        {"a": _marked(A_MARK)}, body="pairs", private_memory=True, arena_bytes=16 << 20, split=split
    ) as srv:
        for text in (srv.uri, srv.data_uri):
            uri = DissocURI.parse(text)
            assert uri.remote_handle is None
            assert not any(k.startswith("rma_") for k in uri.params), uri
        data = DissocURI.parse(srv.data_uri)
        assert data.memory == "shm" and data.params["arena"] == "private" and data.free_data is not None
        assert srv.arena is None and srv.placements is None  # no shared arena at all
        private = srv.private
        assert private is not None and private.open_count == 0  # made only for an accepted want_data


@SPLIT
async def test_two_clients_get_arenas_of_their_own_holding_only_their_own_data(split: bool) -> None:
    a, b = _marked(A_MARK), _marked(B_MARK)
    async with Server(
        {"a": a, "b": b}, body="pairs", private_memory=True, arena_bytes=32 << 20, split=split
    ) as srv:
        private = srv.private
        assert private is not None and private.capacity == 8 << 20  # a quarter of the arena
        # zero-copy tables keep their connections (and so their arenas) open while they live
        got_a = await fetch_async(srv.uri, "a", data_uri=srv.data_uri, options=ZERO_COPY)
        got_b = await fetch_async(srv.uri, "b", data_uri=srv.data_uri, options=ZERO_COPY)
        assert got_a.equals(a) and got_b.equals(b)
        names = private.names()
        assert len(names) == 2
        for name in names:
            st = os.stat(os.path.join(SHM_DIR, name))
            assert st.st_size == private.capacity  # sized by the per-client quota
            assert stat.S_IMODE(st.st_mode) & 0o077 == 0  # no access for group or others
        # each arena holds one dataset's bytes, and none of the other's
        counts = sorted((_count(n, A_MARK), _count(n, B_MARK)) for n in names)
        rows = a.num_rows
        assert counts == [(0, rows), (rows, 0)], counts
        del got_a, got_b
        assert await _released(srv)
        assert not any(_exists(n) for n in names)  # unlinked when the connections closed


@SPLIT
async def test_only_a_served_client_is_told_an_arena(split: bool) -> None:
    secret = Secret(b"0123456789abcdef0123456789abcdef")
    table = _marked(A_MARK, rows=10_000, batches=2)
    async with Server(
        {"a": table, "b": table},
        body="pairs",
        private_memory=True,
        arena_bytes=8 << 20,
        split=split,
        secret=secret,
    ) as srv:
        private = srv.private
        assert private is not None
        forged = Secret(b"another secret of the same length").mint("a", ttl=60)
        for ticket, code in (("a", "unauthorized"), (forged, "unauthorized"), (secret.mint("zz"), "unknown")):
            with pytest.raises(RemoteError) as caught:
                await within(20, fetch_async(srv.uri, ticket, data_uri=srv.data_uri), "a refused client")
            assert caught.value.code.startswith(code)
        assert private.opened == 0  # nothing was made, so nothing could be announced
        got = await fetch_async(srv.uri, secret.mint("a", ttl=60), data_uri=srv.data_uri)
        assert got.equals(table) and private.opened == 1


@SPLIT
async def test_a_copying_client_leaves_nothing_behind(split: bool) -> None:
    table = _marked(A_MARK, rows=50_000, batches=6)
    async with Server(
        {"a": table}, body="pairs", private_memory=True, arena_bytes=8 << 20, split=split
    ) as srv:
        private = srv.private
        assert private is not None
        seen: set[str] = set()
        rows = 0
        async for batch in stream_batches(srv.uri, "a", data_uri=srv.data_uri):
            seen.update(private.names())
            rows += batch.num_rows
        assert rows == table.num_rows and len(seen) == 1
        assert await _released(srv)
        assert not _exists(seen.pop()) and private.opened == 1


async def test_zero_copy_batches_free_their_ranges_in_the_private_arena_when_released() -> None:
    batch = pa.record_batch([pa.array(np.arange(100_000))], names=["id"])
    table = pa.Table.from_batches([batch] * 20)  # 16 MB through a 2 MiB arena: frees as batches go
    async with Server(
        {"t": table}, body="pairs", private_memory=True, arena_bytes=8 << 20, max_unfreed_bytes=2 << 20
    ) as srv:
        n = 0
        async for b in stream_batches(srv.uri, "t", data_uri=srv.data_uri, options=ZERO_COPY):
            assert isinstance(b, pa.RecordBatch) and b.column(0).equals(batch.column(0))
            n += 1
            del b
        assert n == 20
        assert await _released(srv)


async def test_a_zero_copy_fetch_through_a_private_arena() -> None:
    table = _marked(A_MARK, rows=20_000, batches=3)
    async with Server({"t": table}, body="pairs", private_memory=True, arena_bytes=16 << 20) as srv:
        private = srv.private
        assert private is not None
        got = await fetch_async(srv.uri, "t", data_uri=srv.data_uri, options=ZERO_COPY)
        assert got.equals(table)
        (served,) = private.arenas()
        values = got.column(0).chunk(0).buffers()[1]
        assert values is not None
        # the batch is a view of the server's private segment: written there, seen here
        raw = served.arena.array.view(np.int64)
        hits = np.flatnonzero(raw == A_MARK)
        assert hits.size == table.num_rows
        raw[hits[0]] = -7
        assert -7 in got.column(0).to_pylist()
        del got, values, raw
        assert await _released(srv)


def test_the_synchronous_calls_read_a_private_arena() -> None:
    from helpers.e2e import ServerThread

    table = _marked(B_MARK, rows=10_000, batches=3)
    with ServerThread({"t": table}, body="pairs", private_memory=True, arena_bytes=16 << 20) as srv:
        assert fetch(srv.uri, "t", data_uri=srv.data_uri).equals(table)
        got = fetch(srv.uri, "t", data_uri=srv.data_uri, options=ZERO_COPY)
        assert got.equals(table)


_KILLED_CLIENT = """
import asyncio, sys
from dissoc.client import ClientOptions, stream_batches

async def main() -> None:
    held = []
    options = ClientOptions(zero_copy=True, timeout=60)
    async for batch in stream_batches(sys.argv[1], "a", data_uri=sys.argv[2], options=options):
        held.append(batch)
        print("holding", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@SPLIT
@pytest.mark.parametrize("memory", ["shm", pytest.param("ucx", marks=pytest.mark.ucx)])
async def test_a_client_killed_mid_stream_leaves_no_arena(split: bool, memory: str) -> None:
    table = _marked(A_MARK, rows=100_000, batches=8)
    async with Server(
        {"a": table},
        transport="ucx" if memory == "ucx" else "tcp",
        body="pairs",
        memory=memory,
        private_memory=True,
        arena_bytes=16 << 20,
        split=split,
    ) as srv:
        private = srv.private
        assert private is not None
        proc = subprocess.Popen(
            [PYTHON, "-c", _KILLED_CLIENT, srv.uri, srv.data_uri],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            await asyncio.to_thread(read_lines, proc, 1, 60)
            names = private.names()
            assert len(names) == 1 and _exists(names[0])
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        assert await eventually(lambda: private.open_count == 0, 15), private
        assert not _exists(names[0]) and private.registered_regions == 0
        # and the server serves the next client
        assert (await fetch_async(srv.uri, "a", data_uri=srv.data_uri)).equals(table)


async def test_arenas_of_connections_still_open_go_when_the_server_stops() -> None:
    table = _marked(A_MARK, rows=10_000, batches=2)
    srv = Server({"a": table}, body="pairs", private_memory=True, arena_bytes=8 << 20)
    async with srv:
        got = await fetch_async(srv.uri, "a", data_uri=srv.data_uri, options=ZERO_COPY)
        assert srv.private is not None
        names = srv.private.names()
        assert len(names) == 1
    assert not _exists(names[0])
    assert got.equals(table)  # the client's mapping outlives the name
    del got
    gc.collect()


# ------------------------------------------------------------------------------------------------- limits


def test_private_memory_is_refused_where_it_does_not_apply() -> None:
    with pytest.raises(DissocError, match=r"private_memory.*not 'cuda'"):
        Server({}, body="pairs", memory="cuda", private_memory=True)
    with pytest.raises(DissocError, match="needs body='pairs'"):
        Server({}, private_memory=True)
    with pytest.raises(DissocError, match="more than arena_bytes"):
        Server({}, body="pairs", private_memory=True, arena_bytes=4 << 20, max_unfreed_bytes=8 << 20)


@SPLIT
async def test_one_arena_too_many_is_refused_with_arenas_exhausted(split: bool) -> None:
    a = _marked(A_MARK, rows=10_000, batches=2)
    async with Server(
        {"a": a},
        body="pairs",
        private_memory=True,
        arena_bytes=8 << 20,
        max_unfreed_bytes=4 << 20,
        split=split,
    ) as srv:
        private = srv.private
        assert private is not None and private.limit == 2
        held = [await fetch_async(srv.uri, "a", data_uri=srv.data_uri, options=ZERO_COPY) for _ in range(2)]
        assert private.open_count == 2
        with pytest.raises(RemoteError) as caught:
            await within(20, fetch_async(srv.uri, "a", data_uri=srv.data_uri), "the third client")
        assert caught.value.code == "arenas_exhausted"
        assert "max_unfreed_bytes" in str(caught.value) and private.refused == 1
        held.pop()
        gc.collect()
        assert await eventually(lambda: private.open_count == 1, 10)
        assert (await fetch_async(srv.uri, "a", data_uri=srv.data_uri)).equals(a)
        del held
        assert await _released(srv)


async def test_a_batch_larger_than_the_private_arena_fails_its_stream_clearly() -> None:
    big = pa.table({"v": np.arange(1 << 20, dtype=np.int64)})  # one 8 MiB batch
    async with Server(
        {"big": big}, body="pairs", private_memory=True, arena_bytes=16 << 20, max_unfreed_bytes=4 << 20
    ) as srv:
        with pytest.raises(RemoteError) as caught:
            await within(20, fetch_async(srv.uri, "big", data_uri=srv.data_uri), "the fetch")
        assert caught.value.code == "stream_failed"
        assert "private arena" in str(caught.value) and "max_unfreed_bytes" in str(caught.value)
        assert await _released(srv)


async def test_a_client_that_holds_its_arena_full_and_never_frees_is_failed() -> None:
    table = _marked(A_MARK, rows=100_000, batches=8)  # 6.4 MB into a 2 MiB arena
    async with Server(
        {"a": table}, body="pairs", private_memory=True, arena_bytes=8 << 20, max_unfreed_bytes=2 << 20
    ) as srv:
        held: list[Any] = []

        async def hold_everything() -> tuple[str, str]:
            try:
                async for batch in stream_batches(srv.uri, "a", data_uri=srv.data_uri, options=ZERO_COPY):
                    held.append(batch)
            except RemoteError as e:  # kept in here: its traceback would hold the last batch
                return e.code, str(e)
            raise AssertionError("the stream ended without an error")

        code, message = await within(30, hold_everything(), "a client that never frees")
        assert code == "quota_exceeded" and "private arena" in message, message
        assert 0 < len(held) < 8
        held.clear()
        assert await _released(srv)


# --------------------------------------------------------------------------------------------------- CLI


def test_dissoc_serve_private_memory_and_cleanup_after_a_kill(tmp_path: Path) -> None:
    table = _marked(A_MARK, rows=10_000, batches=2)
    path = tmp_path / "a.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    args = (str(path), "--body", "pairs", "--private-memory", "--arena-mib", "8", "--max-unfreed-mib", "2")
    with cli_server(*args, count=1) as (proc, lines):
        line = lines[0]
        uri = DissocURI.parse(line["data_uri"])
        assert uri.remote_handle is None and uri.params["arena"] == "private"
        got = fetch(line["uri"], line["ticket"], data_uri=line["data_uri"], options=ZERO_COPY)
        assert got.equals(table)
        mine = [f for f in os.listdir(SHM_DIR) if f.startswith(f"dissoc-{proc.pid}-")]
        assert len(mine) == 1 and os.stat(os.path.join(SHM_DIR, mine[0])).st_size == 2 << 20
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert _exists(mine[0])  # a killed server cannot unlink: dissoc cleanup does
    cleaned = subprocess.run(
        [PYTHON, "-m", "dissoc.cli", "cleanup"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert cleaned.returncode == 0, cleaned.stderr
    assert mine[0] in {r["name"] for r in json.loads(cleaned.stdout)["removed"]}
    assert not _exists(mine[0])
    del got
    gc.collect()


def test_dissoc_serve_refuses_private_memory_for_cuda(tmp_path: Path) -> None:
    path = tmp_path / "a.arrow"
    table = _marked(A_MARK, rows=10, batches=1)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    serve = ["serve", str(path), "--body", "pairs", "--memory", "cuda", "--private-memory"]
    got = subprocess.run(
        [PYTHON, "-m", "dissoc.cli", *serve],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 1 and "private_memory" in got.stderr, got.stderr


# ---------------------------------------------------------------------------------------------------- UCX


@pytest.mark.ucx
@SPLIT
async def test_ucx_clients_get_regions_and_keys_of_their_own(split: bool) -> None:
    a, b = _marked(A_MARK, rows=50_000, batches=4), _marked(B_MARK, rows=50_000, batches=4)
    async with Server(
        {"a": a, "b": b},
        transport="ucx",
        body="pairs",
        memory="ucx",
        private_memory=True,
        arena_bytes=32 << 20,
        split=split,
    ) as srv:
        data = DissocURI.parse(srv.data_uri)
        assert data.memory == "ucx" and data.remote_handle is None and data.params["arena"] == "private"
        assert not any(k.startswith("rma_") for k in data.params)
        private = srv.private
        assert private is not None
        options = ClientOptions(timeout=20)
        first = stream_batches(srv.uri, "a", data_uri=srv.data_uri, options=options)
        second = stream_batches(srv.uri, "b", data_uri=srv.data_uri, options=options)
        got_a = [await anext(first)]
        got_b = [await anext(second)]
        arenas = private.arenas()
        assert len(arenas) == 2 and private.registered_regions == 2
        # a registration (and a packed remote key) each; the keys may be byte-for-byte equal where UCX
        # emulates RMA in software (tcp, shared memory on one host: an empty key), see the README
        assert arenas[0]._registration is not arenas[1]._registration
        regions = sorted((int(s.params["rma_base"]), int(s.params["rma_length"])) for s in arenas)
        assert regions[0][0] + regions[0][1] <= regions[1][0]  # disjoint regions
        got_a += [batch async for batch in first]
        got_b += [batch async for batch in second]
        assert pa.Table.from_batches(got_a).equals(a) and pa.Table.from_batches(got_b).equals(b)
        assert await eventually(lambda: private.open_count == 0, 10)
        assert private.registered_regions == 0  # deregistered with their connections


@pytest.mark.ucx
async def test_ucx_one_arena_too_many_is_refused() -> None:
    a = _marked(A_MARK, rows=50_000, batches=4)
    async with Server(
        {"a": a},
        transport="ucx",
        body="pairs",
        memory="ucx",
        private_memory=True,
        arena_bytes=4 << 20,
        max_unfreed_bytes=4 << 20,
    ) as srv:
        options = ClientOptions(timeout=20)
        first = stream_batches(srv.uri, "a", data_uri=srv.data_uri, options=options)
        held = await anext(first)
        with pytest.raises(RemoteError) as caught:
            await within(20, fetch_async(srv.uri, "a", data_uri=srv.data_uri, options=options), "the second")
        assert caught.value.code == "arenas_exhausted"
        rest = [batch async for batch in first]
        assert pa.Table.from_batches([held, *rest]).equals(a)
        private = srv.private
        assert private is not None
        assert await eventually(lambda: private.registered_regions == 0, 10)
