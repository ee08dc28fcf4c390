"""Private arenas: one arena per data connection, so that a client can read only what was listed to it.

With one shared arena (:class:`~dissoc.memory.pairs.ServedArena`), whoever holds the arena's handle can read
all of it: a client of ``memory=shm`` maps the whole segment, a client of ``memory=ucx`` can GET any offset
of the registered region, whatever ticket it was given. :class:`PrivateArenas` is the server's supply of
arenas of ``capacity`` bytes each (the per-client quota, ``max_unfreed_bytes``), one per data connection
that was accepted, each with a segment (``shm``) or a registered region and remote key (``ucx``) of its own:

* :meth:`PrivateArenas.open` makes one (a ``dissoc-<pid>-<random>`` segment created with mode 0600, its
  memory reserved, registered with UCX for ``ucx``) or raises :class:`ArenasExhausted` when ``limit`` of
  them are open already: together they hold at most ``budget`` bytes (the server's ``arena_bytes``);
* :meth:`PrivateArenas.release` destroys one (deregistered, unlinked, unmapped), when its connection closes;
* :meth:`PrivateArenas.close` destroys every one still open, and the UCX context they share, when the
  server stops. A server killed with SIGKILL leaves its segments to :func:`~dissoc.memory.shm.cleanup_stale`
  (the next server's start, or ``dissoc cleanup``), as it does its shared arena.

Thread-safe: :meth:`open` and :meth:`release` may run in worker threads (making a large segment takes tens
of milliseconds, which a server keeps off its event loop).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Final

from dissoc.buffers import ALIGNMENT, align_up
from dissoc.errors import DissocError, ResourceError
from dissoc.memory.pairs import ServedArena
from dissoc.memory.shm import cleanup_stale

__all__ = ["ARENAS_EXHAUSTED", "PRIVATE_MEMORY_KINDS", "ArenasExhausted", "PrivateArenas"]

log = logging.getLogger(__name__)

PRIVATE_MEMORY_KINDS: Final = ("shm", "ucx")
"""The memory kinds private arenas exist for (a ``cuda`` arena is one device allocation, shared)."""

ARENAS_EXHAUSTED: Final = "arenas_exhausted"
"""The error code a client gets when every private arena the server may make is in use."""


class ArenasExhausted(ResourceError):
    """Every private arena the server may hold is in use: reported to the client that asked, with the error
    code :data:`ARENAS_EXHAUSTED`; the others are served."""

    code: Final = ARENAS_EXHAUSTED


class PrivateArenas:
    """A server's private arenas (see the module docstring): each ``capacity`` bytes, at most ``budget``
    bytes together, so at most :attr:`limit` open at once."""

    def __init__(self, memory: str, *, capacity: int, budget: int) -> None:
        if memory not in PRIVATE_MEMORY_KINDS:
            raise DissocError(
                f"private_memory: one arena per connection is for memory='shm' or 'ucx', not {memory!r} "
                "(a memory='cuda' arena is one device allocation shared through CUDA IPC)"
            )
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise DissocError(
                f"private_memory: expected a positive per-connection arena size, got {capacity!r}"
            )
        capacity = align_up(capacity, ALIGNMENT)
        if capacity > budget:
            raise DissocError(
                f"private_memory: each connection's arena is max_unfreed_bytes ({capacity} bytes), more than "
                f"arena_bytes ({budget}), which bounds them all together"
            )
        self.memory = memory
        #: Bytes of each arena (the per-client quota, 64-byte aligned).
        self.capacity = capacity
        #: Bytes all the open arenas may hold together (the server's ``arena_bytes``).
        self.budget = budget
        #: How many may be open at once.
        self.limit = budget // capacity
        self._lock = threading.Lock()
        self._open: set[ServedArena] = set()
        self._reserved = 0  # slots taken by arenas being made or open
        self._rma: Any = None  # one UCX context (worker) shared by every ucx arena
        self._closed = False
        #: Counters: arenas made, and requests refused because ``limit`` were open.
        self.opened = 0
        self.refused = 0
        cleanup_stale()  # once per server: the segments of dead dissoc processes

    @property
    def open_count(self) -> int:
        """Arenas open now (made and not yet released)."""
        with self._lock:
            return len(self._open)

    @property
    def registered_regions(self) -> int:
        """UCX regions registered now (``ucx``; 0 for ``shm``)."""
        rma = self._rma
        return 0 if rma is None or rma.closed else len(rma._registrations)

    def arenas(self) -> list[ServedArena]:
        """The arenas open now (a snapshot)."""
        with self._lock:
            return list(self._open)

    def names(self) -> list[str]:
        """The segment names of the arenas open now (as under ``/dev/shm``)."""
        return sorted(a.arena.name for a in self.arenas())

    def open(self) -> ServedArena:
        """A new arena of :attr:`capacity` bytes; :class:`ArenasExhausted` when :attr:`limit` are open,
        :class:`~dissoc.errors.ResourceError` when the system cannot provide the memory or the server is
        closed."""
        with self._lock:
            if self._closed:
                raise ResourceError("private arenas: the server is closed")
            if self._reserved >= self.limit:
                self.refused += 1
                raise ArenasExhausted(
                    f"this server gives each connection an arena of its own (private_memory) and all "
                    f"{self.limit} it may hold are in use (arena_bytes {self.budget} / max_unfreed_bytes "
                    f"{self.capacity}): try again later"
                )
            self._reserved += 1
            if self.memory == "ucx" and self._rma is None:
                try:
                    self._rma = _rma_context()
                except BaseException:
                    self._reserved -= 1
                    raise
            rma = self._rma
        try:
            served = ServedArena(self.memory, self.capacity, rma=rma, sweep=False)
        except BaseException:
            with self._lock:
                self._reserved -= 1
            raise
        with self._lock:
            if not self._closed:
                self._open.add(served)
                self.opened += 1
                log.debug("private arena %s (%d bytes) made", served.arena.name, self.capacity)
                return served
            self._reserved -= 1
        served.close()
        raise ResourceError("private arenas: the server is closed")

    def release(self, served: ServedArena) -> None:
        """Destroy one arena (deregistered, unlinked, unmapped); idempotent."""
        with self._lock:
            if served not in self._open:
                return
            self._open.discard(served)
            self._reserved -= 1
        name = served.arena.name
        try:
            served.close()
        finally:
            log.debug("private arena %s released", name)

    def close(self) -> None:
        """Destroy every arena still open and the UCX context they share; later :meth:`open` calls fail."""
        with self._lock:
            self._closed = True
            arenas, self._open = list(self._open), set()
            self._reserved -= len(arenas)
            rma, self._rma = self._rma, None
        for served in arenas:
            try:
                served.close()
            except DissocError:
                log.warning("closing private arena %s failed", served.arena.name, exc_info=True)
        if rma is not None:
            rma.close()

    def __repr__(self) -> str:
        return (
            f"PrivateArenas(memory={self.memory!r}, capacity={self.capacity}, limit={self.limit}, "
            f"open={self.open_count})"
        )


def _rma_context() -> Any:
    from dissoc.memory.ucx_rma import RmaContext

    context = RmaContext()
    # Reads through emulated transports (across hosts without RDMA) need this side to make progress.
    context.start_progress_thread(idle_sleep_s=0.002)
    return context
