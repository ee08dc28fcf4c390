"""Connections for the transport tests: connected pairs through any registered transport, over TCP and in
process, and a raw-socket peer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

from dissoc.transport import Connection, TcpConnection, connect, connect_tcp, serve
from dissoc.transport.inproc import inproc_pair


@contextlib.asynccontextmanager
async def connected_pair(
    scheme: str,
    client_options: dict[str, Any] | None = None,
    server_options: dict[str, Any] | None = None,
    timeout: float = 10,
) -> AsyncIterator[tuple[Connection, Connection]]:
    """A client connection and the server side of it, through the transport registered for ``scheme``."""
    accepted: asyncio.Queue[Connection] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(conn: Connection) -> None:
        await accepted.put(conn)
        await done.wait()

    listener = await serve(scheme, "127.0.0.1", 0, handler, **(server_options or {}))
    try:
        client = await connect(scheme, "127.0.0.1", listener.port, **(client_options or {}))
        server = await asyncio.wait_for(accepted.get(), timeout)
        try:
            yield client, server
        finally:
            await client.close()
            await server.close()
    finally:
        done.set()
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), timeout)


def tcp_pair(
    client_options: dict[str, Any] | None = None, server_options: dict[str, Any] | None = None
) -> contextlib.AbstractAsyncContextManager[tuple[Connection, Connection]]:
    """A client connection and the server side of it, over loopback TCP."""
    return connected_pair("tcp", client_options, server_options, timeout=5)


@contextlib.asynccontextmanager
async def joined_inproc(**options: Any) -> AsyncIterator[tuple[Connection, Connection]]:
    """Two joined in-process ends."""
    a, b = inproc_pair(**options)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


@contextlib.asynccontextmanager
async def make_pair(kind: str, **options: Any) -> AsyncIterator[tuple[Connection, Connection]]:
    """A connected pair of the given kind (``tcp`` or ``inproc``); ``options`` are limits for both ends."""
    if kind == "tcp":
        async with tcp_pair(options, options) as pair:
            yield pair
    else:
        async with joined_inproc(**options) as pair:
            yield pair


@contextlib.asynccontextmanager
async def raw_peer(**options: Any) -> AsyncIterator[tuple[TcpConnection, socket.socket]]:
    """A :class:`TcpConnection` whose peer is a plain blocking socket the test writes raw bytes to."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        connecting = asyncio.ensure_future(connect_tcp("127.0.0.1", listener.getsockname()[1], **options))
        raw, _ = await loop.sock_accept(listener)
        conn = await connecting
        raw.setblocking(True)
        raw.settimeout(5)
        try:
            yield conn, raw
        finally:
            await conn.close()
            raw.close()
    finally:
        listener.close()
