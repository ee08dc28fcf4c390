"""The UCX transport (scheme ``ucx``), over ucxx's low-level bindings (``pip install 'dissoc[ucx]'``).

Mapping (DESIGN.md section 3, the reference example's): tagged messages (want_data, free_data, bodies) are UCX
tagged messages carrying the u64 tag as given (no per-endpoint tag mixing); untagged messages (the metadata
stream) are UCX active messages, id 0 (sent with ucxx's AM API, which prepends its own small header; received
by :mod:`~dissoc.transport.ucx.am` through libucp, which ignores any header).

**One worker per connection.** A UCX tag receive does not say which endpoint sent the message, so a server
whose connections shared one worker could not tell its clients' want_data/free_data apart. Connections are
accepted on a worker of their own, on two paths:

* the *listener path* (``host:port``, any host, any peer that follows the reference mapping, and peers
  written with ucxx's asyncio API): the listener is libucp's (:mod:`~dissoc.transport.ucx.libucp`), and each
  connection request is accepted on a fresh worker (:class:`~dissoc.transport.ucx.endpoint.RawEndpoint`);
  the client's one endpoint carries everything from its first message on (want_data), with UCX peer-failure
  handling on (such a connection uses TCP anyway). ucxx's asyncio endpoints (``ucxx.create_endpoint``,
  ``ucxx.create_listener``) first swap 16 bytes of peer information on the UCX stream API, the listener's
  side first, and wait for them: dissoc's listener sends its 16 bytes to a peer still silent 0.2 s after
  the accept (or as soon as the peer's own came), dissoc's client answers a listener's, and each side takes
  and drops the peer's; nothing is sent on the stream to a peer that sent want_data at once, nothing waits
  for the exchange, and the 16-byte receive is cancelled when the connection closes
  (:mod:`~dissoc.transport.ucx.peer_info`);
* the *same-host path* (the URI's ``worker``, the listener worker's address): the client sends
  ``MAGIC + its worker address`` tagged ``HELLO_TAG`` to the listener worker; the server creates a fresh
  worker, an endpoint from it to the client's worker, and a monitor endpoint (peer-failure handling on) from
  the listener worker, and answers ``MAGIC + the fresh worker's address`` tagged ``REPLY_TAG``; the client
  connects its worker to that address. The data endpoints have peer-failure handling off by default (with it
  on, UCX drops the shared-memory transports: ~0.7 GB/s here); the monitor reports the peer's death. Pass
  ``error_handling=True`` to both ends to keep peer-failure handling on the data endpoints too.

When the peer closes or dies the connection drains what already arrived, then fails with
:class:`~dissoc.errors.TransportError`.

**Receiving.** A tagged message is received by probe, through libucp itself (``ucp_tag_probe_nb``, then
``ucp_tag_msg_recv_nbx`` into the buffer's address; no ucxx object per message): for each waiting
``recv_tagged(tag, mask)`` (oldest first) the worker is probed with that tag and mask; the probe gives the
message's tag and length before any payload is placed, so the lander (:meth:`Connection.set_lander`: the
client's session puts a packed body after room for its framing, in a slab) or else the allocator
(:meth:`Connection.set_allocator`) provides the buffer (host, or device memory by its
``__cuda_array_interface__`` address), and ``max_message_bytes`` is checked before either is called. An eager
message that arrived whole is received at once.
Messages nobody waits for are taken (in arrival order, probing with mask 0) while the buffering budget allows;
the rest stay in UCX (large ones as a rendezvous announcement only, so the sender waits: UCX's own flow
control). Active messages are received as they arrive, by :class:`~dissoc.transport.ucx.am.AmReceiver` (their
size is checked before anything is allocated), and handed to the inbox in order while reading is admitted.

**Closing** (:meth:`UcxConnection._release`): endpoints with peer-failure handling (the listener path) are
closed forcefully; the same-host path's data endpoints first have an exchange: each side sends ``BYE_TAG`` as
its last message, then takes and drops what the other still sends until the other's ``BYE_TAG`` (so every
send under way completes on both sides), then closes; a peer known dead is closed forcefully, and a send UCX
never completes is given up with the worker. A UCX request that never completes, or a receive left in
ucxx's queues, would hold its endpoint and worker for the life of the process; hence dissoc's own endpoints
for accepted connections and its own active-message receiving.

**Sending.** One UCX message per message: a single buffer is sent as is (held until UCX completes the send);
a list of buffers is first gathered into one (a copy). ``send_many`` (and so ``send``/``send_tagged``)
returns once its messages are posted while the connection's sends under way stay within
``SEND_WINDOW_BYTES``/``SEND_WINDOW`` (4 MiB, 512 messages; beyond, it waits for the oldest): the sender
goes on to its next messages while UCX moves these. A send that fails fails the connection; closing waits
(up to a bound) for the sends under way.

**Progress.** No thread and no busy loop: each worker runs in blocking mode, its epoll descriptor is watched
by the event loop (``add_reader``); on activity the worker is progressed, requests are completed and probes
are run, then the worker is armed again. While requests are outstanding a 0.5 s timer also progresses it, as
a guard against a missed wake-up. An idle connection costs no CPU.

**Workers.** A listener keeps one worker made ahead for its next connection on each path
(``listener.SPARE_WORKERS``): making one takes about 10 ms, which the connection then does not wait for.

**Environment.** ucxx is imported lazily, by the first ``serve_ucx``/``connect_ucx`` call, never by importing
this package, and the environment is left as it was: importing ucxx sets, when unset, ``UCX_MEMTYPE_CACHE=n``,
``UCX_RNDV_THRESH=8192``, ``UCX_RNDV_FRAG_MEM_TYPE=cuda`` and ``UCX_MAX_RNDV_RAILS=1`` (ucxx's own choices);
they are taken back out of ``os.environ`` at once and passed to dissoc's UCX context as its configuration
instead (``UCX_*`` variables the user set still win).

**Per-message calls.** Probes, receives, sends, request tests and the active-message handler go through
:mod:`~dissoc.transport.ucx.calls`: the package's small C module where it was built with dissoc (arguments
straight from Python ints, eager active messages queued as bytes by a C handler), ctypes otherwise
(``DISSOC_UCX_NATIVE=0`` forces it); the same calls either way.

**Modules.** :mod:`~dissoc.transport.ucx.library` (ucxx, loaded lazily, and the UCX context),
:mod:`~dissoc.transport.ucx.libucp` (libucp's C API through ctypes),
:mod:`~dissoc.transport.ucx.calls` (the per-message calls, through ``_fast.c`` or ctypes),
:mod:`~dissoc.transport.ucx.am` (receiving active messages),
:mod:`~dissoc.transport.ucx.endpoint` (endpoints of accepted connections),
:mod:`~dissoc.transport.ucx.peer_info` (ucxx's peer-information exchange),
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
