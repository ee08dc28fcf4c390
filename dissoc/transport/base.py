"""The transport interface: delimited and tagged messages over one connection to one peer.

Dissociated IPC needs two things from a transport (spec, "Requirements"): delimited (untagged) messages, and
messages carrying a little-endian u64 tag. :class:`Connection` offers exactly that to asyncio code:

- ``send`` / ``recv`` move untagged messages, in order;
- ``send_tagged`` / ``recv_tagged`` move tagged messages; a receiver asks for the next message whose tag
  matches under a mask, so bodies can be claimed by sequence number whatever their body-type byte;
- a placement hook (:meth:`Connection.set_allocator`) lets the receiver choose the final buffer of each tagged
  payload before it is read, so payloads land where they will live (aligned numpy memory, shared memory, ...)
  and are never copied afterwards;
- two limits protect the receiver: ``max_message_bytes`` (largest message it accepts; checked before anything
  is allocated) and ``max_buffered_bytes`` (received messages nobody has claimed yet; past it the reader stops
  reading, so the sender is throttled by the transport's own flow control).

Implementations share the inbox logic below and only move bytes: see :mod:`dissoc.transport.tcp` and
:mod:`dissoc.transport.inproc`. A small registry maps URI schemes to ``connect``/``serve`` functions.
"""

from __future__ import annotations

import abc
import asyncio
import copy
import importlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, Self, TypeAlias

from dissoc.buffers import (
    ALIGNMENT,
    DEFAULT_POOL,
    BufferPool,
    BytesLike,
    aligned_empty,
    buffer_nbytes,
    byte_view,
    default_allocator,
    device_nbytes,
)
from dissoc.errors import DissocError, ProtocolError, ResourceError, TransportError

if TYPE_CHECKING:
    pass

__all__ = [
    "ALIGNMENT",
    "DEFAULT_MAX_BUFFERED_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "TAG_MASK_ALL",
    "Allocator",
    "DEFAULT_POOL",
    "BufferLimitError",
    "BufferPool",
    "BytesLike",
    "Connection",
    "FrameError",
    "Handler",
    "Listener",
    "MessageTooLargeError",
    "SendData",
    "TaggedMessage",
    "aligned_empty",
    "connect",
    "default_allocator",
    "register_transport",
    "registered_schemes",
    "serve",
]

logger = logging.getLogger(__name__)

#: Mask that compares every bit of a tag (exact match).
TAG_MASK_ALL = 0xFFFF_FFFF_FFFF_FFFF
#: Default largest single message a connection accepts (4 GiB).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 30
#: Default budget of received-but-unclaimed message bytes (256 MiB).
DEFAULT_MAX_BUFFERED_BYTES = 256 << 20
#: Bytes-like data to send: one buffer, or a list/tuple of buffers gathered into one message.
SendData: TypeAlias = "BytesLike | Sequence[BytesLike]"
#: Placement hook: ``(tag, length) -> writable buffer of exactly length bytes``.
Allocator: TypeAlias = "Callable[[int, int], BytesLike]"
#: A server's per-connection coroutine.
Handler: TypeAlias = "Callable[[Connection], Awaitable[None]]"

_U64_MAX = TAG_MASK_ALL


class FrameError(TransportError, ProtocolError):
    """The peer sent bytes that are not a valid frame (unknown kind, non-zero padding, ...)."""


class MessageTooLargeError(TransportError, ResourceError):
    """The peer announced a message larger than ``max_message_bytes``; nothing was allocated for it."""


class BufferLimitError(TransportError, ResourceError):
    """Unclaimed received messages exceeded the buffer budget while a consumer waited for another one."""


class TaggedMessage(NamedTuple):
    """A received tagged message: its full u64 tag and its payload (the buffer the allocator returned)."""

    tag: int
    payload: BytesLike

    def view(self) -> memoryview:
        """A flat byte view of the payload (no copy); TypeError for a payload in device memory."""
        return byte_view(self.payload)

    @property
    def nbytes(self) -> int:
        """The payload's length in bytes (host or device memory)."""
        return buffer_nbytes(self.payload)


def _check_u64(value: int, what: str) -> None:
    if not 0 <= value <= _U64_MAX:
        raise ValueError(f"{what} must be an unsigned 64-bit integer, got {value!r}")


def _as_views(data: SendData) -> tuple[list[memoryview], int]:
    """Byte views over ``data`` (one buffer, or a list/tuple of them) and their total length; no copies."""
    items: Sequence[BytesLike] = data if isinstance(data, (list, tuple)) else (data,)
    views: list[memoryview] = []
    total = 0
    for item in items:
        if device_nbytes(item) is not None:
            raise TransportError("this transport sends host memory only: copy device buffers to the host")
        view = byte_view(item)
        views.append(view)
        total += view.nbytes
    return views, total


def _fresh(exc: DissocError) -> DissocError:
    """A copy of a stored error, so each raise gets its own traceback."""
    new = copy.copy(exc)
    new.__traceback__ = None
    return new


class _Held:
    __slots__ = ("message", "nbytes", "order", "taken")

    def __init__(self, message: TaggedMessage, nbytes: int, order: int = 0) -> None:
        self.message = message
        self.nbytes = nbytes
        self.order = order
        self.taken = False


class _TaggedStore:
    """Held tagged messages, in arrival order, found by (tag, mask) in O(1).

    One index per mask that consumers have used (built on first use, then kept up to date on arrival). A
    message taken through one index leaves a stale entry in the others; an index with too many is dropped and
    rebuilt when next used.
    """

    _MAX_INDEXES = 8

    def __init__(self) -> None:
        self._live: dict[int, _Held] = {}
        self._next = 0
        self._first = 0
        self._indexes: dict[int, dict[int, deque[_Held]]] = {}
        self._stale: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(self, message: TaggedMessage, nbytes: int, *, front: bool = False) -> None:
        """Hold a message: at the back (arrival), or at the front (given back by a cancelled consumer)."""
        if front:
            self._first -= 1
            held = _Held(message, nbytes, self._first)
        else:
            self._next += 1
            held = _Held(message, nbytes, self._next)
        self._live[id(held)] = held
        tag = message.tag
        for mask, index in self._indexes.items():
            queue = index.get(tag & mask)
            if queue is None:
                index[tag & mask] = deque((held,))
            elif front:
                queue.appendleft(held)
            else:
                queue.append(held)

    def _index(self, mask: int) -> dict[int, deque[_Held]]:
        index = self._indexes.get(mask)
        if index is None:
            if len(self._indexes) >= self._MAX_INDEXES:
                oldest = next(iter(self._indexes))
                del self._indexes[oldest]
                del self._stale[oldest]
            index = {}
            for held in sorted(self._live.values(), key=lambda h: h.order):
                key = held.message.tag & mask
                queue = index.get(key)
                if queue is None:
                    index[key] = deque((held,))
                else:
                    queue.append(held)
            self._indexes[mask] = index
            self._stale[mask] = 0
        return index

    def take(self, tag: int, mask: int) -> _Held | None:
        """Remove and return the oldest held message matching ``tag`` under ``mask``, or None."""
        if not self._live:
            return None
        index = self._index(mask)
        key = tag & mask
        queue = index.get(key)
        if queue is None:
            return None
        found: _Held | None = None
        while queue:
            held = queue.popleft()
            if held.taken:
                self._stale[mask] -= 1
                continue
            found = held
            break
        if not queue:
            del index[key]
        if found is None:
            return None
        found.taken = True
        del self._live[id(found)]
        if not self._live:
            self._indexes.clear()
            self._stale.clear()
            return found
        limit = len(self._live) + 64
        for other in list(self._indexes):
            if other != mask:
                self._stale[other] += 1
                if self._stale[other] > limit:
                    del self._indexes[other]
                    del self._stale[other]
        return found

    def clear(self) -> None:
        self._live.clear()
        self._indexes.clear()
        self._stale.clear()


class _Waiter:
    __slots__ = ("future", "mask", "order", "tag")

    def __init__(self, tag: int, mask: int, order: int, future: asyncio.Future[_Held]) -> None:
        self.tag = tag
        self.mask = mask
        self.order = order
        self.future = future


class _TagWaiters:
    """Consumers blocked in ``recv_tagged``, indexed by mask then masked tag; the earliest match wins."""

    def __init__(self) -> None:
        self._by_mask: dict[int, dict[int, deque[_Waiter]]] = {}
        self._order = 0

    def add(self, tag: int, mask: int, future: asyncio.Future[_Held]) -> _Waiter:
        self._order += 1
        waiter = _Waiter(tag, mask, self._order, future)
        index = self._by_mask.setdefault(mask, {})
        index.setdefault(tag & mask, deque()).append(waiter)
        return waiter

    def discard(self, waiter: _Waiter) -> None:
        index = self._by_mask.get(waiter.mask)
        if index is None:
            return
        key = waiter.tag & waiter.mask
        queue = index.get(key)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if not queue:
            del index[key]
            if not index:
                del self._by_mask[waiter.mask]

    def _first(self, tag: int) -> tuple[_Waiter, int, deque[_Waiter]] | None:
        best: tuple[_Waiter, int, deque[_Waiter]] | None = None
        for mask, index in self._by_mask.items():
            queue = index.get(tag & mask)
            if not queue:
                continue
            while queue and queue[0].future.done():
                queue.popleft()
            if queue and (best is None or queue[0].order < best[0].order):
                best = (queue[0], mask, queue)
        return best

    def has_match(self, tag: int) -> bool:
        return self._first(tag) is not None

    def pop_match(self, tag: int) -> _Waiter | None:
        best = self._first(tag)
        if best is None:
            return None
        waiter, mask, queue = best
        queue.popleft()
        if not queue:
            index = self._by_mask[mask]
            del index[tag & mask]
            if not index:
                del self._by_mask[mask]
        return waiter

    def all(self) -> list[_Waiter]:
        return [w for index in self._by_mask.values() for queue in index.values() for w in queue]

    def clear(self) -> None:
        self._by_mask.clear()


class Connection(abc.ABC):
    """One connection to one peer, carrying untagged (delimited) and tagged messages.

    Received messages nobody has asked for yet are held (up to ``max_buffered_bytes``); untagged ones are
    handed out in arrival order by :meth:`recv`, tagged ones by :meth:`recv_tagged` (first match in arrival
    order).
    Once the connection fails or the peer goes away, messages already received are still handed out, then
    every receive raises :class:`~dissoc.errors.TransportError`. After :meth:`close`, everything raises.
    """

    def __init__(
        self,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        allocator: Allocator | None = None,
        description: str = "",
    ) -> None:
        if max_message_bytes < 0:
            raise ValueError(f"max_message_bytes must be >= 0, got {max_message_bytes}")
        if max_buffered_bytes <= 0:
            raise ValueError(f"max_buffered_bytes must be > 0, got {max_buffered_bytes}")
        self._max_message_bytes = max_message_bytes
        self._max_buffered_bytes = max_buffered_bytes
        self._allocator: Allocator = allocator if allocator is not None else default_allocator
        self._description = description or type(self).__name__
        self._untagged: deque[bytes | memoryview] = deque()
        self._untagged_waiters: deque[asyncio.Future[bytes | memoryview]] = deque()
        self._held = _TaggedStore()
        self._tag_waiters = _TagWaiters()
        self._buffered = 0
        self._blocked = 0
        self._paused_by_owner = False
        self._error: DissocError | None = None
        self._closed = False

    # ----------------------------------------------------------------------------------------------- public

    @property
    def closed(self) -> bool:
        """True once the connection was closed locally or torn down (peer gone, I/O or framing error)."""
        return self._closed

    @property
    def max_message_bytes(self) -> int:
        """Largest single message this side accepts."""
        return self._max_message_bytes

    @property
    def max_buffered_bytes(self) -> int:
        """Budget of received-but-unclaimed message bytes; past it the reader stops reading from the peer."""
        return self._max_buffered_bytes

    @property
    def buffered_bytes(self) -> int:
        """Bytes of received messages that no consumer has claimed yet."""
        return self._buffered

    @property
    def description(self) -> str:
        """A human-readable name of the connection (endpoints), for logs and error messages."""
        return self._description

    def set_allocator(self, allocator: Allocator | None) -> None:
        """Set the placement hook for tagged payloads (None restores :func:`default_allocator`).

        The hook is called with ``(tag, length)`` before a tagged payload is read and must return a writable,
        C-contiguous buffer of exactly ``length`` bytes; the payload is written into it and it is handed out,
        as is, as :attr:`TaggedMessage.payload`. If the hook raises, the connection fails with that error.
        """
        self._allocator = allocator if allocator is not None else default_allocator

    async def send(self, data: SendData) -> None:
        """Send one untagged message: ``data`` is a buffer or a list/tuple of buffers, gathered, not copied.

        Returns once the bytes are handed to the transport; the buffers may be reused afterwards.
        """
        views, total = _as_views(data)
        if self._closed:
            raise self._closed_error("cannot send an untagged message")
        await self._send_frame(False, 0, views, total)

    async def send_tagged(self, tag: int, data: SendData) -> None:
        """Send one tagged message with the u64 ``tag``; ``data`` as for :meth:`send`."""
        _check_u64(tag, "tag")
        views, total = _as_views(data)
        if self._closed:
            raise self._closed_error(f"cannot send a tagged message (tag {tag:#018x})")
        await self._send_frame(True, tag, views, total)

    async def send_many(self, messages: Sequence[tuple[int | None, SendData]]) -> None:
        """Send several messages in order; a tag of ``None`` means untagged.

        Transports that can (TCP) write them with one gathered system call: a server sends each batch's
        metadata and body this way, which halves its system calls for small batches.
        """
        for tag, data in messages:
            if tag is None:
                await self.send(data)
            else:
                await self.send_tagged(tag, data)

    async def recv(self) -> bytes | memoryview:
        """The next untagged message, in arrival order (``bytes`` when small, else a memoryview)."""
        if self._untagged:
            message = self._untagged.popleft()
            self._buffered -= len(message)
            self._on_flow()
            return message
        if self._error is not None:
            raise _fresh(self._error)
        future: asyncio.Future[bytes | memoryview] = asyncio.get_running_loop().create_future()
        self._untagged_waiters.append(future)
        self._blocked += 1
        self._on_flow()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._give_back_untagged(future.result())
            raise
        finally:
            self._blocked -= 1
            if not future.done():
                future.cancel()

    async def recv_tagged(self, tag: int, mask: int = TAG_MASK_ALL) -> TaggedMessage:
        """The next received tagged message with ``(message_tag & mask) == (tag & mask)``.

        Several consumers may wait at once, with different tags or masks; a message goes to the one that has
        waited longest among those it matches, or is held until someone asks for it.
        """
        _check_u64(tag, "tag")
        _check_u64(mask, "mask")
        held = self._held.take(tag, mask)
        if held is not None:
            self._buffered -= held.nbytes
            self._on_flow()
            return held.message
        if self._error is not None:
            raise _fresh(self._error)
        future: asyncio.Future[_Held] = asyncio.get_running_loop().create_future()
        waiter = self._tag_waiters.add(tag, mask, future)
        self._blocked += 1
        self._on_flow()
        try:
            return (await future).message
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._give_back_tagged(future.result())
            raise
        finally:
            self._blocked -= 1
            self._tag_waiters.discard(waiter)
            if not future.done():
                future.cancel()

    async def close(self) -> None:
        """Close the connection: pending and later sends and receives raise ``TransportError``."""
        if self._closed:
            return
        self._fail(TransportError(f"connection {self._description} was closed"), drop_held=True)
        await self._close_transport()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self._description} {state}>"

    # ----------------------------------------------------------------------------------- for implementations

    @abc.abstractmethod
    async def _send_frame(self, tagged: bool, tag: int, views: list[memoryview], total: int) -> None:
        """Send one message made of ``views`` (``total`` bytes); frames of concurrent senders never mix."""

    @abc.abstractmethod
    async def _close_transport(self) -> None:
        """Release the transport (called once, by :meth:`close`, after the inbox was failed)."""

    def _on_flow(self) -> None:  # noqa: B027 - optional hook
        """Called when buffered bytes went down or a consumer started waiting: a paused reader may go on."""

    def _closed_error(self, doing: str) -> TransportError:
        if self._error is None:
            return TransportError(f"{doing}: {self._description} is closed")
        return TransportError(f"{doing}: {self._error}")

    def pause_reading(self) -> None:
        """Stop taking messages from the peer (the owner's own flow control); held ones are still handed out.

        Unlike the budget, this pause holds even while consumers wait: the owner knows that what they wait for
        will come from messages already received (the client pauses its data connection once the bodies it
        holds for its consumer reach their limit).
        """
        self._paused_by_owner = True

    def resume_reading(self) -> None:
        """Undo :meth:`pause_reading`."""
        if self._paused_by_owner:
            self._paused_by_owner = False
            self._on_flow()

    def _admit(self, tagged: bool, tag: int, length: int, extra: int = 0) -> bool:
        """May a message of ``length`` bytes be received now? False: pause reading until :meth:`_on_flow`.

        Admitted when nothing is buffered (so one message larger than the budget still gets through), when it
        fits in the budget, when a consumer waits for exactly this message, or when some consumer is blocked
        (reading on is then the only way forward) and the total stays under twice the budget; past that the
        connection would deadlock, and :class:`BufferLimitError` is raised instead.
        """
        if self._paused_by_owner:
            return False
        buffered = self._buffered + extra
        if buffered == 0 or buffered + length <= self._max_buffered_bytes:
            return True
        if tagged:
            if self._tag_waiters.has_match(tag):
                return True
        elif any(not f.done() for f in self._untagged_waiters):
            return True
        if self._blocked > 0:
            if buffered + length <= 2 * self._max_buffered_bytes:
                return True
            what = f"tagged message {tag:#018x}" if tagged else "untagged message"
            raise BufferLimitError(
                f"{self._description}: {buffered} bytes of unclaimed messages are held while consumers wait "
                f"for other messages; the next ({what}, {length} bytes) would exceed twice "
                f"max_buffered_bytes ({self._max_buffered_bytes})"
            )
        return False

    #: Whether this transport moves device (CUDA) memory itself: sends take objects with
    #: ``__cuda_array_interface__`` and the allocator may return them. Others need host memory.
    device_memory = False

    def _allocate(self, tag: int, length: int) -> tuple[BytesLike, memoryview]:
        """Call the placement hook for a tagged payload; returns the buffer and a writable byte view of it
        (for a device buffer, on a transport with :attr:`device_memory`, the buffer itself)."""
        try:
            buffer = self._allocator(tag, length)
            size = device_nbytes(buffer)
            if size is not None:
                if not self.device_memory:
                    raise TransportError(
                        f"{self._description}: the allocator returned device memory for tag {tag:#018x}; "
                        "this transport receives into host memory only"
                    )
                if size != length:
                    raise TransportError(
                        f"{self._description}: the allocator must return a buffer of {length} bytes for tag "
                        f"{tag:#018x}; it returned a device buffer of {size} bytes"
                    )
                return buffer, buffer  # type: ignore[return-value]
            view = byte_view(buffer)
        except DissocError:
            raise
        except Exception as exc:
            raise TransportError(
                f"{self._description}: the allocator failed for tagged message {tag:#018x} of {length} "
                f"bytes: {exc!r}"
            ) from exc
        if view.readonly or view.nbytes != length:
            raise TransportError(
                f"{self._description}: the allocator must return a writable buffer of {length} bytes for "
                f"tag {tag:#018x}; it returned {'a read-only' if view.readonly else 'a'} buffer of "
                f"{view.nbytes} bytes"
            )
        return buffer, view

    def _deliver_untagged(self, message: bytes | memoryview) -> None:
        """Hand a received untagged message to the oldest waiting consumer, or hold it."""
        waiters = self._untagged_waiters
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(message)
                return
        self._untagged.append(message)
        self._buffered += len(message)

    def _deliver_tagged(self, tag: int, payload: BytesLike, nbytes: int) -> None:
        """Hand a received tagged message to the consumer that waited longest for it, or hold it."""
        held = _Held(TaggedMessage(tag, payload), nbytes)
        waiter = self._tag_waiters.pop_match(tag)
        if waiter is not None:
            waiter.future.set_result(held)
            return
        self._held.add(held.message, nbytes)
        self._buffered += nbytes

    def _give_back_untagged(self, message: bytes | memoryview) -> None:
        """A consumer was cancelled just after being handed ``message``: pass it on, or hold it first."""
        waiters = self._untagged_waiters
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(message)
                return
        self._untagged.appendleft(message)
        self._buffered += len(message)

    def _give_back_tagged(self, held: _Held) -> None:
        """As :meth:`_give_back_untagged`, for a tagged message."""
        waiter = self._tag_waiters.pop_match(held.message.tag)
        if waiter is not None:
            waiter.future.set_result(held)
            return
        self._held.add(held.message, held.nbytes, front=True)
        self._buffered += held.nbytes

    def _fail(self, exc: DissocError, *, drop_held: bool = False) -> None:
        """Record the first error and raise it in all blocked consumers; held messages stay unless dropped."""
        if self._error is None:
            self._error = exc
            if not drop_held:
                logger.debug("%s failed: %s", self._description, exc)
        error = self._error
        while self._untagged_waiters:
            future = self._untagged_waiters.popleft()
            if not future.done():
                future.set_exception(_fresh(error))
        for waiter in self._tag_waiters.all():
            if not waiter.future.done():
                waiter.future.set_exception(_fresh(error))
        self._tag_waiters.clear()
        if drop_held:
            self._untagged.clear()
            self._held.clear()
            self._buffered = 0


class Listener(abc.ABC):
    """A server endpoint: accepts connections and runs ``handler(connection)`` for each in its own task.

    When a handler returns (or raises), its connection is closed. :meth:`close` stops accepting and closes the
    open connections (their handlers then see ``TransportError``); :meth:`wait_closed` waits for the handlers.
    """

    scheme: str = ""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections: set[Connection] = set()
        self._closing = False

    @property
    @abc.abstractmethod
    def host(self) -> str:
        """The host (or name) this listener is reachable at."""

    @property
    @abc.abstractmethod
    def port(self) -> int:
        """The port this listener is bound to (the chosen one when 0 was asked)."""

    @property
    def address(self) -> str:
        """``scheme://host:port``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def uri_params(self) -> dict[str, str]:
        """Extra URI query parameters clients of this listener may use (e.g. ucx's ``worker``)."""
        return {}

    @property
    def connections(self) -> frozenset[Connection]:
        """The connections whose handlers are still running."""
        return frozenset(self._connections)

    @property
    def is_serving(self) -> bool:
        """True until :meth:`close`."""
        return not self._closing

    def _start_handler(self, connection: Connection) -> None:
        self._connections.add(connection)
        task = asyncio.get_running_loop().create_task(self._run_handler(connection))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_handler(self, connection: Connection) -> None:
        try:
            await self._handler(connection)
        except asyncio.CancelledError:
            logger.debug("handler for %s cancelled", connection.description)
        except DissocError as exc:
            logger.info("handler for %s ended with %s: %s", connection.description, type(exc).__name__, exc)
        except Exception:
            logger.exception("handler for %s failed", connection.description)
        finally:
            self._connections.discard(connection)
            await connection.close()

    @abc.abstractmethod
    def _stop_accepting(self) -> None:
        """Stop taking new connections (called once)."""

    def close(self) -> None:
        """Stop accepting and close every open connection."""
        if self._closing:
            return
        self._closing = True
        self._stop_accepting()
        for connection in list(self._connections):
            connection._fail(TransportError(f"{connection.description}: the server is shutting down"))
            task = asyncio.get_running_loop().create_task(connection.close())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def wait_closed(self) -> None:
        """Wait until the handlers of all connections have finished (after :meth:`close`)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        await self.wait_closed()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address}{'' if self.is_serving else ' closed'}>"


# ------------------------------------------------------------------------------------------------- registry

ConnectFunction: TypeAlias = "Callable[..., Awaitable[Connection]]"
ServeFunction: TypeAlias = "Callable[..., Awaitable[Listener]]"


@dataclass(frozen=True)
class _Entry:
    connect: ConnectFunction
    serve: ServeFunction


_REGISTRY: dict[str, _Entry] = {}
_LAZY: dict[str, str] = {"ucx": "dissoc.transport.ucx"}


def register_transport(scheme: str, connect: ConnectFunction, serve: ServeFunction) -> None:
    """Register ``connect(host, port, **options)`` and ``serve(host, port, handler, **options)``."""
    _REGISTRY[scheme.lower()] = _Entry(connect, serve)


def registered_schemes() -> list[str]:
    """The schemes with a loaded transport."""
    return sorted(_REGISTRY)


def _entry(scheme: str) -> _Entry:
    key = scheme.lower()
    entry = _REGISTRY.get(key)
    if entry is None and key in _LAZY:
        try:
            importlib.import_module(_LAZY[key])
        except ImportError as exc:
            raise TransportError(
                f"the {key!r} transport is not available ({exc}); install the extra that provides it, "
                f"e.g. pip install 'dissoc[{key}]'"
            ) from exc
        entry = _REGISTRY.get(key)
    if entry is None:
        raise TransportError(f"unknown transport scheme {scheme!r}; expected one of {registered_schemes()}")
    return entry


async def connect(scheme: str, host: str, port: int, **options: Any) -> Connection:
    """Connect with the transport registered for ``scheme`` (``tcp``, ``mem``, ...)."""
    return await _entry(scheme).connect(host, port, **options)


async def serve(scheme: str, host: str, port: int, handler: Handler, **options: Any) -> Listener:
    """Listen with the transport registered for ``scheme``; ``handler`` runs once per accepted connection."""
    return await _entry(scheme).serve(host, port, handler, **options)
