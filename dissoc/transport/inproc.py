"""The in-process transport (scheme ``inproc``) with fault injection, for tests.

:func:`inproc_pair` joins two :class:`InprocConnection` ends inside one event loop; :func:`serve_inproc` and
:func:`connect_inproc` do the same through a named listener, so a whole server and client can run over
``inproc://NAME:0``. Each direction can be given :class:`Faults`: reordering within a window, delay,
duplicated, dropped or corrupted messages, and a cut of the connection after N messages or N bytes. Faults are
drawn from a seeded random generator, so a failing case can be replayed.

Messages are copied when sent (the sender may reuse its buffers at once, as with a socket) and tagged
payloads are placed through the receiver's allocator, like the TCP transport. Limits and backpressure behave
as over TCP: a sender waits while the receiver holds ``max_buffered_bytes`` of unclaimed messages.

Until 0.2 it was called the memory transport (``MemoryConnection``, ``memory_pair``, ``mem://``...), but in
dissoc "memory" is where pair lists point (:mod:`dissoc.memory`); the old names stay, as aliases, for one
release.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from dissoc.errors import DissocError, TransportError
from dissoc.transport.base import (
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    Allocator,
    BufferLimitError,
    Connection,
    Handler,
    Listener,
    MessageTooLargeError,
    ReceiveBudget,
    fresh_error,
)
from dissoc.transport.registry import register_transport

__all__ = [
    "FaultStats",
    "Faults",
    "InprocConnection",
    "InprocListener",
    "connect_inproc",
    "inproc_pair",
    "serve_inproc",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Faults:
    """Faults injected into one direction of an in-process connection.

    Message indices count the messages sent in that direction, from 0, dropped ones included.

    - ``reorder_window``: messages are released in batches of up to this many, shuffled (a batch is released
      early when no new message comes for ``reorder_linger`` seconds). Untagged messages keep their order
      among themselves unless ``reorder_untagged``; tagged ones move freely, also relative to untagged ones.
    - ``delay`` (+ a uniform random ``jitter``): seconds between sending a message and its arrival.
    - ``duplicate`` / ``drop`` / ``corrupt``: indices of messages to deliver twice, lose, or deliver with one
      byte flipped; the ``*_rate`` fields do the same at random with that probability.
    - ``cut_after_messages`` / ``cut_after_bytes``: after that many messages (or payload bytes) the connection
      is cut: the message that would cross the limit is lost, later sends raise ``TransportError``, and each
      side receives what was already in flight, then ``TransportError``.
    """

    seed: int | None = None
    reorder_window: int = 0
    reorder_untagged: bool = False
    reorder_linger: float = 0.002
    delay: float = 0.0
    jitter: float = 0.0
    duplicate: Collection[int] = frozenset()
    duplicate_rate: float = 0.0
    drop: Collection[int] = frozenset()
    drop_rate: float = 0.0
    corrupt: Collection[int] = frozenset()
    corrupt_rate: float = 0.0
    cut_after_messages: int | None = None
    cut_after_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.reorder_window < 0 or self.delay < 0 or self.jitter < 0 or self.reorder_linger < 0:
            raise ValueError("reorder_window, reorder_linger, delay and jitter must be >= 0")
        for name in ("duplicate_rate", "drop_rate", "corrupt_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {getattr(self, name)}")

    @property
    def pipelined(self) -> bool:
        """True when messages go through a delivery task (reordering or delay), not straight through."""
        return self.reorder_window > 1 or self.delay > 0 or self.jitter > 0


@dataclass
class FaultStats:
    """What happened to the messages sent in one direction."""

    messages: int = 0
    bytes: int = 0
    delivered: int = 0
    dropped: int = 0
    duplicated: int = 0
    corrupted: int = 0
    cut: bool = False
    corrupted_indices: list[int] = field(default_factory=list)


class _Item:
    __slots__ = ("due", "error", "payload", "tag", "tagged")

    def __init__(
        self, tagged: bool, tag: int, payload: bytearray | None, due: float, error: TransportError | None
    ) -> None:
        self.tagged = tagged
        self.tag = tag
        self.payload = payload
        self.due = due
        self.error = error


class _Channel:
    """One direction: sender -> faults -> receiver's inbox."""

    def __init__(
        self, sender: InprocConnection, receiver: InprocConnection, faults: Faults | None, seed_offset: int
    ) -> None:
        self.sender = sender
        self.receiver = receiver
        self.faults = faults if faults is not None else Faults()
        seed = self.faults.seed
        self.rng = random.Random(None if seed is None else seed + seed_offset)
        self.stats = FaultStats()
        self.queue: deque[_Item] = deque()
        self.inflight = 0
        self.broken: TransportError | None = None
        self.space = asyncio.Event()
        self.wake = asyncio.Event()
        self.pump: asyncio.Task[None] | None = None
        self.ended = False
        self.end_error: TransportError | None = None

    # ------------------------------------------------------------------------------------------ sending side

    async def send(self, tagged: bool, tag: int, views: list[memoryview], total: int) -> None:
        rx = self.receiver
        faults = self.faults
        if self.broken is not None:
            raise fresh_error(self.broken)
        what = f"tagged message {tag:#018x}" if tagged else "untagged message"
        if total > rx.max_message_bytes:
            rx._teardown(
                MessageTooLargeError(
                    f"{rx.description}: the peer announced a {what} of {total} bytes; the limit "
                    f"(max_message_bytes) is {rx.max_message_bytes}"
                )
            )
            raise TransportError(f"{self.sender.description}: the peer rejected a {what} of {total} bytes")
        if tagged and rx._tag_limits:
            try:
                rx._check_tag_limit(tag, total)
            except DissocError as exc:
                rx._teardown(exc)
                raise TransportError(
                    f"{self.sender.description}: the peer rejected a {what} of {total} bytes"
                ) from None
        index = self.stats.messages
        reason = ""
        if faults.cut_after_messages is not None and index >= faults.cut_after_messages:
            reason = f"after {index} messages"
        elif faults.cut_after_bytes is not None and self.stats.bytes + total > faults.cut_after_bytes:
            reason = f"after {self.stats.bytes} bytes, in the middle of a {what} of {total} bytes"
        if reason:
            self.stats.cut = True
            logger.debug("%s: cutting the connection %s", self.sender.description, reason)
            self.sender._cut(reason)
            raise fresh_error(self.broken or TransportError(f"connection cut {reason}"))
        self.stats.messages += 1
        self.stats.bytes += total
        while True:
            if self.broken is not None:
                raise fresh_error(self.broken)
            try:
                admitted = rx._admit(tagged, tag, total, self.inflight)
            except BufferLimitError as exc:
                rx._teardown(exc)
                raise TransportError(f"{self.sender.description}: the peer gave up: {exc}") from exc
            if admitted:
                break
            self.space.clear()
            await self.space.wait()
        rng = self.rng
        if index in faults.drop or (faults.drop_rate and rng.random() < faults.drop_rate):
            self.stats.dropped += 1
            logger.debug("%s: dropping %s #%d", self.sender.description, what, index)
            return
        payload = bytearray(total)
        offset = 0
        for view in views:
            payload[offset : offset + view.nbytes] = view
            offset += view.nbytes
        if total and (
            index in faults.corrupt or (faults.corrupt_rate and rng.random() < faults.corrupt_rate)
        ):
            position = rng.randrange(total)
            payload[position] ^= rng.randrange(1, 256)
            self.stats.corrupted += 1
            self.stats.corrupted_indices.append(index)
            logger.debug("%s: corrupting byte %d of %s #%d", self.sender.description, position, what, index)
        copies = 1
        if index in faults.duplicate or (faults.duplicate_rate and rng.random() < faults.duplicate_rate):
            copies = 2
            self.stats.duplicated += 1
        for _ in range(copies):
            if faults.pipelined:
                loop = asyncio.get_running_loop()
                due = loop.time() + faults.delay + (rng.uniform(0.0, faults.jitter) if faults.jitter else 0.0)
                self.queue.append(_Item(tagged, tag, payload, due, None))
                self.inflight += total
                if self.pump is None:
                    self.pump = loop.create_task(self._pump())
                self.wake.set()
            else:
                self._deliver(tagged, tag, payload)

    def end(self, error: TransportError) -> None:
        """No more messages: the receiver gets an error (``end_error`` if set, else ``error``) once what is in
        flight has arrived. Only the first call counts."""
        if self.ended:
            return
        self.ended = True
        error = self.end_error or error
        if self.pump is not None and not self.pump.done():
            self.queue.append(_Item(False, 0, None, 0.0, error))
            self.wake.set()
        else:
            self.receiver._teardown(error)

    def stop(self) -> None:
        """The receiver is gone: drop what is in flight."""
        if self.pump is not None and not self.pump.done():
            self.pump.cancel()
        self.queue.clear()
        self.inflight = 0
        self.space.set()

    # ---------------------------------------------------------------------------------------- receiving side

    def _deliver(self, tagged: bool, tag: int, payload: bytearray) -> None:
        rx = self.receiver
        if rx.closed:
            return
        self.stats.delivered += 1
        try:
            rx._accept(tag if tagged else None, len(payload))
            if tagged:
                buffer, view = rx._allocate(tag, len(payload))
                view[:] = payload
                rx._deliver(tag, buffer, len(payload))
            else:
                rx._deliver(None, bytes(payload), len(payload))
        except DissocError as exc:
            rx._teardown(exc)

    def _shuffled(self, batch: list[_Item]) -> list[_Item]:
        order = list(range(len(batch)))
        self.rng.shuffle(order)
        out = [batch[i] for i in order]
        if not self.faults.reorder_untagged:
            untagged = iter([item for item in batch if not item.tagged])
            out = [item if item.tagged else next(untagged) for item in out]
        return out

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        faults = self.faults
        window = max(1, faults.reorder_window)
        queue = self.queue
        while True:
            while not queue:
                self.wake.clear()
                await self.wake.wait()
            if window > 1 and len(queue) < window and all(item.error is None for item in queue):
                deadline = loop.time() + faults.reorder_linger
                while len(queue) < window:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    self.wake.clear()
                    try:
                        async with asyncio.timeout(remaining):
                            await self.wake.wait()
                    except TimeoutError:
                        break
            batch: list[_Item] = []
            while queue and len(batch) < window and queue[0].error is None:
                batch.append(queue.popleft())
            if not batch:
                marker = queue.popleft()
                assert marker.error is not None
                self.receiver._teardown(marker.error)
                return
            if len(batch) > 1:
                batch = self._shuffled(batch)
            for item in batch:
                wait = item.due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                assert item.payload is not None
                self.inflight -= len(item.payload)
                self._deliver(item.tagged, item.tag, item.payload)
                self.space.set()


class InprocConnection(Connection):
    """One end of an in-process connection (see :func:`inproc_pair`)."""

    def __init__(
        self,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        allocator: Allocator | None = None,
        description: str = "inproc",
        receive_budget: ReceiveBudget | None = None,
    ) -> None:
        super().__init__(
            max_message_bytes=max_message_bytes,
            max_buffered_bytes=max_buffered_bytes,
            allocator=allocator,
            description=description,
            receive_budget=receive_budget,
        )
        self._out: _Channel | None = None
        self._in: _Channel | None = None
        self._peer: InprocConnection | None = None
        self._send_lock = asyncio.Lock()

    @property
    def sent_stats(self) -> FaultStats:
        """Counters of the messages this end sent (and what the faults did to them)."""
        assert self._out is not None
        return self._out.stats

    @property
    def received_stats(self) -> FaultStats:
        """Counters of the messages the peer sent to this end."""
        assert self._in is not None
        return self._in.stats

    async def _send_frame(self, tagged: bool, tag: int, views: list[memoryview], total: int) -> None:
        async with self._send_lock:
            if self._closed or self._out is None:
                raise self._closed_error("cannot send")
            await self._out.send(tagged, tag, views, total)

    def _on_flow(self) -> None:
        if self._in is not None:
            self._in.space.set()

    def _teardown(self, exc: DissocError) -> None:
        """Fail this end with ``exc``; the peer's sends fail at once, its receives after what is in flight."""
        if self._closed:
            return
        self._closed = True
        self._fail(exc)
        peer = self._peer
        gone = TransportError(f"{peer.description if peer else 'peer'}: the peer closed the connection")
        if self._in is not None:
            if self._in.broken is None:
                self._in.broken = gone
            self._in.stop()
        if self._out is not None:
            if self._out.broken is None:
                self._out.broken = TransportError(f"{self._description}: {exc}")
            self._out.space.set()
            self._out.end(gone)

    def _cut(self, reason: str) -> None:
        """Cut both directions: sends fail now, each side receives what is in flight and then an error."""
        channels = [channel for channel in (self._out, self._in) if channel is not None]
        for channel in channels:
            # Set both reasons first: ending one side tears it down, which ends the other direction too.
            if channel.end_error is None:
                channel.end_error = TransportError(
                    f"{channel.receiver.description}: the connection was cut {reason}"
                )
            if channel.broken is None:
                channel.broken = TransportError(
                    f"{channel.sender.description}: the connection was cut {reason}"
                )
            channel.space.set()
        for channel in channels:
            channel.end(channel.end_error or TransportError(f"the connection was cut {reason}"))

    async def _close_transport(self) -> None:
        if self._error is not None:
            self._teardown(self._error)


def _join(
    a: InprocConnection, b: InprocConnection, a_to_b: Faults | None, b_to_a: Faults | None, offset: int
) -> None:
    a._peer = b
    b._peer = a
    a._out = b._in = _Channel(a, b, a_to_b, 2 * offset)
    b._out = a._in = _Channel(b, a, b_to_a, 2 * offset + 1)


def inproc_pair(
    a_to_b: Faults | None = None,
    b_to_a: Faults | None = None,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    allocator: Allocator | None = None,
    name: str = "pair",
    **faults: Any,
) -> tuple[InprocConnection, InprocConnection]:
    """Two connected in-process ends ``(a, b)``.

    ``a_to_b`` / ``b_to_a`` are the faults of each direction; keyword arguments naming :class:`Faults` fields
    are a shorthand for ``a_to_b`` (``inproc_pair(drop={1}, seed=7)``). The limits and allocator apply to both
    ends. Use inside a running event loop.
    """
    if faults:
        if a_to_b is not None:
            raise ValueError("give either a_to_b or Faults keyword arguments, not both")
        a_to_b = Faults(**faults)
    limits: dict[str, Any] = {
        "max_message_bytes": max_message_bytes,
        "max_buffered_bytes": max_buffered_bytes,
        "allocator": allocator,
    }
    a = InprocConnection(description=f"inproc {name} a->b", **limits)
    b = InprocConnection(description=f"inproc {name} b->a", **limits)
    _join(a, b, a_to_b, b_to_a, 0)
    return a, b


_LISTENERS: dict[str, InprocListener] = {}
_names = itertools.count(1)


class InprocListener(Listener):
    """An in-process server endpoint, reachable by name with :func:`connect_inproc` (``inproc://NAME:0``).

    ``to_client`` / ``to_server`` are the faults applied to each connection accepted here (unless the
    connecting side gives its own); a seeded generator is offset by the connection's number, so runs replay.
    At ``max_connections`` a connect fails with :class:`~dissoc.errors.TransportError`; in-process peers have
    no address, so ``max_connections_per_peer`` is accepted and does nothing.
    """

    scheme = "inproc"

    def __init__(
        self,
        name: str,
        port: int,
        handler: Handler,
        *,
        to_client: Faults | None = None,
        to_server: Faults | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        allocator: Allocator | None = None,
        max_connections: int | None = None,
        max_connections_per_peer: int | None = None,
        receive_budget: ReceiveBudget | None = None,
    ) -> None:
        super().__init__(handler, max_connections=max_connections)
        del max_connections_per_peer
        self._loop = asyncio.get_running_loop()
        self._name = name
        self._port = port
        self._to_client = to_client
        self._to_server = to_server
        self._limits: dict[str, Any] = {
            "max_message_bytes": max_message_bytes,
            "max_buffered_bytes": max_buffered_bytes,
            "allocator": allocator,
            "receive_budget": receive_budget,
        }
        self._accepted = 0

    @property
    def host(self) -> str:
        """The listener's name."""
        return self._name

    @property
    def port(self) -> int:
        """The port given when serving (kept for ``inproc://NAME:PORT`` addresses; it means nothing else)."""
        return self._port

    def _accept(
        self,
        client_limits: dict[str, Any],
        recv_faults: Faults | None,
        send_faults: Faults | None,
    ) -> InprocConnection:
        if self._full():
            raise TransportError(
                f"cannot connect to inproc://{self._name}:{self._port}: {self.open_connections} connections "
                "are open (max_connections)"
            )
        number = self._accepted
        self._accepted += 1
        server = InprocConnection(description=f"inproc {self._name}#{number} server", **self._limits)
        client = InprocConnection(description=f"inproc {self._name}#{number} client", **client_limits)
        to_client = recv_faults if recv_faults is not None else self._to_client
        to_server = send_faults if send_faults is not None else self._to_server
        _join(server, client, to_client, to_server, number)
        logger.debug("accepted %s", server.description)
        self._start_handler(server)
        return client

    def _stop_accepting(self) -> None:
        if _LISTENERS.get(self._name) is self:
            del _LISTENERS[self._name]


async def serve_inproc(
    name: str,
    port: int,
    handler: Handler,
    *,
    to_client: Faults | None = None,
    to_server: Faults | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    allocator: Allocator | None = None,
    max_connections: int | None = None,
    max_connections_per_peer: int | None = None,
    receive_budget: ReceiveBudget | None = None,
) -> InprocListener:
    """Serve in-process under ``name`` (an empty name picks a fresh one); see :class:`InprocListener`."""
    if not name:
        name = f"inproc-{next(_names)}"
    current = _LISTENERS.get(name)
    if current is not None and current.is_serving and not current._loop.is_closed():
        raise TransportError(f"cannot listen on inproc://{name}:{port}: the name is in use")
    listener = InprocListener(
        name,
        port,
        handler,
        to_client=to_client,
        to_server=to_server,
        max_message_bytes=max_message_bytes,
        max_buffered_bytes=max_buffered_bytes,
        allocator=allocator,
        max_connections=max_connections,
        max_connections_per_peer=max_connections_per_peer,
        receive_budget=receive_budget,
    )
    _LISTENERS[name] = listener
    return listener


async def connect_inproc(
    name: str,
    port: int = 0,
    *,
    timeout: float | None = None,
    recv_faults: Faults | None = None,
    send_faults: Faults | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    allocator: Allocator | None = None,
) -> InprocConnection:
    """Connect to the in-process listener ``name``; ``recv_faults``/``send_faults`` override its faults.

    ``port`` and ``timeout`` are accepted for symmetry with TCP and otherwise ignored.
    """
    del port, timeout
    listener = _LISTENERS.get(name)
    if listener is None or not listener.is_serving or listener._loop is not asyncio.get_running_loop():
        raise TransportError(f"cannot connect to inproc://{name}: no in-process listener of that name")
    limits: dict[str, Any] = {
        "max_message_bytes": max_message_bytes,
        "max_buffered_bytes": max_buffered_bytes,
        "allocator": allocator,
    }
    return listener._accept(limits, recv_faults, send_faults)


register_transport("inproc", connect_inproc, serve_inproc)

# The names of 0.2, kept for one release: the old scheme, and the old names as aliases of the new.
register_transport("mem", connect_inproc, serve_inproc)
MemoryConnection = InprocConnection
MemoryListener = InprocListener
memory_pair = inproc_pair
serve_memory = serve_inproc
connect_memory = connect_inproc
