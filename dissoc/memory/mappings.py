"""Another process's device allocations, mapped once per client process and kept between streams.

Mapping a CUDA IPC handle costs milliseconds (``cudaIpcOpenMemHandle``), far more than a short stream's
control; a client that fetches stream after stream from one server's device arena maps it once. Each
``memory=cuda`` pair reader :meth:`~MappedRegions.acquire` s the mapping for its data URI's handle and
:meth:`~MappedRegions.release` s it when it is done; a mapping nobody uses stays mapped for
:data:`IDLE_S` seconds, ready for the next stream, then is unmapped. At most :data:`MAX_IDLE` idle mappings
are kept (the oldest goes first), and every one goes at exit. A stream that failed releases its mapping with
``forget=True``: the server may be gone, and its next arena comes with a new handle anyway.

Nothing here reads the memory: the mapping is the backend's (:meth:`DeviceBackend.open_ipc`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time

from dissoc.memory.cuda import DeviceAllocation, DeviceBackend

__all__ = ["IDLE_S", "MAPPINGS", "MAX_IDLE", "MappedRegions"]

log = logging.getLogger(__name__)

#: Seconds an unused mapping stays open for the next stream.
IDLE_S = 30.0
#: Unused mappings kept at most (the least recently used beyond this is unmapped at once).
MAX_IDLE = 8

_Key = tuple[str, bytes, int]


class _Entry:
    __slots__ = ("allocation", "idle_since", "users")

    def __init__(self, allocation: DeviceAllocation) -> None:
        self.allocation = allocation
        self.users = 0
        self.idle_since = 0.0


class MappedRegions:
    """Mappings of other processes' device allocations, by (backend, IPC handle, length); thread-safe."""

    def __init__(self, idle_s: float = IDLE_S, max_idle: int = MAX_IDLE) -> None:
        self.idle_s = idle_s
        self.max_idle = max_idle
        self._lock = threading.Lock()
        self._entries: dict[_Key, _Entry] = {}
        self._timer: threading.Timer | None = None
        #: Mappings made (a stream that found one already mapped does not count).
        self.opened = 0

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, backend: DeviceBackend, handle: bytes, nbytes: int) -> DeviceAllocation:
        """The mapping of ``handle`` (made now unless one is kept); give it back with :meth:`release`."""
        key = (backend.name, bytes(handle), int(nbytes))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.users += 1
                return entry.allocation
        allocation = backend.open_ipc(handle, nbytes)  # (outside the lock: it may take milliseconds)
        with self._lock:
            entry = self._entries.get(key)
            made = entry is None
            if entry is None:
                entry = self._entries[key] = _Entry(allocation)
                self.opened += 1
            entry.users += 1
            kept = entry.allocation
        if not made:  # another thread mapped it meanwhile
            allocation.close()
        return kept

    def release(self, backend: DeviceBackend, handle: bytes, nbytes: int, *, forget: bool = False) -> None:
        """A reader is done with the mapping: kept for the next stream (``forget``: unmapped once unused)."""
        key = (backend.name, bytes(handle), int(nbytes))
        close: list[DeviceAllocation] = []
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.users -= 1
            if entry.users > 0:
                return
            if forget or self.idle_s <= 0:
                del self._entries[key]
                close.append(entry.allocation)
            else:
                entry.idle_since = time.monotonic()
                close.extend(self._prune(entry.idle_since))
                self._schedule()
        _close_all(close)

    def clear(self) -> None:
        """Unmap every mapping nobody uses now."""
        with self._lock:
            close = [e.allocation for e in self._entries.values() if e.users == 0]
            self._entries = {k: e for k, e in self._entries.items() if e.users > 0}
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        _close_all(close)

    def _prune(self, now: float) -> list[DeviceAllocation]:
        """Under the lock: drop the idle mappings past their time, and the oldest beyond ``max_idle``."""
        idle = sorted((e.idle_since, k) for k, e in self._entries.items() if e.users == 0)
        expired = [k for since, k in idle if now - since >= self.idle_s]
        keep = [k for since, k in idle if now - since < self.idle_s]
        expired += keep[: max(0, len(keep) - self.max_idle)]
        return [self._entries.pop(k).allocation for k in expired]

    def _schedule(self) -> None:
        """Under the lock: a sweep once the oldest idle mapping's time is up (one timer at a time)."""
        if self._timer is not None:
            return
        idle = [e.idle_since for e in self._entries.values() if e.users == 0]
        if not idle:
            return
        delay = max(0.0, min(idle) + self.idle_s - time.monotonic()) + 0.01
        self._timer = threading.Timer(delay, self._sweep)
        self._timer.daemon = True
        self._timer.start()

    def _sweep(self) -> None:
        with self._lock:
            self._timer = None
            close = self._prune(time.monotonic())
            self._schedule()
        _close_all(close)


def _close_all(allocations: list[DeviceAllocation]) -> None:
    for allocation in allocations:
        with contextlib.suppress(Exception):
            allocation.close()
        log.debug("unmapped a %d-byte device allocation", allocation.nbytes)


#: The process's mappings (closed at exit).
MAPPINGS = MappedRegions()
atexit.register(MAPPINGS.clear)
