"""End to end over the UCX transport (``transport="ucx"``, scheme ``ucx://``): the TCP suite's round trips,
both connection paths (through the listener, by worker address), peers going away on either side, a slow
consumer, pairs over shared memory, the command line, and 32 clients at once; plus transport-level checks
for what these tests found (a closing connection's receive buffers, damaged worker addresses).

Tests where a UCX failure could abort the process (the server going away while a client receives, a bad
worker address) run the client in a child process, so that a crash is a test failure and not the end of the
test run. The ones that start processes or many clients are marked ``slow`` (``-m "not slow"`` skips them).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.e2e import (
    PYTHON,
    REPO,
    ServerThread,
    assert_ids_in_order,
    collect,
    eventually,
    listener_connections,
    ordered_table,
    read_lines,
    sample_table,
    within,
)

import dissoc
from dissoc.client import (
    ClientOptions,
    FetchStats,
    close_idle_connections_sync,
    fetch_async,
    open_stream,
    stream_batches,
)
from dissoc.datasets import ReaderFactoryDataset
from dissoc.errors import RemoteError, TransportError
from dissoc.server import Server
from dissoc.uri import DissocURI

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]

MiB = 1 << 20
LAYOUTS = [pytest.param(False, id="combined"), pytest.param(True, id="split")]
PATHS = ["listener", "address", "auto"]


def opts(path: str = "auto", **kw: Any) -> ClientOptions:
    return ClientOptions(timeout=kw.pop("timeout", 30), ucx_path=path, **kw)


def ucx_server(datasets: dict[str, Any], split: bool = False, **kw: Any) -> Server:
    return Server(datasets, transport="ucx", split=split, **kw)


async def fetch(server: Server, ticket: str, path: str = "auto", **kw: Any) -> pa.Table:
    return await within(
        30, fetch_async(server.uri, ticket, data_uri=server.data_uri, options=opts(path, **kw)), "fetch"
    )


def _ipc_file(path: Path, table: pa.Table) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def _segment_exists(uri: str) -> bool:
    """Does the shared-memory segment a pairs data URI points at (its ``remote_handle``) still exist?"""
    handle = DissocURI.parse(uri).remote_handle
    assert handle is not None
    return os.path.exists(f"/dev/shm/{handle.decode()}")


def _server_paths(server: Server) -> list[str]:
    """How each connection the server runs a handler for was set up (from its description)."""
    paths = []
    for role in server._servers:
        listener = role._listener
        assert listener is not None
        for conn in listener.connections:
            paths.append("address" if conn.description.endswith("(address)") else "listener")
    return paths


def _without_worker(uri: str) -> str:
    u = DissocURI.parse(uri)
    assert "worker" in u.params, f"a ucx server URI carries its worker address: {uri}"
    params = {k: v for k, v in u.params.items() if k != "worker"}
    return str(
        DissocURI(
            u.scheme,
            u.host,
            u.port,
            u.want_data,
            u.free_data,
            remote_handle=u.remote_handle,
            memory=u.memory,
            params=params,
        )
    )


# ---------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("split", LAYOUTS)
async def test_sample_table_round_trip(split: bool) -> None:
    table = sample_table()
    async with ucx_server({"t": table}, split) as server:
        assert server.uri.startswith("ucx://127.0.0.1:")
        assert (server.data_uri != server.uri) if split else (server.data_uri == server.uri)
        for uri in {server.uri, server.data_uri}:
            assert "worker" in DissocURI.parse(uri).params
        got = await fetch(server, "t")
    assert got.schema.equals(table.schema, check_metadata=True)
    assert got.equals(table)


@pytest.mark.parametrize("kind", ["ipc-file", "ipc-stream", "parquet", "reader-factory"])
@pytest.mark.parametrize("split", LAYOUTS)
async def test_dataset_kinds_round_trip(kind: str, split: bool, tmp_path: Path) -> None:
    table = sample_table(batches=3)
    source: Any
    if kind == "ipc-file":
        source = _ipc_file(tmp_path / "d.arrow", table)
        expected = table
    elif kind == "ipc-stream":
        source = tmp_path / "d.arrows"
        with pa.OSFile(str(source), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        expected = table
    elif kind == "parquet":
        source = tmp_path / "d.parquet"
        pq.write_table(table.drop_columns(["fsl"]), source, row_group_size=300)
        expected = pq.read_table(source)
    else:
        calls = []

        def source() -> pa.RecordBatchReader:
            calls.append(1)
            return pa.RecordBatchReader.from_batches(table.schema, table.to_batches())

        expected = table
    async with ucx_server({"d": source}, split) as server:
        first = await fetch(server, "d")
        second = await fetch(server, "d")  # a second request gets the whole stream again
    assert first.equals(expected)
    assert second.equals(expected)
    assert first.num_rows == table.num_rows
    if kind == "reader-factory":
        assert len(calls) >= 2


@pytest.mark.parametrize("split", LAYOUTS)
async def test_dictionary_replacements_and_deltas(split: bool, tmp_path: Path) -> None:
    # Replacement: each batch has its own dictionary (encoded by the server).
    b1 = pa.record_batch({"d": pa.array(["a", "b", None, "a"]).dictionary_encode(), "i": [1, 2, 3, 4]})
    b2 = pa.record_batch({"d": pa.array(["x", "y", "x"]).dictionary_encode(), "i": [5, 6, 7]})
    replaced = pa.Table.from_batches([b1, b2])
    # Deltas: a stored stream whose later dictionaries extend the first (forwarded as stored).
    dictionary_type = pa.dictionary(pa.int32(), pa.string())
    schema = pa.schema([("d", dictionary_type), ("i", pa.int64())])
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    delta_batches = [
        pa.record_batch(
            [
                pa.DictionaryArray.from_arrays(
                    pa.array([k % (2 * n + 2) for k in range(10)], pa.int32()), pa.array(words[: 2 * n + 2])
                ),
                pa.array(range(10 * n, 10 * n + 10), pa.int64()),
            ],
            schema=schema,
        )
        for n in range(3)
    ]
    path = tmp_path / "deltas.arrows"
    options = pa.ipc.IpcWriteOptions(emit_dictionary_deltas=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema, options=options) as writer:
        for batch in delta_batches:
            writer.write_batch(batch)
    reader = pa.ipc.open_stream(str(path))
    deltas = reader.read_all()
    assert reader.stats.num_dictionary_deltas == 2, "the stored stream must carry dictionary deltas"
    async with ucx_server({"replaced": replaced, "deltas": path}, split) as server:
        got_replaced = await fetch(server, "replaced")
        got_deltas = await fetch(server, "deltas")
    assert got_replaced.column("d").to_pylist() == ["a", "b", None, "a", "x", "y", "x"]
    assert got_replaced.equals(replaced)
    assert got_deltas.equals(deltas)
    assert got_deltas.column("d").to_pylist() == deltas.column("d").to_pylist()
    assert got_deltas.column("d").to_pylist()[20:26] == ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]


@pytest.mark.parametrize("split", LAYOUTS)
async def test_empty_dataset_keeps_schema(split: bool, tmp_path: Path) -> None:
    table = sample_table(batches=1).slice(0, 0)
    path = tmp_path / "empty.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema):
        pass  # a file with a schema and no batches
    async with ucx_server({"empty": table, "nofile": path}, split) as server:
        for ticket in ("empty", "nofile"):
            stats = FetchStats()
            batches = await within(
                30,
                collect(stream_batches(server.uri, ticket, data_uri=server.data_uri, stats=stats)),
                "stream",
            )
            got = await fetch(server, ticket)
            assert got.num_rows == 0
            assert got.schema.equals(table.schema)
            assert stats.rows == 0 and sum(b.num_rows for b in batches) == 0


@pytest.mark.parametrize("split", LAYOUTS)
async def test_many_batches_arrive_in_sequence_order(split: bool) -> None:
    table = ordered_table(batches=200, rows=500)
    stats = FetchStats()
    async with ucx_server({"ordered": table}, split) as server:
        batches = await within(
            60,
            collect(stream_batches(server.uri, "ordered", data_uri=server.data_uri, stats=stats)),
            "stream",
        )
        assert await eventually(lambda: listener_connections(server) == 0, 20), (
            f"the server still runs {listener_connections(server)} handler(s) after the client closed"
        )
    assert len(batches) == 200
    assert assert_ids_in_order(batches) == 200 * 500
    assert (stats.batches, stats.rows) == (200, 100_000)


@pytest.mark.parametrize("split", LAYOUTS)
def test_sync_fetch_and_open_stream(split: bool) -> None:
    """The synchronous API against a server on another thread's loop (two event loops, one UCX context)."""
    table = ordered_table(batches=20, rows=100)
    with ServerThread({"t": table}, transport="ucx", split=split) as srv:
        got = dissoc.fetch(srv.uri, "t", data_uri=srv.data_uri, options=opts())
        with open_stream(srv.uri, "t", data_uri=srv.data_uri, options=opts("listener")) as reader:
            assert reader.schema.equals(table.schema)
            streamed = list(reader)
        close_idle_connections_sync()  # while the server is there to close them with
    assert got.equals(table)
    assert assert_ids_in_order(streamed) == 2000


# -------------------------------------------------------------------------------------------- unknown ticket


@pytest.mark.parametrize("path", ["listener", "address"])
@pytest.mark.parametrize("split", LAYOUTS)
async def test_unknown_ticket_is_a_remote_error_and_the_server_goes_on(split: bool, path: str) -> None:
    table = sample_table(batches=2)
    async with ucx_server({"known": table}, split) as server:
        started = time.monotonic()
        with pytest.raises(RemoteError) as info:
            await fetch(server, "no-such-ticket", path, timeout=20)
        assert time.monotonic() - started < 10, "the error came only with the client's timeout"
        assert "no-such-ticket" in str(info.value)
        assert info.value.code == "unknown_ticket"
        assert (await fetch(server, "known", path)).equals(table)
        with pytest.raises(RemoteError, match="another-missing"):
            await fetch(server, "another-missing", path, timeout=20)
        assert (await fetch(server, "known", path)).equals(table)


async def test_unknown_ticket_streaming_api_raises_before_any_batch() -> None:
    got: list[pa.RecordBatch] = []
    async with ucx_server({"known": ordered_table(2, 2)}, True) as server:
        with pytest.raises(RemoteError, match="missing-one"):
            agen = stream_batches(server.uri, "missing-one", data_uri=server.data_uri, options=opts())
            async with contextlib.aclosing(agen):
                async for batch in agen:
                    got.append(batch)
    assert got == []


# ------------------------------------------------------------------------------------------ connection paths


@pytest.mark.parametrize("split", LAYOUTS)
async def test_connection_paths_give_equal_results(split: bool) -> None:
    """``listener``, ``address`` and ``auto`` (the address path: the host is local and the URI has
    ``worker``) all give the served table, and the server sees connections of the expected kind."""
    table = ordered_table(batches=12, rows=1000, pad=40)
    expected_kind = {"listener": "listener", "address": "address", "auto": "address"}
    results: dict[str, list[pa.RecordBatch]] = {}
    async with ucx_server({"t": table}, split) as server:
        for path in PATHS:
            stats = FetchStats()
            agen = stream_batches(server.uri, "t", data_uri=server.data_uri, options=opts(path), stats=stats)
            batches: list[pa.RecordBatch] = []
            async with contextlib.aclosing(agen):
                async for batch in agen:
                    if not batches:  # the connections are up: see how the server got them
                        kinds = _server_paths(server)
                        assert kinds == [expected_kind[path]] * (2 if split else 1), (path, kinds)
                    batches.append(batch)
            results[path] = batches
            _check_ucx_path(stats, expected_kind[path])
            assert await eventually(lambda: listener_connections(server) == 0, 20)
    for path in PATHS:
        assert pa.Table.from_batches(results[path]).equals(table), path
    assert [b.num_rows for b in results["listener"]] == [b.num_rows for b in results["address"]]


#: Transports UCX has on any host (TCP, shared memory, loopback), one of which a local connection uses.
_HOST_TRANSPORTS = {"tcp", "sysv", "posix", "cma", "self", "xpmem", "knem"}


def _check_ucx_path(stats: FetchStats, kind: str) -> None:
    """The path of a packed stream over UCX names the transports its data endpoint's lanes use, as UCX does
    (``name/device``, or ``name`` alone for a connection manager's lane)."""
    path = stats.path
    assert path is not None
    assert (path.transport, path.data_transport, path.bodies, path.memory, path.device_landing) == (
        "ucx",
        "ucx",
        "packed",
        None,
        (),
    )
    lanes = path.ucx_transports
    assert lanes, f"no UCX transports reported ({kind} path)"
    assert all(isinstance(lane, str) for lane in lanes), lanes
    names = [lane.split("/", 1)[0] for lane in lanes]
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", name) for name in names), lanes
    assert len(set(lanes)) == len(lanes)
    assert _HOST_TRANSPORTS & set(names), lanes
    if kind == "listener":  # connected through the listener's socket address: TCP's connection manager
        assert "tcp" in names, lanes


async def test_uri_without_worker_uses_the_listener_and_address_path_needs_it() -> None:
    table = ordered_table(3, 10)
    async with ucx_server({"t": table}, True) as server:
        uri, data_uri = _without_worker(server.uri), _without_worker(server.data_uri)
        agen = stream_batches(uri, "t", data_uri=data_uri, options=opts("auto"))
        async with contextlib.aclosing(agen):
            first = await within(30, agen.__anext__(), "the first batch")
            assert _server_paths(server) == ["listener", "listener"]
            rest = [b async for b in agen]
        assert pa.Table.from_batches([first, *rest]).equals(table)
        with pytest.raises(TransportError, match="worker"):
            await within(30, fetch_async(uri, "t", data_uri=data_uri, options=opts("address")))
        with pytest.raises(TransportError, match="path"):
            await within(30, fetch_async(server.uri, "t", options=opts("carrier-pigeon")))
        assert (await fetch(server, "t")).equals(table)  # nothing broke on the server


# ------------------------------------------------------------------------------------------ server goes away

CHILD_CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from dissoc.client import ClientOptions, stream_batches
    from dissoc.errors import DissocError

    async def main(uri, data_uri, ticket, path, mode):
        opts = ClientOptions(
            timeout=30, ucx_path=path, max_in_flight_bytes=4 << 20, max_buffered_bytes=4 << 20
        )
        rows = batches = 0
        told = None
        error = None
        try:
            async for batch in stream_batches(uri, ticket, data_uri=data_uri, options=opts):
                ids = batch.column(0)
                assert ids[0].as_py() == rows, (ids[0].as_py(), rows)
                rows += batch.num_rows
                batches += 1
                if batches == 2:
                    print(json.dumps({"batches": batches}), flush=True)
                    if mode == "wait":  # until the parent says the server is gone
                        await asyncio.to_thread(sys.stdin.readline)
                        told = time.monotonic()
                if mode == "slow":
                    await asyncio.sleep(0.01)
        except DissocError as exc:
            error = exc
        after = None if told is None else time.monotonic() - told
        name = None if error is None else type(error).__name__
        print(json.dumps({"rows": rows, "error": name, "message": str(error), "after": after}), flush=True)

    asyncio.run(main(*sys.argv[1:]))
    """
)


def _child_client(uri: str, data_uri: str, ticket: str, path: str, mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [PYTHON, "-c", CHILD_CLIENT, uri, data_uri, ticket, path, mode],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@contextlib.contextmanager
def _reaped(*procs: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(BrokenPipeError):
                        pipe.close()


BIG_BATCHES = 40
BIG_ROWS = (2 * MiB) // 8


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 batches of 2 MiB (an ``id`` column): bodies large enough for UCX's rendezvous protocol."""
    path = tmp_path_factory.mktemp("ucx-big") / "big.arrow"
    schema = pa.schema([("id", pa.int64())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for i in range(BIG_BATCHES):
            ids = np.arange(i * BIG_ROWS, (i + 1) * BIG_ROWS, dtype=np.int64)
            writer.write_batch(pa.record_batch([pa.array(ids)], schema=schema))
    return path


def _serve_cli(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [PYTHON, "-m", "dissoc.cli", "serve", "--transport", "ucx", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


SERVER_GONE = [
    pytest.param("kill", "listener", False, id="SIGKILL-listener-combined"),
    pytest.param("kill", "address", True, id="SIGKILL-address-split"),
    pytest.param("term", "listener", True, id="SIGTERM-listener-split"),
    pytest.param("term", "address", False, id="SIGTERM-address-combined"),
    pytest.param("term", "address", True, id="SIGTERM-address-split"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("how", "path", "split"), SERVER_GONE)
async def test_server_gone_mid_stream_client_raises_transport_error_promptly(
    how: str, path: str, split: bool, big_file: Path
) -> None:
    """A server killed (SIGKILL) or stopped (SIGTERM: it closes its connections) while a client is in the
    middle of a stream: the client raises TransportError well before its 30 s timeout, and does not crash."""
    server = _serve_cli(str(big_file), *(["--split"] if split else []))
    client: subprocess.Popen[bytes] | None = None
    with _reaped(server):
        line = json.loads(read_lines(server, 1, 30)[0])
        assert line["ticket"] == "big"
        client = _child_client(line["uri"], line["data_uri"], "big", path, "wait")
        with _reaped(client):
            assert json.loads(read_lines(client, 1, 30)[0]) == {"batches": 2}
            server.send_signal(signal.SIGKILL if how == "kill" else signal.SIGTERM)
            status = await asyncio.to_thread(server.wait, 20)
            assert status == (-signal.SIGKILL if how == "kill" else 0), status
            assert client.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # the client may have died already
                client.stdin.write(b"the server is gone\n")
                client.stdin.flush()
            out, err = await asyncio.to_thread(client.communicate, None, 60)
    assert client.returncode == 0, (
        f"the client process died with status {client.returncode} (a negative status is a signal: UCX "
        f"aborted it) instead of raising TransportError; stderr: {err.decode(errors='replace')[-1500:]}"
    )
    # (the last JSON line: ucxx may log to stdout too, e.g. an endpoint's close failing as the peer is gone)
    report = json.loads([line for line in out.decode().splitlines() if line.startswith("{")][-1])
    assert report["error"] == "TransportError", report
    assert report["after"] < 10, f"the client noticed only after {report['after']:.1f} s: {report}"
    assert 0 < report["rows"] < BIG_BATCHES * BIG_ROWS, report


# ------------------------------------------------------------------------------------------ client goes away


class LongStream:
    """A reader factory for a practically endless stream of ~256 KiB batches that records what it did."""

    SCHEMA = pa.schema([("id", pa.int64()), ("pad", pa.binary())])
    ROWS = 1024

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened = 0
        self.closed = 0
        self.produced = 0

    def __call__(self) -> Iterator[pa.RecordBatch]:
        with self.lock:
            self.opened += 1
        try:
            pad = pa.array([b"p" * 256] * self.ROWS, pa.binary())
            for i in range(1_000_000):
                with self.lock:
                    self.produced += 1
                ids = pa.array(range(i * self.ROWS, (i + 1) * self.ROWS), pa.int64())
                yield pa.record_batch([ids, pad], schema=self.SCHEMA)
        finally:
            with self.lock:
                self.closed += 1

    def dataset(self) -> ReaderFactoryDataset:
        return ReaderFactoryDataset("long", self, schema=self.SCHEMA)


SMALL = ordered_table(3, 50)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["listener", "address"])
@pytest.mark.parametrize("split", LAYOUTS)
async def test_client_killed_mid_stream_server_serves_the_others(split: bool, path: str) -> None:
    """A client process killed (SIGKILL) mid-stream: the server closes that stream's reader and handlers,
    while another client's stream, running all along, goes on in order; new clients are served."""
    stream = LongStream()
    async with ucx_server({"long": stream.dataset(), "small": SMALL}, split) as server:
        other = stream_batches(server.uri, "long", data_uri=server.data_uri, options=opts(path))
        async with contextlib.aclosing(other):
            seen = 0

            async def take(n: int) -> None:
                nonlocal seen
                for _ in range(n):
                    batch: pa.RecordBatch = await other.__anext__()
                    assert batch.column("id")[0].as_py() == seen * LongStream.ROWS
                    seen += 1

            await within(30, take(2), "the other client's first batches")
            child = _child_client(server.uri, server.data_uri, "long", path, "slow")
            with _reaped(child):
                # read_lines blocks: run it off the loop, which must keep serving meanwhile.
                first = await asyncio.to_thread(read_lines, child, 1, 30)
                assert json.loads(first[0]) == {"batches": 2}
                assert stream.opened == (4 if split else 2)
                child.send_signal(signal.SIGKILL)
                await asyncio.to_thread(child.wait, 10)
            per_client = 2 if split else 1
            assert await eventually(lambda: stream.closed == per_client, 20), (
                f"the killed client's stream was not released: opened {stream.opened}, closed {stream.closed}"
            )
            assert await eventually(lambda: listener_connections(server) == per_client, 20), (
                f"handlers still running: {listener_connections(server)} (expected {per_client})"
            )
            await within(30, take(20), "the other client's stream after the kill")
        assert await eventually(lambda: stream.closed == stream.opened, 20)
        assert await eventually(lambda: listener_connections(server) == 0, 20)
        assert (await fetch(server, "small", path)).equals(SMALL)


async def test_many_clients_leaving_early_leave_nothing_behind() -> None:
    stream = LongStream()
    async with ucx_server({"long": stream.dataset(), "small": SMALL}) as server:
        for k in range(6):
            agen = stream_batches(server.uri, "long", options=opts(PATHS[k % 3]))
            async with contextlib.aclosing(agen):
                async for _batch in agen:
                    break
        assert await eventually(lambda: stream.closed == stream.opened == 6, 20), (
            stream.opened,
            stream.closed,
        )
        assert await eventually(lambda: listener_connections(server) == 0, 20)
        produced = stream.produced
        await asyncio.sleep(0.2)
        assert stream.produced == produced, "the server kept producing batches after the clients left"
        assert (await fetch(server, "small")).equals(SMALL)


async def test_server_close_ends_a_connected_clients_connection_promptly() -> None:
    """Closing an in-process server with a client connected: closing does not hang, and the client's
    connection ends with TransportError after what was sent (small bodies: no rendezvous in flight)."""
    table = ordered_table(2, 10)
    from dissoc.transport.ucx import connect_ucx

    server = await ucx_server({"t": table}).start()
    try:
        uri = DissocURI.parse(server.uri)
        conn = await within(20, connect_ucx(uri.host, uri.port, worker=uri.params["worker"]), "connect")
        try:
            await conn.send_tagged(uri.want_data, b"t")
            first = bytes(await within(20, conn.recv(), "the schema message"))
            assert first[:5] == b"\x01\x00\x00\x00\x00"  # metadata, sequence number 0
            started = time.monotonic()
            await within(20, server.close(), "closing the server")
            assert time.monotonic() - started < 10
            with pytest.raises(TransportError):
                while True:  # the rest of the stream, then the end of the connection
                    await within(20, conn.recv(), "the client noticing the server closed")
        finally:
            await conn.close()
    finally:
        await server.close()


# ---------------------------------------------------------------------------------------------- slow consumer


class CountingSource:
    """A reader factory of ``batches`` batches of ``batch_bytes`` bytes (an ``id`` column), counting per
    opened iterator how many batches it produced."""

    def __init__(self, batches: int, batch_bytes: int) -> None:
        self.rows = batch_bytes // 8
        self.batches = batches
        self.produced: list[int] = []
        self.schema = pa.schema([("id", pa.int64())])

    def __call__(self) -> Iterator[pa.RecordBatch]:
        slot = len(self.produced)
        self.produced.append(0)
        base = np.arange(self.rows, dtype=np.int64)
        for i in range(self.batches):
            self.produced[slot] += 1
            yield pa.record_batch([pa.array(base + i * self.rows)], schema=self.schema)

    def data_produced(self) -> int:
        # split: the data server's iterator is the one the bodies come from (the slower of the two)
        return min(self.produced) if self.produced else 0


@pytest.mark.parametrize("path", ["listener", "address"])
@pytest.mark.parametrize("split", LAYOUTS)
async def test_slow_consumer_throttles_the_server(split: bool, path: str) -> None:
    """1 MiB bodies (UCX rendezvous): the server stays within the client's budgets of the consumer (and the
    sends it may have under way)."""
    from dissoc.transport.ucx.connection import SEND_WINDOW_BYTES

    source = CountingSource(batches=400, batch_bytes=MiB)
    o = opts(path, max_in_flight_bytes=4 * MiB, max_buffered_bytes=4 * MiB)
    allowed = (o.max_in_flight_bytes + o.max_buffered_bytes + SEND_WINDOW_BYTES) // MiB + 4
    consumed = max_lead = 0
    async with ucx_server({"slow": ReaderFactoryDataset("slow", source, schema=source.schema)}, split) as srv:
        agen = stream_batches(srv.uri, "slow", data_uri=srv.data_uri, options=o)
        async with contextlib.aclosing(agen):

            async def consume() -> None:
                nonlocal consumed, max_lead
                batch: pa.RecordBatch
                async for batch in agen:
                    assert batch.column("id")[0].as_py() == consumed * source.rows
                    consumed += 1
                    await asyncio.sleep(0.01)
                    max_lead = max(max_lead, source.data_produced() - consumed)
                    if consumed == 80:
                        return

            await within(60, consume(), "the slow consumer")
        final = source.data_produced()
    assert consumed == 80
    assert final < source.batches, f"the server produced all {final} batches for a consumer that took 80"
    assert max_lead <= allowed, (
        f"the server ran {max_lead} MiB batches ahead of the consumer; allowed {allowed}"
    )


@pytest.mark.parametrize("split", LAYOUTS)
async def test_stalled_consumer_bounds_the_server_with_small_bodies(split: bool) -> None:
    """4 KiB bodies, below UCX's rendezvous threshold (eager messages, which UCX buffers at the receiver):
    a consumer that stalls after one batch must still hold the server back, to about what its window and
    budgets allow (over TCP the socket buffers do that)."""
    batch_bytes = 4096
    source = CountingSource(batches=40_000, batch_bytes=batch_bytes)
    o = opts(max_in_flight_bytes=1 * MiB, max_buffered_bytes=1 * MiB, window=1024)
    allowed = o.window + (o.max_in_flight_bytes + o.max_buffered_bytes) // batch_bytes + 256
    async with ucx_server({"s": ReaderFactoryDataset("s", source, schema=source.schema)}, split) as srv:
        agen = stream_batches(srv.uri, "s", data_uri=srv.data_uri, options=o)
        async with contextlib.aclosing(agen):
            first: pa.RecordBatch = await within(30, agen.__anext__(), "the first batch")
            assert first.column("id")[0].as_py() == 0
            # Stalled: wait until the server stops producing (steady for 1 s), or clearly runs away.
            deadline = time.monotonic() + 30
            last, steady_since = -1, time.monotonic()
            while time.monotonic() < deadline:
                produced = source.data_produced()
                if produced > 3 * allowed:
                    break
                if produced != last:
                    last, steady_since = produced, time.monotonic()
                elif time.monotonic() - steady_since > 1.0:
                    break
                await asyncio.sleep(0.05)
            lead = source.data_produced() - 1
            # The stream still completes in order once the consumer resumes.
            n = 1
            batch: pa.RecordBatch
            async for batch in agen:
                assert batch.column("id")[0].as_py() == n * source.rows
                n += 1
                if n == 2000:
                    break
    assert lead <= allowed, (
        f"with the consumer stalled, the server produced {lead} batches ({lead * batch_bytes // MiB} MiB) "
        f"ahead; the client allows about {allowed} (window {o.window}, budgets 1 + 1 MiB): the rest piles up "
        "in the client's UCX unexpected-message and active-message queues, unbounded"
    )


# ---------------------------------------------------------------------------------------------------- pairs


def _pairs_table(rows: int = 50_000) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(np.arange(rows)),
            "s": pa.array([None if i % 11 == 0 else f"v{i}" for i in range(rows)]),
            "d": pa.array([f"k{i % 5}" for i in range(rows)]).dictionary_encode(),
            "l": pa.array([[i, i + 1] for i in range(rows)], pa.list_(pa.int64())),
        }
    )


@pytest.mark.parametrize("path", ["listener", "address"])
@pytest.mark.parametrize("split", LAYOUTS)
async def test_pairs_over_shared_memory_round_trip_and_ledger_drains(
    split: bool, path: str, tmp_path: Path
) -> None:
    table = _pairs_table()
    stored = tmp_path / "stored.arrow"
    with pa.ipc.new_file(stored, table.schema) as writer:
        writer.write_table(table, max_chunksize=10_000)
    async with ucx_server(
        {"t": table, "stored": str(stored)}, split, body="pairs", memory="shm", arena_bytes=32 << 20
    ) as server:
        data_uri = server.data_uri
        assert _segment_exists(data_uri)
        data = DissocURI.parse(data_uri)
        assert data.scheme == "ucx" and data.memory == "shm"
        assert data.remote_handle is not None and data.free_data is not None and "worker" in data.params
        placements = server.placements
        assert placements is not None
        for ticket in ("t", "stored"):
            got = await fetch(server, ticket, path)
            assert got.equals(table)
            assert await eventually(lambda: placements.held_bytes == 0, 10), (
                f"{placements.held_bytes} bytes never freed"
            )
        assert await eventually(lambda: listener_connections(server) == 0, 20)
    assert not _segment_exists(data_uri), "the server's segment must be unlinked when it closes"


async def test_pairs_dataset_larger_than_the_arena_streams_through_it() -> None:
    rows = 100_000
    batch = pa.record_batch([pa.array(np.arange(rows))], names=["id"])
    async with ucx_server(
        {"t": pa.Table.from_batches([batch] * 40)}, body="pairs", memory="shm", arena_bytes=4 << 20
    ) as server:
        n = 0
        b: pa.RecordBatch
        async for b in stream_batches(server.uri, "t", data_uri=server.data_uri, options=opts()):
            assert b.column(0).equals(batch.column(0))
            n += 1
        assert n == 40
        placements = server.placements
        assert placements is not None
        assert await eventually(lambda: placements.held_bytes == 0, 10)


@pytest.mark.parametrize("path", ["listener", "address"])
async def test_pairs_client_that_leaves_without_freeing_gives_its_ranges_back(path: str) -> None:
    from dissoc.transport.ucx import connect_ucx

    table = _pairs_table(200_000).combine_chunks()
    async with ucx_server({"t": table}, body="pairs", memory="shm", arena_bytes=64 << 20) as server:
        arena, placements = server.arena, server.placements
        assert arena is not None and placements is not None
        uri = DissocURI.parse(server.uri)
        conn = await within(20, connect_ucx(uri.host, uri.port, worker=uri.params["worker"], path=path))
        try:
            await conn.send_tagged(uri.want_data, b"t")
            body = await within(20, conn.recv_tagged(0, 0), "a pair-list body")
            assert body.tag >> 56 == 1  # body type 1: pairs
            assert await eventually(lambda: arena.used_bytes > 0, 10)
        finally:
            await conn.close()  # never freed anything
        assert await eventually(lambda: placements.held_bytes == 0, 10), (
            "a departed client's ranges must be freed"
        )
        assert (await fetch(server, "t", path)).equals(table)


# ---------------------------------------------------------------------------------------------- command line


def _dissoc(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-m", "dissoc.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, pa.Table]]:
    root = tmp_path_factory.mktemp("ucx-cli")
    trips = sample_table(batches=3)
    ordered = ordered_table(5, 100)
    parquet = root / "ordered.parquet"
    pq.write_table(ordered, parquet, row_group_size=100)
    return {
        "trips": (_ipc_file(root / "trips.arrow", trips), trips),
        "ordered": (parquet, pq.read_table(parquet)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["combined", "split", "pairs"])
def test_cli_serve_ucx_and_get(variant: str, cli_files: dict[str, Any], tmp_path: Path) -> None:
    extra = {"combined": [], "split": ["--split"], "pairs": ["--body", "pairs", "--memory", "shm"]}[variant]
    server = _serve_cli(str(cli_files["trips"][0]), str(cli_files["ordered"][0]), *extra)
    try:
        lines = [json.loads(line) for line in read_lines(server, 2, 30)]
        assert [line["ticket"] for line in lines] == ["trips", "ordered"]
        for line in lines:
            assert line["uri"].startswith("ucx://127.0.0.1:") and "worker=" in line["uri"]
            assert (
                (line["data_uri"] != line["uri"]) if variant == "split" else (line["data_uri"] == line["uri"])
            )
            if variant == "pairs":
                assert "memory=shm" in line["data_uri"] and _segment_exists(line["data_uri"])
        # All the gets at once: the server handles them concurrently.
        gets = []
        for line, suffix in zip(lines, [".arrow", ".arrows"], strict=True):
            out = tmp_path / f"{line['ticket']}{suffix}"
            cmd = ["get", line["uri"], line["ticket"], "-o", str(out), "--no-progress", "--timeout", "30"]
            gets.append((line["ticket"], out, _dissoc(*cmd, "--data-uri", line["data_uri"])))
        unknown = _dissoc("get", lines[0]["uri"], "no-such-ticket", "--data-uri", lines[0]["data_uri"])
        for ticket, out, proc in gets:
            stdout, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0, stderr
            assert "Traceback" not in stderr
            summary_lines = stdout.strip().splitlines()
            assert len(summary_lines) == 1, f"expected one JSON line on stdout, got {stdout!r}"
            expected = cli_files[ticket][1]
            assert json.loads(summary_lines[0])["rows"] == expected.num_rows
            reader = pa.ipc.open_file if out.suffix == ".arrow" else pa.ipc.open_stream
            assert reader(str(out)).read_all().equals(expected), f"{out.name} differs from the served data"
        stdout, stderr = unknown.communicate(timeout=60)
        assert unknown.returncode == 1, (unknown.returncode, stderr)
        assert "no-such-ticket" in stderr and "Traceback" not in stderr and stdout == ""
        assert server.poll() is None, "the server exited while serving"
        server.send_signal(signal.SIGTERM)
        server_out, err = server.communicate(timeout=30)
        assert server.returncode == 0, f"exit status {server.returncode}; stderr: {err.decode()[-2000:]}"
        assert server_out == b"", (
            f"stdout carried more than the JSON lines (UCX messages go to stderr): {server_out!r}"
        )
        assert b"Traceback" not in err
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate(timeout=10)
    if variant == "pairs":
        assert not _segment_exists(lines[0]["data_uri"]), "the server's segment must be unlinked on exit"


# ---------------------------------------------------------------------------------------------- many clients


@pytest.mark.slow
@pytest.mark.parametrize("split", LAYOUTS)
async def test_32_concurrent_clients_each_get_their_stream_intact(split: bool) -> None:
    """32 clients at once (alternately through the listener and by worker address), each with its own UCX
    worker on both sides; 2 MiB per client."""
    tables = {f"t{k}": ordered_table(8, 2048, pad=120) for k in range(4)}
    async with ucx_server(tables, split) as server:
        tickets = [f"t{k % 4}" for k in range(32)]
        paths = [("listener", "address")[k % 2] for k in range(32)]
        started = time.monotonic()
        results = await within(
            90,
            asyncio.gather(
                *(
                    fetch_async(server.uri, t, data_uri=server.data_uri, options=opts(p, timeout=60))
                    for t, p in zip(tickets, paths, strict=True)
                )
            ),
            "32 concurrent fetches",
        )
        elapsed = time.monotonic() - started
        assert await eventually(lambda: listener_connections(server) == 0, 30), listener_connections(server)
    assert len(results) == 32
    for ticket, got in zip(tickets, results, strict=True):
        assert got.nbytes >= 2 * MiB
        assert got.equals(tables[ticket])
        assert assert_ids_in_order(got.to_batches()) == 8 * 2048
    assert elapsed < 60, f"32 clients took {elapsed:.1f} s"


# ------------------------------------------------------------------------------------ transport-level checks


@pytest.mark.parametrize("path", ["listener", "address"])
async def test_a_closing_connection_never_lets_ucx_write_into_a_buffer_it_let_go(path: str) -> None:
    """The peer starts a 16 MiB message and closes at once (BYE first, then it waits for the send): the
    receiver takes the message while draining, then tears down. Its buffer (from a test-owned arena, so
    that nothing unsafe happens) must stay reserved until UCX is done with it: whatever UCX writes after the
    transport dropped it would land in freed memory with the default allocator (heap corruption, seen as
    segfaults in later tests)."""
    from dissoc.transport.ucx import connect_ucx, serve_ucx

    size = 16 * MiB
    payload = np.ones(size, np.uint8)

    async def handler(conn: Any) -> None:
        sending = asyncio.ensure_future(conn.send_tagged(1, payload))
        await asyncio.sleep(0)
        await conn.close()
        with contextlib.suppress(TransportError):
            await sending

    arena = np.zeros(2 * size, np.uint8)
    slots = iter(range(2))
    dropped: list[int] = []

    def allocator(tag: int, length: int) -> np.ndarray[Any, Any]:
        k = next(slots)
        view = arena[k * size : k * size + length]

        def on_drop() -> None:  # the transport let go of the buffer: nothing may write into it now
            arena[k * size : (k + 1) * size] = 0xEE
            dropped.append(k)

        weakref.finalize(view, on_drop)
        return view

    listener = await serve_ucx("127.0.0.1", 0, handler)
    try:
        client = await within(
            20, connect_ucx("127.0.0.1", listener.port, worker=listener.uri_params()["worker"], path=path)
        )
        client.set_allocator(allocator)
        try:
            with contextlib.suppress(TransportError):  # the message may or may not complete first
                message = await within(20, client.recv_tagged(1), "the message or the end")
                assert message.view().nbytes == size
                del message
        finally:
            await within(20, client.close(), "closing the client")
    finally:
        listener.close()
        await within(20, listener.wait_closed(), "closing the listener")
    for k in dropped:
        written = int(np.count_nonzero(arena[k * size : (k + 1) * size] != 0xEE))
        assert written == 0, f"UCX wrote {written} bytes into buffer {k} after the transport dropped it"


# ------------------------------------------------------------------------------------------------ bad URIs


BAD_WORKER = textwrap.dedent(
    """
    import asyncio, base64, sys
    from dissoc.client import ClientOptions, fetch_async
    from dissoc.errors import TransportError
    from dissoc.uri import DissocURI

    u = DissocURI.parse(sys.argv[1])
    worker = bytearray(base64.b64decode(u.params["worker"]))
    worker[0] ^= 0xFF  # a corrupted header byte (version bits)
    params = {"worker": base64.b64encode(worker).decode()}
    bad = DissocURI(u.scheme, u.host, u.port, u.want_data, params=params)
    try:
        asyncio.run(fetch_async(str(bad), "t", options=ClientOptions(timeout=10, ucx_path="address")))
    except TransportError as exc:
        print("TransportError:", exc)
    """
)


def test_corrupted_worker_address_is_a_transport_error_not_a_crash() -> None:
    """A URI whose ``worker`` parameter is damaged fails with TransportError (run in a child process: UCX
    may abort on an address it cannot unpack)."""
    with ServerThread({"t": ordered_table(1, 1)}, transport="ucx") as srv:
        result = subprocess.run(
            [PYTHON, "-c", BAD_WORKER, srv.uri], cwd=REPO, capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 0, (
        f"the client died with status {result.returncode} on a corrupted worker address: "
        f"{result.stderr[-1500:]}"
    )
    assert result.stdout.startswith("TransportError:"), result.stdout


def test_worker_parameter_is_valid_base64_of_the_listener_address() -> None:
    with ServerThread({"t": ordered_table(1, 1)}, transport="ucx", split=True) as srv:
        meta, data = DissocURI.parse(srv.uri), DissocURI.parse(srv.data_uri)
    raw = [base64.b64decode(u.params["worker"], validate=True) for u in (meta, data)]
    assert all(len(r) > 16 for r in raw)
    assert raw[0] != raw[1], "each listener has its own worker"
