"""libucp's per-message calls, as the UCX transport makes them: tag probe and receive, tagged and
active-message sends, request tests, and the active-message handler.

Each is one libucp call. Where the package's C module (:mod:`dissoc.transport.ucx._fast`, built when dissoc is
installed with a C compiler at hand) is there, the calls go through it: it takes its arguments straight from
Python ints and queues eager active messages itself, a few hundred nanoseconds a call less than ctypes, which
is most of the transport's own time per small message. Without it (or with ``DISSOC_UCX_NATIVE=0``) the same
calls go through ctypes, with the same arguments and results: :attr:`Calls.native` says which.

Arguments and results are plain ints: handles, addresses (a ``bytes`` object may stand for the address of its
own storage where a call sends data) and parameter structs by address. A returned pointer is 0 for NULL (an
operation UCX completed at once), a request, or an error status coded as a pointer
(:func:`~dissoc.transport.ucx.libucp.ptr_is_err`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import Any

from dissoc.transport.ucx.libucp import UCS_INPROGRESS, UcpTagRecvInfo, lib

__all__ = ["Calls", "calls", "native_module"]

logger = logging.getLogger(__name__)

#: The C module's interface version this package is written for (``_fast.ABI``).
NATIVE_ABI = 3

#: Every bit of a tag.
ALL = 0xFFFF_FFFF_FFFF_FFFF
#: ``fallback(worker, data, length, recv_attr)``: the Python side of the active-message handler.
AmFallback = Callable[[int, int, int, int], None]


def native_module() -> Any | None:
    """The C module when it is built, of the version expected and not turned off (``DISSOC_UCX_NATIVE=0``);
    else None."""
    if os.environ.get("DISSOC_UCX_NATIVE", "1").strip().lower() in ("0", "no", "false", "off"):
        return None
    try:
        from dissoc.transport.ucx import _fast
    except ImportError:
        return None
    if getattr(_fast, "ABI", None) != NATIVE_ABI:
        logger.warning(
            "dissoc.transport.ucx._fast is of another version (ABI %s, expected %s): reinstall dissoc to "
            "rebuild it; the UCX transport goes through ctypes meanwhile",
            getattr(_fast, "ABI", None),
            NATIVE_ABI,
        )
        return None
    return _fast


def _address(fn: Any) -> int:
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


class Calls:
    """The per-message calls (see the module's text), through the C module or through ctypes."""

    tag_probe: Callable[[int, int, int, bool], tuple[int, int, int] | None]
    #: ``tag_probe_take(worker, tag, mask, most)``: the oldest message matching, taken out of UCX when
    #: ``most < 0`` or its length is at most ``most``, else only looked at (then its message handle is 0).
    tag_probe_take: Callable[[int, int, int, int], tuple[int, int, int] | None]
    #: ``tag_take_run(worker, most, lander, done, param, stop_tag, max_length)``: unclaimed messages taken,
    #: landed and received in one call, until one is left to the caller (see ``_fast.c`` for the statuses).
    tag_take_run: Callable[
        [int, int, Callable[[int, int], tuple[object, int] | None], list[Any], int, int, int],
        tuple[int, int, int, int, object, int],
    ]
    tag_msg_recv: Callable[[int, int, int, int, int], int]
    tag_send: Callable[[int, int | bytes, int, int, int], int]
    am_send: Callable[[int, int, int | bytes, int, int | bytes, int, int], int]
    request_test: Callable[[int], int]

    def __init__(self, native: Any | None) -> None:
        ucp = lib()
        functions = (
            ucp.ucp_tag_probe_nb,
            ucp.ucp_tag_msg_recv_nbx,
            ucp.ucp_tag_send_nbx,
            ucp.ucp_am_send_nbx,
            ucp.ucp_request_check_status,
            ucp.ucp_request_free,
        )
        self._native = native
        self._am_handler = 0
        if native is not None:
            native.bind(*(_address(fn) for fn in functions))
            self.tag_probe = native.tag_probe
            self.tag_probe_take = native.tag_probe_take
            self.tag_take_run = native.tag_take_run
            self.tag_msg_recv = native.tag_msg_recv
            self.tag_send = native.tag_send
            self.am_send = native.am_send
            self.request_test = native.request_test
            return
        # The same functions with every pointer as c_void_p, so that they take ints.
        vp, u64, size = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
        status_t = ctypes.c_int8  # ucs_status_t: a packed enum
        probe = ctypes.CFUNCTYPE(vp, vp, u64, u64, ctypes.c_int, vp)(_address(functions[0]))
        recv = ctypes.CFUNCTYPE(vp, vp, vp, size, vp, vp)(_address(functions[1]))
        send = ctypes.CFUNCTYPE(vp, vp, vp, size, u64, vp)(_address(functions[2]))
        am = ctypes.CFUNCTYPE(vp, vp, ctypes.c_uint, vp, size, vp, size, vp)(_address(functions[3]))
        check_status = ctypes.CFUNCTYPE(status_t, vp)(_address(functions[4]))
        free = ctypes.CFUNCTYPE(None, vp)(_address(functions[5]))
        info = UcpTagRecvInfo()
        info_address = ctypes.addressof(info)
        self._keep = (probe, recv, send, am, check_status, free, info)

        def tag_probe(worker: int, tag: int, mask: int, remove: bool) -> tuple[int, int, int] | None:
            message = probe(worker, tag, mask, 1 if remove else 0, info_address)
            return None if not message else (message, info.sender_tag, info.length)

        def tag_probe_take(worker: int, tag: int, mask: int, most: int) -> tuple[int, int, int] | None:
            message = probe(worker, tag, mask, 1 if most < 0 else 0, info_address)
            if not message:
                return None
            found, length = info.sender_tag, info.length
            if most >= 0:
                message = probe(worker, found, ALL, 1, info_address) if length <= most else 0
            return message or 0, found, length

        def tag_take_run(
            worker: int,
            most: int,
            lander: Callable[[int, int], tuple[object, int] | None],
            done: list[Any],
            param: int,
            stop_tag: int,
            max_length: int,
        ) -> tuple[int, int, int, int, object, int]:
            taken = found = length = 0
            while True:
                probed = tag_probe_take(worker, 0, 0, most)
                if probed is None:
                    return 0, 0, found, length, None, taken
                message, found, length = probed
                if not message:  # (not admitted by most: looked at only)
                    caller = found == stop_tag or length > max_length
                    return 1 if caller else 0, 0, found, length, None, taken
                if found == stop_tag or length > max_length:
                    return 1, message, found, length, None, taken
                try:
                    placed = lander(found, length)
                except Exception as exc:
                    return 3, message, found, length, exc, taken
                if placed is None:
                    return 1, message, found, length, None, taken
                payload, address = placed
                request = recv(worker, address, length, message, param) or 0
                if request:
                    error = request % (1 << 64) >= (-100) % (1 << 64)  # UCS_PTR_IS_ERR
                    return 4 if error else 2, request, found, length, payload, taken
                done.append((found, payload, length))
                taken += length
                if most >= 0:
                    most -= length

        def tag_msg_recv(worker: int, address: int, length: int, message: int, param: int) -> int:
            return recv(worker, address, length, message, param) or 0

        def tag_send(ep: int, data: int | bytes, length: int, tag: int, param: int) -> int:
            if not ep:
                raise ValueError("tag_send(): the endpoint is NULL")
            return send(ep, data, length, tag, param) or 0

        def am_send(
            ep: int,
            am_id: int,
            header: int | bytes,
            header_length: int,
            data: int | bytes,
            length: int,
            param: int,
        ) -> int:
            if not ep:
                raise ValueError("am_send(): the endpoint is NULL")
            return am(ep, am_id, header, header_length, data, length, param) or 0

        def request_test(request: int) -> int:
            if not request:
                raise ValueError("request_test(): the request is NULL")
            status = int(check_status(request))
            if status != UCS_INPROGRESS:
                free(request)
            return status

        self.tag_probe = tag_probe
        self.tag_probe_take = tag_probe_take
        self.tag_take_run = tag_take_run
        self.tag_msg_recv = tag_msg_recv
        self.tag_send = tag_send
        self.am_send = am_send
        self.request_test = request_test

    @property
    def native(self) -> bool:
        """Whether the calls go through the C module."""
        return self._native is not None

    def am_handler(self, queues: dict[int, tuple[Callable[[bytes], None], int]], fallback: AmFallback) -> int:
        """The address of the C active-message handler, which queues each eager message of at most ``max``
        bytes for a worker in ``queues`` (``worker -> (append, max)``) as bytes and hands every other message
        to ``fallback``; 0 without the C module (the caller registers a ctypes callback instead). Set up once
        per process: ``queues`` and ``fallback`` are kept for good, since UCX may call the handler until each
        worker is destroyed."""
        if self._native is None:
            return 0
        if not self._am_handler:
            self._am_handler = int(self._native.am_setup(queues, fallback))
        return self._am_handler


_calls: Calls | None = None


def calls() -> Calls:
    """The process's :class:`Calls` (libucp is loaded by the first call)."""
    global _calls
    made = _calls
    if made is None:
        made = _calls = Calls(native_module())
        logger.debug("libucp's per-message calls go through %s", "the C module" if made.native else "ctypes")
    return made
