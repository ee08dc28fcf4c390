"""The client's options (:class:`ClientOptions`), what one stream carried (:class:`FetchStats`) and the path
its bytes took (:class:`FetchPath`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dissoc.flight.common import DEFAULT_TIMEOUT
from dissoc.transport.tcp import DEFAULT_KEEPALIVE, Keepalive

__all__ = ["HOST_COPY", "ClientOptions", "FetchPath", "FetchStats"]

#: How a body reached the device when it was on the host (:attr:`FetchPath.device_landing`); the names
#: are :mod:`dissoc.device.landing`'s.
HOST_COPY = "host-copy"


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """Client limits.

    ``timeout``: seconds to connect, and the longest silence tolerated while a stream is incomplete; None:
    no limit on silence (following a live stream, whose producer may pause for long; connecting still gives
    up after 30 s, and keepalive still notices a server that is gone).
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
    ``require_device_path``: with ``landing="device"``, a stream whose bodies reach the device through host
    memory (received on the host, then uploaded: packed bodies over TCP, pairs in ``shm`` or ``ucx``
    memory) fails with :class:`~dissoc.errors.DevicePathError` before the first such batch is handed out,
    instead of logging a warning (once per stream) and going on. The device path is UCX with CuPy and a
    CUDA-capable UCX build (packed bodies received into device memory), or pairs in device memory
    (``memory=cuda``, CUDA IPC). See :attr:`FetchStats.path`.
    ``keepalive``: how a ``tcp``/``tls`` connection notices a server that is gone without a word (a partition,
    a host that vanished), pooled connections included: TCP keepalive probes and a limit on unacknowledged
    data (:class:`dissoc.transport.Keepalive`; the default notices within about a minute; None: off). A
    stream in progress also ends after ``timeout`` seconds without data.
    """

    timeout: float | None = 30.0
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
    require_device_path: bool = False
    keepalive: Keepalive | None = DEFAULT_KEEPALIVE

    @property
    def connect_timeout(self) -> float:
        """Seconds to connect (and to set up a stream's memory): ``timeout``, or 30 when it is None."""
        return self.timeout if self.timeout is not None else 30.0


@dataclass(frozen=True, slots=True)
class FetchPath:
    """The path one stream's bytes took, from the server to the batches handed out.

    ``transport``, ``data_transport``: the schemes of the metadata and data connections (``tcp``, ``tls``,
    ``ucx``, ``inproc``; the same unless the servers are split).
    ``ucx_transports``: for a ``ucx`` data connection, the UCX transport and device of each lane of its
    endpoint, as ``"transport/device"`` (``"tcp/lo"``, ``"sysv/memory"``, ``"cma/memory"``,
    ``"cuda_copy/cuda"``, ``"cuda_ipc/cuda"``, ``"rc_mlx5/mlx5_0:1"``...; ``"tcp"`` alone for the connection
    manager's lane), each once, as libucp reports them (UCX 1.14 or later); empty otherwise.
    ``bodies``: ``"packed"`` (the bodies themselves travelled on the data connection) or ``"pairs"``
    (address/length pairs into memory the client reads).
    ``memory``: what the pairs pointed into: ``"shm"`` (POSIX shared memory), ``"ucx"`` (a region read with
    UCX RMA) or ``"cuda"`` (device memory, through CUDA IPC); None for packed bodies.
    ``arena``: for pairs, ``"shared"`` (one arena for every client) or ``"private"`` (one per connection,
    ``private_memory``); None for packed bodies.
    ``device_landing``: with ``landing="device"``, how bodies reached the device, each way once, in the order
    first taken: ``"received"`` (packed bodies received into device memory by UCX's CUDA transports),
    ``"cuda-ipc-view"`` (``memory=cuda`` pairs with ``zero_copy``: views over the server's allocation),
    ``"cuda-ipc-copy"`` (``memory=cuda`` pairs copied device to device), ``"host-copy"`` (bodies that were
    in host memory, packed or pairs, uploaded: the slow path, see
    ``ClientOptions.require_device_path``); empty when landing on the host or before any body.
    """

    transport: str = ""
    data_transport: str = ""
    ucx_transports: tuple[str, ...] = ()
    bodies: str = ""
    memory: str | None = None
    arena: str | None = None
    device_landing: tuple[str, ...] = ()

    @property
    def host_copy(self) -> bool:
        """Whether bodies landing on the device went through host memory."""
        return HOST_COPY in self.device_landing

    def as_dict(self) -> dict[str, object]:
        """The path as JSON-ready values (tuples as lists): what ``dissoc get`` prints."""
        return {
            "transport": self.transport,
            "data_transport": self.data_transport,
            "ucx_transports": list(self.ucx_transports),
            "bodies": self.bodies,
            "memory": self.memory,
            "arena": self.arena,
            "device_landing": list(self.device_landing),
        }


@dataclass(slots=True)
class FetchStats:
    """What one fetch carried, filled in when its stream ends (also when it fails or is closed early).

    ``batches``, ``rows``, ``bytes``: batches decoded, their rows, and the bytes of their bodies received.
    ``paths``: the path each stream's bytes took (:class:`FetchPath`), one per stream read (a Flight
    location's endpoints, in the order read; none for a stream that never began); :attr:`path` is the first.
    """

    batches: int = 0
    rows: int = 0
    bytes: int = 0
    paths: list[FetchPath] = field(default_factory=list)

    @property
    def path(self) -> FetchPath | None:
        """The path of the (first) stream's bytes; None before it began."""
        return self.paths[0] if self.paths else None
