"""Connections from hostile or silent clients (the transport and listener side of ``dissoc serve``).

Each test asserts a bound that the server broke before these limits existed:

- a want_data frame announcing a 128 MiB ticket is refused from its header: the server's RSS stays put, the
  client gets a ``request_too_large`` error, and a well-behaved client is served meanwhile;
- with 64 file descriptors and 100 idle connections the server neither spins nor floods its log, and once the
  idle connections are dropped (want_data deadline) a normal client is served;
- a client sending its want_data one byte at a time is dropped by the want_data deadline; one that sits idle
  by the idle timeout, unless it holds listed ranges (pairs);
- connections that announce 512 MiB, send part of it and leave release what they held at once, and the
  bytes being received across connections are capped;
- one peer address gets at most ``max_connections_per_peer`` connections; at ``max_connections`` accepting
  pauses until a connection closes.

Servers whose RSS or CPU time is measured run in a child process; the others run in the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import struct
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, eventually, listener_connections, sample_table, vm_rss, within

import dissoc
from dissoc.client import fetch_async
from dissoc.errors import TransportError
from dissoc.server import DEFAULT_FREE_DATA, DEFAULT_WANT_DATA, Server
from dissoc.transport import connect

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MiB = 1 << 20
_HEADER = struct.Struct("<QQQ")
_CHILD = textwrap.dedent(
    """
    import asyncio, gc, json, logging, os, sys
    import pyarrow as pa
    from dissoc.server import Server

    if os.environ.get("NO_GC"):
        gc.disable()  # what a departed client held must go without the collector

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s: %(message)s")

    async def main():
        table = pa.table({"x": list(range(1000))})
        async with Server({"t": table}, **json.loads(sys.argv[1])) as server:
            print(server.uri, flush=True)
            await server.serve_forever()

    asyncio.run(main())
    """
)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _server_process(
    tmp_path: Path, nofile: int | None = None, no_gc: bool = False, **options: Any
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """A ``dissoc.Server`` serving table ``t`` in a child process (optionally with ``nofile`` descriptors, or
    with the garbage collector off); yields the process, its URI and the file its log goes to."""
    log_path = tmp_path / "server.log"

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [PYTHON, "-c", _CHILD, json.dumps(options)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=log,
            preexec_fn=limit,
            env={**os.environ, "NO_GC": "1" if no_gc else ""},
        )
    try:
        assert proc.stdout is not None
        uri = proc.stdout.readline().decode().strip()
        assert uri.startswith("tcp://"), f"the server did not start: {log_path.read_text()[-2000:]}"
        yield proc, uri, log_path
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def _port(uri: str) -> int:
    return int(uri.split(":")[2].split("?")[0])


def _settle_rss(pid: int, seconds: float = 1.0) -> int:
    time.sleep(seconds)
    return vm_rss(pid)


def _closed_by_peer(sock: socket.socket, seconds: float) -> bool:
    """Read (and drop) what ``sock`` receives until the peer closes it (True) or ``seconds`` pass (False)."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(1 << 16):
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True


def _fetch_seconds(uri: str) -> float:
    start = time.monotonic()
    table = dissoc.fetch(uri, "t")
    assert table.num_rows == 1000
    return time.monotonic() - start


# ----------------------------------------------------------------------------------------- 1. huge ticket


def test_huge_ticket_is_refused_from_its_header(tmp_path: Path) -> None:
    with _server_process(tmp_path) as (proc, uri, log_path):
        normal = _fetch_seconds(uri)  # warm: imports, first stream
        normal = min(normal, _fetch_seconds(uri))
        before = _settle_rss(proc.pid, 0.5)
        sock = socket.create_connection(("127.0.0.1", _port(uri)))
        sock.sendall(_HEADER.pack(2, DEFAULT_WANT_DATA, 128 * MiB))
        junk = b"j" * MiB
        sent = 0
        sock.settimeout(0.5)
        with contextlib.suppress(OSError):
            while sent < 128:
                sock.sendall(junk)
                sent += 1
        # The server stopped reading at the header: the kernel's buffers took what was sent.
        assert sent < 32, f"the server read {sent} MiB of a ticket over its 64 KiB limit"
        meanwhile = _fetch_seconds(uri)
        assert meanwhile < max(2.0, 5 * normal), (
            f"a normal client took {meanwhile:.2f} s (alone {normal:.2f} s)"
        )
        grown = _settle_rss(proc.pid, 0.5) - before
        assert grown < 4 * MiB, f"the server's RSS grew by {grown / MiB:.1f} MiB"
        reply = b""
        sock.settimeout(5)
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 16):
                reply += chunk
        sock.close()
        # The error goes out before the connection is dropped; unread junk may turn the close into a reset
        # that discards it on the way, so its content is checked when it arrived.
        if reply:
            assert b"request_too_large" in reply and len(reply) < 4096, reply[:200]
        assert proc.poll() is None
        assert log_path.stat().st_size < 4096


# ------------------------------------------------------------------------------------------ 2. fd limit


@pytest.mark.parametrize(
    "max_connections",
    [
        pytest.param("auto", id="default-limit"),
        # No connection limit: accepts fail with EMFILE, and accepting backs off instead of spinning.
        pytest.param(None, id="emfile-backoff"),
    ],
)
def test_fd_exhaustion_neither_spins_nor_floods_the_log(tmp_path: Path, max_connections: str | None) -> None:
    options: dict[str, Any] = {"want_data_timeout": 0.5, "max_connections": max_connections}
    with _server_process(tmp_path, nofile=64, **options) as (proc, uri, log_path):
        port = _port(uri)
        time.sleep(0.3)
        cpu = _cpu_seconds(proc.pid)
        idle = []
        for _ in range(100):
            with contextlib.suppress(OSError):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        assert len(idle) >= 90
        time.sleep(3)
        spent = _cpu_seconds(proc.pid) - cpu
        assert spent < 0.5, f"the server spent {spent:.2f} s of CPU in 3 s with idle connections"
        took = _fetch_seconds(uri)
        assert took < 10
        lines = log_path.read_bytes().count(b"\n")
        assert lines < 20 and log_path.stat().st_size < 8192, log_path.read_text()[-2000:]
        dropped = sum(_closed_by_peer(s, 0.05) for s in idle)
        assert dropped >= len(idle) - 5, f"only {dropped} of {len(idle)} idle connections were dropped"
        for s in idle:
            s.close()
        assert proc.poll() is None


# ---------------------------------------------------------------------------------------- 3. deadlines


async def _raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _eof_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Drain ``reader`` until EOF (True) or ``seconds`` pass (False)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def test_slowloris_is_dropped_by_the_want_data_deadline() -> None:
    async with Server({"t": sample_table()}, want_data_timeout=1.0) as server:
        port = _port(server.uri)
        reader, writer = await _raw(port)
        request = _HEADER.pack(2, DEFAULT_WANT_DATA, 1) + b"t"
        start = time.monotonic()
        eof = asyncio.ensure_future(_eof_within(reader, 8))
        for byte in request:  # one byte every 0.25 s: 25 bytes would take 6 s
            if eof.done():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(bytes([byte]))
                await writer.drain()
            await asyncio.sleep(0.25)
        assert await eof, "a client trickling its want_data was not dropped"
        assert time.monotonic() - start < 3.5
        writer.close()
        assert await eventually(lambda: listener_connections(server) == 0, 2)


async def test_a_request_left_unfinished_after_a_stream_is_dropped() -> None:
    async with Server({"t": sample_table()}, want_data_timeout=0.5, idle_timeout=60) as server:
        port = _port(server.uri)
        reader, writer = await _raw(port)
        writer.write(_HEADER.pack(2, DEFAULT_WANT_DATA, 1) + b"t")
        await writer.drain()
        await asyncio.sleep(0.5)  # the stream is sent
        writer.write(_HEADER.pack(2, DEFAULT_WANT_DATA, 1000)[:10])  # half a header, then nothing
        await writer.drain()
        start = time.monotonic()
        assert await _eof_within(reader, 5)
        assert time.monotonic() - start < 3
        writer.close()


@pytest.mark.parametrize("body", ["packed", "pairs"])
async def test_idle_timeout_spares_clients_holding_ranges(body: str) -> None:
    async with Server({"t": sample_table()}, body=body, want_data_timeout=5, idle_timeout=0.5) as server:
        port = _port(server.uri)
        reader, writer = await _raw(port)
        writer.write(_HEADER.pack(2, DEFAULT_WANT_DATA, 1) + b"t")
        await writer.drain()
        # packed: nothing held, dropped after the idle timeout; pairs: the ranges listed to it are held until
        # it sends free_data, so it is kept (idle as it is).
        dropped = await _eof_within(reader, 2.5)
        assert dropped is (body == "packed")
        writer.close()


async def test_an_idle_connection_without_want_data_is_dropped() -> None:
    async with Server({"t": sample_table()}, want_data_timeout=0.5) as server:
        port = _port(server.uri)
        reader, writer = await _raw(port)
        start = time.monotonic()
        assert await _eof_within(reader, 3)
        assert 0.4 < time.monotonic() - start < 2.5
        writer.close()
        table = await within(10, fetch_async(server.uri, "t"))
        assert table.num_rows == sample_table().num_rows


async def test_a_huge_free_data_list_is_refused_from_its_header() -> None:
    async with Server({"t": sample_table()}, body="pairs", max_free_data_bytes=4096) as server:
        port = _port(server.uri)
        budget = server.receive_budget
        assert budget is not None
        reader, writer = await _raw(port)
        writer.write(_HEADER.pack(2, DEFAULT_FREE_DATA, 16 * MiB) + b"f" * 65536)
        await writer.drain()
        data = b""
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(3):
                while chunk := await reader.read(1 << 16):
                    data += chunk
        assert reader.at_eof() or data, "the connection was kept after a free_data frame over its limit"
        if data:
            assert b"request_too_large" in data, data[:200]
        assert budget.used == 0
        writer.close()


# ------------------------------------------------------------------------------------- 4. memory on close


def test_departed_clients_release_their_buffers_at_once(tmp_path: Path) -> None:
    with _server_process(tmp_path, no_gc=True) as (proc, uri, _log):
        port = _port(uri)
        _fetch_seconds(uri)
        before = _settle_rss(proc.pid, 0.5)
        junk = b"y" * MiB
        for round_ in range(10):
            sock = socket.create_connection(("127.0.0.1", port))
            tag = 0x1234 + round_  # not a request tag: held for a consumer that never comes
            if round_ % 3 == 2:
                sock.sendall(_HEADER.pack(2, tag, 32 * MiB) + junk * 32)  # a whole message, held unread
            else:
                sock.sendall(_HEADER.pack(2, tag, 512 * MiB))  # most of a partly received one
                for _ in range(40):
                    sock.sendall(junk)
            time.sleep(0.05)
            if round_ % 2:  # half leave with a reset, half with a FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        grown = _settle_rss(proc.pid, 0.5) - before
        assert grown < 24 * MiB, f"the server's RSS grew by {grown / MiB:.0f} MiB with nothing open"
        _fetch_seconds(uri)


async def test_bytes_being_received_are_capped_across_connections() -> None:
    async with Server({"t": sample_table()}, max_receiving_bytes=64 * MiB) as server:
        port = _port(server.uri)
        _first_reader, first = await _raw(port)
        first.write(_HEADER.pack(2, 0x99, 48 * MiB) + b"z" * MiB)
        await first.drain()
        assert server.receive_budget is not None
        budget = server.receive_budget
        assert await eventually(lambda: budget.used >= 48 * MiB, 2)
        second_reader, second = await _raw(port)
        second.write(_HEADER.pack(2, 0x99, 48 * MiB) + b"z" * MiB)
        await second.drain()
        # The second does not fit beside the first: its connection fails without allocating.
        assert await _eof_within(second_reader, 3)
        assert budget.used <= 64 * MiB
        first.close()
        second.close()
        assert await eventually(lambda: budget.used == 0, 3), budget.used
        table = await within(10, fetch_async(server.uri, "t"))
        assert table.num_rows == sample_table().num_rows


# --------------------------------------------------------------------------------- 5. connection limits


async def test_per_peer_limit_closes_the_extra_connection() -> None:
    async with Server({"t": sample_table()}, max_connections_per_peer=4) as server:
        port = _port(server.uri)
        held = [await _raw(port) for _ in range(4)]
        assert await eventually(lambda: listener_connections(server) == 4, 2)
        extra_reader, extra = await _raw(port)
        assert await _eof_within(extra_reader, 2), "a fifth connection from one address was kept"
        extra.close()
        held[0][1].close()
        assert await eventually(lambda: listener_connections(server) == 3, 2)
        table = await within(10, fetch_async(server.uri, "t"))  # room again
        assert table.num_rows == sample_table().num_rows
        for _reader, writer in held[1:]:
            writer.close()


async def test_at_max_connections_accepting_pauses_until_one_closes() -> None:
    async with Server({"t": sample_table()}, max_connections=2) as server:
        port = _port(server.uri)
        held = [await _raw(port) for _ in range(2)]
        assert await eventually(lambda: listener_connections(server) == 2, 2)
        waiting = asyncio.ensure_future(fetch_async(server.uri, "t"))
        await asyncio.sleep(0.5)
        assert not waiting.done(), "a third connection was served past max_connections=2"
        assert listener_connections(server) == 2
        held[0][1].close()
        table = await within(10, waiting)
        assert table.num_rows == sample_table().num_rows
        held[1][1].close()


def test_default_connection_limit_is_below_the_fd_limit() -> None:
    from dissoc.transport.base import default_max_connections

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert 1 <= default_max_connections() <= 1024
    if soft != resource.RLIM_INFINITY:
        assert default_max_connections() < soft


# ------------------------------------------------------------------------------------------------- UCX


@pytest.mark.ucx
async def test_ucx_huge_ticket_is_refused_before_it_is_received() -> None:
    async with Server({"t": sample_table()}, transport="ucx", max_ticket_bytes=1024) as server:
        port = _port(server.uri)
        budget = server.receive_budget
        assert budget is not None
        conn = await connect("ucx", "127.0.0.1", port)
        try:
            # The send completes only if the server receives it (UCX rendezvous), so it may fail itself.
            with pytest.raises(TransportError):
                await within(10, conn.send_tagged(DEFAULT_WANT_DATA, b"t" * (64 * MiB)))
                await within(10, conn.recv())
            assert budget.used == 0
        finally:
            await conn.close()
        table = await within(30, fetch_async(server.uri, "t"))
        assert table.num_rows == sample_table().num_rows


@pytest.mark.ucx
async def test_ucx_max_connections_refuses_the_extra_one() -> None:
    async with Server(
        {"t": sample_table()}, transport="ucx", max_connections=1, want_data_timeout=1.0
    ) as server:
        port = _port(server.uri)
        first = await connect("ucx", "127.0.0.1", port)
        try:
            assert await eventually(lambda: listener_connections(server) == 1, 5)
            with pytest.raises(TransportError):
                second = await connect("ucx", "127.0.0.1", port, timeout=3)
                await within(5, second.recv())
        finally:
            await first.close()
        # The idle one is dropped by its deadline and has closed: room again.
        assert await eventually(lambda: listener_connections(server) == 0, 5)
        table = await within(30, fetch_async(server.uri, "t"))
        assert isinstance(table, pa.Table) and table.num_rows == sample_table().num_rows
