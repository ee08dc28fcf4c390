"""The allocator every pair-list arena shares: first-fit free list, all-or-nothing batches, backpressure.

:class:`FreeListArena` hands out 64-byte aligned ranges of a fixed-size region (offsets from its start), keeps
a first-fit free list that coalesces neighbours on release, places a batch's buffers all or nothing (one
allocation per non-empty buffer, so each pair-list entry is freed on its own), and lets asyncio tasks wait for
releases while the region is full (:meth:`FreeListArena.allocate_wait`, :meth:`FreeListArena.place_wait`):
that is the server's backpressure.

A message body can also be placed whole (a :class:`Body`): one allocation, one copy, and each buffer at its
own offset in the body, so a client can take the batch as one range laid out exactly as its IPC body (a
view, or one copy, with the metadata unchanged). Its pairs are still freed one by one: the allocation goes
back when the last of them is released.

What the region *is* -- host shared memory (:class:`~dissoc.memory.shm.ShmArena`) or one device allocation
(:class:`~dissoc.memory.cuda_arena.DeviceArena`) -- is up to the subclass, which says how buffers are
measured (:meth:`FreeListArena._measure`) and copied in (:meth:`FreeListArena._fill`), whether it is still
open (:meth:`FreeListArena._check_open`), and how it names itself in messages (:attr:`FreeListArena._label`).

Allocator state is behind a lock, so :meth:`FreeListArena.release` and :meth:`FreeListArena.release_many` may
be called from any thread; waiters are woken in their own event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

from dissoc.buffers import ALIGNMENT, align_up
from dissoc.errors import ResourceError

__all__ = ["Body", "FreeListArena"]

_T = TypeVar("_T")


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass(frozen=True, slots=True)
class Body:
    """A message body to place whole: ``data`` (what the arena's :meth:`~FreeListArena.place` takes as one
    buffer) holds the message's buffers at ``spans``, one (offset, length) per buffer as the metadata lists
    them (a length of 0: an absent buffer)."""

    data: Any
    spans: Sequence[tuple[int, int]]

    def members(self) -> list[int] | None:
        """The offsets of the non-empty buffers, or None when two share an offset (then each buffer needs an
        allocation of its own, as :meth:`FreeListArena.place` gives a list of buffers)."""
        offsets = [int(o) for o, n in self.spans if n]
        return offsets if len(set(offsets)) == len(offsets) else None


class FreeListArena:
    """Allocator and backpressure over a region of ``capacity`` bytes (a multiple of :data:`ALIGNMENT`).

    Subclasses provide the memory: :meth:`_check_open`, :meth:`_measure`, :meth:`_fill` and :attr:`_label`.
    """

    #: Whether :meth:`place` takes device arrays (device-to-device copies); host arenas take host memory.
    is_device = False

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._closed = False
        self._lock = threading.Lock()
        # Allocator: allocated {offset: rounded size}; free blocks {start: size} plus sorted starts.
        self._allocated: dict[int, int] = {}
        self._free: dict[int, int] = {0: capacity}
        self._free_starts: list[int] = [0]
        self._used = 0
        # Bodies placed whole: each non-empty buffer's offset -> its allocation; allocation -> buffers held.
        self._members: dict[int, int] = {}
        self._group_left: dict[int, int] = {}
        # Tasks waiting for space: (their loop, a future to resolve when something is released).
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # -- what subclasses provide --------------------------------------------------------------------------

    @property
    def _label(self) -> str:
        """How error messages name this arena."""
        return f"arena of {self._capacity} bytes"

    def _check_open(self) -> None:
        """Raise :class:`~dissoc.errors.ResourceError` if the arena is closed."""
        if self._closed:
            raise ResourceError(f"{self._label}: expected an open arena, got a closed one")

    def _measure(self, buffers: Sequence[Any]) -> tuple[list[Any], list[int]]:
        """The buffers in the form :meth:`_fill` takes, and their sizes in bytes."""
        raise NotImplementedError

    def _fill(self, sources: list[Any], sizes: list[int], offsets: list[int]) -> None:
        """Copy each non-empty source to its offset (one offset per non-zero size, in order)."""
        raise NotImplementedError

    # -- properties ---------------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Size of the region in bytes (a multiple of 64)."""
        return self._capacity

    def close(self) -> None:
        """Give the memory back; idempotent (subclasses)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def used_bytes(self) -> int:
        """Bytes allocated (sizes rounded up to 64)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def largest_free_block(self) -> int:
        """The largest allocation that would succeed now with the default alignment."""
        with self._lock:
            return max(self._free.values(), default=0)

    @property
    def allocations(self) -> int:
        """Number of live allocations."""
        return len(self._allocated)

    def allocation_size(self, offset: int) -> int:
        """The (rounded) size of the allocation at ``offset``; KeyError if there is none."""
        return self._allocated[offset]

    def placed_bytes(self, offsets: Iterable[int]) -> int:
        """The (rounded) bytes of the allocations that the pairs at ``offsets`` lie in, each counted once (the
        buffers of a body placed whole share one); 0 for an offset that is not allocated."""
        total = 0
        seen: set[int] = set()
        with self._lock:
            for offset in offsets:
                base = self._members.get(offset, offset)
                if base not in seen:
                    seen.add(base)
                    total += self._allocated.get(base, 0)
        return total

    def _room(self) -> str:
        return f"{self.free_bytes} free of {self._capacity} (largest free block {self.largest_free_block})"

    # -- allocation ---------------------------------------------------------------------------------------

    def _check_request(self, nbytes: int, alignment: int) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"allocate: expected a positive number of bytes, got {nbytes!r}")
        if alignment < ALIGNMENT or alignment & (alignment - 1):
            raise ValueError(f"allocate: expected a power-of-two alignment >= {ALIGNMENT}, got {alignment}")
        if nbytes > self._capacity:
            raise ResourceError(
                f"{self._label}: expected at most its capacity of {self._capacity} bytes, "
                f"got a request for {nbytes}"
            )
        self._check_open()
        return align_up(nbytes, ALIGNMENT)

    def _take(self, size: int, alignment: int) -> int | None:
        """First fit; caller holds the lock."""
        for start in self._free_starts:
            block = self._free[start]
            offset = align_up(start, alignment)
            end = start + block
            if offset + size > end:
                continue
            self._remove_free(start)
            if offset > start:  # leading padding stays free
                self._insert_free(start, offset - start)
            if offset + size < end:
                self._insert_free(offset + size, end - offset - size)
            self._allocated[offset] = size
            self._used += size
            return offset
        return None

    def _remove_free(self, start: int) -> None:
        del self._free[start]
        self._free_starts.remove(start)

    def _insert_free(self, start: int, size: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free[start] = size

    def try_allocate(self, nbytes: int, alignment: int = ALIGNMENT) -> int | None:
        """Allocate ``nbytes`` now, or return ``None`` if no free block is big enough.

        Raises :class:`~dissoc.errors.ResourceError` if ``nbytes`` exceeds the capacity (it never could fit)
        or the arena is closed.
        """
        size = self._check_request(nbytes, alignment)
        with self._lock:
            return self._take(size, alignment)

    def allocate(self, nbytes: int, alignment: int = ALIGNMENT) -> int:
        """Allocate ``nbytes`` at an ``alignment``-aligned offset; returns the offset.

        Raises :class:`~dissoc.errors.ResourceError` if ``nbytes`` exceeds the capacity or no free block is
        big enough now (use :meth:`allocate_wait` to wait for releases instead).
        """
        offset = self.try_allocate(nbytes, alignment)
        if offset is None:
            raise ResourceError(f"{self._label}: expected room for {nbytes} bytes, got {self._room()}")
        return offset

    def release(self, offset: int) -> int:
        """Release the allocation at ``offset``; returns its (rounded) size and wakes waiting tasks.

        Raises :class:`ValueError` if nothing is allocated at ``offset`` (a double release is a bug).
        Safe to call from any thread.
        """
        with self._lock:
            size = self._release_locked(offset)
        self._wake()
        return size

    def release_many(self, offsets: Iterable[int]) -> int:
        """Release several allocations (all or none); returns the bytes released. Safe from any thread."""
        offsets = list(offsets)
        with self._lock:
            missing = [o for o in offsets if o not in self._allocated and o not in self._members]
            if missing or len(set(offsets)) != len(offsets):
                raise ValueError(f"release: expected distinct allocated offsets, got {offsets!r}")
            total = sum(self._release_locked(o) for o in offsets)
        self._wake()
        return total

    def _release_locked(self, offset: int) -> int:
        base = self._members.pop(offset, None)
        if base is not None:  # a buffer of a body placed whole: its allocation goes with the last one
            left = self._group_left[base] - 1
            if left:
                self._group_left[base] = left
                return 0
            del self._group_left[base]
            offset = base
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"release: expected an allocated offset, got {offset!r} (double release?)")
        self._used -= size
        start, end = offset, offset + size
        i = bisect.bisect_left(self._free_starts, start)
        if i < len(self._free_starts) and self._free_starts[i] == end:  # merge with the next block
            end += self._free.pop(end)
            del self._free_starts[i]
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free[prev] == start:  # merge with the previous block
                self._free[prev] = end - prev
                return size
        self._free_starts.insert(i, start)
        self._free[start] = end - start
        return size

    # -- waiting for space (backpressure) -----------------------------------------------------------------

    def _wake(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        if not waiters:
            return
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for loop, fut in waiters:
            if loop is current:
                _resolve(fut)
            elif not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed in between
                    loop.call_soon_threadsafe(_resolve, fut)

    async def _until(self, attempt: Callable[[], _T | None], timeout: float | None, what: str) -> _T:
        """Call ``attempt()`` (under the lock) until it returns non-None; wait for a release between tries."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                while True:
                    with self._lock:
                        result = attempt()
                        if result is not None:
                            return result
                        fut: asyncio.Future[None] = loop.create_future()
                        self._waiters.append((loop, fut))
                    try:
                        await fut
                    finally:  # woken (already removed), cancelled or timed out (still listed)
                        with self._lock, contextlib.suppress(ValueError):
                            self._waiters.remove((loop, fut))
                    self._check_open()  # closed while waiting
        except TimeoutError:
            raise ResourceError(
                f"{self._label}: expected room for {what} within {timeout} s, got {self._room()}"
            ) from None

    async def allocate_wait(
        self, nbytes: int, timeout: float | None = None, alignment: int = ALIGNMENT
    ) -> int:
        """Allocate ``nbytes``, waiting for releases while the arena is too full; returns the offset.

        Raises :class:`~dissoc.errors.ResourceError` at once if ``nbytes`` exceeds the capacity, after
        ``timeout`` seconds if no room was made, or when the arena is closed meanwhile.
        """
        size = self._check_request(nbytes, alignment)
        return await self._until(lambda: self._take(size, alignment), timeout, f"{nbytes} bytes")

    # -- placing batches ----------------------------------------------------------------------------------

    def _take_many(self, sizes: list[int]) -> list[int] | None:
        """One allocation per non-zero size, all or none; caller holds the lock."""
        offsets: list[int] = []
        for size in sizes:
            if not size:
                continue
            offset = self._take(align_up(size, ALIGNMENT), ALIGNMENT)
            if offset is None:
                for o in offsets:
                    self._release_locked(o)
                return None
            offsets.append(offset)
        return offsets

    def _prepare(self, buffers: Sequence[Any] | Body) -> tuple[list[Any], list[int]]:
        self._check_open()
        sources, sizes = self._measure([buffers.data] if isinstance(buffers, Body) else buffers)
        if isinstance(buffers, Body):
            for offset, n in buffers.spans:
                if n and (offset < 0 or offset + n > sizes[0]):
                    raise ValueError(
                        f"place: expected spans inside the {sizes[0]}-byte body, got offset {offset} "
                        f"length {n}"
                    )
        total = sum(align_up(n, ALIGNMENT) for n in sizes)
        if total > self._capacity:
            raise ResourceError(
                f"{self._label}: expected a batch of at most {self._capacity} bytes (64-byte aligned), "
                f"got {total}"
            )
        return sources, sizes

    def _placed(
        self, sources: list[Any], sizes: list[int], offsets: list[int], body: Body | None = None
    ) -> list[tuple[int, int]]:
        """Fill the allocations (giving them back if that fails) and return the pair list."""
        try:
            self._fill(sources, sizes, offsets)
        except BaseException:
            with contextlib.suppress(ValueError):
                self.release_many(offsets)
            raise
        if body is not None:
            return self._grouped(body, offsets)
        it = iter(offsets)
        return [(next(it), n) if n else (0, 0) for n in sizes]

    def _grouped(self, body: Body, offsets: list[int]) -> list[tuple[int, int]]:
        """The pairs of a body placed whole at ``offsets`` (its one allocation, or none for an empty body)."""
        members = body.members()
        if not offsets or not members:  # nothing to hold (every buffer empty)
            with contextlib.suppress(ValueError):
                self.release_many(offsets)
            return [(0, 0)] * len(body.spans)
        base = offsets[0]
        with self._lock:
            for m in members:
                self._members[base + m] = base
            self._group_left[base] = len(members)
        return [(base + int(o), int(n)) if n else (0, 0) for o, n in body.spans]

    def _unpack(self, buffers: Sequence[Any] | Body) -> tuple[Sequence[Any] | Body, Body | None]:
        """What to measure and place, and the body to place whole (None: one allocation per buffer). A body
        whose buffers share an offset is placed as one buffer per span."""
        if not isinstance(buffers, Body):
            return buffers, None
        if buffers.members() is not None:
            return buffers, buffers
        data = buffers.data
        return [data[o : o + n] if n else b"" for o, n in buffers.spans], None

    def place(self, buffers: Sequence[Any] | Body) -> list[tuple[int, int]]:
        """Copy each buffer into the arena; returns one (offset, length) pair per buffer, in order.

        One allocation per non-empty buffer, at a 64-byte aligned offset, so each pair can be freed (and
        released with :meth:`release`) on its own; an empty buffer gives ``(0, 0)`` and allocates nothing.
        A :class:`Body` is placed whole instead: one allocation and one copy, each pair at its buffer's offset
        in the body (each still released on its own; the allocation goes with the last). All or nothing:
        raises :class:`~dissoc.errors.ResourceError`, having allocated nothing, if the buffers do not all fit
        now (see :meth:`place_wait`).
        """
        what, body = self._unpack(buffers)
        sources, sizes = self._prepare(what)
        with self._lock:
            offsets = self._take_many(sizes)
        if offsets is None:
            total = sum(align_up(n, ALIGNMENT) for n in sizes)
            raise ResourceError(
                f"{self._label}: expected room for a batch of {total} bytes, got {self._room()}"
            )
        return self._placed(sources, sizes, offsets, body)

    async def place_wait(
        self, buffers: Sequence[Any] | Body, timeout: float | None = None
    ) -> list[tuple[int, int]]:
        """Like :meth:`place`, but waits for releases while the batch does not fit (backpressure).

        Never holds part of a batch while waiting, so concurrent waiters cannot deadlock each other.
        Raises :class:`~dissoc.errors.ResourceError` at once if the batch exceeds the capacity, after
        ``timeout`` seconds, or when the arena is closed meanwhile.
        """
        what, body = self._unpack(buffers)
        sources, sizes = self._prepare(what)
        total = sum(align_up(n, ALIGNMENT) for n in sizes)
        offsets = await self._until(lambda: self._take_many(sizes), timeout, f"a batch of {total} bytes")
        return self._placed(sources, sizes, offsets, body)
