"""A UCX connection (:class:`UcxConnection`) and the client side of its setup (:func:`connect_ucx`)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import ctypes
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from dissoc.buffers import device_nbytes
from dissoc.errors import DissocError, ProtocolError, ResourceError, TransportError
from dissoc.logs import peer_log
from dissoc.transport._inbox import Waiter
from dissoc.transport.base import (
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    TAG_MASK_ALL,
    Allocator,
    Connection,
    MessageTooLargeError,
    ReceiveBudget,
    Received,
    SendData,
    as_views,
    check_u64,
    fresh_error,
)
from dissoc.transport.ucx.am import AmReceiver
from dissoc.transport.ucx.calls import calls
from dissoc.transport.ucx.driver import MAX_ROUNDS, Driver, Pending
from dissoc.transport.ucx.endpoint import COMPLETED, RawEndpoint, RawRequest, flush
from dissoc.transport.ucx.handshake import (
    BYE_TAG,
    HELLO_TAG,
    MAGIC,
    MAX_HELLO,
    REPLY_TAG,
    parse_hello,
    plausible_address,
    recv_tagged,
    send_tagged,
)
from dissoc.transport.ucx.library import (
    close_endpoint,
    endpoint_alive,
    ucx_array,
    ucx_context,
    ucx_tag,
    ucxx_lib,
)
from dissoc.transport.ucx.libucp import UcpRequestParam, ep_transports
from dissoc.transport.ucx.peer_info import PeerInfoExchange

__all__ = ["PATHS", "UcxConnection", "connect_ucx"]

logger = logging.getLogger(__name__)

#: Connection paths (see the package docstring).
PATHS = ("auto", "listener", "address")
#: Seconds a closing connection waits for its outstanding sends before it closes the endpoints.
_CLOSE_WAIT = 2.0
#: Seconds a closed connection keeps progressing its worker for the closing exchange with the peer.
_RELEASE_WAIT = 1.0
#: Bytes and messages a connection's sends may have under way before ``send_many`` waits for the oldest
#: (their buffers are held until UCX completes them; a larger message waits for itself): enough to keep
#: small messages moving while the peer takes earlier ones, little next to the peer's own budgets.
SEND_WINDOW_BYTES = 4 << 20
SEND_WINDOW = 512
#: Seconds a send may stay under way before the connection fails with ``TransportError``: a peer that is
#: unreachable (a partition, a host gone without a word) never completes it, and the connection, a server's
#: stream on it included, would be held until UCX's transport gave up. Over UCX a peer that takes no data
#: (a consumer that stopped reading) cannot be told from one that is gone, so this is the server's idle
#: bound (``idle_timeout``'s default), not TCP's shorter ``user_timeout``
#: (:class:`dissoc.transport.Keepalive`). None: no limit. Checked whenever the sender goes on or waits.
SEND_STALL_TIMEOUT: float | None = 300.0
#: Largest buffer a message that arrives after the close is received into (larger ones are truncated).
_DISCARD_BYTES = 1 << 20
#: The parameters of every tagged receive (contiguous bytes, no callback: requests are polled).
_RECV_PARAM = UcpRequestParam()
_RECV_PARAM_ADDRESS = ctypes.addressof(_RECV_PARAM)


class _TaggedRecv:
    """A tagged receive UCX has started: its request, the message's tag and length, where it lands (the
    payload to hand out, and what keeps its memory alive while UCX writes it), and the waiter it was taken
    for (its id, or 0)."""

    __slots__ = ("buffer", "length", "request", "tag", "view", "waiter")

    def __init__(self, request: Any, tag: int, length: int, buffer: Any, view: object, waiter: int) -> None:
        self.request = request
        self.tag = tag
        self.length = length
        self.buffer = buffer
        self.view = view
        self.waiter = waiter


class _Send:
    """A send UCX has not completed yet: its request, what it keeps alive, its size and what it sends."""

    __slots__ = ("keep", "nbytes", "posted", "request", "tag", "tagged")

    def __init__(
        self, request: Any, keep: object, nbytes: int, tagged: bool, tag: int, posted: float
    ) -> None:
        self.request = request
        self.keep = keep
        self.nbytes = nbytes
        self.tagged = tagged
        self.tag = tag
        self.posted = posted  # (time.monotonic())


class UcxConnection(Connection):
    """A :class:`Connection` between two per-connection UCX workers (see the package docstring).

    Get one from :func:`connect_ucx` or in a :func:`serve_ucx` handler. Tagged messages may be sent from
    device memory, and the allocator may return device buffers (UCX's CUDA transports move them).
    ``closing_exchange``: the data endpoint has no peer-failure handling, so closing starts with the BYE
    exchange (see :meth:`_release`).
    """

    device_memory = True

    def __init__(
        self,
        driver: Driver,
        endpoint: Any,
        bootstrap: Any,
        bootstrap_driver: Driver,
        *,
        description: str,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        allocator: Allocator | None = None,
        receive_budget: ReceiveBudget | None = None,
        closing_exchange: bool = True,
    ) -> None:
        super().__init__(
            max_message_bytes=max_message_bytes,
            max_buffered_bytes=max_buffered_bytes,
            allocator=allocator,
            description=description,
            receive_budget=receive_budget,
        )
        self._loop = driver.loop
        self._driver = driver
        self._worker = driver.worker
        self._ep = endpoint
        #: The endpoint when it is dissoc's own (it sends from an address, no ucxx Array needed).
        self._raw_ep: RawEndpoint | None = endpoint if isinstance(endpoint, RawEndpoint) else None
        self._bootstrap: Any = bootstrap
        self._bootstrap_driver = bootstrap_driver
        self._tagged: collections.deque[_TaggedRecv] = collections.deque()
        # Tagged messages are probed and received through libucp (see _probe).
        self._worker_handle = int(self._worker.handle)
        ucp = calls()
        self._tag_probe = ucp.tag_probe
        self._tag_probe_take = ucp.tag_probe_take
        self._take_run_call = ucp.tag_take_run
        self._msg_recv = ucp.tag_msg_recv
        self._recv_what = f"{description}: receiving tagged message"
        self._inflight = 0
        self._done_bytes = 0  # (of the messages received whole in this pass: see _hand_over)
        #: Sends posted and not known to be completed, oldest first (see send_many).
        self._sending: collections.deque[_Send] = collections.deque()
        self._sending_bytes = 0
        self._claimed: dict[int, int] = {}
        self._peer_gone = False
        #: The peer's BYE arrived (it sends nothing after it); ours was sent.
        self._peer_bye = False
        self._bye_sent = False
        self._closing = False
        self._release_task: asyncio.Task[None] | None = None
        #: Closing needs the BYE exchange (a data endpoint without peer-failure handling): see _release.
        self._exchange = closing_exchange
        #: ucxx's peer-information exchange (the listener path): see exchange_peer_info.
        self._peer_info: PeerInfoExchange | None = None
        #: A tagged or active message came from the peer (for the exchange: it is not waiting for one).
        self._heard = False
        try:
            # Untagged messages are received by dissoc, not by ucxx (see dissoc.transport.ucx.am).
            self._am = AmReceiver(int(self._worker.handle), max_message_bytes, description)
        except Exception as exc:
            raise TransportError(f"{description}: cannot receive active messages: {exc}") from exc
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

    def lanes(self) -> tuple[str, ...]:
        """The transport and device of each lane of the data endpoint (``ucp_ep_query``; see
        :meth:`Connection.lanes`), e.g. ``("tcp/lo", "sysv/memory", "cma/memory")``; empty once the
        connection is closed or its endpoint failed (a failed endpoint is not asked), or where libucp cannot
        tell."""
        ep = self._ep
        if ep is None or self._closed or self._closing or not endpoint_alive(ep):
            return ()
        try:
            handle = int(ep.handle)
            if not handle:
                return ()
            names = (f"{name}/{device}" if device else name for name, device in ep_transports(handle))
            return tuple(dict.fromkeys(names))
        except Exception as exc:
            logger.debug("%s: cannot tell the endpoint's lanes: %s", self._description, exc)
            return ()

    def exchange_peer_info(self, listener: bool) -> None:
        """Start ucxx's peer-information exchange on the endpoint (the listener path), as the listener's side
        or the connecting one: see :mod:`~dissoc.transport.ucx.peer_info`. Nothing waits for it; a failure
        to start it is only logged."""
        if self._peer_info is not None or self._closed or self._closing:
            return
        handle = int(self._ep.handle)
        if not handle:
            return
        try:
            self._peer_info = PeerInfoExchange(
                handle,
                self._loop,
                self._description,
                listener=listener,
                quiet=self._peer_quiet,
                excess=lambda reason: self._teardown(ProtocolError(f"{self._description}: {reason}")),
            )
        except Exception as exc:
            logger.debug("%s: ucxx's peer-information exchange did not start: %s", self._description, exc)

    def _peer_quiet(self) -> bool:
        """Whether nothing has come from the peer (no tagged or active message; the worker is progressed
        first)."""
        if self._heard or self._closed or self._closing:
            return False
        self._driver.run()
        return not self._heard and self._am.ready() is None and not self._closed

    # ------------------------------------------------------------------------------------------------ sending

    def _post(self, tagged: bool, tag: int, views: list[Any], total: int) -> tuple[Any, object]:
        """Post one message to UCX; returns the request and what it must keep alive.

        ``views`` are byte views, or one device buffer (``__cuda_array_interface__``), sent from where it is
        (a device buffer's type is whatever array library made it, hence ``Any``).
        """
        if len(views) == 1:
            data: Any = views[0]
        else:
            data = np.empty(total, dtype=np.uint8)
            offset = 0
            for view in views:
                data[offset : offset + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
                offset += view.nbytes
        if self._closed or self._closing:
            raise self._closed_error(_sending(tagged, tag))
        try:
            array = ucx_array(data)
            request = self._ep.tag_send(array, ucx_tag(tag)) if tagged else self._ep.am_send(array)
        except Exception as exc:
            raise TransportError(f"{self._description}: {_sending(tagged, tag)} failed: {exc}") from exc
        return request, (array, data)

    def _post_host(self, tagged: bool, tag: int, buffer: bytes | pa.Buffer) -> tuple[Any, object]:
        """:meth:`_post` for one host buffer (see :func:`_host_buffer`): on dissoc's own endpoint, straight
        from its address (no ucxx ``Array``)."""
        raw = self._raw_ep
        if raw is None:
            return self._post(tagged, tag, [buffer], len(buffer))
        if self._closed or self._closing:
            raise self._closed_error(_sending(tagged, tag))
        if isinstance(buffer, bytes):
            ptr: int | bytes = buffer
            nbytes = len(buffer)
        else:
            ptr = buffer.address
            nbytes = buffer.size
        try:
            if tagged:
                return raw.tag_send_buffer(ptr, nbytes, tag, buffer), buffer
            return raw.am_send_buffer(ptr, nbytes, buffer), buffer
        except Exception as exc:
            raise TransportError(f"{self._description}: {_sending(tagged, tag)} failed: {exc}") from exc

    async def _send_frame(self, tagged: bool, tag: int, views: list[memoryview], total: int) -> None:
        request, keep = self._post(tagged, tag, views, total)
        await self._driver.wait(request, keep, _sending(tagged, tag))

    async def send_tagged(self, tag: int, data: SendData) -> None:
        """Send one tagged message (host buffers, or one device buffer sent from device memory)."""
        await self.send_many([(tag, data)])

    async def send_many(self, messages: Sequence[tuple[int | None, SendData]]) -> None:
        """Post every message at once, in order, then wait for them all (see :meth:`Connection.send_many`)."""
        # Everything is checked before anything is posted.
        prepared: list[tuple[bool, int, Any, list[Any] | None, int]] = []
        for tag, data in messages:
            if tag is not None:
                check_u64(tag, "tag")
            host = _host_buffer(data)
            if host is not None:
                prepared.append((tag is not None, tag or 0, host, None, 0))
                continue
            device = _device_item(data)
            if device is not None:
                prepared.append((tag is not None, tag or 0, None, [device[0]], device[1]))
                continue
            views, total = as_views(data)
            prepared.append((tag is not None, tag or 0, None, views, total))
        posted = [
            self._post_host(tagged, tag, host) if views is None else self._post(tagged, tag, views, total)
            for tagged, tag, host, views, total in prepared
        ]
        driver = self._driver
        sending = self._sending
        now = time.monotonic()
        for (request, keep), (tagged, tag, host, _, total) in zip(posted, prepared, strict=True):
            if request.completed:
                try:
                    request.check_error()
                except Exception as exc:
                    raise TransportError(
                        f"{driver.description}: {_sending(tagged, tag)} failed: {exc}"
                    ) from exc
                continue
            # Not waited for here: the caller goes on to its next messages while these move. The buffer is
            # kept until UCX completes the send (see _settle_sends), and a failure fails the connection.
            sending.append(_Send(request, keep, total if host is None else len(host), tagged, tag, now))
            self._sending_bytes += sending[-1].nbytes
        if sending or self._raw_ep is None:
            # Something is under way (or ucxx's endpoint may want progress): progress soon. Sends UCX
            # completed at once (small ones over shared memory, mostly) leave nothing to progress, and the
            # worker stays armed for what the peer sends.
            driver.kick()
        await self._within_send_window()

    def _settle_sends(self) -> bool:
        """Let go of the sends UCX completed (oldest first: they complete in order, by and large); a failed
        one fails the connection. Whether any completed."""
        sending = self._sending
        settled = False
        while sending and sending[0].request.completed:
            done = sending.popleft()
            self._sending_bytes -= done.nbytes
            settled = True
            try:
                done.request.check_error()
            except Exception as exc:
                self._teardown(
                    TransportError(f"{self._description}: {_sending(done.tagged, done.tag)} failed: {exc}")
                )
                return True
        return settled

    async def _within_send_window(self) -> None:
        """Wait until the sends under way are within :data:`SEND_WINDOW_BYTES` and :data:`SEND_WINDOW`."""
        sending = self._sending
        self._settle_sends()
        stall = SEND_STALL_TIMEOUT
        if stall is not None and sending and time.monotonic() - sending[0].posted > stall:
            self._stalled(sending[0], stall)
        while sending and (self._sending_bytes > SEND_WINDOW_BYTES or len(sending) > SEND_WINDOW):
            oldest = sending[0]
            left = None if stall is None else max(0.0, oldest.posted + stall - time.monotonic())
            try:
                async with asyncio.timeout(left):
                    await self._driver.wait(oldest.request, None, _sending(oldest.tagged, oldest.tag))
            except TimeoutError:
                self._stalled(oldest, stall)
            self._settle_sends()
        if self._closed and self._error is not None:
            raise fresh_error(self._error)  # (a send of this call failed meanwhile)

    def _stalled(self, send: _Send, stall: float | None) -> None:
        """Fail the connection: ``send`` has been under way for longer than :data:`SEND_STALL_TIMEOUT`."""
        error = TransportError(
            f"{self._description}: {_sending(send.tagged, send.tag)} has not completed within {stall} s "
            "(SEND_STALL_TIMEOUT): the peer is unreachable"
        )
        self._teardown(error)
        raise fresh_error(error)

    def _sends_under_way(self) -> list[asyncio.Future[None]]:
        """Hand the sends not completed yet to the driver, with a future each (for a close that lets them
        finish first)."""
        futures: list[asyncio.Future[None]] = []
        for item in self._sending:
            future: asyncio.Future[None] = self._loop.create_future()
            future.add_done_callback(_retrieve)
            self._driver.pending.append(Pending(item.request, item.keep, future))
            futures.append(future)
        self._sending.clear()
        self._sending_bytes = 0
        return futures

    # ---------------------------------------------------------------------------------------------- receiving

    def _busy(self) -> bool:
        return bool(self._tagged or self._am.busy or self._blocked or self._sending)

    def _on_flow(self) -> None:
        self._driver.kick()

    def _on_progress(self) -> bool:
        if self._closed:
            return False
        # (sends that completed are no reason to progress again at once: nothing new was started)
        if self._sending and self._settle_sends() and self._closed:
            return True
        activity = self._finish_tagged()
        activity = self._pump_untagged() or activity
        activity = self._pump_tagged() or activity
        return activity

    def _finish_tagged(self) -> bool:
        tagged = self._tagged
        if not tagged or not tagged[0].request.completed:
            return False
        # Oldest first, up to the first one still under way: a peer's messages complete in the order they
        # were received, by and large, and looking no further keeps this pass short when many are posted.
        done = [tagged.popleft()]
        while tagged and tagged[0].request.completed:
            done.append(tagged.popleft())
        received: list[Received] = []  # (for a receiver: handed over in one call)
        for item in done:
            self._inflight -= item.length
            self._release_claim(item.waiter)
            try:
                item.request.check_error()
            except Exception as exc:
                self._deliver_all(received)
                self._teardown(
                    TransportError(
                        f"{self._description}: receiving tagged message {item.tag:#018x} failed: {exc}"
                    )
                )
                return True
            if self._receiver is not None:
                received.append((item.tag, item.buffer, item.length))
            else:
                self._deliver(item.tag, item.buffer, item.length)
        self._deliver_all(received)
        return True

    def _release_claim(self, waiter: int) -> None:
        if waiter:
            left = self._claimed.get(waiter, 0) - 1
            if left > 0:
                self._claimed[waiter] = left
            else:
                self._claimed.pop(waiter, None)

    def _pump_untagged(self, force: bool = False) -> bool:
        """Hand the untagged messages that have arrived to the inbox, in order, while reading is admitted
        (``force``: all of them, the peer is gone)."""
        am = self._am
        if am.error is not None:
            self._teardown(am.error)
            return True
        activity = False
        received: list[Received] = []  # (for a receiver: handed over in one call)
        queue = am.queue
        fast = not (force or self._paused_by_owner) and self._receiver is not None and self._budget is None
        if queue and fast:
            # The common case, in fewer steps: eager messages (bytes already) to a receiver, as far as the
            # buffering budget admits them (_may_take), and no shared receive budget to take room in.
            used = self._buffered + self._inflight
            room = self._max_buffered_bytes - used if used else -1
            while queue:
                head = queue[0]
                if type(head) is not bytes:
                    break
                size = len(head)
                if 0 <= room < size:
                    break
                queue.popleft()
                received.append((None, head, size))
            if received:
                activity = self._heard = True
        while not self._closed:
            length = am.ready()
            if length is None:
                if am.error is not None:
                    self._deliver_all(received)
                    self._teardown(am.error)
                    return True
                break
            # (whether a consumer waits is asked only when the budget alone does not admit the message)
            if not (
                force
                or self._may_take(length, False)
                or self._may_take(length, any(not f.done() for f in self._untagged_waiters))
            ):
                break
            message = am.pop()
            activity = self._heard = True
            try:
                self._accept(None, len(message))
            except DissocError as exc:
                self._deliver_all(received)
                self._teardown(exc)
                return True
            if self._receiver is not None:
                received.append((None, message, len(message)))
            else:
                self._deliver(None, message, len(message))
        self._deliver_all(received)
        return activity

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
        # Messages received whole at once go to a receiver together, at the end of the pass.
        done: list[Received] | None = [] if self._receiver is not None else None
        if done is not None and self._lander is not None and not force:
            activity = self._take_run(done) or activity
        while not self._closed and self._probe(0, 0, None, force, done):
            activity = True
        if done:
            self._hand_over(done)
        return activity

    def _take_run(self, done: list[Received]) -> bool:
        """The unclaimed messages of the common case (a receiver, a lander, no other limit to take room in)
        taken, landed and received in one call per run (``tag_take_run``), up to the first one it leaves to
        :meth:`_take` or to the general pass; whether something happened."""
        activity = False
        run = self._take_run_call
        lander = self._lander
        if lander is None or self._budget is not None:
            return False
        while not (self._closed or self._tagged or self._paused_by_owner or self._tag_limits):
            used = self._buffered + self._inflight
            most = self._max_buffered_bytes - used if used else -1
            if used and most < 0:
                break  # (the budget is used up: the general pass looks at what waits)
            status, handle, found, length, extra, taken = run(
                self._worker_handle,
                most,
                lander,
                done,
                _RECV_PARAM_ADDRESS,
                BYE_TAG,
                self._max_message_bytes,
            )
            if taken:
                activity = self._heard = True
                self._inflight += taken
                self._done_bytes += taken
            if status == 0:
                break
            activity = self._heard = True
            # 1: a message for _take: a BYE, one too large, one not admitted, one the lander left to the
            # allocator (so _take does not ask it again)
            if status == 1:
                if not self._take(handle, found, length, None, done, ask_lander=False) or not handle:
                    break
                continue
            if status == 3:  # the lander raised
                self._discard(handle, length)
                if isinstance(extra, DissocError) or not isinstance(extra, Exception):
                    raise extra  # type: ignore[misc]
                raise TransportError(
                    f"{self._description}: the lander failed for tagged message {found:#018x} of {length} "
                    f"bytes: {extra!r}"
                ) from extra
            # 2: a receive UCX did not complete at once; 4: one that failed (see _finish_tagged)
            request = RawRequest(handle, None, self._recv_what, found)
            self._inflight += length
            self._tagged.append(_TaggedRecv(request, found, length, extra, extra, 0))
            break
        return activity

    def _hand_over(self, done: list[Received]) -> None:
        """Messages received whole in this pass (counted in ``_inflight`` until now) to the receiver."""
        self._inflight -= self._done_bytes
        self._done_bytes = 0
        self._deliver_all(done)

    def _probe(
        self, tag: int, mask: int, waiter: Waiter | None, force: bool, done: list[Received] | None = None
    ) -> bool:
        """Receive the oldest message matching ``tag``/``mask`` if there is one and it may be taken now.

        Straight through libucp (``ucp_tag_probe_nb``, ``ucp_tag_msg_recv_nbx``): an eager message that has
        arrived whole is received at once, and none needs an object of ucxx's per message. With ``done`` (the
        receiver's list for this pass), a message for no waiter that was received at once, while no receive
        is under way before it, goes there instead of waiting for the next pass.
        """
        # Taken out of UCX at once when the buffering budget admits it (_may_take); else only looked at: a
        # message that may not be taken now stays in UCX (UCX's own flow control holds the sender back).
        if force or waiter is not None:
            most = -1
        elif self._paused_by_owner:
            most = -2
        else:
            used = self._buffered + self._inflight
            if not used:
                most = -1
            else:
                room = self._max_buffered_bytes - used
                most = room if room >= 0 else -2
        if most < -1:  # (paused, or the budget is used up: only looked at)
            probed = self._tag_probe(self._worker_handle, tag, mask, False)
            if probed is not None:
                probed = (0, probed[1], probed[2])
        else:
            probed = self._tag_probe_take(self._worker_handle, tag, mask, most)
        if probed is None:
            return False
        self._heard = True
        message, found, length = probed
        return self._take(message, found, length, waiter, done)

    def _take(
        self,
        message: int,
        found: int,
        length: int,
        waiter: Waiter | None,
        done: list[Received] | None,
        ask_lander: bool = True,
    ) -> bool:
        """The rest of :meth:`_probe` for a message it found (``message``: taken out of UCX; 0: looked at
        only, it may not be taken now); whether something happened. ``ask_lander``: False where the lander
        already left this message to the allocator."""
        if found == BYE_TAG:
            self._take_bye(length, message or None)
            return True
        if length > self._max_message_bytes:
            if done:
                self._hand_over(done)  # (what came before it first)
                done.clear()
            self._teardown(
                MessageTooLargeError(
                    f"{self._description}: the peer sent tagged message {found:#018x} of {length} bytes; "
                    f"the limit (max_message_bytes) is {self._max_message_bytes}"
                )
            )
            if message:
                self._discard(message, length)
            return True
        if not message:
            return False  # (not admitted now: it waits in UCX)
        try:
            if self._tag_limits or self._budget is not None:  # (what _accept checks; most connections none)
                self._accept(found, length)
        except DissocError as exc:
            if done:
                self._hand_over(done)
                done.clear()
            self._teardown(exc)
            self._discard(message, length)
            return True
        landed = None
        lander = self._lander if ask_lander else None
        if lander is not None:  # (the per-body path: Connection._allocate_at's first step, inline)
            try:
                landed = lander(found, length)
            except BaseException as exc:
                self._discard(message, length)
                if isinstance(exc, DissocError) or not isinstance(exc, Exception):
                    raise
                raise TransportError(
                    f"{self._description}: the lander failed for tagged message {found:#018x} of {length} "
                    f"bytes: {exc!r}"
                ) from exc
        if landed is not None:
            buffer, address = landed
            view: object = buffer
        else:
            try:
                buffer, view, address = self._allocate_at(found, length, skip_lander=True)
            except BaseException:
                self._discard(message, length)
                raise
        ptr = self._msg_recv(self._worker_handle, address, length, message, _RECV_PARAM_ADDRESS)
        if not ptr and done is not None and waiter is None and not self._tagged:
            self._inflight += length
            self._done_bytes += length
            done.append((found, buffer, length))
            return True
        request = RawRequest(ptr, None, self._recv_what, found) if ptr else COMPLETED
        key = id(waiter) if waiter is not None else 0
        if key:
            self._claimed[key] = self._claimed.get(key, 0) + 1
        self._inflight += length
        self._tagged.append(_TaggedRecv(request, found, length, buffer, view, key))
        return True

    def _discard(self, message: int, length: int) -> None:
        """Receive ``message`` (a probed message handle, taken from UCX) into a sink and drop it: the
        connection is failing. A sink smaller than the message: UCX truncates (an error on this side only)
        and the sender's request completes all the same."""
        sink = np.empty(max(1, min(length, _DISCARD_BYTES)), dtype=np.uint8)
        self._recv_into_sink(message, sink)

    def _recv_into_sink(self, message: int, sink: Any) -> None:
        """Receive probed ``message`` into ``sink`` (a numpy array, kept until the receive completes)."""
        with contextlib.suppress(Exception):
            address = int(sink.ctypes.data)
            ptr = self._msg_recv(self._worker_handle, address, sink.nbytes, message, _RECV_PARAM_ADDRESS)
            if ptr:
                request = RawRequest(ptr, sink, self._recv_what)
                self._driver.pending.append(Pending(request, sink, None))

    # ------------------------------------------------------------------------------------------------ closing

    def _take_bye(self, length: int, message: int | None = None) -> None:
        """The peer announced that it closes: consume the notice (``message``: its handle, already taken from
        UCX), then drain and fail like a lost peer."""
        if message is None:
            probed = self._tag_probe(self._worker_handle, BYE_TAG, TAG_MASK_ALL, True)
            message = probed[0] if probed is not None else None
        if message:
            self._peer_bye = True
            self._recv_into_sink(message, np.empty(max(1, min(length, MAX_HELLO)), dtype=np.uint8))
        if not self._closed and not self._closing:
            self._loop.call_soon(self._on_peer_gone)

    def _send_bye(self) -> asyncio.Future[None] | None:
        """Tell the peer this side closes (it may not learn it otherwise on the address path)."""
        if self._ep is None or self._bye_sent or (self._peer_gone and not self._peer_bye):
            return None
        self._bye_sent = True
        try:
            data = MAGIC
            array = ucx_array(data)
            request = self._ep.tag_send(array, ucx_tag(BYE_TAG))
        except Exception:
            return None
        future: asyncio.Future[None] = self._loop.create_future()
        # Awaited only by a close that waits for its sends: a failure is no news to anyone else.
        future.add_done_callback(_retrieve)
        self._driver.pending.append(Pending(request, (array, data), future))
        self._driver.kick()
        return future

    def _on_bootstrap_closed(self, *args: object) -> None:
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
            for _ in range(MAX_ROUNDS):
                self._worker.progress()
                self._driver.complete()
                activity = self._finish_tagged()
                if self._closed:
                    return
                activity = self._pump_untagged(force=True) or activity
                activity = self._pump_tagged(force=True) or activity
                if not activity and not self._tagged and not self._am.busy:
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
        if isinstance(exc, ResourceError):
            peer_log.log(logging.WARNING, type(exc), "%s", exc, stream=self.stream_id)
        else:
            logger.debug("%s torn down: %s", self._description, exc, extra=self._log_extra())
        driver = self._driver
        driver.on_progress = lambda: False
        driver.fail_pending(TransportError(f"{self._description}: {exc}"))
        with contextlib.suppress(Exception):
            self._bootstrap.remove_close_callback()
        # A receive UCX has started keeps writing into its buffer until it completes: hand each one to the
        # driver, which keeps the buffer alive until then (dropping it here let UCX write into freed memory).
        for item in self._tagged:
            driver.pending.append(Pending(item.request, (item.buffer, item.view), None))
        self._tagged.clear()
        for send in self._sending:  # (the same for sends: UCX reads their buffers until they complete)
            driver.pending.append(Pending(send.request, send.keep, None))
        self._sending.clear()
        self._sending_bytes = 0
        if self._peer_info is not None:
            # (a receive the peer never answered completes, cancelled, once the endpoint is closed)
            for request, keep in self._peer_info.settle():
                driver.pending.append(Pending(request, keep, None))
            self._peer_info = None
        self._am.close()
        self._claimed.clear()
        self._release_task = self._loop.create_task(self._release())

    async def _release(self) -> None:
        """Close the endpoints, progressing the worker until UCX completed everything (bounded), then let go.

        A request UCX never completes holds its endpoint, and the endpoint its worker, for good, and the
        worker is only progressed while this runs. Endpoints with peer-failure handling (the listener path)
        are closed forcefully: what is still under way is cancelled. Those without (the same-host path's data
        endpoints, which keep shared memory) first have the closing exchange: both sides send BYE as their
        last message, then take (and drop) whatever the other still sends until its BYE, so that every send
        under way completes and the (flushing) closes after it can too; a peer known to be dead is closed
        forcefully. After ``_RELEASE_WAIT`` seconds a phase gives up.
        (``close()`` is never called on an endpoint UCX already failed: ucxx crashes on that.)
        """
        driver = self._driver
        driver.busy = lambda: True
        self._send_bye()  # a dissoc peer learns it at once; any other peer drops an unknown tag
        with contextlib.suppress(Exception):
            driver.worker.cancel_inflight_requests(0, 1)  # receives posted for consumers now gone
        try:
            answered = True
            if self._exchange and not (self._peer_gone and not self._peer_bye):
                answered = await self._progress_until(self._exchange_done, "the closing exchange")
            # A peer that died, or did not answer within the wait, is closed forcefully: a flush towards it
            # would never complete.
            closing = self._close_endpoints(force=not answered or not endpoint_alive(self._bootstrap))
            if not await self._progress_until(
                lambda: all(_completed(r) for r in closing) and not driver.pending and self._am.reap(),
                "closing the endpoints",
            ):
                logger.debug(
                    "%s: %d of %d closes, %d other requests and %s arriving messages left",
                    self._description,
                    sum(not _completed(r) for r in closing),
                    len(closing),
                    len(driver.pending),
                    "some" if not self._am.reap() else "no",
                )
        finally:
            driver.close()
            self._am.abandon()
            self._ep = None
            self._raw_ep = None
            self._bootstrap = None
            self._worker = None

    def _exchange_done(self) -> bool:
        """Whether the peer has said BYE (or gone) and every send of ours completed."""
        self._discard_incoming()
        peer_done = self._peer_bye or not endpoint_alive(self._bootstrap)
        return peer_done and not self._driver.pending

    async def _progress_until(self, done: Callable[[], bool], what: str) -> bool:
        """Progress the worker until ``done()`` (True) or for at most ``_RELEASE_WAIT`` seconds (False)."""
        driver = self._driver
        deadline = self._loop.time() + _RELEASE_WAIT
        while True:
            driver.complete()
            if done():
                return True
            if self._loop.time() >= deadline:
                logger.debug("%s: %s did not complete in %s s", self._description, what, _RELEASE_WAIT)
                return False
            driver.kick()
            if not self._bootstrap_driver.closed:
                self._bootstrap_driver.kick()
            await asyncio.sleep(0.001)

    def _close_endpoints(self, force: bool = False) -> list[Any]:
        """Start closing both endpoints (dissoc's own forcefully with ``force``, or when the peer died);
        returns the close requests."""
        closing: list[Any] = []
        endpoints = [self._ep] if self._bootstrap is self._ep else [self._ep, self._bootstrap]
        dead = force or (self._peer_gone and not self._peer_bye)
        for endpoint in endpoints:
            request = None
            if isinstance(endpoint, RawEndpoint):
                # Failed or not, dissoc's own endpoint is closed: UCX releases a failed one only then.
                request = endpoint.close(force=True if dead or not endpoint.alive else None)
            elif endpoint_alive(endpoint):
                with contextlib.suppress(Exception):
                    request = endpoint.close()
            if request is not None:
                closing.append(request)
        return closing

    def _discard_incoming(self) -> None:
        """Take every tagged message that arrived and drop it (the connection is closed), noting the BYE."""
        for _ in range(MAX_ROUNDS):
            probed = self._tag_probe(self._worker_handle, 0, 0, True)
            if probed is None:
                return
            message, found, length = probed
            if found == BYE_TAG:
                self._peer_bye = True
            self._discard(message, length)

    async def _close_transport(self) -> None:
        if not self._closing and not self._closed:
            self._closing = True
            # Let outstanding sends complete first, so that what was sent before close() reaches the peer.
            under_way = self._sends_under_way()
            bye = self._send_bye()
            pending = [p.future for p in self._driver.pending if p.future is not None and not p.future.done()]
            pending += under_way
            if bye is not None:
                pending.append(bye)
            if pending and not self._peer_gone:
                await asyncio.wait(pending, timeout=_CLOSE_WAIT)
            self._teardown(self._error or TransportError(f"connection {self._description} was closed"))
        task = self._release_task
        if task is not None:
            await asyncio.shield(task)


def _retrieve(future: asyncio.Future[None]) -> None:
    """Mark a future's failure as seen (asyncio logs failures nobody retrieved)."""
    if not future.cancelled():
        future.exception()


def _completed(request: Any) -> bool:
    """Whether a ucxx request has completed (or cannot be asked)."""
    try:
        return bool(request.completed)
    except Exception:
        return True


def _sending(tagged: bool, tag: int) -> str:
    """What a send does, as its errors say."""
    return f"sending tagged message {tag:#018x}" if tagged else "sending an untagged message"


def _host_buffer(data: SendData) -> bytes | pa.Buffer | None:
    """The one host buffer ``data`` is (alone or in a one-item list) when it is ``bytes`` or a host
    ``pa.Buffer``, the messages a server sends; None for anything else (gathered, or device memory)."""
    item: Any = data
    kind = type(item)
    if kind is list or kind is tuple:
        if len(item) != 1:
            return None
        item = item[0]
        kind = type(item)
    if kind is bytes or (kind is pa.Buffer and item.is_cpu):
        return item
    return None


def _device_item(data: SendData) -> tuple[Any, int] | None:
    """(the device buffer, its size) when ``data`` is one device buffer (alone or in a one-item list)."""
    item = data[0] if isinstance(data, (list, tuple)) and len(data) == 1 else data
    size = device_nbytes(item)
    if size is None:
        if isinstance(data, (list, tuple)) and any(device_nbytes(d) is not None for d in data):
            raise TransportError("a message in device memory must be one buffer (gather it on the device)")
        return None
    return item, size


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
    if worker and not plausible_address(worker):
        # UCX asserts (aborts the process) on an address format it does not know: check before handing it over
        raise TransportError(
            f"ucx://{host}:{port}: the URI's 'worker' is not a UCX worker address of this UCX version "
            f"({len(worker)} bytes starting {worker[:8].hex()})"
        )
    use_address = bool(worker) and (path == "address" or (path == "auto" and _is_local_host(host)))
    lib = ucxx_lib()
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
        client_worker = lib.UCXWorker(ucx_context("default" if use_address else "listener"))
    except Exception as exc:
        raise TransportError(f"cannot connect to {where}: cannot create a UCX worker: {exc}") from exc
    driver = Driver(client_worker, loop, description)
    bootstrap: Any = None
    try:
        async with asyncio.timeout(timeout):
            if use_address:
                assert isinstance(worker, bytes)
                try:
                    bootstrap = client_worker.create_endpoint_from_worker_address(
                        lib.UCXAddress.create_from_buffer(worker), True
                    )
                except Exception as exc:
                    raise TransportError(f"cannot connect to {where}: {exc}") from exc
                hello = MAGIC + bytes(client_worker.address.tobytes())
                await send_tagged(driver, bootstrap, HELLO_TAG, hello, f"connecting to {where}")
                reply = await recv_tagged(driver, REPLY_TAG, f"connecting to {where}")
                server_address = parse_hello(reply, description)
                try:
                    endpoint = client_worker.create_endpoint_from_worker_address(
                        lib.UCXAddress.create_from_buffer(server_address), error_handling
                    )
                except Exception as exc:
                    raise TransportError(f"cannot connect to {where}: {exc}") from exc
            else:
                # The listener path, as the reference mapping has it: the server accepts the connection on a
                # worker of its own, and everything travels on this one endpoint (no handshake of dissoc's;
                # ucxx's peer information goes alongside, see below).
                try:
                    bootstrap = endpoint = lib.UCXEndpoint.create(client_worker, address, port, True)
                    # Connected (or refused) once a flush completes: report a failure here, not at the first
                    # receive.
                    request = flush(int(bootstrap.handle), f"connecting to {where}")
                except Exception as exc:
                    raise TransportError(f"cannot connect to {where}: {exc}") from exc
                await driver.wait(request, None, f"connecting to {where}")
            connection = UcxConnection(
                driver,
                endpoint,
                bootstrap,
                driver,
                description=description,
                max_message_bytes=max_message_bytes,
                max_buffered_bytes=max_buffered_bytes,
                allocator=allocator,
                # Only a data endpoint without peer-failure handling needs the closing exchange.
                closing_exchange=use_address and not error_handling,
            )
            if not use_address:
                # ucxx's asyncio listener sends its peer information first and calls its handler once ours
                # came back (want_data goes out without waiting for any of it)
                connection.exchange_peer_info(listener=False)
            return connection
    except TimeoutError as exc:
        driver.close()
        if bootstrap is not None:
            close_endpoint(bootstrap)
        raise TransportError(f"connecting to {where} timed out after {timeout} s") from exc
    except BaseException:
        driver.close()
        if bootstrap is not None:
            close_endpoint(bootstrap)
        raise
