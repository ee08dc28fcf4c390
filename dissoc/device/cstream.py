"""The Arrow C Device Data Interface's stream (``ArrowDeviceArrayStream``): a stream of batches out, as the
PyCapsule ``__arrow_c_device_stream__`` of a reader, and in, from any producer of one.

**Export.** ``get_schema``, ``get_next`` and ``get_last_error`` are ctypes callbacks into Python: a consumer
calls them in its normal flow, from any thread (ctypes takes the GIL). Each array ``get_next`` hands out is
an ``ArrowDeviceArray`` of :mod:`dissoc.device.cdevice` (or pyarrow's, for host batches), moved into the
consumer's struct. ``release``, which a consumer may call anywhere (while an exception propagates, at
exit), runs no Python: it is a few machine instructions (:func:`dissoc.codec.cdata.native_function`) that
mark the stream released and release a holder ``ArrowArray`` whose private data owns the Python side, which
is then let go by reference counting, in C++, as :mod:`dissoc.codec.cdata` lets imported batches go. A
stream released after the consumer took at least one array closes its source (a dissoc stream: the server
is told); one never read from leaves it open. The capsule's own destructor, for a capsule nobody consumed,
is a small ctypes callback that only releases the stream.

**Import** (:func:`read_device_stream`) moves the stream out of its capsule, reads the schema, then calls
``get_next`` until the end, importing each array with :func:`dissoc.device.cdevice.import_device_array`; it
releases the stream when done, or when the caller stops early.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import threading
import weakref
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import pyarrow as pa

from dissoc.codec.cdata import Keepalive, give_release, native_function
from dissoc.device.cdevice import (
    DEVICE_ARRAY_SIZE,
    DeviceInterfaceError,
    Imported,
    empty_array_capsule,
    import_device_array,
)
from dissoc.memory.cuda import DeviceBackend

__all__ = ["STREAM_CAPSULE", "export_device_stream", "read_device_stream"]

log = logging.getLogger(__name__)

STREAM_CAPSULE = b"arrow_device_array_stream"
#: sizeof(struct ArrowDeviceArrayStream): device_type (padded), four callbacks, private_data.
STREAM_SIZE = 48
_GET_SCHEMA, _GET_NEXT, _GET_LAST_ERROR, _RELEASE, _PRIVATE = 8, 16, 24, 32, 40
SCHEMA_SIZE = 72  # sizeof(struct ArrowSchema)

_GetSchema = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_GetNext = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_GetLastError = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_Release = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# Declared apart from cdevice's: the destructor passes the capsule as a raw address, not a Python object.
_raw_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_object_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

#: ``void release(struct ArrowDeviceArrayStream* s) { struct ArrowArray* h = s->private_data;
#: s->release = NULL; h->release(h); }``
_FORWARD_RELEASE = native_function(
    x86_64="488b4728"
    "48c7472000000000"
    "4889c7"
    "ff6740",  # mov rax,[rdi+40]; mov [rdi+32],0; mov rdi,rax; jmp [rdi+64]
    aarch64=[0xF9401401, 0xF900101F, 0xAA0103E0, 0xF9402010, 0xD61F0200],  # ldr, str xzr, mov, ldr x16, br
)


class _Holders:
    """ArrowArray structs that own the Python side of exported streams.

    Arrow's release writes the struct (marking it released) after it has let go of what it owned, so the
    struct's memory cannot be among what it owns: it lives here, in chunks kept for the process's life, and
    a released slot (release NULL) is taken again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: list[np.ndarray[Any, np.dtype[np.uint64]]] = []

    def take(self, keep: Keepalive) -> int:
        with self._lock:
            for chunk in self._chunks:
                free = np.flatnonzero(chunk[:, 8] == 0)
                if free.size:
                    return self._fill(chunk, int(free[0]), keep)
            chunk = np.zeros((64, 10), np.uint64)
            self._chunks.append(chunk)
            return self._fill(chunk, 0, keep)

    @staticmethod
    def _fill(chunk: np.ndarray[Any, np.dtype[np.uint64]], row: int, keep: Keepalive) -> int:
        chunk[row] = 0
        give_release(chunk[row : row + 1], keep)
        return int(chunk.ctypes.data) + 80 * row


_holders = _Holders()
_capsule_memory: dict[int, ctypes.Array[ctypes.c_char]] = {}


def _destroy(capsule: int) -> None:
    """The capsule's destructor: release a stream nobody took, and free the capsule's struct."""
    try:
        address = _raw_pointer(capsule, STREAM_CAPSULE)
        if address:
            release = ctypes.c_uint64.from_address(address + _RELEASE).value
            if release:
                _Release(release)(address)
            _capsule_memory.pop(address, None)
    except BaseException:  # nothing may escape a destructor
        pass


_destroy_capsule = _Release(_destroy)


class _Exported:
    """The Python side of one exported stream."""

    def __init__(
        self,
        schema: pa.Schema,
        pull: Callable[[], Any],
        to_array: Callable[[Any], tuple[object, object]],
        finish: Callable[[bool], None],
    ) -> None:
        self.schema = schema
        self.pull = pull
        self.to_array = to_array
        self.finish = finish
        self.started = False
        self.done = False
        self.error = ctypes.create_string_buffer(1)

    def fail(self, exc: BaseException) -> int:
        log.debug("exported device stream: %s", exc, exc_info=True)
        self.error = ctypes.create_string_buffer(f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"))
        self.done = True
        return errno.EIO

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.finish(self.started)


def export_device_stream(
    schema: pa.Schema,
    device_type: int,
    pull: Callable[[], Any],
    to_array: Callable[[Any], tuple[object, object]],
    finish: Callable[[bool], None],
) -> object:
    """An ``arrow_device_array_stream`` capsule over the batches ``pull()`` returns (None at the end), each
    exported with ``to_array`` (``(schema capsule, arrow_device_array capsule)``) on ``device_type``.

    ``finish(started)`` runs once the consumer released the stream (or the capsule died unconsumed);
    ``started`` says whether it asked for any batch."""
    state = _Exported(schema, pull, to_array, finish)
    ref = weakref.ref(state)  # the callbacks must not keep the state alive: the holder alone does

    def get_schema(_stream: int, out: int) -> int:
        st = ref()
        if st is None:
            return errno.EINVAL
        try:
            st.schema._export_to_c(out)
        except BaseException as e:
            return st.fail(e)
        return 0

    def get_next(_stream: int, out: int) -> int:
        st = ref()
        if st is None:
            return errno.EINVAL
        try:
            st.started = True
            batch = None if st.done else st.pull()
            if batch is None:
                st.done = True
                ctypes.memset(out, 0, DEVICE_ARRAY_SIZE)  # release NULL: the end of the stream
                return 0
            _, capsule = st.to_array(batch)
            address = _object_pointer(capsule, b"arrow_device_array")
            ctypes.memmove(out, address, DEVICE_ARRAY_SIZE)
            ctypes.c_uint64.from_address(address + 64).value = 0  # moved out: the capsule has nothing left
        except BaseException as e:
            return st.fail(e)
        return 0

    def get_last_error(_stream: int) -> int | None:
        st = ref()
        if st is None or not st.error.value:
            return None
        return ctypes.addressof(st.error)

    callbacks: list[Any] = [_GetSchema(get_schema), _GetNext(get_next), _GetLastError(get_last_error)]

    if _FORWARD_RELEASE:
        release = _FORWARD_RELEASE
    else:  # another architecture: a Python release (unlike the native one, not safe mid-exception)

        def py_release(stream: int) -> None:
            holder = ctypes.c_uint64.from_address(stream + _PRIVATE).value
            ctypes.c_uint64.from_address(stream + _RELEASE).value = 0
            _Release(ctypes.c_uint64.from_address(holder + 64).value)(holder)

        callbacks.append(_Release(py_release))
        release = ctypes.cast(callbacks[-1], ctypes.c_void_p).value or 0
    keep = Keepalive()
    keep.objects += [state, callbacks]
    holder = _holders.take(keep)
    del state
    memory = ctypes.create_string_buffer(STREAM_SIZE)
    address = ctypes.addressof(memory)
    ctypes.c_int64.from_address(address).value = device_type  # int32, and 4 bytes of padding
    for offset, fn in zip((_GET_SCHEMA, _GET_NEXT, _GET_LAST_ERROR), callbacks, strict=False):
        ctypes.c_uint64.from_address(address + offset).value = ctypes.cast(fn, ctypes.c_void_p).value or 0
    ctypes.c_uint64.from_address(address + _RELEASE).value = release
    ctypes.c_uint64.from_address(address + _PRIVATE).value = holder
    _capsule_memory[address] = memory
    return _capsule_new(address, STREAM_CAPSULE, ctypes.cast(_destroy_capsule, ctypes.c_void_p).value)


# ---------------------------------------------------------------------------------------------------- import


class _OneArray:
    """Hands one received ArrowDeviceArray to :func:`import_device_array` as a PyCapsule producer."""

    def __init__(self, schema: pa.Schema, capsule: object) -> None:
        self.schema = schema
        self.capsule = capsule

    def __arrow_c_device_array__(
        self, requested_schema: object = None, **kwargs: Any
    ) -> tuple[object, object]:
        return self.schema.__arrow_c_schema__(), self.capsule


def read_device_stream(obj: Any, backend: DeviceBackend) -> Generator[Imported, None, None]:
    """Each batch of the stream ``obj`` exports (``__arrow_c_device_stream__``), imported into ``backend``'s
    memory (see :func:`~dissoc.device.cdevice.import_device_array`); the schema first, as ``pa.Schema``."""
    if not hasattr(obj, "__arrow_c_device_stream__"):
        raise DeviceInterfaceError(f"a {type(obj).__name__} exports no Arrow device stream")
    capsule = obj.__arrow_c_device_stream__()
    address = _object_pointer(capsule, STREAM_CAPSULE)
    if not address:
        raise DeviceInterfaceError("not an arrow_device_array_stream capsule")
    own = ctypes.create_string_buffer(STREAM_SIZE)
    stream = ctypes.addressof(own)
    ctypes.memmove(stream, address, STREAM_SIZE)
    ctypes.c_uint64.from_address(address + _RELEASE).value = 0  # moved out of the capsule
    del capsule

    def call(offset: int, kind: Any, *args: int) -> int:
        fn = ctypes.c_uint64.from_address(stream + offset).value
        return int(kind(fn)(stream, *args))

    def check(rc: int, what: str) -> None:
        if rc:
            fn = ctypes.c_uint64.from_address(stream + _GET_LAST_ERROR).value
            message = _GetLastError(fn)(stream) if fn else None
            text = (
                ctypes.string_at(message).decode("utf-8", "replace") if message else errno.errorcode.get(rc)
            )
            raise DeviceInterfaceError(f"the device stream's {what} failed ({rc}): {text}")

    try:
        if not ctypes.c_uint64.from_address(stream + _RELEASE).value:
            raise DeviceInterfaceError("the device stream was released already")
        schema_struct = pa.allocate_buffer(SCHEMA_SIZE)
        check(call(_GET_SCHEMA, _GetSchema, schema_struct.address), "get_schema")
        schema = pa.Schema._import_from_c(schema_struct.address)
        while True:
            _, array_capsule = empty_array_capsule()
            array = _object_pointer(array_capsule, b"arrow_device_array")
            check(call(_GET_NEXT, _GetNext, array), "get_next")
            if not ctypes.c_uint64.from_address(array + 64).value:
                return
            yield import_device_array(_OneArray(schema, array_capsule), backend)
    finally:
        release = ctypes.c_uint64.from_address(stream + _RELEASE).value
        if release:
            _Release(release)(stream)
