"""Buffers, the ground floor every layer shares: what counts as bytes, how long a buffer is (host or device
memory), the one alignment rule and aligned allocation, and the pool that recycles large receive buffers.

Nothing here does I/O or knows a protocol; the codec, the protocol core, the transports, the arenas and the
client all size, view and allocate buffers through these functions.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "ALIGNMENT",
    "DEFAULT_POOL",
    "BufferPool",
    "BytesLike",
    "NotContiguousError",
    "U8Array",
    "aligned_empty",
    "align_up",
    "buffer_nbytes",
    "byte_view",
    "default_allocator",
    "device_nbytes",
]

#: Alignment, in bytes, of every buffer dissoc allocates: received payloads, arena ranges, stream bodies
#: written to memory (the columnar format recommends 64 for SIMD; IPC bodies themselves are padded to 8,
#: :data:`dissoc.codec.encoder.BODY_PADDING`).
ALIGNMENT: Final = 64

#: A bytes-like object (numpy arrays are spelled out: their stubs declare the buffer protocol only for 3.12+).
BytesLike: TypeAlias = "Buffer | np.ndarray[Any, Any]"
#: A one-dimensional uint8 numpy array.
U8Array: TypeAlias = "np.ndarray[Any, np.dtype[np.uint8]]"


class NotContiguousError(TypeError, ValueError):
    """A buffer that is not C-contiguous was given where contiguous bytes are needed (a programming error,
    not bad data: both a wrong kind of argument and a bad value, so either ``except`` catches it)."""


def byte_view(obj: BytesLike) -> memoryview:
    """A flat, unsigned-byte memoryview of a C-contiguous host buffer (no copy).

    Raises :class:`NotContiguousError` for a non-contiguous one and TypeError for an object that is not a
    buffer (a device array, say).
    """
    if isinstance(obj, memoryview):
        view = obj
    elif isinstance(obj, np.ndarray):
        view = obj.data
    else:
        view = memoryview(obj)
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise NotContiguousError("expected a contiguous buffer")
        view = view.cast("B")
    elif not view.c_contiguous:
        raise NotContiguousError("expected a contiguous buffer")
    return view


def device_nbytes(obj: object) -> int | None:
    """The size of a CUDA device buffer (an object with ``__cuda_array_interface__``), or None for others.

    Only C-contiguous device buffers can be sent or received into (ValueError otherwise).
    """
    if getattr(type(obj), "__cuda_array_interface__", None) is None:
        return None
    iface = obj.__cuda_array_interface__  # type: ignore[attr-defined]
    shape = tuple(int(d) for d in iface["shape"])
    itemsize = int(str(iface["typestr"])[2:])
    count = 1
    for dim in shape:
        count *= dim
    strides = iface.get("strides")
    if strides is not None:
        expected = itemsize
        for dim, stride in zip(reversed(shape), reversed(tuple(strides)), strict=True):
            if dim > 1 and int(stride) != expected:
                raise ValueError("device buffers must be C-contiguous")
            expected *= dim
    return count * itemsize


def buffer_nbytes(obj: object) -> int:
    """The length in bytes of a buffer in host memory (bytes-like) or device memory."""
    size = device_nbytes(obj)
    return size if size is not None else byte_view(obj).nbytes  # type: ignore[arg-type]


def align_up(value: int, alignment: int = ALIGNMENT) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & ~(alignment - 1)


def aligned_empty(length: int, alignment: int = ALIGNMENT) -> U8Array:
    """An uninitialised 1-D uint8 numpy array of ``length`` bytes whose data starts on ``alignment`` bytes."""
    raw = np.empty(length + alignment, dtype=np.uint8)
    offset = -int(raw.ctypes.data) % alignment
    return raw[offset : offset + length]


#: Slabs a pool keeps for reuse (with the default 1 MiB slabs: 16 MiB).
_MAX_SLABS = 16
_NO_SLAB: U8Array = np.empty(0, dtype=np.uint8)


#: Idle checks per allocation of a pooled size class before a fresh array is allocated instead.
_TRIES = 64
#: Allocations that skip looking for idle arrays to evict after a look found none, once the pool holds more
#: than ``_SCAN_FREELY`` arrays (fewer cost little to look through every time).
_EVICT_BACKOFF = 32
_SCAN_FREELY = 64


def _size_class(need: int) -> int:
    """``need`` rounded up to its size class: steps of an eighth to a sixteenth of the size, 64 KiB at least,
    so that slightly different sizes share arrays and at most an eighth is wasted."""
    step = max(64 << 10, 1 << (need.bit_length() - 4))
    return -(-need // step) * step


class BufferPool:
    """Recycles large aligned receive buffers once nothing references them any more.

    A fresh buffer larger than malloc keeps in its heap costs a page fault per page the first time it is
    written, and is unmapped again when freed: that costs more than the socket read into it. The pool keeps
    the raw arrays behind the buffers it hands out, by size class, and reuses one when its reference count
    shows that no view of it is left (every numpy view, memoryview or pyarrow buffer over a handed-out array
    keeps the raw array alive, so a live buffer is never reused). Each size class is a queue checked from
    its oldest array, a few arrays per allocation, so that an allocation costs the same however many
    buffers the consumer keeps. Buffers smaller than ``min_bytes`` are simply allocated, except those of at
    most ``slab_max`` bytes: they are carved, aligned, from a shared ``slab_bytes`` slab (a fresh one when
    it is used up), which costs a slice instead of an allocation per small message. A slab lives as long as
    any buffer carved from it, so keeping one small batch keeps its slab (``slab_bytes``) in memory. The
    pool holds at most ``max_bytes`` of raw arrays (idle ones of other sizes are forgotten to make room);
    :meth:`clear` lets them go.
    """

    def __init__(
        self,
        max_bytes: int = 256 << 20,
        min_bytes: int = 64 << 10,
        alignment: int = ALIGNMENT,
        *,
        slab_max: int = 64 << 10,
        slab_bytes: int = 1 << 20,
    ) -> None:
        if slab_max > slab_bytes:
            raise ValueError(f"slab_max ({slab_max}) must be at most slab_bytes ({slab_bytes})")
        self._max_bytes = max_bytes
        self._min_bytes = min_bytes
        self._alignment = alignment
        self._classes: dict[int, deque[U8Array]] = {}
        self._held = 0
        self._evict_skip = 0
        self._lock = threading.Lock()
        self._slab_max = slab_max
        self._slab_bytes = slab_bytes
        self._slab: U8Array = _NO_SLAB
        self._slab_address = int(_NO_SLAB.ctypes.data)
        self._slab_pos = 0
        # Raw arrays behind slabs, reused once nothing carved from them is alive (fresh pages cost a fault
        # each on first write, more than the copy into them).
        self._slab_raws: list[U8Array] = []

    @property
    def held_bytes(self) -> int:
        """Bytes of raw arrays the pool keeps (in use or idle)."""
        return self._held

    def clear(self) -> None:
        """Forget every pooled array (arrays still in use stay valid and are freed when released)."""
        with self._lock:
            self._classes.clear()
            self._held = 0
            self._slab_raws.clear()

    def _next_slab(self) -> U8Array:
        """A slab to carve from: an idle pooled one, else a new one (pooled while fewer than
        ``_MAX_SLABS``). Called with the lock held."""
        raws = self._slab_raws
        self._slab = _NO_SLAB  # drop the view of the slab just used up: it may be idle already
        # Idle: referenced by the list and getrefcount's argument only (no slab view, no carved buffer).
        idle = next((i for i in range(len(raws)) if sys.getrefcount(raws[i]) == 2), -1)
        if idle >= 0:
            raw = raws[idle]
        else:
            raw = np.empty(self._slab_bytes + self._alignment, dtype=np.uint8)
            if len(raws) < _MAX_SLABS:
                raws.append(raw)
        offset = -int(raw.ctypes.data) % self._alignment
        return raw[offset : offset + self._slab_bytes]

    def _reuse(self, queue: deque[U8Array]) -> U8Array | None:
        """An idle array of ``queue``, moved to its end; None if the first few are all in use. Called with the
        lock held."""
        for _ in range(min(_TRIES, len(queue))):
            raw = queue.popleft()
            queue.append(raw)
            # idle: referenced by the queue, this frame and getrefcount's argument only
            if sys.getrefcount(raw) == 3:
                return raw
        return None

    def _make_room(self, size: int) -> None:
        """Forget idle arrays, largest classes first, until ``size`` more bytes fit the budget (or none is
        idle). Called with the lock held."""
        if self._evict_skip > 0:
            self._evict_skip -= 1
            return
        entries = sum(len(queue) for queue in self._classes.values())
        for cls in sorted(self._classes, reverse=True):
            queue = self._classes[cls]
            for _ in range(len(queue)):
                if self._held + size <= self._max_bytes:
                    return
                raw = queue.popleft()
                if sys.getrefcount(raw) == 2:  # idle (``raw`` and the argument): forgotten
                    self._held -= raw.nbytes
                else:
                    queue.append(raw)
            if not queue:
                del self._classes[cls]
        if self._held + size > self._max_bytes and entries > _SCAN_FREELY:
            self._evict_skip = _EVICT_BACKOFF  # all in use: the next few do not look again

    def allocate_at(self, length: int) -> tuple[U8Array, int]:
        """:meth:`allocate`, and the array's address (for a transport that hands its library addresses)."""
        if length <= self._slab_max:
            alignment = self._alignment
            with self._lock:
                pos = self._slab_pos
                end = pos + length
                slab = self._slab
                if end > slab.nbytes:
                    slab = self._slab = self._next_slab()
                    self._slab_address = int(slab.ctypes.data)
                    pos, end = 0, length
                self._slab_pos = (end + alignment - 1) & -alignment
                return slab[pos:end], self._slab_address + pos
        array = self.allocate(length)
        return array, int(array.ctypes.data)

    def allocate(self, length: int) -> U8Array:
        """An uninitialised aligned uint8 array of ``length`` bytes; reuses an idle pooled one if it can."""
        if length <= self._slab_max:
            return self.allocate_at(length)[0]  # carved from the current slab
        alignment = self._alignment
        if length < self._min_bytes:
            return aligned_empty(length, alignment)
        size = _size_class(length + alignment)
        with self._lock:
            queue = self._classes.get(size)
            raw = self._reuse(queue) if queue else None
            if raw is None:
                raw = np.empty(size, dtype=np.uint8)
                if self._held + size > self._max_bytes:
                    self._make_room(size)
                if self._held + size <= self._max_bytes:
                    if queue is None:
                        queue = self._classes[size] = deque()
                    queue.append(raw)
                    self._held += size
        offset = -int(raw.ctypes.data) % alignment
        return raw[offset : offset + length]


#: The pool behind :func:`default_allocator`.
DEFAULT_POOL = BufferPool()


def default_allocator(tag: int, length: int) -> U8Array:
    """The default placement hook: a 64-byte-aligned uninitialised numpy uint8 buffer.

    Large buffers come from :data:`DEFAULT_POOL`, which reuses the memory of buffers that are no longer
    referenced anywhere (saving the page faults of fresh memory); small ones are freshly allocated.
    """
    del tag
    return DEFAULT_POOL.allocate(length)
