"""Client side of ``ClientOptions(landing="device")``: every body ends up in device memory as a DeviceBatch.

Where the body arrives decides how it gets to the device, never what the consumer sees:

* **packed, received into device memory** (UCX with CuPy: the data connection's allocator hands UCX device
  buffers for body messages, and UCX's CUDA transports fill them): decoded where it lies;
* **packed, received into host memory** (TCP, or no CUDA-capable transport): one upload of the whole body;
* **pairs in device memory** (``memory=cuda``): zero-copy, a view over the server's mapped allocation; the
  view's release frees the batch's ranges. A server places a device body whole, its buffers where the IPC
  body has them, so the view is the body and the metadata holds as it is; ranges that lie otherwise get a
  view from the batch's first range to the end of its last, with the metadata's buffer offsets rewritten to
  point into it. Without zero-copy, one device-to-device copy of the whole body (one per range when they lie
  otherwise) into a body of the client's own, and the ranges are freed at once;
* **pairs in host memory** (``shm``, ``ucx``): the ranges are read on the host, gathered as the metadata lays
  them out, and uploaded once.

Each call notes the way its body took in :attr:`DeviceLanding.way` (:data:`RECEIVED`, :data:`HOST_COPY`,
:data:`CUDA_IPC_VIEW`, :data:`CUDA_IPC_COPY`, in the order of the list above; empty for a message without a
body): what the client reports as the stream's path (``FetchPath.device_landing``), and what it warns about,
or refuses with ``ClientOptions(require_device_path=True)``, when it is :data:`HOST_COPY`.

Compressed bodies cannot land on the device (:class:`~dissoc.errors.CodecError`): ask the server for
uncompressed ones, or land on the host.

**Validation.** With ``validate`` (the default, as for host batches), a stream whose schema has contents to
check (offsets, views, union ids, dictionary indices, run ends) is mirrored through the host decoder: each of
its bodies is copied to the host once and checked there, and a bad one raises
:class:`~dissoc.errors.CodecError` before its batch is handed out. Streams of fixed-width columns only need
no such copy (the metadata's sizes, always checked, are enough). ``ClientOptions(validate=False)`` turns the
mirror off for trusted servers.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

from dissoc.buffers import device_nbytes
from dissoc.codec import MessageDecoder, parse
from dissoc.codec.message import HeaderType, encode_dictionary_batch, encode_record_batch
from dissoc.device import DeviceBatch, DeviceDecoder
from dissoc.errors import CodecError, ProtocolError
from dissoc.memory.cuda import DeviceBackend, get_backend
from dissoc.memory.pairs import PairReader
from dissoc.protocol import PairList

__all__ = ["CUDA_IPC_COPY", "CUDA_IPC_VIEW", "HOST_COPY", "RECEIVED", "WAYS", "DeviceLanding"]

log = logging.getLogger(__name__)

#: A packed body received into device memory by the transport (UCX's CUDA transports).
RECEIVED = "received"
#: A body that was in host memory (packed over TCP or into host buffers, pairs in ``shm`` or ``ucx`` memory),
#: uploaded: the path through the host.
HOST_COPY = "host-copy"
#: ``memory=cuda`` pairs read zero-copy: a view over the server's allocation, mapped through CUDA IPC.
CUDA_IPC_VIEW = "cuda-ipc-view"
#: ``memory=cuda`` pairs copied device to device from the server's allocation, mapped through CUDA IPC.
CUDA_IPC_COPY = "cuda-ipc-copy"
#: Every way, as above.
WAYS = (RECEIVED, HOST_COPY, CUDA_IPC_VIEW, CUDA_IPC_COPY)


class DeviceLanding:
    """Turns one stream's messages into :class:`~dissoc.device.DeviceBatch` objects (see the module doc)."""

    def __init__(self, backend: DeviceBackend | None = None, *, validate: bool = True) -> None:
        self.backend = backend if backend is not None else get_backend()
        self.decoder = DeviceDecoder(backend=self.backend)
        self.validate = validate
        self._mirror: MessageDecoder | None = None  # set with the schema, when contents need checking
        #: metadata -> (the parsed message, its buffers' (offset, length) rows, their offsets, their lengths)
        self._parsed: dict[bytes, tuple[Any, Any, list[int], tuple[int, ...]]] = {}
        #: How the last body reached the device (one of :data:`WAYS`; empty: the message had none).
        self.way = ""

    @property
    def receives_on_device(self) -> bool:
        """Whether a CUDA-capable transport may be handed device buffers to receive into."""
        return self.backend.name == "cupy"

    def allocate(self, length: int) -> Any:
        """A device buffer for a packed body of ``length`` bytes (the data connection's allocator)."""
        return self.backend.empty(length)

    def schema(self, metadata: Any) -> None:
        """Take in the stream's Schema message."""
        meta = bytes(metadata)
        self.decoder.decode(meta)
        if self.validate:
            mirror = MessageDecoder()
            mirror.decode(meta)
            self._mirror = mirror if mirror.checks_contents else None

    def _check(self, metadata: bytes, body: Any) -> None:
        """Check a device body's contents through the host decoder (see Validation in the module doc)."""
        mirror = self._mirror
        if mirror is None:
            return
        host = self.backend.download(body) if int(body.nbytes) else np.zeros(0, np.uint8)
        mirror.decode(metadata, pa.py_buffer(host))

    def _land(self, metadata: bytes, body: Any) -> DeviceBatch | None:
        self._check(metadata, body)
        return self.decoder.decode(metadata, body)

    def packed(self, metadata: Any, body: Any) -> DeviceBatch | None:
        """A packed body, in device memory or host memory."""
        if body is None:
            self.way = ""
            return self.decoder.decode(bytes(metadata), None)
        if device_nbytes(body) is None and not self.backend.is_device_array(body):
            self.way = HOST_COPY
            if self._mirror is not None:  # on the host already: check it there before the upload
                self._mirror.decode(bytes(metadata), body)
                return self.decoder.decode(bytes(metadata), self.backend.upload(body))
            body = self.backend.upload(body)
        else:
            self.way = RECEIVED
        return self._land(bytes(metadata), body)

    def pairs(
        self, metadata: Any, pairs: PairList, reader: PairReader
    ) -> tuple[DeviceBatch | None, list[int]]:
        """A pair-list body; returns the batch and the offsets that may be freed now."""
        meta = bytes(metadata)
        known = self._parsed.get(meta)
        if known is None:
            parsed = parse(meta)
            if parsed.batch is None:
                raise ProtocolError("address/length pairs arrived for a message without a body")
            # Streams of same-shaped batches repeat their metadata byte for byte: parsed once.
            if len(self._parsed) >= 64:
                del self._parsed[next(iter(self._parsed))]
            spans = parsed.batch.buffers
            rows = spans.tolist()
            known = self._parsed[meta] = (parsed, spans, [o for o, _ in rows], tuple(n for _, n in rows))
        parsed, spans, at, sizes = known
        flat = pairs.flat()
        if len(flat) != 2 * len(at):
            raise ProtocolError(f"the metadata lists {len(at)} buffers, the pair list {len(flat) // 2}")
        lengths = flat[1::2]
        if lengths != sizes:
            k = next(i for i, (a, b) in enumerate(zip(lengths, sizes, strict=True)) if a != b)
            raise ProtocolError(
                f"pair {k} lists {lengths[k]} bytes, the metadata says buffer {k} has {sizes[k]}"
            )
        span = getattr(reader, "device_span", None)
        if span is not None and reader.zero_copy:
            self.way = CUDA_IPC_VIEW
            whole = reader.device_body(pairs, at, parsed.body_length)  # type: ignore[attr-defined]
            if whole is not None:  # placed as its IPC body is laid out: the metadata holds as it is
                return self._land(meta, whole), []
            view, low, high = span(pairs)
            if view is None:  # every buffer is empty
                return self._land(meta, self.backend.empty(parsed.body_length)), []
            rewritten = _rewrite(parsed, pairs.pairs, low, high - low)
            return self._land(rewritten, view), []
        gather = getattr(reader, "gather_into", None)
        if gather is not None:  # device memory: one device-to-device copy per range, straight into place
            self.way = CUDA_IPC_COPY
            body = self.backend.empty(parsed.body_length)
            done = gather(pairs, body, at)
            return self._land(meta, body), done
        self.way = HOST_COPY
        buffers, done = reader.read(pairs)
        host = np.zeros(parsed.body_length, np.uint8)
        for (offset, n), buf in zip(spans.tolist(), buffers, strict=True):
            if n and buf is not None:
                host[offset : offset + n] = np.frombuffer(buf, np.uint8, n)
        if self._mirror is not None:
            self._mirror.decode(meta, pa.py_buffer(host))
        return self.decoder.decode(meta, self.backend.upload(host)), done


def _rewrite(parsed: Any, rows: Any, low: int, size: int) -> bytes:
    """The message with its buffers at the pairs' offsets relative to ``low``, its body ``size`` bytes."""
    batch = parsed.batch
    if batch.compression is not None:
        raise CodecError("device landing needs uncompressed bodies; this message is compressed")
    buffers = np.zeros_like(batch.buffers)
    nonempty = rows[:, 1] > 0
    buffers[:, 1] = batch.buffers[:, 1]
    buffers[nonempty, 0] = rows[nonempty, 0].astype(np.int64) - low
    variadic = None if batch.variadic_counts is None else [int(v) for v in batch.variadic_counts]
    if parsed.header_type == HeaderType.DictionaryBatch:
        return encode_dictionary_batch(
            int(parsed.dictionary_id),
            bool(parsed.is_delta),
            batch.length,
            batch.nodes,
            buffers,
            size,
            None,
            variadic,
        )
    return encode_record_batch(batch.length, batch.nodes, buffers, size, None, variadic)
