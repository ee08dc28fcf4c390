"""Where address/length pairs (body type 1) point, seen from both ends.

Server side, :class:`ServedArena`: the memory arena the data server places batch buffers in, and what its
data URI publishes about it (``memory``, ``remote_handle`` and, for UCX, where to reach the arena).

* ``memory=shm``: a POSIX shared-memory arena; ``remote_handle`` is its name; pairs carry offsets.
* ``memory=ucx``: the same kind of arena, registered with UCX (``ucp_mem_map``); ``remote_handle`` is the
  packed remote key; pairs carry offsets from the registered base. The URI also carries ``rma_worker`` (the
  base64 UCX address of the worker the region was registered with, which the client connects an RMA endpoint
  to), ``rma_base`` and ``rma_length`` (the region, so that the client can bound every read).

Client side, :func:`open_pair_reader` gives a :class:`PairReader` for a data URI: ``read(pairs)`` returns
one ``pa.Buffer`` (or None when empty) per pair and tells which offsets may be freed now; zero-copy readers
return buffers that free their ranges when the last of them is released (``on_release``).
"""

from __future__ import annotations

import base64
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from dissoc.errors import DissocError, ProtocolError
from dissoc.memory.shm import ShmArena, ShmView, cleanup_stale
from dissoc.protocol import PairList
from dissoc.uri import DissocURI

__all__ = ["PairReader", "ServedArena", "open_pair_reader"]

log = logging.getLogger(__name__)

MEMORY_KINDS = ("shm", "ucx")


class ServedArena:
    """The arena a data server places pair-list bodies in, and what its URI says about it."""

    def __init__(self, memory: str, capacity: int) -> None:
        if memory not in MEMORY_KINDS:
            raise DissocError(
                f"memory: expected one of {', '.join(MEMORY_KINDS)} for pairs, got {memory!r}"
                + (" (device memory comes with the GPU path)" if memory == "cuda" else "")
            )
        self.memory = memory
        cleanup_stale()
        self.arena = ShmArena.create(capacity)
        self._rma: Any = None
        self._registration: Any = None
        self.params: dict[str, str] = {}
        if memory == "ucx":
            try:
                self._register()
            except BaseException:
                self.close()
                raise

    def _register(self) -> None:
        from dissoc.memory.ucx_rma import RmaContext

        self._rma = RmaContext()
        self._registration = self._rma.register(self.arena.buffer)
        # Reads through emulated transports (across hosts without RDMA) need this side to make progress.
        self._rma.start_progress_thread(idle_sleep_s=0.002)
        reg = self._registration
        self.params = {
            "rma_worker": base64.b64encode(self._rma.worker_address()).decode("ascii"),
            "rma_base": str(reg.address),
            "rma_length": str(reg.length),
        }

    @property
    def remote_handle(self) -> bytes:
        """What the URI's ``remote_handle`` carries: the segment's name, or the packed UCX remote key."""
        if self.memory == "ucx":
            return bytes(self._registration.rkey)
        return self.arena.handle

    def close(self) -> None:
        """Unregister, stop, and unlink the segment."""
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        if self._rma is not None:
            self._rma.close()
            self._rma = None
        self.arena.close()


# ------------------------------------------------------------------------------------------------ client


class PairReader:
    """Turns a pair list into buffers. ``read`` returns (buffers, offsets to free now)."""

    zero_copy = False

    def read(self, pairs: PairList) -> tuple[list[pa.Buffer | None], list[int]]:
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the reader holds (zero-copy buffers already handed out stay valid)."""


class _ShmCopy(PairReader):
    def __init__(self, view: ShmView) -> None:
        self.view = view

    def read(self, pairs: PairList) -> tuple[list[pa.Buffer | None], list[int]]:
        views = self.view.buffers(pairs)
        # Copy mode: the batch owns private memory, so every range can be freed at once.
        out: list[pa.Buffer | None] = [None if v.size == 0 else pa.py_buffer(v.to_pybytes()) for v in views]
        return out, [int(a) for a, n in pairs.pairs.tolist() if n]

    def close(self) -> None:
        self.view.close()


class _Lease:
    """Owned by every buffer of one zero-copy batch; when the last buffer goes, its ranges are freed."""

    __slots__ = ("__weakref__",)


class _ShmZeroCopy(PairReader):
    """Buffers over the read-only mapping itself; a batch's ranges are freed when it is released."""

    zero_copy = True

    def __init__(self, view: ShmView, on_release: Callable[[list[int]], None]) -> None:
        self.view = view
        self.on_release = on_release
        self._lock = threading.Lock()
        self.outstanding = 0
        self.idle = threading.Event()
        self.idle.set()

    def read(self, pairs: PairList) -> tuple[list[pa.Buffer | None], list[int]]:
        views = self.view.buffers(pairs)
        offsets = [int(a) for a, n in pairs.pairs.tolist() if n]
        if not offsets:
            return [None] * len(views), []
        lease = _Lease()
        out: list[pa.Buffer | None] = [
            None if v.size == 0 else pa.foreign_buffer(v.address, v.size, base=(lease, v)) for v in views
        ]
        with self._lock:
            self.outstanding += 1
            self.idle.clear()
        weakref.finalize(lease, self._released, offsets)
        return out, []

    def _released(self, offsets: list[int]) -> None:
        # Runs in whichever thread dropped the batch's last buffer.
        try:
            self.on_release(offsets)
        except Exception:  # a finalizer must not raise
            log.debug("handing back %d ranges failed", len(offsets), exc_info=True)
        with self._lock:
            self.outstanding -= 1
            if self.outstanding == 0:
                self.idle.set()

    def close(self) -> None:
        # The mapping stays until the last zero-copy buffer goes (each keeps a slice of it).
        self.view.close()


_client_rma: Any = None
_client_rma_lock = threading.Lock()
_endpoints: dict[bytes, Any] = {}


def _rma_endpoint(worker: bytes) -> Any:
    """This process's RMA context (one, made on first use) and its endpoint to ``worker``."""
    global _client_rma
    from dissoc.memory.ucx_rma import RmaContext

    with _client_rma_lock:
        if _client_rma is None or _client_rma.closed:
            _client_rma = RmaContext()
            _endpoints.clear()
        ep = _endpoints.get(worker)
        if ep is None or ep.closed:
            ep = _endpoints[worker] = _client_rma.connect(worker)
        return ep


class _UcxGet(PairReader):
    """Reads every listed range with one-sided UCX GETs into a private buffer, then frees at once."""

    def __init__(self, uri: DissocURI, timeout: float) -> None:
        params = uri.params
        try:
            worker = base64.b64decode(params["rma_worker"], validate=True)
            self.base = int(params["rma_base"])
            self.length = int(params["rma_length"])
        except (KeyError, ValueError) as e:
            raise ProtocolError(
                f"data URI: memory=ucx needs rma_worker (base64), rma_base and rma_length, got {params}: {e}"
            ) from None
        if self.base < 0 or self.length <= 0 or self.base + self.length > 1 << 64:
            raise ProtocolError(f"data URI: expected a valid remote region, got {self.base:#x}+{self.length}")
        assert uri.remote_handle is not None
        self.timeout = timeout
        self.rkey = _rma_endpoint(worker).unpack(uri.remote_handle, self.base, self.length)

    def read(self, pairs: PairList) -> tuple[list[pa.Buffer | None], list[int]]:
        from dissoc.memory.ucx_rma import wait_all

        rows = pairs.pairs.tolist()
        sizes = [(n + 63) & ~63 for _, n in rows]
        total = sum(sizes)
        dest = np.empty(max(total, 1), dtype=np.uint8)
        requests = []
        out: list[pa.Buffer | None] = []
        at = 0
        whole = pa.py_buffer(dest)
        for (offset, n), size in zip(rows, sizes, strict=True):
            if n == 0:
                out.append(None)
                continue
            if offset < 0 or offset + n > self.length:
                raise ProtocolError(
                    f"pairs: expected ranges inside the {self.length}-byte remote region, "
                    f"got offset {offset} length {n}"
                )
            requests.append(self.rkey.get_nb(self.base + offset, dest[at : at + n]))
            out.append(whole.slice(at, n))
            at += size
        wait_all(requests, timeout=self.timeout)
        return out, [int(a) for a, n in rows if n]

    def close(self) -> None:
        self.rkey.close()


def open_pair_reader(
    uri: DissocURI, *, zero_copy: bool, on_release: Callable[[list[int]], None], timeout: float
) -> PairReader:
    """The reader for a data URI that announces pair-list bodies (``memory=shm`` or ``memory=ucx``)."""
    if uri.remote_handle is None or uri.free_data is None:
        raise ProtocolError(f"data URI: memory={uri.memory!r} needs remote_handle and free_data, got {uri}")
    if uri.memory == "shm":
        view = ShmView.attach(uri.remote_handle)
        return _ShmZeroCopy(view, on_release) if zero_copy else _ShmCopy(view)
    if uri.memory == "ucx":
        return _UcxGet(uri, timeout)
    raise ProtocolError(
        f"data URI: pairs in memory={uri.memory!r} cannot be read here (this client reads shm and ucx)"
    )
