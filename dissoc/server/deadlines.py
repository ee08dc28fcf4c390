"""The deadlines of a server's connections: a connection that sends no complete want_data within
``want_data_timeout`` of connecting, leaves a later request unfinished that long, or sits idle (no request,
no stream, no listed ranges held) for ``idle_timeout`` is dropped (logged at debug level, counted by
reason). One timer per server looks at every watched connection, a few times per shortest deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dissoc.metrics import SERVER
from dissoc.transport import Connection

__all__ = ["Deadlines", "Watch"]

log = logging.getLogger(__name__)


class Watch:
    """Where one connection stands, for the deadlines."""

    __slots__ = ("first", "frame", "frame_since", "since", "streaming")

    def __init__(self, now: float) -> None:
        self.first = True  # no want_data received yet
        self.streaming = False
        self.since = now  # connected, or the last stream ended
        self.frame: object | None = None  # the partly received frame seen last
        self.frame_since = now

    def request(self) -> None:
        """A want_data arrived: its stream begins."""
        self.first = False
        self.streaming = True

    def answered(self) -> None:
        """The stream (or the error) went: idle from now."""
        self.streaming = False
        self.since = time.monotonic()


class Deadlines:
    """Drops the watched connections past a deadline (None turns one off; with neither, nothing is watched).
    ``holds_ranges(conn)`` says whether a connection's client holds listed ranges (it will send free_data
    later: not idle)."""

    def __init__(
        self,
        want_data_timeout: float | None,
        idle_timeout: float | None,
        holds_ranges: Callable[[Connection], bool],
    ) -> None:
        self.want_data_timeout = want_data_timeout
        self.idle_timeout = idle_timeout
        self._holds_ranges = holds_ranges
        self._watched: dict[Connection, Watch] = {}
        self._ticker: asyncio.TimerHandle | None = None
        self._drops: set[asyncio.Task[None]] = set()

    def watch(self, conn: Connection) -> Watch | None:
        """Start watching a new connection (None: there are no deadlines)."""
        if self.want_data_timeout is None and self.idle_timeout is None:
            return None
        watch = Watch(time.monotonic())
        self._watched[conn] = watch
        if self._ticker is None:
            self._schedule_tick()
        return watch

    def forget(self, conn: Connection) -> None:
        """The connection ended."""
        self._watched.pop(conn, None)

    def close(self) -> None:
        """Stop the timer (the server is closing)."""
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    def _tick_seconds(self) -> float:
        timeouts = [t for t in (self.want_data_timeout, self.idle_timeout) if t is not None]
        return min(1.0, max(0.05, min(timeouts) / 4))

    def _schedule_tick(self) -> None:
        self._ticker = asyncio.get_running_loop().call_later(self._tick_seconds(), self._tick)

    def _tick(self) -> None:
        self._ticker = None
        self.check(time.monotonic())
        if self._watched:
            self._schedule_tick()

    def check(self, now: float) -> None:
        """Drop the connections past a deadline at ``now``."""
        for conn, watch in list(self._watched.items()):
            if watch.streaming or conn.closed:
                continue
            kind, reason = self._overdue(conn, watch, now)
            if reason:
                SERVER.refusals.inc(kind)
                log.debug("dropping %s: %s", conn.description, reason)
                del self._watched[conn]
                task = asyncio.get_running_loop().create_task(conn.close())
                self._drops.add(task)
                task.add_done_callback(self._drops.discard)

    def _overdue(self, conn: Connection, watch: Watch, now: float) -> tuple[str, str]:
        """The deadline ``conn`` is past (its kind, for the metrics, and why, in words), or ``("", "")``."""
        want_data_timeout, idle_timeout = self.want_data_timeout, self.idle_timeout
        if watch.first:
            if want_data_timeout is not None and now - watch.since > want_data_timeout:
                return (
                    "want_data_timeout",
                    f"no complete want_data within {want_data_timeout} s of connecting",
                )
            return "", ""
        frame = conn.idle_frame()
        if frame is None or frame != watch.frame:
            watch.frame = frame
            watch.frame_since = now
        elif want_data_timeout is not None and now - watch.frame_since > want_data_timeout:
            return "request_timeout", f"a request left unfinished for {want_data_timeout} s"
        if idle_timeout is not None:
            if self._holds_ranges(conn):
                watch.since = now  # a client holding listed ranges will send free_data later
            elif now - watch.since > idle_timeout:
                return "idle_timeout", f"idle for {idle_timeout} s"
        return "", ""
