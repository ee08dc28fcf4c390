"""Device memory arena: the server side of pairs with ``memory=cuda``.

:class:`DeviceArena` is one dedicated device allocation of ``capacity`` bytes (from the process's
:func:`~dissoc.memory.cuda.get_backend`), with the allocator, all-or-nothing batch placement and
backpressure of :class:`~dissoc.memory.arena.FreeListArena`, as :class:`~dissoc.memory.shm.ShmArena` has
them. Pair lists carry offsets from the allocation's base; the data URI's ``remote_handle`` is
:attr:`DeviceArena.handle`, the 64-byte IPC handle of that allocation, and ``cuda_length`` its size, so a
client opens it once per stream and bounds every read.

:meth:`DeviceArena.place` takes host buffers (anything with the buffer protocol: ``pa.Buffer``,
``memoryview``, numpy arrays), copied host-to-device, and device arrays of the backend, copied
device-to-device; :meth:`DeviceArena.place_spans` places ranges of one device body. Copies are complete
(the backend synchronised) when ``place`` returns, so the pairs may be sent at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from dissoc.buffers import ALIGNMENT, align_up, byte_view
from dissoc.errors import ResourceError
from dissoc.memory.arena import FreeListArena
from dissoc.memory.cuda import DeviceAllocation, DeviceArray, DeviceBackend, get_backend

__all__ = ["DeviceArena"]

log = logging.getLogger(__name__)


def _close_if_creator(allocation: DeviceAllocation, creator_pid: int) -> None:
    """Finalizer: free an allocation this process made and never closed (not from a forked child)."""
    if os.getpid() == creator_pid:
        with contextlib.suppress(Exception):
            allocation.close()


class DeviceArena(FreeListArena):
    """One device allocation with an allocator over it (offsets from its base, multiples of 64).

    Create with :meth:`create`; close with :meth:`close` (or use it as a context manager), which frees the
    allocation and makes waiting tasks raise :class:`~dissoc.errors.ResourceError`. Device arrays already
    handed out by :meth:`view` keep the memory valid (CuPy) until they go.
    """

    #: Takes device arrays as they are (device-to-device copies); host arenas need host memory.
    is_device = True

    def __init__(self, backend: DeviceBackend, allocation: DeviceAllocation, capacity: int) -> None:
        """Use :meth:`create`."""
        super().__init__(capacity)
        self._backend = backend
        self._allocation: DeviceAllocation | None = allocation
        self._handle = backend.ipc_handle(allocation)
        self._finalizer = weakref.finalize(self, _close_if_creator, allocation, os.getpid())

    @classmethod
    def create(cls, capacity: int, *, backend: DeviceBackend | None = None) -> DeviceArena:
        """Allocate ``capacity`` bytes (rounded up to 64) of device memory from ``backend`` (default:
        :func:`~dissoc.memory.cuda.get_backend`).

        Raises :class:`ValueError` for a bad capacity and :class:`~dissoc.errors.ResourceError` when there is
        no device (the message names the ``gpu`` extra) or not enough device memory.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        capacity = align_up(capacity, ALIGNMENT)
        backend = get_backend() if backend is None else backend
        allocation = backend.allocate(capacity)
        try:
            arena = cls(backend, allocation, capacity)
        except BaseException:
            allocation.close()
            raise
        log.debug("device arena of %d bytes on %s", capacity, backend.name)
        return arena

    # -- properties ---------------------------------------------------------------------------------------

    @property
    def backend(self) -> DeviceBackend:
        """The device backend the allocation came from."""
        return self._backend

    @property
    def allocation(self) -> DeviceAllocation:
        """The base allocation (:class:`~dissoc.errors.ResourceError` once closed)."""
        self._check_open()
        assert self._allocation is not None
        return self._allocation

    @property
    def handle(self) -> bytes:
        """What goes into the URI's ``remote_handle``: the 64-byte IPC handle of the base allocation."""
        return self._handle

    def view(self, offset: int, length: int) -> DeviceArray:
        """A uint8 device array over ``[offset, offset + length)`` of the arena (no copy).

        Raises :class:`ValueError` for a range outside the arena, :class:`~dissoc.errors.ResourceError` once
        the arena is closed.
        """
        return self._backend.view(self.allocation, int(offset), int(length))

    # -- what the allocator needs -------------------------------------------------------------------------

    @property
    def _label(self) -> str:
        return f"device arena ({self._backend.name}, {self._capacity} bytes)"

    def _check_open(self) -> None:
        if self._allocation is None:
            raise ResourceError(f"{self._label}: expected an open arena, got a closed one")

    def _device_bytes(self, array: DeviceArray) -> DeviceArray:
        if len(array.shape) != 1:
            raise TypeError(f"place: expected one-dimensional device arrays, got shape {array.shape}")
        if array.dtype != np.uint8:
            try:
                array = array.view(np.uint8)
            except ValueError:
                raise TypeError(
                    f"place: expected contiguous device arrays, got a strided one of {array.dtype}"
                ) from None
        return array

    def _measure(self, buffers: Sequence[Any]) -> tuple[list[DeviceArray | memoryview], list[int]]:
        sources: list[DeviceArray | memoryview] = []
        for buf in buffers:
            if self._backend.is_device_array(buf):
                sources.append(self._device_bytes(buf))
            else:
                sources.append(byte_view(buf))
        return sources, [int(s.nbytes) for s in sources]

    def _fill(self, sources: list[DeviceArray | memoryview], sizes: list[int], offsets: list[int]) -> None:
        backend = self._backend
        allocation = self.allocation
        it = iter(offsets)
        for src, n in zip(sources, sizes, strict=True):
            if not n:
                continue
            dst = backend.view(allocation, next(it), n)
            if isinstance(src, memoryview):
                backend.upload_into(dst, src)
            else:
                backend.copy(dst, src)
        # The pairs go to another process next: every copy must have landed by then.
        backend.synchronize()

    # -- device bodies ------------------------------------------------------------------------------------

    def _spans(self, body: object, spans: Sequence[tuple[int, int]]) -> list[DeviceArray | bytes]:
        if not self._backend.is_device_array(body):
            raise TypeError(f"place_spans: expected a device array of {self._backend.name}, got {type(body)}")
        body = self._device_bytes(body)
        size = int(body.nbytes)
        out: list[DeviceArray | bytes] = []
        for offset, length in spans:
            offset, length = int(offset), int(length)
            if offset < 0 or length < 0 or offset + length > size:
                raise ValueError(
                    f"place_spans: expected spans inside the {size}-byte body, got offset {offset} "
                    f"length {length}"
                )
            out.append(body[offset : offset + length] if length else b"")
        return out

    def place_spans(self, body: object, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """:meth:`place` for ranges of one device array ``body``: one (offset, length) span per buffer.

        Each non-empty span is copied device-to-device to its own allocation; empty ones give ``(0, 0)``.
        Raises :class:`ValueError` for a span outside ``body``.
        """
        return self.place(self._spans(body, spans))

    # -- lifetime -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the allocation; idempotent. Waiting tasks get :class:`~dissoc.errors.ResourceError`."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        allocation, self._allocation = self._allocation, None
        if allocation is not None:
            allocation.close()
        self._wake()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"used={self._used}"
        return f"DeviceArena(backend={self._backend.name!r}, capacity={self._capacity}, {state})"
