"""The UCX transport (scheme ``ucx``), over ucxx's low-level bindings (``pip install 'dissoc[ucx]'``).

Mapping (DESIGN.md section 3, the reference example's): tagged messages (want_data, free_data, bodies) are UCX
tagged messages carrying the u64 tag as given (no per-endpoint tag mixing); untagged messages (the metadata
stream) are UCX active messages (ucxx's AM API, which prepends its own small header to each message).

**One worker per connection.** A UCX tag receive does not say which endpoint sent the message, so a server
whose connections shared one worker could not tell its clients' want_data/free_data apart. ucxx's Python API
can only create an accepted endpoint on the *listener's* worker, so connections are set up in two steps:

1. the client creates its own worker and connects a *bootstrap* endpoint to ``host:port`` (the listener, over
   TCP, with UCX peer-failure handling on); it sends ``MAGIC + its worker address`` as an active message;
2. the server creates a fresh worker for the connection, an endpoint from it to the client's worker address,
   and answers ``MAGIC + its own worker address``; the client connects its worker to that address.

Every data message then flows between the two per-connection workers (each has exactly one peer), over the
best transport UCX finds for worker-address endpoints (shared memory on one host, ~5 GB/s here; a listener
endpoint is restricted to TCP). The data endpoints have peer-failure handling off by default (with it on, UCX
drops the shared-memory transports: ~0.7 GB/s here); the bootstrap endpoint stays open as the liveness
monitor: when the peer closes or dies, UCX reports it there, and the connection drains what already arrived
on its data worker, then fails with :class:`~dissoc.errors.TransportError`. Pass ``error_handling=True`` to
both ends to keep peer-failure handling on the data endpoints too. A peer that is not a dissoc ``ucx``
endpoint (for instance the reference C++ client, which uses the listener endpoint for data) is not supported.

**Receiving.** A tagged message is received by probe: for each waiting ``recv_tagged(tag, mask)`` (oldest
first) the worker is probed with ``UCXXTag(tag)``/``UCXXTagMask(mask)``; the probe gives the message's tag and
length before any payload is placed, so the allocator (:meth:`Connection.set_allocator`) provides the buffer,
and ``max_message_bytes`` is checked before it is called. Messages nobody waits for are taken (in arrival
order, probing with mask 0) while the buffering budget allows; the rest stay in UCX (large ones as a
rendezvous announcement only, so the sender waits: UCX's own flow control). Active messages are received by
ucxx as they arrive, into memory it allocates; their size limit can only be checked after the fact.

**Sending.** One UCX message per message: a single buffer is sent as is (held until UCX completes the send);
a list of buffers is first gathered into one (a copy). ``send`` returns when UCX has completed the request.

**Progress.** No thread and no busy loop: each worker runs in blocking mode, its epoll descriptor is watched
by the event loop (``add_reader``); on activity the worker is progressed, requests are completed and probes
are run, then the worker is armed again. While requests are outstanding a 0.5 s timer also progresses it, as
a guard against a missed wake-up. An idle connection costs no CPU.

**Environment.** ucxx is imported lazily, by the first ``serve_ucx``/``connect_ucx`` call, never by importing
this module, and the environment is left as it was: importing ucxx sets, when unset, ``UCX_MEMTYPE_CACHE=n``,
``UCX_RNDV_THRESH=8192``, ``UCX_RNDV_FRAG_MEM_TYPE=cuda`` and ``UCX_MAX_RNDV_RAILS=1`` (ucxx's own choices);
they are taken back out of ``os.environ`` at once and passed to dissoc's UCX context as its configuration
instead (``UCX_*`` variables the user set still win).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import logging
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from dissoc.errors import DissocError, TransportError
from dissoc.transport.base import (
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    TAG_MASK_ALL,
    Allocator,
    BytesLike,
    Connection,
    Handler,
    Listener,
    MessageTooLargeError,
    SendData,
    _as_views,
    _check_u64,
    _Waiter,
    device_nbytes,
    register_transport,
)

__all__ = ["MAGIC", "UcxConnection", "UcxListener", "connect_ucx", "serve_ucx"]

logger = logging.getLogger(__name__)

#: First bytes of every handshake message (then the sender's UCX worker address).
MAGIC = b"DISSOC-UCX/1\0"
#: Tags of the connection-control messages ("DISSOC" then a number). Their top byte has bits the Dissociated
#: IPC tag layout reserves, so no data message carries them.
HELLO_TAG = 0x444953534F430001  # client -> the listener's worker, by worker address: MAGIC + its address
REPLY_TAG = 0x444953534F430002  # server -> the client's worker: MAGIC + the connection worker's address
BYE_TAG = 0x444953534F430003  # either side, on the data endpoint, before it closes the connection
#: Largest handshake message accepted (a UCX worker address is a few hundred bytes).
_MAX_HELLO = 16 * 1024
#: Connection paths (see the module docstring).
PATHS = ("auto", "listener", "address")
#: Untagged messages up to this size are handed out as ``bytes`` (larger ones as a memoryview, no copy).
_SMALL_UNTAGGED = 64 * 1024
#: Seconds between guard progress calls while requests are outstanding.
_GUARD_PERIOD = 0.5
#: Seconds a closing connection waits for its outstanding sends before it closes the endpoints.
_CLOSE_WAIT = 2.0
#: Seconds a closed connection keeps progressing its worker for the endpoint close exchange with the peer.
_RELEASE_WAIT = 1.0
#: Progress/probe rounds before the worker is armed even though work keeps appearing (then come back soon).
_MAX_ROUNDS = 64

_lib_module: Any = None
#: Outstanding requests of closed connections, with their buffers and worker (see _Driver.close).
_ABANDONED: list[tuple[Any, Any]] = []
_context: Any = None


def _lib() -> Any:
    """ucxx's low-level module, imported on first use (see the module docstring about the environment)."""
    global _lib_module
    if _lib_module is None:
        before = dict(os.environ)
        try:
            import ucxx._lib.libucxx as libucxx
        except ImportError as exc:
            raise TransportError(
                f"the 'ucx' transport needs ucxx (pip install 'dissoc[ucx]'): {exc}"
            ) from exc
        finally:
            _restore_environment(before)
        _lib_module = libucxx
    return _lib_module


#: What importing ucxx put into ``os.environ`` (then taken out again): UCX settings, without the prefix.
_UCXX_SETTINGS: dict[str, str] = {}


def _restore_environment(before: dict[str, str]) -> None:
    """Undo what importing ucxx did to ``os.environ``, keeping its UCX choices for our contexts' config."""
    for key in [k for k in os.environ if k not in before]:
        value = os.environ.pop(key)
        if key.startswith("UCX_"):
            _UCXX_SETTINGS[key[4:]] = value
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _ucx_context() -> Any:
    """The process's UCX context (tag matching, active messages, wake-up, RMA), created once."""
    global _context
    if _context is None:
        lib = _lib()
        features = (lib.Feature.TAG, lib.Feature.AM, lib.Feature.WAKEUP, lib.Feature.RMA)
        # Without cma: UCX aborts a process whose cma read fails because the peer died mid-transfer (the data
        # endpoints have no peer-failure handling); shared memory still carries the data. UCX_TLS overrides.
        config = {} if "UCX_TLS" in os.environ else {"TLS": "^cma"}
        # ucxx's own defaults (they were environment variables; UCX_* set by the user still win).
        settings = {k: v for k, v in _UCXX_SETTINGS.items() if f"UCX_{k}" not in os.environ}
        try:
            _context = lib.UCXContext({**settings, **config}, features)
        except Exception:
            logger.debug("UCX context with ucxx's settings %s failed; without them", settings, exc_info=True)
            try:
                _context = lib.UCXContext(config, features)
            except Exception as exc:
                raise TransportError(f"cannot create a UCX context: {exc}") from exc
    return _context


def _array(obj: Any) -> Any:
    from ucxx._lib.arr import Array

    return Array(obj)


def _tag(value: int) -> Any:
    return _lib().UCXXTag(value)


def _mask(value: int) -> Any:
    return _lib().UCXXTagMask(value)


class _Pending:
    """An outstanding UCX request, the buffer it uses (kept alive until it completes) and who waits on it."""

    __slots__ = ("future", "keep", "request")

    def __init__(self, request: Any, keep: Any, future: asyncio.Future[None] | None) -> None:
        self.request = request
        self.keep = keep
        self.future = future


class _Driver:
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
        self._pending: list[_Pending] = []
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
        if self._closed:
            return
        if self.held() and not self._pending:
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
            for _ in range(_MAX_ROUNDS):
                worker.progress()
                self._complete()
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
        if not self._closed and self._guard is None and (self._pending or self.busy()):
            self._guard = self.loop.call_later(_GUARD_PERIOD, self._guard_run)

    def _complete(self) -> None:
        pending = self._pending
        if not pending:
            return
        still: list[_Pending] = []
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
        self._pending = still

    async def wait(self, request: Any, keep: Any, what: str) -> None:
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
        self._pending.append(_Pending(request, keep, future))
        self.kick()
        try:
            await future
        except TransportError as exc:
            raise TransportError(f"{what} failed: {exc}") from exc

    def fail_pending(self, exc: TransportError) -> None:
        """Fail every waiter on an outstanding request (the requests themselves are cancelled by UCX)."""
        for item in self._pending:
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
        _ABANDONED.extend((p, self.worker) for p in self._pending if not p.request.completed)


class _TaggedRecv:
    __slots__ = ("buffer", "length", "request", "tag", "view", "waiter")

    def __init__(
        self, request: Any, tag: int, length: int, buffer: BytesLike, view: memoryview, waiter: int
    ) -> None:
        self.request = request
        self.tag = tag
        self.length = length
        self.buffer = buffer
        self.view = view
        self.waiter = waiter


class UcxConnection(Connection):
    """A :class:`Connection` between two per-connection UCX workers (see the module docstring).

    Get one from :func:`connect_ucx` or in a :func:`serve_ucx` handler. Tagged messages may be sent from
    device memory, and the allocator may return device buffers (UCX's CUDA transports move them).
    """

    device_memory = True

    def __init__(
        self,
        driver: _Driver,
        endpoint: Any,
        bootstrap: Any,
        bootstrap_driver: _Driver,
        *,
        description: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        allocator: Allocator | None = None,
    ) -> None:
        super().__init__(
            max_message_bytes=max_message_bytes,
            max_buffered_bytes=max_buffered_bytes,
            allocator=allocator,
            description=description,
        )
        self._loop = driver.loop
        self._driver = driver
        self._worker = driver.worker
        self._ep = endpoint
        self._bootstrap: Any = bootstrap
        self._bootstrap_driver = bootstrap_driver
        self._am_queue: deque[Any] = deque()
        self._tagged: list[_TaggedRecv] = []
        self._inflight = 0
        self._claimed: dict[int, int] = {}
        self._peer_gone = False
        self._closing = False
        self._release_task: asyncio.Task[None] | None = None
        driver.on_progress = self._on_progress
        driver.on_error = self._teardown
        driver.busy = self._busy
        driver.held = lambda: self._paused_by_owner and not self._closing and not self._closed
        try:
            bootstrap.set_close_callback(self._on_bootstrap_closed)
        except Exception as exc:
            raise TransportError(f"{description}: cannot watch the peer: {exc}") from exc
        if not bootstrap.alive:
            self._loop.call_soon(self._on_peer_gone)
        driver.kick()
        logger.debug("%s open", description)

    # ------------------------------------------------------------------------------------------------ sending

    def _post(self, tagged: bool, tag: int, views: list[Any], total: int) -> tuple[Any, Any, str]:
        """Post one message to UCX; returns the request, what it must keep alive, and a description.

        ``views`` are byte views, or one device buffer (``__cuda_array_interface__``), sent from where it is.
        """
        if len(views) == 1:
            data: Any = views[0]
        else:
            data = np.empty(total, dtype=np.uint8)
            offset = 0
            for view in views:
                data[offset : offset + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
                offset += view.nbytes
        what = f"sending tagged message {tag:#018x}" if tagged else "sending an untagged message"
        if self._closed or self._closing:
            raise self._closed_error(what)
        try:
            array = _array(data)
            request = self._ep.tag_send(array, _tag(tag)) if tagged else self._ep.am_send(array)
        except Exception as exc:
            raise TransportError(f"{self._description}: {what} failed: {exc}") from exc
        return request, (array, data), what

    async def _send_frame(self, tagged: bool, tag: int, views: list[memoryview], total: int) -> None:
        request, keep, what = self._post(tagged, tag, views, total)
        await self._driver.wait(request, keep, what)

    async def send_tagged(self, tag: int, data: SendData) -> None:
        """Send one tagged message (host buffers, or one device buffer sent from device memory)."""
        await self.send_many([(tag, data)])

    async def send_many(self, messages: Sequence[tuple[int | None, SendData]]) -> None:
        """Post every message at once, in order, then wait for them all (see :meth:`Connection.send_many`)."""
        prepared: list[tuple[bool, int, list[Any], int]] = []
        for tag, data in messages:
            if tag is not None:
                _check_u64(tag, "tag")
            device = _device_item(data)
            if device is not None:
                prepared.append((tag is not None, tag or 0, [device[0]], device[1]))
                continue
            views, total = _as_views(data)
            prepared.append((tag is not None, tag or 0, views, total))
        posted = [self._post(tagged, tag, views, total) for tagged, tag, views, total in prepared]
        for request, keep, what in posted:
            await self._driver.wait(request, keep, what)

    # ---------------------------------------------------------------------------------------------- receiving

    def _busy(self) -> bool:
        return bool(self._tagged or self._am_queue or self._blocked)

    def _on_flow(self) -> None:
        self._driver.kick()

    def _on_progress(self) -> bool:
        if self._closed:
            return False
        activity = self._finish_tagged()
        activity = self._pump_untagged() or activity
        activity = self._pump_tagged() or activity
        return activity

    def _finish_tagged(self) -> bool:
        if not self._tagged:
            return False
        done = [r for r in self._tagged if r.request.completed]
        if not done:
            return False
        self._tagged = [r for r in self._tagged if not r.request.completed]
        for item in done:
            self._inflight -= item.length
            self._release_claim(item.waiter)
            try:
                item.request.check_error()
            except Exception as exc:
                self._teardown(
                    TransportError(
                        f"{self._description}: receiving tagged message {item.tag:#018x} failed: {exc}"
                    )
                )
                return True
            self._deliver_tagged(item.tag, item.buffer, item.length)
        return True

    def _release_claim(self, waiter: int) -> None:
        if waiter:
            left = self._claimed.get(waiter, 0) - 1
            if left > 0:
                self._claimed[waiter] = left
            else:
                self._claimed.pop(waiter, None)

    def _pump_untagged(self, force: bool = False) -> bool:
        """Deliver completed active messages in order; keep one receive posted while reading is admitted.

        (ucxx's ``am_probe`` stays true once a message was seen from the endpoint, so it cannot tell whether
        another one is waiting; a posted ``am_recv`` completes as soon as one is there.)
        """
        activity = False
        queue = self._am_queue
        while not self._closed:
            if queue:
                request = queue[0]
                if not request.completed:
                    break
                queue.popleft()
                activity = True
                self._finish_untagged(request)
                continue
            if not (force or self._may_take(0, any(not f.done() for f in self._untagged_waiters))):
                break
            try:
                queue.append(self._ep.am_recv())
            except Exception as exc:
                self._teardown(
                    TransportError(f"{self._description}: receiving an untagged message failed: {exc}")
                )
                return True
            if not queue[0].completed:
                break
        return activity

    def _finish_untagged(self, request: Any) -> None:
        try:
            request.check_error()
            buffer = request.recv_buffer
        except Exception as exc:
            self._teardown(
                TransportError(f"{self._description}: receiving an untagged message failed: {exc}")
            )
            return
        if buffer is None:
            message: bytes | memoryview = b""
        else:
            view = buffer.data if isinstance(buffer, np.ndarray) else memoryview(buffer)
            if view.ndim != 1 or view.format != "B":
                view = view.cast("B")
            if view.nbytes > self._max_message_bytes:
                self._teardown(
                    MessageTooLargeError(
                        f"{self._description}: the peer sent an untagged message of {view.nbytes} bytes; "
                        f"the limit (max_message_bytes) is {self._max_message_bytes}"
                    )
                )
                return
            message = bytes(view) if view.nbytes <= _SMALL_UNTAGGED else view
        self._deliver_untagged(message)

    def _may_take(self, length: int, wanted: bool) -> bool:
        """May a message of ``length`` bytes be taken from UCX now (``wanted``: a consumer waits for it)?

        Unlike a byte stream, UCX keeps messages nobody took, so nothing forces taking unclaimed ones when
        consumers wait for others (no deadlock, no :class:`BufferLimitError`): they stay in UCX past the
        budget. ``pause_reading`` holds back even the wanted ones.
        """
        if self._paused_by_owner:
            return False
        if wanted:
            return True
        used = self._buffered + self._inflight
        return used == 0 or used + length <= self._max_buffered_bytes

    def _pump_tagged(self, force: bool = False) -> bool:
        activity = False
        waiters = self._tag_waiters.all()
        if waiters:
            waiters.sort(key=lambda w: w.order)
            for waiter in waiters:
                if waiter.future.done() or id(waiter) in self._claimed:
                    continue
                if self._closed:
                    return activity
                activity = self._probe(waiter.tag, waiter.mask, waiter, force) or activity
        while not self._closed and self._probe(0, 0, None, force):
            activity = True
        return activity

    def _probe(self, tag: int, mask: int, waiter: _Waiter | None, force: bool) -> bool:
        """Receive the oldest message matching ``tag``/``mask`` if there is one and it may be taken now."""
        worker = self._worker
        probe = worker.tag_probe(_tag(tag), _mask(mask), False)
        if not probe.matched:
            return False
        found = int(probe.sender_tag.value)
        length = int(probe.length)
        if found == BYE_TAG:
            self._take_bye(length)
            return True
        if length > self._max_message_bytes:
            self._teardown(
                MessageTooLargeError(
                    f"{self._description}: the peer sent tagged message {found:#018x} of {length} bytes; "
                    f"the limit (max_message_bytes) is {self._max_message_bytes}"
                )
            )
            return True
        if not force and not self._may_take(length, waiter is not None):
            return False
        buffer, view = self._allocate(found, length)
        probe = worker.tag_probe(_tag(found), _mask(TAG_MASK_ALL), True)
        if not probe.matched:  # cannot happen: the message matched a moment ago
            return False
        request = worker.tag_recv_with_handle(_array(view), probe)
        key = id(waiter) if waiter is not None else 0
        if key:
            self._claimed[key] = self._claimed.get(key, 0) + 1
        self._inflight += length
        self._tagged.append(_TaggedRecv(request, found, length, buffer, view, key))
        return True

    # ------------------------------------------------------------------------------------------------ closing

    def _take_bye(self, length: int) -> None:
        """The peer announced that it closes: consume the notice, then drain and fail like a lost peer."""
        probe = self._worker.tag_probe(_tag(BYE_TAG), _mask(TAG_MASK_ALL), True)
        if probe.matched:
            sink = bytearray(max(1, min(length, _MAX_HELLO)))
            with contextlib.suppress(Exception):
                self._driver._pending.append(
                    _Pending(self._worker.tag_recv_with_handle(_array(sink), probe), sink, None)
                )
        if not self._closed and not self._closing:
            self._loop.call_soon(self._on_peer_gone)

    def _send_bye(self) -> asyncio.Future[None] | None:
        """Tell the peer this side closes (it may not learn it otherwise on the address path)."""
        if self._ep is None or self._peer_gone:
            return None
        try:
            data = MAGIC
            array = _array(data)
            request = self._ep.tag_send(array, _tag(BYE_TAG))
        except Exception:
            return None
        future: asyncio.Future[None] = self._loop.create_future()
        self._driver._pending.append(_Pending(request, (array, data), future))
        self._driver.kick()
        return future

    def _on_bootstrap_closed(self, *args: Any) -> None:
        # Called from inside a worker's progress: act from the event loop instead.
        del args
        if not self._closed and not self._closing:
            self._loop.call_soon(self._on_peer_gone)

    def _on_peer_gone(self) -> None:
        """The peer closed or died: take what already arrived on the data worker, then fail."""
        if self._closed or self._closing or self._peer_gone:
            return
        self._peer_gone = True
        logger.debug("%s: the peer went away", self._description)
        try:
            for _ in range(_MAX_ROUNDS):
                self._worker.progress()
                self._driver._complete()
                activity = self._finish_tagged()
                if self._closed:
                    return
                activity = self._pump_untagged(force=True) or activity
                activity = self._pump_tagged(force=True) or activity
                if not activity and not self._tagged and not self._am_queue:
                    break
        except DissocError as exc:
            self._teardown(exc)
            return
        except Exception as exc:
            logger.debug("%s: draining after the peer went away failed: %s", self._description, exc)
        self._teardown(TransportError(f"{self._description}: the peer closed the connection"))

    def _teardown(self, exc: DissocError) -> None:
        """Fail the inbox with ``exc``, then release the endpoints and the worker in the background."""
        if self._closed:
            return
        self._closed = True
        self._fail(exc)
        if isinstance(exc, MessageTooLargeError):
            logger.warning("%s", exc)
        else:
            logger.debug("%s torn down: %s", self._description, exc)
        driver = self._driver
        driver.on_progress = lambda: False
        driver.fail_pending(TransportError(f"{self._description}: {exc}"))
        with contextlib.suppress(Exception):
            self._bootstrap.remove_close_callback()
        # A receive UCX has started keeps writing into its buffer until it completes: hand each one to the
        # driver, which keeps the buffer alive until then (dropping it here let UCX write into freed memory).
        for item in self._tagged:
            driver._pending.append(_Pending(item.request, (item.buffer, item.view), None))
        self._tagged.clear()
        self._am_queue.clear()
        self._claimed.clear()
        self._release_task = self._loop.create_task(self._release())

    async def _release(self) -> None:
        """Close both endpoints, progressing the workers until the peer acknowledged (bounded), then let go.

        A UCX endpoint close is a short exchange with the peer: the worker must keep being progressed for it
        to complete (and for the peer to hear of it). After ``_RELEASE_WAIT`` seconds (a peer that is gone
        never answers) the objects are dropped anyway; ucxx then force-closes what is left.
        (``close()`` is never called on an endpoint UCX already failed: ucxx crashes on that.)
        """
        endpoints = [self._ep, self._bootstrap]
        for endpoint in endpoints:
            if _alive(endpoint):
                with contextlib.suppress(Exception):
                    endpoint.close()
        driver = self._driver
        driver.busy = lambda: True
        deadline = self._loop.time() + _RELEASE_WAIT
        try:
            while self._loop.time() < deadline:
                # The bootstrap endpoint (peer-failure handling on) reports the end of the exchange; a data
                # endpoint without it stays "alive" until it is destroyed.
                if not _alive(endpoints[1]):
                    break
                driver.kick()
                if not self._bootstrap_driver.closed:
                    self._bootstrap_driver.kick()
                await asyncio.sleep(0.005)
        finally:
            driver.close()
            self._ep = None
            self._bootstrap = None

    async def _close_transport(self) -> None:
        if not self._closing and not self._closed:
            self._closing = True
            # Let outstanding sends complete first, so that what was sent before close() reaches the peer.
            bye = self._send_bye()
            pending = [
                p.future for p in self._driver._pending if p.future is not None and not p.future.done()
            ]
            if bye is not None:
                pending.append(bye)
            if pending and not self._peer_gone:
                await asyncio.wait(pending, timeout=_CLOSE_WAIT)
            self._teardown(self._error or TransportError(f"connection {self._description} was closed"))
        task = self._release_task
        if task is not None:
            await asyncio.shield(task)


def _device_item(data: Any) -> tuple[Any, int] | None:
    """(the device buffer, its size) when ``data`` is one device buffer (alone or in a one-item list)."""
    item = data[0] if isinstance(data, (list, tuple)) and len(data) == 1 else data
    size = device_nbytes(item)
    if size is None:
        if isinstance(data, (list, tuple)) and any(device_nbytes(d) is not None for d in data):
            raise TransportError("a message in device memory must be one buffer (gather it on the device)")
        return None
    return item, size


def _alive(endpoint: Any) -> bool:
    try:
        return bool(endpoint.alive)
    except Exception:
        return False


# ------------------------------------------------------------------------------------------------ handshake


#: Worker-address format versions this UCX reads (``UCP_OBJECT_VERSION_V1``/``V2``, the low 4 bits of the
#: first byte); UCX aborts the process, through an assertion, on any other.
_ADDRESS_VERSIONS = (0, 1)


def _plausible_address(address: bytes) -> bool:
    """Whether ``address`` may be handed to UCX (deeper corruption is UCX's to detect)."""
    return len(address) >= 16 and address[0] & 0x0F in _ADDRESS_VERSIONS


def _parse_hello(message: Any, description: str) -> bytes:
    data = bytes(memoryview(message).cast("B")) if message is not None else b""
    if not data.startswith(MAGIC) or len(data) == len(MAGIC):
        raise TransportError(f"{description}: the peer is not a dissoc ucx endpoint (bad handshake)")
    address = data[len(MAGIC) :]
    if not _plausible_address(address):
        raise TransportError(
            f"{description}: expected a UCX worker address of this UCX version in the handshake, got "
            f"{len(address)} bytes starting {address[:8].hex()}"
        )
    return address


async def _recv_am(driver: _Driver, endpoint: Any, what: str) -> Any:
    try:
        request = endpoint.am_recv()
    except Exception as exc:
        raise TransportError(f"{driver.description}: {what} failed: {exc}") from exc
    await driver.wait(request, None, what)
    return request.recv_buffer


async def _send_am(driver: _Driver, endpoint: Any, data: bytes, what: str) -> None:
    try:
        array = _array(data)
        request = endpoint.am_send(array)
    except Exception as exc:
        raise TransportError(f"{driver.description}: {what} failed: {exc}") from exc
    await driver.wait(request, (array, data), what)


async def _send_tagged(driver: _Driver, endpoint: Any, tag: int, data: bytes, what: str) -> None:
    try:
        array = _array(data)
        request = endpoint.tag_send(array, _tag(tag))
    except Exception as exc:
        raise TransportError(f"{driver.description}: {what} failed: {exc}") from exc
    await driver.wait(request, (array, data), what)


async def _recv_tagged(driver: _Driver, tag: int, what: str) -> bytes:
    """Receive one message of exactly ``tag`` on the driver's worker (at most ``_MAX_HELLO`` bytes)."""
    worker = driver.worker
    while True:
        probe = worker.tag_probe(_tag(tag), _mask(TAG_MASK_ALL), False)
        if probe.matched:
            break
        if driver.closed:
            raise TransportError(f"{driver.description}: {what}: the connection is closed")
        driver.kick()
        await asyncio.sleep(0.001)
    length = int(probe.length)
    if length > _MAX_HELLO:
        raise TransportError(f"{driver.description}: {what}: the answer is {length} bytes, not a handshake")
    probe = worker.tag_probe(_tag(tag), _mask(TAG_MASK_ALL), True)
    buffer = bytearray(max(1, length))
    array = _array(buffer)
    await driver.wait(worker.tag_recv_with_handle(array, probe), (array, buffer), what)
    return bytes(buffer[:length])


def _is_local_host(host: str) -> bool:
    """Is ``host`` an address of this machine (so that UCX can use shared memory to reach it)?"""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def _close_endpoint(endpoint: Any) -> None:
    """Start closing an endpoint unless UCX already closed it (closing a failed ucxx endpoint crashes)."""
    with contextlib.suppress(Exception):
        endpoint.remove_close_callback()
    if _alive(endpoint):
        with contextlib.suppress(Exception):
            endpoint.close()


class UcxListener(Listener):
    """A UCX listener; each accepted connection gets its own worker (see the module docstring)."""

    scheme = "ucx"

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        handshake_timeout: float | None,
        error_handling: bool,
        limits: dict[str, Any],
    ) -> None:
        super().__init__(handler)
        lib = _lib()
        self._loop = asyncio.get_running_loop()
        self._lib = lib
        self._limits = limits
        self._handshake_timeout = handshake_timeout
        self._error_handling = error_handling
        self._count = itertools.count(1)
        self._handshakes: set[asyncio.Task[None]] = set()
        try:
            worker = lib.UCXWorker(_ucx_context())
        except Exception as exc:
            raise TransportError(f"cannot create a UCX worker: {exc}") from exc
        self._driver = _Driver(worker, self._loop, f"ucx listener :{port}")
        try:
            self._listener: Any = lib.UCXListener.create(worker, port, self._on_request, (), None, False)
        except Exception as exc:
            self._driver.close()
            raise TransportError(f"cannot listen on ucx://{host}:{port}: {exc}") from exc
        self._port = int(self._listener.port)
        self._host = host or str(self._listener.ip)
        self._driver.description = f"ucx listener {self.address}"
        self._worker_address = bytes(worker.address.tobytes())
        self._hellos: list[tuple[Any, bytearray]] = []
        self._driver.on_progress = self._poll_hellos
        self._driver.busy = lambda: bool(self._hellos)
        self._driver.kick()
        logger.debug("listening on %s", self.address)

    @property
    def host(self) -> str:
        """The host asked for (UCX listens on every interface)."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    @property
    def worker_address(self) -> bytes:
        """The listener worker's UCX address (what a same-host client connects to on the address path)."""
        return self._worker_address

    def uri_params(self) -> dict[str, str]:
        """``worker``: the listener worker's address (base64), for the same-host path."""
        return {"worker": base64.b64encode(self._worker_address).decode("ascii")}

    def _poll_hellos(self) -> bool:
        """Take handshakes of clients connecting by worker address (tagged ``HELLO_TAG`` on this worker)."""
        activity = False
        if self._hellos:
            done = [h for h in self._hellos if h[0].completed]
            if done:
                activity = True
                self._hellos = [h for h in self._hellos if not h[0].completed]
                for request, buffer in done:
                    try:
                        request.check_error()
                    except Exception as exc:
                        logger.info("%s: receiving a handshake failed: %s", self.address, exc)
                        continue
                    length = len(buffer)
                    if self._closing:
                        continue
                    task = self._loop.create_task(self._accept_address(bytes(buffer[:length])))
                    self._handshakes.add(task)
                    task.add_done_callback(self._handshakes.discard)
        worker = self._driver.worker
        while len(self._hellos) < 64:
            probe = worker.tag_probe(_tag(HELLO_TAG), _mask(TAG_MASK_ALL), False)
            if not probe.matched:
                break
            length = int(probe.length)
            probe = worker.tag_probe(_tag(HELLO_TAG), _mask(TAG_MASK_ALL), True)
            if not probe.matched:
                break
            # An oversized handshake is received into a small buffer: UCX truncates it and reports an error,
            # so nothing larger than _MAX_HELLO is ever allocated for it.
            buffer = bytearray(max(1, min(length, _MAX_HELLO)))
            self._hellos.append((worker.tag_recv_with_handle(_array(buffer), probe), buffer))
            activity = True
        return activity

    async def _accept_address(self, hello: bytes) -> None:
        """The address path: a fresh worker for the client, a data endpoint and a monitor endpoint to it."""
        description = f"ucx {self.address}<-client#{next(self._count)}(address)"
        monitors: list[Any] = []

        async def receive() -> bytes:
            return hello

        def open_monitor(client: Any) -> Any:
            # Peer-failure handling on: UCX reports the client's death here (as the listener path's
            # bootstrap endpoint does).
            monitors.append(self._driver.worker.create_endpoint_from_worker_address(client, True))
            return monitors[-1]

        async def reply(monitor: Any, data: bytes) -> None:
            await _send_tagged(self._driver, monitor, REPLY_TAG, data, "answering the handshake")

        if not await self._handshake(description, receive, open_monitor, reply):
            for monitor in monitors:
                _close_endpoint(monitor)

    async def _handshake(
        self,
        description: str,
        receive: Callable[[], Awaitable[Any]],
        open_monitor: Callable[[Any], Any],
        reply: Callable[[Any, bytes], Awaitable[None]],
    ) -> bool:
        """Both paths' handshake: the client's hello, a worker and data endpoint for it, the monitor, the
        reply; then the connection's handler starts. False (logged) when it failed; the caller closes the
        monitor it opened."""
        driver: _Driver | None = None
        try:
            async with asyncio.timeout(self._handshake_timeout):
                client_address = _parse_hello(await receive(), description)
                lib = self._lib
                client = lib.UCXAddress.create_from_buffer(client_address)
                worker = lib.UCXWorker(_ucx_context())
                driver = _Driver(worker, self._loop, description)
                endpoint = worker.create_endpoint_from_worker_address(client, self._error_handling)
                monitor = open_monitor(client)
                connection = UcxConnection(
                    driver, endpoint, monitor, self._driver, description=description, **self._limits
                )
                try:
                    await reply(monitor, MAGIC + bytes(worker.address.tobytes()))
                except BaseException:
                    await connection.close()
                    raise
        except TimeoutError:
            logger.info("%s: handshake timed out after %s s", description, self._handshake_timeout)
        except Exception as exc:
            logger.info("%s: handshake failed: %s", description, exc)
        else:
            if self._closing:
                await connection.close()
            else:
                logger.debug("accepted %s", description)
                self._start_handler(connection)
            return True
        if driver is not None:
            driver.close()
        return False

    def _on_request(self, conn_request: int, *args: Any) -> None:
        # Called from inside the listener worker's progress.
        del args
        if self._closing or self._listener is None:
            return
        try:
            bootstrap = self._listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:
            logger.warning("accepting a connection on %s failed: %s", self.address, exc)
            return
        task = self._loop.create_task(self._accept(bootstrap))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _accept(self, bootstrap: Any) -> None:
        """The listener path: the hello and the reply travel on the bootstrap endpoint, the monitor."""
        description = f"ucx {self.address}<-client#{next(self._count)}"

        async def receive() -> Any:
            return await _recv_am(self._driver, bootstrap, "receiving the handshake")

        async def reply(monitor: Any, data: bytes) -> None:
            await _send_am(self._driver, monitor, data, "answering the handshake")

        if not await self._handshake(description, receive, lambda client: bootstrap, reply):
            _close_endpoint(bootstrap)

    def _stop_accepting(self) -> None:
        self._listener = None  # dropping ucxx's listener stops listening
        for task in list(self._handshakes):
            task.cancel()
        logger.debug("stopped listening on %s", self.address)

    async def wait_closed(self) -> None:
        """Wait for the handlers, then release the listener's worker."""
        await super().wait_closed()
        if self._closing and not self._connections:
            # Give closing bootstrap endpoints a moment of progress, then stop watching the worker.
            await asyncio.sleep(0)
            self._driver.run()
            self._driver.close()


async def serve_ucx(
    host: str,
    port: int,
    handler: Handler,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    allocator: Allocator | None = None,
    error_handling: bool = False,
    handshake_timeout: float | None = 10.0,
) -> UcxListener:
    """Listen on ``port`` (0 picks a free one; UCX binds every interface) and run ``handler`` per connection.

    ``error_handling`` turns UCX peer-failure handling on for the data endpoints (slower: no shared memory);
    the peer's disappearance is detected either way (module docstring).
    """
    limits = {
        "max_message_bytes": max_message_bytes,
        "max_buffered_bytes": max_buffered_bytes,
        "allocator": allocator,
    }
    return UcxListener(
        host,
        port,
        handler,
        handshake_timeout=handshake_timeout,
        error_handling=error_handling,
        limits=limits,
    )


async def connect_ucx(
    host: str,
    port: int,
    *,
    timeout: float | None = 10.0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    allocator: Allocator | None = None,
    error_handling: bool = False,
    worker: bytes | str | None = None,
    path: str = "auto",
) -> UcxConnection:
    """Connect to a :func:`serve_ucx` listener; TransportError on failure or timeout.

    ``worker`` is the listener worker's address (bytes, or the base64 text of the URI's ``worker`` parameter).
    ``path`` picks how the connection is set up: ``"listener"`` through ``host:port`` (works across hosts),
    ``"address"`` straight to ``worker`` (same host, no TCP connection), or ``"auto"``: the address path when
    ``worker`` is known and ``host`` is an address of this machine, the listener path otherwise.
    """
    if path not in PATHS:
        raise TransportError(f"ucx path: expected one of {', '.join(PATHS)}, got {path!r}")
    if isinstance(worker, str):
        try:
            worker = base64.b64decode(worker.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise TransportError(f"ucx worker address: expected base64, got {worker[:40]!r}: {exc}") from exc
    if path == "address" and not worker:
        raise TransportError("ucx path 'address' needs the server's worker address (the URI's 'worker')")
    if worker and not _plausible_address(worker):
        # UCX asserts (aborts the process) on an address format it does not know: check before handing it over
        raise TransportError(
            f"ucx://{host}:{port}: the URI's 'worker' is not a UCX worker address of this UCX version "
            f"({len(worker)} bytes starting {worker[:8].hex()})"
        )
    use_address = bool(worker) and (path == "address" or (path == "auto" and _is_local_host(host)))
    lib = _lib()
    loop = asyncio.get_running_loop()
    where = f"ucx://{host}:{port}" + (" (by worker address)" if use_address else "")
    address = ""
    if not use_address:
        try:
            infos = await loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
            address = str(infos[0][4][0])
        except (OSError, IndexError) as exc:
            raise TransportError(f"cannot connect to {where}: {exc}") from exc
    description = f"ucx ->{host}:{port}" + ("(address)" if use_address else "")
    try:
        client_worker = lib.UCXWorker(_ucx_context())
    except Exception as exc:
        raise TransportError(f"cannot connect to {where}: cannot create a UCX worker: {exc}") from exc
    driver = _Driver(client_worker, loop, description)
    bootstrap: Any = None
    try:
        async with asyncio.timeout(timeout):
            hello = MAGIC + bytes(client_worker.address.tobytes())
            if use_address:
                assert isinstance(worker, bytes)
                try:
                    bootstrap = client_worker.create_endpoint_from_worker_address(
                        lib.UCXAddress.create_from_buffer(worker), True
                    )
                except Exception as exc:
                    raise TransportError(f"cannot connect to {where}: {exc}") from exc
                await _send_tagged(driver, bootstrap, HELLO_TAG, hello, f"connecting to {where}")
                reply = await _recv_tagged(driver, REPLY_TAG, f"connecting to {where}")
                server_address = _parse_hello(reply, description)
            else:
                try:
                    bootstrap = lib.UCXEndpoint.create(client_worker, address, port, True)
                except Exception as exc:
                    raise TransportError(f"cannot connect to {where}: {exc}") from exc
                reply_request = bootstrap.am_recv()
                await _send_am(driver, bootstrap, hello, f"connecting to {where}")
                await driver.wait(reply_request, None, f"connecting to {where}")
                server_address = _parse_hello(reply_request.recv_buffer, description)
            try:
                endpoint = client_worker.create_endpoint_from_worker_address(
                    lib.UCXAddress.create_from_buffer(server_address), error_handling
                )
            except Exception as exc:
                raise TransportError(f"cannot connect to {where}: {exc}") from exc
            return UcxConnection(
                driver,
                endpoint,
                bootstrap,
                driver,
                description=description,
                max_message_bytes=max_message_bytes,
                max_buffered_bytes=max_buffered_bytes,
                allocator=allocator,
            )
    except TimeoutError as exc:
        driver.close()
        if bootstrap is not None:
            _close_endpoint(bootstrap)
        raise TransportError(f"connecting to {where} timed out after {timeout} s") from exc
    except BaseException:
        driver.close()
        if bootstrap is not None:
            _close_endpoint(bootstrap)
        raise


register_transport("ucx", connect_ucx, serve_ucx)
