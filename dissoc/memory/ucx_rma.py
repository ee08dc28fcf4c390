"""A small ctypes binding for UCX one-sided reads (RMA GET) through libucp's C API.

ucxx's Python API has no RMA, so this module binds the few libucp calls needed for a server to register a
memory arena and publish a packed remote key, and for a client to unpack that key on its endpoint and read
ranges of the arena straight into its own buffers::

    with RmaContext() as server, RmaContext() as client:
        reg = server.register(arena)                    # ucp_mem_map + ucp_rkey_pack
        ep = client.connect(server.worker_address())    # ucp_ep_create by worker address
        rkey = ep.unpack(reg.rkey, reg.address, reg.length)
        rkey.get(reg.address + offset, dest)            # ucp_get_nbx, polled with ucp_worker_progress

Design notes:

* Each :class:`RmaContext` owns its own ``ucp_context_h`` (``UCP_FEATURE_RMA``) and one ``ucp_worker_h``
  (``UCS_THREAD_MODE_SERIALIZED``, every call made under the context's lock), created through libucp
  directly rather than taken from ucxx objects. ucxx *does* expose the raw handles (``UCXContext.handle``,
  ``UCXWorker.handle``, ``UCXEndpoint.handle`` are integer ``ucp_*_h`` pointers), but sharing a worker with
  ucxx would mean sharing its progress discipline (ucxx may progress the worker from its own thread) and
  relying on the context having been created with ``UCP_FEATURE_RMA``; a private context avoids both.
* Endpoints are created from a worker address with error handling off, which lets UCX pick shared-memory
  transports (``cma`` for zero-copy GET of user memory on one host).
* UCX does not check that a GET stays inside the registered region (with ``cma`` it reads any mapped address
  of the target process, and fails only on unmapped ones), so :class:`RemoteKey` checks ranges itself when
  it is given the region's address and length.
* libucp is loaded lazily, on the first :class:`RmaContext`: importing this module loads nothing. The binding
  itself (constants, structs, functions) is :mod:`dissoc.transport.ucx.libucp`, shared with the UCX transport.
* A GET that times out is cancelled; UCX may not finish the cancellation (an emulated GET whose target never
  progresses), in which case the request and its destination buffer stay referenced until it completes or
  the context closes, so UCX never writes into freed memory.

Every UCX failure raises :class:`dissoc.errors.TransportError` carrying ``ucs_status_string``'s message.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from dissoc.errors import TransportError
from dissoc.transport.ucx.libucp import (
    UCP_API_MAJOR,
    UCP_API_MINOR,
    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
    UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
    UCP_ERR_HANDLING_MODE_NONE,
    UCP_FEATURE_RMA,
    UCP_MEM_MAP_PARAM_FIELD_ADDRESS,
    UCP_MEM_MAP_PARAM_FIELD_LENGTH,
    UCP_MEM_MAP_PARAM_FIELD_PROT,
    UCP_MEM_MAP_PROT_LOCAL_READ,
    UCP_MEM_MAP_PROT_REMOTE_READ,
    UCP_OP_ATTR_FIELD_FLAGS,
    UCP_PARAM_FIELD_FEATURES,
    UCP_WORKER_PARAM_FIELD_THREAD_MODE,
    UCS_INPROGRESS,
    UCS_OK,
    UCS_THREAD_MODE_SERIALIZED,
    UcpEpParams,
    UcpMemMapParams,
    UcpParams,
    UcpRequestParam,
    UcpWorkerParams,
    libucp_path,
    ptr_is_err,
    ptr_status,
)
from dissoc.transport.ucx.libucp import check as _check
from dissoc.transport.ucx.libucp import lib as _lib

__all__ = [
    "GetRequest",
    "Registration",
    "RemoteKey",
    "RmaContext",
    "RmaEndpoint",
    "libucp_path",
    "wait_all",
]

DEFAULT_TIMEOUT_S = 30.0
CANCEL_GRACE_S = 1.0
# requests that neither completed nor cancelled in time, with their context and the buffers they may still
# write into; reaped (freed) once they complete, dropped when their context's worker is destroyed
_ABANDONED: list[tuple[RmaContext, int, object]] = []

# ---------------------------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------------------------


def _buffer_address(buffer: Any, *, writable: bool) -> tuple[memoryview, int, int]:
    """(byte view, address, length) of a C-contiguous buffer; the view keeps the exporter pinned."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        view.release()
        raise ValueError("buffer must be C-contiguous")
    flat = view.cast("B") if (view.ndim != 1 or view.format != "B") else view
    if writable and flat.readonly:
        raise ValueError("destination buffer must be writable")
    length = flat.nbytes
    if length == 0:
        return flat, 0, 0
    if flat.readonly:
        # ctypes cannot take the address of a read-only buffer; numpy can, without copying
        import numpy as np

        address = int(np.frombuffer(flat, dtype=np.uint8).ctypes.data)
    else:
        address = ctypes.addressof(ctypes.c_char.from_buffer(flat))
    return flat, address, length


# ---------------------------------------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------------------------------------


class _Closable:
    _closed: bool

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def _ensure_open(self) -> None:
        if self._closed:
            raise TransportError(f"{type(self).__name__} is closed")


class RmaContext(_Closable):
    """A private UCP context (RMA feature) with one worker; owns endpoints and registrations made from it.

    Calls on the worker are serialized by :attr:`lock`, so one thread may run :meth:`progress` (or
    :meth:`start_progress_thread`) while another issues GETs.
    """

    def __init__(self) -> None:
        self._closed = True
        self._lib = _lib()
        self.lock = threading.RLock()
        self._endpoints: list[RmaEndpoint] = []
        self._registrations: list[Registration] = []
        # GETs started and not yet waited for: referenced here so a dropped GetRequest keeps its buffer alive
        self._inflight: set[GetRequest] = set()
        self._progress_thread: threading.Thread | None = None
        self._progress_stop = threading.Event()

        params = UcpParams(field_mask=UCP_PARAM_FIELD_FEATURES, features=UCP_FEATURE_RMA)
        context = ctypes.c_void_p()
        _check(
            self._lib.ucp_init_version(
                UCP_API_MAJOR, UCP_API_MINOR, ctypes.byref(params), None, ctypes.byref(context)
            ),
            "ucp_init",
        )
        self._context: int = int(context.value or 0)
        wparams = UcpWorkerParams(
            field_mask=UCP_WORKER_PARAM_FIELD_THREAD_MODE, thread_mode=UCS_THREAD_MODE_SERIALIZED
        )
        worker = ctypes.c_void_p()
        status = self._lib.ucp_worker_create(self._context, ctypes.byref(wparams), ctypes.byref(worker))
        if status != UCS_OK:
            self._lib.ucp_cleanup(self._context)
            _check(status, "ucp_worker_create")
        self._worker: int = int(worker.value or 0)
        self._closed = False

    def worker_address(self) -> bytes:
        """This worker's UCX address, for a peer's :meth:`connect`."""
        self._ensure_open()
        address = ctypes.c_void_p()
        length = ctypes.c_size_t()
        with self.lock:
            _check(
                self._lib.ucp_worker_get_address(self._worker, ctypes.byref(address), ctypes.byref(length)),
                "ucp_worker_get_address",
            )
            try:
                return ctypes.string_at(address.value or 0, length.value)
            finally:
                self._lib.ucp_worker_release_address(self._worker, address)

    def progress(self) -> int:
        """One ``ucp_worker_progress`` call; returns how many events it processed."""
        self._ensure_open()
        with self.lock:
            n = int(self._lib.ucp_worker_progress(self._worker))
        if _ABANDONED:
            self._reap()
        return n

    def start_progress_thread(self, idle_sleep_s: float = 0.001) -> None:
        """Progress the worker from a daemon thread until :meth:`close` (for protocols needing the target)."""
        self._ensure_open()
        if self._progress_thread is not None:
            return

        def run() -> None:
            while not self._progress_stop.is_set():
                with self.lock:
                    if self._closed:
                        return
                    n = self._lib.ucp_worker_progress(self._worker)
                if n == 0:
                    self._progress_stop.wait(idle_sleep_s)

        self._progress_stop.clear()
        self._progress_thread = threading.Thread(target=run, name="ucx-rma-progress", daemon=True)
        self._progress_thread.start()

    def _wait(self, request: int | None, what: str, timeout: float | None, keep: object = None) -> None:
        """Drive one returned ``ucs_status_ptr_t`` to completion, free it, raise on error.

        On timeout the request is cancelled; if even the cancellation does not complete within
        :data:`CANCEL_GRACE_S`, the request and ``keep`` (the buffer it writes into) are parked forever in
        :data:`_ABANDONED` so that UCX never writes into freed memory.
        """
        if request is None:
            return
        if ptr_is_err(request):
            _check(ptr_status(request), what)
        status = self._poll(request, timeout)
        if status == UCS_INPROGRESS:
            with self.lock:
                self._lib.ucp_request_cancel(self._worker, request)
            if self._poll(request, CANCEL_GRACE_S) == UCS_INPROGRESS:
                _ABANDONED.append((self, request, keep))
            raise TransportError(f"{what} timed out after {timeout} s")
        _check(status, what)

    def _poll(self, request: int, timeout: float | None) -> int:
        """Progress until ``request`` completes (then free it) or ``timeout`` passes; the final status."""
        if _ABANDONED:
            self._reap()
        deadline = None if timeout is None else time.monotonic() + timeout
        lib = self._lib
        spins = 0
        while True:
            with self.lock:
                status = int(lib.ucp_request_check_status(request))
                if status != UCS_INPROGRESS:
                    lib.ucp_request_free(request)
                    return status
                lib.ucp_worker_progress(self._worker)
            spins += 1
            if deadline is not None and spins % 64 == 0 and time.monotonic() > deadline:
                return UCS_INPROGRESS

    def _reap(self) -> None:
        """Free this context's abandoned requests that have completed since."""
        with self.lock:
            for entry in [e for e in _ABANDONED if e[0] is self]:
                if self._closed:
                    _ABANDONED.remove(entry)
                elif self._lib.ucp_request_check_status(entry[1]) != UCS_INPROGRESS:
                    self._lib.ucp_request_free(entry[1])
                    _ABANDONED.remove(entry)

    def connect(self, remote_address: bytes) -> RmaEndpoint:
        """An endpoint to the worker whose :meth:`worker_address` is ``remote_address``."""
        self._ensure_open()
        if not remote_address:
            raise TransportError("empty UCX worker address")
        address_buf = ctypes.create_string_buffer(bytes(remote_address), len(remote_address))
        params = UcpEpParams(
            field_mask=UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
            address=ctypes.addressof(address_buf),
            err_mode=UCP_ERR_HANDLING_MODE_NONE,
        )
        ep = ctypes.c_void_p()
        with self.lock:
            _check(
                self._lib.ucp_ep_create(self._worker, ctypes.byref(params), ctypes.byref(ep)), "ucp_ep_create"
            )
        endpoint = RmaEndpoint(self, int(ep.value or 0))
        self._endpoints.append(endpoint)
        return endpoint

    def register(self, buffer: Any) -> Registration:
        """Register an existing C-contiguous buffer for remote reads (``ucp_mem_map``) and pack its rkey.

        The registration keeps a view of ``buffer`` (pinning it) until closed.
        """
        self._ensure_open()
        view, address, length = _buffer_address(buffer, writable=False)
        if length == 0:
            view.release()
            raise ValueError("cannot register an empty buffer")
        mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH
        prot = 0
        if view.readonly:
            mask |= UCP_MEM_MAP_PARAM_FIELD_PROT
            prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_REMOTE_READ
        params = UcpMemMapParams(field_mask=mask, address=address, length=length, prot=prot)
        memh = ctypes.c_void_p()
        lib = self._lib
        with self.lock:
            status = lib.ucp_mem_map(self._context, ctypes.byref(params), ctypes.byref(memh))
            if status != UCS_OK:
                view.release()
                _check(status, "ucp_mem_map")
            rkey_buf = ctypes.c_void_p()
            rkey_len = ctypes.c_size_t()
            status = lib.ucp_rkey_pack(self._context, memh, ctypes.byref(rkey_buf), ctypes.byref(rkey_len))
            if status != UCS_OK:
                lib.ucp_mem_unmap(self._context, memh)
                view.release()
                _check(status, "ucp_rkey_pack")
            try:
                rkey = ctypes.string_at(rkey_buf.value or 0, rkey_len.value)
            finally:
                lib.ucp_rkey_buffer_release(rkey_buf)
        registration = Registration(self, int(memh.value or 0), view, address, length, rkey)
        self._registrations.append(registration)
        return registration

    def close(self) -> None:
        """Close endpoints (and their keys), unmap registrations, destroy the worker and the context."""
        if self._closed:
            return
        if self._progress_thread is not None:
            self._progress_stop.set()
            self._progress_thread.join()
            self._progress_thread = None
        errors: list[TransportError] = []
        for request in list(self._inflight):
            try:
                request.wait(CANCEL_GRACE_S)
            except TransportError as e:
                errors.append(e)
        for ep in list(self._endpoints):
            try:
                ep.close()
            except TransportError as e:
                errors.append(e)
        for reg in list(self._registrations):
            try:
                reg.close()
            except TransportError as e:
                errors.append(e)
        with self.lock:
            self._reap()  # first free what completed; the rest cannot write anywhere once the worker is gone
            self._lib.ucp_worker_destroy(self._worker)
            self._lib.ucp_cleanup(self._context)
            self._closed = True
            self._reap()
        if errors:
            raise errors[0]


class Registration(_Closable):
    """Memory registered with ``ucp_mem_map``: publish :attr:`address`, :attr:`length` and :attr:`rkey`."""

    def __init__(
        self, context: RmaContext, memh: int, view: memoryview, address: int, length: int, rkey: bytes
    ) -> None:
        self._context = context
        self._memh = memh
        self._view: memoryview | None = view
        self.address = address
        self.length = length
        self.rkey = rkey
        self._closed = False

    @property
    def memh(self) -> int:
        """The raw ``ucp_mem_h``."""
        return self._memh

    def close(self) -> None:
        """``ucp_mem_unmap``; remote keys already unpacked by peers become invalid."""
        if self._closed:
            return
        self._closed = True
        ctx = self._context
        with ctx.lock:
            status = ctx._lib.ucp_mem_unmap(ctx._context, self._memh)
        if self in ctx._registrations:
            ctx._registrations.remove(self)
        if self._view is not None:
            self._view.release()
            self._view = None
        _check(status, "ucp_mem_unmap")


class RmaEndpoint(_Closable):
    """A ``ucp_ep_h`` to a remote worker; unpacks remote keys published by that worker."""

    def __init__(self, context: RmaContext, ep: int) -> None:
        self._context = context
        self._ep = ep
        self._rkeys: list[RemoteKey] = []
        self._closed = False

    def unpack(self, rkey: bytes, address: int | None = None, length: int | None = None) -> RemoteKey:
        """``ucp_ep_rkey_unpack``. With the region's ``address`` and ``length``, GETs are range-checked."""
        self._ensure_open()
        if (address is None) != (length is None):
            raise ValueError("give both address and length of the remote region, or neither")
        if not rkey:
            raise TransportError("empty remote key")
        handle = ctypes.c_void_p()
        ctx = self._context
        with ctx.lock:
            _check(
                ctx._lib.ucp_ep_rkey_unpack(self._ep, bytes(rkey), ctypes.byref(handle)), "ucp_ep_rkey_unpack"
            )
        key = RemoteKey(self, int(handle.value or 0), address, length)
        self._rkeys.append(key)
        return key

    def close(self, timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        """Destroy this endpoint's remote keys and close it in flush mode, progressing until done."""
        if self._closed:
            return
        for key in list(self._rkeys):
            key.close()
        self._closed = True
        ctx = self._context
        if self in ctx._endpoints:
            ctx._endpoints.remove(self)
        params = UcpRequestParam(op_attr_mask=UCP_OP_ATTR_FIELD_FLAGS, flags=0)
        with ctx.lock:
            request = ctx._lib.ucp_ep_close_nbx(self._ep, ctypes.byref(params))
        ctx._wait(request, "ucp_ep_close_nbx", timeout)


class RemoteKey(_Closable):
    """An unpacked remote key (``ucp_rkey_h``): GET ranges of the remote region into local buffers."""

    def __init__(self, endpoint: RmaEndpoint, rkey: int, address: int | None, length: int | None) -> None:
        self._endpoint = endpoint
        self._rkey = rkey
        self.address = address
        self.length = length
        self._closed = False

    def _check_range(self, remote_address: int, nbytes: int) -> None:
        if remote_address < 0 or nbytes < 0:
            raise TransportError(f"negative remote address or length ({remote_address:#x}, {nbytes})")
        if self.address is None or self.length is None:
            return
        if remote_address < self.address or remote_address + nbytes > self.address + self.length:
            raise TransportError(
                f"GET [{remote_address:#x}, +{nbytes}) is outside the registered region "
                f"[{self.address:#x}, +{self.length})"
            )

    def get_nb(self, remote_address: int, dest: Any) -> GetRequest:
        """Start ``ucp_get_nbx`` of ``len(dest)`` bytes at ``remote_address``; complete it with the request.

        ``dest`` must stay untouched until the request completes (the request holds a view of it).
        """
        self._ensure_open()
        self._endpoint._ensure_open()
        view, address, nbytes = _buffer_address(dest, writable=True)
        self._check_range(remote_address, nbytes)
        ctx = self._endpoint._context
        if nbytes == 0:
            return GetRequest(ctx, None, view)
        params = UcpRequestParam(op_attr_mask=0)
        with ctx.lock:
            request = ctx._lib.ucp_get_nbx(
                self._endpoint._ep, address, nbytes, remote_address, self._rkey, ctypes.byref(params)
            )
        if ptr_is_err(request):
            view.release()
            _check(ptr_status(request), "ucp_get_nbx")
        pending = GetRequest(ctx, request, view)
        if request is not None:
            ctx._inflight.add(pending)
        return pending

    def get(self, remote_address: int, dest: Any, timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        """GET ``len(dest)`` bytes at ``remote_address`` into ``dest``, progressing the worker until done."""
        self.get_nb(remote_address, dest).wait(timeout)

    def close(self) -> None:
        """``ucp_rkey_destroy``."""
        if self._closed:
            return
        self._closed = True
        ctx = self._endpoint._context
        with ctx.lock:
            ctx._lib.ucp_rkey_destroy(self._rkey)
        if self in self._endpoint._rkeys:
            self._endpoint._rkeys.remove(self)


@dataclass(eq=False)
class GetRequest:
    """An in-flight GET; holds the destination view until it completes."""

    _context: RmaContext
    _request: int | None
    _view: memoryview | None

    def done(self) -> bool:
        """Progress the worker once and tell whether the GET finished (raises if it failed)."""
        if self._request is None:
            self._release()
            return True
        ctx = self._context
        with ctx.lock:
            status = ctx._lib.ucp_request_check_status(self._request)
            if status == UCS_INPROGRESS:
                ctx._lib.ucp_worker_progress(ctx._worker)
                status = ctx._lib.ucp_request_check_status(self._request)
                if status == UCS_INPROGRESS:
                    return False
            ctx._lib.ucp_request_free(self._request)
        self._request = None
        self._context._inflight.discard(self)
        self._release()
        _check(status, "ucp_get_nbx")
        return True

    def wait(self, timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        """Progress until the GET completes; TransportError on failure or timeout (the GET is cancelled)."""
        request, self._request = self._request, None
        view, self._view = self._view, None
        self._context._inflight.discard(self)
        try:
            self._context._wait(request, "ucp_get_nbx", timeout, keep=view)
        finally:
            if view is not None and not any(view is kept for _, _, kept in _ABANDONED):
                view.release()

    def _release(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None


def wait_all(requests: list[GetRequest], timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
    """Wait for several GETs (issued back to back, so they overlap)."""
    for request in requests:
        request.wait(timeout)
