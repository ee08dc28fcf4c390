"""The free_data ledger: which listed ranges each client still holds (sans-IO).

When a server sends a body as a pair list (body type 1), every non-empty (offset, length) range it listed
must stay alive until that client frees it with a free_data message, or disconnects (spec: "Any
shared/remote memory addresses that are sent across MUST be kept alive by the server until a corresponding
tagged <free_data> message is received"). The :class:`Ledger` is that bookkeeping, and nothing else: it owns
no memory and does no I/O. The driver calls

* :meth:`Ledger.record` after listing ranges to a client,
* :meth:`Ledger.free_ranges` when a free_data message arrives (then lets go of the freed ranges for that
  client),
* :meth:`Ledger.drop` when a client disconnects (then lets go of everything returned, for that client),
* :meth:`Ledger.fits_quota` before listing a batch, to keep one client's bytes under its quota
  (:meth:`Ledger.live_bytes_of`).

Ranges are keyed by their offset/address. A range may be live for *several* clients at once -- a resident
placement (:mod:`dissoc.memory.placements`) is listed to every client that asks for it -- and then each of
those clients holds its own listing of it and frees that listing once; the memory itself may be reused only
when no client holds it any more, which is the driver's business (the placements count their holders). Within
one client an offset is live at most once. Zero-length ranges (the ``(0, 0)`` pairs of empty buffers) are
never recorded, so a client must not list them in free_data.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dissoc.errors import ProtocolError, ResourceError

__all__ = ["QUOTA_EXCEEDED", "Ledger", "QuotaExceeded"]

QUOTA_EXCEEDED: Final = "quota_exceeded"
"""The error code a server sends a client whose unfreed ranges would pass its quota."""


class QuotaExceeded(ResourceError):
    """A client holds too many bytes awaiting free_data (its quota); reported to that client only, with the
    error code :data:`QUOTA_EXCEEDED`."""

    code: Final = QUOTA_EXCEEDED


_U64_MAX: Final = 0xFFFFFFFFFFFFFFFF


def _as_u64(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= int(value) <= _U64_MAX:
        raise ValueError(f"{what}: expected an unsigned 64-bit integer, got {value!r}")
    return int(value)


class Ledger:
    """Per-client live ranges awaiting free_data; a range may be listed to several clients at once.

    ``client`` keys are opaque and hashable (a connection object, an id...). ``capacity_bytes`` is the size
    of the memory the ranges lie in (the driver's quotas are parts of it); :meth:`record` itself does not
    refuse ranges (the memory is already placed by then), so the driver asks :meth:`fits_quota` (and waits on
    its arena) *before* placing a batch.

    Bytes are counted two ways: :attr:`live_bytes` counts each live range once, however many clients hold
    it (the memory pinned), while :meth:`live_bytes_of` counts what one client holds, so a range shared by
    two clients counts in both of theirs (the sum over clients is at least :attr:`live_bytes`).

    Every method is atomic: one that raises changes nothing.
    """

    __slots__ = ("_by_client", "_bytes_of", "_capacity", "_holders", "_length", "_live_bytes")

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: expected a non-negative int, got {capacity_bytes!r}")
        self._capacity = capacity_bytes
        self._by_client: dict[Hashable, dict[int, int]] = {}  # client -> {offset: length}
        self._bytes_of: dict[Hashable, int] = {}  # client -> bytes it holds
        self._holders: dict[int, dict[Hashable, None]] = {}  # offset -> clients holding it, in listing order
        self._length: dict[int, int] = {}  # offset -> length of the live range there
        self._live_bytes = 0  # each live range once

    # -- queries --------------------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """The bytes of the memory the listed ranges lie in (what the driver's quotas are parts of)."""
        return self._capacity

    @property
    def live_bytes(self) -> int:
        """Bytes of the ranges live for at least one client, each range counted once."""
        return self._live_bytes

    def live_bytes_of(self, client: Hashable) -> int:
        """Bytes ``client`` still holds, shared ranges included (0 for a client the ledger does not know)."""
        return self._bytes_of.get(client, 0)

    def fits_quota(self, client: Hashable, nbytes: int, quota: int) -> bool:
        """Whether ``client`` could be listed ``nbytes`` more and hold at most ``quota`` bytes (shared ranges
        count in full for each client holding them, as in :meth:`live_bytes_of`)."""
        return self._bytes_of.get(client, 0) + nbytes <= quota

    def __repr__(self) -> str:
        return (
            f"Ledger(capacity_bytes={self._capacity}, live_bytes={self._live_bytes}, "
            f"ranges={len(self._length)}, clients={len(self._by_client)})"
        )

    # -- updates --------------------------------------------------------------------------------------------

    def record(
        self, client: Hashable, pairs: Iterable[tuple[int, int]] | npt.NDArray[np.integer[Any]]
    ) -> int:
        """Record the ranges just listed to ``client``; returns the bytes recorded for it.

        ``pairs`` is a sequence of (offset, length) or an ``(n, 2)`` integer array (``PairList.pairs``).
        Zero-length entries (the ``(0, 0)`` pairs of empty buffers) are ignored. An offset live for other
        clients may be listed to this one too (a shared, resident range), with the same length. Raises
        :class:`ValueError` (a bug in the server, not bad input from the wire) if a value is not a u64, an
        offset is already live for this client or repeated in ``pairs``, or a shared offset comes with
        another length; then nothing is recorded.
        """
        new: dict[int, int] = {}
        rows: Iterable[Any] = pairs.tolist() if isinstance(pairs, np.ndarray) else pairs
        mine = self._by_client.get(client, {})
        for item in rows:
            if len(item) != 2:
                raise ValueError(f"ledger: expected (offset, length) pairs, got {item!r}")
            offset, length = item
            if not (type(offset) is int and type(length) is int and 0 <= offset <= _U64_MAX >= length >= 0):
                offset = _as_u64(offset, "ledger offset")
                length = _as_u64(length, "ledger length")
            if length == 0:
                continue
            if offset in new or offset in mine:
                raise ValueError(
                    f"ledger: expected each live offset once per client, got offset {offset:#x} again "
                    f"for {client!r}"
                )
            live = self._length.get(offset)
            if live is not None and live != length:
                raise ValueError(
                    f"ledger: expected offset {offset:#x} with its live length {live}, got length {length} "
                    f"(listed to {list(self._holders[offset])!r})"
                )
            new[offset] = length
        if not new:
            return 0
        added = sum(new.values())
        self._by_client.setdefault(client, {}).update(new)
        for offset, length in new.items():
            holders = self._holders.get(offset)
            if holders is None:
                self._holders[offset] = {client: None}
                self._length[offset] = length
                self._live_bytes += length
            else:
                holders[client] = None
        self._bytes_of[client] = self._bytes_of.get(client, 0) + added
        return added

    def free_ranges(
        self, client: Hashable, addresses: Sequence[int] | Iterable[int]
    ) -> list[tuple[int, int]]:
        """Free ``client``'s listing of ``addresses`` (one free_data message); returns the ranges it let go.

        Other clients' listings of the same ranges are untouched. All-or-nothing: if any address is not a
        live range of ``client`` -- unknown, already freed by it, repeated in the message, or listed only to
        other clients -- raises :class:`~dissoc.errors.ProtocolError` naming it and frees nothing of this
        message. The caller then answers that client only; other clients' ranges are never touched.
        """
        mine = self._by_client.get(client, {})
        seen: set[int] = set()
        released: list[tuple[int, int]] = []
        for raw in addresses:
            if isinstance(raw, bool) or not isinstance(raw, int | np.integer):
                raise ProtocolError(f"free_data: expected u64 addresses, got {raw!r}")
            address = int(raw)
            if address in seen:
                raise ProtocolError(
                    f"free_data: expected each address once per message, got {address:#x} twice"
                )
            seen.add(address)
            length = mine.get(address)
            if length is None:
                if address in self._holders:
                    raise ProtocolError(
                        f"free_data: expected an address listed to this client, got {address:#x}, "
                        "which was listed to another client"
                    )
                raise ProtocolError(
                    f"free_data: expected an address listed to this client and not yet freed, "
                    f"got unknown address {address:#x}"
                )
            released.append((address, length))
        if not released:
            return released
        freed = 0
        for address, length in released:
            del mine[address]
            self._unhold(address, client)
            freed += length
        left = self._bytes_of[client] - freed
        if mine:
            self._bytes_of[client] = left
        else:  # keep the maps small: a client with nothing live is forgotten
            del self._by_client[client]
            del self._bytes_of[client]
        return released

    def drop(self, client: Hashable) -> list[tuple[int, int]]:
        """Forget ``client`` (it disconnected); returns exactly its live ranges, sorted, for the caller to let
        go of (other clients' listings of shared ranges stay)."""
        mine = self._by_client.pop(client, None)
        self._bytes_of.pop(client, None)
        if not mine:
            return []
        for address in mine:
            self._unhold(address, client)
        return sorted(mine.items())

    def _unhold(self, address: int, client: Hashable) -> None:
        holders = self._holders[address]
        del holders[client]
        if not holders:
            del self._holders[address]
            self._live_bytes -= self._length.pop(address)
