"""The UCX transport (scheme ``ucx``), over ucxx's low-level bindings (``pip install 'dissoc[ucx]'``).

Mapping (DESIGN.md section 3, the reference example's): tagged messages (want_data, free_data, bodies) are UCX
tagged messages carrying the u64 tag as given (no per-endpoint tag mixing); untagged messages (the metadata
stream) are UCX active messages, id 0 (sent with ucxx's AM API, which prepends its own small header; received
by :mod:`~dissoc.transport.ucx.am` through libucp, which ignores any header).

**One worker per connection.** A UCX tag receive does not say which endpoint sent the message, so a server
whose connections shared one worker could not tell its clients' want_data/free_data apart. ucxx's Python API
can only create an accepted endpoint on the *listener's* worker, so connections are set up in two steps:

1. the client creates its own worker and connects a *bootstrap* endpoint to ``host:port`` (the listener, over
   TCP, with UCX peer-failure handling on); it sends ``MAGIC + its worker address`` as an active message;
2. the server creates a fresh worker for the connection, an endpoint from it to the client's worker address,
   and answers ``MAGIC + its own worker address``; the client connects its worker to that address.

Every data message then flows between the two per-connection workers (each has exactly one peer), over the
best transport UCX finds for worker-address endpoints (shared memory on one host, ~5 GB/s here; a listener
endpoint is restricted to TCP). The data endpoints have peer-failure handling off by default (with it on, UCX
drops the shared-memory transports: ~0.7 GB/s here); the bootstrap endpoint stays open as the liveness
monitor: when the peer closes or dies, UCX reports it there, and the connection drains what already arrived
on its data worker, then fails with :class:`~dissoc.errors.TransportError`. Pass ``error_handling=True`` to
both ends to keep peer-failure handling on the data endpoints too. A peer that is not a dissoc ``ucx``
endpoint (for instance the reference C++ client, which uses the listener endpoint for data) is not supported.

**Receiving.** A tagged message is received by probe: for each waiting ``recv_tagged(tag, mask)`` (oldest
first) the worker is probed with ``UCXXTag(tag)``/``UCXXTagMask(mask)``; the probe gives the message's tag and
length before any payload is placed, so the allocator (:meth:`Connection.set_allocator`) provides the buffer,
and ``max_message_bytes`` is checked before it is called. Messages nobody waits for are taken (in arrival
order, probing with mask 0) while the buffering budget allows; the rest stay in UCX (large ones as a
rendezvous announcement only, so the sender waits: UCX's own flow control). Active messages are received as
they arrive, by :class:`~dissoc.transport.ucx.am.AmReceiver` (their size is checked before anything is
allocated), and handed to the inbox in order while reading is admitted.

**Closing** is an exchange: each side sends ``BYE_TAG`` as its last message, then takes and drops what the
other still sends until the other's ``BYE_TAG`` (so every send under way completes on both sides), then closes
its endpoints and waits for UCX to complete the closes. A UCX request that never completes holds its endpoint,
and the endpoint its worker, for the life of the process; so would a receive left in ucxx's queues, which is
why active messages do not go through them.

**Sending.** One UCX message per message: a single buffer is sent as is (held until UCX completes the send);
a list of buffers is first gathered into one (a copy). ``send`` returns when UCX has completed the request.

**Progress.** No thread and no busy loop: each worker runs in blocking mode, its epoll descriptor is watched
by the event loop (``add_reader``); on activity the worker is progressed, requests are completed and probes
are run, then the worker is armed again. While requests are outstanding a 0.5 s timer also progresses it, as
a guard against a missed wake-up. An idle connection costs no CPU.

**Environment.** ucxx is imported lazily, by the first ``serve_ucx``/``connect_ucx`` call, never by importing
this package, and the environment is left as it was: importing ucxx sets, when unset, ``UCX_MEMTYPE_CACHE=n``,
``UCX_RNDV_THRESH=8192``, ``UCX_RNDV_FRAG_MEM_TYPE=cuda`` and ``UCX_MAX_RNDV_RAILS=1`` (ucxx's own choices);
they are taken back out of ``os.environ`` at once and passed to dissoc's UCX context as its configuration
instead (``UCX_*`` variables the user set still win).

**Modules.** :mod:`~dissoc.transport.ucx.library` (ucxx, loaded lazily, and the UCX context),
:mod:`~dissoc.transport.ucx.libucp` (libucp's C API through ctypes),
:mod:`~dissoc.transport.ucx.am` (receiving active messages),
:mod:`~dissoc.transport.ucx.driver` (progress), :mod:`~dissoc.transport.ucx.handshake` (its constants and
messages), :mod:`~dissoc.transport.ucx.connection` (:class:`UcxConnection`, :func:`connect_ucx`) and
:mod:`~dissoc.transport.ucx.listener` (:class:`UcxListener`, :func:`serve_ucx`).
"""

from __future__ import annotations

from dissoc.transport.registry import register_transport
from dissoc.transport.ucx.connection import UcxConnection, connect_ucx
from dissoc.transport.ucx.handshake import MAGIC
from dissoc.transport.ucx.listener import UcxListener, serve_ucx

__all__ = ["MAGIC", "UcxConnection", "UcxListener", "connect_ucx", "serve_ucx"]

register_transport("ucx", connect_ucx, serve_ucx)
