"""ucxx's peer information, exchanged on the listener path so that clients and servers written with ucxx's
asyncio API (``ucxx.create_endpoint``, ``ucxx.create_listener``) connect to dissoc's, and dissoc's to theirs.

ucxx's asyncio endpoints begin every connection with an exchange on the UCX *stream* API, before any other
message: 16 bytes each way, ``struct`` format ``"QQ"`` in the machine's own byte order, (``msg_tag``,
``checksum``), where ``msg_tag`` is the tag the sender's untagged ``send``/``recv`` calls use and
``checksum`` is the first 16 hex digits of the SHA-1 of ``repr((msg_tag,))``. The listener's side sends
first; a ucxx client waits for those 16 bytes before it sends anything, and a ucxx listener waits for the
client's before it calls its handler.

dissoc takes part without depending on it (:class:`PeerInfoExchange`), and without sending anything on the
stream to a peer that has not shown it speaks it: a peer whose UCX context lacks the stream feature (as a
client or server that follows the reference mapping may) logs a UCX warning, on its standard output, for
every stream message it gets. So each side posts a 16-byte stream receive at once, and

* the listener's side sends its 16 bytes when the peer has sent nothing at all (no tagged or active message)
  :data:`LISTENER_DELAY` seconds after the connection was accepted (a ucxx client waits for them), or as
  soon as the peer's own 16 bytes come;
* the connecting side sends its 16 bytes only in answer to the listener's (a ucxx listener waits for them).

The peer's bytes are taken when they come (a wrong checksum is only logged, at debug level) and dropped. A
peer that follows the reference mapping sends want_data at once and never sends the 16 bytes: nothing waits
for them (messages flow from the first one on), and the receive is cancelled when the connection closes.
dissoc's messages never use ``msg_tag`` (every message it sends carries its tag as given, ``force_tag=True``
in ucxx's terms), so the one dissoc sends is random.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import itertools
import logging
import os
import struct
from collections.abc import Callable

from dissoc.transport.ucx.endpoint import RawRequest, stream_send
from dissoc.transport.ucx.libucp import (
    STREAM_RECV_CALLBACK,
    UCP_OP_ATTR_FIELD_CALLBACK,
    UCP_OP_ATTR_FIELD_FLAGS,
    UCP_OP_ATTR_FIELD_USER_DATA,
    UCP_STREAM_RECV_FLAG_WAITALL,
    UCS_INPROGRESS,
    UCS_OK,
    UcpRequestParam,
    lib,
    status_string,
)

__all__ = [
    "LISTENER_DELAY",
    "PEER_INFO",
    "PeerInfoExchange",
    "checksum",
    "pack_peer_info",
    "parse_peer_info",
]

logger = logging.getLogger(__name__)

#: ucxx's peer information: (msg_tag, checksum), two u64 in the machine's own byte order (16 bytes).
PEER_INFO = struct.Struct("QQ")
#: Seconds after a connection was accepted, the peer silent, before the listener's side sends its 16 bytes
#: (a peer that follows the reference mapping has sent want_data by then; ucxx's client waits up to 5 s).
LISTENER_DELAY = 0.2
#: Bytes of the receive that stays posted on the stream after the exchange (anything arriving fails it).
_GUARD_BYTES = 64


def checksum(msg_tag: int) -> int:
    """ucxx's checksum of ``msg_tag``: the first 64 bits of the SHA-1 of ``repr((msg_tag,))``, as a number."""
    return int(hashlib.sha1(repr((msg_tag,)).encode("utf-8")).hexdigest()[:16], 16)


def pack_peer_info(msg_tag: int | None = None) -> bytes:
    """The 16 bytes this side sends (a random ``msg_tag`` unless one is given)."""
    if msg_tag is None:
        msg_tag = int.from_bytes(os.urandom(8), "little")
    return PEER_INFO.pack(msg_tag, checksum(msg_tag))


def parse_peer_info(data: bytes) -> int | None:
    """The peer's ``msg_tag`` when ``data`` is ucxx's peer information (16 bytes, checksum right); else
    None."""
    if len(data) != PEER_INFO.size:
        return None
    msg_tag, check = PEER_INFO.unpack(data)
    return int(msg_tag) if check == checksum(msg_tag) else None


#: Exchanges under way, by the id their receive's callback is given.
_EXCHANGES: dict[int, PeerInfoExchange] = {}
_IDS = itertools.count(1)


def _on_received(request: int | None, status: int, length: int, user_data: int | None) -> None:
    del request, length
    try:
        exchange = _EXCHANGES.get(user_data or 0)
        if exchange is not None:
            exchange.received(int(status))
    except BaseException:  # never let an exception unwind through UCX
        logger.exception("taking ucxx's peer information failed")


_RECV_CALLBACK = STREAM_RECV_CALLBACK(_on_received)
# Never freed, not even when the interpreter exits: UCX may call it while a worker is destroyed then.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_RECV_CALLBACK))


class PeerInfoExchange:
    """The exchange on one endpoint (``ep``, a ``ucp_ep_h`` of dissoc's own or ucxx's), on the listener's
    side (``listener``) or the connecting one; ``quiet()`` says whether nothing came from the peer yet.

    The receive is posted at once and nothing waits for it; UCX's completion callback (inside the worker's
    progress) hands over to the event loop. :meth:`settle` ends the exchange when the connection ends: the
    requests UCX has not completed are handed over, to be kept with their buffers until UCX completes them
    (closing the endpoint cancels a receive the peer never answered).
    """

    __slots__ = (
        "_buffer",
        "_description",
        "_ep",
        "_excess",
        "_guard",
        "_id",
        "_loop",
        "_quiet",
        "_recv",
        "_send",
        "_sent",
        "_settled",
        "_timer",
        "_watching",
    )

    def __init__(
        self,
        ep: int,
        loop: asyncio.AbstractEventLoop,
        description: str,
        *,
        listener: bool,
        quiet: Callable[[], bool],
        excess: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self._ep = ep
        self._excess = excess
        self._guard: RawRequest | None = None
        self._watching = False
        self._loop = loop
        self._description = description
        self._quiet = quiet
        self._buffer = ctypes.create_string_buffer(PEER_INFO.size)
        self._send: RawRequest | None = None
        self._sent = False
        self._settled = False
        self._timer: asyncio.TimerHandle | None = None
        self._recv: RawRequest | None = self._post_receive(
            self._buffer, PEER_INFO.size, UCP_STREAM_RECV_FLAG_WAITALL, "receiving ucxx's peer information"
        )
        if listener:
            self._timer = loop.call_later(LISTENER_DELAY, self._send_if_quiet)

    def _post_receive(
        self, buffer: ctypes.Array[ctypes.c_char], size: int, flags: int, what: str
    ) -> RawRequest:
        """Post a stream receive into ``buffer``; its completion calls :meth:`received`."""
        self._id = next(_IDS)
        param = UcpRequestParam()
        param.op_attr_mask = (
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS
        )
        param.flags = flags
        param.cb = ctypes.cast(_RECV_CALLBACK, ctypes.c_void_p).value
        param.user_data = self._id
        length = ctypes.c_size_t()
        _EXCHANGES[self._id] = self
        try:
            ptr = lib().ucp_stream_recv_nbx(
                self._ep, ctypes.addressof(buffer), size, ctypes.byref(length), ctypes.byref(param)
            )
        except BaseException:
            del _EXCHANGES[self._id]
            raise
        request = RawRequest(ptr, buffer, f"{self._description}: {what}")
        if ptr is None:  # the peer's bytes were there already (UCX calls no callback then)
            self.received(UCS_OK)
        elif request.status != UCS_INPROGRESS:  # refused at once
            _EXCHANGES.pop(self._id, None)
            logger.debug("%s: %s failed: %s", self._description, what, status_string(request.status))
        return request

    def received(self, status: int) -> None:
        """The receive completed with ``status`` (called from inside the worker's progress, or at once)."""
        _EXCHANGES.pop(self._id, None)
        if status == UCS_OK:
            self._loop.call_soon(self._beyond if self._watching else self._answer)

    def _beyond(self) -> None:
        """More came on the stream after the 16 bytes: nothing more is expected there, and UCX would keep it
        all (outside every budget) until the connection closes."""
        if not self._settled:
            self._excess(
                "the peer sent data on the UCX stream API after ucxx's peer information (nothing more is "
                "expected there)"
            )

    def _answer(self) -> None:
        """The peer's 16 bytes came: check them, and send this side's (a ucxx listener waits for them). A
        receive stays posted on the stream: anything more the peer sends there ends the connection."""
        if self._settled or self._watching:
            return
        self._watching = True
        self._guard = self._post_receive(
            ctypes.create_string_buffer(_GUARD_BYTES), _GUARD_BYTES, 0, "watching the stream"
        )
        if parse_peer_info(self._buffer.raw) is None:
            logger.debug(
                "%s: the peer's 16 bytes on the stream are not ucxx's peer information: %s",
                self._description,
                self._buffer.raw.hex(),
            )
            return
        logger.debug("%s: the peer sent ucxx's peer information", self._description)
        self._send_once()

    def _send_if_quiet(self) -> None:
        """The listener's side, :data:`LISTENER_DELAY` after the connection was accepted: send this side's
        16 bytes if the peer has sent nothing (a ucxx client waits for them)."""
        self._timer = None
        if not self._settled and not self._sent and self._quiet():
            self._send_once()

    def _send_once(self) -> None:
        if self._sent or self._settled:
            return
        self._sent = True
        try:
            what = f"{self._description}: sending ucxx's peer information"
            self._send = stream_send(self._ep, pack_peer_info(), what)
            self._send.check_error()
        except Exception as exc:
            logger.debug("%s: sending ucxx's peer information failed: %s", self._description, exc)

    def settle(self) -> list[tuple[RawRequest, object]]:
        """End the exchange (idempotent); returns the requests UCX has not completed, each with what it must
        keep alive until it does."""
        if self._settled:
            return []
        self._settled = True
        _EXCHANGES.pop(self._id, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        left: list[tuple[RawRequest, object]] = []
        for request, keep in ((self._send, None), (self._recv, self._buffer), (self._guard, None)):
            if request is not None and not request.completed:
                left.append((request, keep))  # (a RawRequest keeps its own buffer too)
        self._send = self._recv = self._guard = None
        return left
