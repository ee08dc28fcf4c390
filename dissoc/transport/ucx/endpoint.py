"""Endpoints dissoc makes through libucp itself: those of connections accepted on a worker of their own.

ucxx can accept a listener's connection request only on the listener's worker, and a tag receive on a shared
worker does not say which endpoint sent the message; the reference example answers both by creating a worker
per connection when it is accepted. :class:`RawEndpoint` is such a connection's endpoint
(``ucp_ep_create`` with the request, on the new worker), with the small part of ucxx's endpoint interface
:class:`~dissoc.transport.ucx.connection.UcxConnection` uses: ``tag_send``, ``am_send``, ``close``,
``alive`` and a close callback. Its requests (:class:`RawRequest`) are polled, like ucxx's.

Active messages carry ucxx's header (host memory, no receiver callback: 14 bytes) and ask for a reply
endpoint, so that peers receiving with ucxx match them to their endpoint; the reference example's own
receiver ignores the header.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import struct
from collections.abc import Callable
from typing import Any

from dissoc.errors import TransportError
from dissoc.transport.ucx.am import AM_ID
from dissoc.transport.ucx.calls import calls
from dissoc.transport.ucx.libucp import (
    ERR_CALLBACK,
    UCP_AM_SEND_FLAG_REPLY,
    UCP_EP_CLOSE_FLAG_FORCE,
    UCP_EP_PARAM_FIELD_CONN_REQUEST,
    UCP_EP_PARAM_FIELD_ERR_HANDLER,
    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
    UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
    UCP_ERR_HANDLING_MODE_NONE,
    UCP_ERR_HANDLING_MODE_PEER,
    UCP_OP_ATTR_FIELD_FLAGS,
    UCS_ERR_CANCELED,
    UCS_INPROGRESS,
    UCS_OK,
    UcpEpParams,
    UcpRequestParam,
    check,
    lib,
    ptr_is_err,
    ptr_status,
    status_string,
)

__all__ = ["COMPLETED", "UCXX_AM_HEADER", "RawEndpoint", "RawRequest", "flush", "stream_send"]

logger = logging.getLogger(__name__)

#: ucxx's active-message header for host memory: memory type (i32, UCS_MEMORY_TYPE_HOST = 0), no receiver
#: callback (bool), memory-type policy (u8, fall back to host), user header size (u64, 0).
UCXX_AM_HEADER = struct.pack("<i?BQ", 0, False, 0, 0)
_HEADER_LEN = len(UCXX_AM_HEADER)


def _request_param(flags: int = 0) -> UcpRequestParam:
    param = UcpRequestParam()
    if flags:
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS
        param.flags = flags
    return param


# Request parameters, made once (UCX only reads them): no flags; an active message asking for a reply
# endpoint; a forced close.
_PLAIN = _request_param()
_AM_REPLY = _request_param(UCP_AM_SEND_FLAG_REPLY)
_FORCE = _request_param(UCP_EP_CLOSE_FLAG_FORCE)
_PLAIN_ADDRESS = ctypes.addressof(_PLAIN)
_AM_REPLY_ADDRESS = ctypes.addressof(_AM_REPLY)

#: Live endpoints by the id their error handler is given.
_ENDPOINTS: dict[int, RawEndpoint] = {}
_IDS = itertools.count(1)


class RawRequest:
    """A libucp send or close request, polled: ``completed``, then ``check_error()`` (ucxx's interface).

    ``keep`` (the buffer being sent) is held until the request completes. ``what`` names the operation in
    the error, followed by ``tag`` in hex when one is given (the text is only made if the request fails).
    """

    __slots__ = ("_keep", "_ptr", "_status", "_tag", "_what")

    def __init__(self, ptr: int | None, keep: object, what: str, tag: int | None = None) -> None:
        self._what = what
        self._tag = tag
        if not ptr:  # completed at once (most small sends)
            self._ptr: int | None = None
            self._status = UCS_OK
            self._keep: object = None
        elif ptr_is_err(ptr):
            self._ptr = None
            self._status = ptr_status(ptr)
            self._keep = None
        else:
            self._ptr = ptr
            self._status = UCS_INPROGRESS
            self._keep = keep

    @property
    def completed(self) -> bool:
        """Whether UCX has completed the request (it is then freed)."""
        if self._status == UCS_INPROGRESS and self._ptr is not None:
            status = calls().request_test(self._ptr)  # (frees it once it is no longer in progress)
            if status != UCS_INPROGRESS:
                self._ptr = None
                self._status = status
                self._keep = None
        return self._status != UCS_INPROGRESS

    @property
    def status(self) -> int:
        """UCX's status of the request as last seen (``UCS_INPROGRESS`` until :attr:`completed` is True)."""
        return self._status

    def orphan(self) -> object:
        """Forget the request for good (its worker is about to go, and UCX with it); returns what it kept
        alive, which UCX may still read until the worker is destroyed."""
        keep, self._keep, self._ptr = self._keep, None, None
        if self._status == UCS_INPROGRESS:
            self._status = UCS_ERR_CANCELED
        return keep

    def check_error(self) -> None:
        """Raise TransportError when the request failed."""
        if self._status not in (UCS_OK, UCS_INPROGRESS):
            what = self._what if self._tag is None else f"{self._what} {self._tag:#018x}"
            raise TransportError(f"{what}: {status_string(self._status)}")


#: The request of every operation UCX completed at once (most small sends, eager messages received whole):
#: nothing to poll or keep.
COMPLETED = RawRequest(None, None, "")


def _on_error(arg: int | None, ep: int | None, status: int) -> None:
    del ep
    try:
        endpoint = _ENDPOINTS.get(arg or 0)
        if endpoint is not None:
            endpoint.failed(int(status))
    except BaseException:  # never let an exception unwind through UCX
        logger.exception("handling a UCX endpoint error failed")


_ERR_CALLBACK = ERR_CALLBACK(_on_error)
# Never freed, not even when the interpreter exits: UCX may call it while ucxx destroys a worker then.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_ERR_CALLBACK))


class RawEndpoint:
    """An endpoint on ``worker`` (a ``ucp_worker_h``): of a connection accepted from ``conn_request``, or to a
    peer worker's ``address``. ``error_handling``: UCX peer-failure handling (on for accepted connections,
    which go over TCP anyway; off for same-host worker-address endpoints, which it would keep off shared
    memory)."""

    def __init__(
        self,
        worker: int,
        description: str,
        *,
        conn_request: int | None = None,
        address: bytes | None = None,
        error_handling: bool = True,
    ) -> None:
        self._id = next(_IDS)
        self._description = description
        # The beginnings of a failed send's error (RawRequest adds the tag).
        self._tag_what = f"{description}: sending tagged message"
        self._am_what = f"{description}: sending an active message"
        self._status = UCS_INPROGRESS
        self._closing = False
        self._error_handling = error_handling
        self._close_callback: Callable[..., object] | None = None
        params = UcpEpParams()
        params.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER
        keep: object = None
        if conn_request is not None:
            params.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST
            params.conn_request = conn_request
        elif address is not None:
            keep = ctypes.create_string_buffer(address, len(address))
            params.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            params.address = ctypes.addressof(keep)
        else:
            raise TransportError(f"{description}: an endpoint needs a connection request or a worker address")
        params.err_mode = UCP_ERR_HANDLING_MODE_PEER if error_handling else UCP_ERR_HANDLING_MODE_NONE
        params.err_handler.cb = ctypes.cast(_ERR_CALLBACK, ctypes.c_void_p).value
        params.err_handler.arg = self._id
        handle = ctypes.c_void_p()
        _ENDPOINTS[self._id] = self
        try:
            check(lib().ucp_ep_create(worker, ctypes.byref(params), ctypes.byref(handle)), "ucp_ep_create")
        except TransportError:
            del _ENDPOINTS[self._id]
            raise
        del keep
        self._ep: int | None = int(handle.value or 0)

    @property
    def handle(self) -> int:
        """The ``ucp_ep_h`` (0 once closed), as ucxx's endpoints have it."""
        return self._ep or 0

    @property
    def alive(self) -> bool:
        """False once UCX reported the peer's failure or the endpoint was closed."""
        return self._status == UCS_INPROGRESS and not self._closing

    def failed(self, status: int) -> None:
        """The error handler's work (inside the worker's progress): note it, tell the close callback."""
        if self._status != UCS_INPROGRESS:
            return
        self._status = status
        logger.debug("%s: UCX reported %s", self._description, status_string(status))
        callback, self._close_callback = self._close_callback, None
        if callback is not None:
            callback()

    def set_close_callback(self, callback: Callable[..., object]) -> None:
        """Call ``callback()`` when UCX reports that the peer closed or failed."""
        self._close_callback = callback

    def remove_close_callback(self) -> None:
        """Forget the close callback."""
        self._close_callback = None

    def _usable(self, what: str) -> int:
        if self._ep is None or self._closing:
            raise TransportError(f"{self._description}: {what}: the endpoint is closed")
        if self._status != UCS_INPROGRESS:
            raise TransportError(f"{self._description}: {what}: {status_string(self._status)}")
        return self._ep

    def tag_send(self, array: Any, tag: Any) -> RawRequest:
        """Send ``array`` (ucxx's ``Array``: ``ptr``, ``nbytes``) tagged ``tag`` (ucxx's ``UCXXTag``, or an
        int)."""
        return self.tag_send_buffer(
            array.ptr, array.nbytes, tag if type(tag) is int else int(tag.value), array
        )

    def tag_send_buffer(self, ptr: int | bytes, nbytes: int, tag: int, keep: object) -> RawRequest:
        """Send ``nbytes`` at ``ptr`` (an address, or a ``bytes`` object) tagged ``tag``; ``keep`` is held
        until UCX is done with the memory."""
        ep = self._ep
        if ep is None or self._closing or self._status != UCS_INPROGRESS:
            ep = self._usable(f"sending tagged message {tag:#018x}")
        request = calls().tag_send(ep, ptr, nbytes, tag, _PLAIN_ADDRESS)
        return RawRequest(request, keep, self._tag_what, tag) if request else COMPLETED

    def am_send(self, array: Any) -> RawRequest:
        """Send ``array`` as an active message (id 0, ucxx's header, reply endpoint asked for)."""
        return self.am_send_buffer(array.ptr, array.nbytes, array)

    def am_send_buffer(self, ptr: int | bytes, nbytes: int, keep: object) -> RawRequest:
        """Send ``nbytes`` at ``ptr`` (an address, or a ``bytes`` object) as an active message (see
        :meth:`am_send`); ``keep`` is held until UCX is done with the memory."""
        ep = self._ep
        if ep is None or self._closing or self._status != UCS_INPROGRESS:
            ep = self._usable("sending an active message")
        request = calls().am_send(ep, AM_ID, UCXX_AM_HEADER, _HEADER_LEN, ptr, nbytes, _AM_REPLY_ADDRESS)
        return RawRequest(request, keep, self._am_what) if request else COMPLETED

    def close(self, force: bool | None = None) -> RawRequest | None:
        """Close the endpoint; None if already closed.

        Forcefully (outstanding sends are cancelled, nothing waits for the peer) when ``force`` says so,
        by default with peer-failure handling on. A peer known to be dead is closed forcefully whatever the
        mode: a flush towards it would never complete, and its request would hold the worker for good.
        """
        if self._ep is None or self._closing:
            return None
        self._closing = True
        self._close_callback = None
        ep, self._ep = self._ep, None
        _ENDPOINTS.pop(self._id, None)
        forced = self._error_handling if force is None else force
        ptr = lib().ucp_ep_close_nbx(ep, ctypes.byref(_FORCE if forced else _PLAIN))
        return RawRequest(ptr, None, f"{self._description}: closing the endpoint")


def flush(ep: int, what: str) -> RawRequest:
    """Flush endpoint ``ep`` (a ``ucp_ep_h``, e.g. ucxx's ``UCXEndpoint.handle``): the request completes once
    what was sent has arrived and, on a new client endpoint, once the connection is set up (or failed)."""
    return RawRequest(lib().ucp_ep_flush_nbx(ep, ctypes.byref(_PLAIN)), None, what)


def stream_send(ep: int, data: bytes, what: str) -> RawRequest:
    """Send ``data`` on endpoint ``ep``'s stream (UCX's stream API); the request holds ``data`` until UCX is
    done with it."""
    return RawRequest(lib().ucp_stream_send_nbx(ep, data, len(data), ctypes.byref(_PLAIN)), data, what)
