"""Reassembling a Dissociated IPC stream: metadata and bodies in, complete messages out in sequence order.

Metadata messages (from the metadata stream) and bodies (from the data stream) may arrive in any order
relative to each other, and metadata messages may also arrive out of order among themselves -- even before
the schema (sequence number ``start_seq``, normally 0): the spec has sequence numbers exist "to ensure we do
not rely on messages having to arrive in order". A message is *complete* once its metadata has arrived and,
if the metadata says it has a body, its body too. Complete messages are released strictly in sequence order
as soon as every earlier one has been released, so nothing is released before the schema.

Memory is bounded against a hostile or broken peer: anything for a sequence number ``window`` or more
messages ahead of the next one to release is refused with :class:`~dissoc.errors.ResourceError`, as is
anything that would make the buffered bytes exceed ``max_pending_bytes``. Drivers reading the two streams
independently can use :meth:`ReorderBuffer.classify` to apply backpressure instead of hitting the window.

The end-of-stream message carries the next unused sequence number (the count of metadata messages sent,
modulo 2**32). It may overtake metadata messages as well as bodies: the buffer records the count, keeps
accepting metadata and bodies for the sequence numbers before it, refuses any for the sequence numbers at or
after it (:class:`~dissoc.errors.ProtocolError`), and is *finished* once every message before it has been
released.
"""

from __future__ import annotations

import enum
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
    seq_diff,
    seq_distance,
)
from dissoc.protocol.tags import body_type_name

__all__ = [
    "DEFAULT_MAX_PENDING_BYTES",
    "DEFAULT_WINDOW",
    "Complete",
    "ReorderBuffer",
    "SeqClass",
]

_log = logging.getLogger(__name__)

DEFAULT_WINDOW: Final = 1024
"""Default number of sequence numbers, from the next one to release, for which input is accepted."""

DEFAULT_MAX_PENDING_BYTES: Final = 1 << 30
"""Default bound on the bytes held waiting for release (bodies plus the metadata sizes reported)."""

_MAX_LISTED: Final = 16  # sequence numbers named in one error message

M = TypeVar("M")
B = TypeVar("B")


class SeqClass(enum.IntEnum):
    """Where an incoming sequence number stands, as :meth:`ReorderBuffer.classify` reports it.

    The sign tells a driver what to do with the input (metadata or body) carrying it:

    * negative -- pass it on at once: the buffer will raise :class:`~dissoc.errors.ProtocolError` for it, and
      waiting would never change that (``RELEASED``, ``PAST_END``; ``FAILED`` from
      :meth:`~dissoc.protocol.state.ClientStream.classify` only);
    * zero -- pass it on now (``ACCEPT``);
    * positive -- it is ahead of the window (``AHEAD``): passing it on now raises
      :class:`~dissoc.errors.ResourceError`; a driver that would rather apply backpressure waits until
      releases move the window (the answer changes only when messages are released).

    So ``classify(seq) > 0`` is the whole "should I wait?" test. The values are plain ints
    (:class:`enum.IntEnum`), so comparing with ``<``, ``==`` or ``>`` against 0 works.
    """

    FAILED = -3
    """The stream has failed (:class:`~dissoc.protocol.state.ClientStream` only): every input raises."""
    RELEASED = -2
    """Behind the next message to release: already released, so any input for it is a duplicate."""
    PAST_END = -1
    """At or after the count the end-of-stream message carried: no metadata or body may exist for it."""
    ACCEPT = 0
    """Inside the window (and before the end-of-stream count, if known): input for it is taken now, unless
    it breaks another rule (a duplicate of something held, a body for a message without one, the byte
    limit)."""
    AHEAD = 1
    """Before the end-of-stream count (or none known yet) but ``window`` or more ahead of the next message to
    release: input for it raises :class:`~dissoc.errors.ResourceError` until enough messages are released."""


_RELEASED: Final = SeqClass.RELEASED
_PAST_END: Final = SeqClass.PAST_END
_ACCEPT: Final = SeqClass.ACCEPT
_AHEAD: Final = SeqClass.AHEAD


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

    Metadata, bodies and the end of stream may arrive in any order, as long as everything stays inside the
    window: the schema (``start_seq``) need not come first (nothing is released before it), and the
    end-of-stream message may come before metadata or bodies for the sequence numbers below its count.

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
        #: The sequence number of the next message to release (read it; the buffer moves it).
        self.next_seq = self._start
        self._released = 0
        self._slots: dict[int, _Slot[M, B]] = {}
        self._pending_bytes = 0
        self._held_metadata = 0  # slots whose metadata has arrived (none is released without it)
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
    def start_seq(self) -> int:
        """The sequence number of the first message (the schema)."""
        return self._start

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
        """Whether the end-of-stream message has arrived (messages before it may still be outstanding)."""
        return self._eos is not None

    @property
    def metadata_complete(self) -> bool:
        """End of stream seen and the metadata for every sequence number before its count arrived.

        Nothing more is due on the metadata stream then (the spec: after end of stream "it is safe to close
        the metadata connection if there are no gaps in the sequence numbers received"); bodies may still be
        outstanding. Constant time.
        """
        eos = self._eos
        return eos is not None and self._held_metadata == ((eos - self.next_seq) & SEQ_MAX)

    @property
    def held_metadata(self) -> int:
        """How many sequence numbers have their metadata held (see :attr:`metadata_complete`)."""
        return self._held_metadata

    @property
    def finished(self) -> bool:
        """End of stream seen and every message before it released."""
        return self._eos is not None and self.next_seq == self._eos and not self._slots

    def accepts(self, seq: int) -> bool:
        """Whether ``seq`` is inside the window: less than :attr:`window` ahead of :attr:`next_seq`.

        This looks at the window only: it is false both for sequence numbers ahead of the window and for
        those already released (which will never become acceptable), and true for sequence numbers at or
        after a known end of stream if they are inside the window. A driver deciding whether to wait should
        use :meth:`classify`, which tells these apart.
        """
        return 0 <= seq_diff(seq, self.next_seq) < self._window

    def classify(self, seq: int) -> SeqClass:
        """Where input (metadata or body) for ``seq`` stands now; constant time, changes nothing.

        Returns, checking in this order:

        * :attr:`SeqClass.RELEASED` (-2) -- ``seq`` is behind :attr:`next_seq` (more than half the sequence
          space ahead counts as behind): already released, so the input is a duplicate and
          ``add_metadata``/``add_body`` raise :class:`~dissoc.errors.ProtocolError`;
        * :attr:`SeqClass.PAST_END` (-1) -- the end-of-stream message has arrived and ``seq`` is at or after
          its count: the input raises :class:`~dissoc.errors.ProtocolError`;
        * :attr:`SeqClass.AHEAD` (1) -- ``seq`` is :attr:`window` or more ahead of :attr:`next_seq`: the input
          raises :class:`~dissoc.errors.ResourceError` now, but may be accepted once earlier messages have
          been released;
        * :attr:`SeqClass.ACCEPT` (0) -- otherwise: the input is taken now unless it breaks a rule that
          depends on what is held (a duplicate of held metadata or body, a body for a message without one,
          the byte limit).

        A driver reading the metadata and data streams separately waits while the answer is positive and
        passes the input on otherwise, so that a duplicate or an input past the end fails the stream at once
        rather than stalling it. (Waiting only makes progress if the messages missing before ``seq`` come
        on a stream that is still being read.)
        """
        if type(seq) is not int or not 0 <= seq <= SEQ_MAX:
            check_seq(seq)  # raises
        nxt = self.next_seq
        d = (seq - nxt) & SEQ_MAX
        if d >= SEQ_HALF:
            return _RELEASED
        eos = self._eos
        if eos is not None and d >= ((eos - nxt) & SEQ_MAX):
            return _PAST_END
        if d >= self._window:
            return _AHEAD
        return _ACCEPT

    def missing(self, limit: int = _MAX_LISTED) -> list[int]:
        """Up to ``limit`` sequence numbers, in order, that still lack their metadata or body.

        After end of stream every sequence number before its count is considered. Before it the stream's
        length is not known, so only those up to the furthest one with something held are (the gaps below
        it included).
        """
        if self._eos is not None:
            span = seq_distance(self.next_seq, self._eos)
        elif self._slots:
            span = 1 + max(seq_distance(self.next_seq, s) for s in self._slots)
        else:
            span = 0
        out: list[int] = []
        seq = self.next_seq
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
        """Distance of ``seq`` ahead of the next message to release, checked against the end of stream and
        the window (the checks of :meth:`classify`, raising)."""
        if type(seq) is not int or not 0 <= seq <= SEQ_MAX:
            check_seq(seq)  # raises
        d = (seq - self.next_seq) & SEQ_MAX
        if d >= SEQ_HALF:  # more than half the space ahead means behind: already released
            raise ProtocolError(self._behind_message(seq, what))
        eos = self._eos
        if eos is not None and d >= ((eos - self.next_seq) & SEQ_MAX):
            raise ProtocolError(
                f"{what} for seq {fmt_seq(seq)}: expected only seqs before the end of stream "
                f"(seq {fmt_seq(eos)}, the count of metadata messages), got one at or after it"
            )
        if d >= self._window:
            raise ResourceError(
                f"{what} for seq {fmt_seq(seq)}: expected a seq less than {self._window} ahead of "
                f"{fmt_seq(self.next_seq)}, got one {d} ahead"
            )
        return d

    def _behind_message(self, seq: int, what: object) -> str:
        """Why input for ``seq``, more than half the sequence space ahead of :attr:`next_seq`, is refused: a
        duplicate when it is among the messages released, else out of range (a jump ahead no window could
        hold, or a seq before the stream's first)."""
        back = (self.next_seq - seq) & SEQ_MAX
        if back <= self._released:
            return (
                f"{what} for seq {fmt_seq(seq)}: expected seq {fmt_seq(self.next_seq)} or later, but "
                f"{fmt_seq(seq)} was already released (duplicate?)"
            )
        return (
            f"{what} for seq {fmt_seq(seq)}: expected a seq less than {self._window} ahead of "
            f"{fmt_seq(self.next_seq)}, got one {(seq - self.next_seq) & SEQ_MAX} ahead (out of range: not "
            f"one of the {self._released} message(s) released)"
        )

    def _check_bytes(self, nbytes: int, seq: int, what: object) -> None:
        if self._pending_bytes + nbytes > self._max_pending_bytes:
            raise ResourceError(
                f"{what} for seq {fmt_seq(seq)} ({nbytes} bytes): expected at most the limit of "
                f"{self._max_pending_bytes} bytes waiting for release, it would make "
                f"{self._pending_bytes + nbytes}"
            )

    def add_metadata(self, seq: int, metadata: M, has_body: bool, nbytes: int = 0) -> list[Complete[M, B]]:
        """Add the metadata of message ``seq``; return the messages now releasable, in order.

        Metadata may arrive in any order, before the schema's too (it is held until every earlier message
        has been released), and after the end-of-stream message for the sequence numbers below its count.
        ``nbytes`` is the metadata's size, counted against ``max_pending_bytes`` while it waits.
        Raises :class:`~dissoc.errors.ProtocolError` for a seq already released or held (a duplicate), at or
        after the end-of-stream count, or if a body already arrived but ``has_body`` is false;
        :class:`~dissoc.errors.ResourceError` outside the window or over the byte limit.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
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
        self._held_metadata += 1
        _log.debug("metadata seq=0x%08x has_body=%s (%d bytes)", seq, has_body, nbytes)
        # Only completing the next message to release can release anything.
        return self._release() if seq == self.next_seq and slot.complete else []

    def add_body(self, seq: int, body_type: int, body: B, nbytes: int) -> list[Complete[M, B]]:
        """Add the body of message ``seq``; return the messages now releasable, in order.

        Raises :class:`~dissoc.errors.ProtocolError` for a seq already released, a duplicate body, a body
        whose metadata said there is none, or a body at or after the end-of-stream count;
        :class:`~dissoc.errors.ResourceError` outside the window or over the byte limit.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        what = _BodyWhat(body_type)
        self._offset(seq, what)
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
        return self._release() if seq == self.next_seq and slot.complete else []

    def advance(self, seq: int, nbytes: int) -> bool:
        """Release message ``seq`` in one step, for a caller that keeps its metadata and body itself (what
        :meth:`add_metadata` then :meth:`add_body` would do): True when ``seq`` (``nbytes`` of metadata and
        body together) was the next to release with nothing held (and before the end of stream, if that came
        already), and is now released; False changes nothing (the caller then goes through those two, which
        check the rest)."""
        if (
            seq != self.next_seq
            or self._slots
            or seq == self._eos
            or nbytes > self._max_pending_bytes - self._pending_bytes
        ):
            return False
        self.next_seq = (seq + 1) & SEQ_MAX
        self._released += 1
        return True

    def end(self, eos_seq: int) -> list[Complete[M, B]]:
        """Record the end-of-stream message carrying ``eos_seq`` (the next unused sequence number, that is the
        count of metadata messages modulo 2**32).

        It may arrive before metadata and bodies for the sequence numbers below it; those are still accepted
        afterwards, and the buffer is :attr:`finished` once all of them have been released. Input for
        sequence numbers at or after ``eos_seq`` is refused from then on. The count is not bounded by the
        window (it holds no memory). Returns the messages now releasable (end of stream itself never
        completes one, so this is empty; the list is for symmetry). Raises
        :class:`~dissoc.errors.ProtocolError` for a second end of stream, an ``eos_seq`` behind
        :attr:`next_seq` (lower than a seq already released), or metadata or bodies held for sequence numbers
        at or after ``eos_seq``.
        """
        check_seq(eos_seq)
        where = f"end of stream (seq {fmt_seq(eos_seq)})"
        if self._eos is not None:
            raise ProtocolError(
                f"{where}: expected one end-of-stream message, got a second (the first carried "
                f"{fmt_seq(self._eos)})"
            )
        span = seq_distance(self.next_seq, eos_seq)
        if span >= SEQ_HALF:
            raise ProtocolError(
                f"{where}: expected seq {fmt_seq(self.next_seq)} or later ({self._released} message(s) "
                f"already released), got {fmt_seq(eos_seq)} which is behind it"
            )
        beyond_meta: list[int] = []
        orphan_bodies: list[int] = []
        for seq, slot in self._slots.items():
            if seq_distance(self.next_seq, seq) >= span:
                (beyond_meta if slot.meta_arrived else orphan_bodies).append(seq)
        if beyond_meta:
            last = max(beyond_meta, key=lambda s: seq_distance(self.next_seq, s))
            raise ProtocolError(
                f"{where}: expected a seq after every metadata message received, at least "
                f"{fmt_seq(next_seq(last))}, got {fmt_seq(eos_seq)}"
            )
        if orphan_bodies:
            orphan_bodies.sort(key=lambda s: seq_distance(self.next_seq, s))
            raise ProtocolError(
                f"{where}: expected bodies only for seqs before it, got bodies for seqs at or after it: "
                f"{_fmt_seqs(orphan_bodies[:_MAX_LISTED], len(orphan_bodies) > _MAX_LISTED)}"
            )
        self._eos = eos_seq
        _log.debug("end of stream seq=%s (%d messages outstanding)", fmt_seq(eos_seq), span)
        return self._release()

    def close(self) -> None:
        """Declare that no more input will arrive; raise :class:`~dissoc.errors.ProtocolError` unless done.

        The error names what never arrived: the end of stream, and the sequence numbers still lacking their
        metadata or body.
        """
        if self.finished:
            return
        missing = self.missing(_MAX_LISTED + 1)
        more = len(missing) > _MAX_LISTED
        if self._eos is None:
            listed = _fmt_seqs(missing[:_MAX_LISTED], more)
            raise ProtocolError(
                f"stream closed: expected an end-of-stream message, got none after {self._released} released "
                f"message(s) (next expected seq {fmt_seq(self.next_seq)}; incomplete: {listed or 'none'})"
            )
        no_meta: list[int] = []
        no_body: list[int] = []
        for seq in missing[:_MAX_LISTED]:
            slot = self._slots.get(seq)
            (no_body if slot is not None and slot.meta_arrived else no_meta).append(seq)
        parts: list[str] = []
        if no_meta:
            parts.append(f"metadata for seqs {_fmt_seqs(no_meta, False)}")
        if no_body:
            parts.append(f"bodies for seqs {_fmt_seqs(no_body, False)}")
        if no_meta:
            expected = (
                f"metadata for every seq before the end of stream ({fmt_seq(self._eos)}) "
                "and a body for every message that has one"
            )
        else:
            expected = "a body for every message that has one"
        raise ProtocolError(
            f"stream closed: expected {expected}, missing {'; '.join(parts)}{', ...' if more else ''}"
        )

    # -- output ----------------------------------------------------------------------------------------------

    def _release(self) -> list[Complete[M, B]]:
        out: list[Complete[M, B]] = []
        slots = self._slots
        while True:
            held = slots.get(self.next_seq)
            if held is None or not held.complete:
                break
            slot = held
            del slots[self.next_seq]
            self._pending_bytes -= slot.meta_nbytes + slot.body_nbytes
            self._held_metadata -= 1
            out.append(
                Complete(
                    self.next_seq,
                    slot.metadata,  # type: ignore[arg-type]  # set when meta_arrived
                    slot.body_type if slot.has_body else None,
                    slot.body if slot.has_body else None,
                    slot.body_nbytes,
                )
            )
            self.next_seq = (self.next_seq + 1) & SEQ_MAX
            self._released += 1
        return out
