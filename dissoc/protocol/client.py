"""The client's side of one stream: what arrived in, events out, and every rule about their order.

:class:`ClientStream` takes the messages of both streams as they arrive (metadata-stream messages, and the
tagged messages of the data stream) and releases them as events, in sequence order. It decides everything a
client decides about ordering: matching metadata with bodies (:mod:`dissoc.protocol.reorder`), the order an
in-order transport promises, input that arrives ahead of the reorder window (held, and its source paused),
the bytes waiting for the consumer (reading pauses past a bound and resumes at half of it), end of stream,
and the data stream's error and arena messages. It is sans-IO: a driver pumps received messages into
:meth:`ClientStream.receive`, pops :attr:`ClientStream.events`, reports what its consumer is done with
(:meth:`ClientStream.consumed`) and pauses or resumes reading as :attr:`ClientStream.pauses` says.

The common case takes few steps: a metadata message that runs on from the next one to release is held for its
body (a *held run*), and a packed body for the first held message releases both at once, without going
through the reorder buffer; everything else (out of order, ahead of the window, after an end of stream) goes
through the general rules, which give the same events and errors.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, NoReturn

import numpy as np

from dissoc.errors import DissocError, ProtocolError, RemoteError, ResourceError
from dissoc.protocol.arena import decode_arena
from dissoc.protocol.events import ClientEvent, ClientState, MessageReady, SchemaReceived, StreamEnded
from dissoc.protocol.framing import (
    PREFIX_SIZE,
    BytesLike,
    EndOfStream,
    ErrorMessage,
    MessageType,
    MetadataMessage,
    as_byte_view,
    decode_stream_message,
    peek_prefix,
)
from dissoc.protocol.pairs import decode_pairs
from dissoc.protocol.reorder import (
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_WINDOW,
    Complete,
    ReorderBuffer,
    SeqClass,
)
from dissoc.protocol.seq import SEQ_HALF, SEQ_MAX, SEQ_MODULUS, check_seq, fmt_seq
from dissoc.protocol.tags import (
    ARENA_TAG,
    BODY_ERROR,
    BODY_PACKED,
    BODY_PAIRS,
    BODY_TYPE_SHIFT,
    fmt_tag,
    parse_body_tag,
    seq_of,
)

__all__ = ["ClientStream", "Keep", "Received"]

_log = logging.getLogger(__name__)

#: One received message: ``(tag, payload, nbytes)``; ``tag`` None for a metadata-stream message.
Received = tuple[int | None, Any, int]
#: Turns a payload lent only for the call into one the stream may keep: ``keep(payload, metadata)``, with the
#: message's metadata flatbuffer when it is known (the driver may land the body where it will be decoded).
Keep = Callable[[memoryview, bytes | None], object]

_SEQ: Final = struct.Struct("<I")  # a metadata message's sequence number, after its type byte
_METADATA: Final = int(MessageType.METADATA)
_EOS: Final = int(MessageType.END_OF_STREAM)
#: The largest tag of a packed body (body type 0 in bits 56-63, reserved bits 32-55 clear): the seq itself.
_PACKED_TAG_MAX: Final = 0xFFFF_FFFF
#: The body-type bits of a pair list's tag (body type 1): its tag is the seq with these set.
_PAIRS_TAG: Final = BODY_PAIRS << BODY_TYPE_SHIFT
#: A :class:`MessageReady` from its fields without the named tuple's Python-level ``__new__`` (one per batch).
_new_event: Final = tuple.__new__
#: Distinct metadata a stream remembers as having a body (a stream of same-shaped batches has one).
_BODIED_KEPT: Final = 64
_STREAMING: Final = ClientState.STREAMING  # (module globals: cheaper than the enum's attributes)
_FINISHED: Final = ClientState.FINISHED


def _payload_nbytes(payload: object) -> int:
    if isinstance(payload, bytes | bytearray):
        return len(payload)
    n = getattr(payload, "nbytes", None)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    raise TypeError(f"cannot tell the size of a body of type {type(payload).__name__}; pass nbytes")


def _kept(payload: memoryview, metadata: bytes | None) -> object:
    return bytes(payload)


class ClientStream:
    """Reassembles one stream on the client: received messages in, events out (see the module's text).

    :param has_body: tells from a metadata flatbuffer whether the message has a body (RecordBatch and
        DictionaryBatch do, Schema does not); supplied by the codec.
    :param window: how many sequence numbers from the next one to release input is taken for.
    :param max_pending_bytes: bound on the bytes held in the reorder buffer (see
        :class:`~dissoc.protocol.reorder.ReorderBuffer`).
    :param start_seq: the schema's sequence number (0 in the protocol; other values let tests cover
        roll-over).
    :param ordered: the transport delivers the metadata stream in order (TCP, TLS): a gap, a duplicate or a
        wrong end-of-stream count is an error at once.
    :param max_ahead: input up to this many sequence numbers ahead of the next one to release is taken; what
        is ahead of the window waits (and :attr:`pauses` asks for its source to pause) until releases make
        room. Beyond it, :class:`~dissoc.errors.ResourceError`. Default: the window (nothing waits).
    :param max_in_flight_bytes: bodies received and not yet reported consumed (:meth:`consumed`) up to which
        reading goes on: at the bound :attr:`pauses` asks for both streams to pause, until they are down to
        half. None: no bound.
    :param shared_link: both streams come over one link, so pausing one pauses both: input waiting for the
        window does not pause it (what it waits for comes after it on the same link); it is bounded by
        ``max_in_flight_bytes`` (else ``max_pending_bytes``) instead.
    :param keep: for :meth:`receive` with ``lent=True``: turns a payload the stream keeps into one that
        outlives the call (default: a copy into ``bytes``).

    Messages may arrive in any order within the window: metadata out of order (even before the schema, which
    is held until it arrives), bodies before or after their metadata, and the end-of-stream message before
    metadata or bodies for the sequence numbers below its count; events come out in sequence order all the
    same, and :class:`~dissoc.protocol.events.StreamEnded` once every message before the end-of-stream count
    has been released. The message at ``start_seq`` must be the schema (no body). An error message raises
    :class:`~dissoc.errors.RemoteError`; a peer breaking the rules raises
    :class:`~dissoc.errors.ProtocolError` (duplicates, input at or after the end-of-stream count, a second
    end of stream, ...) or
    :class:`~dissoc.errors.ResourceError` past the limits. After any error the stream is failed and every
    further call raises :class:`~dissoc.errors.ProtocolError`.
    """

    def __init__(
        self,
        has_body: Callable[[Any], bool],
        *,
        window: int = DEFAULT_WINDOW,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        start_seq: int = 0,
        ordered: bool = False,
        max_ahead: int | None = None,
        max_in_flight_bytes: int | None = None,
        shared_link: bool = True,
        keep: Keep | None = None,
    ) -> None:
        self._has_body = has_body
        #: Metadata known to have a body (the fast path asks here before has_body).
        self._bodied: set[bytes] = set()
        self._reorder: ReorderBuffer[Any, object] = ReorderBuffer(
            window=window, max_pending_bytes=max_pending_bytes, start_seq=start_seq
        )
        self._window = window
        self._max_ahead = window if max_ahead is None else max(max_ahead, window)
        self._start = check_seq(start_seq)
        self._state = ClientState.AWAITING_SCHEMA
        self._schema_released = False
        # What failed the stream, as text: the exception itself would keep alive, through the traceback it
        # gathers once a consumer raises it, whatever the consumer's frames hold.
        self._failure: str | None = None
        self._ordered = ordered
        self._expected = self._start  # the next metadata seq an in-order transport must deliver
        self._keep: Keep = keep if keep is not None else _kept
        #: Events released and not yet popped by the driver, oldest first.
        self.events: deque[ClientEvent] = deque()
        # The held run: metadata messages (seq, flatbuffer) that run on from the next one to release, each
        # waiting for its packed body.
        self._held: deque[tuple[int, bytes]] = deque()
        self._held_at: dict[int, bytes] = {}  # the same, by sequence number (for held_metadata)
        self._held_bytes = 0
        # Input ahead of the window, waiting for releases (its source is paused meanwhile).
        self._stalled_meta: deque[Any] = deque()
        self._stalled_bodies: deque[tuple[int, Any, int]] = deque()
        self._stalled_bytes = 0
        self._retry_at = 0  # (see _metadata_fits)
        self._shared = shared_link
        self._stall_bound = max_in_flight_bytes if max_in_flight_bytes is not None else max_pending_bytes
        # Flow towards the consumer: bodies received and not yet consumed.
        self._in_flight = 0
        self._max_in_flight = max_in_flight_bytes if max_in_flight_bytes is not None else 1 << 62
        self._paused = False
        self._stop = False  # a pause began during receive(): hand back the rest of the batch
        self._moved = False  # what pauses says may have changed (see _repause)
        #: Whether reading should pause now: ``(metadata stream, data stream)``. Both while the consumer is
        #: behind (``max_in_flight_bytes``); apart from that, a stream whose input waits for the window (when
        #: the two do not share a link). A new tuple whenever it may have changed.
        self.pauses: tuple[bool, bool] = (False, False)
        self._fast = False  # a metadata message may join the held run in few steps (kept by _settle)
        self._quiet = False  # ... or begin one: nothing waits in the reorder buffer either

    # -- introspection ---------------------------------------------------------------------------------------

    @property
    def state(self) -> ClientState:
        """The current state."""
        return self._state

    @property
    def finished(self) -> bool:
        """End of stream received and every message released."""
        return self._state is ClientState.FINISHED

    @property
    def failed(self) -> bool:
        """Whether an error ended the stream."""
        return self._state is ClientState.FAILED

    @property
    def metadata_complete(self) -> bool:
        """End of stream received and the metadata for every sequence number before its count too: nothing
        more is due on the metadata stream (bodies may still be outstanding)."""
        reorder = self._reorder
        eos = reorder.eos_seq
        if eos is None:
            return False
        return reorder.held_metadata + len(self._held) == (eos - reorder.next_seq) & SEQ_MAX

    @property
    def next_seq(self) -> int:
        """The sequence number of the next message to release."""
        return self._reorder.next_seq

    @property
    def released(self) -> int:
        """How many messages have been released (schema included)."""
        return self._reorder.released

    @property
    def pending_bytes(self) -> int:
        """Bytes held waiting for release (bodies, and the metadata flatbuffers' sizes)."""
        return self._reorder.pending_bytes + self._held_bytes

    @property
    def in_flight(self) -> int:
        """Body bytes received and not yet reported consumed (:meth:`consumed`)."""
        return self._in_flight

    @property
    def waiting(self) -> bool:
        """Whether something is held: a held run, or input waiting for the window."""
        return bool(self._held or self._stalled_meta or self._stalled_bodies)

    def held_metadata(self, tag: int) -> bytes | None:
        """The metadata flatbuffer a packed body tagged ``tag`` will be released with, where that metadata is
        in the held run (it came in order and waits for its body: the common case); None otherwise. Cheap,
        changes nothing: a driver asks it to land a body where it will be decoded before the body arrives
        (see ``keep``)."""
        return self._held_at.get(tag)  # (a packed body's tag is its seq; any other tag is no seq)

    def accepts(self, seq: int) -> bool:
        """Whether ``seq`` is inside the window now (see ``ReorderBuffer.accepts``)."""
        return self._reorder.accepts(seq)

    def classify(self, seq: int) -> SeqClass:
        """Where input for ``seq`` stands now (see ``ReorderBuffer.classify``); :attr:`SeqClass.FAILED` once
        the stream has failed. Cheap, changes nothing."""
        if self._state is ClientState.FAILED:
            return SeqClass.FAILED
        return self._reorder.classify(seq)

    def missing(self) -> list[int]:
        """Some sequence numbers still lacking their metadata or body (see ``ReorderBuffer.missing``). Held
        metadata are handed to the reorder buffer first (:meth:`flush`)."""
        if self._held and self._state is not ClientState.FAILED:
            with contextlib.suppress(DissocError):
                self.flush()
        return self._reorder.missing()

    # -- input -----------------------------------------------------------------------------------------------

    def receive(self, messages: Iterable[Received], *, lent: bool = False) -> int:
        """Take received messages, oldest first; events go to :attr:`events`. Returns how many were taken:
        all of them, unless the stream finished on the way (the rest are not its own; input that comes once it
        finished is a :class:`~dissoc.errors.ProtocolError`) or reading was asked to pause on the way (see
        :attr:`pauses`: the driver keeps the rest and offers them again once it
        resumes). ``lent``: the tagged payloads are valid only during the call (a transport's staging
        buffer; metadata-stream messages are always the caller's own bytes): what the stream keeps of them
        goes through ``keep``. Raises what a peer broke (the stream is failed then)."""
        if self._state is ClientState.FAILED:
            self._check_usable("input")
        taken = 0
        # (what stays the same for the stream's life, as locals: this loop runs once per message)
        held = self._held
        held_at = self._held_at
        reorder = self._reorder
        events = self.events
        bodied = self._bodied
        keep = self._keep
        window = self._window
        ordered = self._ordered
        try:
            for tag, payload, nbytes in messages:
                if taken and self._state is _FINISHED:
                    break  # (what follows the end is not this stream's: left to the driver)
                taken += 1
                if tag is None:
                    if (
                        self._fast
                        and type(payload) is bytes
                        and len(payload) > PREFIX_SIZE
                        and payload[0] == _METADATA
                    ):
                        # The common case: the next metadata message of the held run (or the first of one,
                        # when nothing waits in the reorder buffer), inside the window; what the general
                        # rules would find, in fewer steps.
                        seq = _SEQ.unpack_from(payload, 1)[0]
                        next_seq = reorder.next_seq
                        if (
                            (seq == (held[-1][0] + 1) & SEQ_MAX if held else seq == next_seq and self._quiet)
                            and (seq == self._expected or not ordered)
                            and (seq - next_seq) & SEQ_MAX < window
                        ):
                            metadata = payload[PREFIX_SIZE:]
                            if metadata in bodied or self._with_body(metadata):
                                if ordered:
                                    self._expected = (seq + 1) & SEQ_MAX
                                held.append((seq, metadata))
                                held_at[seq] = metadata
                                self._held_bytes += len(metadata)
                                continue
                    self._metadata_in(payload)
                elif held and tag == held[0][0]:
                    # A packed body for the first held message: both released in one step.
                    seq, metadata = held[0]
                    if reorder.advance(seq, nbytes + len(metadata)):
                        held.popleft()
                        del held_at[seq]
                        self._held_bytes -= len(metadata)
                        body = keep(payload, metadata) if lent else payload
                        events.append(_new_event(MessageReady, (seq, metadata, BODY_PACKED, body, nbytes)))
                        self._in_flight += nbytes
                        if self._state is not _STREAMING:  # the end of stream came already
                            self._released(())
                        if self._in_flight >= self._max_in_flight and not self._paused:
                            self._paused = self._moved = True
                            break  # (the rest waits for the consumer)
                        continue
                    self._body_in(tag, payload, nbytes, lent)
                elif held and tag == held[0][0] | _PAIRS_TAG:
                    # A pair list for the first held message: decoded, then both released in one step.
                    seq, metadata = held[0]
                    pairs = decode_pairs(_host_view(keep(payload, None) if lent else payload))
                    if reorder.advance(seq, nbytes + len(metadata)):
                        held.popleft()
                        del held_at[seq]
                        self._held_bytes -= len(metadata)
                        events.append(_new_event(MessageReady, (seq, metadata, BODY_PAIRS, pairs, nbytes)))
                        self._in_flight += nbytes
                        if self._state is not _STREAMING:
                            self._released(())
                        if self._in_flight >= self._max_in_flight and not self._paused:
                            self._paused = self._moved = True
                            break
                        continue
                    self._body_in(tag, payload, nbytes, lent)
                else:
                    self._body_in(tag, payload, nbytes, lent)
                if self._stop:
                    self._stop = False
                    break
            if self._stalled_bodies or (self._stalled_meta and self._metadata_fits()):
                self._retry_stalled()
        except Exception as exc:
            self._fail(exc)
        if self._moved:
            self._repause()
        return taken

    def _with_body(self, metadata: bytes) -> bool:
        """``has_body(metadata)``, remembered for the metadata that has one (a stream repeats a few)."""
        if not self._has_body(metadata):
            return False
        if len(self._bodied) < _BODIED_KEPT:
            self._bodied.add(metadata)
        return True

    def receive_metadata_message(self, buf: BytesLike) -> list[ClientEvent]:
        """One message from the metadata stream (:meth:`receive` for one); the events it released.

        The metadata of events may view ``buf`` (no copy): keep it unchanged while they are in use."""
        self.receive(((None, buf, 0),))
        return self._drain()

    def receive_body(self, tag: int, payload: object, nbytes: int | None = None) -> list[ClientEvent]:
        """One tagged message from the data stream (:meth:`receive` for one); the events it released.

        ``payload`` is the body as the transport delivered it (host bytes, or device memory for packed
        bodies); ``nbytes`` its size, from ``len()``/``.nbytes`` when omitted. Pair lists (body type 1) must
        be in host memory and are decoded into a :class:`~dissoc.protocol.pairs.PairList`."""
        if self._state is ClientState.FAILED:
            self._check_usable(f"body with tag {fmt_tag(tag) if isinstance(tag, int) else tag!r}")
        if nbytes is None:
            try:
                pairs = type(tag) is int and tag >> BODY_TYPE_SHIFT == BODY_PAIRS
                nbytes = len(_host_view(payload)) if pairs else _payload_nbytes(payload)
            except TypeError as exc:
                self._fail(exc)
        self.receive(((tag, payload, nbytes),))
        return self._drain()

    def consumed(self, nbytes: int) -> bool:
        """The driver's consumer is done with ``nbytes`` of released bodies (a :class:`MessageReady`'s
        ``nbytes``). True when that ends a pause (:attr:`pauses` changed)."""
        self._in_flight -= nbytes
        if self._paused and self._in_flight <= self._max_in_flight // 2:
            self._paused = False
            self._repause()
            return True
        return False

    def flush(self) -> None:
        """Hand the held run to the reorder buffer (nothing followed it as the fast path expects: a timeout,
        a lost connection). Events go to :attr:`events`; errors fail the stream."""
        try:
            self._flush_held()
        except Exception as exc:
            self._fail(exc)

    def close(self) -> None:
        """Declare that no more input will arrive; raise :class:`~dissoc.errors.ProtocolError` unless done.

        The error names what never arrived. Closing a failed stream does nothing more.
        """
        if self._state is ClientState.FAILED or self._state is ClientState.FINISHED:
            return
        try:
            self._flush_held()
            self._reorder.close()
        except DissocError as exc:
            self._fail(exc)

    # -- the general rules -----------------------------------------------------------------------------------

    def _check_usable(self, what: str) -> NoReturn:
        raise ProtocolError(f"{what}: the stream already failed ({self._failure})")

    def _fail(self, exc: BaseException) -> NoReturn:
        self._state = ClientState.FAILED
        self._failure = str(exc)
        self._fast = self._quiet = False
        raise exc

    def _drain(self) -> list[ClientEvent]:
        out = list(self.events)
        self.events.clear()
        return out

    def _settle(self) -> None:
        """Whether the held run's fast path applies from now on (after anything but that path)."""
        fast = self._fast = self._state is _STREAMING and not self._stalled_meta and not self._stalled_bodies
        self._quiet = fast and not self._reorder.backlog

    def _metadata_in(self, buf: Any) -> None:
        """A metadata-stream message, by the general rules."""
        prefix = peek_prefix(buf)
        if prefix is not None and (prefix[0] == _METADATA or prefix[0] == _EOS):
            kind, seq = prefix
            if self._ordered:
                self._check_order(kind, seq)
            if kind == _EOS:
                held = self._held
                reorder = self._reorder
                # The held run stays held when the count is past it (the reorder buffer checks the rest).
                if held and (held[-1][0] - reorder.next_seq) & SEQ_MAX >= (seq - reorder.next_seq) & SEQ_MAX:
                    self._flush_held()
                self._metadata(buf)
                return
            if kind == _METADATA:
                if self._stalled_meta or self._ahead(seq):
                    if not self._stalled_meta:
                        self._stall_metadata_from(seq)
                    self._stalled_meta.append(buf)
                    self._stalled(len(buf))
                    return
                if self._hold(seq, buf):
                    return
        if self._held:
            self._flush_held()
        self._metadata(buf)

    def _body_in(self, tag: int, payload: Any, nbytes: int, lent: bool) -> None:
        """A tagged message of the data stream, by the general rules."""
        if tag >> BODY_TYPE_SHIFT == BODY_ERROR:
            view = as_byte_view(payload)
            err = decode_stream_message(view)
            if isinstance(err, ErrorMessage):
                raise RemoteError(err.code, err.message)
            raise ProtocolError(f"data stream: an error tag carried a {type(err).__name__}, not an error")
        if tag == ARENA_TAG:
            self.events.append(decode_arena(as_byte_view(payload)))
            return
        self._in_flight += nbytes
        held = self._held
        if held:
            if tag == held[0][0]:  # a packed body (type 0: the tag is the seq) for the first held message
                seq, metadata = held.popleft()
                del self._held_at[seq]
                self._held_bytes -= len(metadata)
                self._add_metadata(seq, metadata)
                self._body(tag, self._keep(payload, metadata) if lent else payload, nbytes)
                self._flow()
                return
            self._flush_held()
        if lent:
            payload = self._keep(payload, None)
        if self._stalled_bodies or self._ahead(seq_of(tag)):
            self._stalled_bodies.append((tag, payload, nbytes))
            self._stalled(nbytes)
        else:
            self._body(tag, payload, nbytes)
        self._flow()

    def _flow(self) -> None:
        if self._in_flight >= self._max_in_flight and not self._paused:
            self._paused = self._stop = self._moved = True

    def _ahead(self, seq: int) -> bool:
        """Whether input for ``seq`` must wait for releases (ahead of the window, within ``max_ahead``).

        A sequence number already released or past the end goes on at once (the reorder buffer then reports
        it), and one beyond ``max_ahead`` is an error rather than a wait only a timeout would end.
        """
        if self._max_ahead == self._window or self._reorder.classify(seq) <= 0:
            return False
        ahead = (seq - self._reorder.next_seq) & SEQ_MAX
        if ahead >= self._max_ahead:
            raise ResourceError(
                f"message {fmt_seq(seq)} is {ahead} sequence numbers ahead of the next one to release "
                f"({fmt_seq(self._reorder.next_seq)}); at most {self._window} may be pending"
            )
        return True

    def _stalled(self, nbytes: int) -> None:
        """Input waits for the window: its source pauses, unless both streams share the link (then what it
        waits for comes after it), where the waiting bytes are bounded instead."""
        self._stalled_bytes += nbytes
        self._fast = self._quiet = False
        if self._shared:
            if self._stalled_bytes > self._stall_bound:
                raise ResourceError(
                    f"{self._stalled_bytes} bytes arrived ahead of the reorder window (window "
                    f"{self._window}), more than max_in_flight_bytes ({self._stall_bound})"
                )
            return
        self._stop = self._moved = True

    def _repause(self) -> None:
        """What :attr:`pauses` says now."""
        self._moved = False
        paused = self._paused
        if self._shared:
            self.pauses = (paused, paused)
        else:
            self.pauses = (bool(self._stalled_meta), paused or bool(self._stalled_bodies))

    def _metadata_fits(self) -> bool:
        """Whether enough of the metadata that waits for the window fits it now to be worth passing on: a
        quarter of the window beyond the first waiting message (one at a time, each release would resume the
        metadata source for one message)."""
        return bool(self._stalled_meta) and (self._reorder.next_seq - self._retry_at) & SEQ_MAX < SEQ_HALF

    def _stall_metadata_from(self, seq: int) -> None:
        """Metadata message ``seq`` is the first to wait for the window: when to pass it on (see above)."""
        window = self._window
        self._retry_at = (seq - window + 1 + window // 4) & SEQ_MAX

    def _retry_stalled(self) -> None:
        """Pass on the input that waited for the window, as far as the window now allows."""
        progress = True
        while progress and not self.finished:
            progress = False
            stalled_meta = self._stalled_meta
            while stalled_meta:
                buf = stalled_meta[0]
                prefix = peek_prefix(buf)
                if prefix is not None and self._ahead(prefix[1]):
                    self._stall_metadata_from(prefix[1])
                    break
                stalled_meta.popleft()
                self._moved = True
                self._stalled_bytes -= len(buf)
                # held for its body as if it had just come (else every later message would meet a reorder
                # buffer holding something, and none would pair again)
                if prefix is None or prefix[0] != _METADATA or not self._hold(prefix[1], buf):
                    if self._held:
                        self._flush_held()
                    self._metadata(buf)
                progress = True
            stalled_bodies = self._stalled_bodies
            while stalled_bodies and not self.finished:
                tag, payload, nbytes = stalled_bodies[0]
                if self._ahead(seq_of(tag)):
                    break
                stalled_bodies.popleft()
                self._moved = True
                self._stalled_bytes -= nbytes
                self._body(tag, payload, nbytes)
                progress = True
        self._settle()

    def _hold(self, seq: int, buf: BytesLike) -> bool:
        """Hold metadata message ``seq`` for its body when it runs on from the next one to release (or from
        the held run), is inside the window and has a body; False: it goes through the reorder buffer."""
        if self._stalled_bodies:
            return False
        held = self._held
        reorder = self._reorder
        if held:
            if seq != (held[-1][0] + 1) & SEQ_MAX:
                return False
        elif not (seq == reorder.next_seq and self._state is _STREAMING and not reorder.backlog):
            return False
        if reorder.classify(seq) != SeqClass.ACCEPT:  # (the window, and the end of stream)
            return False
        metadata = bytes(as_byte_view(buf)[PREFIX_SIZE:])
        if not metadata or not self._has_body(metadata):
            return False
        held.append((seq, metadata))
        self._held_at[seq] = metadata
        self._held_bytes += len(metadata)
        self._settle()
        return True

    def _flush_held(self) -> None:
        """The held metadata go through the reorder buffer on their own (what came next did not pair)."""
        held = self._held
        while held:
            seq, metadata = held.popleft()
            del self._held_at[seq]
            self._held_bytes -= len(metadata)
            self._add_metadata(seq, metadata)

    def _check_order(self, kind: int, seq: int) -> None:
        """On an ordered transport every metadata message has the next number, and the end of stream carries
        the count."""
        expected = self._expected
        if seq != expected:
            what = "end of stream" if kind == _EOS else "metadata message"
            # Those received are the seqs before the expected one (fewer than 2**32 in any real stream).
            if (expected - seq) % SEQ_MODULUS <= (expected - self._start) % SEQ_MODULUS:
                why = "a duplicate of one already received"
            else:
                why = f"a jump {(seq - expected) % SEQ_MODULUS} ahead: messages were skipped"
            raise ProtocolError(
                f"metadata stream: expected {what} {fmt_seq(expected)}, got {fmt_seq(seq)} "
                f"(the transport delivers in order, so this is {why})"
            )
        if kind == _METADATA:
            self._expected = (seq + 1) & SEQ_MAX

    # -- into the reorder buffer -----------------------------------------------------------------------------

    def _metadata(self, buf: BytesLike) -> None:
        """A metadata-stream message through the reorder buffer."""
        msg = decode_stream_message(buf)
        reorder = self._reorder
        if isinstance(msg, MetadataMessage):
            has_body = bool(self._has_body(msg.metadata))
            if has_body and msg.seq == self._start and reorder.released == 0:
                raise ProtocolError(
                    f"first message (seq {fmt_seq(msg.seq)}) must be a schema: expected a schema without "
                    "body, got metadata for a message with a body"
                )
            done = reorder.add_metadata(msg.seq, msg.metadata, has_body, len(msg.metadata))
        elif isinstance(msg, EndOfStream):
            if reorder.released == 0 and msg.seq == reorder.next_seq and not reorder.ended:
                raise ProtocolError(
                    f"end of stream (seq {fmt_seq(msg.seq)}): expected the schema first, got an end of "
                    "stream counting no metadata messages at all"
                )
            done = reorder.end(msg.seq)
        else:
            assert isinstance(msg, ErrorMessage)
            if reorder.ended:
                raise ProtocolError(
                    f"metadata stream: expected only metadata after end of stream "
                    f"(seq {fmt_seq(reorder.eos_seq or 0)}), got an error message with seq "
                    f"{fmt_seq(msg.seq)} ({msg.code}: {msg.message})"
                )
            _log.debug("client: error message seq=%s code=%r", fmt_seq(msg.seq), msg.code)
            raise RemoteError(msg.code, msg.message)
        self._released(done)

    def _add_metadata(self, seq: int, metadata: bytes) -> None:
        """A held metadata message (known to have a body, after the schema) through the reorder buffer."""
        self._released(self._reorder.add_metadata(seq, metadata, True, len(metadata)))

    def _body(self, tag: int, payload: object, nbytes: int) -> None:
        """A body through the reorder buffer (pair lists decoded on the way)."""
        if type(tag) is int and 0 <= tag <= _PACKED_TAG_MAX:  # a packed body's tag: bits 32-63 clear
            seq, body_type = tag, BODY_PACKED
        else:
            seq, body_type = parse_body_tag(tag)
        body: object = payload
        if body_type == BODY_PAIRS:
            body = decode_pairs(_host_view(payload))
        self._released(self._reorder.add_body(seq, body_type, body, nbytes))

    def _released(self, done: Sequence[Complete[Any, object]]) -> None:
        """Messages the reorder buffer released become events; the state follows."""
        events = self.events
        for c in done:
            if self._schema_released:
                events.append(MessageReady(c.seq, c.metadata, c.body_type, c.body, c.nbytes))
            else:
                self._schema_released = True
                events.append(SchemaReceived(c.seq, c.metadata))
        reorder = self._reorder
        if not done and self._state is _STREAMING and not reorder.ended:
            self._settle()  # nothing released, no end of stream: the state stays (the reorder buffer moved)
            return
        if reorder.finished:
            if self._state is not ClientState.FINISHED:
                self._state = ClientState.FINISHED
                events.append(StreamEnded(reorder.released))
                _log.debug("client: stream finished after %d messages", reorder.released)
        elif reorder.ended:
            self._state = ClientState.ENDED
        elif self._schema_released:
            self._state = _STREAMING
        self._settle()


def _host_view(payload: object) -> memoryview:
    if isinstance(payload, memoryview | bytes | bytearray | np.ndarray):
        return as_byte_view(payload)
    raise TypeError(f"a pair-list body must be in host memory, got {type(payload).__name__}")
