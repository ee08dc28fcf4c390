"""Record batches in device memory: each one is its IPC messages with the bodies on the device.

A :class:`DeviceBatch` holds the stream's Schema message, the DictionaryBatch messages its dictionary fields
need and its RecordBatch message, each message's body one device allocation (a uint8 device array of the
active :mod:`dissoc.memory.cuda` backend: CuPy on a GPU). Nothing is re-laid out: uploading a
``pa.RecordBatch`` is :class:`~dissoc.codec.MessageEncoder` plus one upload per message body, and
:meth:`DeviceBatch.to_arrow` is one download per body plus :class:`~dissoc.codec.MessageDecoder`. The
per-column view (:class:`DeviceColumn`) is found from the metadata alone (:mod:`dissoc.codec.layout`): every
Arrow buffer is a zero-copy slice of a body, and fixed-width columns expose a typed view through
``__cuda_array_interface__`` and DLPack, so that CuPy, cuDF or torch take them without a copy.

:class:`DeviceDecoder` lands a stream's messages whose bodies already are on the device (a client receiving
into GPU memory); :class:`DeviceEncoder` turns device batches back into messages for a server, sending each
dictionary once per stream.

Limitations: bodies must be uncompressed and little-endian (device landing refuses others with
:class:`~dissoc.errors.CodecError`; decode those on the host and upload). The decoder checks the metadata
(node, buffer and variadic counts, spans, buffer sizes) but not the values inside offsets, views or indices,
which are on the device; :meth:`DeviceBatch.to_arrow` validates those fully, as the host decoder does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dissoc.codec.decoder import MessageDecoder, parse
from dissoc.codec.encoder import EncodedMessage, MessageEncoder
from dissoc.codec.layout import FieldLayout, MessageLayout, message_layout
from dissoc.codec.message import HeaderType
from dissoc.codec.schema import FieldPlan, Layout, SchemaInfo, decode_schema
from dissoc.device.cdevice import DeviceInterfaceError, Imported, export_device_array, import_device_array
from dissoc.errors import CodecError
from dissoc.memory.cuda import DeviceBackend, get_backend

__all__ = [
    "DeviceBatch",
    "DeviceColumn",
    "DeviceDecoder",
    "DeviceEncoder",
    "DeviceInterfaceError",
    "DeviceMessage",
    "typed_dtype",
]

log = logging.getLogger(__name__)

_CACHE_SIZE = 64


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class DeviceMessage:
    """One IPC message whose body is in device memory.

    ``metadata`` is the Message flatbuffer; ``body`` a uint8 device array of (at least) ``bodyLength`` bytes
    (None for a Schema message, which has no body). Messages compare by identity: two uploads of equal bytes
    are two messages.
    """

    metadata: bytes
    body: Any
    is_dictionary: bool = False
    dictionary_id: int | None = None
    is_delta: bool = False

    @property
    def body_length(self) -> int:
        """Bytes in the body."""
        return 0 if self.body is None else int(self.body.nbytes)

    def __repr__(self) -> str:
        kind = f"dictionary id={self.dictionary_id} delta={self.is_delta}" if self.is_dictionary else "batch"
        return f"DeviceMessage({kind}, metadata={len(self.metadata)} bytes, body={self.body_length} bytes)"


# ----------------------------------------------------------------------------------------------------------
# Columns

_INT_DTYPES = {
    pa.lib.Type_INT8: np.int8,
    pa.lib.Type_INT16: np.int16,
    pa.lib.Type_INT32: np.int32,
    pa.lib.Type_INT64: np.int64,
    pa.lib.Type_UINT8: np.uint8,
    pa.lib.Type_UINT16: np.uint16,
    pa.lib.Type_UINT32: np.uint32,
    pa.lib.Type_UINT64: np.uint64,
    pa.lib.Type_HALF_FLOAT: np.float16,
    pa.lib.Type_FLOAT: np.float32,
    pa.lib.Type_DOUBLE: np.float64,
    pa.lib.Type_DATE32: np.int32,
    pa.lib.Type_DATE64: np.int64,
    pa.lib.Type_TIME32: np.int32,
    pa.lib.Type_TIME64: np.int64,
    pa.lib.Type_TIMESTAMP: np.int64,
    pa.lib.Type_DURATION: np.int64,
}


def typed_dtype(ty: pa.DataType) -> np.dtype[Any] | None:
    """The numpy dtype of a column's typed view: fixed-width numbers and int-backed temporal types (their
    storage type for extension types, the index type for dictionary-encoded ones); None for other types."""
    if isinstance(ty, pa.BaseExtensionType):
        return typed_dtype(ty.storage_type)
    if pa.types.is_dictionary(ty):
        return typed_dtype(ty.index_type)
    dtype = _INT_DTYPES.get(ty.id)
    return None if dtype is None else np.dtype(dtype)


class DeviceColumn:
    """One field of a device batch: its Arrow buffers as zero-copy slices of a device message body.

    ``buffers`` are uint8 device arrays (None where the metadata lists an empty buffer), in the IPC order of
    the field's layout -- the same as the metadata's buffer list: validity first where the layout has one
    (absent when there are no nulls), then offsets / values / type ids..., then a view type's variadic data
    buffers. ``children`` follow the Arrow type (none for dictionary-encoded fields: their values are
    ``dictionary``). ``offset`` is always 0: the encoder writes slices from their first element.

    For fixed-width numeric and temporal types (and dictionary indices), :attr:`data` is a typed view of
    ``length`` elements, and the column itself hands that view out through ``__cuda_array_interface__``
    (version 3; no ``mask``: nulls are in ``buffers[0]``) and ``__dlpack__``, so ``cupy.asarray(column)`` or
    ``torch.from_dlpack(column)`` share its memory.
    """

    __slots__ = (
        "_body",
        "_data",
        "backend",
        "buffers",
        "children",
        "dictionary",
        "dictionary_chunks",
        "field",
        "layout",
        "length",
        "null_count",
        "offset",
        "spans",
    )

    def __init__(
        self,
        layout: FieldLayout,
        body: Any,
        backend: DeviceBackend,
        children: list[DeviceColumn],
        dictionary_chunks: list[DeviceColumn],
    ) -> None:
        self.layout = layout
        self.field: pa.Field = layout.field
        self.length = layout.length
        self.null_count = layout.length if layout.layout == Layout.NULL else layout.null_count
        self.offset = 0
        self.spans = layout.buffers
        self.backend = backend
        self._body = body
        self.buffers: list[Any] = [None if n == 0 else body[o : o + n] for o, n in layout.buffers]
        self.children = children
        self.dictionary_chunks = dictionary_chunks
        self.dictionary: DeviceColumn | None = dictionary_chunks[0] if len(dictionary_chunks) == 1 else None
        self._data: Any = None

    @property
    def type(self) -> pa.DataType:
        """The field's Arrow type."""
        return self.field.type

    @property
    def name(self) -> str:
        return str(self.field.name)

    @property
    def dictionary_id(self) -> int:
        """The dictionary id of a dictionary-encoded field, else -1."""
        return self.layout.dictionary_id

    @property
    def dtype(self) -> np.dtype[Any] | None:
        """The numpy dtype of :attr:`data`, or None when the column has no typed view."""
        return typed_dtype(self.type)

    @property
    def nbytes(self) -> int:
        """Bytes of this column's own buffers (not its children's or dictionary's)."""
        return sum(n for _, n in self.spans)

    @property
    def data(self) -> Any:
        """A typed device array of ``length`` elements over the values (the indices for dictionary-encoded
        fields), without a copy; :class:`DeviceInterfaceError` for other types. Slots of nulls hold
        unspecified values."""
        if self._data is None:
            dtype = self.dtype
            if dtype is None or self.layout.layout != Layout.FIXED:
                raise DeviceInterfaceError(
                    f"column {self.name!r} of type {self.type} has no typed view: only fixed-width numeric "
                    "and temporal columns (and dictionary indices) have one; use .buffers"
                )
            off, n = self.spans[1]
            need = self.length * dtype.itemsize
            if n < need:  # the layout checks this already; kept for hand-built layouts
                raise CodecError(f"column {self.name!r}: values buffer holds {n} bytes, {need} are needed")
            if need and off % dtype.itemsize:
                raise CodecError(
                    f"column {self.name!r}: values at body offset {off} are not aligned to {dtype.itemsize} "
                    "bytes, so they cannot be viewed as a typed device array"
                )
            start = off if need else 0
            self._data = self._body[start : start + need].view(dtype)
        return self._data

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface (version 3) of :attr:`data`; refused where it is not CUDA memory."""
        typed = self.data
        cai = getattr(typed, "__cuda_array_interface__", None)
        if cai is None:
            raise DeviceInterfaceError(
                f"column {self.name!r} is not in CUDA memory (device backend {self.backend.name!r}): it has "
                "no __cuda_array_interface__; copy its buffers to the host with backend.download instead"
            )
        out = dict(cai)
        out.pop("mask", None)
        out["version"] = 3
        out["strides"] = None
        return out

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: Any = None,
        copy: bool | None = None,
    ) -> Any:
        """DLPack capsule of :attr:`data` (delegated to the backend array)."""
        typed = self.data
        if not hasattr(typed, "__dlpack__"):
            raise DeviceInterfaceError(
                f"column {self.name!r}: arrays of the {self.backend.name!r} device backend have no DLPack"
            )
        kwargs = {
            k: v
            for k, v in (
                ("stream", stream),
                ("max_version", max_version),
                ("dl_device", dl_device),
                ("copy", copy),
            )
            if v is not None
        }
        return typed.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """DLPack device of :attr:`data` (delegated to the backend array)."""
        typed = self.data
        if not hasattr(typed, "__dlpack_device__"):
            raise DeviceInterfaceError(
                f"column {self.name!r}: arrays of the {self.backend.name!r} device backend have no DLPack"
            )
        device: tuple[int, int] = typed.__dlpack_device__()
        return device

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return (
            f"DeviceColumn({self.name!r}, {self.type}, length={self.length}, null_count={self.null_count}, "
            f"buffers={len(self.buffers)}, children={len(self.children)})"
        )


# ----------------------------------------------------------------------------------------------------------
# Batches


@dataclass(slots=True, eq=False)
class _Replayed:
    """A dictionary message with its layout and the dictionaries in force before it (for nested ones)."""

    message: DeviceMessage
    layout: MessageLayout
    state: dict[int, tuple[_Replayed, ...]]


def _decode_schema_message(metadata: object) -> SchemaInfo:
    msg = parse(metadata)
    if msg.header_type != HeaderType.Schema:
        raise CodecError(f"expected a Schema message, got {HeaderType(msg.header_type).name}")
    assert msg.info.header is not None
    return decode_schema(msg.info.header, msg.info.version)


def _dictionary_ids(fields: Sequence[FieldLayout]) -> Iterator[int]:
    """Dictionary ids used directly by these fields (not inside the dictionaries' own values)."""
    stack = list(fields)
    while stack:
        f = stack.pop()
        if f.dictionary_id >= 0:
            yield f.dictionary_id
        stack.extend(f.children)


def _as_bytes(metadata: object) -> bytes:
    if isinstance(metadata, bytes):
        return metadata
    return bytes(memoryview(metadata).cast("B"))  # type: ignore[arg-type]


def _check_body(backend: DeviceBackend, body: Any, what: str) -> int:
    if not backend.is_device_array(body):
        raise CodecError(
            f"{what}: the body must be a device array of the {backend.name!r} backend, "
            f"got {type(body).__name__}"
        )
    if len(body.shape) != 1 or body.dtype != np.uint8:
        raise CodecError(f"{what}: the body must be a 1-D uint8 device array, got {body.dtype} {body.shape}")
    return int(body.nbytes)


class DeviceBatch:
    """A record batch whose buffers are in device memory: its IPC messages with device bodies.

    Build one with :meth:`from_arrow` (upload), or get them from :class:`DeviceDecoder`. ``messages`` are the
    DictionaryBatch messages the batch needs, in stream order, then its RecordBatch message; replayed into a
    fresh :class:`~dissoc.codec.MessageDecoder` after ``schema_metadata`` they give the batch
    (:meth:`to_arrow`).

    The constructor takes exactly that: the stream's Schema message, the messages (bodies as uint8 device
    arrays of ``backend``, the process's backend by default) and optionally ``schema_info``, the already
    decoded ``schema_metadata``. Their metadata is checked against the schema and the bodies
    (:class:`CodecError`); the values inside the bodies are not (:meth:`to_arrow` does).
    """

    def __init__(
        self,
        schema_metadata: bytes,
        messages: Sequence[DeviceMessage],
        *,
        backend: DeviceBackend | None = None,
        schema_info: SchemaInfo | None = None,
    ) -> None:
        self.backend: DeviceBackend = backend if backend is not None else get_backend()
        self.schema_metadata = _as_bytes(schema_metadata)
        self._info = schema_info if schema_info is not None else _decode_schema_message(self.schema_metadata)
        if self._info.big_endian:
            raise CodecError("device batches need a little-endian schema")
        msgs = list(messages)
        layouts: list[MessageLayout] = []
        for k, m in enumerate(msgs):
            size = _check_body(self.backend, m.body, f"message {k}")
            lay = message_layout(self._info, m.metadata, body_size=size)
            if lay.compression is not None:
                raise CodecError(f"message {k}: device bodies must be uncompressed")
            if (m.is_dictionary, m.dictionary_id, m.is_delta) != (
                lay.is_dictionary,
                lay.dictionary_id,
                lay.is_delta,
            ):
                # the metadata decides; the message's own fields are made to agree with it
                msgs[k] = DeviceMessage(
                    _as_bytes(m.metadata), m.body, lay.is_dictionary, lay.dictionary_id, lay.is_delta
                )
            layouts.append(lay)
        self._replay(msgs, layouts)

    @classmethod
    def _checked(
        cls,
        backend: DeviceBackend,
        schema_metadata: bytes,
        info: SchemaInfo,
        messages: list[DeviceMessage],
        layouts: list[MessageLayout],
    ) -> DeviceBatch:
        """A batch from messages whose layouts the caller (the decoder) has already checked."""
        self = cls.__new__(cls)
        self.backend = backend
        self.schema_metadata = schema_metadata
        self._info = info
        self._replay(messages, layouts)
        return self

    @classmethod
    def _plain(
        cls,
        backend: DeviceBackend,
        schema_metadata: bytes,
        info: SchemaInfo,
        message: DeviceMessage,
        layout: MessageLayout,
    ) -> DeviceBatch:
        """A batch of one checked RecordBatch message whose fields use no dictionary (no replay needed)."""
        self = cls.__new__(cls)
        self.backend = backend
        self.schema_metadata = schema_metadata
        self._info = info
        self.messages = [message]
        self.message_layouts = [layout]
        self._layout = layout
        self._state = {}
        self._columns = None
        return self

    def _replay(self, messages: list[DeviceMessage], layouts: list[MessageLayout]) -> None:
        """Check the message order and resolve which dictionary messages each field refers to."""
        if not messages:
            raise CodecError("a device batch needs at least its RecordBatch message")
        self.messages = messages
        self.message_layouts = layouts
        state: dict[int, tuple[_Replayed, ...]] = {}
        for k, (m, lay) in enumerate(zip(messages, layouts, strict=True)):
            last = k == len(messages) - 1
            if lay.is_dictionary == last:
                raise CodecError(
                    "a device batch's messages are DictionaryBatch messages followed by one RecordBatch; "
                    f"message {k} of {len(messages)} is a {HeaderType(lay.header_type).name}"
                )
            self._check_dictionaries(lay, state, f"message {k}")
            if last:
                self._layout = lay
                break
            assert lay.dictionary_id is not None
            r = _Replayed(m, lay, dict(state))
            if lay.is_delta:
                state[lay.dictionary_id] = (*state[lay.dictionary_id], r)
            else:
                state[lay.dictionary_id] = (r,)
        self._state = state
        self._columns: list[DeviceColumn] | None = None

    @staticmethod
    def _check_dictionaries(lay: MessageLayout, state: dict[int, tuple[_Replayed, ...]], what: str) -> None:
        for did in _dictionary_ids(lay.fields):
            if did not in state:
                raise CodecError(f"{what}: dictionary id {did} is used before any DictionaryBatch for it")
        if lay.is_delta and lay.dictionary_id not in state:
            raise CodecError(
                f"{what}: delta for dictionary id {lay.dictionary_id} before any dictionary for it"
            )

    # -------------------------------------------------------------------------------------- construction

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch, *, backend: DeviceBackend | None = None) -> DeviceBatch:
        """Upload ``batch``: encode it into IPC messages and copy each body to the device in one transfer."""
        out = cls.from_batches(batch.schema, [batch], backend=backend)
        return out[0]

    @classmethod
    def from_batches(
        cls, schema: pa.Schema, batches: Sequence[pa.RecordBatch], *, backend: DeviceBackend | None = None
    ) -> list[DeviceBatch]:
        """Upload batches of one schema; a dictionary unchanged between batches is uploaded once and shared
        (so a :class:`DeviceEncoder` sends it once)."""
        backend = backend if backend is not None else get_backend()
        enc = MessageEncoder(schema)
        dec = DeviceDecoder(backend=backend)
        dec.decode(enc.schema_message().metadata)
        out: list[DeviceBatch] = []
        for batch in batches:
            result = None
            for m in enc.encode(batch):
                result = dec.decode(m.metadata, _upload(backend, m))
            assert result is not None
            out.append(result)
        return out

    @classmethod
    def from_table(cls, table: pa.Table, *, backend: DeviceBackend | None = None) -> list[DeviceBatch]:
        """Upload every batch of ``table`` (see :meth:`from_batches`)."""
        return cls.from_batches(table.schema, table.to_batches(), backend=backend)

    @staticmethod
    def to_table(batches: Sequence[DeviceBatch], schema: pa.Schema | None = None) -> pa.Table:
        """Download device batches into one ``pa.Table`` (``schema`` is needed when there are none)."""
        host = [b.to_arrow() for b in batches]
        if schema is None:
            if not batches:
                raise ValueError("DeviceBatch.to_table: no batches and no schema")
            schema = batches[0].schema
        return pa.Table.from_batches(host, schema=schema)

    @classmethod
    def from_arrow_device(cls, obj: Any, *, backend: DeviceBackend | None = None) -> DeviceBatch:
        """Import a batch from any producer of the Arrow C Device Data Interface
        (``__arrow_c_device_array__``: cuDF, another dissoc batch...) or of host Arrow data
        (``__arrow_c_array__``, uploaded), into this backend's memory: one device-to-device copy per buffer,
        into IPC messages (see :mod:`dissoc.device.cdevice`)."""
        backend = backend if backend is not None else get_backend()
        return cls._imported(import_device_array(obj, backend), backend)

    @classmethod
    def from_arrow_device_stream(
        cls, obj: Any, *, backend: DeviceBackend | None = None
    ) -> Iterator[DeviceBatch]:
        """Import each batch of any producer of an Arrow C device stream (``__arrow_c_device_stream__``: a
        dissoc reader landing on the device, cuDF...) as :meth:`from_arrow_device` does; stopping early
        releases the producer's stream."""
        from dissoc.device.cstream import read_device_stream

        backend = backend if backend is not None else get_backend()
        stream = read_device_stream(obj, backend)
        try:
            for got in stream:
                yield cls._imported(got, backend)
        finally:
            stream.close()

    @classmethod
    def _imported(cls, got: Imported, backend: DeviceBackend) -> DeviceBatch:
        if isinstance(got, pa.RecordBatch):
            return cls.from_arrow(got, backend=backend)
        schema_metadata, messages = got
        return cls(
            schema_metadata,
            [DeviceMessage(meta, body, did is not None, did, False) for meta, body, did in messages],
            backend=backend,
        )

    # ------------------------------------------------------------------------------ C Device Data Interface

    def __arrow_c_device_array__(
        self, requested_schema: object | None = None, **kwargs: Any
    ) -> tuple[object, object]:
        """The Arrow PyCapsule interface for device data: ``(schema capsule, arrow_device_array capsule)``
        over this batch's own device memory, no copy (see :mod:`dissoc.device.cdevice`). The batch is kept
        alive until the consumer releases the array."""
        for key, value in kwargs.items():
            if value is not None:
                raise NotImplementedError(f"__arrow_c_device_array__: the keyword {key!r} is not supported")
        return export_device_array(self.backend, self.schema, self.num_rows, self.columns, self)

    def __arrow_c_schema__(self) -> object:
        """The batch's schema as an Arrow PyCapsule."""
        return self.schema.__arrow_c_schema__()

    # -------------------------------------------------------------------------------------- host copy

    def to_arrow(self) -> pa.RecordBatch:
        """Copy to host memory: one download per message body, decoded (and validated) by the host codec."""
        dec = MessageDecoder()
        dec.decode(self.schema_metadata)
        result = None
        for m in self.messages:
            host = self.backend.download(m.body) if m.body_length else np.empty(0, np.uint8)
            result = dec.decode(m.metadata, pa.py_buffer(host))
        assert isinstance(result, pa.RecordBatch)
        return result

    # -------------------------------------------------------------------------------------- accessors

    @property
    def schema(self) -> pa.Schema:
        """The batch's schema (as decoded from its Schema message)."""
        return self._info.schema

    @property
    def schema_info(self) -> SchemaInfo:
        return self._info

    @property
    def num_rows(self) -> int:
        return self._layout.length

    @property
    def num_columns(self) -> int:
        return len(self._layout.fields)

    @property
    def nbytes(self) -> int:
        """Device bytes held by the batch's messages (its own body and its dictionaries')."""
        return sum(m.body_length for m in self.messages)

    @property
    def layout(self) -> MessageLayout:
        """The RecordBatch message's layout (see :mod:`dissoc.codec.layout`)."""
        return self._layout

    @property
    def columns(self) -> list[DeviceColumn]:
        """One :class:`DeviceColumn` per field (built on first use)."""
        if self._columns is None:
            body = self.messages[-1].body
            self._columns = [self._column(f, body, self._state) for f in self._layout.fields]
        return self._columns

    def column(self, i: int | str) -> DeviceColumn:
        """The column at index ``i`` or of name ``i`` (KeyError when no single field has that name)."""
        if isinstance(i, str):
            idx = int(self.schema.get_field_index(i))
            if idx < 0:
                raise KeyError(f"no single field named {i!r} in {self.schema.names}")
            return self.columns[idx]
        return self.columns[i]

    def _column(self, fl: FieldLayout, body: Any, state: dict[int, tuple[_Replayed, ...]]) -> DeviceColumn:
        children = [self._column(c, body, state) for c in fl.children]
        chunks: list[DeviceColumn] = []
        if fl.dictionary_id >= 0:
            chunks = [
                self._column(r.layout.fields[0], r.message.body, r.state) for r in state[fl.dictionary_id]
            ]
        return DeviceColumn(fl, body, self.backend, children, chunks)

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (
            f"DeviceBatch(rows={self.num_rows}, columns={self.schema.names}, messages={len(self.messages)}, "
            f"nbytes={self.nbytes}, backend={self.backend.name!r})"
        )


def _upload(backend: DeviceBackend, msg: EncodedMessage) -> Any:
    """One host-to-device copy of an encoded message's body (its buffers joined on the host first)."""
    n = msg.body_length
    if n == 0:
        return backend.empty(0)
    host = np.empty(n, np.uint8)
    pos = 0
    for buf in msg.body_buffers:
        if buf is None:
            continue
        raw = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
        host[pos : pos + raw.size] = raw
        pos += raw.size
    if pos != n:
        raise CodecError(f"encoded body: bodyLength is {n}, its buffers hold {pos} bytes")
    return backend.upload(host)


# ----------------------------------------------------------------------------------------------------------
# Decoder and encoder


@dataclass(slots=True, eq=False)
class _Entry:
    """A dictionary message the decoder holds, with its arrival number and what replaying it needs."""

    seq: int
    message: DeviceMessage
    layout: MessageLayout
    needs: tuple[_Entry, ...]  # itself and, transitively, the nested dictionaries in force when it arrived


class DeviceDecoder:
    """Decode a stream of Message metadata with device bodies into :class:`DeviceBatch` objects.

    Call :meth:`decode` once per message, in stream order: the Schema message first (no body), then
    DictionaryBatch and RecordBatch messages with their bodies as uint8 device arrays of the backend. A
    dictionary message replaces that id's dictionary, or with ``isDelta`` is appended to it; every batch
    refers to the dictionary messages in force when it arrived (all of a dictionary's messages, base and
    deltas, which :meth:`DeviceBatch.to_arrow` replays in order; :attr:`DeviceColumn.dictionary` is then None
    and :attr:`DeviceColumn.dictionary_chunks` lists one column per message). Compressed bodies and
    big-endian schemas raise :class:`CodecError` (decode those on the host, then upload).
    """

    def __init__(self, *, backend: DeviceBackend | None = None) -> None:
        self.backend: DeviceBackend = backend if backend is not None else get_backend()
        self._info: SchemaInfo | None = None
        self._schema_metadata = b""
        self._dicts: dict[int, tuple[_Entry, ...]] = {}
        self._seq = 0
        self._layouts: dict[bytes, MessageLayout] = {}
        #: The dictionary ids each cached layout's fields use directly (by metadata, like _layouts).
        self._dictionary_uses: dict[bytes, tuple[int, ...]] = {}

    @property
    def schema(self) -> pa.Schema | None:
        """The stream's schema, once its Schema message has been decoded."""
        return None if self._info is None else self._info.schema

    @property
    def schema_metadata(self) -> bytes:
        """The stream's Schema message (empty before it arrived)."""
        return self._schema_metadata

    def decode(self, metadata: object, body: Any = None) -> DeviceBatch | None:
        """Decode one message: a :class:`DeviceBatch` for a RecordBatch, None for the others.

        Streams of same-shaped batches repeat their metadata byte for byte: layouts are cached per metadata.
        """
        key = _as_bytes(metadata)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layout(key)
            if lay is None:
                return None
        return self._land(lay, key, body)

    def _layout(self, metadata: bytes) -> MessageLayout | None:
        """Parse a message: the Schema is taken in (None), batch layouts are checked and cached."""
        msg = parse(metadata)
        kind = HeaderType(msg.header_type).name
        if msg.header_type == HeaderType.Schema:
            if self._info is not None:
                raise CodecError("a second Schema message arrived; a stream has exactly one")
            info = _decode_schema_message(metadata)
            if info.big_endian:
                raise CodecError(
                    "device landing needs a little-endian stream; this schema is big-endian "
                    "(decode it on the host and upload)"
                )
            self._info = info
            self._schema_metadata = metadata
            return None
        if self._info is None:
            raise CodecError(f"a {kind} message arrived before the Schema message")
        if not msg.has_body or msg.batch is None:
            raise CodecError(f"unexpected {kind} message in a stream")
        if msg.batch.compression is not None:
            raise CodecError(
                f"{kind}: the body is compressed; device landing needs uncompressed bodies "
                "(decode it on the host and upload)"
            )
        lay = message_layout(self._info, metadata, parsed=msg)
        if len(self._layouts) >= _CACHE_SIZE:
            oldest = next(iter(self._layouts))
            del self._layouts[oldest]
            self._dictionary_uses.pop(oldest, None)
        self._layouts[metadata] = lay
        self._dictionary_uses[metadata] = tuple(set(_dictionary_ids(lay.fields)))
        return lay

    def _land(self, lay: MessageLayout, metadata: bytes, body: Any) -> DeviceBatch | None:
        info = self._info
        assert info is not None
        kind = HeaderType(lay.header_type).name
        if body is None:
            raise CodecError(f"{kind}: a body is needed (bodyLength {lay.body_length})")
        size = _check_body(self.backend, body, kind)
        if size < lay.body_length:
            raise CodecError(
                f"{kind}: message body: expected {lay.body_length} bytes (bodyLength), got {size}"
            )
        if size > lay.body_length:
            body = body[: lay.body_length]
        self._seq += 1
        if lay.is_dictionary:
            did = lay.dictionary_id
            assert did is not None
            prev = self._dicts.get(did)
            if lay.is_delta and prev is None:
                raise CodecError(f"DictionaryBatch: delta for id {did} before any dictionary for it")
            m = DeviceMessage(metadata, body, True, did, lay.is_delta)
            entry = _Entry(self._seq, m, lay, ())
            entry.needs = (entry, *self._needs(lay, "DictionaryBatch"))
            self._dicts[did] = (*prev, entry) if lay.is_delta and prev is not None else (entry,)
            log.debug("device dictionary id=%#x delta=%s bytes=%d", did, lay.is_delta, lay.body_length)
            return None
        uses = self._dictionary_uses.get(metadata)
        if uses == ():  # no dictionaries (the common case): nothing to resolve or replay
            message = DeviceMessage(metadata, body)
            return DeviceBatch._plain(self.backend, self._schema_metadata, info, message, lay)
        needed = sorted({id(e): e for e in self._needs(lay, "RecordBatch")}.values(), key=lambda e: e.seq)
        messages = [e.message for e in needed]
        messages.append(DeviceMessage(metadata, body))
        layouts = [e.layout for e in needed]
        layouts.append(lay)
        return DeviceBatch._checked(self.backend, self._schema_metadata, info, messages, layouts)

    def _needs(self, lay: MessageLayout, what: str) -> list[_Entry]:
        """The entries (with their own needs) of the dictionaries a message's fields use directly."""
        out: list[_Entry] = []
        for did in set(_dictionary_ids(lay.fields)):
            entries = self._dicts.get(did)
            if entries is None:
                raise CodecError(f"{what}: dictionary id {did} is used before any DictionaryBatch for it")
            for e in entries:
                out.extend(e.needs)
        return out


class DeviceEncoder:
    """Turn device batches of one schema into the messages of a stream (for servers of device batches).

    :meth:`schema_message` starts the stream; :meth:`encode` returns a batch's messages: the dictionary
    messages the receiver does not already hold -- judged by dictionary id and the identity of each message's
    device body, so a dictionary shared between batches goes out once -- then the batch's RecordBatch message.
    Bodies are not copied: the messages are the batch's own.

    The dictionary ids in the batches' metadata must be the stream's: give ``schema_metadata`` (e.g.
    ``batch.schema_metadata``) when the batches come from a :class:`DeviceDecoder` whose producer chose other
    ids than the encoder's (depth first, from 0).
    """

    def __init__(self, schema: pa.Schema, *, schema_metadata: bytes | None = None) -> None:
        if not isinstance(schema, pa.Schema):
            raise TypeError(f"schema must be a pyarrow.Schema, got {type(schema).__name__}")
        if schema_metadata is None:
            schema_metadata = MessageEncoder(schema).schema_message().metadata
        self._schema_metadata = bytes(schema_metadata)
        self._info = _decode_schema_message(self._schema_metadata)
        if not self._info.schema.equals(schema, check_metadata=False):
            raise CodecError(f"schema_metadata describes {self._info.schema}, not {schema}")
        self.schema = schema
        self._ids = _dictionary_signature(self._info)
        self._sent: dict[int, tuple[DeviceMessage, ...]] = {}

    def schema_message(self) -> DeviceMessage:
        """The Schema message that starts the stream (no body)."""
        return DeviceMessage(self._schema_metadata, None)

    def encode(self, batch: DeviceBatch) -> list[DeviceMessage]:
        """The messages to send for ``batch``: dictionaries the receiver lacks, then the batch."""
        if batch.schema_metadata != self._schema_metadata:
            if not batch.schema.equals(self.schema, check_metadata=False):
                raise CodecError(
                    f"batch schema {batch.schema} does not match the stream schema {self.schema}"
                )
            if _dictionary_signature(batch.schema_info) != self._ids:
                raise CodecError(
                    "the batch's dictionary ids differ from the stream's; build the DeviceEncoder with "
                    "schema_metadata=batch.schema_metadata"
                )
        msgs = batch.messages[:-1]
        skip = self._already_held(msgs, batch.message_layouts[:-1])
        out: list[DeviceMessage] = []
        for i, m in enumerate(msgs):
            did = m.dictionary_id
            assert did is not None
            if i not in skip:
                out.append(m)
                self._sent[did] = (*self._sent.get(did, ()), m) if m.is_delta else (m,)
        out.append(batch.messages[-1])
        return out

    def _already_held(self, msgs: list[DeviceMessage], layouts: list[MessageLayout]) -> set[int]:
        """Indices of dictionary messages the receiver holds already, so need not be sent again.

        For each id, the first chain of ``msgs`` (a base and the deltas that follow it, up to the id's next
        base) is compared with what was last sent for that id: when the sent messages are that chain or the
        start of it (by device body identity), they are skipped and only the rest is sent -- unless a message
        of another id that uses this dictionary lies among them (it was decoded against a shorter chain).
        Everything else is sent, so the receiver ends up with exactly the batch's dictionaries.
        """
        chains: dict[int, list[int]] = {}
        closed: set[int] = set()
        for i, m in enumerate(msgs):
            did = m.dictionary_id
            assert did is not None
            if did not in chains:
                chains[did] = [i]
            elif m.is_delta and did not in closed:
                chains[did].append(i)
            else:
                closed.add(did)
        skip: set[int] = set()
        for did, chain in chains.items():
            held = self._sent.get(did, ())
            j = len(held)
            if not 0 < j <= len(chain) or any(held[k].body is not msgs[chain[k]].body for k in range(j)):
                continue
            inside = set(chain[:j])
            users = (
                x
                for x in range(chain[0] + 1, chain[j - 1])
                if x not in inside and did in set(_dictionary_ids(layouts[x].fields))
            )
            if next(users, None) is None:
                skip.update(inside)
        return skip


def _dictionary_signature(info: SchemaInfo) -> list[int]:
    """Dictionary ids in schema order (depth first, into dictionary values)."""
    out: list[int] = []

    def visit(p: FieldPlan) -> None:
        if p.dict_id >= 0:
            out.append(p.dict_id)
            visit(info.dictionaries[p.dict_id].value_plan)
            return
        for c in p.children:
            visit(c)

    for p in info.plans:
        visit(p)
    return out
