"""Where address/length pairs (body type 1) point, seen from both ends.

Server side, :class:`ServedArena`: the memory arena the data server places batch buffers in, and what its
data URI publishes about it (``memory``, ``remote_handle`` and, for UCX, where to reach the arena).

* ``memory=shm``: a POSIX shared-memory arena; ``remote_handle`` is its name; pairs carry offsets.
* ``memory=ucx``: the same kind of arena, registered with UCX (``ucp_mem_map``); ``remote_handle`` is the
  packed remote key; pairs carry offsets from the registered base. The URI also carries ``rma_worker`` (the
  base64 UCX address of the worker the region was registered with, which the client connects an RMA endpoint
  to), ``rma_base`` and ``rma_length`` (the region, so that the client can bound every read).
* ``memory=cuda``: one dedicated device allocation (:class:`~dissoc.memory.cuda_arena.DeviceArena`);
  ``remote_handle`` is its 64-byte CUDA IPC memory handle; pairs carry offsets from its base. The URI also
  carries ``cuda_length``, the allocation's size, so that the client can bound every read.

Client side, :func:`open_pair_reader` gives a :class:`PairReader` for a data URI: ``read(pairs)`` returns
one ``pa.Buffer`` (or None when empty) per pair and tells which offsets may be freed now; zero-copy readers
return buffers that free their ranges when the last of them is released (``on_release``).
``read_device(pairs)`` is the same with device arrays (the device landing): for ``memory=cuda`` views over
the mapped allocation (zero-copy) or device-to-device copies; for ``shm`` and ``ucx``, host reads uploaded
to the device. A ``memory=cuda`` reader maps the IPC handle when it is made (one reader per stream), or
takes the mapping an earlier stream left (:mod:`dissoc.memory.mappings`: kept per process while in use and
for a while after).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from dissoc.buffers import DEFAULT_POOL
from dissoc.errors import DissocError, ProtocolError, ResourceError
from dissoc.memory.cuda import IPC_HANDLE_BYTES, DeviceAllocation, DeviceBackend, get_backend
from dissoc.memory.mappings import MAPPINGS
from dissoc.memory.shm import ShmArena, ShmView, cleanup_stale
from dissoc.protocol import PairList
from dissoc.uri import DissocURI

__all__ = ["MEMORY_KINDS", "PairReader", "ServedArena", "cuda_region", "open_pair_reader"]

log = logging.getLogger(__name__)

MEMORY_KINDS = ("shm", "ucx", "cuda")


class ServedArena:
    """The arena a data server places pair-list bodies in, and what its URI says about it.

    ``memory`` is ``shm``, ``ucx`` or ``cuda``; ``arena`` is a :class:`~dissoc.memory.shm.ShmArena` for the
    first two and a :class:`~dissoc.memory.cuda_arena.DeviceArena` for ``cuda`` (same allocator API);
    ``params`` are the extra data-URI parameters (``rma_*`` for ucx, ``cuda_length`` for cuda). Asking for
    ``cuda`` where there is no device raises :class:`~dissoc.errors.ResourceError` naming the ``gpu`` extra.

    ``rma``: for ``ucx``, an :class:`~dissoc.memory.ucx_rma.RmaContext` to register the region with (its
    owner closes it; by default the arena makes and closes its own). ``sweep``: unlink the segments of dead
    dissoc processes first (:func:`~dissoc.memory.shm.cleanup_stale`; the private arenas of
    :mod:`dissoc.memory.private` sweep once per server instead of once per arena).
    """

    def __init__(self, memory: str, capacity: int, *, rma: Any = None, sweep: bool = True) -> None:
        if memory not in MEMORY_KINDS:
            raise DissocError(f"memory: expected one of {', '.join(MEMORY_KINDS)} for pairs, got {memory!r}")
        self.memory = memory
        self._rma: Any = None
        # a context owned by someone else (private arenas share one): not closed here
        self._shared_rma: Any = rma
        self._registration: Any = None
        self.params: dict[str, str] = {}
        self.arena: Any
        if memory == "cuda":
            from dissoc.memory.cuda_arena import DeviceArena

            try:
                self.arena = DeviceArena.create(capacity)
            except ResourceError as e:
                raise ResourceError(f"memory=cuda: {e}") from e
            self.params = {"cuda_length": str(self.arena.capacity)}
            return
        if sweep:
            cleanup_stale()
        self.arena = ShmArena.create(capacity)
        if memory == "ucx":
            try:
                self._register()
            except BaseException:
                self.close()
                raise

    def _register(self) -> None:
        from dissoc.memory.ucx_rma import RmaContext

        context = self._shared_rma
        if context is None:
            context = self._rma = RmaContext()
        self._registration = context.register(self.arena.buffer)
        # Reads through emulated transports (across hosts without RDMA) need this side to make progress.
        context.start_progress_thread(idle_sleep_s=0.002)
        reg = self._registration
        self.params = {
            "rma_worker": base64.b64encode(context.worker_address()).decode("ascii"),
            "rma_base": str(reg.address),
            "rma_length": str(reg.length),
        }

    @property
    def remote_handle(self) -> bytes:
        """What the URI's ``remote_handle`` carries: the segment's name, the packed UCX remote key, or the
        64-byte CUDA IPC handle of the device arena."""
        if self.memory == "ucx":
            return bytes(self._registration.rkey)
        return bytes(self.arena.handle)

    def close(self) -> None:
        """Unregister, stop, and unlink the segment (or free the device allocation)."""
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        if self._rma is not None:
            self._rma.close()
            self._rma = None
        self.arena.close()


# ------------------------------------------------------------------------------------------------ client


class PairReader:
    """Turns a pair list into buffers. ``read`` returns (buffers, offsets to free now).

    Offsets not returned as free-now are handed to the reader's ``on_release`` callback when the zero-copy
    buffers (or device arrays) over them are released; every listed offset is reported exactly once, by one
    or the other.
    """

    zero_copy = False

    def read(self, pairs: PairList) -> tuple[list[pa.Buffer | None], list[int]]:
        """One host buffer per pair (None for an empty one), and the offsets that may be freed now."""
        raise NotImplementedError

    def read_device(self, pairs: PairList) -> tuple[list[Any | None], list[int]]:
        """One uint8 device array per pair (None for an empty one), and the offsets that may be freed now.

        This default reads the host buffers with :meth:`read` and uploads them to the device of
        :func:`~dissoc.memory.cuda.get_backend` (for pairs in host memory: ``shm``, ``ucx``); a zero-copy
        reader's ranges are then handed to ``on_release`` as soon as the host buffers are dropped, after the
        upload. Raises :class:`~dissoc.errors.ResourceError` (naming the ``gpu`` extra) without a device.
        """
        backend = get_backend()
        buffers, done = self.read(pairs)
        out = [None if b is None else backend.upload(b) for b in buffers]
        backend.synchronize()
        return out, done

    def close(self) -> None:
        """Let go of what the reader holds (zero-copy buffers already handed out stay valid)."""

    def forget(self) -> None:
        """The stream failed: what the reader keeps for later streams (a mapping) goes when it closes."""


class _ShmCopy(PairReader):
    def __init__(self, view: ShmView) -> None:
        self.view = view

    def read(self, pairs: PairList) -> tuple[list[pa.Buffer | None], list[int]]:
        # buffers() compares the batch's ranges with the segment's current size first (one fstat): a segment
        # that shrank under us is a TransportError, not SIGBUS. A truncation racing between that check and
        # the copy below is not covered.
        views = self.view.buffers(pairs)
        # Copy mode: the batch owns private memory, so every range can be freed at once. One pooled buffer per
        # batch (memory of released batches is reused: fresh pages would cost more than the copy).
        sizes = [(v.size + 63) & ~63 for v in views]
        dest = DEFAULT_POOL.allocate(max(sum(sizes), 1))
        whole = pa.py_buffer(dest)
        out: list[pa.Buffer | None] = []
        at = 0
        for v, size in zip(views, sizes, strict=True):
            if v.size == 0:
                out.append(None)
                continue
            np.copyto(dest[at : at + v.size], np.frombuffer(v, np.uint8))
            out.append(whole.slice(at, v.size))
            at += size
        return out, [int(a) for a, n in pairs.pairs.tolist() if n]

    def close(self) -> None:
        self.view.close()


class _Lease:
    """Owned by every buffer of one zero-copy batch; when the last buffer goes, its ranges are freed."""

    __slots__ = ("__weakref__",)


class _Leasing(PairReader):
    """Bookkeeping of a reader whose batches lie in the server's memory: each batch holds a lease, and the
    lease's end hands the batch's ranges to ``on_release``. ``outstanding`` counts live leases; ``idle`` is
    set when there are none (the client keeps its data connection until then)."""

    def __init__(self, on_release: Callable[[list[int]], None]) -> None:
        self.on_release = on_release
        self._lock = threading.Lock()
        self._closed = False
        self.outstanding = 0
        #: The live leases' weak references, with the ranges each frees when its batch goes.
        self._leases: dict[weakref.ref[object], list[int]] = {}
        self.idle = threading.Event()
        self.idle.set()
        #: Called (in the releasing thread) once the last live batch was released, after ``on_release``.
        self.on_idle: Callable[[], None] | None = None

    def _lease(self, lease: object, offsets: list[int]) -> None:
        """Count ``lease`` (refused once closed) and free ``offsets`` when it goes, exactly once."""
        with self._lock:  # counted before close() can look: the memory stays while the batch lives
            if self._closed:
                raise ResourceError("pair reader: expected an open reader, got a closed one")
            self.outstanding += 1
            self.idle.clear()
        # (a weak reference with a callback, kept until it fires: a batch's lease costs less than a finalizer)
        self._leases[weakref.ref(lease, self._gone)] = offsets

    def _gone(self, ref: weakref.ref[object]) -> None:
        offsets = self._leases.pop(ref, None)
        if offsets is not None:
            self._released(offsets)

    def _released(self, offsets: list[int]) -> None:
        # Runs in whichever thread dropped the batch's last buffer.
        try:
            self.on_release(offsets)
        except Exception:  # a finalizer must not raise
            log.debug("handing back %d ranges failed", len(offsets), exc_info=True)
        with self._lock:
            self.outstanding -= 1
            last = self.outstanding == 0
            if last:
                self.idle.set()
            unmap = last and self._closed
        if last and self.on_idle is not None:
            try:
                self.on_idle()
            except Exception:  # a finalizer must not raise
                log.debug("telling the stream its last batch went failed", exc_info=True)
        if unmap:
            self._last_released()

    def _last_released(self) -> None:
        """The reader was closed and its last lease has gone."""


class _ShmZeroCopy(_Leasing):
    """Buffers over the read-only mapping itself; a batch's ranges are freed when it is released."""

    zero_copy = True

    def __init__(self, view: ShmView, on_release: Callable[[list[int]], None]) -> None:
        super().__init__(on_release)
        self.view = view

    def read(self, pairs: PairList) -> tuple[list[pa.Buffer | None], list[int]]:
        # Checked against the segment's current size before the buffers are handed out (one fstat per
        # batch); a truncation after that (racing with the check, or while the batch is in use) is not
        # covered.
        views = self.view.buffers(pairs)
        offsets = [int(a) for a, n in pairs.pairs.tolist() if n]
        if not offsets:
            return [None] * len(views), []
        lease = _Lease()
        out: list[pa.Buffer | None] = [
            None if v.size == 0 else pa.foreign_buffer(v.address, v.size, base=(lease, v)) for v in views
        ]
        self._lease(lease, offsets)
        return out, []

    def close(self) -> None:
        # The mapping stays until the last zero-copy buffer goes (each keeps a slice of it).
        self.view.close()


_client_rma: Any = None
_client_rma_lock = threading.Lock()
#: This process's RMA endpoints by the server worker they reach, least recently used first.
_endpoints: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
#: RMA endpoints kept (one per server arena's worker); the least recently used beyond this is closed.
MAX_RMA_PEERS = 32


def _rma_endpoint(worker: bytes) -> Any:
    """This process's RMA context (one, made on first use) and its endpoint to ``worker``, kept for the
    next stream (at most :data:`MAX_RMA_PEERS` of them)."""
    global _client_rma
    from dissoc.memory.ucx_rma import RmaContext

    with _client_rma_lock:
        if _client_rma is None or _client_rma.closed:
            _client_rma = RmaContext()
            _endpoints.clear()
        ep = _endpoints.get(worker)
        if ep is None or ep.closed:
            ep = _endpoints[worker] = _client_rma.connect(worker)
        _endpoints.move_to_end(worker)
        while len(_endpoints) > MAX_RMA_PEERS:
            _, oldest = _endpoints.popitem(last=False)
            with contextlib.suppress(DissocError):
                oldest.close()
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
        dest = DEFAULT_POOL.allocate(max(total, 1))
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


_U63_MAX = (1 << 63) - 1


def cuda_region(uri: DissocURI) -> tuple[bytes, int]:
    """The (IPC handle, length) a ``memory=cuda`` data URI announces, checked; :class:`ProtocolError` if the
    ``remote_handle`` is not :data:`~dissoc.memory.cuda.IPC_HANDLE_BYTES` bytes or ``cuda_length`` is not
    a positive decimal integer."""
    handle = uri.remote_handle
    if handle is None or len(handle) != IPC_HANDLE_BYTES:
        got = "none" if handle is None else f"{len(handle)} bytes"
        raise ProtocolError(
            f"data URI: memory=cuda needs a {IPC_HANDLE_BYTES}-byte CUDA IPC handle as remote_handle, "
            f"got {got}"
        )
    text = uri.params.get("cuda_length")
    if (
        text is None
        or not 0 < len(text) <= 20
        or not text.isascii()
        or not text.isdigit()
        or not 0 < int(text) <= _U63_MAX
    ):
        raise ProtocolError(
            f"data URI: memory=cuda needs cuda_length (the allocation's size in bytes, a positive decimal "
            f"integer), got {text!r}"
        )
    return handle, int(text)


class _DeviceLease:
    """Owned by every device array of one zero-copy batch (and keeping the mapping): when the last array
    goes, the batch's ranges are freed."""

    __slots__ = ("__weakref__", "allocation")

    def __init__(self, allocation: DeviceAllocation) -> None:
        self.allocation = allocation


class _CudaReader(_Leasing):
    """Pairs in another process's device allocation, mapped once from its IPC handle.

    Host landing (:meth:`read`) copies each range device-to-host and frees at once. Device landing
    (:meth:`read_device`) gives views over the mapping (``zero_copy``: freed when the batch's last view is
    released) or device-to-device copies (freed at once). :meth:`close` unmaps, or, while zero-copy views are
    alive, leaves that to the release of the last of them.
    """

    def __init__(
        self,
        uri: DissocURI,
        *,
        zero_copy: bool,
        on_release: Callable[[list[int]], None],
        backend: DeviceBackend | None = None,
    ) -> None:
        handle, self.length = cuda_region(uri)
        self.backend = get_backend() if backend is None else backend
        super().__init__(on_release)
        self.zero_copy = zero_copy
        self._handle = handle
        self._forget = False
        # Kept mapped between streams (see dissoc.memory.mappings): mapping costs milliseconds.
        self._allocation: DeviceAllocation | None = MAPPINGS.acquire(self.backend, handle, self.length)

    def _checked(self, pairs: PairList) -> tuple[DeviceAllocation, tuple[int, ...]]:
        """The mapping and the pairs flattened (:meth:`~dissoc.protocol.PairList.flat`), every non-empty one
        checked against ``cuda_length``."""
        flat = pairs.flat()
        length = self.length
        for i in range(0, len(flat), 2):
            offset, n = flat[i], flat[i + 1]
            if n and (offset < 0 or offset + n > length):
                raise ProtocolError(
                    f"pairs: expected ranges inside the {length}-byte device allocation, "
                    f"got offset {offset} length {n}"
                )
        allocation = self._allocation
        if self._closed or allocation is None:
            raise ResourceError("device pair reader: expected an open reader, got a closed one")
        return allocation, flat

    def _rows(self, pairs: PairList) -> tuple[DeviceAllocation, list[tuple[int, int]]]:
        """The mapping and the pairs, every non-empty one checked against ``cuda_length``."""
        allocation, flat = self._checked(pairs)
        return allocation, list(zip(flat[::2], flat[1::2], strict=True))

    def _in_place(self, flat: tuple[int, ...], at: Sequence[int], body_length: int) -> int | None:
        """Where the batch's body starts in the mapping when its ranges (``flat``, checked) lie exactly as the
        IPC body lays out its buffers (``at``: each buffer's offset in the body, as the metadata says), as a
        server places a device body whole (:class:`~dissoc.memory.arena.Body`); else None (also when every
        range is empty)."""
        base: int | None = None
        for i, dest in enumerate(at):
            if flat[2 * i + 1]:
                delta = flat[2 * i] - dest
                if base is None:
                    base = delta
                elif delta != base:
                    return None
        if base is None or base < 0 or base + body_length > self.length:
            return None
        return base

    def read(self, pairs: PairList) -> tuple[list[pa.Buffer | None], list[int]]:
        allocation, rows = self._rows(pairs)
        sizes = [(n + 63) & ~63 for _, n in rows]
        whole = pa.allocate_buffer(sum(sizes))  # 64-byte aligned, like Arrow's own buffers
        dest = np.frombuffer(whole, dtype=np.uint8)
        out: list[pa.Buffer | None] = []
        at = 0
        for (offset, n), size in zip(rows, sizes, strict=True):
            if n == 0:
                out.append(None)
                continue
            self.backend.download(self.backend.view(allocation, offset, n), out=dest[at : at + n])
            out.append(whole.slice(at, n))
            at += size
        # download waits for each copy: the ranges can go back now
        return out, [offset for offset, n in rows if n]

    def read_device(self, pairs: PairList) -> tuple[list[Any | None], list[int]]:
        allocation, rows = self._rows(pairs)
        offsets = [offset for offset, n in rows if n]
        if not offsets:
            return [None] * len(rows), []
        backend = self.backend
        if self.zero_copy:
            lease = _DeviceLease(allocation)
            self._lease(lease, offsets)  # from here on, the ranges go back exactly once
            views = [
                None if n == 0 else backend.view(allocation, offset, n, owner=lease) for offset, n in rows
            ]
            return views, []
        sizes = [(n + 63) & ~63 for _, n in rows]
        dest = backend.empty(sum(sizes))
        out: list[Any | None] = []
        at = 0
        for (offset, n), size in zip(rows, sizes, strict=True):
            if n == 0:
                out.append(None)
                continue
            target = dest[at : at + n]
            backend.copy(target, backend.view(allocation, offset, n))
            out.append(target)
            at += size
        backend.synchronize()  # the copies must be done before the server may reuse the ranges
        return out, offsets

    def gather_into(self, pairs: PairList, body: Any, at: Sequence[int]) -> list[int]:
        """Copy the batch device-to-device into ``body``, laid out as its IPC body (``at``: each buffer's
        offset in it, one per pair): one copy of the whole body when the ranges lie that way in the mapping,
        else one per range; waits for the copies and returns the offsets, all free now."""
        allocation, flat = self._checked(pairs)
        if len(at) * 2 != len(flat):
            raise ProtocolError(f"pairs: expected {len(at)} pairs, got {len(flat) // 2}")
        backend = self.backend
        offsets = [flat[i] for i in range(0, len(flat), 2) if flat[i + 1]]
        size = int(body.nbytes)
        base = self._in_place(flat, at, size)
        if base is not None:
            backend.copy(body, backend.view(allocation, base, size))
        else:
            for i, dest in enumerate(at):
                offset, n = flat[2 * i], flat[2 * i + 1]
                if n:
                    backend.copy(body[dest : dest + n], backend.view(allocation, offset, n))
        backend.synchronize()
        return offsets

    def device_body(self, pairs: PairList, at: Sequence[int], body_length: int) -> Any | None:
        """Zero-copy device landing of a batch whose ranges lie as its IPC body lays out its buffers (``at``:
        each buffer's offset in the body): one view of ``body_length`` bytes over the mapping, in which the
        metadata's offsets hold as they are; the ranges are freed (``on_release``) when the last view over it
        is released. None when the ranges lie otherwise (see :meth:`device_span`) or are all empty."""
        allocation, flat = self._checked(pairs)
        if len(at) * 2 != len(flat):
            return None
        base = self._in_place(flat, at, body_length)
        if base is None:
            return None
        lease = _DeviceLease(allocation)
        self._lease(lease, [flat[i] for i in range(0, len(flat), 2) if flat[i + 1]])
        return self.backend.view(allocation, base, body_length, owner=lease)

    def device_span(self, pairs: PairList) -> tuple[Any | None, int, int]:
        """Zero-copy device landing of a whole batch: one view over the mapping from the batch's first range
        to the end of its last, and those two offsets; the batch's ranges are freed (``on_release``) when
        the last view over it is released. ``(None, 0, 0)`` when every range is empty (nothing to free)."""
        allocation, rows = self._rows(pairs)
        offsets = [offset for offset, n in rows if n]
        if not offsets:
            return None, 0, 0
        low = min(offsets)
        high = max(offset + n for offset, n in rows if n)
        lease = _DeviceLease(allocation)
        self._lease(lease, offsets)
        return self.backend.view(allocation, low, high - low, owner=lease), low, high

    def _last_released(self) -> None:
        self._unmap()

    def _unmap(self) -> None:
        with self._lock:
            allocation, self._allocation = self._allocation, None
        if allocation is not None:
            MAPPINGS.release(self.backend, self._handle, self.length, forget=self._forget)

    def forget(self) -> None:
        self._forget = True

    def close(self) -> None:
        """Stop reading; unmap the allocation now, or when the last zero-copy view still alive is released."""
        with self._lock:
            self._closed = True
            busy = self.outstanding > 0
        if not busy:
            self._unmap()


def open_pair_reader(
    uri: DissocURI, *, zero_copy: bool, on_release: Callable[[list[int]], None], timeout: float
) -> PairReader:
    """The reader for a data URI that announces pair-list bodies (``memory=shm``, ``ucx`` or ``cuda``).

    ``zero_copy``: batches over the server's memory itself where that memory can be mapped (``shm``; device
    landing of ``cuda``), their ranges handed to ``on_release`` when released. ``memory=cuda`` maps the IPC
    handle here, once: :class:`~dissoc.errors.ProtocolError` for a handle that is not 64 bytes or a missing
    ``cuda_length``, :class:`~dissoc.errors.ResourceError` without a device or when the handle cannot be
    opened.
    """
    if uri.remote_handle is None or uri.free_data is None:
        raise ProtocolError(f"data URI: memory={uri.memory!r} needs remote_handle and free_data, got {uri}")
    if uri.memory == "shm":
        view = ShmView.attach(uri.remote_handle)
        return _ShmZeroCopy(view, on_release) if zero_copy else _ShmCopy(view)
    if uri.memory == "ucx":
        return _UcxGet(uri, timeout)
    if uri.memory == "cuda":
        return _CudaReader(uri, zero_copy=zero_copy, on_release=on_release)
    raise ProtocolError(
        f"data URI: pairs in memory={uri.memory!r} cannot be read here (this client reads shm, ucx and cuda)"
    )
