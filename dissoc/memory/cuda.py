"""Device memory behind one small interface: CuPy on a CUDA device, or a fake device for CPU tests.

Everything in dissoc that touches GPU memory goes through a :class:`DeviceBackend`:

* :class:`CupyBackend` (``"cupy"``): allocations are dedicated ``cudaMalloc`` regions
  (``cupy.cuda.Memory``, not the pool, so that a CUDA IPC handle covers exactly one allocation and offsets
  within it mean the same in every process); arrays are ``cupy.ndarray``; IPC handles are the 64-byte
  ``cudaIpcMemHandle_t``.
* :class:`FakeDeviceBackend` (``"fake"``): "device" memory is host memory in a POSIX shared-memory segment,
  arrays are :class:`FakeDeviceArray` over it, and the "IPC handle" is 64 bytes naming the segment. It exists
  so that what does not need a GPU (handle encoding, arena accounting, the choice of landing place, two
  processes sharing an allocation) is tested on any machine. It is never chosen unless asked for.

Computing on device memory (hashing, gathering) goes through the backend's array module
(:attr:`DeviceBackend.array_module`: ``cupy``, or ``numpy`` for the fake device) and the two conversions
:meth:`DeviceBackend.as_xp` / :meth:`DeviceBackend.from_xp`, neither of which copies: the same code then runs
on the GPU with CuPy and on the host with numpy.

:func:`get_backend` returns the process's backend: the one set with :func:`use_backend`, else the one named by
the ``DISSOC_DEVICE_BACKEND`` environment variable (``cupy`` or ``fake``; read, never set), else CuPy. CuPy is
imported on first use only; without it (or without a device) asking for device memory raises
:class:`~dissoc.errors.ResourceError` naming the ``gpu`` extra.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, cast

import numpy as np
import numpy.typing as npt

from dissoc.buffers import BytesLike, U8Array
from dissoc.errors import DissocError, ResourceError
from dissoc.memory.shm import reserve

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "IPC_HANDLE_BYTES",
    "CupyBackend",
    "DeviceAllocation",
    "DeviceArray",
    "DeviceBackend",
    "FakeDeviceBackend",
    "get_backend",
    "use_backend",
]

log = logging.getLogger(__name__)

#: ``ArrowDeviceType`` values of the Arrow C Device Data Interface (those of DLPack's ``DLDeviceType``).
ARROW_DEVICE_CPU = 1
ARROW_DEVICE_CUDA = 2
ARROW_DEVICE_CUDA_HOST = 3
ARROW_DEVICE_CUDA_MANAGED = 13

#: Size of a CUDA IPC memory handle (``cudaIpcMemHandle_t``), and of the fake backend's handles.
IPC_HANDLE_BYTES = 64
#: First bytes of a fake backend's IPC handle (then the segment name, NUL-padded to 64 bytes).
FAKE_HANDLE_MAGIC = b"DISSOC-FAKE-DEV\0"
_FAKE_PREFIX = "dissoc-fakedev-"
ENV_VAR = "DISSOC_DEVICE_BACKEND"


class DeviceArray(Protocol):
    """A device array as dissoc uses it, whatever the backend (``cupy.ndarray``, :class:`FakeDeviceArray`):
    its size, shape and dtype, a dtype view and slices (views too, no copy). Its bytes are reached through
    the backend (``download``), never directly."""

    @property
    def nbytes(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    def view(self, dtype: npt.DTypeLike, /) -> DeviceArray: ...

    def __getitem__(self, key: slice, /) -> DeviceArray: ...

    def __len__(self) -> int: ...


class DeviceAllocation(Protocol):
    """One device allocation: a base pointer and a size, owned (freed by :meth:`close`) or mapped from a
    handle (unmapped by :meth:`close`). ``array`` is a uint8 device array over all of it."""

    @property
    def ptr(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def array(self) -> DeviceArray: ...

    def close(self) -> None: ...


class DeviceBackend(Protocol):
    """What dissoc needs from a device: allocate, copy both ways, share between processes, synchronise."""

    name: str

    def allocate(self, nbytes: int) -> DeviceAllocation:
        """A dedicated allocation of ``nbytes`` (one IPC handle covers exactly it)."""
        ...

    def empty(self, nbytes: int) -> DeviceArray:
        """A uint8 device array of ``nbytes`` (pooled memory is fine: it is not shared)."""
        ...

    def upload(self, data: BytesLike) -> DeviceArray:
        """A new uint8 device array holding a copy of host bytes-like ``data``."""
        ...

    def download(self, array: DeviceArray, out: U8Array | None = None) -> U8Array:
        """Copy uint8 device ``array`` to host memory (into ``out`` when given); waits for the copy."""
        ...

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        """Device-to-device copy of ``src`` into ``dst`` (uint8 arrays of one size)."""
        ...

    def upload_into(self, dst: DeviceArray, data: BytesLike) -> None:
        """Copy host bytes-like ``data`` into the existing uint8 device array ``dst`` (of the same size)."""
        ...

    def view(
        self, allocation: DeviceAllocation, offset: int, length: int, owner: object | None = None
    ) -> DeviceArray:
        """A uint8 device array over a range of ``allocation`` (no copy); ``ValueError`` outside it. With an
        ``owner``, the array and every view derived from it keep ``owner`` alive."""
        ...

    def is_device_array(self, obj: object) -> TypeGuard[DeviceArray]:
        """Whether ``obj`` is this backend's device array."""
        ...

    def ipc_handle(self, allocation: DeviceAllocation) -> bytes:
        """The IPC handle of ``allocation`` (:data:`IPC_HANDLE_BYTES` bytes)."""
        ...

    def open_ipc(self, handle: bytes, nbytes: int) -> DeviceAllocation:
        """Map another process's allocation; ``nbytes`` bounds what may be read (checked when possible)."""
        ...

    def synchronize(self) -> None:
        """Wait until the work queued on the current stream has finished."""
        ...

    @property
    def array_module(self) -> ModuleType:
        """The array module that computes on this backend's memory: ``cupy``, or ``numpy`` (fake device)."""
        ...

    def as_xp(self, array: DeviceArray) -> Any:
        """``array`` as an ndarray of :attr:`array_module` over the same memory (no copy)."""
        ...

    def from_xp(self, array: Any) -> DeviceArray:
        """An ndarray of :attr:`array_module` as a device array of this backend, over its memory (no copy)."""
        ...

    # The Arrow C Device Data Interface (dissoc.device.cdevice)

    def pointer(self, array: DeviceArray) -> int:
        """The address of ``array``'s first byte in this backend's memory."""
        ...

    def wrap(self, ptr: int, nbytes: int, owner: object) -> DeviceArray:
        """A uint8 device array over ``nbytes`` at address ``ptr`` that someone else owns (no copy); it keeps
        ``owner`` alive."""
        ...

    def arrow_device(self) -> tuple[int, int]:
        """The Arrow C Device Data Interface's ``(device_type, device_id)`` of this backend's memory."""
        ...

    def record_event(self) -> tuple[object, int]:
        """A sync event recorded on the current stream, for a consumer to wait on: ``(keep, address)``, the
        address of a ``cudaEvent_t`` kept valid by ``keep`` (``(None, 0)``: nothing to wait for)."""
        ...

    def wait_event(self, address: int) -> None:
        """Make the current stream wait for the producer's event at ``address`` (a ``cudaEvent_t*``)."""
        ...


def _host_bytes(data: BytesLike) -> U8Array:
    """Host bytes-like ``data`` as a flat uint8 numpy array over the same memory (no copy)."""
    # numpy's stubs declare the buffer protocol of arrays for Python 3.12+ only; they have it on 3.11 too.
    return np.frombuffer(memoryview(cast("Buffer", data)).cast("B"), dtype=np.uint8)


# ----------------------------------------------------------------------------------------------------------
# CuPy


class _CupyArray(DeviceArray, Protocol):
    """What the CuPy backend uses of a ``cupy.ndarray`` beyond :class:`DeviceArray` (CuPy has no type
    information of its own)."""

    def get(self, *, out: U8Array | None = None) -> U8Array: ...

    def set(self, arr: U8Array, /) -> None: ...


def _cupy() -> ModuleType:
    """The ``cupy`` module, or a ResourceError naming the ``gpu`` extra."""
    try:
        import cupy
    except ImportError as exc:
        raise ResourceError(
            f"device memory needs CuPy and a CUDA device (pip install 'dissoc[gpu]'): {exc}"
        ) from exc
    module: ModuleType = cupy  # CuPy has no type information: to the checker the import is Any
    return module


# CUDA maps an IPC handle at most once per process: opening it again while it is open fails. Every allocation
# opened from one handle shares that mapping, which is closed with the last of them.
_ipc_lock = threading.Lock()
_ipc_open: dict[bytes, list[int]] = {}  # handle -> [mapped pointer, allocations using it]


def _close_ipc(handle: bytes) -> None:
    with _ipc_lock:
        entry = _ipc_open.get(handle)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _ipc_open[handle]
        with contextlib.suppress(Exception):  # under the lock: nobody reopens it before it is closed
            _cupy().cuda.runtime.ipcCloseMemHandle(entry[0])


class _CupyAllocation:
    __slots__ = ("_array", "_closed", "_ipc_handle", "_memory", "nbytes", "ptr")

    def __init__(self, memory: object | None, ptr: int, nbytes: int, ipc_handle: bytes | None) -> None:
        """``memory``: the ``cupy.cuda.Memory`` this allocation owns, or None for one mapped from
        ``ipc_handle``."""
        cp = _cupy()
        self._memory = memory
        self.ptr = ptr
        self.nbytes = nbytes
        self._ipc_handle = ipc_handle
        self._closed = False
        owner = memory if memory is not None else self
        unowned = cp.cuda.UnownedMemory(ptr, nbytes, owner)
        self._array: DeviceArray | None = cp.ndarray(
            (nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(unowned, 0)
        )

    @property
    def array(self) -> DeviceArray:
        # None once closed, when nothing reads it any more (the arenas and readers check first).
        return cast(DeviceArray, self._array)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._array = None
        if self._ipc_handle is not None:
            _close_ipc(self._ipc_handle)
        self._memory = None


class CupyBackend:
    """A CUDA device through CuPy (the current device of the calling thread)."""

    name = "cupy"

    def __init__(self) -> None:
        cp = _cupy()
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise ResourceError(f"device memory needs a CUDA device: {exc}") from exc
        if count < 1:
            raise ResourceError("device memory needs a CUDA device: none is visible")
        self._cp = cp
        # Create the device's context now, before a UCX context may be created in this process: UCX's CUDA
        # transports look for a current context when they start.
        cp.empty(1, dtype=cp.uint8)

    def allocate(self, nbytes: int) -> DeviceAllocation:
        cp = self._cp
        try:
            memory = cp.cuda.Memory(max(int(nbytes), 1))
        except cp.cuda.memory.OutOfMemoryError as exc:
            raise ResourceError(f"cannot allocate {nbytes} bytes of device memory: {exc}") from exc
        return _CupyAllocation(memory, int(memory.ptr), int(nbytes), None)

    def empty(self, nbytes: int) -> _CupyArray:
        try:
            array: _CupyArray = self._cp.empty(int(nbytes), dtype=self._cp.uint8)
        except self._cp.cuda.memory.OutOfMemoryError as exc:
            raise ResourceError(f"cannot allocate {nbytes} bytes of device memory: {exc}") from exc
        return array

    def upload(self, data: BytesLike) -> DeviceArray:
        host = _host_bytes(data)
        array = self.empty(host.nbytes)
        array.set(host)
        return array

    def download(self, array: DeviceArray, out: U8Array | None = None) -> U8Array:
        if out is None:
            return cast(_CupyArray, array).get()
        cast(_CupyArray, array).get(out=out)
        return out

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        self._cp.copyto(dst, src)

    def upload_into(self, dst: DeviceArray, data: BytesLike) -> None:
        """Copy host bytes-like ``data`` into the existing uint8 device array ``dst`` (of its size)."""
        host = _host_bytes(data)
        cast(_CupyArray, dst).set(host)

    def view(
        self, allocation: DeviceAllocation, offset: int, length: int, owner: object | None = None
    ) -> DeviceArray:
        """A uint8 device array over ``[offset, offset + length)`` of ``allocation`` (no copy).

        With an ``owner``, the array (and every view derived from it) keeps ``owner`` alive; without one, it
        is a slice of ``allocation.array``.
        """
        _check_view(allocation, offset, length)
        if owner is None:
            return allocation.array[offset : offset + length]
        cp = self._cp
        memory = cp.cuda.UnownedMemory(allocation.ptr + offset, max(length, 1), owner)
        array: DeviceArray = cp.ndarray((length,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
        return array

    def is_device_array(self, obj: object) -> TypeGuard[DeviceArray]:
        return isinstance(obj, self._cp.ndarray)

    def ipc_handle(self, allocation: DeviceAllocation) -> bytes:
        handle = bytes(self._cp.cuda.runtime.ipcGetMemHandle(allocation.ptr))
        if len(handle) != IPC_HANDLE_BYTES:
            raise DissocError(f"CUDA IPC handle: expected {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        return handle

    def open_ipc(self, handle: bytes, nbytes: int) -> DeviceAllocation:
        check_ipc_handle(handle)
        if handle.startswith(FAKE_HANDLE_MAGIC):
            raise ResourceError("remote_handle names a fake-device segment, not CUDA memory")
        raw = bytes(handle)
        with _ipc_lock:
            entry = _ipc_open.get(raw)
            if entry is None:  # not mapped in this process yet (see _ipc_open)
                try:
                    ptr = int(self._cp.cuda.runtime.ipcOpenMemHandle(raw))
                except Exception as exc:
                    raise ResourceError(f"cannot open the CUDA IPC handle: {exc}") from exc
                entry = _ipc_open[raw] = [ptr, 0]
            entry[1] += 1
        try:
            return _CupyAllocation(None, entry[0], int(nbytes), raw)
        except BaseException:
            _close_ipc(raw)
            raise

    def synchronize(self) -> None:
        self._cp.cuda.get_current_stream().synchronize()

    @property
    def array_module(self) -> ModuleType:
        """``cupy``."""
        return self._cp

    def as_xp(self, array: DeviceArray) -> Any:
        """The ``cupy.ndarray`` itself (device arrays of this backend already are CuPy arrays)."""
        if not isinstance(array, self._cp.ndarray):
            raise TypeError(f"expected a cupy.ndarray, got {type(array).__name__}")
        return array

    def from_xp(self, array: Any) -> DeviceArray:
        """The ``cupy.ndarray`` itself; host arrays are refused (upload them instead)."""
        if not isinstance(array, self._cp.ndarray):
            raise TypeError(f"expected a cupy.ndarray, got {type(array).__name__} (upload host data instead)")
        result: DeviceArray = array
        return result

    def pointer(self, array: DeviceArray) -> int:
        return int(cast(Any, array).data.ptr)

    def wrap(self, ptr: int, nbytes: int, owner: object) -> DeviceArray:
        cp = self._cp
        memory = cp.cuda.UnownedMemory(int(ptr), max(int(nbytes), 1), owner)
        pointer = cp.cuda.MemoryPointer(memory, 0)
        array: DeviceArray = cp.ndarray((int(nbytes),), dtype=cp.uint8, memptr=pointer)
        return array

    def arrow_device(self) -> tuple[int, int]:
        return ARROW_DEVICE_CUDA, int(self._cp.cuda.runtime.getDevice())

    def record_event(self) -> tuple[object, int]:
        event = self._cp.cuda.Event(block=False, disable_timing=True)
        event.record()
        handle = np.array([int(event.ptr)], np.uint64)  # the cudaEvent_t the address points at
        return (event, handle), int(handle.ctypes.data)

    def wait_event(self, address: int) -> None:
        handle = ctypes.c_uint64.from_address(address).value
        self._cp.cuda.runtime.streamWaitEvent(self._cp.cuda.get_current_stream().ptr, handle, 0)


# ----------------------------------------------------------------------------------------------------------
# Fake device (host shared memory), for tests without a GPU


def _fake_path(name: str) -> str:
    return os.path.join("/dev/shm", name)


class _FakeAllocation:
    __slots__ = ("_closed", "_mm", "_owner", "array", "name", "nbytes", "ptr")

    def __init__(self, name: str, mm: mmap.mmap, nbytes: int, owner: bool) -> None:
        self.name = name
        self._mm = mm
        self.nbytes = nbytes
        self._owner = owner
        self._closed = False
        host = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        self.ptr = int(host.ctypes.data)
        self.array = FakeDeviceArray(host)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.array = FakeDeviceArray(np.empty(0, np.uint8))
        with contextlib.suppress(BufferError):
            self._mm.close()  # still exported (a view outlives us): the mapping goes with the last view
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_fake_path(self.name))


class FakeDeviceBackend:
    """Host shared memory posing as a device (see the module docstring); for tests only."""

    name = "fake"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = 0

    def allocate(self, nbytes: int) -> DeviceAllocation:
        """A shared-memory segment ``dissoc-fakedev-<pid>-<random>`` of ``nbytes``, its memory reserved now
        (a ``/dev/shm`` too small for it raises :class:`~dissoc.errors.ResourceError` here, not SIGBUS on
        first use), mapped read-write and then made read-only (mode 0400) for everyone else."""
        nbytes = int(nbytes)
        name = f"{_FAKE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(_fake_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.ftruncate(fd, max(nbytes, 1))
                reserve(fd, max(nbytes, 1), "fake device arena")
                mm = mmap.mmap(fd, max(nbytes, 1))
                os.fchmod(fd, 0o400)  # as a ShmArena: clients open it read-only, nobody else for writing
            except OSError as exc:
                raise ResourceError(f"cannot allocate {nbytes} bytes of fake device memory: {exc}") from exc
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_fake_path(name))
            raise
        finally:
            os.close(fd)
        return _FakeAllocation(name, mm, nbytes, owner=True)

    def empty(self, nbytes: int) -> FakeDeviceArray:
        return FakeDeviceArray(np.empty(int(nbytes), np.uint8))

    def upload(self, data: BytesLike) -> FakeDeviceArray:
        host = _host_bytes(data)
        return FakeDeviceArray(host.copy())

    def download(self, array: DeviceArray, out: U8Array | None = None) -> U8Array:
        src = np.asarray(array.host if isinstance(array, FakeDeviceArray) else array, np.uint8)
        if out is None:
            return src.copy()
        np.copyto(out, src)
        return out

    def copy(self, dst: DeviceArray, src: DeviceArray) -> None:
        np.copyto(_fake_host(dst), _fake_host(src))

    def upload_into(self, dst: DeviceArray, data: BytesLike) -> None:
        """Copy host bytes-like ``data`` into the existing uint8 fake device array ``dst`` (of its size)."""
        np.copyto(_fake_host(dst), _host_bytes(data))

    def view(
        self, allocation: DeviceAllocation, offset: int, length: int, owner: object | None = None
    ) -> FakeDeviceArray:
        """A fake device array over ``[offset, offset + length)`` of ``allocation`` (no copy).

        With an ``owner``, the numpy array behind it holds ``owner`` as its base, so that every view derived
        from it (slices, dtype views, new :class:`FakeDeviceArray` objects over them) keeps ``owner`` alive.
        """
        _check_view(allocation, offset, length)
        host = _fake_host(allocation.array)[offset : offset + length]
        if owner is not None:
            host = np.asarray(_Owned(host, owner))
        return FakeDeviceArray(host)

    def is_device_array(self, obj: object) -> TypeGuard[DeviceArray]:
        return isinstance(obj, FakeDeviceArray)

    def ipc_handle(self, allocation: DeviceAllocation) -> bytes:
        name = getattr(allocation, "name", None)
        if not isinstance(name, str):
            raise DissocError("the fake backend has IPC handles only for its own allocations")
        raw = FAKE_HANDLE_MAGIC + name.encode()
        return raw.ljust(IPC_HANDLE_BYTES, b"\0")

    def open_ipc(self, handle: bytes, nbytes: int) -> DeviceAllocation:
        check_ipc_handle(handle)
        if not handle.startswith(FAKE_HANDLE_MAGIC):
            raise ResourceError("remote_handle is not a fake-device handle (a real CUDA IPC handle?)")
        name = handle[len(FAKE_HANDLE_MAGIC) :].rstrip(b"\0").decode("ascii", "replace")
        if not name.startswith(_FAKE_PREFIX) or "/" in name:
            raise ResourceError(f"fake-device handle: bad segment name {name!r}")
        try:
            fd = os.open(_fake_path(name), os.O_RDONLY)  # read-only, like a client's shared-memory view
        except OSError as exc:
            raise ResourceError(f"cannot open the fake-device handle {name!r}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if nbytes > size:
                raise ResourceError(f"fake-device handle {name!r}: {nbytes} bytes asked, {size} mapped")
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return _FakeAllocation(name, mm, int(nbytes), owner=False)

    def synchronize(self) -> None:
        return None

    @property
    def array_module(self) -> ModuleType:
        """``numpy``: the fake device's memory is host memory."""
        return np

    def as_xp(self, array: DeviceArray) -> npt.NDArray[Any]:
        """The numpy array behind a :class:`FakeDeviceArray` (no copy)."""
        if not isinstance(array, FakeDeviceArray):
            raise TypeError(f"expected a FakeDeviceArray, got {type(array).__name__}")
        return array.host

    def from_xp(self, array: Any) -> FakeDeviceArray:
        """A numpy array as a :class:`FakeDeviceArray` over the same memory (no copy)."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"expected a numpy.ndarray, got {type(array).__name__}")
        return FakeDeviceArray(array)

    def pointer(self, array: DeviceArray) -> int:
        return int(_fake_host(array).ctypes.data)

    def wrap(self, ptr: int, nbytes: int, owner: object) -> FakeDeviceArray:
        if nbytes == 0:
            return FakeDeviceArray(np.empty(0, np.uint8))
        host = np.ctypeslib.as_array((ctypes.c_uint8 * int(nbytes)).from_address(int(ptr)))
        return FakeDeviceArray(np.asarray(_Owned(host, owner)))

    def arrow_device(self) -> tuple[int, int]:
        """The fake device's memory is host memory: ``ARROW_DEVICE_CPU``, device id -1, as pyarrow has it."""
        return ARROW_DEVICE_CPU, -1

    def record_event(self) -> tuple[object, int]:
        return None, 0

    def wait_event(self, address: int) -> None:
        return None


class FakeDeviceArray:
    """A fake backend's device array: host memory that code must not treat as host memory by accident.

    It deliberately has no buffer protocol and no ``__array__``: reaching its bytes takes
    ``backend.download`` (as with a real device array), so tests catch code that forgets the copy. Slicing
    gives views; ``.host`` is the numpy array behind it (for the backend and tests)."""

    __slots__ = ("host",)

    def __init__(self, host: npt.NDArray[Any]) -> None:
        self.host = host

    @property
    def nbytes(self) -> int:
        return int(self.host.nbytes)

    @property
    def size(self) -> int:
        return int(self.host.size)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.host.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.host.dtype

    @property
    def data_ptr(self) -> int:
        return int(self.host.ctypes.data)

    def view(self, dtype: npt.DTypeLike) -> FakeDeviceArray:
        return FakeDeviceArray(self.host.view(dtype))

    def __getitem__(self, key: slice) -> FakeDeviceArray:
        return FakeDeviceArray(self.host[key])

    def __len__(self) -> int:
        return len(self.host)

    def __repr__(self) -> str:
        return f"FakeDeviceArray(nbytes={self.nbytes}, dtype={self.dtype})"


def _fake_host(obj: object) -> npt.NDArray[Any]:
    return obj.host if isinstance(obj, FakeDeviceArray) else np.asarray(obj)


class _Owned:
    """Exposes a numpy array's memory (``__array_interface__``) while holding an owner: numpy keeps this
    object as the base of arrays made from it, so the owner lives as long as any of them."""

    __slots__ = ("__array_interface__", "_host", "owner")

    def __init__(self, host: npt.NDArray[Any], owner: object) -> None:
        self._host = host
        self.owner = owner
        self.__array_interface__ = host.__array_interface__


def _check_view(allocation: DeviceAllocation, offset: int, length: int) -> None:
    if offset < 0 or length < 0 or offset + length > allocation.nbytes:
        raise ValueError(
            f"device view: expected a range inside the {allocation.nbytes}-byte allocation, "
            f"got offset {offset} length {length}"
        )


# ----------------------------------------------------------------------------------------------------------
# Choosing the backend


def check_ipc_handle(handle: bytes | bytearray | memoryview) -> bytes:
    """``handle`` as bytes, if it has the size of an IPC handle; else :class:`ResourceError`."""
    raw = bytes(handle)
    if len(raw) != IPC_HANDLE_BYTES:
        raise ResourceError(f"IPC memory handle: expected {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
    return raw


_override: DeviceBackend | None = None
_default: DeviceBackend | None = None
_choose_lock = threading.Lock()


def get_backend() -> DeviceBackend:
    """The process's device backend (see the module docstring); :class:`ResourceError` when there is none."""
    global _default
    if _override is not None:
        return _override
    with _choose_lock:
        if _default is None:
            wanted = os.environ.get(ENV_VAR, "cupy").strip().lower() or "cupy"
            if wanted == "fake":
                _default = FakeDeviceBackend()
            elif wanted == "cupy":
                _default = CupyBackend()
            else:
                raise ResourceError(f"{ENV_VAR}: expected 'cupy' or 'fake', got {wanted!r}")
            log.debug("device backend: %s", _default.name)
        return _default


@contextlib.contextmanager
def use_backend(backend: DeviceBackend) -> Iterator[DeviceBackend]:
    """Use ``backend`` for device memory in this process while the block runs (tests)."""
    global _override
    previous = _override
    _override = backend
    try:
        yield backend
    finally:
        _override = previous
