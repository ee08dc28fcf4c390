"""The client's options (:class:`ClientOptions`) and what one stream carried (:class:`FetchStats`)."""

from __future__ import annotations

from dataclasses import dataclass

from dissoc.flight.common import DEFAULT_TIMEOUT

__all__ = ["ClientOptions", "FetchStats"]


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """Client limits.

    ``timeout``: seconds to connect, and the longest silence tolerated while a stream is incomplete.
    ``max_in_flight_bytes``: received body bytes waiting for the consumer before reading pauses.
    ``max_buffered_bytes``: the transport's own read-ahead budget per connection.
    ``window``: how many sequence numbers metadata or bodies may run ahead of the next batch to release.
    ``ordered_metadata``: the metadata transport delivers in order (default: true for ``tcp`` and ``tls``),
    so a gap, a duplicate or a wrong end-of-stream count is an error at once; otherwise metadata may arrive in
    any order (the spec's sequence numbers allow it) and a gap is only reported when the timeout expires.
    ``ucx_path``: how a ``ucx`` connection is set up: ``"listener"`` (host:port, works across hosts),
    ``"address"`` (the URI's ``worker`` address, same host) or ``"auto"`` (the address path when the server's
    host is this machine).
    ``zero_copy``: pairs in shared memory (``memory=shm``) become batches over the mapped segment itself, no
    copy; each batch's ranges are freed when the batch is released, and the data connection stays open until
    every such batch is (the server would reuse the memory otherwise). Synchronous calls then run the stream
    on a background event loop that outlives the call. With ``landing="device"`` and ``memory=cuda`` pairs,
    batches are views over the server's device allocation (CUDA IPC), freed the same way.
    ``landing``: where batches land, whatever memory the server keeps them in: ``"host"`` (``pa.RecordBatch``)
    or ``"device"`` (:class:`dissoc.device.DeviceBatch`, CUDA memory through CuPy; needs the ``gpu`` extra and
    uncompressed bodies). See :mod:`dissoc.device.landing` for how each body gets there.
    ``flight_timeout``: seconds a Flight control plane (a ``grpc://`` location) may take to describe a
    dataset before the fetch fails.
    ``tls_ca``, ``tls_cert``, ``tls_key``: PEM files for ``tls://`` URIs and ``grpc+tls://`` control planes:
    the CA bundle the server's certificate must be signed by (None: the system's trusted roots), and this
    client's certificate and key for servers that require one (mutual TLS). A ``tcp://`` URI is plaintext
    whatever these say.
    ``token``: a signed ticket (:mod:`dissoc.tokens`, ``dissoc token``) for servers started with a secret.
    A Flight control plane gets it as ``authorization: Bearer TOKEN`` and hands back endpoints with tickets
    it signed; a dissoc URI gets it in place of the ticket when the ticket is the dataset's name the token
    is for (a ticket that is already signed is sent as it is). A signed ticket given as the ticket to a
    Flight location, with no ``token``, is used as the bearer token for the name it carries.
    ``reuse_connections``: a stream of packed bodies that ended cleanly leaves its connections to the next
    stream to the same server from the same event loop, as the server waits for another request on them;
    they are dropped after 5 s unused (see :mod:`dissoc.session.pool`). None (the default): only in the
    loop the synchronous API runs (the main thread's, closed at exit); True: in any loop (close them with
    :func:`close_idle_connections` before the loop ends); False: every stream connects afresh and closes
    its connections.
    """

    timeout: float = 30.0
    max_in_flight_bytes: int = 256 << 20
    max_buffered_bytes: int = 64 << 20
    window: int = 4096
    validate: bool = True
    ordered_metadata: bool | None = None
    ucx_path: str = "auto"
    zero_copy: bool = False
    landing: str = "host"
    flight_timeout: float | None = DEFAULT_TIMEOUT
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    reuse_connections: bool | None = None


@dataclass(slots=True)
class FetchStats:
    """What one stream carried."""

    batches: int = 0
    rows: int = 0
    bytes: int = 0
