"""Idle client connections kept for the next stream to the same server.

A dissoc server keeps a connection open after a stream for the client's next want_data (until its
``idle_timeout``, 300 s by default), and a connection costs far more to make than to reuse: a UCX
connection makes a worker on each side (tens of milliseconds), a TLS one a handshake. The client therefore
gives the connections of a stream that ended cleanly back to the pool of its event loop, and the next
stream to the same endpoint, with the same connection options, takes them. By default only the loops the
library runs itself do this (the synchronous API's, closed with their pool at exit); an application's own
loop pools with ``ClientOptions(reuse_connections=True)`` and closes the pool with
:func:`dissoc.client.close_idle_connections` before the loop ends. A connection idle for longer
than :data:`MAX_IDLE_S` (well under the server's timeout) or closed meanwhile is dropped instead.

Connections of zero-copy streams are not pooled: their batches keep ranges of the server's arena, tied to
the connection, until they are released; copy-mode pair readers free every range before the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Hashable

from dissoc.errors import DissocError
from dissoc.transport import Connection

__all__ = ["MAX_IDLE_S", "MAX_PER_KEY", "ConnectionPool", "own", "owned", "pool_of"]

log = logging.getLogger(__name__)

#: Seconds a connection may wait in the pool (far less than a server's default idle_timeout: a client that
#: comes back later connects afresh rather than hold a server's connection for nothing).
MAX_IDLE_S = 5.0
#: Idle connections kept per endpoint (more streams at once make more connections; the rest are closed).
MAX_PER_KEY = 4

_background: set[asyncio.Task[None]] = set()


class ConnectionPool:
    """Idle connections of one event loop, by endpoint and connection options (``key``)."""

    def __init__(self) -> None:
        self._idle: dict[Hashable, list[tuple[Connection, float]]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def _prune(self, now: float) -> None:
        """Close the connections of every endpoint that waited too long or were closed meanwhile."""
        for key, idle in list(self._idle.items()):
            keep = [(c, t) for c, t in idle if now - t < MAX_IDLE_S and not c.closed]
            if len(keep) != len(idle):
                for c, t in idle:
                    if now - t >= MAX_IDLE_S or c.closed:
                        self._close_later(c)
                if keep:
                    self._idle[key] = keep
                else:
                    del self._idle[key]

    async def take(self, key: Hashable) -> Connection | None:
        """The most recently returned live connection for ``key``, or None."""
        if not self._idle:
            return None
        # One turn of the loop first: a connection the server closed meanwhile sees its end of stream now.
        await asyncio.sleep(0)
        now = time.monotonic()
        self._prune(now)
        idle = self._idle.get(key)
        if not idle:
            return None
        while idle:
            conn, since = idle.pop()
            if not conn.closed and conn.buffered_bytes == 0 and now - since < MAX_IDLE_S:
                if not idle:
                    self._idle.pop(key, None)
                log.debug("reusing %s (idle %.3f s)", conn.description, now - since)
                return conn
            self._close_later(conn)
        self._idle.pop(key, None)
        return None

    def give(self, key: Hashable, conn: Connection) -> None:
        """Keep ``conn`` for the next stream to ``key`` (closed instead when it cannot be reused)."""
        conn.set_receiver(None)
        conn.set_allocator(None)
        conn.set_lander(None)
        if conn.closed or conn.buffered_bytes:
            self._close_later(conn)
            return
        now = time.monotonic()
        self._prune(now)
        idle = self._idle.setdefault(key, [])
        idle.append((conn, now))
        while len(idle) > MAX_PER_KEY:
            self._close_later(idle.pop(0)[0])

    def discard(self, conn: Connection) -> None:
        """Forget ``conn`` if it is pooled (its owner closes it)."""
        for key, idle in list(self._idle.items()):
            self._idle[key] = [(c, t) for c, t in idle if c is not conn]

    async def aclose(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _ in conns:
                with contextlib.suppress(DissocError):
                    await conn.close()

    @staticmethod
    def _close_later(conn: Connection) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(_close_quietly(conn))
        _background.add(task)
        task.add_done_callback(_background.discard)


async def _close_quietly(conn: Connection) -> None:
    with contextlib.suppress(DissocError):
        await conn.close()


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ConnectionPool] = weakref.WeakKeyDictionary()
_OWNED: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def own(loop: asyncio.AbstractEventLoop) -> None:
    """Mark ``loop`` as one the library runs itself (the synchronous API's): it closes that loop's pool
    before the loop, so streams there reuse connections unless told not to."""
    _OWNED.add(loop)


def owned(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` was marked with :func:`own`."""
    return loop in _OWNED


def pool_of(loop: asyncio.AbstractEventLoop) -> ConnectionPool:
    """The pool of idle connections of ``loop`` (made on first use; it goes with the loop)."""
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = ConnectionPool()
    return pool
