"""Where a stream's small packed bodies land on the host: side by side in slabs of the session's own, each
after room for its IPC framing, so that the codec reads it where it lies (no allocation or copy per batch).

A transport lends small payloads from its staging buffer for the length of a call only
(``Receiver.on_messages(..., lent=True)``); :meth:`Slabs.land` copies one into the current slab as its message
is released, and the batch decoded from it later keeps the slab alive (the pool hands the slab out again
once no batch does). A transport that receives each payload into an address of its choosing (UCX) is given
room in the slab instead, before the body arrives (:meth:`Slabs.reserve`, through the connection's lander),
and the body lands there with no copy at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pyarrow as pa

from dissoc.buffers import ALIGNMENT, DEFAULT_POOL
from dissoc.codec import Landing, MessageDecoder, frame_room

__all__ = ["SLAB_BYTES", "Landed", "Slabs", "copied"]

#: Bytes of one landing slab.
SLAB_BYTES = 1 << 20
#: Distinct metadata a stream's slabs keep the one-read landing of (a stream of same-shaped batches has one).
_PLAIN_KEPT = 64
#: The largest landing that shares a slab with others (larger bodies get an allocation of their own).
_SHARED_MAX = SLAB_BYTES // 4
_ALIGN_UP = ALIGNMENT - 1
_ALIGN_MASK = -ALIGNMENT
_NO_SLAB = pa.py_buffer(b"")


class Landed(NamedTuple):
    """A body landed after room for its framing: ``framed`` holds room and body; ``plain`` reads it in one
    step where the layout leaves nothing in the body to check (else ``MessageDecoder.decode_landed``)."""

    framed: pa.Buffer
    plain: Landing | None


_new_landed = tuple.__new__  # (without the NamedTuple's Python-level __new__: one is made per batch)


def copied(staged: memoryview) -> object:
    """A lent payload copied out into a pooled buffer (as the transport would have received it)."""
    body = DEFAULT_POOL.allocate(len(staged))
    body.data[:] = staged
    return body


class Slabs:
    """Lands bodies for one decoder (see the module's text)."""

    __slots__ = ("_address", "_decoder", "_plain", "_pos", "_slab", "_view", "find")

    def __init__(self, decoder: MessageDecoder, find: Callable[[int], bytes | None] | None = None) -> None:
        self._decoder = decoder
        #: ``find(tag)``: the metadata a packed body tagged so will be released with, if known (land_tagged).
        self.find = find
        self._pos = SLAB_BYTES
        self._view = memoryview(b"")
        self._slab = _NO_SLAB
        self._address = 0
        #: The decoder's one-read landings by metadata, once it has one (the per-message path asks here).
        self._plain: dict[bytes, tuple[Landing | None, int, bytes]] = {}

    def land_tagged(self, tag: int, length: int) -> tuple[Landed, int] | None:
        """A connection's lander (``Connection.set_lander``): :meth:`reserve` for a packed body whose metadata
        ``find`` knows; None (the allocator's) for any other tagged message."""
        find = self.find
        metadata = find(tag) if find is not None else None
        return None if metadata is None else self.reserve(metadata, length)

    def reserve(self, metadata: bytes, nbytes: int) -> tuple[Landed, int] | None:
        """Room in the current slab for a packed body of ``nbytes`` that a transport will receive itself,
        after room for ``metadata``'s framing (the framing is written now): the :class:`Landed` to decode it
        from once it has arrived, and the address its bytes go to. None for a body too large to share a slab
        (the transport's allocator gives it a buffer of its own)."""
        known = self._plain.get(metadata)
        if known is None:
            known = self._landing_of(metadata)
        plain, room, head = known
        need = room + nbytes
        if need > _SHARED_MAX:
            return None
        pos = self._pos
        if pos + need > SLAB_BYTES:
            pos = self._next()
        self._pos = (pos + need + _ALIGN_UP) & _ALIGN_MASK
        if plain is not None:
            self._view[pos : pos + room] = head
            return _new_landed(Landed, (self._slab.slice(pos, need), plain)), self._address + pos + room
        landed = _new_landed(Landed, (pa.py_buffer(self._view[pos : pos + need]), None))
        return landed, self._address + pos + room

    def _landing_of(self, metadata: bytes) -> tuple[Landing | None, int, bytes]:
        """The decoder's one-read landing for ``metadata`` (kept once it has one), its room and head."""
        plain = self._decoder.landing(metadata)
        if plain is None:
            return None, frame_room(len(metadata)), b""
        known = (plain, plain.room, plain.head)
        if len(self._plain) < _PLAIN_KEPT:
            self._plain[metadata] = known
        return known

    def _next(self) -> int:
        """A fresh slab to land in (an idle pooled one, once nothing uses it): its first position."""
        slab = DEFAULT_POOL.allocate(SLAB_BYTES)
        self._view = slab.data
        self._slab = pa.py_buffer(slab)
        self._address = self._slab.address
        return 0

    def land(self, staged: memoryview, metadata: bytes | None) -> object:
        """``staged`` (a packed body lent by the transport) landed for decoding with ``metadata``; without
        metadata (a body that came before it), a plain copy."""
        if metadata is None:
            return copied(staged)
        known = self._plain.get(metadata)
        plain, room, head = known if known is not None else self._landing_of(metadata)
        nbytes = len(staged)
        need = room + nbytes
        pos = self._pos
        if pos + need > SLAB_BYTES:
            if need > _SHARED_MAX:  # a large body: an allocation of its own
                landing = DEFAULT_POOL.allocate(need)
                landing.data[room:] = staged
                return _new_landed(Landed, (pa.py_buffer(landing), None))
            pos = self._next()
        end = pos + need
        view = self._view
        view[pos + room : end] = staged
        self._pos = (end + _ALIGN_UP) & _ALIGN_MASK
        if plain is not None:
            # the framing before the body: one read of a slice of the slab (whose batches then hold the slab
            # through pyarrow alone)
            view[pos : pos + room] = head
            return _new_landed(Landed, (self._slab.slice(pos, need), plain))
        return _new_landed(Landed, (pa.py_buffer(view[pos:end]), None))
