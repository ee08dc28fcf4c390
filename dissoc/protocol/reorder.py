"""Reassembling a Dissociated IPC stream: metadata and bodies in, complete messages out in sequence order.

Metadata messages (from the metadata stream) and bodies (from the data stream) may arrive in any order
relative to each other, and metadata messages may even arrive out of order among themselves. A message is
*complete* once its metadata has arrived and, if the metadata says it has a body, its body too. Complete
messages are released strictly in sequence order as soon as every earlier one has been released.

Memory is bounded against a hostile or broken peer: anything for a sequence number more than ``window``
messages ahead of the next one to release is refused with :class:`~dissoc.errors.ResourceError`, as is
anything that would make the buffered bytes exceed ``max_pending_bytes``. Drivers reading the two streams
independently can use :meth:`ReorderBuffer.accepts` to apply backpressure instead of hitting the window.

The end-of-stream message carries the next unused sequence number (the count of metadata messages sent,
modulo 2**32). Since it is the last message on the metadata stream, every metadata message before it must
have arrived when it does; bodies may still be outstanding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from dissoc.errors import ProtocolError, ResourceError
from dissoc.protocol.seq import (
    SEQ_HALF,
    SEQ_MAX,
    check_seq,
    fmt_seq,
    next_seq,
    seq_add,
    seq_diff,
    seq_distance,
)
from dissoc.protocol.tags import body_type_name

__all__ = [
    "DEFAULT_MAX_PENDING_BYTES",
    "DEFAULT_WINDOW",
    "Complete",
    "ReorderBuffer",
]

_log = logging.getLogger(__name__)

DEFAULT_WINDOW: Final = 1024
"""Default number of sequence numbers, from the next one to release, for which input is accepted."""

DEFAULT_MAX_PENDING_BYTES: Final = 1 << 30
"""Default bound on the bytes held waiting for release (bodies plus the metadata sizes reported)."""

_MAX_LISTED: Final = 16  # sequence numbers named in one error message

M = TypeVar("M")
B = TypeVar("B")


@dataclass(frozen=True, slots=True)
class Complete(Generic[M, B]):
    """A message released in order: its metadata and, if it has one, its body.

    ``body_type`` and ``body`` are ``None`` for a message without a body; ``nbytes`` is the body size reported
    when it was added (0 without a body).
    """

    seq: int
    metadata: M
    body_type: int | None
    body: B | None
    nbytes: int

    @property
    def has_body(self) -> bool:
        """Whether the message came with a body."""
        return self.body_type is not None


class _Slot(Generic[M, B]):
    """What has arrived so far for one sequence number."""

    __slots__ = (
        "body",
        "body_arrived",
        "body_nbytes",
        "body_type",
        "has_body",
        "meta_arrived",
        "meta_nbytes",
        "metadata",
    )

    def __init__(self) -> None:
        self.meta_arrived = False
        self.metadata: M | None = None
        self.has_body = False
        self.meta_nbytes = 0
        self.body_arrived = False
        self.body_type: int | None = None
        self.body: B | None = None
        self.body_nbytes = 0

    @property
    def complete(self) -> bool:
        return self.meta_arrived and (self.body_arrived or not self.has_body)

    @property
    def awaiting_body(self) -> bool:
        return self.meta_arrived and self.has_body and not self.body_arrived


class _BodyWhat:
    """Names a body in error messages; formatted only when an error is raised (keeps the hot path cheap)."""

    __slots__ = ("body_type",)

    def __init__(self, body_type: int) -> None:
        self.body_type = body_type

    def __str__(self) -> str:
        return f"{body_type_name(self.body_type)} body"

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _fmt_seqs(seqs: list[int], more: bool) -> str:
    text = ", ".join(fmt_seq(s) for s in seqs)
    return text + (", ..." if more else "")


class ReorderBuffer(Generic[M, B]):
    """Matches metadata with bodies by sequence number and releases complete messages in order.

    ``M`` is the type of the metadata objects and ``B`` of the bodies; the buffer never looks inside either.
    Every method either accepts its input completely or raises and leaves the buffer unchanged.

    :param window: input is accepted only for sequence numbers less than ``window`` ahead of :attr:`next_seq`.
    :param max_pending_bytes: bound on :attr:`pending_bytes`; input that would exceed it raises
        :class:`~dissoc.errors.ResourceError`.
    :param start_seq: sequence number of the first message (0 in the protocol; other values let tests cover
        roll-over without sending 2**32 messages).
    """

    def __init__(
        self,
        *,
        window: int = DEFAULT_WINDOW,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        start_seq: int = 0,
    ) -> None:
        if not 1 <= window < (1 << 31):
            raise ValueError(f"window must be in [1, 2**31), got {window!r}")
        if max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes must be >= 0, got {max_pending_bytes!r}")
        self._window = window
        self._max_pending_bytes = max_pending_bytes
        self._start = check_seq(start_seq)
        self._next = self._start
        self._released = 0
        self._slots: dict[int, _Slot[M, B]] = {}
        self._pending_bytes = 0
        self._metadata_seen = 0
        self._eos: int | None = None

    # -- introspection ---------------------------------------------------------------------------------------

    @property
    def window(self) -> int:
        """How many sequence numbers from :attr:`next_seq` on are accepted."""
        return self._window

    @property
    def max_pending_bytes(self) -> int:
        """Bound on :attr:`pending_bytes`."""
        return self._max_pending_bytes

    @property
    def next_seq(self) -> int:
        """The sequence number of the next message to release."""
        return self._next

    @property
    def released(self) -> int:
        """How many messages have been released (not reduced modulo 2**32)."""
        return self._released

    @property
    def pending_bytes(self) -> int:
        """Bytes held for messages not yet released (body sizes plus reported metadata sizes)."""
        return self._pending_bytes

    @property
    def backlog(self) -> int:
        """How many sequence numbers have something held for them."""
        return len(self._slots)

    @property
    def eos_seq(self) -> int | None:
        """The sequence number the end-of-stream message carried, once it has arrived."""
        return self._eos

    @property
    def ended(self) -> bool:
        """Whether the end-of-stream message has arrived."""
        return self._eos is not None

    @property
    def finished(self) -> bool:
        """End of stream seen and every message before it released."""
        return self._eos is not None and self._next == self._eos and not self._slots

    def accepts(self, seq: int) -> bool:
        """Whether ``seq`` is inside the window (a driver can stop reading a stream until it is)."""
        return 0 <= seq_diff(seq, self._next) < self._window

    def missing(self, limit: int = _MAX_LISTED) -> list[int]:
        """Up to ``limit`` sequence numbers, in order, that still lack their metadata or body.

        Before end of stream only held messages are considered (the stream's length is not known yet).
        """
        out: list[int] = []
        if self._eos is None:
            for off in sorted(seq_distance(self._next, s) for s in self._slots):
                seq = seq_add(self._next, off)
                if not self._slots[seq].complete:
                    out.append(seq)
                    if len(out) >= limit:
                        break
            return out
        span = seq_distance(self._next, self._eos)
        seq = self._next
        for _ in range(span):
            slot = self._slots.get(seq)
            if slot is None or not slot.complete:
                out.append(seq)
                if len(out) >= limit:
                    break
            seq = next_seq(seq)
        return out

    # -- input -----------------------------------------------------------------------------------------------

    def _offset(self, seq: int, what: object) -> int:
        """Distance of ``seq`` ahead of the next message to release, checked against the window."""
        if type(seq) is not int or not 0 <= seq <= SEQ_MAX:
            check_seq(seq)  # raises
        d = (seq - self._next) & SEQ_MAX
        if d >= SEQ_HALF:  # more than half the space ahead means behind: already released
            raise ProtocolError(
                f"{what} for seq {fmt_seq(seq)}: expected seq {fmt_seq(self._next)} or later, but "
                f"{fmt_seq(seq)} was already released (duplicate?)"
            )
        if d >= self._window:
            raise ResourceError(
                f"{what} for seq {fmt_seq(seq)}: expected a seq less than {self._window} ahead of "
                f"{fmt_seq(self._next)}, got one {d} ahead"
            )
        return d

    def _check_bytes(self, nbytes: int, seq: int, what: object) -> None:
        if self._pending_bytes + nbytes > self._max_pending_bytes:
            raise ResourceError(
                f"{what} for seq {fmt_seq(seq)} ({nbytes} bytes): expected at most the limit of "
                f"{self._max_pending_bytes} bytes waiting for release, it would make "
                f"{self._pending_bytes + nbytes}"
            )

    def add_metadata(self, seq: int, metadata: M, has_body: bool, nbytes: int = 0) -> list[Complete[M, B]]:
        """Add the metadata of message ``seq``; return the messages now releasable, in order.

        ``nbytes`` is the metadata's size, counted against ``max_pending_bytes`` while it waits.
        Raises :class:`~dissoc.errors.ProtocolError` after end of stream, if the first metadata is not
        ``start_seq``, for a duplicate, or if a body already arrived but ``has_body`` is false;
        :class:`~dissoc.errors.ResourceError` outside the window or over the byte limit.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        if self._eos is not None:
            raise ProtocolError(
                f"metadata for seq {fmt_seq(check_seq(seq))}: expected nothing more on the metadata stream "
                f"after end of stream (seq {fmt_seq(self._eos)})"
            )
        if self._metadata_seen == 0 and seq != self._start:
            raise ProtocolError(
                f"first metadata message: expected seq {fmt_seq(self._start)} (the schema), "
                f"got {fmt_seq(seq)}"
            )
        self._offset(seq, "metadata")
        slot = self._slots.get(seq)
        if slot is not None:
            if slot.meta_arrived:
                raise ProtocolError(f"metadata for seq {fmt_seq(seq)}: expected it once, got a duplicate")
            if slot.body_arrived and not has_body:
                raise ProtocolError(
                    f"metadata for seq {fmt_seq(seq)}: expected a message with a body (a "
                    f"{body_type_name(slot.body_type or 0)} body arrived for it), "
                    "got metadata saying it has none"
                )
        self._check_bytes(nbytes, seq, "metadata")
        if slot is None:
            slot = self._slots[seq] = _Slot()
        slot.meta_arrived = True
        slot.metadata = metadata
        slot.has_body = has_body
        slot.meta_nbytes = nbytes
        self._pending_bytes += nbytes
        self._metadata_seen += 1
        _log.debug("metadata seq=0x%08x has_body=%s (%d bytes)", seq, has_body, nbytes)
        return self._release()

    def add_body(self, seq: int, body_type: int, body: B, nbytes: int) -> list[Complete[M, B]]:
        """Add the body of message ``seq``; return the messages now releasable, in order.

        Raises :class:`~dissoc.errors.ProtocolError` for a duplicate body, a body whose metadata said there is
        none, or a body beyond the end of stream; :class:`~dissoc.errors.ResourceError` outside the window or
        over the byte limit.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        what = _BodyWhat(body_type)
        off = self._offset(seq, what)
        if self._eos is not None and off >= seq_distance(self._next, self._eos):
            raise ProtocolError(
                f"{what} for seq {fmt_seq(seq)}: expected only seqs before the end of stream "
                f"(seq {fmt_seq(self._eos)}), and no metadata was sent for this one"
            )
        slot = self._slots.get(seq)
        if slot is not None:
            if slot.body_arrived:
                raise ProtocolError(f"{what} for seq {fmt_seq(seq)}: expected one body, got a duplicate")
            if slot.meta_arrived and not slot.has_body:
                raise ProtocolError(
                    f"{what} for seq {fmt_seq(seq)}: expected no body, its metadata says it has none"
                )
        self._check_bytes(nbytes, seq, what)
        if slot is None:
            slot = self._slots[seq] = _Slot()
        slot.body_arrived = True
        slot.body_type = body_type
        slot.body = body
        slot.body_nbytes = nbytes
        self._pending_bytes += nbytes
        _log.debug("body seq=0x%08x type=%d (%d bytes)", seq, body_type, nbytes)
        return self._release()

    def end(self, eos_seq: int) -> list[Complete[M, B]]:
        """Record the end-of-stream message carrying ``eos_seq`` (the next unused sequence number).

        Every metadata message before ``eos_seq`` must have arrived already (end of stream is the last message
        on the metadata stream); bodies may still follow. Returns the messages now releasable (end of stream
        itself never completes one, so this is empty; the list is for symmetry). Raises
        :class:`~dissoc.errors.ProtocolError` for a second end of stream, an ``eos_seq`` that is not the one
        after the last metadata, gaps, or bodies held for sequence numbers at or after ``eos_seq``.
        """
        check_seq(eos_seq)
        where = f"end of stream (seq {fmt_seq(eos_seq)})"
        if self._eos is not None:
            raise ProtocolError(f"{where}: expected one end-of-stream message, got a second")
        span = seq_distance(self._next, eos_seq)
        beyond_meta: list[int] = []
        orphan_bodies: list[int] = []
        present = 0
        for seq, slot in self._slots.items():
            inside = seq_distance(self._next, seq) < span
            if slot.meta_arrived:
                if inside:
                    present += 1
                else:
                    beyond_meta.append(seq)
            elif not inside:
                orphan_bodies.append(seq)
        if beyond_meta:
            last = max(beyond_meta, key=lambda s: seq_distance(self._next, s))
            raise ProtocolError(
                f"{where}: expected the seq after the last metadata message, {fmt_seq(next_seq(last))}, "
                f"got {fmt_seq(eos_seq)}"
            )
        if orphan_bodies:
            orphan_bodies.sort(key=lambda s: seq_distance(self._next, s))
            raise ProtocolError(
                f"{where}: expected bodies only for seqs with metadata, got bodies for seqs without: "
                f"{_fmt_seqs(orphan_bodies[:_MAX_LISTED], len(orphan_bodies) > _MAX_LISTED)}"
            )
        if present != span:
            gaps: list[int] = []
            seq = self._next
            for _ in range(span):
                found = self._slots.get(seq)
                if found is None or not found.meta_arrived:
                    gaps.append(seq)
                    if len(gaps) > _MAX_LISTED:
                        break
                seq = next_seq(seq)
            raise ProtocolError(
                f"{where}: expected metadata for every seq before it, missing "
                f"{span - present}: {_fmt_seqs(gaps[:_MAX_LISTED], len(gaps) > _MAX_LISTED)}"
            )
        self._eos = eos_seq
        _log.debug("end of stream seq=%s (%d messages outstanding)", fmt_seq(eos_seq), span)
        return self._release()

    def close(self) -> None:
        """Declare that no more input will arrive; raise :class:`~dissoc.errors.ProtocolError` unless done.

        The error names what never arrived (the end of stream, or the sequence numbers still lacking a body).
        """
        if self.finished:
            return
        missing = self.missing(_MAX_LISTED + 1)
        listed = _fmt_seqs(missing[:_MAX_LISTED], len(missing) > _MAX_LISTED)
        if self._eos is None:
            raise ProtocolError(
                f"stream closed: expected an end-of-stream message, got none after {self._released} released "
                f"message(s) (next expected seq {fmt_seq(self._next)}; incomplete: {listed or 'none'})"
            )
        raise ProtocolError(
            f"stream closed: expected a body for every message that has one, missing bodies for seqs {listed}"
        )

    # -- output ----------------------------------------------------------------------------------------------

    def _release(self) -> list[Complete[M, B]]:
        out: list[Complete[M, B]] = []
        slots = self._slots
        while True:
            held = slots.get(self._next)
            if held is None or not held.complete:
                break
            slot = held
            del slots[self._next]
            self._pending_bytes -= slot.meta_nbytes + slot.body_nbytes
            out.append(
                Complete(
                    self._next,
                    slot.metadata,  # type: ignore[arg-type]  # set when meta_arrived
                    slot.body_type if slot.has_body else None,
                    slot.body if slot.has_body else None,
                    slot.body_nbytes,
                )
            )
            self._next = (self._next + 1) & SEQ_MAX
            self._released += 1
        return out
