"""Connections for a stream: made with the client's transport settings, or taken from the loop's pool."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

from dissoc.errors import TransportError
from dissoc.session.options import ClientOptions
from dissoc.session.pool import pool_of
from dissoc.transport import Connection, connect
from dissoc.uri import DissocURI

__all__ = ["open_connection", "pool_key", "take_or_open"]


async def open_connection(uri: DissocURI, options: ClientOptions) -> Connection:
    """A fresh connection to ``uri``'s server with ``options``' transport settings (TLS files, UCX path,
    read-ahead budget), within ``options.timeout``; failures are :class:`~dissoc.errors.TransportError`."""
    extra: dict[str, Any] = {}
    if uri.scheme == "ucx":
        extra = {"worker": uri.params.get("worker"), "path": options.ucx_path}
    elif uri.scheme == "tls":
        from dissoc.transport.tls import cached_client_context

        extra = {
            "tls": cached_client_context(options.tls_ca, options.tls_cert, options.tls_key),
            "keepalive": options.keepalive,
        }
    elif uri.scheme == "tcp":
        extra = {"keepalive": options.keepalive}
    try:
        return await asyncio.wait_for(
            connect(
                uri.scheme,
                uri.host,
                uri.port,
                max_buffered_bytes=options.max_buffered_bytes,
                **extra,
            ),
            options.connect_timeout,
        )
    except TimeoutError:
        raise TransportError(
            f"connecting to {uri.host}:{uri.port}: no answer within {options.connect_timeout} s"
        ) from None
    except OSError as e:
        raise TransportError(f"connecting to {uri.host}:{uri.port} failed: {e}") from None


def pool_key(uri: DissocURI, options: ClientOptions) -> Hashable:
    """What a pooled connection must match to serve a stream: the endpoint and the connection options."""
    o = options
    return (
        uri.scheme,
        uri.host,
        uri.port,
        uri.params.get("worker"),
        o.ucx_path,
        o.tls_ca,
        o.tls_cert,
        o.tls_key,
        o.max_buffered_bytes,
        o.keepalive,
    )


async def take_or_open(uri: DissocURI, options: ClientOptions, *, pooled: bool) -> tuple[Connection, bool]:
    """A connection to ``uri``: an idle one from the running loop's pool where ``pooled``, else a fresh one;
    and whether it came from the pool."""
    if pooled:
        conn = await pool_of(asyncio.get_running_loop()).take(pool_key(uri, options))
        if conn is not None:
            return conn, True
    return await open_connection(uri, options), False
