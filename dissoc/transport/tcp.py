"""The TCP transport (scheme ``tcp``): the default data path.

Framing (DESIGN.md section 3): every message is a 24-byte header — u8 kind (1 untagged, 2 tagged), 7 zero
bytes, u64 LE tag (0 for untagged), u64 LE payload length — followed by the payload.

The socket is non-blocking and driven straight from the event loop (no asyncio streams or transports, which
copy): a reader callback ``recv_into``'s a small staging buffer and parses frames there; a large payload is
read straight into its final buffer (from the allocator) once the part already staged is copied over. Sending
gathers the header and the caller's buffers with ``sendmsg`` and, when the kernel takes only part, waits for
writability and goes on from where it stopped, never copying a payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, Unpack

import pyarrow as pa

from dissoc.buffers import DEFAULT_POOL
from dissoc.errors import DissocError, TransportError
from dissoc.logs import peer_log
from dissoc.metrics import SERVER
from dissoc.transport.base import (
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    Allocator,
    Connection,
    FrameError,
    Handler,
    Listener,
    MessageTooLargeError,
    ReceiveBudget,
    ReceiveBudgetError,
    Received,
    SendData,
    TagLimitError,
    as_views,
    check_u64,
    fresh_error,
)
from dissoc.transport.registry import register_transport

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_BACKLOG",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_KEEPALIVE",
    "HEADER_SIZE",
    "KIND_TAGGED",
    "KIND_UNTAGGED",
    "ConnectOptions",
    "Keepalive",
    "ListenOptions",
    "format_keepalive",
    "parse_keepalive",
    "TcpConnection",
    "TcpListener",
    "connect_socket",
    "connect_stream",
    "connect_tcp",
    "decode_header",
    "listen_socket",
    "encode_header",
    "serve_stream",
    "serve_tcp",
]

logger = logging.getLogger(__name__)

HEADER_SIZE = 24
KIND_UNTAGGED = 1
KIND_TAGGED = 2

# The first u64 holds the kind in its low byte and the seven padding bytes above it, so a valid frame has
# a first word of exactly 1 or 2.
_HEADER = struct.Struct("<QQQ")

_STAGING_BYTES = 256 * 1024
# ... on the connections a client opens, which bring the batches: a read brings up to this much, and on
# loopback each read costs the reader the window update it sends, whatever its size (small batches: about
# 9.6 us of client CPU a batch with 256 KiB, 6.4-6.9 us with 2 MiB). Servers keep the smaller one: their
# peers send requests and frees, and every connection a client opens holds its stage.
_CONNECT_STAGING_BYTES = 2 * 1024 * 1024
# A payload with at least this much left to read is read straight into its final buffer.
_DIRECT_READ_MIN = 64 * 1024
# SO_RCVLOWAT while a large payload is read (see TcpConnection._set_low_water).
_LOW_WATER = 1024 * 1024
# Bytes one reader callback may consume before yielding to other tasks.
_READ_BUDGET = 16 * 1024 * 1024
# ... of which at most this much through the staging buffer (small messages): their consumer then takes them
# while they are still in the cache, and the receive buffers they land in are reused sooner (measured with
# small batches: 1 MiB a wake-up took about a tenth off the client's time against 16 MiB).
_STAGED_READ_BUDGET = 1024 * 1024
# sendmsg accepts at most IOV_MAX buffers (1024 on Linux).
_IOV_MAX = 1024
# A large frame goes out this much per sendmsg: on loopback 16 and 64 MiB batches moved at 4.7-4.9 GB/s sent
# whole, 5.2-5.6 in 256 KiB or 1-4 MiB pieces and 5.8-6.3 in 512 KiB pieces (the server's CPU per GB went
# from 0.18-0.22 s to 0.16), 3.2 in 128 KiB ones.
_SEND_CHUNK = 512 * 1024
# A bytes payload up to this size is copied next to its frame header (fewer buffers to send).
_JOIN_BYTES = 4096
# At most this many whole frames are offered to a receiver in one call (Receiver.on_messages): untagged ones
# it leaves were copied out for nothing, so the waste per offer stays bounded.
_RUN_MESSAGES = 512
_U64_MAX = (1 << 64) - 1
# After an accept failed for want of file descriptors (or kernel memory), accepting pauses this long.
ACCEPT_BACKOFF = 0.5
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def encode_header(tagged: bool, tag: int, length: int) -> bytes:
    """The 24-byte frame header of a message."""
    return _HEADER.pack(KIND_TAGGED if tagged else KIND_UNTAGGED, tag, length)


def decode_header(
    header: Buffer, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> tuple[bool, int, int]:
    """Parse and check a 24-byte frame header: ``(tagged, tag, length)``; raises :class:`FrameError` or
    :class:`MessageTooLargeError`."""
    first, tag, length = _HEADER.unpack_from(header)
    _check_header(first, tag, length, max_message_bytes, "")
    return first == KIND_TAGGED, tag, length


def _check_header(first: int, tag: int, length: int, max_message_bytes: int, where: str) -> None:
    if first != KIND_TAGGED and first != KIND_UNTAGGED:
        kind = first & 0xFF
        if kind in (KIND_UNTAGGED, KIND_TAGGED):
            padding = (first >> 8).to_bytes(7, "little").hex()
            raise FrameError(
                f"{where}frame corrupt: expected 7 zero padding bytes after the kind, got {padding}"
            )
        raise FrameError(
            f"{where}frame corrupt: expected frame kind {KIND_UNTAGGED} (untagged) or {KIND_TAGGED} "
            f"(tagged), got {kind}"
        )
    if first == KIND_UNTAGGED and tag != 0:
        raise FrameError(f"{where}frame corrupt: an untagged frame must carry tag 0, got {tag:#018x}")
    if length > max_message_bytes:
        what = f"tagged message {tag:#018x}" if first == KIND_TAGGED else "untagged message"
        raise MessageTooLargeError(
            f"{where}the peer announced a {what} of {length} bytes; the limit (max_message_bytes) is "
            f"{max_message_bytes}"
        )


def tls_record_hint(first_bytes: Buffer) -> str | None:
    """What to say when a connection's first bytes are a TLS record where a frame header was expected (a TLS
    peer on a plaintext connection), else None. Used on error paths only."""
    head = bytes(memoryview(first_bytes)[:2])
    if len(head) < 2 or head[1] != 0x03:
        return None
    if head[0] == 0x15:  # an alert: a TLS server refusing this plaintext client
        return (
            "the peer answered with a TLS alert: it is a TLS server and this connection is plaintext; "
            "connect with its tls:// URI (and the CA that signed its certificate: --tls-ca)"
        )
    if head[0] == 0x16:  # a handshake record: a TLS client's ClientHello
        return (
            "the peer sent a TLS handshake: it is a TLS client and this server is plaintext (tcp://); "
            "start the server with --tls-cert/--tls-key, or connect with the tcp:// URI"
        )
    return None


@dataclass(frozen=True, slots=True)
class Keepalive:
    """How a TCP connection notices a peer that is gone without a word (a host that vanished, a partition):
    after ``idle`` seconds without traffic the kernel sends a probe every ``interval`` seconds, and ``count``
    unanswered ones end the connection; data sent but not acknowledged for ``user_timeout`` seconds ends it
    too (``TCP_USER_TIMEOUT``; None: the kernel's retransmission limit, about 15 minutes). Either way the
    connection's next read or write fails with :class:`~dissoc.errors.TransportError`.

    The defaults (:data:`DEFAULT_KEEPALIVE`) notice an idle dead peer in about a minute and a stalled send in
    a minute; a connection that carries nothing for hours is kept. Set per listener and per connection
    (``keepalive`` of :class:`ListenOptions` and :class:`ConnectOptions`; None: off).
    """

    idle: float = 30.0
    interval: float = 10.0
    count: int = 3
    user_timeout: float | None = 60.0

    def __post_init__(self) -> None:
        for name in ("idle", "interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 1 <= value <= 32767:
                raise ValueError(f"keepalive {name}: expected 1 to 32767 seconds, got {value!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or not 1 <= self.count <= 127:
            raise ValueError(f"keepalive count: expected 1 to 127 probes, got {self.count!r}")
        timeout = self.user_timeout
        bad = isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        if timeout is not None and bad:
            raise ValueError(f"keepalive user_timeout: expected seconds > 0 or None, got {timeout!r}")


#: Keepalive of every TCP and TLS connection unless its options say otherwise.
DEFAULT_KEEPALIVE = Keepalive()


def parse_keepalive(text: str) -> Keepalive | None:
    """``IDLE,INTERVAL,COUNT[,USER_TIMEOUT]`` (seconds, seconds, probes, seconds or ``none``), or ``off``:
    what ``--keepalive`` takes. Raises :class:`ValueError` naming what is wrong."""
    text = text.strip()
    if text.lower() in ("off", "none", "0"):
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4):
        raise ValueError(f"keepalive: expected IDLE,INTERVAL,COUNT[,USER_TIMEOUT] or off, got {text!r}")
    try:
        idle, interval, count = float(parts[0]), float(parts[1]), int(parts[2])
        user = None if len(parts) < 4 or parts[3].lower() == "none" else float(parts[3])
    except ValueError:
        raise ValueError(
            f"keepalive: expected numbers in IDLE,INTERVAL,COUNT[,USER_TIMEOUT], got {text!r}"
        ) from None
    return Keepalive(idle, interval, count, user if len(parts) == 4 else DEFAULT_KEEPALIVE.user_timeout)


def format_keepalive(keepalive: Keepalive | None) -> str:
    """What :func:`parse_keepalive` reads back."""
    if keepalive is None:
        return "off"
    user = "none" if keepalive.user_timeout is None else f"{keepalive.user_timeout:g}"
    return f"{keepalive.idle:g},{keepalive.interval:g},{keepalive.count},{user}"


def _keepalive(sock: socket.socket, keepalive: Keepalive | None) -> None:
    if keepalive is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", keepalive.idle),
        ("TCP_KEEPINTVL", keepalive.interval),
        ("TCP_KEEPCNT", keepalive.count),
    ):
        option = getattr(socket, name, None)
        if option is not None:  # (Linux; other systems keep their own timing)
            sock.setsockopt(socket.IPPROTO_TCP, option, max(1, int(value)))
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None and keepalive.user_timeout is not None:
        sock.setsockopt(socket.IPPROTO_TCP, user_timeout, max(1, int(keepalive.user_timeout * 1000)))


def _configure_socket(
    sock: socket.socket, sndbuf: int | None, rcvbuf: int | None, keepalive: Keepalive | None = None
) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keepalive(sock, keepalive)
    if sndbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)


def _first_chunk(pieces: list[memoryview], first: int) -> list[memoryview]:
    """The buffers of one sendmsg of a large frame: ``pieces[first:]`` up to ``_SEND_CHUNK`` bytes (the last
    one cut) and at most ``_IOV_MAX`` of them."""
    chunk: list[memoryview] = []
    room = _SEND_CHUNK
    for i in range(first, min(len(pieces), first + _IOV_MAX)):
        piece = pieces[i]
        size = len(piece)
        if size >= room:
            chunk.append(piece[:room] if size > room else piece)
            break
        chunk.append(piece)
        room -= size
    return chunk


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _endpoint(address: Any) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
    return str(address)


class TcpConnection(Connection):
    """A :class:`Connection` over a connected stream socket (TCP, or a Unix socket pair for tests).

    Build it inside a running event loop from a connected socket; it becomes non-blocking and owned by the
    connection. Most code gets one from :func:`connect_tcp` or from a :func:`serve_tcp` handler.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        allocator: Allocator | None = None,
        staging_bytes: int = _STAGING_BYTES,
        receive_budget: ReceiveBudget | None = None,
    ) -> None:
        try:
            local, remote = _endpoint(sock.getsockname()), _endpoint(sock.getpeername())
        except OSError:
            local, remote = "?", "?"
        super().__init__(
            max_message_bytes=max_message_bytes,
            max_buffered_bytes=max_buffered_bytes,
            allocator=allocator,
            description=f"tcp {local}->{remote}",
            receive_budget=receive_budget,
        )
        if staging_bytes < HEADER_SIZE:
            raise ValueError(f"staging_bytes must be at least {HEADER_SIZE}, got {staging_bytes}")
        self._loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        # receiving
        self._stage = bytearray(staging_bytes)
        self._stage_view = memoryview(self._stage)
        self._rpos = 0
        self._wpos = 0
        self._header: tuple[int, int, int] | None = None  # parsed, waiting for admission
        self._target: memoryview | None = None  # payload being filled
        self._target_obj: Any = None
        self._target_tagged = False
        self._target_tag = 0
        self._target_len = 0
        self._filled = 0
        self._paused = False
        self._refused = False  # a frame over a limit was refused: nothing more is read
        self._resume_scheduled = False
        self._low_water = 1
        self._frames = 0  # frame headers parsed (see idle_frame)
        # sending
        self._sending = False
        self._send_waiters: deque[asyncio.Future[None]] = deque()
        self._write_waiter: asyncio.Future[None] | None = None
        self._send_error: TransportError | None = None
        self._loop.add_reader(self._fd, self._on_readable)
        logger.debug("%s open", self._description)

    # ------------------------------------------------------------------------------------------------ sending

    async def _send_frame(self, tagged: bool, tag: int, views: list[memoryview], total: int) -> None:
        pieces = [memoryview(_HEADER.pack(KIND_TAGGED if tagged else KIND_UNTAGGED, tag, total))]
        pieces.extend(views)
        await self._send_pieces(pieces, total + HEADER_SIZE)

    async def _send_pieces(self, pieces: list[memoryview], total: int) -> None:
        """Write whole frames, taking the send turn first (frames of concurrent senders never mix)."""
        if self._sending or self._send_waiters:
            await self._acquire_send()
        else:
            self._sending = True
        try:
            if self._closed:
                raise self._closed_error("cannot send")
            if self._send_error is not None:
                raise fresh_error(self._send_error)
            await self._send_all(pieces, total)
        finally:
            self._release_send()

    async def send_many(self, messages: Sequence[tuple[int | None, SendData]]) -> None:
        """Several frames, in order, through one gathered ``sendmsg`` (see :meth:`Connection.send_many`).

        Frame headers and small ``bytes`` payloads are copied together into one buffer up to the next large
        payload, which goes as it is (a body of one ``pa.Buffer`` without further checks): a server streaming
        small batches sends two buffers a batch, not four.
        """
        pieces: list[memoryview] = []
        append = pieces.append
        pack = _HEADER.pack
        small: list[bytes] = []  # headers and small payloads not yet joined into a piece
        total = 0
        for tag, data in messages:
            if tag is None:
                kind, word = KIND_UNTAGGED, 0
            else:
                if type(tag) is not int or tag < 0 or tag > _U64_MAX:
                    check_u64(tag, "tag")
                kind, word = KIND_TAGGED, tag
            payload: Any = data
            data_type = type(payload)
            if data_type is bytes and len(payload) <= _JOIN_BYTES:
                size = len(payload)
                small.append(pack(kind, word, size))
                small.append(payload)
            else:
                if data_type is list and len(payload) == 1 and type(payload[0]) is pa.Buffer:
                    body: pa.Buffer = payload[0]
                    size = body.size
                    views = None
                else:
                    views, size = as_views(data)
                if small:
                    small.append(pack(kind, word, size))
                    append(memoryview(b"".join(small)))
                    small = []
                else:
                    append(memoryview(pack(kind, word, size)))
                if views is None:
                    append(memoryview(body))
                else:
                    pieces += views
            total += size + HEADER_SIZE
        if small:
            append(memoryview(b"".join(small)))
        await self._send_pieces(pieces, total)

    async def _acquire_send(self) -> None:
        """Wait for the turn to send (frames of concurrent senders must not interleave); FIFO."""
        future: asyncio.Future[None] = self._loop.create_future()
        self._send_waiters.append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release_send()  # the turn was handed to us: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._send_waiters.remove(future)
            raise

    def _release_send(self) -> None:
        waiters = self._send_waiters
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(None)  # hand the turn over directly; _sending stays True
                return
        self._sending = False

    async def _send_all(self, pieces: list[memoryview], total: int) -> None:
        sock = self._sock
        count = len(pieces)
        first = 0
        done = 0
        while first < count:
            try:
                if total - done <= _SEND_CHUNK:
                    if first == 0 and count <= _IOV_MAX:
                        sent = sock.sendmsg(pieces)
                    else:
                        sent = sock.sendmsg(pieces[first : first + _IOV_MAX])
                else:
                    sent = sock.sendmsg(_first_chunk(pieces, first))
            except (BlockingIOError, InterruptedError):
                try:
                    await self._wait_writable()
                except asyncio.CancelledError:
                    if done:
                        self._teardown(
                            TransportError(
                                f"{self._description}: a send was cancelled after {done} of {total} bytes "
                                "of its frame; the stream cannot be resumed"
                            )
                        )
                    raise
                continue
            except OSError as exc:
                # Only the sending side is broken: the reader goes on until it sees the end of the stream, so
                # messages the peer sent before it went away are not lost.
                self._send_error = TransportError(
                    f"{self._description}: sending failed after {done} of {total} bytes of a frame: {exc}"
                )
                logger.debug("%s", self._send_error)
                raise fresh_error(self._send_error) from exc
            done += sent
            if done == total:  # all of it (the common case): no piece to trim
                return
            while first < count:
                size = len(pieces[first])
                if sent >= size:
                    sent -= size
                    first += 1
                else:
                    if sent:
                        pieces[first] = pieces[first][sent:]
                    break

    async def _wait_writable(self) -> None:
        if self._closed:
            raise self._closed_error("cannot send")
        future: asyncio.Future[None] = self._loop.create_future()
        self._write_waiter = future
        self._loop.add_writer(self._fd, _wake, future)
        try:
            await future
        finally:
            self._write_waiter = None
            if not self._closed:
                self._loop.remove_writer(self._fd)

    # ---------------------------------------------------------------------------------------------- receiving

    def _on_readable(self) -> None:
        try:
            self._read()
        finally:
            if not self._closed and not self._refused:
                self._set_low_water()

    def _set_low_water(self) -> None:
        """Have the kernel wake the reader only once a good part of a large payload is there.

        While a large payload is read straight into its buffer, SO_RCVLOWAT asks for at least
        min(remaining, 1 MiB) before the socket counts as readable: fewer, larger reads and far fewer trips
        through the event loop. Between payloads it is 1 (any byte of a header matters). The kernel caps the
        value to what the receive buffer can hold.
        """
        target = self._target
        remaining = self._target_len - self._filled if target is not None else 0
        low_water = min(remaining, _LOW_WATER) if remaining >= _DIRECT_READ_MIN else 1
        if low_water != self._low_water:
            self._low_water = low_water
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low_water)

    def _read(self) -> None:
        sock = self._sock
        # No more per wake-up than the buffering budget: consumers get to claim what arrived before the next
        # read, so a burst cannot pile up past the budget merely because they had no turn yet.
        budget = min(_READ_BUDGET, self._max_buffered_bytes)
        staged_budget = _STAGED_READ_BUDGET
        try:
            while True:
                target = self._target
                if target is not None and self._target_len - self._filled >= _DIRECT_READ_MIN:
                    want = self._target_len - self._filled
                    n = sock.recv_into(target[self._filled :], want)
                    if n == 0:
                        self._on_eof()
                        return
                    self._filled += n
                    if self._filled == self._target_len:
                        self._finish_target()
                else:
                    want = len(self._stage) - self._wpos
                    n = sock.recv_into(self._stage_view[self._wpos :], want)
                    if n == 0:
                        self._on_eof()
                        return
                    self._wpos += n
                    self._process()
                    if self._paused or self._closed:
                        return
                    staged_budget -= n
                    if staged_budget <= 0:
                        return
                budget -= n
                if n < want or budget <= 0:
                    return
        except (BlockingIOError, InterruptedError):
            return
        except DissocError as exc:
            self._reader_failed(exc)
        except OSError as exc:
            self._teardown(TransportError(f"{self._description}: receiving failed {self._position()}: {exc}"))
        except Exception as exc:
            logger.exception("%s: unexpected error in the reader", self._description)
            self._teardown(TransportError(f"{self._description}: internal error in the reader: {exc!r}"))

    def _process(self) -> None:
        """Parse the staged bytes: deliver complete messages, start the payload of the next one."""
        stage = self._stage
        view = self._stage_view
        rpos = self._rpos
        wpos = self._wpos
        try:
            while True:
                target = self._target
                if target is not None:
                    need = self._target_len - self._filled
                    take = wpos - rpos if wpos - rpos < need else need
                    if take:
                        target[self._filled : self._filled + take] = view[rpos : rpos + take]
                        self._filled += take
                        rpos += take
                    if take < need:
                        break
                    self._finish_target()
                header = self._header
                if header is None:
                    if self._frames and self._receiver is not None:
                        rpos = self._fast_lane(rpos, wpos)
                    if wpos - rpos < HEADER_SIZE:
                        break
                    first, tag, length = _HEADER.unpack_from(stage, rpos)
                    if first != KIND_UNTAGGED or tag != 0 or length > self._max_message_bytes:
                        if self._frames == 0:
                            self._check_not_tls(view[rpos : rpos + 2])
                        _check_header(first, tag, length, self._max_message_bytes, f"{self._description}: ")
                    rpos += HEADER_SIZE
                    self._frames += 1
                    header = (first, tag, length)
                else:
                    first, tag, length = header
                tagged = first == KIND_TAGGED
                if not self._admit(tagged, tag, length):
                    self._header = header
                    self._pause()
                    break
                self._accept(tag if tagged else None, length)
                self._header = None
                if not tagged and wpos - rpos >= length:
                    self._deliver(None, bytes(view[rpos : rpos + length]), length)
                    rpos += length
                    continue
                if tagged:
                    if wpos - rpos >= length and self._offer([(tag, view[rpos : rpos + length], length)]):
                        rpos += length
                        continue
                    obj, target = self._allocate(tag, length)
                    if wpos - rpos >= length:  # all staged already (small payloads): no target to track
                        target[:] = view[rpos : rpos + length]
                        rpos += length
                        self._deliver(tag, obj, length)
                        continue
                else:
                    obj = DEFAULT_POOL.allocate(length)
                    target = obj.data
                self._target_obj = obj
                self._target = target
                self._target_tagged = tagged
                self._target_tag = tag
                self._target_len = length
                self._filled = 0
        finally:
            if rpos == wpos:
                rpos = wpos = 0
            elif rpos:
                view[: wpos - rpos] = view[rpos:wpos]
                wpos -= rpos
                rpos = 0
            self._rpos = rpos
            self._wpos = wpos

    def _fast_lane(self, rpos: int, wpos: int) -> int:
        """Whole well-formed frames staged one after another, offered to the receiver in one call (at most
        :data:`_RUN_MESSAGES`; tagged payloads lent in place, untagged ones as ``bytes``; see
        ``Connection._offer``). Returns where it stopped: after the last frame taken; the general path takes
        the rest (a frame that is not whole or not plainly well formed, or one the receiver left)."""
        stage = self._stage
        view = self._stage_view
        limit = self._max_message_bytes
        begin = rpos
        messages: list[Received] = []
        ends: list[int] = []
        while wpos - rpos >= HEADER_SIZE and len(messages) < _RUN_MESSAGES:
            first, tag, length = _HEADER.unpack_from(stage, rpos)
            start = rpos + HEADER_SIZE
            end: int = start + length
            if end > wpos or length > limit:
                break
            if first == KIND_TAGGED:
                messages.append((tag, view[start:end], length))
            elif first == KIND_UNTAGGED and tag == 0:
                messages.append((None, bytes(view[start:end]), length))
            else:
                break
            ends.append(end)
            rpos = end
        taken = self._offer(messages) if messages else 0
        self._frames += taken
        return ends[taken - 1] if taken else begin

    def _finish_target(self) -> None:
        obj = self._target_obj
        self._target = None
        self._target_obj = None
        if self._target_tagged:
            self._deliver(self._target_tag, obj, self._target_len)
        else:
            self._deliver(None, memoryview(obj), self._target_len)

    def _position(self) -> str:
        if self._target is not None:
            what = (
                f"tagged message {self._target_tag:#018x}" if self._target_tagged else "an untagged message"
            )
            return f"in the middle of {what} ({self._filled} of {self._target_len} payload bytes received)"
        if self._header is not None:
            first, tag, length = self._header
            what = f"tagged message {tag:#018x}" if first == KIND_TAGGED else "an untagged message"
            return f"before the payload of {what} ({length} bytes announced)"
        if self._wpos > self._rpos:
            staged = self._wpos - self._rpos
            return f"in the middle of a frame ({staged} bytes staged, at least {HEADER_SIZE} expected)"
        return "between frames"

    def idle_frame(self) -> object | None:
        """A token for the frame partly received (header or payload), None between frames."""
        if self._target is not None or self._header is not None:
            return 2 * self._frames + 1
        if self._wpos > self._rpos:
            return 2 * self._frames
        return None

    def _check_not_tls(self, first_bytes: Buffer) -> None:
        """A clear :class:`TransportError` when the first bytes received are a TLS record (TLS on one side
        only), instead of a corrupt-frame error."""
        hint = tls_record_hint(first_bytes)
        if hint is not None:
            peer_log.log(logging.WARNING, ("tls mismatch", hint[:24]), "%s: %s", self._description, hint)
            raise TransportError(f"{self._description}: {hint}")

    def _on_eof(self) -> None:
        if self._frames == 0 and self._wpos - self._rpos >= 2:
            hint = tls_record_hint(self._stage_view[self._rpos : self._rpos + 2])
            if hint is not None:
                self._teardown(TransportError(f"{self._description}: {hint}"))
                return
        position = self._position()
        if position == "between frames":
            self._teardown(TransportError(f"{self._description}: the peer closed the connection"))
        else:
            self._teardown(TransportError(f"{self._description}: the peer closed the connection {position}"))

    def _pause(self) -> None:
        if not self._paused:
            self._paused = True
            self._loop.remove_reader(self._fd)
            logger.debug(
                "%s: %d bytes unclaimed (budget %d); reading paused",
                self._description,
                self._buffered,
                self._max_buffered_bytes,
            )

    def _on_flow(self) -> None:
        if self._paused and not self._resume_scheduled and not self._closed and not self._refused:
            self._resume_scheduled = True
            self._loop.call_soon(self._try_resume)

    def _try_resume(self) -> None:
        self._resume_scheduled = False
        if not self._paused or self._closed or self._header is None:
            return
        first, tag, length = self._header
        try:
            if not self._admit(first == KIND_TAGGED, tag, length):
                return
            self._paused = False
            self._loop.add_reader(self._fd, self._on_readable)
            logger.debug("%s: reading resumed", self._description)
            self._process()
        except DissocError as exc:
            self._reader_failed(exc)
        if not self._closed and not self._refused:
            self._set_low_water()

    # ------------------------------------------------------------------------------------------------ closing

    def _reader_failed(self, exc: DissocError) -> None:
        """A frame over a limit is refused (reading stops, sending goes on, so the owner may answer before
        it closes); any other error tears the connection down."""
        if isinstance(exc, TagLimitError | ReceiveBudgetError) and not self._closed:
            self._refuse(exc)
        else:
            self._teardown(exc)

    def _refuse(self, exc: DissocError) -> None:
        if self._refused:
            return
        self._refused = True
        self._fail(exc)
        peer_log.log(logging.WARNING, type(exc), "%s", exc, stream=self.stream_id)
        if not self._paused:
            self._loop.remove_reader(self._fd)
        self._paused = True
        self._drop_target()

    def _drop_target(self) -> None:
        """Let go of a partly received payload (and its share of the receive budget)."""
        if self._target is not None:
            self._target = None
            self._target_obj = None
            self._unreserve(self._target_len)
        self._header = None
        self._rpos = self._wpos = 0

    def _teardown(self, exc: DissocError) -> None:
        """Fail the inbox with ``exc`` and release the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._fail(exc)
        if isinstance(exc, FrameError | MessageTooLargeError):
            peer_log.log(logging.WARNING, type(exc), "%s", exc, stream=self.stream_id)
        else:
            logger.debug("%s torn down: %s", self._description, exc, extra=self._log_extra())
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        waiter = self._write_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(self._closed_error("cannot send"))
        self._drop_target()
        with contextlib.suppress(OSError):
            self._sock.close()

    async def _close_transport(self) -> None:
        if self._error is not None:
            self._teardown(self._error)


class TcpListener(Listener):
    """A listening TCP socket that runs a handler for each accepted :class:`TcpConnection`.

    At ``max_connections`` the listening socket is taken off the event loop (new connections wait in the
    kernel's backlog) until one closes; an accept that fails for want of file descriptors pauses accepting
    for :data:`ACCEPT_BACKOFF` seconds. A peer address over ``max_connections_per_peer`` has its new
    connection accepted and closed at once. What they log is rate-limited (one line per kind per 5 s).
    """

    scheme = "tcp"

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        allocator: Allocator | None = None,
        sndbuf: int | None = None,
        rcvbuf: int | None = None,
        max_connections: int | None = None,
        max_connections_per_peer: int | None = None,
        receive_budget: ReceiveBudget | None = None,
        keepalive: Keepalive | None = DEFAULT_KEEPALIVE,
    ) -> None:
        super().__init__(
            handler, max_connections=max_connections, max_connections_per_peer=max_connections_per_peer
        )
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._limits: dict[str, Any] = {
            "max_message_bytes": max_message_bytes,
            "max_buffered_bytes": max_buffered_bytes,
            "allocator": allocator,
            "receive_budget": receive_budget,
        }
        self._accepting = False
        self._backoff: asyncio.TimerHandle | None = None
        self._sndbuf = sndbuf
        self._rcvbuf = rcvbuf
        self._keepalive = keepalive
        name = sock.getsockname()
        self._host = str(name[0])
        self._port = int(name[1])
        sock.setblocking(False)
        self._resume_accepting()
        logger.debug("listening on %s", self.address)

    @property
    def host(self) -> str:
        """The bound address."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The listening socket(s)."""
        return (self._sock,)

    def _pause_accepting(self, backoff: float | None = None) -> None:
        """Take the listening socket off the loop: until a connection closes, or for ``backoff`` seconds."""
        if self._accepting:
            self._accepting = False
            self._loop.remove_reader(self._sock.fileno())
        if backoff is not None and self._backoff is None:
            self._backoff = self._loop.call_later(backoff, self._end_backoff)

    def _end_backoff(self) -> None:
        self._backoff = None
        self._resume_accepting()

    def _resume_accepting(self) -> None:
        if self._accepting or self._closing or self._backoff is not None or self._full():
            return
        self._accepting = True
        self._loop.add_reader(self._sock.fileno(), self._on_accept)

    def _connection_closed(self) -> None:
        self._resume_accepting()

    def _on_accept(self) -> None:
        for _ in range(64):
            if self._full():
                # (TCP: accepting pauses; the peer waits in the backlog)
                SERVER.refusals.inc("max_connections")
                peer_log.log(
                    logging.WARNING,
                    ("full", self.address),
                    "%s: %d connections open (max_connections); accepting paused until one closes",
                    self.address,
                    self.open_connections,
                )
                self._pause_accepting()
                return
            try:
                conn_sock, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    peer_log.log(
                        logging.WARNING,
                        ("accept", self.address, exc.errno),
                        "accepting on %s failed: %s; accepting paused for %s s",
                        self.address,
                        exc,
                        ACCEPT_BACKOFF,
                    )
                    self._pause_accepting(ACCEPT_BACKOFF)
                else:
                    peer_log.log(
                        logging.WARNING,
                        ("accept", self.address),
                        "accepting on %s failed: %s",
                        self.address,
                        exc,
                    )
                return
            peer = str(address[0]) if isinstance(address, tuple) and address else str(address)
            if self._peer_full(peer):
                SERVER.refusals.inc("max_connections_per_peer")
                peer_log.log(
                    logging.WARNING,
                    ("peer full", self.address),
                    "%s: %s already has %d connections open (max_connections_per_peer); closing a new one",
                    self.address,
                    peer,
                    self._per_peer.get(peer, 0),
                )
                conn_sock.close()
                continue
            try:
                _configure_socket(conn_sock, self._sndbuf, self._rcvbuf, self._keepalive)
                connection = self._connection(conn_sock)
            except (OSError, ValueError) as exc:
                peer_log.log(
                    logging.WARNING,
                    ("setup", self.address),
                    "could not set up an accepted connection on %s: %s",
                    self.address,
                    exc,
                )
                conn_sock.close()
                continue
            logger.debug("accepted %s", connection.description)
            self._start_handler(connection, peer)

    def _connection(self, sock: socket.socket) -> TcpConnection:
        """The connection over an accepted socket (the TLS listener makes TLS ones)."""
        return TcpConnection(sock, **self._limits)

    def _stop_accepting(self) -> None:
        if self._backoff is not None:
            self._backoff.cancel()
            self._backoff = None
        if self._accepting:
            self._accepting = False
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        logger.debug("stopped listening on %s", self.address)


#: The listening socket's backlog (:class:`ListenOptions`).
DEFAULT_BACKLOG = 128
#: Seconds a connection (and a TLS handshake) may take by default (:class:`ConnectOptions`).
DEFAULT_CONNECT_TIMEOUT = 10.0


class ListenOptions(TypedDict, total=False):
    """What :func:`serve_tcp` takes besides the address and handler (and
    :func:`~dissoc.transport.tls.serve_tls` besides its TLS context), each optional:

    - ``backlog`` (:data:`DEFAULT_BACKLOG`): the listening socket's;
    - ``max_message_bytes``, ``max_buffered_bytes``, ``allocator``: each accepted connection's limits and
      receive buffers (see :class:`TcpConnection`);
    - ``sndbuf``/``rcvbuf``: the kernel socket buffer sizes (default: the kernel's autotuning);
    - ``max_connections``, ``max_connections_per_peer`` and ``receive_budget``: what peers may hold (see
      :class:`TcpListener` and :class:`~dissoc.transport.base.ReceiveBudget`; None: unbounded);
    - ``keepalive`` (:data:`DEFAULT_KEEPALIVE`): how accepted connections notice a peer that is gone (see
      :class:`Keepalive`; None: off).
    """

    backlog: int
    max_message_bytes: int
    max_buffered_bytes: int
    allocator: Allocator | None
    sndbuf: int | None
    rcvbuf: int | None
    max_connections: int | None
    max_connections_per_peer: int | None
    receive_budget: ReceiveBudget | None
    keepalive: Keepalive | None


class ConnectOptions(TypedDict, total=False):
    """What :func:`connect_tcp` takes besides the address (and :func:`~dissoc.transport.tls.connect_tls`
    besides its TLS context), each optional: ``timeout`` (:data:`DEFAULT_CONNECT_TIMEOUT` seconds; None: no
    limit), the connection's ``max_message_bytes``, ``max_buffered_bytes`` and ``allocator`` (see
    :class:`TcpConnection`), the kernel socket buffer sizes ``sndbuf``/``rcvbuf``, and ``keepalive``
    (:data:`DEFAULT_KEEPALIVE`; see :class:`Keepalive`; None: off)."""

    timeout: float | None
    max_message_bytes: int
    max_buffered_bytes: int
    allocator: Allocator | None
    sndbuf: int | None
    rcvbuf: int | None
    keepalive: Keepalive | None


ListenerT = TypeVar("ListenerT", bound=TcpListener)
ConnectionT = TypeVar("ConnectionT", bound=TcpConnection)


async def listen_socket(
    host: str,
    port: int,
    *,
    backlog: int = DEFAULT_BACKLOG,
    sndbuf: int | None = None,
    rcvbuf: int | None = None,
    scheme: str = "tcp",
) -> socket.socket:
    """A listening stream socket on ``host:port`` (port 0 picks a free one); ``scheme`` names it in errors.

    Buffer sizes set on the listening socket are inherited by accepted ones (and must be set before the
    handshake for window scaling)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _kind, _proto, _name, address = infos[0]
        sock = socket.create_server(address, family=family, backlog=backlog, reuse_port=False)
    except OSError as exc:
        raise TransportError(f"cannot listen on {scheme}://{host}:{port}: {exc}") from exc
    try:
        if sndbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_stream(
    scheme: str,
    host: str,
    port: int,
    handler: Handler,
    listener: Callable[..., ListenerT],
    options: ListenOptions,
) -> ListenerT:
    """What :func:`serve_tcp` and :func:`~dissoc.transport.tls.serve_tls` do: listen on ``host:port``
    (``scheme`` names it in errors) and make ``listener(sock, handler, **options)`` over the socket (which
    is closed if that fails); ``backlog`` is the socket's."""
    sock = await listen_socket(
        host,
        port,
        backlog=options.get("backlog", DEFAULT_BACKLOG),
        sndbuf=options.get("sndbuf"),
        rcvbuf=options.get("rcvbuf"),
        scheme=scheme,
    )
    try:
        return listener(sock, handler, **{k: v for k, v in options.items() if k != "backlog"})
    except BaseException:
        sock.close()
        raise


async def serve_tcp(host: str, port: int, handler: Handler, **options: Unpack[ListenOptions]) -> TcpListener:
    """Listen on ``host:port`` (port 0 picks a free one) and run ``handler(connection)`` per connection;
    ``options``: see :class:`ListenOptions`. TLS is the ``tls`` scheme's
    :func:`dissoc.transport.tls.serve_tls`, with the same options."""
    return await serve_stream("tcp", host, port, handler, TcpListener, options)


async def connect_socket(
    host: str,
    port: int,
    *,
    timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
    sndbuf: int | None = None,
    rcvbuf: int | None = None,
    scheme: str = "tcp",
    keepalive: Keepalive | None = DEFAULT_KEEPALIVE,
) -> socket.socket:
    """A non-blocking stream socket connected to ``host:port`` (each address tried in turn); raises
    :class:`~dissoc.errors.TransportError` on failure or timeout (``scheme`` names the target in it)."""
    loop = asyncio.get_running_loop()
    where = f"{scheme}://{host}:{port}"
    last: OSError | None = None
    try:
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            for family, kind, proto, _name, address in infos:
                sock = socket.socket(family, kind, proto)
                try:
                    sock.setblocking(False)
                    _configure_socket(sock, sndbuf, rcvbuf, keepalive)
                    await loop.sock_connect(sock, address)
                except OSError as exc:
                    sock.close()
                    last = exc
                    continue
                except BaseException:
                    sock.close()
                    raise
                return sock
    except TimeoutError as exc:
        raise TransportError(f"connecting to {where} timed out after {timeout} s") from exc
    except OSError as exc:
        raise TransportError(f"cannot connect to {where}: {exc}") from exc
    raise TransportError(f"cannot connect to {where}: {last or 'no address found'}") from last


async def connect_stream(
    scheme: str, host: str, port: int, connection: Callable[..., ConnectionT], options: ConnectOptions
) -> ConnectionT:
    """What :func:`connect_tcp` and :func:`~dissoc.transport.tls.connect_tls` do: connect to ``host:port``
    within ``timeout`` (``scheme`` names the target in errors) and make ``connection(sock, **limits)`` over
    the socket (which is closed if that fails), the limits being ``options`` but for the socket's own."""
    sock = await connect_socket(
        host,
        port,
        timeout=options.get("timeout", DEFAULT_CONNECT_TIMEOUT),
        sndbuf=options.get("sndbuf"),
        rcvbuf=options.get("rcvbuf"),
        scheme=scheme,
        keepalive=options.get("keepalive", DEFAULT_KEEPALIVE),
    )
    try:
        socket_options = ("timeout", "sndbuf", "rcvbuf", "keepalive")
        return connection(sock, **{k: v for k, v in options.items() if k not in socket_options})
    except BaseException:
        sock.close()
        raise


async def connect_tcp(host: str, port: int, **options: Unpack[ConnectOptions]) -> TcpConnection:
    """Connect to ``host:port`` (``options``: see :class:`ConnectOptions`); raises
    :class:`~dissoc.errors.TransportError` on failure or timeout."""
    # (the connections a client opens stage larger reads: see _CONNECT_STAGING_BYTES)
    connection = functools.partial(TcpConnection, staging_bytes=_CONNECT_STAGING_BYTES)
    return await connect_stream("tcp", host, port, connection, options)


register_transport("tcp", connect_tcp, serve_tcp)
