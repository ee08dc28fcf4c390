"""Resident placements: a batch placed in the arena once is listed to every client that asks for it.

With pair-list bodies (body type 1) a server copies each batch's buffers into its arena and lists the ranges
to the client. For a dataset whose messages are the same on every request (stored or in-memory data), that
copy need only happen once: :class:`Placements` keeps the placed batch *resident* and lists the same ranges
to the next client that asks, with no copy, so the time from asking to holding a batch does not grow with
its size.

A resident placement is keyed by (the dataset's :class:`Scope`, the message's sequence number in its
stream) and remembers its pairs, its arena offsets, which clients hold it now, and when it was last used.

* :meth:`Placements.acquire` returns the cached pairs (the client now holds them) or places the batch
  (:meth:`Placements.place`) and caches it. A client that already holds a placement (it asked for the same
  stream again without freeing the first listing) gets a private copy: free_data lists each range once per
  client, so a range can be listed to one client only once at a time.
* :meth:`Placements.release` is what free_data and disconnects call instead of the arena's ``release_many``:
  it lets go of the client's hold on resident ranges and releases the other (per-request) ranges in the
  arena as before.
* A placement nobody holds stays resident until the arena needs room: :meth:`Placements.place_now` evicts
  such placements, least recently used first, when a batch does not fit, and while a task waits for room
  (:meth:`Placements.waiting`) a placement is released as soon as its last holder lets go. A placement is
  never released while a client holds it.
* :meth:`Placements.forget` drops a dataset's placements when it is removed or replaced (released now if
  unreferenced, otherwise when the last holder lets go); :meth:`Placements.close` forgets everything.

No sockets: the bookkeeping methods may be called from any thread (state is behind a lock; the arena's
release is thread-safe too); :meth:`Placements.acquire` and :meth:`Placements.place` wait for room on the
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dissoc.buffers import ALIGNMENT
from dissoc.errors import DissocError, ResourceError, TransportError
from dissoc.memory.arena import Body

__all__ = ["Placements", "Scope"]

log = logging.getLogger(__name__)

Pairs = list[tuple[int, int]]


def _rounded(length: int) -> int:
    return (length + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


@dataclass(eq=False, slots=True)
class Scope:
    """One version of one dataset whose placements may be resident (what cache keys start with)."""

    token: int
    dataset: Any
    version: Hashable = None
    retired: bool = False
    entries: dict[int, _Placement] = field(default_factory=dict)  # message index -> placement

    @property
    def name(self) -> str:
        return str(getattr(self.dataset, "name", "?"))


@dataclass(eq=False, slots=True)
class _Placement:
    scope: Scope
    index: int
    pairs: Pairs
    offsets: list[int]
    nbytes: int  # arena bytes (rounded as the arena rounds)
    holders: dict[Hashable, int] = field(default_factory=dict)  # client -> how many of `offsets` it holds
    retired: bool = False  # its dataset was dropped: released when the last holder lets go

    @property
    def key(self) -> tuple[int, int]:
        return (self.scope.token, self.index)


class Placements:
    """The resident placements of one arena (see the module docstring).

    ``resident=False`` caches nothing: every request places its own copy and :meth:`release` releases it in
    the arena, as without this class.
    """

    def __init__(self, arena: Any, *, resident: bool = True) -> None:
        self.arena = arena
        self.resident = resident
        self._lock = threading.RLock()
        self._tokens = itertools.count(1)
        self._scopes: dict[str, Scope] = {}  # dataset name -> its current scope
        self._by_offset: dict[int, _Placement] = {}  # every offset of every resident placement
        self._idle: OrderedDict[tuple[int, int], _Placement] = OrderedDict()  # unreferenced, oldest first
        self._resident_bytes = 0
        self._idle_bytes = 0
        self._hungry = 0  # tasks waiting for room in the arena
        self._closed = False
        #: Counters: batches listed from a resident placement / placed in the arena / evicted.
        self.hits = 0
        self.placed = 0
        self.evicted = 0

    # -- queries --------------------------------------------------------------------------------------------

    @property
    def resident_bytes(self) -> int:
        """Arena bytes of resident placements, held or not."""
        return self._resident_bytes

    @property
    def idle_bytes(self) -> int:
        """Arena bytes of resident placements no client holds (what eviction can give back)."""
        return self._idle_bytes

    @property
    def held_bytes(self) -> int:
        """Arena bytes in use other than idle resident placements: what clients hold (and batches being
        placed). 0 once every client has freed everything listed to it."""
        return int(self.arena.used_bytes) - self._idle_bytes

    @property
    def hungry(self) -> int:
        """Tasks waiting for room in the arena now (a client over its quota is held back only then)."""
        return self._hungry

    def __len__(self) -> int:
        """Number of resident placements (those of dropped datasets that clients still hold included)."""
        with self._lock:
            return len({id(p) for p in self._by_offset.values()})

    def is_resident(self, offset: int) -> bool:
        with self._lock:
            return offset in self._by_offset

    def __repr__(self) -> str:
        return (
            f"Placements(resident={self.resident}, placements={len(self)}, "
            f"resident_bytes={self._resident_bytes}, idle_bytes={self._idle_bytes})"
        )

    # -- scopes ---------------------------------------------------------------------------------------------

    def scope(
        self, dataset: Any, *, version: Hashable = None, current: Callable[[], bool] | None = None
    ) -> Scope | None:
        """The scope that ``dataset``'s placements are cached under, or ``None`` when they must not be
        (``resident=False``, closed, or ``current()`` says the dataset is no longer the one served under its
        name: a request that began before a replacement gets per-request copies).

        ``version`` tells apart contents of one dataset object that may change (a stream file rewritten on
        disk): a new version retires the old one's placements.
        """
        if not self.resident:
            return None
        name = str(dataset.name)
        with self._lock:
            if self._closed:
                return None
            scope = self._scopes.get(name)
            if scope is not None and scope.dataset is dataset and scope.version == version:
                return scope
            if current is not None and not current():
                return None
            if scope is not None:
                self._retire(scope)
            scope = Scope(next(self._tokens), dataset, version)
            self._scopes[name] = scope
            log.debug("resident placements for %r (scope %d)", name, scope.token)
            return scope

    def forget(self, name: str) -> None:
        """Drop the placements of the dataset served as ``name`` (removed or replaced): each is released now
        if no client holds it, otherwise when its last holder lets go."""
        with self._lock:
            scope = self._scopes.pop(name, None)
            if scope is not None:
                self._retire(scope)

    def _retire(self, scope: Scope) -> None:
        if self._scopes.get(scope.name) is scope:
            del self._scopes[scope.name]
        scope.retired = True
        entries, scope.entries = list(scope.entries.values()), {}
        freed: list[int] = []
        for p in entries:
            p.retired = True
            if not p.holders:
                freed += self._drop(p)
        log.debug(
            "dropped the resident placements of %r (scope %d): %d, %d released now",
            scope.name,
            scope.token,
            len(entries),
            sum(1 for p in entries if not p.holders),
        )
        self._release_in_arena(freed)

    # -- listing --------------------------------------------------------------------------------------------

    async def acquire(
        self,
        client: Hashable,
        scope: Scope | None,
        index: int,
        buffers: Callable[[], Sequence[Any] | Body],
        *,
        gone: Callable[[], bool],
        what: str = "client",
    ) -> Pairs:
        """The pairs to list to ``client`` for message ``index`` of ``scope``'s stream: the resident ones
        (``client`` now holds them), or ``buffers()`` placed by :meth:`place` (cached as resident when it can
        be). ``buffers`` is called only when a placement is needed; ``gone()`` says whether the client left.

        With ``scope=None`` nothing is cached: the placement is ``client``'s alone.
        """
        pairs = self.lookup(client, scope, index)
        if pairs is not None:
            return pairs
        placed = await self.place(buffers(), gone=gone, what=what)
        return self.insert(client, scope, index, placed)

    async def place(
        self, buffers: Sequence[Any] | Body, *, gone: Callable[[], bool], what: str = "client"
    ) -> Pairs:
        """Place a batch in the arena: at once if it fits, evicting resident placements nobody holds (oldest
        first) if that makes it fit, else waiting for frees, but not past the client's departure (``gone()``
        turns true: a client that holds its batches and leaves, or a server closing, must not leave this task
        waiting; :class:`~dissoc.errors.TransportError` then)."""
        now = self.place_now(buffers)
        if now is not None:
            return now
        arena = self.arena
        with self.waiting():  # meanwhile a resident placement is released when its last holder frees it
            placing = asyncio.ensure_future(arena.place_wait(buffers))
            returned = False
            try:
                while True:
                    done, _ = await asyncio.wait({placing}, timeout=0.25)
                    if done:
                        pairs: Pairs = placing.result()
                        returned = True
                        return pairs
                    if gone():
                        raise TransportError(f"{what}: closed while waiting for room in the arena")
            finally:
                if not placing.done():
                    placing.cancel()
                    with contextlib.suppress(asyncio.CancelledError, DissocError):
                        await placing
                if (
                    not returned
                    and placing.done()
                    and not placing.cancelled()
                    and placing.exception() is None
                ):
                    # placed, but nobody will list it
                    arena.release_many(offset for offset, _ in placing.result())

    def lookup(self, client: Hashable, scope: Scope | None, index: int) -> Pairs | None:
        """The resident pairs of (``scope``, ``index``), now held by ``client`` too; ``None`` on a miss (or
        when ``client`` already holds them: it needs a copy of its own)."""
        if scope is None:
            return None
        with self._lock:
            p = scope.entries.get(index)
            if p is None or scope.retired or client in p.holders:
                return None
            self._hold(p, client)
            self.hits += 1
            log.debug(
                "message %d of %r listed to %r from its resident placement at %s",
                index,
                scope.name,
                client,
                _fmt(p.offsets),
            )
            return list(p.pairs)

    def insert(
        self, client: Hashable, scope: Scope | None, index: int, pairs: Sequence[tuple[int, int]]
    ) -> Pairs:
        """Record a placement just made for ``client``; returns the pairs to list to it.

        Cached as resident (held by ``client``) when ``scope`` allows it and nothing is cached there yet;
        when another task cached the same message meanwhile, the fresh copy is released and the resident
        one listed instead (unless ``client`` already holds that one).
        """
        placed = [(int(o), int(n)) for o, n in pairs]
        offsets = [o for o, n in placed if n]
        placed_bytes = getattr(self.arena, "placed_bytes", None)
        nbytes = (
            placed_bytes(offsets) if placed_bytes is not None else sum(_rounded(n) for _, n in placed if n)
        )
        with self._lock:
            self.placed += 1
            if scope is None or scope.retired or self._closed or not offsets:
                return placed
            cached = scope.entries.get(index)
            if cached is not None:
                if client in cached.holders:
                    return placed  # a private copy for a client that holds the resident one
                self._hold(cached, client)
                self.hits += 1
                self._release_in_arena(offsets)
                return list(cached.pairs)
            p = _Placement(scope, index, placed, offsets, nbytes)
            scope.entries[index] = p
            for o in offsets:
                self._by_offset[o] = p
            self._resident_bytes += nbytes
            p.holders[client] = len(offsets)
            log.debug(
                "message %d of %r placed resident at %s (%d bytes)", index, scope.name, _fmt(offsets), nbytes
            )
            return list(placed)

    def _hold(self, p: _Placement, client: Hashable) -> None:
        if not p.holders:
            self._idle.pop(p.key, None)
            self._idle_bytes -= p.nbytes
        p.holders[client] = len(p.offsets)

    # -- letting go -----------------------------------------------------------------------------------------

    def release(self, client: Hashable, ranges: Iterable[tuple[int, int]] | Iterable[int]) -> int:
        """``client`` let go of ``ranges`` (freed with free_data, or dropped when it left): its hold on
        resident placements ends, and the other ranges are released in the arena. Returns the bytes
        released in the arena now.

        The ledger has checked that ``client`` held every one of them.
        """
        offsets = [int(r[0]) if isinstance(r, tuple) else int(r) for r in ranges]
        if not offsets:
            return 0
        freed: list[int] = []
        with self._lock:
            if self._closed:
                return 0  # the arena goes with the server
            for o in offsets:
                p = self._by_offset.get(o)
                if p is None:
                    freed.append(o)  # a per-request placement
                    continue
                left = p.holders.get(client, 0) - 1
                if left > 0:
                    p.holders[client] = left
                    continue
                p.holders.pop(client, None)
                if p.holders:
                    continue
                if p.retired or self._hungry:
                    freed += self._drop(p)  # dropped dataset, or someone waits for room: release now
                else:
                    self._idle[p.key] = p
                    self._idle_bytes += p.nbytes
            return self._release_in_arena(freed)

    def _drop(self, p: _Placement) -> list[int]:
        """Forget a placement nobody holds; returns its offsets for the caller to release in the arena."""
        if self._idle.pop(p.key, None) is not None:
            self._idle_bytes -= p.nbytes
        if p.scope.entries.get(p.index) is p:
            del p.scope.entries[p.index]
        for o in p.offsets:
            self._by_offset.pop(o, None)
        self._resident_bytes -= p.nbytes
        log.debug("released the placement of message %d of %r at %s", p.index, p.scope.name, _fmt(p.offsets))
        return p.offsets

    def _release_in_arena(self, offsets: list[int]) -> int:
        if not offsets or self._closed:
            return 0
        released: int = self.arena.release_many(offsets)
        return released

    def evict_one(self) -> int:
        """Release the least recently used placement nobody holds; returns the arena bytes given back (0 when
        there is none)."""
        with self._lock:
            if not self._idle:
                return 0
            _, p = self._idle.popitem(last=False)
            self._idle_bytes -= p.nbytes
            self.evicted += 1
            log.debug("evicting message %d of %r at %s to make room", p.index, p.scope.name, _fmt(p.offsets))
            return self._release_in_arena(self._drop(p))

    def evict_idle(self) -> int:
        """Release every placement nobody holds; returns the arena bytes given back."""
        total = 0
        while released := self.evict_one():
            total += released
        return total

    # -- making room ----------------------------------------------------------------------------------------

    def place_now(self, buffers: Sequence[Any] | Body) -> Pairs | None:
        """Place ``buffers`` in the arena now, evicting unreferenced placements (oldest first) while they do
        not fit; ``None`` if they still do not fit with nothing left to evict (then wait for room, with
        :meth:`waiting`, e.g. by the arena's ``place_wait``).

        Raises what the arena raises when it is closed.
        """
        while True:
            try:
                pairs: Pairs = self.arena.place(buffers)
                return pairs
            except ResourceError:
                if getattr(self.arena, "closed", False):
                    raise
                if not self.evict_one():
                    return None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """While inside, a placement is released as soon as its last holder lets go (someone needs room);
        unreferenced placements already resident are evicted on entry."""
        with self._lock:
            self._hungry += 1
        try:
            self.evict_idle()
            yield
        finally:
            with self._lock:
                self._hungry -= 1

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Forget every placement, releasing them in the arena (which closes with the server anyway); later
        releases are ignored."""
        with self._lock:
            if self._closed:
                return
            for scope in self._scopes.values():
                scope.retired = True
            self._scopes.clear()
            freed: list[int] = []
            for p in {id(p): p for p in self._by_offset.values()}.values():
                p.retired = True
                freed += self._drop(p)
            with contextlib.suppress(ValueError, ResourceError):
                self._release_in_arena(freed)
            self._closed = True
        log.debug("resident placements closed: %d ranges released", len(freed))


def _fmt(offsets: Sequence[int]) -> str:
    shown = ", ".join(f"{o:#x}" for o in offsets[:4])
    return f"[{shown}{', ...' if len(offsets) > 4 else ''}]"
