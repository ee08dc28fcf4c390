"""The UCX server side: :class:`UcxListener` (it accepts on both connection paths) and :func:`serve_ucx`."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import itertools
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypedDict

from dissoc.errors import TransportError
from dissoc.logs import peer_log
from dissoc.metrics import SERVER
from dissoc.transport.base import (
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    TAG_MASK_ALL,
    Allocator,
    Handler,
    Listener,
    ReceiveBudget,
)
from dissoc.transport.ucx.connection import UcxConnection
from dissoc.transport.ucx.driver import Driver
from dissoc.transport.ucx.endpoint import RawEndpoint
from dissoc.transport.ucx.handshake import (
    HELLO_TAG,
    MAGIC,
    MAX_HELLO,
    REPLY_TAG,
    parse_hello,
    send_tagged,
)
from dissoc.transport.ucx.library import close_endpoint, ucx_array, ucx_context, ucx_mask, ucx_tag, ucxx_lib
from dissoc.transport.ucx.libucp import (
    CONN_CALLBACK,
    UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR,
    UCP_LISTENER_ATTR_FIELD_SOCKADDR,
    UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
    UCP_LISTENER_PARAM_FIELD_SOCK_ADDR,
    UcpConnRequestAttr,
    UcpListenerAttr,
    UcpListenerParams,
    check,
    lib,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["UcxListener", "serve_ucx"]

logger = logging.getLogger(__name__)


class _Limits(TypedDict):
    """The limits and allocator every accepted connection gets (:func:`serve_ucx`'s arguments)."""

    max_message_bytes: int
    max_buffered_bytes: int
    allocator: Allocator | None
    receive_budget: ReceiveBudget | None


#: Workers a listener keeps made ahead of need, per kind of connection (making one takes about 10 ms, which
#: a connection then does not wait for); refilled one at a time, soon after one is taken.
SPARE_WORKERS = 1
#: Seconds after a spare worker was taken before the next is made (the accept goes first).
_REFILL_DELAY = 0.02

#: Live listeners by the id their connection handler is given.
_LISTENERS: dict[int, UcxListener] = {}
_IDS = itertools.count(1)


def _on_conn_request(conn_request: int | None, arg: int | None) -> None:
    try:
        listener = _LISTENERS.get(arg or 0)
        if listener is not None and conn_request:
            listener.requested(conn_request)
    except BaseException:  # never let an exception unwind through UCX
        logger.exception("taking a UCX connection request failed")


_CONN_CALLBACK = CONN_CALLBACK(_on_conn_request)
# Never freed, not even when the interpreter exits: UCX may call it while ucxx destroys a worker then.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_CONN_CALLBACK))


def _sockaddr_in(host: str, port: int) -> ctypes.Array[ctypes.c_char]:
    """A ``struct sockaddr_in`` for ``host`` (any interface when empty or 0.0.0.0) and ``port``."""
    address = socket.inet_aton(socket.gethostbyname(host) if host not in ("", "0.0.0.0") else "0.0.0.0")
    return ctypes.create_string_buffer(
        struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + address, 16
    )


def _sockaddr_text(storage: ctypes.Array[ctypes.c_uint8]) -> tuple[str, int]:
    """(address, port) of a ``struct sockaddr_storage`` holding an IPv4 or IPv6 address."""
    raw = bytes(storage)
    family = struct.unpack_from("=H", raw)[0]
    port = struct.unpack_from("!H", raw, 2)[0]
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
    return socket.inet_ntop(socket.AF_INET, raw[4:8]), port


class UcxListener(Listener):
    """A UCX listener; each accepted connection gets its own worker (see the package docstring)."""

    scheme = "ucx"

    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        *,
        handshake_timeout: float | None,
        error_handling: bool,
        limits: _Limits,
        max_connections: int | None = None,
        max_connections_per_peer: int | None = None,
    ) -> None:
        super().__init__(
            handler, max_connections=max_connections, max_connections_per_peer=max_connections_per_peer
        )
        lib_ucxx = ucxx_lib()
        self._loop = asyncio.get_running_loop()
        self._lib = lib_ucxx
        self._limits = limits
        self._handshake_timeout = handshake_timeout
        self._error_handling = error_handling
        self._count = itertools.count(1)
        self._handshakes: set[asyncio.Task[None]] = set()
        self._requests: list[int] = []
        try:
            worker = lib_ucxx.UCXWorker(ucx_context("listener"))
        except Exception as exc:
            raise TransportError(f"cannot create a UCX worker: {exc}") from exc
        self._driver = Driver(worker, self._loop, f"ucx listener :{port}")
        self._id = next(_IDS)
        params = UcpListenerParams()
        params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER
        sockaddr = _sockaddr_in("", port)
        params.sockaddr.addr = ctypes.addressof(sockaddr)
        params.sockaddr.addrlen = len(sockaddr)
        params.conn_handler.cb = _CONN_CALLBACK
        params.conn_handler.arg = self._id
        handle = ctypes.c_void_p()
        _LISTENERS[self._id] = self
        try:
            check(
                lib().ucp_listener_create(int(worker.handle), ctypes.byref(params), ctypes.byref(handle)),
                "listening",
            )
            self._listener: int | None = int(handle.value or 0)
            attr = UcpListenerAttr()
            attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR
            check(lib().ucp_listener_query(self._listener, ctypes.byref(attr)), "asking the listener's port")
        except (TransportError, OSError) as exc:
            _LISTENERS.pop(self._id, None)
            self._driver.close()
            raise TransportError(f"cannot listen on ucx://{host}:{port}: {exc}") from exc
        self._port = _sockaddr_text(attr.sockaddr)[1]
        self._host = host or socket.gethostbyname(socket.gethostname())
        self._driver.description = f"ucx listener {self.address}"
        self._worker_address = bytes(worker.address.tobytes())
        self._hellos: list[tuple[Any, bytearray]] = []
        self._driver.on_progress = self._poll_hellos
        self._driver.busy = lambda: bool(self._hellos)
        self._driver.kick()
        #: Spare workers by context kind: "default" (the same-host path), "listener" (the listener path).
        self._spares: dict[str, list[Any]] = {"default": [], "listener": []}
        self._refill: asyncio.TimerHandle | None = None
        self._refill_soon()
        logger.debug("listening on %s", self.address)

    @property
    def host(self) -> str:
        """The host asked for (UCX listens on every interface)."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port."""
        return self._port

    def _new_worker(self, kind: str) -> Any:
        """A worker for a new connection: a spare one if there is one (another is made soon after)."""
        spares = self._spares[kind]
        worker = spares.pop() if spares else self._lib.UCXWorker(ucx_context(kind))
        self._refill_soon()
        return worker

    def _refill_soon(self) -> None:
        if self._refill is None and not self._closing and SPARE_WORKERS > 0:
            self._refill = self._loop.call_later(_REFILL_DELAY, self._make_spare)

    def _make_spare(self) -> None:
        """Make one missing spare worker (one per call: the loop is held for one worker's making)."""
        self._refill = None
        if self._closing:
            return
        for kind, spares in self._spares.items():
            if len(spares) < SPARE_WORKERS:
                try:
                    spares.append(self._lib.UCXWorker(ucx_context(kind)))
                except Exception as exc:  # a connection then makes its own, and says why if it cannot
                    logger.debug("%s: a spare UCX worker could not be made: %s", self.address, exc)
                    return
                self._refill_soon()
                return

    def uri_params(self) -> dict[str, str]:
        """``worker``: the listener worker's address (base64), for the same-host path."""
        return {"worker": base64.b64encode(self._worker_address).decode("ascii")}

    def _poll_hellos(self) -> bool:
        """Take handshakes of clients connecting by worker address (tagged ``HELLO_TAG`` on this worker)."""
        activity = False
        if self._hellos:
            done = [h for h in self._hellos if h[0].completed]
            if done:
                activity = True
                self._hellos = [h for h in self._hellos if not h[0].completed]
                for request, buffer in done:
                    try:
                        request.check_error()
                    except Exception as exc:
                        logger.info("%s: receiving a handshake failed: %s", self.address, exc)
                        continue
                    length = len(buffer)
                    if self._closing:
                        continue
                    task = self._loop.create_task(self._accept_address(bytes(buffer[:length])))
                    self._handshakes.add(task)
                    task.add_done_callback(self._handshakes.discard)
        worker = self._driver.worker
        while len(self._hellos) < 64:
            probe = worker.tag_probe(ucx_tag(HELLO_TAG), ucx_mask(TAG_MASK_ALL), False)
            if not probe.matched:
                break
            length = int(probe.length)
            probe = worker.tag_probe(ucx_tag(HELLO_TAG), ucx_mask(TAG_MASK_ALL), True)
            if not probe.matched:
                break
            # An oversized handshake is received into a small buffer: UCX truncates it and reports an error,
            # so nothing larger than MAX_HELLO is ever allocated for it.
            buffer = bytearray(max(1, min(length, MAX_HELLO)))
            self._hellos.append((worker.tag_recv_with_handle(ucx_array(buffer), probe), buffer))
            activity = True
        return activity

    async def _accept_address(self, hello: bytes) -> None:
        """The address path: a fresh worker for the client, a data endpoint and a monitor endpoint to it."""
        description = f"ucx {self.address}<-client#{next(self._count)}(address)"
        monitors: list[Any] = []

        async def receive() -> bytes:
            return hello

        def open_monitor(client: Any) -> Any:
            # Peer-failure handling on: UCX reports the client's death here (as the listener path's
            # bootstrap endpoint does).
            monitors.append(self._driver.worker.create_endpoint_from_worker_address(client, True))
            return monitors[-1]

        async def reply(monitor: Any, data: bytes) -> None:
            await send_tagged(self._driver, monitor, REPLY_TAG, data, "answering the handshake")

        if not await self._handshake(description, receive, open_monitor, reply):
            for monitor in monitors:
                close_endpoint(monitor)

    async def _handshake(
        self,
        description: str,
        receive: Callable[[], Awaitable[Buffer | None]],
        open_monitor: Callable[[Any], Any],
        reply: Callable[[Any, bytes], Awaitable[None]],
    ) -> bool:
        """Both paths' handshake: the client's hello, a worker and data endpoint for it, the monitor, the
        reply; then the connection's handler starts. False (logged) when it failed; the caller closes the
        monitor it opened."""
        driver: Driver | None = None
        if self._full():
            SERVER.refusals.inc("max_connections")
            peer_log.log(
                logging.WARNING,
                ("full", self.address),
                "%s: %d connections open (max_connections); refusing a new one",
                self.address,
                self.open_connections,
            )
            return False
        try:
            async with asyncio.timeout(self._handshake_timeout):
                client_address = parse_hello(await receive(), description)
                lib = self._lib
                client = lib.UCXAddress.create_from_buffer(client_address)
                worker = self._new_worker("default")
                driver = Driver(worker, self._loop, description)
                # dissoc's own endpoint (not ucxx's): closed forcefully when the client dies, which a ucxx
                # endpoint without peer-failure handling cannot be (its sends would hold the worker).
                endpoint = RawEndpoint(
                    int(worker.handle),
                    description,
                    address=client_address,
                    error_handling=self._error_handling,
                )
                monitor = open_monitor(client)
                connection = UcxConnection(
                    driver,
                    endpoint,
                    monitor,
                    self._driver,
                    description=description,
                    closing_exchange=not self._error_handling,
                    **self._limits,
                )
                try:
                    await reply(monitor, MAGIC + bytes(worker.address.tobytes()))
                except BaseException:
                    await connection.close()
                    raise
        except TimeoutError:
            logger.info("%s: handshake timed out after %s s", description, self._handshake_timeout)
        except Exception as exc:
            logger.info("%s: handshake failed: %s", description, exc)
        else:
            if self._closing:
                await connection.close()
            else:
                logger.debug("accepted %s", description)
                self._start_handler(connection)
            return True
        if driver is not None:
            driver.close()
        return False

    def requested(self, conn_request: int) -> None:
        """The connection handler's work (inside the listener worker's progress): accept it soon."""
        self._requests.append(conn_request)
        if len(self._requests) == 1:
            self._loop.call_soon(self._accept_requests)

    def _reject(self, conn_request: int) -> None:
        if self._listener is not None:
            lib().ucp_listener_reject(self._listener, conn_request)

    def _accept_requests(self) -> None:
        """The listener path: each connection on a worker of its own, from its first message on (no
        handshake: a peer that follows the reference mapping sends want_data straight away; ucxx's asyncio
        clients get ucxx's peer information first, see :mod:`~dissoc.transport.ucx.peer_info`)."""
        requests, self._requests = self._requests, []
        for conn_request in requests:
            if self._closing or self._listener is None:
                continue  # the listener is destroyed with its pending requests
            attr = UcpConnRequestAttr()
            attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR
            peer = None
            if lib().ucp_conn_request_query(conn_request, ctypes.byref(attr)) == 0:
                peer = _sockaddr_text(attr.client_address)[0]
            limit = self._max_connections
            busy = self._open + len(self._handshakes)
            if (limit is not None and busy >= limit) or (peer is not None and self._peer_full(peer)):
                per_peer = peer is not None and self._peer_full(peer)
                SERVER.refusals.inc("max_connections_per_peer" if per_peer else "max_connections")
                peer_log.log(
                    logging.WARNING,
                    ("full", self.address),
                    "%s: %d connections open (%s from %s); refusing a new one (max_connections, "
                    "max_connections_per_peer)",
                    self.address,
                    busy,
                    self._per_peer.get(peer or "", 0),
                    peer,
                )
                self._reject(conn_request)
                continue
            description = f"ucx {self.address}<-{peer or '?'}#{next(self._count)}"
            driver: Driver | None = None
            try:
                worker = self._new_worker("listener")
                driver = Driver(worker, self._loop, description)
                endpoint = RawEndpoint(int(worker.handle), description, conn_request=conn_request)
                connection = UcxConnection(
                    driver,
                    endpoint,
                    endpoint,
                    driver,
                    description=description,
                    closing_exchange=False,
                    **self._limits,
                )
            except Exception as exc:
                peer_log.log(
                    logging.WARNING,
                    ("accept", self.address),
                    "accepting a connection on %s failed: %s",
                    self.address,
                    exc,
                )
                if driver is not None:
                    driver.close()
                    self._reject(conn_request)
                continue
            # ucxx's asyncio clients wait for the listener's peer information before they send anything
            connection.exchange_peer_info(listener=True)
            logger.debug("accepted %s", description)
            self._start_handler(connection, peer)

    def _stop_accepting(self) -> None:
        if self._refill is not None:
            self._refill.cancel()
            self._refill = None
        for spares in self._spares.values():
            spares.clear()
        listener, self._listener = self._listener, None
        _LISTENERS.pop(self._id, None)
        if listener is not None:
            lib().ucp_listener_destroy(listener)
        for task in list(self._handshakes):
            task.cancel()
        logger.debug("stopped listening on %s", self.address)

    async def wait_closed(self) -> None:
        """Wait for the handlers, then release the listener's worker."""
        await super().wait_closed()
        if self._closing and not self._connections:
            # Give closing bootstrap endpoints a moment of progress, then stop watching the worker.
            await asyncio.sleep(0)
            self._driver.run()
            self._driver.close()


async def serve_ucx(
    host: str,
    port: int,
    handler: Handler,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    allocator: Allocator | None = None,
    error_handling: bool = False,
    handshake_timeout: float | None = 10.0,
    max_connections: int | None = None,
    max_connections_per_peer: int | None = None,
    receive_budget: ReceiveBudget | None = None,
) -> UcxListener:
    """Listen on ``port`` (0 picks a free one; UCX binds every interface) and run ``handler`` per connection.

    ``error_handling`` turns UCX peer-failure handling on for the data endpoints (slower: no shared memory);
    the peer's disappearance is detected either way (package docstring). At ``max_connections`` (connections
    open plus handshakes under way) a new one is refused, and so is one more than ``max_connections_per_peer``
    from one client address (the listener path; the same-host path's hello does not say where it came from).
    """
    limits: _Limits = {
        "max_message_bytes": max_message_bytes,
        "max_buffered_bytes": max_buffered_bytes,
        "allocator": allocator,
        "receive_budget": receive_budget,
    }
    return UcxListener(
        host,
        port,
        handler,
        handshake_timeout=handshake_timeout,
        error_handling=error_handling,
        limits=limits,
        max_connections=max_connections,
        max_connections_per_peer=max_connections_per_peer,
    )
