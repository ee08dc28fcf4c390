"""Running the client's coroutines from synchronous code (``fetch``, ``open_stream``, ``dissoc get``).

The main thread's synchronous calls share one event loop (:func:`main_runner`), so that connections one call
leaves in its pool serve the next; other threads get a loop per call; a caller inside a running loop gets a
helper thread; zero-copy streams run on one process-wide loop thread (:class:`SharedRunner`), since their
sessions outlive the calls that started them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

from dissoc.session.pool import own, pool_of

__all__ = ["LoopRunner", "SharedRunner", "ThreadRunner", "close_idle_main", "main_runner", "run"]


class LoopRunner:
    """``run``/``close`` on a private event loop in the caller's thread.

    Not ``asyncio.Runner``: on the main thread its ``run`` looks up and swaps the SIGINT handler around each
    call, and ``signal.getsignal`` formats the handler, which holds the previous call's task, whose result is
    a burst of batches: pyarrow formats their values, milliseconds per call. Ctrl-C here interrupts the loop
    with ``KeyboardInterrupt`` as in any synchronous call.

    The main thread's synchronous calls share one such loop (:func:`main_runner`), so that connections left
    in its pool by one call serve the next; ``close`` does nothing to it, :meth:`shutdown` (at exit) does.
    """

    def __init__(self, *, shared: bool = False) -> None:
        self._loop = asyncio.new_event_loop()
        self._shared = shared
        # A reader exported through the Arrow PyCapsule interface is pulled from the consumer's threads
        # (DuckDB's, polars'), one at a time; the lock keeps two threads from entering the loop at once
        # (reentrant: a nested call fails as asyncio makes it, it does not hang).
        self._lock = threading.RLock()
        own(self._loop)

    def run(self, coro: Any) -> Any:
        with self._lock:
            return self._loop.run_until_complete(coro)

    def close(self) -> None:
        if not self._shared:
            self.shutdown()

    def close_idle(self) -> None:
        """Close the idle connections of this loop's pool."""
        with self._lock:
            if not self._loop.is_closed():
                self._loop.run_until_complete(pool_of(self._loop).aclose())

    def shutdown(self) -> None:
        loop = self._loop
        if loop.is_closed():
            return
        try:
            loop.run_until_complete(pool_of(loop).aclose())
            loop.run_until_complete(loop.shutdown_asyncgens())
            with contextlib.suppress(RuntimeError):
                # At interpreter exit Python 3.12+ starts no thread, and this one would join the executor;
                # concurrent.futures joins its workers itself then.
                loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


_main: LoopRunner | None = None


def main_runner() -> LoopRunner | None:
    """The main thread's shared loop (None in other threads: each call there gets a loop of its own)."""
    global _main
    if threading.current_thread() is not threading.main_thread():
        return None
    if _main is None:
        _main = LoopRunner(shared=True)
        atexit.register(_main.shutdown)
    return _main


def _forget_main_runner() -> None:
    """In a forked child the parent's loop and pooled connections are the parent's: never use them."""
    global _main
    _main = None


os.register_at_fork(after_in_child=_forget_main_runner)


class ThreadRunner:
    """``asyncio.Runner``'s ``run``/``close`` on a loop in a helper thread (for callers inside a loop)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dissoc-reader", daemon=True)
        self._thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class SharedRunner(ThreadRunner):
    """One process-wide loop thread for zero-copy sessions, which must outlive the calls that started them.

    Its loop is dissoc's own, so it pools connections as the main thread's loop does: a zero-copy session's
    connection goes back to the pool once its last batch is released, and the next call takes it."""

    _instance: SharedRunner | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        own(self._loop)

    @classmethod
    def get(cls) -> SharedRunner:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
                atexit.register(cls._instance.close_idle)
            return cls._instance

    @classmethod
    def existing(cls) -> SharedRunner | None:
        return cls._instance

    def close(self) -> None:
        """Never stopped by a reader: other sessions may still be using it."""

    def close_idle(self) -> None:
        """Close the idle connections of this loop's pool (waits at most 10 s)."""
        loop = self._loop
        if loop.is_closed() or not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(pool_of(loop).aclose(), loop).result(timeout=10)


def run(coro_factory: Callable[[], Any]) -> Any:
    """Run a coroutine to completion from synchronous code, even when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        runner = main_runner() or LoopRunner()
        try:
            return runner.run(coro_factory())
        finally:
            runner.close()
    result: list[Any] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro_factory()))
        except BaseException as e:
            error.append(e)

    t = threading.Thread(target=target, name="dissoc-fetch")
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]


def close_idle_main() -> None:
    """Close the idle connections of the main thread's shared loop (from the main thread; else nothing)."""
    runner = _main if threading.current_thread() is threading.main_thread() else None
    if runner is not None:
        runner.close_idle()
    shared = SharedRunner.existing()
    if shared is not None:
        shared.close_idle()
