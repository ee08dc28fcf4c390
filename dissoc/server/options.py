"""What a :class:`~dissoc.server.Server` is told: :class:`ServerOptions`, every option checked on its own
before anything is built, and the defaults it starts from (the command line's too).

``dissoc serve`` fills it from its flags, the environment and a configuration file
(:meth:`ServerOptions.from_args`, through :func:`dissoc.config.fill`): a field takes the flag of its name,
or the one its metadata names (``--arena-mib`` for :attr:`~ServerOptions.arena_bytes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Self

from dissoc.config import fill, from_option
from dissoc.errors import DissocError, TransportError
from dissoc.tokens import Secret
from dissoc.transport.tcp import DEFAULT_KEEPALIVE, Keepalive
from dissoc.transport.tls import DEFAULT_HANDSHAKE_TIMEOUT
from dissoc.uri import DissocURI

__all__ = [
    "DEFAULT_FREE_DATA",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS_PER_PEER",
    "DEFAULT_MAX_FREE_DATA_BYTES",
    "DEFAULT_MAX_RECEIVING_BYTES",
    "DEFAULT_MAX_TICKET_BYTES",
    "DEFAULT_WANT_DATA",
    "DEFAULT_WANT_DATA_TIMEOUT",
    "ROLES",
    "ServerOptions",
]

#: The want_data and free_data tag values a server advertises unless told otherwise ("WANT", "FREE").
DEFAULT_WANT_DATA = 0x57414E54
DEFAULT_FREE_DATA = 0x46524545
#: Largest want_data payload (ticket) a server reads (64 KiB).
DEFAULT_MAX_TICKET_BYTES = 64 << 10
#: Largest free_data payload a server reads (8 MiB: 1 Mi ranges of 8 bytes).
DEFAULT_MAX_FREE_DATA_BYTES = 8 << 20
#: Seconds a client has to send a complete want_data after connecting (and to finish any request it began).
DEFAULT_WANT_DATA_TIMEOUT = 10.0
#: Seconds a connection may sit with no request, no stream and no listed ranges held.
DEFAULT_IDLE_TIMEOUT = 300.0
#: Connections one peer address may have open at once, per listening port.
DEFAULT_MAX_CONNECTIONS_PER_PEER = 64
#: Bytes being received (or received and not yet taken) across all of a server's connections.
DEFAULT_MAX_RECEIVING_BYTES = 1 << 30
#: What a Server runs: ``all`` (both halves, or the combined server), one half of a split server in its own
#: process (``metadata``, ``data``: the two encode the same datasets alike, so their sequence numbers
#: match), or ``none`` (only the catalog, for a Flight control plane in front of servers running elsewhere).
ROLES = ("all", "metadata", "data", "none")


def _mebibytes(value: int | None) -> int | None:
    """A size given in MiB (the command line's unit), in bytes; None stays None (no limit)."""
    return None if value is None else value << 20


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """How a :class:`~dissoc.server.Server` serves: ``Server(datasets, options, **overrides)``.

    With ``split=True`` the metadata and data streams come from two servers on two ports (``uri`` and
    ``data_uri``); otherwise one server carries both.

    Bounds on what clients may hold take None to turn them off. Every value is checked when the options are
    made (a :class:`~dissoc.errors.DissocError` naming the option, and its flag where the two differ);
    nothing is built or opened until a server is. An option that is not one of these fields is a
    transport option (:attr:`transport_options`).
    """

    #: The address to listen on.
    host: str = "127.0.0.1"
    #: The metadata (or combined) port, 0 to 65535; 0 picks a free one.
    port: int = 0
    #: The transport scheme: ``tcp``, ``ucx``, ``mem`` (in-process, for tests), or ``tls`` with a context
    #: of your own in :attr:`transport_options` (``tls_cert`` is the usual way to TLS).
    transport: str = "tcp"
    #: Metadata and data streams on two servers (two ports, ``uri`` and ``data_uri``).
    split: bool = False
    #: The data port with ``split``, 0 to 65535; 0 picks a free one.
    data_port: int = 0
    #: The want_data tag clients send requests under (advertised in the URI).
    want_data: int = DEFAULT_WANT_DATA
    #: The free_data tag, for pair bodies (None: :data:`DEFAULT_FREE_DATA` when bodies are pairs).
    free_data: int | None = None
    #: ``lz4`` or ``zstd`` packed bodies (None: uncompressed); pairs point at uncompressed buffers.
    compression: str | None = None
    #: ``packed`` (the bodies themselves) or ``pairs`` (address/length pairs into an arena).
    body: str = "packed"
    #: What pairs point at: ``shm`` (the default with pairs), ``ucx`` (read with UCX RMA; needs the ``ucx``
    #: transport) or ``cuda``. Only with ``body="pairs"``.
    memory: str | None = None
    #: With pairs: the size of the arena buffers are placed in and listed from (``--arena-mib``).
    arena_bytes: int = field(default=1 << 30, metadata=from_option("arena_mib", _mebibytes))
    #: With pairs, a batch of a stored or in-memory dataset is placed once and stays there, listed to every
    #: client that asks with no further copy, until the arena needs the room for something else and no
    #: client holds it (:attr:`Server.placements`); False places a copy per request, freed when the client
    #: frees it (``--no-resident``).
    resident: bool = True
    #: Connections open at once; ``"auto"``: :func:`~dissoc.transport.base.default_max_connections`,
    #: ``min(1024, max(soft - 64, soft // 2))`` for the soft file-descriptor limit (shared out between the two
    #: ports when split). At the bound accepting pauses until one closes (UCX: new ones are refused).
    max_connections: int | Literal["auto"] | None = "auto"
    #: Connections from one address per port: one more is accepted and closed at once.
    max_connections_per_peer: int | None = DEFAULT_MAX_CONNECTIONS_PER_PEER
    #: Seconds to send a complete want_data after connecting, or to finish a request begun later.
    want_data_timeout: float | None = DEFAULT_WANT_DATA_TIMEOUT
    #: Seconds a connection may sit with no request, no stream and no listed ranges held before it is dropped.
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT
    #: How TCP and TLS connections notice a client that is gone without a word (a partition, a host that
    #: vanished), a stream in progress included: keepalive probes and a limit on unacknowledged data
    #: (:class:`~dissoc.transport.Keepalive`: about a minute by default; None: off; ``--keepalive``). The
    #: connection then closes and everything the client held is released.
    keepalive: Keepalive | None = DEFAULT_KEEPALIVE
    #: Largest want_data payload: a larger one is refused from its frame header, before it is read.
    max_ticket_bytes: int = DEFAULT_MAX_TICKET_BYTES
    #: Largest free_data payload: a larger one is refused from its frame header, before it is read.
    max_free_data_bytes: int = DEFAULT_MAX_FREE_DATA_BYTES
    #: Bytes being received, or received and not yet taken, across all connections: a message that would go
    #: past it fails its connection (nothing is allocated for it) (``--max-receiving-mib``).
    max_receiving_bytes: int | None = field(
        default=DEFAULT_MAX_RECEIVING_BYTES, metadata=from_option("max_receiving_mib", _mebibytes)
    )
    #: Bytes one client may hold in listed ranges it has not freed (None: a quarter of the arena); over it,
    #: that client's stream fails with ``quota_exceeded`` and the others are served. With
    #: ``private_memory``, the size of each connection's arena (``--max-unfreed-mib``).
    max_unfreed_bytes: int | None = field(default=None, metadata=from_option("max_unfreed_mib", _mebibytes))
    #: TLS (``tcp`` transport): with ``tls_cert`` and ``tls_key`` (PEM files) both ports speak TLS and the
    #: URIs are ``tls://`` (see :mod:`dissoc.transport.tls`).
    tls_cert: str | os.PathLike[str] | None = None
    #: The private key of ``tls_cert`` (unencrypted PEM; None when ``tls_cert`` holds both).
    tls_key: str | os.PathLike[str] | None = None
    #: Mutual TLS: a client must present a certificate signed by a CA in this bundle (its subject is the
    #: connection's ``peer_identity``).
    tls_client_ca: str | os.PathLike[str] | None = None
    #: Seconds a connection may take to complete its TLS handshake before it is dropped.
    tls_handshake_timeout: float | None = DEFAULT_HANDSHAKE_TIMEOUT
    #: Who may ask: with a secret (a :class:`~dissoc.tokens.Secret`, or its bytes: see
    #: :func:`dissoc.tokens.load_secret`; held as a ``Secret``, whose repr shows no key), want_data must carry
    #: a signed ticket of scope ``read`` made with it (:func:`dissoc.tokens.mint`, ``dissoc token``); anything
    #: else is refused with the error code ``unauthorized`` and the server goes on serving. Without one, the
    #: ticket is the dataset's name.
    secret: Secret | bytes | str | None = None
    #: With pairs (``memory`` ``shm`` or ``ucx``), no shared arena: each data connection gets an arena of its
    #: own (a segment, or a UCX region with its own remote key) of ``max_unfreed_bytes``, made once its
    #: want_data was accepted and announced to it on the data connection (the data URI names none),
    #: destroyed when it closes. Together they hold at most ``arena_bytes``: one more connection asking for
    #: data gets the error ``arenas_exhausted``. A client then reads only what was listed to it (see
    #: :mod:`dissoc.memory.private`).
    private_memory: bool = False
    #: Which servers run in this process (:data:`ROLES`): with ``split``, ``metadata`` or ``data`` runs only
    #: that half (two processes serving the same datasets make one split server; the metadata half hands
    #: clients ``advertise_data_uri``); ``none`` runs no listener, only the catalog, for a
    #: :class:`~dissoc.flight.FlightControlPlane` that hands out ``advertise_uri`` and ``advertise_data_uri``
    #: (publishing through such a plane adds to its own catalog only: run it read-only).
    role: str = "all"
    #: The metadata URI given to clients in place of the running server's.
    advertise_uri: str | None = None
    #: The data URI given to clients in place of the running server's (the data server's, for a metadata
    #: half).
    advertise_data_uri: str | None = None
    #: Options of the transport's ``serve`` (``sndbuf``, ``max_buffered_bytes``, ``mem``'s fault injection,
    #: ...), over the ones the server sets from the fields above.
    transport_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check_role()
        for what, number in (("port", self.port), ("data_port", self.data_port)):
            if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= 65535:
                # the OS would wrap 70000 to 4464, or take 65536 as "any port"
                raise DissocError(f"{what} must be 0 (any free port) to 65535, got {number!r}")
        if self.secret is not None and not isinstance(self.secret, Secret):
            object.__setattr__(self, "secret", Secret(self.secret))  # a short one is refused here
        self._check_body()
        for name, value in (
            ("want_data_timeout", self.want_data_timeout),
            ("idle_timeout", self.idle_timeout),
        ):
            if value is not None and value <= 0:
                raise DissocError(f"{name} must be > 0 (or None), got {value!r}")
        if self.max_ticket_bytes < 0 or self.max_free_data_bytes < 0:
            raise DissocError("max_ticket_bytes and max_free_data_bytes must be >= 0")
        self._check_tls()
        object.__setattr__(self, "transport_options", MappingProxyType(dict(self.transport_options)))
        self._check_transport_options()

    def _check_role(self) -> None:
        role, split = self.role, self.split
        if role not in ROLES:
            raise DissocError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if role in ("metadata", "data") and not split:
            raise DissocError(f"role={role!r} runs one half of a split server: it needs split=True (--split)")
        for what, given in (
            ("advertise_uri", self.advertise_uri),
            ("advertise_data_uri", self.advertise_data_uri),
        ):
            if given is not None:
                try:
                    DissocURI.parse(given)  # a malformed one fails here, not in a client
                except DissocError as e:
                    raise DissocError(f"{what}: {e}") from None
        if role == "metadata" and self.advertise_data_uri is None:
            raise DissocError(
                "role='metadata' needs advertise_data_uri (--advertise-data-uri): the data server's"
            )
        if role == "none" and (self.advertise_uri is None or self.advertise_data_uri is None):
            raise DissocError(
                "role='none' (a catalog for a control plane, no listener) needs advertise_uri and "
                "advertise_data_uri (--advertise-uri, --advertise-data-uri): the servers' that serve it"
            )

    def _check_body(self) -> None:
        if self.body not in ("packed", "pairs"):
            raise DissocError(f"body must be 'packed' or 'pairs', got {self.body!r}")
        if self.body == "pairs":
            if self.pairs_memory == "ucx" and self.transport != "ucx":
                raise DissocError("memory='ucx' (pairs read with UCX RMA) needs transport='ucx'")
            if self.compression is not None:
                raise DissocError("compression applies to packed bodies; pairs point at uncompressed buffers")
        elif self.memory is not None:
            raise DissocError(f"memory={self.memory!r} needs body='pairs'")
        elif self.private_memory:
            raise DissocError("private_memory (an arena per connection) needs body='pairs'")

    def _check_tls(self) -> None:
        if self.tls_cert is None:
            if self.tls_key is not None or self.tls_client_ca is not None:
                raise DissocError(
                    "tls_key and tls_client_ca (--tls-key, --tls-client-ca) need tls_cert (--tls-cert)"
                )
            if self.transport == "tls" and "tls" not in self.transport_options:
                raise DissocError("transport='tls' needs tls_cert and tls_key (--tls-cert, --tls-key)")
            return
        if self.transport not in ("tcp", "tls"):
            raise DissocError(f"TLS (tls_cert, --tls-cert) is for the tcp transport, not {self.transport!r}")
        timeout = self.tls_handshake_timeout
        if timeout is not None and timeout <= 0:
            raise DissocError(f"tls_handshake_timeout must be > 0 (or None), got {timeout!r}")

    def _check_transport_options(self) -> None:
        """Each transport option is one the transport's ``serve`` takes (a misspelt option would otherwise
        only fail when the server starts). A transport that cannot be loaded here is left to fail then."""
        if not self.transport_options:
            return
        from dissoc.transport.registry import serve_options

        try:
            taken = serve_options(self.scheme)
        except TransportError:
            return
        if taken is None:
            return
        unknown = sorted(set(self.transport_options) - taken)
        if unknown:
            fields = [f.name for f in dataclasses.fields(self)]
            close = difflib.get_close_matches(unknown[0], [*fields, *taken], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"unknown server option {', '.join(map(repr, unknown))}{hint}: not a ServerOptions field, "
                f"nor an option of the {self.scheme!r} transport's serve ({', '.join(sorted(taken))})"
            )

    @property
    def scheme(self) -> str:
        """The transport the listeners use: ``tls`` with ``tls_cert``, else :attr:`transport`."""
        return "tls" if self.tls_cert is not None else self.transport

    @property
    def pairs_memory(self) -> str:
        """What pairs point at: :attr:`memory`, by default ``shm``."""
        return self.memory or "shm"

    @classmethod
    def resolve(cls, options: ServerOptions | None, overrides: Mapping[str, Any]) -> ServerOptions:
        """``options`` (None: the defaults) with ``overrides`` applied: each a field by its name, or else a
        transport option (added to :attr:`transport_options`); checked again as a whole."""
        base = cls() if options is None else options
        if not isinstance(base, ServerOptions):
            raise TypeError(f"options must be a ServerOptions, got {type(base).__name__}")
        if not overrides:
            return base
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in overrides.items() if k in names}
        extra = {k: v for k, v in overrides.items() if k not in names}
        if extra:
            given = fields.get("transport_options", base.transport_options)
            fields["transport_options"] = {**given, **extra}
        return dataclasses.replace(base, **fields)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> Self:
        """The options ``dissoc serve``'s arguments give (completed from the environment and the configuration
        file: :func:`dissoc.config.layer`), ``given`` over them (the secret, read from its file)."""
        return fill(cls, args, **given)
