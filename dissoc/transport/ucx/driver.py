"""Progress of a UCX worker, driven by the asyncio event loop (:mod:`dissoc.transport.ucx`, "Progress")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from dissoc.errors import DissocError, TransportError
from dissoc.transport.ucx.endpoint import RawRequest

__all__ = ["MAX_ROUNDS", "Driver", "Pending"]

logger = logging.getLogger(__name__)

#: Seconds between guard progress calls while requests are outstanding.
_GUARD_PERIOD = 0.5
#: Progress/probe rounds before the worker is armed even though work keeps appearing (then come back soon).
MAX_ROUNDS = 64

#: Outstanding requests of closed connections, with their buffers and worker (see Driver.close).
_ABANDONED: list[tuple[Pending, Any]] = []


class Pending:
    """An outstanding UCX request, the buffer it uses (kept alive until it completes) and who waits on it."""

    __slots__ = ("future", "keep", "request")

    def __init__(self, request: Any, keep: object, future: asyncio.Future[None] | None) -> None:
        self.request = request
        self.keep = keep
        self.future = future


class Driver:
    """Progresses one UCX worker from the event loop: woken by the worker's epoll descriptor, never spinning.

    ``on_progress`` runs after each progress pass (it completes receives, probes for new messages) and returns
    True when it started or finished something, in which case the worker is progressed again before it is
    armed. Requests handed to :meth:`wait` are completed here.
    """

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop, description: str) -> None:
        self.worker = worker
        self.loop = loop
        self.description = description
        self.on_progress: Callable[[], bool] = lambda: False
        self.on_error: Callable[[DissocError], None] = lambda exc: None
        #: Outstanding requests; the owner may add its own (with or without a waiter) to keep their buffers.
        self.pending: list[Pending] = []
        #: Buffers of requests given up on at close (see close), kept as long as the worker.
        self.orphans: list[tuple[object, object]] = []
        self._scheduled = False
        self._guard: asyncio.TimerHandle | None = None
        self._closed = False
        self.busy: Callable[[], bool] = lambda: False
        #: True while the owner paused reading: the worker is then not progressed (unless a send of ours
        #: waits), so what the peer sends stays in the transport and the peer's sends do not complete.
        self.held: Callable[[], bool] = lambda: False
        self._watching = True
        try:
            worker.init_blocking_progress_mode()
            self._fd: int = worker.epoll_file_descriptor
        except Exception as exc:
            raise TransportError(f"{description}: cannot set up UCX blocking progress: {exc}") from exc
        loop.add_reader(self._fd, self.run)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def kick(self) -> None:
        """Progress soon (after the current callback): something was posted or a consumer started waiting."""
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self.loop.call_soon(self._scheduled_run)

    def _scheduled_run(self) -> None:
        self._scheduled = False
        self.run()

    def _guard_run(self) -> None:
        self._guard = None
        self.run()

    def run(self) -> None:
        """Progress the worker until it has nothing left to do (bounded), then arm it for the next wake-up."""
        if self._closed:
            return
        if self.held() and not self.pending:
            # Reading is paused: progressing would move eager messages from the transport into UCX's
            # unexpected queue (unbounded memory, and the sender's sends complete). Leave them where they
            # are, so that the sender waits, and stop watching the descriptor until reading resumes.
            if self._watching:
                self.loop.remove_reader(self._fd)
                self._watching = False
            return
        if not self._watching:
            self.loop.add_reader(self._fd, self.run)
            self._watching = True
        worker = self.worker
        try:
            for _ in range(MAX_ROUNDS):
                worker.progress()
                self.complete()
                if self._closed:
                    return
                if self.on_progress():
                    continue
                if self._closed:
                    return
                if worker.arm():
                    break
            else:
                self.kick()
        except DissocError as exc:
            self.on_error(exc)
        except Exception as exc:
            logger.debug("%s: progress failed", self.description, exc_info=True)
            self.on_error(TransportError(f"{self.description}: UCX progress failed: {exc}"))
        if not self._closed and self._guard is None and (self.pending or self.busy()):
            self._guard = self.loop.call_later(_GUARD_PERIOD, self._guard_run)

    def complete(self) -> None:
        """Drop the requests UCX completed, waking their waiters (with the request's error, if any)."""
        pending = self.pending
        if not pending:
            return
        still: list[Pending] = []
        for item in pending:
            if item.request.completed:
                future = item.future
                if future is not None and not future.done():
                    try:
                        item.request.check_error()
                    except Exception as exc:
                        future.set_exception(TransportError(f"{self.description}: {exc}"))
                    else:
                        future.set_result(None)
            else:
                still.append(item)
        self.pending = still

    async def wait(self, request: Any, keep: object, what: str) -> None:
        """Wait for ``request`` (holding ``keep`` alive until it completes); UCX errors -> TransportError."""
        if request.completed:
            try:
                request.check_error()
            except Exception as exc:
                raise TransportError(f"{self.description}: {what} failed: {exc}") from exc
            return
        if self._closed:
            raise TransportError(f"{self.description}: {what}: the connection is closed")
        future: asyncio.Future[None] = self.loop.create_future()
        self.pending.append(Pending(request, keep, future))
        self.kick()
        try:
            await future
        except TransportError as exc:
            raise TransportError(f"{what} failed: {exc}") from exc
        finally:
            del future  # the error's traceback keeps this frame (see Connection.recv_tagged)

    def fail_pending(self, exc: TransportError) -> None:
        """Fail every waiter on an outstanding request (the requests themselves are cancelled by UCX)."""
        for item in self.pending:
            if item.future is not None and not item.future.done():
                item.future.set_exception(TransportError(str(exc)))

    def close(self) -> None:
        """Stop watching the worker (idempotent); outstanding requests are cancelled."""
        if self._closed:
            return
        self._closed = True
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._fd)
        with contextlib.suppress(Exception):
            self.worker.cancel_inflight_requests(0, 1)
        self.fail_pending(TransportError(f"{self.description}: the connection is closed"))
        # Requests UCX has not completed may still use their buffers: keep those (and the worker) alive
        # until they complete, checked whenever a driver closes.
        _ABANDONED[:] = [(p, w) for p, w in _ABANDONED if not p.request.completed]
        for item in self.pending:
            if item.request.completed:
                continue
            if isinstance(item.request, RawRequest):
                # dissoc's own request (libucp's, through ctypes): the worker need not stay for it, only
                # the memory UCX might read until the worker is destroyed, which goes with this driver.
                self.orphans.append((item.request.orphan(), item.keep))
            else:
                _ABANDONED.append((item, self.worker))
        self.pending = []
        # The owner's callbacks refer back to it (and it to this driver): without them the cycle is gone, so
        # the worker is destroyed as soon as its owner lets go, not when the garbage collector next runs.
        self.on_progress = _nothing
        self.on_error = _ignore
        self.busy = _nothing
        self.held = _nothing


def _nothing() -> bool:
    return False


def _ignore(exc: DissocError) -> None:
    del exc
