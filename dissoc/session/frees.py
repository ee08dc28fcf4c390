"""free_data: giving the server back the arena ranges a stream's batches are done with.

Copy-mode pair reads are done with their ranges as they are read; zero-copy batches when the consumer releases
them, in any thread (the reader's ``on_release``). Either way the ranges gather here and go to the data
server in one free_data message per flush, from the session's event loop. A connection that is gone needs
none: a server releases what it listed on a connection when that closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any

from dissoc.errors import DissocError, TransportError
from dissoc.metrics import CLIENT
from dissoc.protocol import encode_free
from dissoc.transport import Connection
from dissoc.uri import DissocURI

__all__ = ["Frees", "background", "settle"]

log = logging.getLogger("dissoc.client")  # (the client's lines, wherever its machinery lives)

#: Tasks that outlive the call that started them (frees sent later, zero-copy sessions waiting for their
#: batches to go).
background: set[asyncio.Task[None]] = set()


def run_later(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` in the running loop, kept in :data:`background` until it is done."""
    task = asyncio.get_running_loop().create_task(coro)
    background.add(task)
    task.add_done_callback(background.discard)


async def settle(timeout: float = 5.0) -> None:
    """Wait (up to ``timeout`` s) for this loop's zero-copy sessions to end: each ends when the batches over
    the server's memory are released, after it has sent their free_data. Call it before the loop closes, so
    that no session is cut off with frees unsent."""
    loop = asyncio.get_running_loop()
    mine = [t for t in background if t.get_loop() is loop and not t.done()]
    if mine:
        await asyncio.wait(mine, timeout=timeout)


class Frees:
    """The ranges to free for one stream, and their free_data messages on its data connection."""

    def __init__(self, data_uri: DissocURI, pending: list[int]) -> None:
        self.data_uri = data_uri
        #: Offsets to free with the next flush (shared with the stream's :class:`Decoding`).
        self.pending = pending
        self.conn: Connection | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._nudge: asyncio.Future[bool] | None = None  # a lingering session waits on it (see linger)
        # Releases from other threads gather here; one loop callback takes each gathering (not one a batch).
        self._inbox: list[int] = []
        self._inbox_lock = threading.Lock()
        self._posted = False

    def released(self, offsets: list[int]) -> None:
        """A zero-copy batch was released (in any thread): free its ranges from the event loop."""
        self._post(offsets)

    def drained(self) -> None:
        """The reader's last live zero-copy batch was released (in any thread; its ranges were handed over
        first): wakes a lingering session, so that it ends (and its connections go back to the pool) at
        once."""
        self._post([])

    def _post(self, offsets: list[int]) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        with self._inbox_lock:
            self._inbox.extend(offsets)
            if self._posted:
                return  # the callback already on its way takes these too
            self._posted = True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
            if running is loop:
                loop.call_soon(self._take_inbox)  # (the loop's own thread: no wake-up needed)
            else:
                loop.call_soon_threadsafe(self._take_inbox)

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            offsets, self._inbox = self._inbox, []
            self._posted = False
        self._later(offsets)

    def _later(self, offsets: list[int]) -> None:
        self.pending.extend(offsets)
        nudge = self._nudge
        if nudge is not None and not nudge.done():
            nudge.set_result(True)
        if not self._scheduled and self.conn is not None:
            # One flush for every release that happens before it runs (free_data messages are coalesced).
            self._scheduled = True
            run_later(self.flush_quietly())

    async def flush_quietly(self) -> None:
        self._scheduled = False
        with contextlib.suppress(DissocError):
            await self.flush()

    async def flush(self) -> None:
        """Send the offsets gathered so far as one free_data message."""
        if self.pending and self.conn is not None and self.data_uri.free_data is not None:
            addresses = self.pending[:]
            self.pending.clear()
            try:
                await self.conn.send_tagged(self.data_uri.free_data, encode_free(addresses))
            except TransportError as e:
                log.debug("free_data of %d ranges not sent (the connection is gone): %s", len(addresses), e)
                return
            CLIENT.free_data.inc(self.data_uri.scheme)

    def _settled(self, idle: threading.Event) -> bool:
        """Whether the last batch was released and every range handed over is in :attr:`pending` (a reader
        hands a batch's ranges over before it counts the batch gone)."""
        if not idle.is_set():
            return False
        with self._inbox_lock:
            return not self._posted

    async def linger(self, idle: threading.Event) -> None:
        """Flush as zero-copy batches are released, until the last one is (``idle``) and its ranges are in:
        woken by each release and by the last (:meth:`drained`: the connection goes back to the pool as soon
        as the last batch is gone), and every 50 ms anyway."""
        loop = asyncio.get_running_loop()
        wait = 0.001
        while not self._settled(idle):
            # (not asyncio.wait_for: in Python 3.11 it can swallow a cancellation that meets a release)
            nudge = self._nudge = loop.create_future()
            timer = loop.call_later(wait, _expire, nudge)
            try:
                nudged = await nudge
            finally:
                timer.cancel()
                self._nudge = None
            wait = 0.001 if nudged else min(0.05, wait * 4)
            await self.flush_quietly()


def _expire(nudge: asyncio.Future[bool]) -> None:
    if not nudge.done():
        nudge.set_result(False)
