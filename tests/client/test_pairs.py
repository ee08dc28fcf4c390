"""Body type 1 over TCP: buffers placed in the server's shared memory, address/length pairs on the wire."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dissoc.client import ClientOptions, fetch_async, stream_batches
from dissoc.errors import DissocError, RemoteError
from dissoc.protocol import encode_free
from dissoc.server import Server
from dissoc.transport import connect_tcp
from dissoc.uri import DissocURI

pytestmark = pytest.mark.timeout(120)


def _segments() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("dissoc-")}
    except FileNotFoundError:
        return set()


def _table(rows: int = 50_000) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(np.arange(rows)),
            "s": pa.array([None if i % 11 == 0 else f"v{i}" for i in range(rows)]),
            "d": pa.array([f"k{i % 5}" for i in range(rows)]).dictionary_encode(),
            "l": pa.array([[i, i + 1] for i in range(rows)], pa.list_(pa.int64())),
        }
    )


async def _until(condition: object, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if condition():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.01)
    return bool(condition())  # type: ignore[operator]


@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
async def test_pairs_round_trip_and_everything_is_freed(split: bool, tmp_path: Path) -> None:
    table = _table()
    path = tmp_path / "stored.arrow"
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table, max_chunksize=10_000)
    async with Server(
        {"t": table, "stored": str(path)}, body="pairs", split=split, arena_bytes=32 << 20
    ) as srv:
        data = DissocURI.parse(srv.data_uri)
        assert data.remote_handle is not None
        segment = data.remote_handle.decode().lstrip("/")
        assert segment in _segments()
        assert data.memory == "shm" and data.remote_handle is not None and data.free_data is not None
        # created 0600 (no other user), then read-only once the server has mapped it (no later writer)
        assert os.stat(f"/dev/shm/{data.remote_handle.decode()}").st_mode & 0o777 == 0o400
        for ticket in ("t", "stored"):
            got = await fetch_async(srv.uri, ticket, data_uri=srv.data_uri)
            assert got.equals(table)
        assert srv.arena is not None and srv.placements is not None
        arena, placements = srv.arena, srv.placements
        # Every client freed everything: what stays in the arena is resident placements nobody holds.
        assert await _until(lambda: placements.held_bytes == 0), f"{placements.held_bytes} bytes never freed"
        assert placements.evict_idle() > 0
        assert arena.used_bytes == 0
    assert segment not in _segments(), "the server's segment must be unlinked when it closes"


async def test_a_dataset_larger_than_the_arena_streams_through_it() -> None:
    # 40 batches of ~800 KiB through a 4 MiB arena: the server waits for frees instead of failing.
    rows = 100_000
    batch = pa.record_batch([pa.array(np.arange(rows))], names=["id"])
    table = pa.Table.from_batches([batch] * 40)
    async with Server({"t": table}, body="pairs", arena_bytes=4 << 20) as srv:
        n = 0
        b: pa.RecordBatch
        async for b in stream_batches(srv.uri, "t", data_uri=srv.data_uri):
            assert b.column(0).equals(batch.column(0))
            n += 1
        assert n == 40


async def test_a_client_that_leaves_gives_its_ranges_back() -> None:
    table = _table(200_000)
    async with Server({"t": table.combine_chunks()}, body="pairs", arena_bytes=64 << 20) as srv:
        arena, placements = srv.arena, srv.placements
        assert arena is not None and placements is not None
        conn = await connect_tcp("127.0.0.1", DissocURI.parse(srv.uri).port)
        await conn.send_tagged(DissocURI.parse(srv.uri).want_data, b"t")
        # Take the body messages but never free them, then leave.
        await asyncio.wait_for(conn.recv_tagged(0, 0), 10)
        assert await _until(lambda: arena.used_bytes > 0)
        await conn.close()
        assert await _until(lambda: placements.held_bytes == 0), "a departed client's ranges must be released"
        got = await fetch_async(srv.uri, "t", data_uri=srv.data_uri)  # and the server still serves
        assert got.equals(table)


async def test_freeing_someone_elses_or_unknown_addresses_is_rejected_for_that_client_only() -> None:
    table = _table(20_000)
    async with Server({"t": table}, body="pairs") as srv:
        uri = DissocURI.parse(srv.uri)
        assert uri.free_data is not None
        rogue = await connect_tcp("127.0.0.1", uri.port)
        await rogue.send_tagged(uri.free_data, encode_free([123456789]))
        with pytest.raises(DissocError):
            # The server answers with an error message and closes this connection.
            while True:
                buf = await asyncio.wait_for(rogue.recv(), 10)
                if buf[:1] == b"\xe0":
                    raise RemoteError("bad_free_data", bytes(buf[5:]).decode())
        await rogue.close()
        got = await fetch_async(srv.uri, "t", data_uri=srv.data_uri, options=ClientOptions(timeout=10))
        assert got.equals(table)


def test_cli_serves_pairs_and_cleans_up(tmp_path: Path) -> None:
    table = _table(30_000)
    path = tmp_path / "data.arrow"
    with pa.ipc.new_file(path, table.schema) as w:
        w.write_table(table)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dissoc.cli", "serve", "--body", "pairs", "--memory", "shm", str(path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert "memory=shm" in info["data_uri"] and "remote_handle=" in info["data_uri"]
        handle = DissocURI.parse(info["data_uri"]).remote_handle
        assert handle is not None
        segment = handle.decode().lstrip("/")
        assert segment in _segments()
        out = tmp_path / "out.arrows"
        got = subprocess.run(
            [
                sys.executable,
                "-m",
                "dissoc.cli",
                "get",
                info["uri"],
                "data",
                "--data-uri",
                info["data_uri"],
                "-o",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["rows"] == table.num_rows
        assert pa.ipc.open_stream(out).read_all().equals(table)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    assert segment not in _segments()


def _cuda_device_present() -> bool:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no cupy, or no usable device
        return False


def _cupy_installed() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--body", "pairs", "--memory", "cuda"], "cuda"),
        (["--body", "pairs", "--memory", "ucx"], "transport='ucx'"),
        (["--memory", "shm"], "needs body='pairs'"),
    ],
    ids=["cuda-without-a-device", "ucx-over-tcp", "memory-without-pairs"],
)
def test_cli_refuses_memory_kinds_it_does_not_have(tmp_path: Path, args: list[str], expected: str) -> None:
    if "cuda" in args and _cuda_device_present():
        pytest.skip("a CUDA device is present: --memory cuda is served (tests/device/test_e2e.py covers it)")
    path = tmp_path / "x.arrow"
    with pa.ipc.new_file(path, pa.schema([("a", pa.int64())])) as w:
        w.write_table(pa.table({"a": [1]}))
    env = {k: v for k, v in os.environ.items() if k != "DISSOC_DEVICE_BACKEND"}  # no fake device either
    r = subprocess.run(
        [sys.executable, "-m", "dissoc.cli", "serve", *args, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert expected in r.stderr and "Traceback" not in r.stderr
    if "cuda" in args and not _cupy_installed():
        assert "dissoc[gpu]" in r.stderr, "the error must say how to get device memory"
