"""libucp's C API through ctypes: the constants, parameter structs, functions and status helpers that
:mod:`dissoc.memory.ucx_rma` (RMA), :mod:`dissoc.transport.ucx.am` (active-message receiving) and
:mod:`dissoc.transport.ucx.peer_info` (the stream API) use.

* libucp is loaded lazily, on the first call of :func:`lib`: importing this module loads nothing. It is loaded
  through ``libucx.load_library()`` (the same files ucxx maps), so the process has one UCX.
* Deprecated-but-exported calls are used where the brief named them: ``ucp_worker_get_address`` and
  ``ucp_rkey_pack`` (newer: ``ucp_worker_query`` and ``ucp_memh_pack``).
* Struct layouts, enum values and field-mask bits come from the headers the libucx wheel ships
  (``libucx/include/ucp/api/ucp.h``, ``ucp_def.h``, ``ucp_compat.h``, ``ucs/type/status.h``) for x86-64
  LP64; ``ucs_status_t`` is a *packed* enum there, i.e. one signed byte, which matters for return types.
  The tests compare these layouts against the headers.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import importlib.util
import os
from collections.abc import Iterator
from functools import cache
from typing import Any

from dissoc.errors import TransportError

__all__ = [
    "AM_RECV_CALLBACK",
    "CONN_CALLBACK",
    "ERR_CALLBACK",
    "STREAM_RECV_CALLBACK",
    "UcpConnRequestAttr",
    "UcpListenerAttr",
    "UcpListenerParams",
    "UcpAmHandlerParam",
    "UcpAmRecvParam",
    "UcpEpAttr",
    "UcpEpParams",
    "UcpErrHandler",
    "UcpTagRecvInfo",
    "UcpMemMapParams",
    "UcpParams",
    "UcpRequestParam",
    "UcpTransportEntry",
    "UcpTransports",
    "UcpWorkerParams",
    "UcsSockAddr",
    "check",
    "ep_transports",
    "lib",
    "libucp_path",
    "ptr_is_err",
    "ptr_is_ptr",
    "ptr_status",
    "status_string",
]

# ---------------------------------------------------------------------------------------------------------
# Constants, from the headers of the libucx 1.21 wheel (UCS_BIT(n) == 1 << n)
# ---------------------------------------------------------------------------------------------------------

UCP_API_MAJOR = 1  # ucp_version.h
UCP_API_MINOR = 21  # ucp_version.h; older 1.x libraries accept newer minors with a warning at most

# ucs/type/status.h
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_NO_MEMORY = -4
UCS_ERR_CANCELED = -16
UCS_ERR_TIMED_OUT = -20
UCS_ERR_LAST = -100
_UINTPTR_MOD = 1 << 64
_UCS_ERR_LAST_PTR = UCS_ERR_LAST % _UINTPTR_MOD  # (uintptr_t)UCS_ERR_LAST

# ucp_params_field / ucp_feature
UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_FEATURE_RMA = 1 << 1

# ucp_worker_params_field / ucs_thread_mode_t
UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
UCS_THREAD_MODE_SINGLE = 0
UCS_THREAD_MODE_SERIALIZED = 1

# ucp_ep_params_field / ucp_err_handling_mode_t / ucp_ep_close_flags_t
UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_ERR_HANDLING_MODE_NONE = 0
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0

# ucp_mem_map_params_field / ucp_mem_map prot
UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_FLAGS = 1 << 2
UCP_MEM_MAP_PARAM_FIELD_PROT = 1 << 3
UCP_MEM_MAP_PROT_LOCAL_READ = 1 << 0
UCP_MEM_MAP_PROT_LOCAL_WRITE = 1 << 1
UCP_MEM_MAP_PROT_REMOTE_READ = 1 << 8
UCP_MEM_MAP_PROT_REMOTE_WRITE = 1 << 9

# ucp_op_attr_t (ucp_request_param_t.op_attr_mask)
UCP_OP_ATTR_FIELD_REQUEST = 1 << 0
UCP_OP_ATTR_FIELD_CALLBACK = 1 << 1
UCP_OP_ATTR_FIELD_USER_DATA = 1 << 2
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4

# ucp_ep_params_field (more), ucp_err_handling_mode_t, ucp_listener_params_field, ucp_listener_attr_field,
# ucp_conn_request_attr_field, ucp_send_am_flags
UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2
UCP_EP_PARAM_FIELD_CONN_REQUEST = 1 << 6
UCP_ERR_HANDLING_MODE_PEER = 1
UCP_LISTENER_PARAM_FIELD_SOCK_ADDR = 1 << 0
UCP_LISTENER_PARAM_FIELD_CONN_HANDLER = 1 << 2
UCP_LISTENER_ATTR_FIELD_SOCKADDR = 1 << 0
UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR = 1 << 0
UCP_AM_SEND_FLAG_REPLY = 1 << 0

# ucp_am_handler_param_field / ucp_am_cb_flags / ucp_am_recv_attr_t
UCP_AM_HANDLER_PARAM_FIELD_ID = 1 << 0
UCP_AM_HANDLER_PARAM_FIELD_FLAGS = 1 << 1
UCP_AM_HANDLER_PARAM_FIELD_CB = 1 << 2
UCP_AM_HANDLER_PARAM_FIELD_ARG = 1 << 3
UCP_AM_FLAG_WHOLE_MSG = 1 << 0
UCP_AM_RECV_ATTR_FIELD_REPLY_EP = 1 << 0
UCP_AM_RECV_ATTR_FLAG_DATA = 1 << 16
UCP_AM_RECV_ATTR_FLAG_RNDV = 1 << 17

# ucp_ep_attr_field; ucp_def.h's UCP_ENTITY_NAME_MAX
UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
UCP_ENTITY_NAME_MAX = 32

# ucp_stream_recv_flags_t
UCP_STREAM_RECV_FLAG_WAITALL = 1 << 0


# ---------------------------------------------------------------------------------------------------------
# Parameter structs (every field up to the end, so sizes match the header; unions as their pointer member)
# ---------------------------------------------------------------------------------------------------------


class UcpParams(ctypes.Structure):
    """``ucp_params_t``."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("features", ctypes.c_uint64),
        ("request_size", ctypes.c_size_t),
        ("request_init", ctypes.c_void_p),  # ucp_request_init_callback_t
        ("request_cleanup", ctypes.c_void_p),  # ucp_request_cleanup_callback_t
        ("tag_sender_mask", ctypes.c_uint64),
        ("mt_workers_shared", ctypes.c_int),
        ("estimated_num_eps", ctypes.c_size_t),
        ("estimated_num_ppn", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        ("node_local_id", ctypes.c_size_t),
    )


UCS_CPU_SETSIZE = 1024  # ucs/type/cpu_set.h; ucs_cpu_set_t is unsigned long ucs_bits[1024 / 64]


class UcpWorkerParams(ctypes.Structure):
    """``ucp_worker_params_t``."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("thread_mode", ctypes.c_int),  # ucs_thread_mode_t
        ("cpu_mask", ctypes.c_ulong * (UCS_CPU_SETSIZE // (8 * ctypes.sizeof(ctypes.c_ulong)))),
        ("events", ctypes.c_uint),
        ("user_data", ctypes.c_void_p),
        ("event_fd", ctypes.c_int),
        ("flags", ctypes.c_uint64),
        ("name", ctypes.c_char_p),
        ("am_alignment", ctypes.c_size_t),
        ("client_id", ctypes.c_uint64),
    )


class UcsSockAddr(ctypes.Structure):
    """``ucs_sock_addr_t``."""

    _fields_ = (("addr", ctypes.c_void_p), ("addrlen", ctypes.c_uint32))  # socklen_t


class UcpErrHandler(ctypes.Structure):
    """``ucp_err_handler_t``."""

    _fields_ = (("cb", ctypes.c_void_p), ("arg", ctypes.c_void_p))


class UcpEpParams(ctypes.Structure):
    """``ucp_ep_params_t``."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),  # const ucp_address_t *
        ("err_mode", ctypes.c_int),  # ucp_err_handling_mode_t
        ("err_handler", UcpErrHandler),
        ("user_data", ctypes.c_void_p),
        ("flags", ctypes.c_uint),
        ("sockaddr", UcsSockAddr),
        ("conn_request", ctypes.c_void_p),
        ("name", ctypes.c_char_p),
        ("local_sockaddr", UcsSockAddr),
    )


class UcpMemMapParams(ctypes.Structure):
    """``ucp_mem_map_params_t``."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),  # ucs_memory_type_t
        ("exported_memh_buffer", ctypes.c_void_p),
    )


class UcpRequestParam(ctypes.Structure):
    """``ucp_request_param_t``."""

    _fields_ = (
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),  # union of callback pointers
        ("datatype", ctypes.c_uint64),  # ucp_datatype_t
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),  # ucs_memory_type_t
        ("recv_info", ctypes.c_void_p),  # union of pointers
        ("memh", ctypes.c_void_p),
    )


# ucs_status_t is `enum {...} __attribute__((packed))`: one signed byte (values 1 .. -100)
_status_t = ctypes.c_int8
_vp = ctypes.c_void_p
_P = ctypes.POINTER


class UcpAmRecvParam(ctypes.Structure):
    """``ucp_am_recv_param_t``."""

    _fields_ = (("recv_attr", ctypes.c_uint64), ("reply_ep", ctypes.c_void_p))


#: ``ucp_listener_conn_callback_t``: (conn_request, arg).
CONN_CALLBACK = ctypes.CFUNCTYPE(None, _vp, _vp)
#: ``ucp_err_handler_cb_t``: (arg, ep, status).
ERR_CALLBACK = ctypes.CFUNCTYPE(None, _vp, _vp, _status_t)
#: ``struct sockaddr_storage`` (128 bytes): family (u16), then the address of that family.
SOCKADDR_STORAGE = ctypes.c_uint8 * 128


class UcpListenerConnHandler(ctypes.Structure):
    """``ucp_listener_conn_handler_t``."""

    _fields_ = (("cb", CONN_CALLBACK), ("arg", ctypes.c_void_p))


class UcpListenerParams(ctypes.Structure):
    """``ucp_listener_params_t``."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("sockaddr", UcsSockAddr),
        ("accept_handler", ctypes.c_void_p * 2),  # ucp_listener_accept_handler_t (cb, arg): unused
        ("conn_handler", UcpListenerConnHandler),
    )


class UcpListenerAttr(ctypes.Structure):
    """``ucp_listener_attr_t``."""

    _fields_ = (("field_mask", ctypes.c_uint64), ("sockaddr", SOCKADDR_STORAGE))


class UcpConnRequestAttr(ctypes.Structure):
    """``ucp_conn_request_attr_t``."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("client_address", SOCKADDR_STORAGE),
        ("client_id", ctypes.c_uint64),
    )


#: ``ucp_stream_recv_nbx_callback_t``: (request, status, length, user_data).
STREAM_RECV_CALLBACK = ctypes.CFUNCTYPE(None, _vp, _status_t, ctypes.c_size_t, _vp)

#: ``ucp_am_recv_callback_t``: (arg, header, header_length, data, length, param) -> ucs_status_t.
AM_RECV_CALLBACK = ctypes.CFUNCTYPE(
    _status_t, _vp, _vp, ctypes.c_size_t, _vp, ctypes.c_size_t, _P(UcpAmRecvParam)
)


class UcpAmHandlerParam(ctypes.Structure):
    """``ucp_am_handler_param_t``."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("id", ctypes.c_uint),
        ("flags", ctypes.c_uint32),
        ("cb", AM_RECV_CALLBACK),
        ("arg", ctypes.c_void_p),
    )


class UcpTagRecvInfo(ctypes.Structure):
    """``ucp_tag_recv_info_t``: a probed or received tagged message's tag and length."""

    _fields_ = (("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t))


class UcpTransportEntry(ctypes.Structure):
    """``ucp_transport_entry_t``: one lane's transport and device names (valid until the endpoint closes)."""

    _fields_ = (("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p))


class UcpTransports(ctypes.Structure):
    """``ucp_transports_t``: the caller's array of entries, its length (in: room, out: used), entry size."""

    _fields_ = (
        ("entries", _P(UcpTransportEntry)),
        ("num_entries", ctypes.c_uint),
        ("entry_size", ctypes.c_size_t),
    )


class UcpEpAttr(ctypes.Structure):
    """``ucp_ep_attr_t``."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("name", ctypes.c_char * UCP_ENTITY_NAME_MAX),
        ("local_sockaddr", SOCKADDR_STORAGE),
        ("remote_sockaddr", SOCKADDR_STORAGE),
        ("transports", UcpTransports),
        ("user_data", ctypes.c_void_p),
    )


# name -> (restype, argtypes); libucs first, then libucp
_UCS_FUNCS: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "ucs_status_string": (ctypes.c_char_p, (_status_t,)),
}
_UCP_FUNCS: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "ucp_init_version": (_status_t, (ctypes.c_uint, ctypes.c_uint, _P(UcpParams), _vp, _P(_vp))),
    "ucp_cleanup": (None, (_vp,)),
    "ucp_worker_create": (_status_t, (_vp, _P(UcpWorkerParams), _P(_vp))),
    "ucp_worker_destroy": (None, (_vp,)),
    "ucp_worker_get_address": (_status_t, (_vp, _P(_vp), _P(ctypes.c_size_t))),
    "ucp_worker_release_address": (None, (_vp, _vp)),
    "ucp_worker_progress": (ctypes.c_uint, (_vp,)),
    "ucp_ep_create": (_status_t, (_vp, _P(UcpEpParams), _P(_vp))),
    "ucp_ep_close_nbx": (_vp, (_vp, _P(UcpRequestParam))),
    "ucp_ep_flush_nbx": (_vp, (_vp, _P(UcpRequestParam))),
    "ucp_mem_map": (_status_t, (_vp, _P(UcpMemMapParams), _P(_vp))),
    "ucp_mem_unmap": (_status_t, (_vp, _vp)),
    "ucp_rkey_pack": (_status_t, (_vp, _vp, _P(_vp), _P(ctypes.c_size_t))),
    "ucp_rkey_buffer_release": (None, (_vp,)),
    "ucp_ep_rkey_unpack": (_status_t, (_vp, ctypes.c_char_p, _P(_vp))),
    "ucp_rkey_destroy": (None, (_vp,)),
    "ucp_get_nbx": (_vp, (_vp, _vp, ctypes.c_size_t, ctypes.c_uint64, _vp, _P(UcpRequestParam))),
    "ucp_request_check_status": (_status_t, (_vp,)),
    "ucp_request_cancel": (None, (_vp, _vp)),
    "ucp_request_free": (None, (_vp,)),
    "ucp_worker_set_am_recv_handler": (_status_t, (_vp, _P(UcpAmHandlerParam))),
    "ucp_listener_create": (_status_t, (_vp, _P(UcpListenerParams), _P(_vp))),
    "ucp_listener_destroy": (None, (_vp,)),
    "ucp_listener_query": (_status_t, (_vp, _P(UcpListenerAttr))),
    "ucp_listener_reject": (_status_t, (_vp, _vp)),
    "ucp_conn_request_query": (_status_t, (_vp, _P(UcpConnRequestAttr))),
    "ucp_tag_send_nbx": (_vp, (_vp, _vp, ctypes.c_size_t, ctypes.c_uint64, _P(UcpRequestParam))),
    "ucp_tag_probe_nb": (_vp, (_vp, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, _P(UcpTagRecvInfo))),
    "ucp_tag_msg_recv_nbx": (_vp, (_vp, _vp, ctypes.c_size_t, _vp, _P(UcpRequestParam))),
    "ucp_am_send_nbx": (
        _vp,
        (_vp, ctypes.c_uint, _vp, ctypes.c_size_t, _vp, ctypes.c_size_t, _P(UcpRequestParam)),
    ),
    "ucp_am_recv_data_nbx": (_vp, (_vp, _vp, _vp, ctypes.c_size_t, _P(UcpRequestParam))),
    "ucp_am_data_release": (None, (_vp, _vp)),
    "ucp_stream_send_nbx": (_vp, (_vp, _vp, ctypes.c_size_t, _P(UcpRequestParam))),
    "ucp_stream_recv_nbx": (
        _vp,
        (_vp, _vp, ctypes.c_size_t, _P(ctypes.c_size_t), _P(UcpRequestParam)),
    ),
}
#: Functions dissoc does without where the library lacks them (set to None then).
_UCP_OPTIONAL: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "ucp_ep_query": (_status_t, (_vp, _P(UcpEpAttr))),
}


class _Lib:
    """The loaded libucs/libucp functions (attributes are ctypes function pointers)."""

    def __init__(self, ucs: ctypes.CDLL, ucp: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._ucs = ucs  # keep both libraries referenced
        self._ucp = ucp
        for lib, table in ((ucs, _UCS_FUNCS), (ucp, _UCP_FUNCS)):
            for name, (restype, argtypes) in table.items():
                fn = getattr(lib, name)
                fn.restype = restype
                fn.argtypes = argtypes
                setattr(self, name, fn)
        for name, (restype, argtypes) in _UCP_OPTIONAL.items():
            fn = getattr(ucp, name, None)
            if fn is not None:
                fn.restype = restype
                fn.argtypes = argtypes
            setattr(self, name, fn)

    def __getattr__(self, name: str) -> Any:  # for the type checker: functions are set in __init__
        raise AttributeError(name)


def _wheel_lib_dir() -> str | None:
    """``libucx/lib`` of the libucx wheel (libucx-cu12/cu13), found without importing anything."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        lib_dir = os.path.join(location, "lib")
        if os.path.exists(os.path.join(lib_dir, "libucp.so")):
            return lib_dir
    return None


def libucp_path() -> str | None:
    """Where libucp would be loaded from: the libucx wheel first, then the system; None when not found."""
    lib_dir = _wheel_lib_dir()
    if lib_dir is not None:
        return os.path.join(lib_dir, "libucp.so")
    return ctypes.util.find_library("ucp")


#: UCX's log level unless ``UCX_LOG_LEVEL`` says otherwise. UCX prints its log on stdout (where dissoc's CLI
#: writes its JSON lines), and what it reports there (a flush to a peer that just went, say) reaches dissoc's
#: callers as a TransportError when it matters.
DEFAULT_LOG_LEVEL = "fatal"


@contextlib.contextmanager
def ucs_log_defaults() -> Iterator[None]:
    """Around loading UCX's libraries (libucs reads its log settings then): ``UCX_LOG_LEVEL`` is
    :data:`DEFAULT_LOG_LEVEL` unless the user set it; the environment is left as it was."""
    added = "UCX_LOG_LEVEL" not in os.environ
    if added:
        os.environ["UCX_LOG_LEVEL"] = DEFAULT_LOG_LEVEL
    try:
        yield
    finally:
        if added:
            os.environ.pop("UCX_LOG_LEVEL", None)


def _load_wheel_libraries() -> tuple[ctypes.CDLL, ctypes.CDLL] | None:
    """libucs and libucp through the libucx wheel's own loader, as ucxx loads them.

    The wheel ships ``libucp.so``, ``libucp.so.0`` ... as separate *copies*, not links, and glibc tells
    libraries opened by path apart by file; loading other names than ucxx does would map a second,
    independent UCX into the process. ``libucx.load_library()`` is idempotent and returns
    ``[libucs, libucs_signal, libuct, libucp]`` (``None`` where one is missing).
    """
    if _wheel_lib_dir() is None:
        return None
    libucx = importlib.import_module("libucx")  # untyped; imported only now, on first use
    with ucs_log_defaults():
        libs = libucx.load_library()
    ucs, ucp = libs[0], libs[-1]
    if not isinstance(ucs, ctypes.CDLL) or not isinstance(ucp, ctypes.CDLL):
        return None
    return ucs, ucp


@cache
def lib() -> _Lib:
    """Load libucs and libucp once (the wheel's copies when installed, else the system's)."""
    try:
        loaded = _load_wheel_libraries()
        if loaded is None:
            ucs_path = ctypes.util.find_library("ucs")
            ucp_path = ctypes.util.find_library("ucp")
            if ucp_path is None or ucs_path is None:
                raise TransportError("libucp not found: install the libucx wheel (pip install 'dissoc[ucx]')")
            with ucs_log_defaults():
                loaded = ctypes.CDLL(ucs_path), ctypes.CDLL(ucp_path)
        ucs, ucp = loaded
        return _Lib(ucs, ucp, str(ucp._name))
    except OSError as e:
        raise TransportError(f"cannot load libucp: {e}") from e
    except AttributeError as e:  # a symbol is missing: too old a libucp
        raise TransportError(f"libucp lacks a needed function: {e}") from e


# ---------------------------------------------------------------------------------------------------------
# Status helpers
# ---------------------------------------------------------------------------------------------------------


def status_string(status: int) -> str:
    """``ucs_status_string(status)``."""
    raw: bytes | None = lib().ucs_status_string(status)
    return raw.decode("utf-8", "replace") if raw else f"UCS status {status}"


def check(status: int, what: str) -> None:
    """Raise TransportError naming ``what`` unless ``status`` is UCS_OK."""
    if status != UCS_OK:
        raise TransportError(f"{what} failed: {status_string(status)} ({status})")


#: Lanes an endpoint may have (UCP_MAX_LANES is 8 in libucx 1.21; room for more costs nothing).
_MAX_LANES = 32


def ep_transports(ep: int) -> tuple[tuple[str, str], ...]:
    """The (transport, device) names of endpoint ``ep``'s lanes (a ``ucp_ep_h``), as ``ucp_ep_query`` with
    ``UCP_EP_ATTR_FIELD_TRANSPORTS`` gives them (UCX >= 1.14; an older library gives none): e.g.
    ``("tcp", "lo")``, ``("sysv", "memory")``, ``("cuda_ipc", "cuda")``. Copied out at once (UCX's strings
    live only as long as the endpoint). TransportError when the query fails."""
    query = lib().ucp_ep_query
    if query is None:
        return ()
    entries = (UcpTransportEntry * _MAX_LANES)()
    attr = UcpEpAttr()
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS
    attr.transports.entries = ctypes.cast(entries, _P(UcpTransportEntry))
    attr.transports.num_entries = _MAX_LANES
    attr.transports.entry_size = ctypes.sizeof(UcpTransportEntry)
    check(query(ep, ctypes.byref(attr)), "ucp_ep_query")
    used = entries[: min(int(attr.transports.num_entries), _MAX_LANES)]
    return tuple((_text(e.transport_name), _text(e.device_name)) for e in used)


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw else ""


def ptr_is_err(ptr: int | None) -> bool:
    """``UCS_PTR_IS_ERR``: the pointer lies in the error range [(uintptr_t)UCS_ERR_LAST, UINTPTR_MAX]."""
    return ptr is not None and ptr % _UINTPTR_MOD >= _UCS_ERR_LAST_PTR


def ptr_is_ptr(ptr: int | None) -> bool:
    """``UCS_PTR_IS_PTR``: a real request pointer (neither NULL nor in the error range)."""
    return ptr is not None and (ptr % _UINTPTR_MOD) - 1 < _UCS_ERR_LAST_PTR - 1


def ptr_status(ptr: int | None) -> int:
    """``UCS_PTR_STATUS``: UCS_INPROGRESS for a request pointer, else the status encoded in the pointer."""
    if ptr is None:
        return UCS_OK
    if ptr_is_ptr(ptr):
        return UCS_INPROGRESS
    value = ptr % _UINTPTR_MOD
    return value - _UINTPTR_MOD if value >= _UINTPTR_MOD // 2 else value
