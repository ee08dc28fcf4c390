"""The transport interface: delimited and tagged messages over one connection to one peer.

Dissociated IPC needs two things from a transport (spec, "Requirements"): delimited (untagged) messages, and
messages carrying a little-endian u64 tag. :class:`Connection` offers exactly that to asyncio code:

- ``send`` / ``recv`` move untagged messages, in order;
- ``send_tagged`` / ``recv_tagged`` move tagged messages; a receiver asks for the next message whose tag
  matches under a mask, so bodies can be claimed by sequence number whatever their body-type byte;
- a placement hook (:meth:`Connection.set_allocator`) lets the receiver choose the final buffer of each tagged
  payload before it is read, so payloads land where they will live (aligned numpy memory, shared memory, ...)
  and are never copied afterwards; on transports that receive into an address of their choosing (UCX), a
  *lander* (:meth:`Connection.set_lander`) may place a payload first, where it knows more than the allocator
  (the client's stream session puts a body right after room for the metadata it arrived with);
- two limits protect the receiver: ``max_message_bytes`` (largest message it accepts; checked before anything
  is allocated) and ``max_buffered_bytes`` (received messages nobody has claimed yet; past it the reader stops
  reading, so the sender is throttled by the transport's own flow control).

- a receiver (:meth:`Connection.set_receiver`) may take every message as it arrives instead, through one
  door (:meth:`Receiver.on_messages`), several at a time where the transport can.

A backend (:mod:`dissoc.transport.tcp`, :mod:`~dissoc.transport.tls`, :mod:`~dissoc.transport.inproc`,
:mod:`dissoc.transport.ucx`) only moves bytes; the inbox, the limits and the receiver are
:class:`Connection`'s. It implements two methods and may override three:

- ``_send_frame(tagged, tag, views, total)``: send one message (frames of concurrent senders never mix);
- ``_close_transport()``: release the transport, once;
- ``_on_flow()`` (optional): reading may go on (something was claimed, a consumer waits, reading resumed);
- ``idle_frame()`` (optional): whether a frame is partly received, for the server's deadlines;
- ``lanes()`` (optional): what carries the bytes below the transport (UCX's transports), for the path a
  client reports.

and it receives through five calls: ``_admit(tagged, tag, length)`` (may a message be read now, or should
reading pause), ``_accept(tag, length)`` (its tag's limit and the shared receive budget, once admitted),
``_allocate(tag, length)`` (where its payload goes), ``_deliver(tag, payload, nbytes)`` (one received message
to the receiver, a waiting consumer or the inbox; ``_deliver_all`` for several, handed to a receiver in one
call) or ``_offer(messages)`` (messages still in the transport's own buffer, lent to the receiver in one
call), and ``_fail(exc)``. :func:`check_u64`, :func:`as_views` and
:func:`fresh_error` are helpers for them; :mod:`dissoc.transport.registry` maps URI schemes to their
``connect``/``serve`` functions.
"""

from __future__ import annotations

import abc
import asyncio
import copy
import logging
import resource
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Protocol, Self, TypeAlias

import numpy as np
import pyarrow as pa

from dissoc.buffers import DEFAULT_POOL, BytesLike, byte_view, default_allocator, device_nbytes
from dissoc.errors import DissocError, ProtocolError, ResourceError, TransportError
from dissoc.logs import peer_log
from dissoc.transport._inbox import Held, TaggedStore, TagWaiters
from dissoc.transport.message import TaggedMessage

__all__ = [
    "DEFAULT_MAX_BUFFERED_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "TAG_MASK_ALL",
    "Allocator",
    "BufferLimitError",
    "Connection",
    "FrameError",
    "Handler",
    "Lander",
    "Listener",
    "MessageTooLargeError",
    "ReceiveBudget",
    "ReceiveBudgetError",
    "Received",
    "Receiver",
    "SendData",
    "TagLimitError",
    "TaggedMessage",
    "as_views",
    "check_u64",
    "default_max_connections",
    "fresh_error",
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
#: ``lander(tag, length)`` (see :meth:`Connection.set_lander`): ``(payload, the address its bytes go to)``, or
#: None to leave the message to the allocator.
Lander: TypeAlias = "Callable[[int, int], tuple[Any, int] | None]"
#: A server's per-connection coroutine.
Handler: TypeAlias = "Callable[[Connection], Awaitable[None]]"

_U64_MAX = TAG_MASK_ALL
#: memoryview formats of one byte per item (a slice of such a view counts bytes).
_BYTE_FORMATS = frozenset({"B", "b", "c"})


class FrameError(TransportError, ProtocolError):
    """The peer sent bytes that are not a valid frame (unknown kind, non-zero padding, ...)."""


class MessageTooLargeError(TransportError, ResourceError):
    """The peer announced a message larger than ``max_message_bytes``; nothing was allocated for it."""


class BufferLimitError(TransportError, ResourceError):
    """Unclaimed received messages exceeded the buffer budget while a consumer waited for another one."""


class TagLimitError(TransportError, ResourceError):
    """The peer announced a tagged message larger than the limit set for its tag
    (:meth:`Connection.limit_tag`); nothing was allocated for it and nothing more is read from the peer."""


class ReceiveBudgetError(TransportError, ResourceError):
    """A message would take the bytes being received across a server's connections past its
    :class:`ReceiveBudget`; nothing was allocated for it and nothing more is read from the peer."""


#: One received message as a :class:`Receiver` is handed it: ``(tag, payload, nbytes)``, ``tag`` None for an
#: untagged message (always its own ``bytes`` or memoryview), the payload a tagged message was received into.
Received: TypeAlias = "tuple[int | None, Any, int]"


class Receiver(Protocol):
    """Takes messages as they arrive (see :meth:`Connection.set_receiver`): one door for every message.

    Both methods run inside the transport's reading callback: they must be quick and must not raise.
    """

    def on_messages(self, messages: list[Received], lent: bool) -> int:
        """Messages received one after another, oldest first. Returns how many it took, from the first on;
        the others are held for ``recv``/``recv_tagged`` (or, where the receiver paused reading meanwhile,
        kept back and offered again once it resumes).

        ``lent``: the tagged payloads are views of the transport's own staging buffer (small messages received
        whole in one read, offered in one call, on connections with the default allocator and no receive
        budget), valid only during the call: copy what is kept. Otherwise each payload is the buffer the
        message was received into, the receiver's to keep."""

    def on_failure(self, exc: DissocError) -> None:
        """The connection failed or was closed, after every message received before was offered."""


class ReceiveBudget:
    """Bytes being received, or received and not yet claimed, across all the connections that share it (a
    server's, through its listener).

    A connection reserves a message's length before it allocates the payload and gives it back when a
    consumer claims the message, or when the connection closes (held messages and a partly received payload
    are dropped then). A message that does not fit fails its connection with :class:`ReceiveBudgetError`
    rather than waiting: a server only receives small requests, so a peer that needs more is misbehaving.
    """

    __slots__ = ("max_bytes", "used")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.used = 0


def default_max_connections() -> int:
    """A server's default bound on open connections: below the process's file-descriptor limit.

    ``min(1024, max(soft - 64, soft // 2))`` for the soft ``RLIMIT_NOFILE`` (1024 when unlimited), at least
    1: the rest of the descriptors stay for the process itself (arenas, files it serves, logs).
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 1024
    return max(1, min(1024, max(soft - 64, soft // 2)))


def check_u64(value: int, what: str) -> None:
    """ValueError unless ``value`` (named ``what`` in the message) is an unsigned 64-bit integer."""
    if not 0 <= value <= _U64_MAX:
        raise ValueError(f"{what} must be an unsigned 64-bit integer, got {value!r}")


def as_views(data: SendData) -> tuple[list[memoryview], int]:
    """Byte views over ``data`` (one buffer, or a list/tuple of them) and their total length; no copies."""
    items: Sequence[BytesLike] = data if isinstance(data, (list, tuple)) else (data,)
    views: list[memoryview] = []
    total = 0
    for item in items:
        kind = type(item)
        if kind is bytes or kind is pa.Buffer:  # the common cases: host memory, contiguous by construction
            view = memoryview(item)  # type: ignore[arg-type]
            views.append(view)
            total += view.nbytes
            continue
        if (
            kind is memoryview
            and item.ndim == 1  # type: ignore[union-attr]
            and item.format in _BYTE_FORMATS  # type: ignore[union-attr]
            and item.c_contiguous  # type: ignore[union-attr]
        ):
            views.append(item)  # type: ignore[arg-type]  # one byte per item: slices count bytes
            total += item.nbytes  # type: ignore[union-attr]
            continue
        if device_nbytes(item) is not None:
            raise TransportError("this transport sends host memory only: copy device buffers to the host")
        view = byte_view(item)
        views.append(view)
        total += view.nbytes
    return views, total


def fresh_error(exc: DissocError) -> DissocError:
    """A copy of a stored error, so each raise gets its own traceback."""
    new = copy.copy(exc)
    new.__traceback__ = None
    return new


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
        receive_budget: ReceiveBudget | None = None,
    ) -> None:
        if max_message_bytes < 0:
            raise ValueError(f"max_message_bytes must be >= 0, got {max_message_bytes}")
        if max_buffered_bytes <= 0:
            raise ValueError(f"max_buffered_bytes must be > 0, got {max_buffered_bytes}")
        self._max_message_bytes = max_message_bytes
        self._max_buffered_bytes = max_buffered_bytes
        self._allocator: Allocator = allocator if allocator is not None else default_allocator
        self._lander: Lander | None = None
        self._description = description or type(self).__name__
        self._untagged: deque[bytes | memoryview] = deque()
        self._untagged_waiters: deque[asyncio.Future[bytes | memoryview]] = deque()
        self._held = TaggedStore()
        self._tag_waiters = TagWaiters()
        self._buffered = 0
        self._blocked = 0
        self._paused_by_owner = False
        self._error: DissocError | None = None
        self._closed = False
        self._tag_limits: dict[int, int] = {}
        self._budget = receive_budget
        self._reserved = 0
        self._receiver: Receiver | None = None
        #: The stream this connection carries now (a log stream id, set by the server or client that runs
        #: it; None before the first): the transport's own lines about the connection carry it.
        self.stream_id: str | None = None

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

    @property
    def peer_identity(self) -> str | None:
        """Who the peer proved to be: the subject of the certificate it presented and this side verified
        (TLS; see :attr:`dissoc.transport.tls.TlsConnection.peer_identity`), in RFC 4514 form such as
        ``"CN=alice,O=Example"``. None on transports without certificates, and without one."""
        return None

    def lanes(self) -> tuple[str, ...]:
        """What carries this connection's bytes below the transport, as ``"transport/device"`` names: for UCX
        the transport and device of each of its data endpoint's lanes (``"tcp/lo"``, ``"sysv/memory"``,
        ``"cuda_ipc/cuda"``...); empty where the transport has nothing to tell (TCP, TLS, in-process) or the
        connection is closed."""
        return ()

    def set_allocator(self, allocator: Allocator | None) -> None:
        """Set the placement hook for tagged payloads (None restores :func:`default_allocator`).

        The hook is called with ``(tag, length)`` before a tagged payload is read and must return a writable,
        C-contiguous buffer of exactly ``length`` bytes; the payload is written into it and it is handed out,
        as is, as :attr:`TaggedMessage.payload`. If the hook raises, the connection fails with that error.
        """
        self._allocator = allocator if allocator is not None else default_allocator

    def set_lander(self, lander: Lander | None) -> None:
        """On a transport that receives each tagged payload into an address it picks once the message's tag
        and length are known (UCX), offer every tagged message to ``lander`` before the allocator (None: the
        allocator alone).

        ``lander(tag, length)`` returns ``(payload, address)``: the message's ``length`` bytes are received
        at ``address`` (writable memory that ``payload`` keeps alive), and ``payload`` is what is handed out
        for it (delivered as is, held for ``recv_tagged`` as is); or None, and the allocator places it. It
        runs inside the transport's reading callback, must be quick, and if it raises the connection fails
        with that error. Transports that read payloads off a byte stream lend small ones to the receiver
        instead (``Receiver.on_messages(..., lent=True)``) and never call it.
        """
        self._lander = lander

    def set_receiver(self, receiver: Receiver | None) -> None:
        """Hand messages to ``receiver`` the moment they arrive, instead of holding them for :meth:`recv` and
        :meth:`recv_tagged` (None: hold them again).

        A consumer that processes every message of a connection itself (the client's stream session) takes
        them this way, several per call where the transport can, without a future or a task switch per
        message. Messages it declines are held as before. Messages already held are offered at once, untagged
        ones first. When the connection fails or is closed, ``receiver.on_failure`` is called once. Flow
        control stays with the owner: :meth:`pause_reading` and :meth:`resume_reading`.
        """
        self._receiver = receiver
        if receiver is None:
            return
        held: list[Received] = [(None, m, len(m)) for m in self._untagged]
        held += [(h.message.tag, h.message.payload, h.nbytes) for h in self._held.drain()]
        self._untagged.clear()
        self._buffered = 0
        for tag, payload, nbytes in held:  # (one at a time: each is taken, or held again)
            if receiver.on_messages([(tag, payload, nbytes)], False):
                if self._budget is not None:
                    self._unreserve(nbytes)
            elif tag is None:
                self._untagged.append(payload)
                self._buffered += nbytes
            else:
                self._held.add(TaggedMessage(tag, payload), nbytes)
                self._buffered += nbytes
        if self._error is not None:
            receiver.on_failure(fresh_error(self._error))

    def limit_tag(self, tag: int, max_bytes: int | None) -> None:
        """Accept tagged messages of exactly ``tag`` only up to ``max_bytes`` of payload (None: no limit but
        ``max_message_bytes``).

        Checked from the frame header (or the transport's probe) before anything is allocated or read: a
        larger one fails the connection with :class:`TagLimitError` and nothing more is read from the peer
        (sends still work, so the owner may answer before it closes). A server sets it for the small requests
        it takes (want_data tickets, free_data lists).
        """
        check_u64(tag, "tag")
        if max_bytes is None:
            self._tag_limits.pop(tag, None)
        elif max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        else:
            self._tag_limits[tag] = max_bytes

    def idle_frame(self) -> object | None:
        """None when no frame is partly received; else a token that stays the same while the same frame is
        still incomplete (a server drops a peer that takes too long to finish one). Transports that cannot
        tell return None."""
        return None

    async def send(self, data: SendData) -> None:
        """Send one untagged message: ``data`` is a buffer or a list/tuple of buffers, gathered, not copied.

        Returns once the bytes are handed to the transport; the buffers may be reused afterwards.
        """
        views, total = as_views(data)
        if self._closed:
            raise self._closed_error("cannot send an untagged message")
        await self._send_frame(False, 0, views, total)

    async def send_tagged(self, tag: int, data: SendData) -> None:
        """Send one tagged message with the u64 ``tag``; ``data`` as for :meth:`send`."""
        check_u64(tag, "tag")
        views, total = as_views(data)
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
            if self._budget is not None:
                self._unreserve(len(message))
            self._on_flow()
            return message
        if self._error is not None:
            raise fresh_error(self._error)
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
            del future  # see recv_tagged

    async def recv_tagged(self, tag: int, mask: int = TAG_MASK_ALL) -> TaggedMessage:
        """The next received tagged message with ``(message_tag & mask) == (tag & mask)``.

        Several consumers may wait at once, with different tags or masks; a message goes to the one that has
        waited longest among those it matches, or is held until someone asks for it.
        """
        check_u64(tag, "tag")
        check_u64(mask, "mask")
        held = self._held.take(tag, mask)
        if held is not None:
            self._buffered -= held.nbytes
            if self._budget is not None:
                self._unreserve(held.nbytes)
            self._on_flow()
            return held.message
        if self._error is not None:
            raise fresh_error(self._error)
        future: asyncio.Future[Held] = asyncio.get_running_loop().create_future()
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
            # A raised error's traceback keeps this frame, and the future keeps the error: without this the
            # connection stays alive until the garbage collector finds the cycle.
            del future, waiter

    async def close(self) -> None:
        """Close the connection: pending and later sends and receives raise ``TransportError``."""
        if self._closed:
            # Torn down already (peer gone, I/O error): let go of what was received and never claimed now,
            # not when the connection object goes.
            self._fail(TransportError(f"connection {self._description} was closed"), drop_held=True)
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

    def _accept(self, tag: int | None, length: int) -> None:
        """A message of ``length`` bytes (``tag`` None: untagged) is about to be received, once admitted
        (:meth:`_admit`): check it against the limit set for its tag and take its room in the shared receive
        budget (:class:`TagLimitError`, :class:`ReceiveBudgetError`; nothing is allocated for it then)."""
        if tag is not None and self._tag_limits:
            self._check_tag_limit(tag, length)
        if self._budget is not None:
            self._reserve(length)

    def _check_tag_limit(self, tag: int, length: int) -> None:
        """:class:`TagLimitError` if ``length`` is over the limit set for ``tag``."""
        limit = self._tag_limits.get(tag)
        if limit is not None and length > limit:
            raise TagLimitError(
                f"{self._description}: the peer announced a tagged message {tag:#018x} of {length} bytes; "
                f"the limit for this tag is {limit} bytes"
            )

    def _reserve(self, length: int) -> None:
        """Take ``length`` bytes of the shared receive budget before allocating a message (no-op without
        one); :class:`ReceiveBudgetError` when it does not fit."""
        budget = self._budget
        if budget is not None:
            if length and budget.used + length > budget.max_bytes:
                raise ReceiveBudgetError(
                    f"{self._description}: the peer sent a message of {length} bytes while {budget.used} "
                    "bytes are being received across the server's connections; the limit "
                    f"(max_receiving_bytes) is {budget.max_bytes}"
                )
            budget.used += length
            self._reserved += length

    def _unreserve(self, length: int) -> None:
        """Give back ``length`` bytes of the receive budget (a message was claimed or dropped)."""
        budget = self._budget
        if budget is not None:
            length = min(length, self._reserved)
            self._reserved -= length
            budget.used -= length

    def _rereserve(self, length: int) -> None:
        """A claimed message is held again (its consumer was cancelled): count it again, unchecked."""
        budget = self._budget
        if budget is not None:
            budget.used += length
            self._reserved += length

    def _unreserve_all(self) -> None:
        budget = self._budget
        if budget is not None:
            budget.used -= self._reserved
            self._reserved = 0

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
        # Only a consumer still waiting counts as blocked: one whose message was just handed over has not
        # resumed yet (it is counted in _blocked until it does), and it will take what is held.
        if self._blocked > 0 and (
            any(not f.done() for f in self._untagged_waiters) or self._tag_waiters.any_pending()
        ):
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
        allocator = self._allocator
        if allocator is default_allocator:  # the common case, whose buffers need no checking
            pooled = DEFAULT_POOL.allocate(length)
            return pooled, pooled.data
        try:
            buffer = allocator(tag, length)
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

    def _allocate_at(self, tag: int, length: int, skip_lander: bool = False) -> tuple[Any, object, int]:
        """Where a tagged payload of ``length`` bytes goes, for a transport that hands its library addresses:
        the payload to hand out, what keeps its memory alive while it is written (a writable view of the
        allocator's buffer; the payload itself for the lander's) and the address of its first byte (a device
        buffer's device address). The lander first (:meth:`set_lander`; ``skip_lander``: the caller
        asked it already), then :meth:`_allocate`."""
        lander = self._lander
        if lander is not None and not skip_lander:
            try:
                landed = lander(tag, length)
            except DissocError:
                raise
            except Exception as exc:
                raise TransportError(
                    f"{self._description}: the lander failed for tagged message {tag:#018x} of {length} "
                    f"bytes: {exc!r}"
                ) from exc
            if landed is not None:
                payload, address = landed
                return payload, payload, address
        if self._allocator is default_allocator:
            pooled, address = DEFAULT_POOL.allocate_at(length)
            return pooled, pooled.data, address
        buffer, view = self._allocate(tag, length)
        interface = getattr(buffer, "__cuda_array_interface__", None)
        if interface is not None:
            return buffer, view, int(interface["data"][0])
        return buffer, view, int(np.frombuffer(view, dtype=np.uint8).ctypes.data)

    def _deliver(self, tag: int | None, payload: BytesLike, nbytes: int) -> None:
        """Hand a received message (``tag`` None: untagged) to the receiver, the consumer that waited longest
        for it, or hold it."""
        receiver = self._receiver
        if receiver is not None and receiver.on_messages([(tag, payload, nbytes)], False):
            if self._budget is not None:
                self._unreserve(nbytes)
            return
        if tag is None:
            message: bytes | memoryview = payload  # type: ignore[assignment]
            waiters = self._untagged_waiters
            while waiters:
                future = waiters.popleft()
                if not future.done():
                    future.set_result(message)
                    if self._budget is not None:
                        self._unreserve(nbytes)
                    return
            self._untagged.append(message)
            self._buffered += nbytes
            return
        held = Held(TaggedMessage(tag, payload), nbytes)
        waiter = self._tag_waiters.pop_match(tag)
        if waiter is not None:
            waiter.future.set_result(held)
            if self._budget is not None:
                self._unreserve(nbytes)
            return
        self._held.add(held.message, nbytes)
        self._buffered += nbytes

    def _deliver_all(self, messages: list[Received]) -> None:
        """Several received messages, oldest first, each payload its receiver's to keep: handed to the
        receiver in one call; any it leaves go on one by one as :meth:`_deliver` has it."""
        receiver = self._receiver
        taken = receiver.on_messages(messages, False) if receiver is not None and messages else 0
        if taken and self._budget is not None:
            self._unreserve(sum(nbytes for _, _, nbytes in messages[:taken]))
        for tag, payload, nbytes in messages[taken:]:
            self._deliver(tag, payload, nbytes)

    def _offer(self, messages: list[Received]) -> int:
        """Offer messages whose tagged payloads are still in the transport's own buffer (lent for the call)
        to the receiver, when it may take them so: a receiver is set, nothing is held or limited, reading is
        not paused and payloads land in the default allocator's buffers. Returns how many it took (0: the
        transport delivers them itself, one by one)."""
        receiver = self._receiver
        if (
            receiver is None
            or self._buffered
            or self._budget is not None
            or self._tag_limits
            or self._paused_by_owner
            or self._allocator is not default_allocator
        ):
            return 0
        return receiver.on_messages(messages, True)

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
        self._rereserve(len(message))

    def _give_back_tagged(self, held: Held) -> None:
        """As :meth:`_give_back_untagged`, for a tagged message."""
        waiter = self._tag_waiters.pop_match(held.message.tag)
        if waiter is not None:
            waiter.future.set_result(held)
            return
        self._held.add(held.message, held.nbytes, front=True)
        self._buffered += held.nbytes
        self._rereserve(held.nbytes)

    def _log_extra(self) -> dict[str, str] | None:
        """``extra=`` for a log line about this connection: the stream it carries, if any."""
        return {"stream": self.stream_id} if self.stream_id is not None else None

    def _fail(self, exc: DissocError, *, drop_held: bool = False) -> None:
        """Record the first error and raise it in all blocked consumers; held messages stay unless dropped."""
        if self._error is None:
            # Stored without its traceback and chained exceptions: their frames would reference this
            # connection (and the payload being read), a cycle that only the garbage collector breaks.
            exc.__traceback__ = None
            exc.__context__ = None
            exc.__cause__ = None
            self._error = exc
            if not drop_held:
                logger.debug("%s failed: %s", self._description, exc, extra=self._log_extra())
            if self._receiver is not None:
                self._receiver.on_failure(fresh_error(exc))
        error = self._error
        while self._untagged_waiters:
            future = self._untagged_waiters.popleft()
            if not future.done():
                future.set_exception(fresh_error(error))
        for waiter in self._tag_waiters.all():
            if not waiter.future.done():
                waiter.future.set_exception(fresh_error(error))
        self._tag_waiters.clear()
        if drop_held:
            self._untagged.clear()
            self._held.clear()
            self._buffered = 0
            self._unreserve_all()


class Listener(abc.ABC):
    """A server endpoint: accepts connections and runs ``handler(connection)`` for each in its own task.

    When a handler returns (or raises), its connection is closed. :meth:`close` stops accepting and closes the
    open connections (their handlers then see ``TransportError``); :meth:`wait_closed` waits for the handlers.

    ``max_connections`` bounds the connections open at once (counted until each is closed): at the bound a
    transport stops accepting until one closes, or refuses new ones where it cannot pause (UCX).
    ``max_connections_per_peer`` bounds those from one peer address: one more is accepted and closed at once.
    None: no bound.
    """

    scheme: str = ""

    def __init__(
        self,
        handler: Handler,
        *,
        max_connections: int | None = None,
        max_connections_per_peer: int | None = None,
    ) -> None:
        for name, value in (
            ("max_connections", max_connections),
            ("max_connections_per_peer", max_connections_per_peer),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self._handler = handler
        self._tasks: set[asyncio.Task[None]] = set()
        self._connections: set[Connection] = set()
        self._closing = False
        self._max_connections = max_connections
        self._max_per_peer = max_connections_per_peer
        self._open = 0  # connections started and not yet closed
        self._per_peer: dict[str, int] = {}

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

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed (what ``max_connections`` bounds)."""
        return self._open

    def _full(self) -> bool:
        """Whether ``max_connections`` connections are open (accept no more until one closes)."""
        return self._max_connections is not None and self._open >= self._max_connections

    def _peer_full(self, peer: str) -> bool:
        """Whether ``peer`` already has ``max_connections_per_peer`` connections open."""
        return self._max_per_peer is not None and self._per_peer.get(peer, 0) >= self._max_per_peer

    def _connection_closed(self) -> None:  # noqa: B027 - optional hook
        """Called after a connection closed (room for another: a paused accept may go on)."""

    def _start_handler(self, connection: Connection, peer: str | None = None) -> None:
        self._connections.add(connection)
        self._open += 1
        if peer is not None:
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        task = asyncio.get_running_loop().create_task(self._run_handler(connection, peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_handler(self, connection: Connection, peer: str | None = None) -> None:
        try:
            await self._handler(connection)
        except asyncio.CancelledError:
            logger.debug("handler for %s cancelled", connection.description)
        except DissocError as exc:
            peer_log.log(
                logging.INFO,
                ("handler", type(exc)),
                "handler for %s ended with %s: %s",
                connection.description,
                type(exc).__name__,
                exc,
            )
        except Exception:
            logger.exception("handler for %s failed", connection.description)
        finally:
            self._connections.discard(connection)
            try:
                await connection.close()
            finally:
                self._open -= 1
                if peer is not None:
                    left = self._per_peer[peer] - 1
                    if left:
                        self._per_peer[peer] = left
                    else:
                        del self._per_peer[peer]
                if not self._closing:
                    self._connection_closed()

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
        # Wait on the unfinished tasks only: a finished one leaves the set in a done-callback, which runs at
        # the loop's next turn, and since Python 3.12 awaiting a gather of finished tasks completes without
        # yielding to the loop, so looping on the set itself would spin forever.
        waited: set[asyncio.Task[None]] = set(self._tasks)
        while pending := [t for t in self._tasks if not t.done()]:
            waited.update(pending)
            await asyncio.wait(pending)
        for task in waited:  # their errors retrieved (and logged), as gather(return_exceptions=True) did
            if not task.cancelled() and (error := task.exception()) is not None:
                logger.debug("%s: closing a connection at shutdown failed: %r", self.address, error)

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
