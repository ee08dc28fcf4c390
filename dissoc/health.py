"""Is a server up? One cheap request, answered or not within a timeout (``dissoc health``).

    result = await dissoc.health.check("tcp://127.0.0.1:9000?want_data=1465007700")
    result.healthy, result.answer, result.seconds

A dissoc server (``tcp://``, ``tls://``, ``ucx://``; metadata, data or combined; a URI without
``want_data`` means the servers' default tag) is asked for the empty ticket: a want_data with no payload,
which servers answer at once with the error code ``empty_ticket``
(logged at debug level, not counted as a refused ticket, whatever the server's secret). Any well-formed
answer means the server serves requests; no answer within the timeout, a refused connection or a reply that
is not a Dissociated IPC message means it does not. A Flight control plane (``grpc://``, ``grpc+tls://``)
is asked ListActions; a refusal for want of a token is an answer too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from dissoc.client import ClientOptions, open_connection
from dissoc.errors import DissocError, RemoteError
from dissoc.flight.common import is_flight_location
from dissoc.protocol import EMPTY_TICKET, ERROR_TAG, ErrorMessage, decode_stream_message
from dissoc.transport.base import Connection
from dissoc.uri import DissocURI

__all__ = ["EMPTY_TICKET", "Health", "check", "check_sync"]

#: Seconds a probe waits by default (the connection and the answer together).
DEFAULT_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class Health:
    """What one probe found: ``healthy`` when the server answered within the timeout; ``answer`` is what it
    answered (an error code, or ``"ListActions"``), ``error`` why it is not healthy."""

    uri: str
    healthy: bool
    seconds: float
    answer: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, object]:
        """The JSON line ``dissoc health`` prints."""
        line: dict[str, object] = {
            "uri": self.uri,
            "healthy": self.healthy,
            "seconds": round(self.seconds, 6),
        }
        if self.answer is not None:
            line["answer"] = self.answer
        if self.error is not None:
            line["error"] = self.error
        return line


async def check(
    uri: str, *, timeout: float = DEFAULT_TIMEOUT, options: ClientOptions | None = None
) -> Health:
    """Probe the server at ``uri`` (TLS files, UCX path and token from ``options``); never raises for a server
    that is down or misbehaving: that is a :class:`Health` with ``healthy=False``."""
    if not timeout > 0:
        raise DissocError(f"timeout must be > 0 seconds, got {timeout!r}")
    options = options or ClientOptions()
    options = ClientOptions(
        timeout=timeout,
        ucx_path=options.ucx_path,
        tls_ca=options.tls_ca,
        tls_cert=options.tls_cert,
        tls_key=options.tls_key,
        token=options.token,
    )
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            if is_flight_location(uri):
                answer = await asyncio.to_thread(_ask_flight, uri, timeout, options)
            else:
                answer = await _ask_dissoc(_with_want_data(uri), options)
    except TimeoutError:
        return Health(uri, False, time.perf_counter() - started, error=f"no answer within {timeout:g} s")
    except DissocError as e:
        return Health(uri, False, time.perf_counter() - started, error=str(e))
    return Health(uri, True, time.perf_counter() - started, answer=answer)


def check_sync(uri: str, *, timeout: float = DEFAULT_TIMEOUT, options: ClientOptions | None = None) -> Health:
    """:func:`check` from synchronous code (runs its own event loop)."""
    return asyncio.run(check(uri, timeout=timeout, options=options))


def _with_want_data(uri: str) -> DissocURI:
    """``uri`` parsed; one without ``want_data`` (``tcp://HOST:PORT``) gets the servers' default tag."""
    if "want_data=" not in uri:
        from dissoc.server.options import DEFAULT_WANT_DATA

        uri += ("&" if "?" in uri else "?") + f"want_data={DEFAULT_WANT_DATA}"
    return DissocURI.parse(uri)


async def _ask_dissoc(uri: DissocURI, options: ClientOptions) -> str:
    """Send the empty want_data on a fresh connection and read the first answer: the metadata stream's first
    message, or (a data server) a tagged error message."""
    conn = await open_connection(uri, options)
    try:
        await conn.send_tagged(uri.want_data, b"")
        return await _first_answer(conn)
    finally:
        with contextlib.suppress(DissocError, OSError):
            await conn.close()


async def _first_answer(conn: Connection) -> str:
    untagged = asyncio.ensure_future(conn.recv())
    tagged = asyncio.ensure_future(conn.recv_tagged(ERROR_TAG))
    try:
        done, _ = await asyncio.wait((untagged, tagged), return_when=asyncio.FIRST_COMPLETED)
        reply = next(iter(done)).result()
        payload = reply if isinstance(reply, bytes | memoryview) else reply.view()
        message = decode_stream_message(payload)
    finally:
        for waiting in (untagged, tagged):
            if not waiting.done():
                waiting.cancel()
            with contextlib.suppress(BaseException):
                await waiting
    if isinstance(message, ErrorMessage):
        return message.code
    # An older server streams nothing for an unknown ticket but an error; anything well-formed is an answer.
    return type(message).__name__


def _ask_flight(location: str, timeout: float, options: ClientOptions) -> str:
    from dissoc.flight.client import list_actions

    try:
        list_actions(
            location,
            timeout=timeout,
            tls_ca=options.tls_ca,
            tls_cert=options.tls_cert,
            tls_key=options.tls_key,
            token=options.token,
        )
    except RemoteError as e:
        return e.code  # it answered: refusing an unauthenticated call is serving
    return "ListActions"
