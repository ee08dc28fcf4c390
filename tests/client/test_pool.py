"""Connections reused between streams: the synchronous API keeps a stream's connections for the next one to
the same server (the server waits for another want_data on them); a connection the server dropped meanwhile
is never used, and one that fails before the stream begins is replaced once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import pyarrow as pa
import pytest
from helpers.e2e import ServerThread, listener_connections, ordered_table

import dissoc
from dissoc.client import (
    ClientOptions,
    close_idle_connections,
    close_idle_connections_sync,
    fetch_device,
    open_stream,
    stream_batches,
)
from dissoc.device import DeviceBatch
from dissoc.memory.cuda import FakeDeviceBackend, use_backend
from dissoc.metrics import SERVER
from dissoc.session import pool as connection_pool
from dissoc.session.pool import ConnectionPool

pytestmark = pytest.mark.timeout(60)

TABLE = ordered_table(batches=6, rows=100)


def _eventually(check: Any, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return bool(check())


@pytest.mark.parametrize("split", [False, True])
def test_the_next_stream_reuses_the_connections(split: bool) -> None:
    with ServerThread({"t": TABLE}, split=split) as srv:
        first = dissoc.fetch(srv.uri, "t", data_uri=srv.data_uri)
        # the stream is over, and its connections wait for the next request (one per port)
        assert listener_connections(srv.server) == (2 if split else 1)
        with open_stream(srv.uri, "t", data_uri=srv.data_uri) as reader:
            streamed = pa.Table.from_batches(list(reader))
        second = dissoc.fetch(srv.uri, "t", data_uri=srv.data_uri)
        assert listener_connections(srv.server) == (2 if split else 1), "the later streams connected anew"
    assert first.equals(TABLE) and streamed.equals(TABLE) and second.equals(TABLE)


@pytest.mark.parametrize("landing", ["host", "device"])
def test_zero_copy_streams_hand_their_connection_to_the_next(landing: str) -> None:
    # A zero-copy stream keeps its connection until its last batch is released; then the next stream of the
    # synchronous API takes it instead of connecting anew (host batches over shm, device batches over the
    # fake device's CUDA IPC).
    memory = "shm" if landing == "host" else "cuda"
    options = ClientOptions(zero_copy=True, timeout=20)
    with contextlib.ExitStack() as stack:
        if landing == "device":
            stack.enter_context(use_backend(FakeDeviceBackend()))
        srv = stack.enter_context(ServerThread({"t": TABLE}, body="pairs", memory=memory))
        before = SERVER.connections.total()
        for _ in range(4):
            if landing == "host":
                got: Any = dissoc.fetch(srv.uri, "t", options=options)
                assert got.equals(TABLE)
            else:
                got = fetch_device(srv.uri, "t", options=options)
                assert DeviceBatch.to_table(got).equals(TABLE)
            del got  # released: the ranges are freed and the connection goes back to the pool
        assert SERVER.connections.total() - before == 1, "a zero-copy stream's successor connected anew"
        close_idle_connections_sync()
        assert _eventually(lambda: listener_connections(srv.server) == 0)
        assert _eventually(lambda: srv.server.placements.held_bytes == 0)


def test_without_reuse_every_stream_closes_its_connection() -> None:
    options = ClientOptions(reuse_connections=False)
    with ServerThread({"t": TABLE}) as srv:
        for _ in range(2):
            assert dissoc.fetch(srv.uri, "t", options=options).equals(TABLE)
            assert _eventually(lambda: listener_connections(srv.server) == 0)


def test_a_connection_the_server_dropped_is_not_reused() -> None:
    # the server drops a connection idle for 0.3 s
    with ServerThread({"t": TABLE}, idle_timeout=0.3) as srv:
        assert dissoc.fetch(srv.uri, "t").equals(TABLE)
        assert _eventually(lambda: listener_connections(srv.server) == 0), "the server kept the idle one"
        assert dissoc.fetch(srv.uri, "t").equals(TABLE)


def test_a_reused_connection_failing_before_the_stream_is_replaced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The loop of the synchronous API does not run between calls, so a pooled connection can look alive
    although the server dropped it: the stream then fails before its first message and is retried once on
    fresh connections."""
    original = ConnectionPool.take

    async def take_without_looking(self: ConnectionPool, key: Any) -> Any:
        idle = self._idle.get(key)  # what take() would return, without the turn of the loop that sees EOF
        if not idle:
            return await original(self, key)
        conn, _since = idle.pop()
        return conn

    with ServerThread({"t": TABLE}, idle_timeout=0.3) as srv:
        assert dissoc.fetch(srv.uri, "t").equals(TABLE)
        assert _eventually(lambda: listener_connections(srv.server) == 0)
        monkeypatch.setattr(ConnectionPool, "take", take_without_looking)
        with caplog.at_level(logging.DEBUG, logger="dissoc.client"):
            assert dissoc.fetch(srv.uri, "t").equals(TABLE)
    assert "a reused connection failed before the stream began" in caplog.text


def test_idle_connections_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection_pool, "MAX_IDLE_S", 0.2)
    with ServerThread({"t": TABLE}) as srv:
        assert dissoc.fetch(srv.uri, "t").equals(TABLE)
        assert listener_connections(srv.server) == 1
        time.sleep(0.3)
        assert dissoc.fetch(srv.uri, "t").equals(TABLE)  # takes a fresh one; the stale one is closed
        assert _eventually(lambda: listener_connections(srv.server) == 1)


async def test_an_application_loop_pools_only_when_asked() -> None:
    with ServerThread({"t": TABLE}) as srv:

        async def read(options: ClientOptions | None) -> int:
            return sum([b.num_rows async for b in stream_batches(srv.uri, "t", options=options)])

        assert await read(None) == TABLE.num_rows
        assert await asyncio.to_thread(_eventually, lambda: listener_connections(srv.server) == 0)
        pooled = ClientOptions(reuse_connections=True)
        assert await read(pooled) == TABLE.num_rows
        assert await read(pooled) == TABLE.num_rows
        assert listener_connections(srv.server) == 1
        await close_idle_connections()
        assert await asyncio.to_thread(_eventually, lambda: listener_connections(srv.server) == 0)


def test_idle_connections_can_be_closed_from_synchronous_code() -> None:
    with ServerThread({"t": TABLE}) as srv:
        assert dissoc.fetch(srv.uri, "t").equals(TABLE)
        assert listener_connections(srv.server) == 1
        close_idle_connections_sync()
        assert _eventually(lambda: listener_connections(srv.server) == 0)
        assert dissoc.fetch(srv.uri, "t").equals(TABLE)  # and the next stream connects afresh
