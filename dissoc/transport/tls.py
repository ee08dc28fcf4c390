"""TLS over TCP (scheme ``tls``): the TCP transport's framing (DESIGN.md section 3) inside a TLS session.

``tls://HOST:PORT?want_data=N`` is ``tcp://`` with every byte of both directions in TLS (1.2 or later, the
standard library's :mod:`ssl`): the same 24-byte frame headers and payloads, the same limits. The scheme, not
a query field, says so, because a reader must not be able to skip it: a client that does not know ``tls``
refuses the URI rather than falling back to plaintext.

- :func:`server_context` / :func:`client_context` build the :class:`ssl.SSLContext` of each side from PEM
  files: the server's certificate chain and key, optionally the CA its clients' certificates must be signed
  by (mutual TLS: a client without a valid certificate is refused); the client's CA bundle (None: the
  system's roots) and optionally its own certificate and key.
- :func:`serve_tls` / :func:`connect_tls` are :func:`~dissoc.transport.tcp.serve_tcp` /
  :func:`~dissoc.transport.tcp.connect_tcp` with a ``tls=`` context; the client checks the server's
  certificate against the host it connects to (a SAN naming the URI's host name or IP address).
- :class:`TlsConnection` is a :class:`~dissoc.transport.tcp.TcpConnection` whose socket is a non-blocking
  :class:`ssl.SSLSocket`. The handshake runs from the event loop's reader callback, so a server's handler
  starts at once and its connection counts against the listener's limits while the handshake runs; it must
  complete within ``handshake_timeout`` seconds. Payloads are still decrypted straight into their final
  buffers; small frames are gathered into one TLS record per write instead of one ``sendmsg``.
- A mismatch fails at once with a :class:`~dissoc.errors.TransportError` that says which side is TLS: a TLS
  server looks at the first byte a client sends (a TLS handshake record starts with 0x16) and answers
  anything else with a TLS alert, which a plaintext client recognizes; a plaintext server recognizes a
  ClientHello where a frame header should be and closes, which a TLS client reports as a server that is
  not TLS.
- :attr:`TlsConnection.peer_identity` is the subject of the peer's verified certificate in RFC 4514 form
  (``"CN=alice,O=Example"``; see :func:`format_subject`): on a server with mutual TLS, the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import os
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias, Unpack

from dissoc.errors import DissocError, TransportError
from dissoc.logs import peer_log
from dissoc.metrics import SERVER
from dissoc.transport.base import (
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_MESSAGE_BYTES,
    Allocator,
    Handler,
    ReceiveBudget,
    fresh_error,
)
from dissoc.transport.registry import register_transport
from dissoc.transport.tcp import (
    _DIRECT_READ_MIN,
    _READ_BUDGET,
    _STAGING_BYTES,
    DEFAULT_CONNECT_TIMEOUT,
    ConnectOptions,
    ListenOptions,
    TcpConnection,
    TcpListener,
    connect_stream,
    serve_stream,
)

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "PathLike",
    "TlsConnection",
    "TlsListener",
    "cached_client_context",
    "client_context",
    "connect_tls",
    "format_subject",
    "server_context",
    "serve_tls",
]

logger = logging.getLogger(__name__)

#: A PEM file's path.
PathLike: TypeAlias = "str | os.PathLike[str]"

#: Seconds an accepted connection has to complete its TLS handshake before the server drops it.
DEFAULT_HANDSHAKE_TIMEOUT = 10.0

# Frames smaller than this are gathered (copied) into one TLS record instead of a record each.
_GATHER_BYTES = 16 * 1024
# The most bytes handed to one SSL_write (larger payloads are written in slices of this size).
_WRITE_BYTES = 1024 * 1024
# A fatal TLS alert (unexpected_message), what a TLS server answers a plaintext client with.
_ALERT_UNEXPECTED_MESSAGE = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x0A])
# The first byte of a TLS handshake record (a ClientHello).
_TLS_HANDSHAKE_RECORD = 0x16

# ------------------------------------------------------------------------------------------------- contexts


def _path(path: PathLike, what: str) -> str:
    text = os.fspath(path)
    if not Path(text).is_file():
        raise TransportError(f"{what}: no such file: {text!r}")
    return text


def _harden(context: ssl.SSLContext) -> None:
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION


def _load_chain(context: ssl.SSLContext, cert: PathLike, key: PathLike | None, who: str) -> None:
    cert_path = _path(cert, f"the {who} certificate (--tls-cert)")
    key_path = None if key is None else _path(key, f"the {who} private key (--tls-key)")
    try:
        context.load_cert_chain(cert_path, key_path)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise TransportError(
            f"cannot load the {who} certificate {cert_path!r}"
            + ("" if key_path is None else f" with the key {key_path!r}")
            + f": {exc} (expected PEM files: the certificate chain, and its unencrypted private key)"
        ) from None


def _load_ca(context: ssl.SSLContext, ca: PathLike, what: str) -> None:
    ca_path = _path(ca, what)
    try:
        context.load_verify_locations(cafile=ca_path)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise TransportError(f"cannot load {what} {ca_path!r}: {exc} (expected PEM certificates)") from None


def server_context(
    cert: PathLike, key: PathLike | None = None, *, client_ca: PathLike | None = None
) -> ssl.SSLContext:
    """The TLS context of a server: its certificate chain ``cert`` and private ``key`` (PEM files; ``key``
    None when ``cert`` holds both). With ``client_ca``, mutual TLS: every client must present a certificate
    signed by a CA in that PEM bundle, or its handshake fails. TLS 1.2 or later, no renegotiation.

    Raises :class:`~dissoc.errors.TransportError` naming the file that cannot be read or used.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(context)
    context.num_tickets = 0  # nobody resumes a session: do not send tickets after each handshake
    _load_chain(context, cert, key, "server")
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        _load_ca(context, client_ca, "the CA for client certificates (--tls-client-ca)")
    return context


def client_context(
    *, ca: PathLike | None = None, cert: PathLike | None = None, key: PathLike | None = None
) -> ssl.SSLContext:
    """The TLS context of a client: the server's certificate must be signed by a CA in ``ca`` (a PEM bundle;
    None: the system's trusted roots) and name the host connected to. ``cert``/``key``: this client's own
    certificate and key, for servers that require one (mutual TLS).

    Raises :class:`~dissoc.errors.TransportError` naming the file that cannot be read or used.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
    _harden(context)
    if ca is None:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    else:
        _load_ca(context, ca, "the CA bundle (--tls-ca)")
    if cert is not None:
        _load_chain(context, cert, key, "client")
    elif key is not None:
        raise TransportError("a client key (--tls-key) needs its certificate (--tls-cert)")
    return context


def _stamp(path: PathLike | None) -> tuple[str, float] | None:
    if path is None:
        return None
    text = os.fspath(path)
    try:
        return text, os.stat(text).st_mtime
    except OSError:
        return text, -1.0


@functools.lru_cache(maxsize=16)
def _cached(
    ca: tuple[str, float] | None, cert: tuple[str, float] | None, key: tuple[str, float] | None
) -> ssl.SSLContext:
    return client_context(
        ca=None if ca is None else ca[0],
        cert=None if cert is None else cert[0],
        key=None if key is None else key[0],
    )


def cached_client_context(
    ca: PathLike | None = None, cert: PathLike | None = None, key: PathLike | None = None
) -> ssl.SSLContext:
    """:func:`client_context`, built once per set of files (and again when one of them changes): loading
    the system's roots takes milliseconds, too long to repeat for every connection."""
    return _cached(_stamp(ca), _stamp(cert), _stamp(key))


# --------------------------------------------------------------------------------------------- identities

_SHORT_NAMES = {
    "commonName": "CN",
    "countryName": "C",
    "domainComponent": "DC",
    "localityName": "L",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "stateOrProvinceName": "ST",
    "streetAddress": "STREET",
    "userId": "UID",
}
_SPECIAL = frozenset(',+"\\<>;=')


def _escape(value: str) -> str:
    out = []
    for i, char in enumerate(value):
        if char in _SPECIAL or (char == "#" and i == 0) or (char == " " and i in (0, len(value) - 1)):
            out.append("\\" + char)
        elif char == "\0":
            out.append("\\00")
        else:
            out.append(char)
    return "".join(out)


def format_subject(subject: Any) -> str:
    """A certificate subject, as :meth:`ssl.SSLSocket.getpeercert` gives it, in RFC 4514 string form: the
    relative names last to first, joined by ``,`` (several in one by ``+``), the usual attribute names
    shortened (``CN``, ``O``, ``OU``, ``C``, ``ST``, ``L``, ``DC``, ``UID``, ``STREET``; others keep
    :mod:`ssl`'s long name), special characters escaped with a backslash. ``((("commonName", "alice"),),)``
    gives ``"CN=alice"``; a subject ``O=Example, CN=alice`` gives ``"CN=alice,O=Example"``."""
    parts = []
    for rdn in reversed(tuple(subject)):
        parts.append("+".join(f"{_SHORT_NAMES.get(str(k), str(k))}={_escape(str(v))}" for k, v in rdn))
    return ",".join(parts)


# ------------------------------------------------------------------------------------------ what failed


_NOT_TLS_REASONS = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE")


def _describe(exc: BaseException, server_side: bool, during: str) -> str:
    """What a TLS failure means, for the side that saw it (``during``: "handshake" or "session")."""
    peer = "client" if server_side else "server"
    reason = str(getattr(exc, "reason", None) or "")
    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = exc.verify_message or str(exc)
        if server_side:
            return f"the client's certificate was not accepted: {detail} (not signed by --tls-client-ca)"
        return (
            f"the server's certificate was not accepted: {detail} (is tls_ca / --tls-ca the CA that signed "
            "it, and does the certificate name the host in the URI?)"
        )
    if isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError | ConnectionError) or reason.startswith(
        "UNEXPECTED_EOF"
    ):
        if server_side:
            return f"the client closed the connection during the TLS {during}"
        if during == "handshake":
            return (
                "the server closed the connection during the TLS handshake: it is not a TLS server "
                "(connect with its tcp:// URI) or it refused this client"
            )
        return "the server closed the TLS session"
    if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return "the client presented no certificate, and this server requires one (--tls-client-ca)"
    if reason in _NOT_TLS_REASONS:
        if server_side:
            return f"the client does not speak TLS ({reason.lower()})"
        return f"the server does not speak TLS ({reason.lower()}): connect with its tcp:// URI"
    if "ALERT" in reason:
        alert = reason.split("ALERT_", 1)[-1].lower().replace("_", " ")
        hint = ""
        if "certificate required" in alert:
            hint = ": it requires a client certificate (tls_cert/tls_key, --tls-cert/--tls-key)"
        elif alert in ("unknown ca", "bad certificate", "certificate unknown"):
            hint = (
                ": it does not trust this side's certificate"
                if not server_side
                else ": the client does not trust this server's certificate (its --tls-ca)"
            )
        return f"the {peer} refused the TLS {during} (alert: {alert}){hint}"
    return f"TLS {during} failed: {exc}"


# ----------------------------------------------------------------------------------------------- connection


class _State(enum.Enum):
    SNIFF = "waiting for the client's first bytes"
    HANDSHAKE = "handshaking"
    OPEN = "open"


class TlsConnection(TcpConnection):
    """A :class:`~dissoc.transport.tcp.TcpConnection` inside a TLS session (see the module's notes).

    Build it inside a running event loop from a connected socket and a context (:func:`server_context` with
    ``server_side=True``, :func:`client_context` with the ``server_hostname`` to check). The handshake starts
    at once and runs from the event loop; sends wait for it, receives see its failure as their error, and
    :meth:`handshake` waits for it. Past ``handshake_timeout`` seconds (None: no limit) the connection
    fails. Most code gets one from :func:`connect_tls` or from a :func:`serve_tls` handler.
    """

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
        handshake_timeout: float | None = DEFAULT_HANDSHAKE_TIMEOUT,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        allocator: Allocator | None = None,
        receive_budget: ReceiveBudget | None = None,
        staging_bytes: int = _STAGING_BYTES,
    ) -> None:
        if not server_side:
            sock = context.wrap_socket(
                sock, server_side=False, server_hostname=server_hostname, do_handshake_on_connect=False
            )
        super().__init__(
            sock,
            max_message_bytes=max_message_bytes,
            max_buffered_bytes=max_buffered_bytes,
            allocator=allocator,
            receive_budget=receive_budget,
            staging_bytes=staging_bytes,
        )
        self._description = "tls" + self._description.removeprefix("tcp")
        self._context = context
        self._server_side = server_side
        self._state = _State.SNIFF if server_side else _State.HANDSHAKE
        self._identity: str | None = None
        self._version: str | None = None
        self._handshake_done: asyncio.Future[None] = self._loop.create_future()
        self._handshake_writing = False
        self._kick_scheduled = False
        self._handshake_timer: asyncio.TimerHandle | None = None
        if handshake_timeout is not None:
            self._handshake_timer = self._loop.call_later(
                handshake_timeout, self._handshake_expired, handshake_timeout
            )
        if not server_side:
            self._step_handshake()  # the ClientHello goes out now

    @property
    def peer_identity(self) -> str | None:
        """The subject of the certificate the peer presented and this side verified, in RFC 4514 form
        (:func:`format_subject`, e.g. ``"CN=alice,O=Example"``): on a server with mutual TLS the client, on a
        client the server. None before the handshake completed, and on a server without mutual TLS."""
        return self._identity

    @property
    def tls_version(self) -> str | None:
        """The TLS version negotiated (``"TLSv1.3"``), None before the handshake completed."""
        return self._version

    async def handshake(self) -> None:
        """Wait for the TLS handshake; raises :class:`~dissoc.errors.TransportError` if it failed."""
        await asyncio.shield(self._handshake_done)

    # ------------------------------------------------------------------------------------------- handshake

    def _on_readable(self) -> None:
        state = self._state
        if state is _State.OPEN:
            self._read()
            self._kick_if_pending()
        elif state is _State.HANDSHAKE:
            self._step_handshake()
        else:
            self._sniff()

    def _sniff(self) -> None:
        """The first bytes of an accepted connection: a TLS handshake record goes on to the handshake;
        anything else (a plaintext dissoc client's frame header) is answered with a TLS alert and closed."""
        raw = self._sock
        try:
            head = raw.recv(2, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._handshake_failed(TransportError(f"{self._description}: receiving failed: {exc}"))
            return
        if not head:
            self._handshake_failed(
                TransportError(
                    f"{self._description}: the client closed the connection before the TLS handshake"
                )
            )
            return
        if head[0] != _TLS_HANDSHAKE_RECORD or (len(head) > 1 and head[1] != 0x03):
            self._refuse_plaintext(head)
            return
        try:
            self._sock = self._context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except (ssl.SSLError, OSError, ValueError) as exc:
            self._handshake_failed(TransportError(f"{self._description}: cannot start TLS: {exc}"))
            return
        self._state = _State.HANDSHAKE
        self._step_handshake()

    def _refuse_plaintext(self, head: bytes) -> None:
        peer_log.log(
            logging.WARNING,
            ("tls plaintext client",),
            "%s: the client sent plaintext (first bytes %s), not a TLS handshake: refused (a TLS server is "
            "reached with its tls:// URI)",
            self._description,
            head.hex(),
        )
        raw = self._sock
        with contextlib.suppress(OSError):
            raw.recv(1 << 16)  # what it sent: closing with unread bytes would reset the connection
            raw.send(_ALERT_UNEXPECTED_MESSAGE)  # and the reset could discard the alert unread
        self._handshake_failed(
            TransportError(
                f"{self._description}: the client sent plaintext, not a TLS handshake (it must connect with "
                "the tls:// URI)"
            )
        )

    def _step_handshake(self) -> None:
        if self._closed or self._state is not _State.HANDSHAKE:
            return
        if self._handshake_writing:
            self._handshake_writing = False
            self._loop.remove_writer(self._fd)
        sock = self._sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            return  # the reader callback goes on when more arrives
        except ssl.SSLWantWriteError:
            self._handshake_writing = True
            self._loop.add_writer(self._fd, self._step_handshake)
            return
        except (ssl.SSLError, OSError) as exc:
            message = _describe(exc, self._server_side, "handshake")
            self._handshake_failed(TransportError(f"{self._description}: {message}"))
            return
        self._opened(sock)

    def _opened(self, sock: ssl.SSLSocket) -> None:
        self._state = _State.OPEN
        self._cancel_timer()
        try:
            cert = sock.getpeercert()
        except (ValueError, OSError):
            cert = None
        if cert:
            self._identity = format_subject(cert.get("subject", ()))
        self._version = sock.version()
        logger.debug(
            "%s: TLS handshake done (%s, %s); peer %s",
            self._description,
            sock.version(),
            (sock.cipher() or ("?",))[0],
            self._identity,
        )
        if not self._handshake_done.done():
            self._handshake_done.set_result(None)
        self._kick_if_pending()

    def _handshake_expired(self, timeout: float) -> None:
        self._handshake_timer = None
        if self._state is _State.OPEN or self._closed:
            return
        peer_log.log(
            logging.INFO,
            ("tls handshake timeout",),
            "%s: no TLS handshake within %s s (%s); dropped",
            self._description,
            timeout,
            self._state.value,
        )
        self._handshake_failed(
            TransportError(f"{self._description}: the TLS handshake did not complete within {timeout} s")
        )

    def _handshake_failed(self, exc: TransportError) -> None:
        if self._server_side:
            SERVER.refusals.inc("tls_handshake")  # failed, timed out, or plaintext
            peer_log.log(logging.INFO, ("tls handshake failed",), "%s", exc)
            # Read what the client sent since: closing with unread bytes would reset the connection, and the
            # reset could discard the alert that says why before the client reads it.
            with contextlib.suppress(OSError):
                for _ in range(16):
                    if not socket.socket.recv(self._sock, 1 << 16):
                        break
        self._teardown(exc)

    def _cancel_timer(self) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None

    # ---------------------------------------------------------------------------------------------- reading

    def _set_low_water(self) -> None:
        """Always 1: what the kernel holds is ciphertext, and part of a payload may already wait, decrypted or
        not, inside the TLS layer, so a low-water mark sized to the payload could keep the reader asleep."""

    def _read(self) -> None:
        """Read and decrypt until the socket has nothing more (the TCP loop stops at a short read, but one
        TLS read returns at most one record, so here only "would block" ends it)."""
        sock = self._sock
        budget = min(_READ_BUDGET, self._max_buffered_bytes)
        try:
            while budget > 0:
                target = self._target
                if target is not None and self._target_len - self._filled >= _DIRECT_READ_MIN:
                    n = sock.recv_into(target[self._filled :], self._target_len - self._filled)
                    if n == 0:
                        self._on_eof()
                        return
                    self._filled += n
                    if self._filled == self._target_len:
                        self._finish_target()
                else:
                    n = sock.recv_into(self._stage_view[self._wpos :], len(self._stage) - self._wpos)
                    if n == 0:
                        self._on_eof()
                        return
                    self._wpos += n
                    self._process()
                    if self._paused or self._closed:
                        return
                budget -= n
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            return
        except ssl.SSLWantWriteError:
            # The TLS layer must write before it can read (a key update): try again shortly.
            self._loop.call_later(0.001, self._kicked)
        except DissocError as exc:
            self._reader_failed(exc)
        except (ssl.SSLError, OSError) as exc:
            message = _describe(exc, self._server_side, "session")
            self._teardown(TransportError(f"{self._description}: {message} ({self._position()})"))
        except Exception as exc:
            logger.exception("%s: unexpected error in the reader", self._description)
            self._teardown(TransportError(f"{self._description}: internal error in the reader: {exc!r}"))

    def _kick_if_pending(self) -> None:
        """Bytes already decrypted inside the TLS layer wake no reader callback: read them next turn."""
        if self._kick_scheduled or self._closed or self._paused or self._refused:
            return
        if self._state is not _State.OPEN:
            return
        try:
            pending = self._sock.pending() if isinstance(self._sock, ssl.SSLSocket) else 0
        except (OSError, ValueError):
            return
        if pending:
            self._kick_scheduled = True
            self._loop.call_soon(self._kicked)

    def _kicked(self) -> None:
        self._kick_scheduled = False
        if not (self._closed or self._paused or self._refused):
            self._on_readable()

    def _try_resume(self) -> None:
        super()._try_resume()
        self._kick_if_pending()

    # ---------------------------------------------------------------------------------------------- sending

    async def _send_all(self, pieces: list[memoryview], total: int) -> None:
        if self._state is not _State.OPEN:
            await asyncio.shield(self._handshake_done)
        sock = self._sock
        done = 0
        for chunk in _writes(pieces):
            while True:
                try:
                    sock.send(chunk)  # all of it: OpenSSL writes partially only when asked to
                    break
                except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                    wait = self._wait_writable()
                except ssl.SSLWantReadError:
                    wait = asyncio.sleep(0.001)  # the TLS layer must read first (a key update)
                except (ssl.SSLError, OSError) as exc:
                    reason = _describe(exc, self._server_side, "session")
                    self._send_error = TransportError(
                        f"{self._description}: sending failed after {done} of {total} bytes of a frame: "
                        + reason
                    )
                    logger.debug("%s", self._send_error)
                    raise fresh_error(self._send_error) from exc
                try:
                    await wait
                except asyncio.CancelledError:
                    # Part of the chunk may be in TLS records already: the stream cannot be resumed.
                    self._teardown(
                        TransportError(
                            f"{self._description}: a send was cancelled after {done} of {total} bytes of its "
                            "frame; the stream cannot be resumed"
                        )
                    )
                    raise
            done += len(chunk)

    # ---------------------------------------------------------------------------------------------- closing

    def _teardown(self, exc: DissocError) -> None:
        if self._closed:
            return
        self._cancel_timer()
        if self._handshake_writing:
            self._handshake_writing = False
        if not self._handshake_done.done():
            self._handshake_done.set_exception(fresh_error(exc))
            self._handshake_done.exception()  # retrieved: a server side nobody waits on logs nothing
        super()._teardown(exc)


def _writes(pieces: list[memoryview]) -> Iterator[memoryview | bytearray]:
    """The buffers to hand to ``SSL_write`` for ``pieces``, in order: small pieces gathered (copied) into
    one buffer of about a record, large ones in slices of at most ``_WRITE_BYTES`` (not copied); a gathered
    buffer is topped up with the start of the large piece after it, so a frame header shares a record with
    its payload."""
    gathered = bytearray()
    for piece in pieces:
        size = piece.nbytes
        if size < _GATHER_BYTES:
            gathered += piece
            if len(gathered) >= _GATHER_BYTES:
                yield gathered
                gathered = bytearray()
            continue
        start = 0
        if gathered:
            start = _GATHER_BYTES - len(gathered)
            gathered += piece[:start]
            yield gathered
            gathered = bytearray()
        for offset in range(start, size, _WRITE_BYTES):
            yield piece[offset : offset + _WRITE_BYTES]
    if gathered:
        yield gathered


# -------------------------------------------------------------------------------------------- listening


class TlsListener(TcpListener):
    """A :class:`~dissoc.transport.tcp.TcpListener` whose connections are :class:`TlsConnection`\\ s (server
    side of ``context``); their handlers start at once and the handshake runs as they wait for a request."""

    scheme = "tls"

    def __init__(
        self,
        sock: socket.socket,
        handler: Handler,
        *,
        context: ssl.SSLContext,
        handshake_timeout: float | None = DEFAULT_HANDSHAKE_TIMEOUT,
        **options: Any,
    ) -> None:
        self._context = context
        self._handshake_timeout = handshake_timeout
        super().__init__(sock, handler, **options)

    def _connection(self, sock: socket.socket) -> TcpConnection:
        return TlsConnection(
            sock, self._context, server_side=True, handshake_timeout=self._handshake_timeout, **self._limits
        )


async def serve_tls(
    host: str,
    port: int,
    handler: Handler,
    *,
    tls: ssl.SSLContext | None = None,
    handshake_timeout: float | None = DEFAULT_HANDSHAKE_TIMEOUT,
    **options: Unpack[ListenOptions],
) -> TlsListener:
    """:func:`~dissoc.transport.tcp.serve_tcp` over TLS (the same ``options``) with the server context ``tls``
    (required; see :func:`server_context`). A connection that has not completed its handshake
    ``handshake_timeout`` seconds after it was accepted is dropped (None: never)."""
    if not isinstance(tls, ssl.SSLContext):
        raise TransportError(
            "serving tls:// needs a server TLS context (tls=dissoc.transport.tls.server_context(cert, key)); "
            f"got {tls!r}"
        )
    listener = functools.partial(TlsListener, context=tls, handshake_timeout=handshake_timeout)
    return await serve_stream("tls", host, port, handler, listener, options)


async def connect_tls(
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    **options: Unpack[ConnectOptions],
) -> TlsConnection:
    """:func:`~dissoc.transport.tcp.connect_tcp` over TLS (the same ``options``): connect to ``host:port``
    and complete a TLS handshake, within ``timeout`` seconds for both.

    ``tls``: the client context (:func:`client_context`; None: the system's roots, no client certificate).
    The server's certificate must name ``server_hostname`` (default ``host``). Raises
    :class:`~dissoc.errors.TransportError` saying what failed: no connection, an untrusted certificate, a
    server that is not TLS, a refused client certificate (TLS 1.2; with TLS 1.3 a server refuses a client's
    certificate after the client's side of the handshake, so that shows on the first receive instead).
    """
    context = tls if tls is not None else cached_client_context()
    timeout = options.get("timeout", DEFAULT_CONNECT_TIMEOUT)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout

    def start(sock: socket.socket, **limits: Any) -> TlsConnection:
        try:
            # (no handshake timeout of its own: it is waited for below, within what is left of ``timeout``)
            return TlsConnection(
                sock,
                context,
                server_side=False,
                server_hostname=server_hostname or host,
                handshake_timeout=None,
                **limits,
            )
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise TransportError(f"cannot start TLS to tls://{host}:{port}: {exc}") from None

    conn = await connect_stream("tls", host, port, start, options)
    try:
        async with asyncio.timeout(None if deadline is None else max(0.0, deadline - loop.time())):
            await conn.handshake()
    except TimeoutError:
        await conn.close()
        raise TransportError(
            f"tls://{host}:{port}: the TLS handshake did not complete within {timeout} s (is it a TLS "
            "server?)"
        ) from None
    except BaseException:
        await conn.close()
        raise
    return conn


register_transport("tls", connect_tls, serve_tls)
