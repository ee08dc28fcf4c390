"""Encoding: ``pyarrow.RecordBatch`` -> Message metadata plus the list of body buffers.

The body buffers point at the batch's own memory (no copy) wherever the Arrow layout allows; only sliced
arrays whose bitmaps start mid-byte, rebased offsets and run-end slices are rewritten. Buffers are padded to
8-byte boundaries with shared zero padding.

Per message the work is kept to what differs between batches of one schema. The Message flatbuffer comes from
a per-shape template (:func:`dissoc.codec.message.message_template`) filled with the numbers. The columns
are walked in one of three ways, chosen per schema: schemas of flat columns (fixed width, boolean, binary,
null) by straight-line code generated for the schema (:mod:`dissoc.codec.flatcode`; sliced columns and empty
batches by one loop that builds nodes, spans and body together); wide batches of plain layouts in bulk through
one C Data export (:mod:`dissoc.codec.bulk`); everything else by a walk driven by per-column plans, which
hands what it does not know (dictionaries, views, unions, run ends, extensions) to the general visitor.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import flatbuffers
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from dissoc.codec import bulk, cdata
from dissoc.codec.compression import codec_id, compress_buffer
from dissoc.codec.flatcode import compile_flat
from dissoc.codec.message import HeaderType, message_template
from dissoc.codec.schema import DictionaryIds, build_message, encode_schema, map_type
from dissoc.errors import CodecError

__all__ = ["EncodedMessage", "MessageEncoder"]

log = logging.getLogger(__name__)

#: IPC message bodies pad every buffer to a multiple of 8 bytes (the format's minimum; allocations use
#: :data:`dissoc.buffers.ALIGNMENT`).
BODY_PADDING = 8
#: Batches with at least this many columns are flattened in bulk (:mod:`dissoc.codec.bulk`) when they can be:
#: the bulk walk costs some 50 numpy calls whatever the width, about as much as walking 40 columns one by one.
BULK_COLUMNS = 48
#: The same for schemas of flat columns, whose one-loop encode costs less per column than the general walk.
BULK_FLAT_COLUMNS = 64
_ZEROS = bytes(64)
#: Zero padding by length (index n: n bytes).
_PADS = tuple(_ZEROS[:n] for n in range(BODY_PADDING))
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
_MINUS_ONE = (-1).to_bytes(8, "little", signed=True)


@dataclass(slots=True)
class EncodedMessage:
    """One IPC message: the Message flatbuffer and the body as a list of buffers (already padded)."""

    metadata: bytes
    # pyarrow buffers, numpy arrays or bytes: Any, as numpy's stubs do not make arrays buffers before 3.12.
    body_buffers: list[Any] = field(default_factory=list)
    body_length: int = 0
    header_type: int = HeaderType.RecordBatch

    @property
    def body(self) -> bytes:
        """The body joined into one bytes object (copies; for tests and small messages)."""
        return b"".join(bytes(memoryview(b)) for b in self.body_buffers)


def _decline(batch: pa.RecordBatch) -> None:
    """The flat code of a schema without any: every batch goes to the general loop."""
    return None


def _nbytes(buf: Any) -> int:
    """Size in bytes of a body buffer (a pyarrow buffer, numpy array, bytes or memoryview; None is empty)."""
    if buf is None:
        return 0
    if isinstance(buf, pa.Buffer):
        return int(buf.size)
    if isinstance(buf, np.ndarray):
        return int(buf.nbytes)
    return memoryview(buf).nbytes


def _bitmap(buf: pa.Buffer | None, offset: int, length: int) -> pa.Buffer | npt.NDArray[np.uint8] | None:
    """Bytes of a bitmap starting at bit ``offset`` (a copy only when the offset is not byte aligned)."""
    if buf is None or length == 0:
        return None
    nbytes = (length + 7) // 8
    if offset % 8 == 0:
        return buf.slice(offset // 8, nbytes)
    start = offset // 8
    end = (offset + length + 7) // 8
    bits = np.unpackbits(np.frombuffer(buf, np.uint8, end - start, start), bitorder="little")
    shift = offset - start * 8
    return np.packbits(bits[shift : shift + length], bitorder="little")


def _rebased_offsets(
    buf: pa.Buffer, offset: int, length: int, dtype: str
) -> tuple[pa.Buffer | npt.NDArray[np.int32] | npt.NDArray[np.int64] | None, int, int]:
    """Offsets for ``length`` values from ``offset``, rebased to start at 0: (buffer, first, last)."""
    width = np.dtype(dtype).itemsize
    if length == 0:
        return None, 0, 0
    offs = np.frombuffer(buf, dtype, length + 1, offset * width)
    first, last = int(offs[0]), int(offs[-1])
    if first == 0:
        return buf.slice(offset * width, (length + 1) * width), 0, last
    return offs - offs.dtype.type(first), first, last


class _Flattener:
    """Walks arrays depth first, collecting field nodes, body buffers and dictionaries (by id)."""

    def __init__(self, ids: DictionaryIds) -> None:
        self.ids = ids
        self.nodes: list[int] = []  # flat: length, null count, length, null count, ...
        self.buffers: list[Any] = []
        self.sizes: list[int] = []  # the byte size of each of ``buffers``
        self.variadic: list[int] = []
        self.dictionaries: list[tuple[int, pa.Array, tuple[int, ...]]] = []

    def visit(self, arr: pa.Array, path: tuple[int, ...]) -> None:
        ty = arr.type
        kind = _KINDS.get(ty.id)
        if kind is None:
            kind = _kind_of(ty)
        if kind == _EXTENSION:
            arr = arr.storage
            ty = arr.type
            kind = _KINDS.get(ty.id) or _kind_of(ty)
        n, off = len(arr), arr.offset
        if kind == _DICTIONARY:
            self.dictionaries.append((self.ids.by_path[path], arr.dictionary, path))
            ty = ty.index_type
            kind = _FIXED
        if kind == _NULL:
            self.nodes += (n, n)
            return
        nulls = arr.null_count
        self.nodes += (n, nulls)
        bufs = arr.buffers()
        validity = _bitmap(bufs[0], off, n) if nulls else None
        buffers, sizes = self.buffers, self.sizes

        def add(buf: Any) -> None:
            buffers.append(buf)
            sizes.append(_nbytes(buf))

        if kind == _FIXED:
            width = ty.bit_width // 8
            add(validity)
            add(bufs[1].slice(off * width, n * width) if n else None)
        elif kind == _BOOL:
            add(validity)
            add(_bitmap(bufs[1], off, n))
        elif kind in (_BINARY, _LARGE_BINARY):
            offsets, first, last = _rebased_offsets(
                bufs[1], off, n, "<i8" if kind == _LARGE_BINARY else "<i4"
            )
            add(validity)
            add(offsets)
            add(bufs[2].slice(first, last - first) if bufs[2] is not None and last > first else None)
        elif kind in (_LIST, _LARGE_LIST):
            offsets, first, last = _rebased_offsets(bufs[1], off, n, "<i8" if kind == _LARGE_LIST else "<i4")
            add(validity)
            add(offsets)
            self.visit(arr.values.slice(first, last - first), (*path, 0))
        elif kind == _STRUCT:
            add(validity)
            for i in range(ty.num_fields):
                self.visit(arr.field(i), (*path, i))
        elif kind == _VIEW:
            add(validity)
            add(bufs[1].slice(off * 16, n * 16) if n else None)
            data = bufs[2:]
            self.variadic.append(len(data))
            for buf in data:
                add(buf)
        elif kind in (_LIST_VIEW, _LARGE_LIST_VIEW):
            w = 8 if kind == _LARGE_LIST_VIEW else 4
            add(validity)
            add(bufs[1].slice(off * w, n * w) if n else None)
            add(bufs[2].slice(off * w, n * w) if n else None)
            self.visit(arr.values, (*path, 0))
        elif kind == _FIXED_LIST:
            add(validity)
            size = ty.list_size
            self.visit(arr.values.slice(off * size, n * size), (*path, 0))
        elif kind == _UNION:
            add(bufs[1].slice(off, n) if n else None)
            if ty.mode == "dense":
                add(bufs[2].slice(off * 4, n * 4) if n else None)
            for i in range(ty.num_fields):
                self.visit(arr.field(i), (*path, i))
        elif kind == _RUN_END:
            run_ends, values = _ree_children(arr)
            self.visit(run_ends, (*path, 0))
            self.visit(values, (*path, 1))
        elif kind == _FIXED_BYTES:
            width = ty.byte_width
            add(validity)
            add(bufs[1].slice(off * width, n * width) if n else None)
        else:  # pragma: no cover - _kind_of raises first
            raise CodecError(f"cannot encode arrays of type {arr.type}")

    def walk(self, arr: pa.Array, plan: _Plan) -> None:
        """:meth:`visit` driven by a precomputed :func:`_plan`: no type inspection, and buffers that are
        already exactly the bytes the message needs are used as they are, without slicing."""
        kind, width, path, children = plan
        if kind == _OTHER:
            self.visit(arr, path)
            return
        n = len(arr)
        nodes = self.nodes
        if kind == _NULL:
            nodes += (n, n)
            return
        off = arr.offset
        nulls = arr.null_count
        nodes += (n, nulls)
        add, size = self.buffers.append, self.sizes.append
        bufs = arr.buffers()
        if nulls:  # every fast kind but null has a validity bitmap first
            nb = (n + 7) >> 3
            v = bufs[0]
            if off & 7:
                v = _bitmap(v, off, n)
            elif off or v.size != nb:
                v = v.slice(off >> 3, nb)
            add(v)
            size(nb)
        else:
            add(None)
            size(0)
        if kind == _FIXED:
            nb = n * width
            if nb:
                d = bufs[1]
                if off or d.size != nb:
                    d = d.slice(off * width, nb)
                add(d)
                size(nb)
            else:
                add(None)
                size(0)
        elif kind in (_BINARY, _LARGE_BINARY, _LIST, _LARGE_LIST):
            if n == 0:
                add(None)
                size(0)
                first = last = 0
            else:
                o = bufs[1]
                if width == 4:
                    first = _I32.unpack_from(o, off * 4)[0]
                    last = _I32.unpack_from(o, (off + n) * 4)[0]
                else:
                    first = _I64.unpack_from(o, off * 8)[0]
                    last = _I64.unpack_from(o, (off + n) * 8)[0]
                nb = (n + 1) * width
                if first:
                    add(np.frombuffer(o, "<i4" if width == 4 else "<i8", n + 1, off * width) - first)
                elif off or o.size != nb:
                    add(o.slice(off * width, nb))
                else:
                    add(o)
                size(nb)
            if kind in (_BINARY, _LARGE_BINARY):
                if last > first:
                    d = bufs[2]
                    if first or d.size != last:
                        d = d.slice(first, last - first)
                    add(d)
                    size(last - first)
                else:
                    add(None)
                    size(0)
            else:
                values = arr.values
                if first or last != len(values):
                    values = values.slice(first, last - first)
                self.walk(values, children[0])
        elif kind == _BOOL:
            nb = (n + 7) >> 3
            if nb:
                d = bufs[1]
                if off & 7:
                    d = _bitmap(d, off, n)
                elif off or d.size != nb:
                    d = d.slice(off >> 3, nb)
                add(d)
                size(nb)
            else:
                add(None)
                size(0)
        elif kind == _STRUCT:
            walk = self.walk
            for i, child in enumerate(children):
                walk(arr.field(i), child)
        elif kind == _FIXED_BYTES:
            nb = n * width
            if nb:
                d = bufs[1]
                if off or d.size != nb:
                    d = d.slice(off * width, nb)
                add(d)
                size(nb)
            else:
                add(None)
                size(0)
        else:  # _FIXED_LIST
            values = arr.values
            if off or len(values) != n * width:
                values = values.slice(off * width, n * width)
            self.walk(values, children[0])


(
    _NULL,
    _FIXED,
    _FIXED_BYTES,
    _BOOL,
    _BINARY,
    _LARGE_BINARY,
    _VIEW,
    _LIST,
    _LARGE_LIST,
    _LIST_VIEW,
    _LARGE_LIST_VIEW,
    _FIXED_LIST,
    _STRUCT,
    _UNION,
    _RUN_END,
    _DICTIONARY,
    _EXTENSION,
    _OTHER,
) = range(18)
_KINDS: dict[int, int] = {}

#: A column's walk, fixed per schema: (kind, width (bytes per value; offset width for binary and list
#: kinds; list size for fixed-size lists), path (for dictionary ids), child plans). Kinds the fast walk does
#: not handle are _OTHER and go to :meth:`_Flattener.visit`.
_Plan = tuple[int, int, tuple[int, ...], tuple["_Plan", ...]]

#: IPC buffers of each flat kind (see MessageEncoder._encode_flat).
_FLAT_BUFFERS = {_NULL: 0, _FIXED: 2, _BOOL: 2, _BINARY: 3}

#: The kind numbers :mod:`dissoc.codec.bulk` takes, by name.
_KIND_NAMES = {
    "null": _NULL,
    "fixed": _FIXED,
    "fixed_bytes": _FIXED_BYTES,
    "bool": _BOOL,
    "binary": _BINARY,
    "large_binary": _LARGE_BINARY,
    "list": _LIST,
    "large_list": _LARGE_LIST,
    "struct": _STRUCT,
    "fixed_list": _FIXED_LIST,
}


def _plan(ty: pa.DataType, path: tuple[int, ...]) -> _Plan:
    """The walk of one field of type ``ty`` at ``path``."""
    kind = _kind_of(ty)
    width = 0
    children: tuple[_Plan, ...] = ()
    if kind == _FIXED:
        width = ty.bit_width // 8
    elif kind == _FIXED_BYTES:
        width = ty.byte_width
    elif kind in (_BINARY, _LIST):
        width = 4
    elif kind in (_LARGE_BINARY, _LARGE_LIST):
        width = 8
    elif kind == _FIXED_LIST:
        width = ty.list_size
    elif kind not in (_NULL, _BOOL, _STRUCT):
        return (_OTHER, 0, path, ())
    if kind in (_LIST, _LARGE_LIST, _FIXED_LIST):
        children = (_plan(ty.field(0).type, (*path, 0)),)
    elif kind == _STRUCT:
        children = tuple(_plan(ty.field(i).type, (*path, i)) for i in range(ty.num_fields))
    return (kind, width, path, children)


def _kind_of(ty: pa.DataType) -> int:
    """The layout kind of a type (cached by type id where the id decides it)."""
    t = pa.types
    if isinstance(ty, pa.BaseExtensionType):
        return _EXTENSION
    if t.is_dictionary(ty):
        kind = _DICTIONARY
    elif t.is_null(ty):
        kind = _NULL
    elif t.is_boolean(ty):
        kind = _BOOL
    elif t.is_binary(ty) or t.is_string(ty):
        kind = _BINARY
    elif t.is_large_binary(ty) or t.is_large_string(ty):
        kind = _LARGE_BINARY
    elif t.is_binary_view(ty) or t.is_string_view(ty):
        kind = _VIEW
    elif t.is_list(ty) or t.is_map(ty):
        kind = _LIST
    elif t.is_large_list(ty):
        kind = _LARGE_LIST
    elif t.is_list_view(ty):
        kind = _LIST_VIEW
    elif t.is_large_list_view(ty):
        kind = _LARGE_LIST_VIEW
    elif t.is_fixed_size_list(ty):
        kind = _FIXED_LIST
    elif t.is_struct(ty):
        kind = _STRUCT
    elif t.is_union(ty):
        kind = _UNION
    elif t.is_run_end_encoded(ty):
        kind = _RUN_END
    elif t.is_fixed_size_binary(ty) or t.is_decimal(ty):
        kind = _FIXED_BYTES
    else:
        try:
            width = ty.bit_width
        except ValueError:
            width = 0
        if width < 8 or width % 8:
            raise CodecError(f"cannot encode arrays of type {ty}")
        kind = _FIXED
    _KINDS[ty.id] = kind
    return kind


def _ree_children(arr: pa.Array) -> tuple[pa.Array, pa.Array]:
    """Run ends and values covering exactly the array's logical slice."""
    run_ends, values = arr.run_ends, arr.values
    off, n = arr.offset, len(arr)
    if off == 0 and (len(run_ends) == 0 or run_ends[-1].as_py() == n):
        return run_ends, values
    ends = run_ends.to_numpy(zero_copy_only=False)
    if n == 0:
        return run_ends.slice(0, 0), values.slice(0, 0)
    lo = int(np.searchsorted(ends, off, side="right"))
    hi = int(np.searchsorted(ends, off + n - 1, side="right"))
    new_ends = np.minimum(ends[lo : hi + 1] - off, n).astype(ends.dtype)
    return pa.array(new_ends, run_ends.type), values.slice(lo, hi - lo + 1)


_OPAQUE_TYPES = {
    pa.lib.Type_INTERVAL_MONTHS: pa.int32(),
    pa.lib.Type_INTERVAL_DAY_TIME: pa.binary(8),
}


def _python_safe(ty: pa.DataType) -> pa.DataType:
    """``ty`` with types pyarrow cannot give Python (month, day-time intervals) replaced by same layouts."""

    def replace(t: pa.DataType) -> pa.DataType | None:
        if t.id in _OPAQUE_TYPES:
            return _OPAQUE_TYPES[t.id]
        if isinstance(t, pa.BaseExtensionType):
            storage = _python_safe(t.storage_type)
            return t if storage.equals(t.storage_type) else storage
        return None

    return map_type(ty, replace)


def _delta_safe(ty: pa.DataType, top: bool = True) -> bool:
    """Whether readers (pyarrow's included) can append a delta to a dictionary of this value type: not over
    nested dictionaries, nor extension types below the top level (pyarrow cannot concatenate those)."""
    if pa.types.is_dictionary(ty):
        return False
    if isinstance(ty, pa.BaseExtensionType):
        return top and _delta_safe(ty.storage_type, False)
    return all(_delta_safe(ty.field(i).type, False) for i in range(ty.num_fields))


class MessageEncoder:
    """Encode record batches of one schema into IPC messages, split into metadata and body buffers.

    :meth:`encode` returns the DictionaryBatch messages a batch needs (new dictionaries, deltas or
    replacements) followed by its RecordBatch message.
    """

    def __init__(
        self,
        schema: pa.Schema,
        *,
        compression: str | None = None,
        emit_dictionary_deltas: bool = False,
        allow_dictionary_replacement: bool = True,
    ) -> None:
        if not isinstance(schema, pa.Schema):
            raise TypeError(f"schema must be a pyarrow.Schema, got {type(schema).__name__}")
        self.schema = schema
        self.compression = codec_id(compression)
        self.emit_dictionary_deltas = emit_dictionary_deltas
        self.allow_dictionary_replacement = allow_dictionary_replacement
        self.ids = DictionaryIds(schema)
        self._dicts: dict[int, pa.Array] = {}
        safe = pa.schema([f.with_type(_python_safe(f.type)) for f in schema])
        self._storage_schema = None if safe.equals(schema) else safe
        self._plans = [_plan(f.type, (i,)) for i, f in enumerate(safe)]
        # Schemas of only fixed-width, boolean, binary, string and null columns: one loop does everything.
        flat_kinds = {_NULL: _NULL, _FIXED: _FIXED, _FIXED_BYTES: _FIXED, _BOOL: _BOOL, _BINARY: _BINARY}
        flat_kinds[_LARGE_BINARY] = _BINARY
        self._flat: list[tuple[int, int]] | None = None
        if self.compression is None and all(p[0] in flat_kinds for p in self._plans):
            self._flat = [(flat_kinds[p[0]], p[1]) for p in self._plans]
            n_buffers = sum(_FLAT_BUFFERS[k] for k, _ in self._flat)
            self._flat_template = message_template(HeaderType.RecordBatch, len(self._flat), n_buffers)
        wide = len(schema) >= (BULK_COLUMNS if self._flat is None else BULK_FLAT_COLUMNS)
        self._bulk = bulk.make_plan(self._plans, _KIND_NAMES) if wide and self.compression is None else None
        # Code for the schema, where the bulk walk does not take its batches (wide ones: the code would only
        # see the sliced batches that the bulk walk leaves, and decline them too).
        self._flat_code: Callable[[pa.RecordBatch], EncodedMessage | None] = _decline
        if self._flat is not None and self._bulk is None:
            names = {_NULL: "null", _FIXED: "fixed", _BOOL: "bool", _BINARY: "binary"}
            self._flat_code = compile_flat(
                [(names[k], w) for k, w in self._flat], self._flat_template, EncodedMessage, _PADS
            )

    def schema_message(self) -> EncodedMessage:
        """The Schema message that starts every stream."""
        b = flatbuffers.Builder(1024)
        off = encode_schema(b, self.schema, self.ids)
        return EncodedMessage(build_message(b, HeaderType.Schema, off, 0), [], 0, HeaderType.Schema)

    def encode(self, batch: pa.RecordBatch) -> list[EncodedMessage]:
        """The messages for one batch: dictionary batches first, then the record batch."""
        schema = batch.schema
        if schema is not self.schema and not schema.equals(self.schema, check_metadata=False):
            raise CodecError(f"batch schema {schema} does not match the stream schema {self.schema}")
        if self._storage_schema is not None:
            batch = cdata.view_as(batch, self._storage_schema)
        if self._bulk is not None:
            flat = bulk.flatten(batch, self._bulk)
            if flat is not None:
                template = message_template(HeaderType.RecordBatch, self._bulk.n_nodes, len(flat.spans))
                meta = template.fill(flat.body_length, batch.num_rows, flat.nodes, flat.spans)
                return [EncodedMessage(meta, flat.body, flat.body_length, HeaderType.RecordBatch)]
        if self._flat is not None:
            # the code made for this schema, else (a sliced column, no rows) the general one-pass loop
            return [self._flat_code(batch) or self._encode_flat(batch, self._flat)]
        fl = _Flattener(self.ids)
        walk = fl.walk
        for column, plan in zip(batch.columns, self._plans, strict=True):
            walk(column, plan)
        out: list[EncodedMessage] = []
        seen: set[int] = set()
        for did, dictionary, path in fl.dictionaries:
            self._dictionary_messages(did, dictionary, path, out, seen)
        out.append(self._message(HeaderType.RecordBatch, batch.num_rows, fl))
        return out

    def _encode_flat(self, batch: pa.RecordBatch, plans: list[tuple[int, int]]) -> EncodedMessage:
        """The RecordBatch message of a batch of flat columns (fixed width, boolean, binary, null): nodes,
        spans and body in one pass, buffers used as they are wherever they already hold exactly the bytes."""
        n = batch.num_rows  # every column's length
        bitmap = (n + 7) >> 3  # bytes of a bitmap of n bits, and the padding after it
        bitmap_pad = -bitmap & 7
        bitmap_padded = bitmap + bitmap_pad
        nodes: list[int] = []
        spans: list[int] = []
        body: list[Any] = []
        add, span, node = body.append, spans.append, nodes.append
        pads = _PADS
        pos = 0
        null_kind, fixed_kind, binary_kind = _NULL, _FIXED, _BINARY
        for arr, (kind, width) in zip(batch.columns, plans, strict=False):
            if kind == null_kind:
                node(n)
                node(n)
                continue
            off = arr.offset
            nulls = arr.null_count
            node(n)
            node(nulls)
            bufs = arr.buffers()
            if nulls:
                v = bufs[0]
                if off:
                    v = _bitmap(v, off, n) if off & 7 else v.slice(off >> 3, bitmap)
                elif v.size != bitmap:
                    v = v.slice(0, bitmap)
                span(pos)
                span(bitmap)
                add(v)
                if bitmap_pad:
                    add(pads[bitmap_pad])
                pos += bitmap_padded
            else:
                span(pos)
                span(0)
            if kind == fixed_kind:
                nb = n * width
                if nb:
                    d = bufs[1]
                    if off or d.size != nb:
                        d = d.slice(off * width, nb)
                    span(pos)
                    span(nb)
                    add(d)
                    pad = -nb & 7
                    if pad:
                        add(pads[pad])
                    pos += nb + pad
                else:
                    span(pos)
                    span(0)
            elif kind == binary_kind:
                if n == 0:
                    span(pos)
                    span(0)
                    span(pos)
                    span(0)
                    continue
                o = bufs[1]
                fmt = _I32 if width == 4 else _I64
                last = fmt.unpack_from(o, (off + n) * width)[0]
                nb = (n + 1) * width
                if off:
                    # A slice: offsets rebased to start at 0 (a copy), data from the first offset on.
                    first = fmt.unpack_from(o, off * width)[0]
                    if first:
                        o = np.frombuffer(o, "<i4" if width == 4 else "<i8", n + 1, off * width) - first
                    else:
                        o = o.slice(off * width, nb)
                else:
                    # Unsliced: the offsets as they are, the data from the buffer's start (a first offset
                    # above 0 leaves bytes in front that readers skip).
                    first = 0
                    if o.size != nb:
                        o = o.slice(0, nb)
                span(pos)
                span(nb)
                add(o)
                pad = -nb & 7
                if pad:
                    add(pads[pad])
                pos += nb + pad
                nb = last - first
                if nb > 0:
                    d = bufs[2]
                    if first or d.size != nb:
                        d = d.slice(first, nb)
                    span(pos)
                    span(nb)
                    add(d)
                    pad = -nb & 7
                    if pad:
                        add(pads[pad])
                    pos += nb + pad
                else:
                    span(pos)
                    span(0)
            elif bitmap:  # boolean values: a bitmap
                d = bufs[1]
                if off:
                    d = _bitmap(d, off, n) if off & 7 else d.slice(off >> 3, bitmap)
                elif d.size != bitmap:
                    d = d.slice(0, bitmap)
                span(pos)
                span(bitmap)
                add(d)
                if bitmap_pad:
                    add(pads[bitmap_pad])
                pos += bitmap_padded
            else:
                span(pos)
                span(0)
        return EncodedMessage(
            self._flat_template.fill(pos, n, nodes, spans), body, pos, HeaderType.RecordBatch
        )

    def _dictionary_messages(
        self, did: int, dictionary: pa.Array, path: tuple[int, ...], out: list[EncodedMessage], seen: set[int]
    ) -> None:
        if did in seen:
            return
        seen.add(did)
        prev = self._dicts.get(did)
        if prev is not None and (prev is dictionary or prev.equals(dictionary)):
            return
        delta = False
        values = dictionary
        if prev is not None:
            if (
                self.emit_dictionary_deltas
                and _delta_safe(dictionary.type)
                and len(dictionary) >= len(prev)
                and dictionary.slice(0, len(prev)).equals(prev)
            ):
                delta = True
                values = dictionary.slice(len(prev))
            elif not self.allow_dictionary_replacement:
                raise CodecError(
                    f"dictionary id {did} changed between batches; the IPC file format cannot replace a "
                    "dictionary (only deltas, with emit_dictionary_deltas=True)"
                )
        fl = _Flattener(self.ids)
        fl.visit(values, (*path, -1))
        # Dictionaries nested in these values must reach the reader first.
        for inner_id, inner, inner_path in fl.dictionaries:
            self._dictionary_messages(inner_id, inner, inner_path, out, seen)
        out.append(self._message(HeaderType.DictionaryBatch, len(values), fl, did, delta))
        self._dicts[did] = dictionary
        log.debug("dictionary id=%#x delta=%s length=%d", did, delta, len(values))

    def _message(
        self, kind: int, length: int, fl: _Flattener, dict_id: int = 0, delta: bool = False
    ) -> EncodedMessage:
        body: list[Any] = []
        spans: list[int] = []  # flat: offset, length, offset, length, ...
        pos = 0
        comp = self.compression
        add, span = body.append, spans.append
        if comp is None:
            for buf, n in zip(fl.buffers, fl.sizes, strict=True):
                span(pos)
                span(n)
                if n:
                    add(buf)
                    pos += n
                    pad = -n & 7
                    if pad:
                        add(_PADS[pad])
                        pos += pad
        else:
            for buf, n in zip(fl.buffers, fl.sizes, strict=True):
                if n == 0:
                    span(pos)
                    span(0)
                    continue
                mv = memoryview(buf)
                packed = compress_buffer(comp, mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B"))
                if packed is None:
                    add(_MINUS_ONE)
                    add(buf)
                    n += 8
                else:
                    add(packed)
                    n = len(packed)
                span(pos)
                span(n)
                pos += n
                pad = -n & 7
                if pad:
                    add(_PADS[pad])
                    pos += pad
        variadic = fl.variadic
        template = message_template(kind, len(fl.nodes) >> 1, len(fl.sizes), comp, len(variadic))
        meta = template.fill(
            pos,
            length,
            fl.nodes,
            spans,
            variadic,
            (dict_id, delta) if kind == HeaderType.DictionaryBatch else None,
        )
        return EncodedMessage(meta, body, pos, kind)
