"""The inbox of a connection: received tagged messages nobody claimed yet, and the consumers waiting for some.

:class:`TaggedStore` holds messages in arrival order and finds the oldest one matching a ``(tag, mask)`` in
O(1); :class:`TagWaiters` holds the consumers blocked in ``recv_tagged`` and finds the one that waited longest
for a given tag. :class:`~dissoc.transport.base.Connection` uses both; transports only read the waiters.
"""

from __future__ import annotations

import asyncio
from collections import deque

from dissoc.transport.message import TaggedMessage

__all__ = ["Held", "TagWaiters", "TaggedStore", "Waiter"]


class Held:
    """A received tagged message, its size, its place in arrival order, and whether a consumer took it."""

    __slots__ = ("message", "nbytes", "order", "taken")

    def __init__(self, message: TaggedMessage, nbytes: int, order: int = 0) -> None:
        self.message = message
        self.nbytes = nbytes
        self.order = order
        self.taken = False


class TaggedStore:
    """Held tagged messages, in arrival order, found by (tag, mask) in O(1).

    One index per mask that consumers have used (built on first use, then kept up to date on arrival). A
    message taken through one index leaves a stale entry in the others; an index with too many is dropped and
    rebuilt when next used.
    """

    _MAX_INDEXES = 8

    def __init__(self) -> None:
        self._live: dict[int, Held] = {}
        self._next = 0
        self._first = 0
        self._indexes: dict[int, dict[int, deque[Held]]] = {}
        self._stale: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(self, message: TaggedMessage, nbytes: int, *, front: bool = False) -> None:
        """Hold a message: at the back (arrival), or at the front (given back by a cancelled consumer)."""
        if front:
            self._first -= 1
            held = Held(message, nbytes, self._first)
        else:
            self._next += 1
            held = Held(message, nbytes, self._next)
        self._live[id(held)] = held
        tag = message.tag
        for mask, index in self._indexes.items():
            queue = index.get(tag & mask)
            if queue is None:
                index[tag & mask] = deque((held,))
            elif front:
                queue.appendleft(held)
            else:
                queue.append(held)

    def _index(self, mask: int) -> dict[int, deque[Held]]:
        index = self._indexes.get(mask)
        if index is None:
            if len(self._indexes) >= self._MAX_INDEXES:
                oldest = next(iter(self._indexes))
                del self._indexes[oldest]
                del self._stale[oldest]
            index = {}
            for held in sorted(self._live.values(), key=lambda h: h.order):
                key = held.message.tag & mask
                queue = index.get(key)
                if queue is None:
                    index[key] = deque((held,))
                else:
                    queue.append(held)
            self._indexes[mask] = index
            self._stale[mask] = 0
        return index

    def take(self, tag: int, mask: int) -> Held | None:
        """Remove and return the oldest held message matching ``tag`` under ``mask``, or None."""
        if not self._live:
            return None
        index = self._index(mask)
        key = tag & mask
        queue = index.get(key)
        if queue is None:
            return None
        found: Held | None = None
        while queue:
            held = queue.popleft()
            if held.taken:
                self._stale[mask] -= 1
                continue
            found = held
            break
        if not queue:
            del index[key]
        if found is None:
            return None
        found.taken = True
        del self._live[id(found)]
        if not self._live:
            self._indexes.clear()
            self._stale.clear()
            return found
        limit = len(self._live) + 64
        for other in list(self._indexes):
            if other != mask:
                self._stale[other] += 1
                if self._stale[other] > limit:
                    del self._indexes[other]
                    del self._stale[other]
        return found

    def drain(self) -> list[Held]:
        """Remove and return every held message, in arrival order."""
        held = sorted(self._live.values(), key=lambda h: h.order)
        for h in held:
            h.taken = True
        self.clear()
        return held

    def clear(self) -> None:
        self._live.clear()
        self._indexes.clear()
        self._stale.clear()


class Waiter:
    """A consumer blocked in ``recv_tagged``: what it asked for, when, and the future that gets it."""

    __slots__ = ("future", "mask", "order", "tag")

    def __init__(self, tag: int, mask: int, order: int, future: asyncio.Future[Held]) -> None:
        self.tag = tag
        self.mask = mask
        self.order = order
        self.future = future


class TagWaiters:
    """Consumers blocked in ``recv_tagged``, indexed by mask then masked tag; the earliest match wins."""

    def __init__(self) -> None:
        self._by_mask: dict[int, dict[int, deque[Waiter]]] = {}
        self._order = 0

    def add(self, tag: int, mask: int, future: asyncio.Future[Held]) -> Waiter:
        self._order += 1
        waiter = Waiter(tag, mask, self._order, future)
        index = self._by_mask.setdefault(mask, {})
        index.setdefault(tag & mask, deque()).append(waiter)
        return waiter

    def discard(self, waiter: Waiter) -> None:
        index = self._by_mask.get(waiter.mask)
        if index is None:
            return
        key = waiter.tag & waiter.mask
        queue = index.get(key)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if not queue:
            del index[key]
            if not index:
                del self._by_mask[waiter.mask]

    def _first(self, tag: int) -> tuple[Waiter, int, deque[Waiter]] | None:
        best: tuple[Waiter, int, deque[Waiter]] | None = None
        for mask, index in self._by_mask.items():
            queue = index.get(tag & mask)
            if not queue:
                continue
            while queue and queue[0].future.done():
                queue.popleft()
            if queue and (best is None or queue[0].order < best[0].order):
                best = (queue[0], mask, queue)
        return best

    def has_match(self, tag: int) -> bool:
        return self._first(tag) is not None

    def pop_match(self, tag: int) -> Waiter | None:
        best = self._first(tag)
        if best is None:
            return None
        waiter, mask, queue = best
        queue.popleft()
        if not queue:
            index = self._by_mask[mask]
            del index[tag & mask]
            if not index:
                del self._by_mask[mask]
        return waiter

    def any_pending(self) -> bool:
        """Whether some consumer still waits (its future not yet resolved)."""
        return any(not w.future.done() for index in self._by_mask.values() for q in index.values() for w in q)

    def all(self) -> list[Waiter]:
        return [w for index in self._by_mask.values() for queue in index.values() for w in queue]

    def clear(self) -> None:
        self._by_mask.clear()
