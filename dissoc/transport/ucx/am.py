"""Receiving a connection worker's active messages into dissoc's own buffers, through libucp's AM API.

ucxx receives active messages into per-worker queues: messages nobody asked for yet, and receives posted
before their message came. Each entry refers to the endpoint and worker it belongs to, and the worker holds
the queues, so one entry left over (a receive still posted when the stream ended or the peer vanished, a
message the owner never read) keeps the whole worker alive, with its sockets, event descriptors and
shared-memory segments, for the rest of the process: about a dozen fds and 5 MiB per connection.

:class:`AmReceiver` takes over active-message id 0 (the one ucxx's ``am_send`` uses; the sender's ucxx
header, if any, is ignored) on a worker that belongs to one connection: an eager message is copied out while
UCX hands it over, a rendezvous one is fetched into a buffer allocated here (``ucp_am_recv_data_nbx``), and
every message is kept in arrival order until the connection takes it. Nothing refers back to the worker, so
it goes when its connection lets go of it.

The handler runs inside the worker's progress call (the event loop's thread) and only queues; the size
limit is checked before anything is allocated. Where the C module is built
(:mod:`~dissoc.transport.ucx.calls`) the handler is its own: an eager message within the limit is queued as
bytes with no Python call; everything else (rendezvous messages, oversized ones, a receiver gone) comes to
:func:`_fallback`, as every message does through the ctypes handler.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from dissoc.errors import DissocError, TransportError
from dissoc.transport.base import MessageTooLargeError
from dissoc.transport.ucx.calls import calls
from dissoc.transport.ucx.libucp import (
    AM_RECV_CALLBACK,
    UCP_AM_FLAG_WHOLE_MSG,
    UCP_AM_HANDLER_PARAM_FIELD_ARG,
    UCP_AM_HANDLER_PARAM_FIELD_CB,
    UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
    UCP_AM_HANDLER_PARAM_FIELD_ID,
    UCP_AM_RECV_ATTR_FLAG_RNDV,
    UCS_INPROGRESS,
    UCS_OK,
    UcpAmHandlerParam,
    UcpAmRecvParam,
    UcpRequestParam,
    check,
    lib,
    ptr_is_err,
    ptr_is_ptr,
    ptr_status,
    status_string,
)

__all__ = ["AM_ID", "AmReceiver"]

logger = logging.getLogger(__name__)

#: The active-message id data messages travel under (ucxx's, and the reference example's default).
AM_ID = 0
#: Messages up to this size are handed out as ``bytes`` (larger ones as a memoryview, no copy).
SMALL_MESSAGE = 64 * 1024

#: Live receivers by worker handle (the handler's ``arg``): a message for a worker whose receiver closed is
#: dropped (a rendezvous one released) instead of reaching freed state.
_RECEIVERS: dict[int, AmReceiver] = {}
#: Rendezvous receives that were cancelled but had not finished when their receiver let go: their buffers
#: stay referenced, since UCX may still write into them until the worker is destroyed.
_ABANDONED: list[object] = []


class _Message:
    """One received (or still arriving) active message."""

    __slots__ = ("buffer", "length", "request")

    def __init__(self, buffer: Any, length: int, request: int | None) -> None:
        self.buffer = buffer
        self.length = length
        self.request = request


def _fallback(worker: int, data: int | None, length: int, attr: int) -> None:
    """What the handler does not queue itself (a rendezvous message, one too large, one for a receiver that
    closed): the receiver's :meth:`AmReceiver.arrived`, or dropped (a rendezvous one released)."""
    try:
        receiver = _RECEIVERS.get(worker)
        if receiver is None:
            if attr & UCP_AM_RECV_ATTR_FLAG_RNDV:
                lib().ucp_am_data_release(worker, data)
            return
        receiver.arrived(data, length, attr)
    except BaseException:  # never let an exception unwind through UCX
        logger.exception("receiving an active message failed")


def _handle_message(
    arg: int | None, header: int | None, header_length: int, data: int | None, length: int, param: Any
) -> int:
    """The handler through ctypes (without the C module): everything goes to the receiver."""
    del header, header_length
    try:
        attr = int(param[0].recv_attr)
    except BaseException:  # never let an exception unwind through UCX
        logger.exception("receiving an active message failed")
        return UCS_OK
    _fallback(arg or 0, data, length, attr)  # (which lets nothing unwind either)
    return UCS_OK


#: Eager messages the C handler queues itself (dissoc.transport.ucx.calls): worker -> (append, max bytes).
_QUEUES: dict[int, tuple[Callable[[bytes], None], int]] = {}

# One C callback for the process, never freed: a worker may call it until the worker itself is destroyed.
_CALLBACK = AM_RECV_CALLBACK(_handle_message)
# Never freed, not even when the interpreter exits: UCX may call it while ucxx destroys a worker then.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_CALLBACK))
# Reference the parameter struct's type so that ctypes has resolved it before the first call.
_ = UcpAmRecvParam


def _handler() -> Any:
    """The handler to register: the C module's (eager messages queued without Python), else the ctypes one."""
    address = calls().am_handler(_QUEUES, _fallback)
    return AM_RECV_CALLBACK(address) if address else _CALLBACK


class AmReceiver:
    """The active messages of one worker (that serves one connection), in arrival order.

    ``worker`` is the ``ucp_worker_h`` (ucxx's ``UCXWorker.handle``). Messages larger than
    ``max_message_bytes`` are refused before anything is allocated: :attr:`error` is set and the message is
    dropped. The owner calls :meth:`ready` / :meth:`pop` after each progress call, and :meth:`close` when
    the connection goes.
    """

    def __init__(self, worker: int, max_message_bytes: int, description: str) -> None:
        self._worker = worker
        self._max = max_message_bytes
        self._description = description
        #: Arrival order: eager messages as bytes (queued by the C handler, or by arrived()), rendezvous ones
        #: as a _Message until they have arrived (see ready/pop). The connection takes leading bytes directly.
        self.queue: deque[bytes | _Message] = deque()
        self._cancelled: list[_Message] = []
        #: The first failure (an oversized message, a receive UCX failed); the owner tears down on it.
        self.error: DissocError | None = None
        self.closed = False
        params = UcpAmHandlerParam()
        params.field_mask = (
            UCP_AM_HANDLER_PARAM_FIELD_ID
            | UCP_AM_HANDLER_PARAM_FIELD_FLAGS
            | UCP_AM_HANDLER_PARAM_FIELD_CB
            | UCP_AM_HANDLER_PARAM_FIELD_ARG
        )
        params.id = AM_ID
        params.flags = UCP_AM_FLAG_WHOLE_MSG
        params.cb = _handler()
        params.arg = worker
        _RECEIVERS[worker] = self
        _QUEUES[worker] = (self.queue.append, max_message_bytes)
        try:
            check(
                lib().ucp_worker_set_am_recv_handler(worker, ctypes.byref(params)), "setting the AM handler"
            )
        except TransportError:
            _RECEIVERS.pop(worker, None)
            _QUEUES.pop(worker, None)
            raise

    def arrived(self, data: int | None, length: int, attr: int) -> int:
        """The handler's work for this worker (inside its progress call) where the C handler does not do it:
        queue one message."""
        rendezvous = bool(attr & UCP_AM_RECV_ATTR_FLAG_RNDV)
        if self.closed or self.error is not None or length > self._max:
            if length > self._max and self.error is None and not self.closed:
                self.error = MessageTooLargeError(
                    f"{self._description}: the peer sent an untagged message of {length} bytes; the limit "
                    f"(max_message_bytes) is {self._max}"
                )
                _QUEUES.pop(self._worker, None)  # (nothing more is queued)
            if rendezvous:
                lib().ucp_am_data_release(self._worker, data)
            return UCS_OK
        if not rendezvous:
            self.queue.append(ctypes.string_at(data or 0, length) if length else b"")
            return UCS_OK
        buffer = np.empty(max(1, length), dtype=np.uint8)
        param = UcpRequestParam()
        ptr: int | None = lib().ucp_am_recv_data_nbx(
            self._worker, data, buffer.ctypes.data, length, ctypes.byref(param)
        )
        if ptr_is_err(ptr):
            self.error = TransportError(
                f"{self._description}: receiving an untagged message of {length} bytes failed: "
                f"{status_string(ptr_status(ptr))}"
            )
            return UCS_OK
        self.queue.append(_Message(buffer, length, ptr if ptr_is_ptr(ptr) else None))
        return UCS_OK

    def _finished(self, message: _Message) -> bool:
        """Whether ``message`` has fully arrived (its request is then freed); a failure sets :attr:`error`."""
        request = message.request
        if request is None:
            return True
        status = int(lib().ucp_request_check_status(request))
        if status == UCS_INPROGRESS:
            return False
        lib().ucp_request_free(request)
        message.request = None
        if status != UCS_OK and self.error is None and not self.closed:
            self.error = TransportError(
                f"{self._description}: receiving an untagged message of {message.length} bytes failed: "
                f"{status_string(status)}"
            )
        return True

    def ready(self) -> int | None:
        """The length of the oldest message if it has fully arrived, else None."""
        if not self.queue:
            return None
        head = self.queue[0]
        if type(head) is bytes:  # (an eager message, copied out as it arrived)
            return len(head)
        assert isinstance(head, _Message)
        return head.length if self._finished(head) else None

    def pop(self) -> bytes | memoryview:
        """Take the oldest message (after :meth:`ready` said it has arrived)."""
        message = self.queue.popleft()
        if type(message) is bytes:
            return message
        assert isinstance(message, _Message)
        buffer = message.buffer
        view = memoryview(buffer)[: message.length]
        return bytes(view) if message.length <= SMALL_MESSAGE else view

    @property
    def busy(self) -> bool:
        """Whether messages are queued or still arriving."""
        return bool(self.queue)

    def close(self) -> None:
        """Stop receiving (later messages are dropped) and cancel the receives still under way."""
        if self.closed:
            return
        self.closed = True
        if _RECEIVERS.get(self._worker) is self:
            del _RECEIVERS[self._worker]
            _QUEUES.pop(self._worker, None)
        for message in self.queue:
            if type(message) is _Message and message.request is not None:
                lib().ucp_request_cancel(self._worker, message.request)
                self._cancelled.append(message)
        self.queue.clear()

    def reap(self) -> bool:
        """Free the cancelled receives that have finished (call between progress calls); True when none is
        left."""
        self._cancelled = [m for m in self._cancelled if not self._finished(m)]
        return not self._cancelled

    def abandon(self) -> None:
        """Let go for good: buffers of receives UCX has not finished stay referenced (module-level)."""
        if not self.reap():
            _ABANDONED.extend(m.buffer for m in self._cancelled)
            self._cancelled = []
