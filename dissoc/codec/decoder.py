"""Decoding: Message metadata and a body given as separate arguments -> ``pyarrow.RecordBatch``.

This is the push decoder that Dissociated IPC needs: it never reads anything itself, it is handed the metadata
and, for batches, the body (packed bytes, or memory the caller mapped). Uncompressed little-endian bodies are
never copied: arrays are built over the body through the C Data Interface (see :mod:`dissoc.codec.cdata`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from dissoc.codec import cdata
from dissoc.codec.checks import check_node, check_run_ends
from dissoc.codec.compression import decompress_buffer
from dissoc.codec.message import (
    HeaderType,
    MessageInfo,
    RecordBatchHeader,
    parse_message,
    parse_record_batch,
)
from dissoc.codec.schema import (
    IPC_BUFFERS,
    SWAP_MONTH_DAY_NANO,
    SWAP_REVERSE,
    DictionaryInfo,
    FieldPlan,
    Layout,
    SchemaInfo,
    decode_schema,
    map_type,
)
from dissoc.errors import CodecError

__all__ = ["MessageDecoder", "ParsedMessage", "ScatteredBody", "parse"]

log = logging.getLogger(__name__)

_NO_VALIDITY = {Layout.NULL, Layout.SPARSE_UNION, Layout.DENSE_UNION, Layout.RUN_END}
_UNIONS = {Layout.SPARSE_UNION, Layout.DENSE_UNION}
#: Layouts whose data buffer Arrow's C importer sizes from the offsets themselves.
_SIZED_BY_OFFSETS = {Layout.BINARY, Layout.LARGE_BINARY}


@dataclass(slots=True)
class ParsedMessage:
    """A parsed Message: its header fields, and for batches the nodes and buffers (offsets, lengths)."""

    info: MessageInfo
    batch: RecordBatchHeader | None = None
    dictionary_id: int | None = None
    is_delta: bool = False

    @property
    def header_type(self) -> int:
        return self.info.header_type

    @property
    def body_length(self) -> int:
        return self.info.body_length

    @property
    def has_body(self) -> bool:
        return self.info.header_type in (HeaderType.RecordBatch, HeaderType.DictionaryBatch)


def parse(metadata: object) -> ParsedMessage:
    """Parse a Message flatbuffer and, for batches, their RecordBatch header."""
    info = parse_message(metadata)
    assert info.header is not None
    if info.header_type == HeaderType.RecordBatch:
        return ParsedMessage(info, parse_record_batch(info.header))
    if info.header_type == HeaderType.DictionaryBatch:
        h = info.header
        data = h.table(1, "RecordBatch")
        if data is None:
            raise CodecError("DictionaryBatch: its RecordBatch (data) is missing")
        return ParsedMessage(
            info, parse_record_batch(data), h.scalar(0, "q", 0), bool(h.scalar(2, "?", False))
        )
    if info.header_type in (HeaderType.Tensor, HeaderType.SparseTensor):
        raise CodecError(
            f"unsupported message type {HeaderType(info.header_type).name}: not part of IPC streams"
        )
    return ParsedMessage(info)


def _fully_validatable(ty: pa.DataType) -> bool:
    """Whether pyarrow's full validation of this type checks memory safety only (no value semantics)."""
    t = pa.types
    if isinstance(ty, pa.BaseExtensionType):
        return _fully_validatable(ty.storage_type)
    if t.is_dictionary(ty):
        return _fully_validatable(ty.value_type)
    if t.is_decimal(ty) or t.is_date64(ty) or t.is_time(ty) or t.is_binary_view(ty) or t.is_string_view(ty):
        return False
    return all(_fully_validatable(ty.field(i).type) for i in range(ty.num_fields))


class _Compiled:
    """A list of top-level plans flattened into the index arrays the bulk import needs."""

    def __init__(self, plans: list[FieldPlan], schema: pa.Schema, v4_unions: bool) -> None:
        flat: list[FieldPlan] = []
        children: list[list[int]] = [[]]  # struct 0 is the root

        def visit(p: FieldPlan) -> int:
            flat.append(p)
            children.append([])
            idx = len(flat)  # struct index of this node
            kids = [] if p.dict_id >= 0 else p.children
            children[idx] = [visit(c) for c in kids]
            return idx

        children[0] = [visit(p) for p in plans]
        self.child_nodes = [[k - 1 for k in kids] for kids in children[1:]]
        self.schema = schema
        # Parsed RecordBatch messages and prepared layouts by metadata bytes, shared by every decoder of
        # this schema.
        self.parsed: dict[bytes, ParsedMessage] = {}
        self.prepared: dict[bytes, _Prepared] = {}
        self.scattered: dict[bytes, tuple[_Prepared, npt.NDArray[np.intp], npt.NDArray[np.bool_]]] = {}
        self.flat = flat
        n = len(flat)
        self.n_nodes = n
        layouts = np.array([p.layout for p in flat], np.int64)
        self.layouts = layouts
        self.nbuf_ipc = np.array([IPC_BUFFERS[Layout(x)] for x in layouts.tolist()], np.int64)
        self.has_validity = np.array([Layout(x) not in _NO_VALIDITY for x in layouts.tolist()], bool)
        self.drop_first = np.zeros(n, bool)
        if v4_unions:
            self.drop_first = np.isin(layouts, [Layout.SPARSE_UNION, Layout.DENSE_UNION])
            self.nbuf_ipc = self.nbuf_ipc + self.drop_first
        self.view_nodes = np.flatnonzero(layouts == Layout.VIEW)
        self.null_nodes = np.flatnonzero(layouts == Layout.NULL)
        self.dict_nodes = [(i, p.dict_id) for i, p in enumerate(flat) if p.dict_id >= 0]
        self.n_children = np.array([len(c) for c in children], np.uint64)
        self.child_idx = np.array([i for c in children for i in c], np.uint64)
        cs = np.zeros(n + 1, np.uint64)
        np.cumsum(self.n_children[:-1], out=cs[1:])
        self.child_start = cs
        self.simple = not self.view_nodes.size and not v4_unions
        # The parts of the struct tree that do not change from batch to batch.
        tmpl = np.zeros((n + 1, 10), np.uint64)
        tmpl[0, 3] = 1
        tmpl[1:, 3] = self.nbuf_ipc - self.drop_first + (layouts == Layout.VIEW)
        tmpl[:, 4] = self.n_children
        self.template = tmpl
        self.total_buffers = int(self.nbuf_ipc.sum())
        self.size_rules = None if self.view_nodes.size else _size_rules(flat, self.nbuf_ipc, self.drop_first)
        self.has_kids = (self.n_children > 0).astype(np.uint64)
        self.child_rel = self.child_start * np.uint64(8)
        self.child_idx80 = self.child_idx * np.uint64(cdata.STRUCT_SIZE)
        rel = np.zeros(n + 1, np.uint64)
        rel[1:] = (np.uint64(1) + _exclusive_cumsum(self.nbuf_ipc).astype(np.uint64)) * np.uint64(8)
        self.buf_rel = rel  # valid for simple plans: byte offset of each struct's buffer list
        vn = np.flatnonzero(self.has_validity)
        self.validity_nodes = vn
        self.validity_pos = _exclusive_cumsum(self.nbuf_ipc)[vn] + 1  # in the pointer array (after root's)
        risky = {
            Layout.BINARY,
            Layout.LARGE_BINARY,
            Layout.LIST,
            Layout.LARGE_LIST,
            Layout.LIST_VIEW,
            Layout.LARGE_LIST_VIEW,
            Layout.VIEW,
            Layout.SPARSE_UNION,
            Layout.DENSE_UNION,
            Layout.RUN_END,
        }
        # Content checks: columns whose types pyarrow's full validation judges only on memory safety are
        # validated by it in one C++ call; the others (decimals, date64, times, views, whose full validation
        # also rejects legal values) get this module's numpy checks, node by node.
        starts = [k - 1 for k in children[0]] + [n]
        self.full_columns: list[int] = []
        self.checked: list[int] = []
        self.offset_bounds: list[tuple[int, int]] = []  # (binary node, offset width) of full columns
        for col, plan in enumerate(plans):
            nodes_of_col = range(starts[col], starts[col + 1])
            risky_nodes = [j for j in nodes_of_col if flat[j].layout in risky or flat[j].dict_id >= 0]
            if not risky_nodes:
                continue
            if _fully_validatable(plan.field.type):
                self.full_columns.append(col)
                # Arrow's C importer sizes a binary node's data buffer from its last offset, so its full
                # validation cannot see offsets past the data received: the bounds are checked here.
                self.offset_bounds.extend(
                    (j, 8 if flat[j].layout == Layout.LARGE_BINARY else 4)
                    for j in risky_nodes
                    if flat[j].layout in _SIZED_BY_OFFSETS
                )
            else:
                self.checked.extend(risky_nodes)
        self.all_full = len(self.full_columns) == len(plans)
        # Large batches check every risky node with numpy instead: pyarrow's full validation also checks
        # UTF-8, which costs more per byte than numpy's offset checks.
        self.checked_all = [i for i, p in enumerate(flat) if p.layout in risky or p.dict_id >= 0]


def _exclusive_cumsum(a: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    out = np.zeros(len(a), np.int64)
    if len(a) > 1:
        np.cumsum(a[:-1], out=out[1:])
    return out


_CACHE_SIZE = 64
_SMALL_BATCH_ROWS = 8192
#: Node lengths above this need more bytes than any body can have (see _required_sizes).
_MAX_NODE_LENGTH = 1 << 56
#: Schemas decoded in this process, by their Schema message bytes: (schema info, version, compiled plans).
#: A client opens one stream per request, each starting with the same Schema message; sharing the compiled
#: plans (and, through them, the parsed and prepared batch layouts) saves ~0.35 ms per stream. Everything
#: shared is read-only once built.
_SCHEMAS: dict[bytes, tuple[SchemaInfo, int, _Compiled]] = {}
_SCHEMAS_LOCK = threading.Lock()


def _remember(cache: dict[bytes, Any], key: bytes, value: Any) -> None:
    """Insert into a bounded cache that other threads may use too (evicting the oldest entry)."""
    if len(cache) >= _CACHE_SIZE:
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):
            cache.pop(next(iter(cache)))
    cache[key] = value


@dataclass(eq=False, slots=True)
class _Prepared:
    """The metadata-only part of decoding one uncompressed batch layout: a struct template with pointers
    relative to the allocation (``mem_index``) and to the body (``body_index``)."""

    compiled: _Compiled
    words: npt.NDArray[np.uint64]
    mem_index: npt.NDArray[np.intp]
    body_index: npt.NDArray[np.intp]
    extra: list[Any]
    nodes: npt.NDArray[np.int64]
    nbuf: npt.NDArray[np.int64]
    first: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.uint64]
    lengths: npt.NDArray[np.int64]
    body_length: int
    absolute: bool = False


def _relative_pointers(
    c: _Compiled,
    nbuf: npt.NDArray[np.int64],
    first: npt.NDArray[np.int64],
    rel: npt.NDArray[np.uint64],
    in_body: npt.NDArray[np.bool_],
    lengths: npt.NDArray[np.int64],
    extra: list[Any],
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.bool_]]:
    """The C buffer list (V4 union validity dropped, view sizes added) and which entries are body-relative."""
    ptrs: list[Any] = [np.zeros(1, np.uint64)]
    mask: list[Any] = [np.zeros(1, bool)]
    for i in range(c.n_nodes):
        s, e = int(first[i]), int(first[i] + nbuf[i])
        if c.drop_first[i]:
            s += 1
        ptrs.append(rel[s:e])
        mask.append(in_body[s:e])
        if c.layouts[i] == Layout.VIEW:
            sizes = np.ascontiguousarray(lengths[first[i] + 2 : first[i] + nbuf[i]], np.int64)
            extra.append(sizes)
            ptrs.append(np.array([sizes.ctypes.data], np.uint64))
            mask.append(np.zeros(1, bool))
    return np.concatenate(ptrs), np.concatenate(mask)


def _concat(a: pa.Array, b: pa.Array) -> pa.Array:
    """``a`` followed by ``b``. pyarrow cannot concatenate extension types nested in others: those are joined
    as their storage types (the same memory, viewed through the C Data Interface) and viewed back."""
    try:
        return pa.concat_arrays([a, b])
    except pa.ArrowNotImplementedError:
        storage = _storage_type(a.type)
        if storage.equals(a.type):
            raise
        return cdata.view_as(pa.concat_arrays([cdata.view_as(a, storage), cdata.view_as(b, storage)]), a.type)


def _storage_type(ty: pa.DataType) -> pa.DataType:
    """``ty`` with every extension type replaced by its storage type."""
    return map_type(
        ty, lambda t: _storage_type(t.storage_type) if isinstance(t, pa.BaseExtensionType) else None
    )


class ScatteredBody:
    """A message body given as one buffer per entry of the metadata's ``buffers`` (None or empty for an
    empty one), wherever each lies: what address/length pair lists describe."""

    __slots__ = ("buffers",)

    def __init__(self, buffers: list[pa.Buffer | None]) -> None:
        self.buffers = buffers


_EMPTY_BODY = pa.py_buffer(b"")


class MessageDecoder:
    """Decode a stream of Message metadata (+ bodies) into ``pa.RecordBatch`` objects.

    Call :meth:`decode` once per message, in stream order. Schema and dictionary messages return ``None``;
    record batches return a ``pa.RecordBatch`` built over ``body`` without copying it (uncompressed,
    little-endian data). With ``validate`` (the default) offsets, views, union ids, dictionary indices and run
    ends are checked (see :mod:`dissoc.codec.checks`), so that malformed data from the wire raises
    :class:`CodecError` instead of producing arrays that read out of bounds; buffer sizes are always checked.
    Turn it off only for trusted producers.
    """

    def __init__(
        self,
        *,
        validate: bool = True,
        max_buffer_bytes: int = 1 << 34,
        allow_dictionary_replacement: bool = True,
        schema: pa.Schema | None = None,
    ) -> None:
        self.validate = validate
        self.max_buffer_bytes = max_buffer_bytes
        self.allow_dictionary_replacement = allow_dictionary_replacement
        self._info: SchemaInfo | None = None
        self._compiled: _Compiled | None = None
        self._dict_compiled: dict[int, _Compiled] = {}
        self._prepared: dict[bytes, _Prepared] = {}
        self._parsed: dict[bytes, ParsedMessage] = {}
        self.dictionaries: dict[int, pa.Array] = {}
        self._version = 4
        if schema is not None:
            raise CodecError("MessageDecoder(schema=...) is not supported: decode the schema message first")

    @property
    def schema(self) -> pa.Schema | None:
        """The stream's schema, once its Schema message has been decoded."""
        return None if self._info is None else self._info.schema

    @property
    def schema_info(self) -> SchemaInfo | None:
        return self._info

    @property
    def checks_contents(self) -> bool:
        """Whether this stream's batches have contents to check (offsets, views, union ids, dictionary
        indices, run ends): False for schemas of fixed-width columns only, whose memory safety the sizes
        checked from the metadata already guarantee."""
        c = self._compiled
        return c is not None and bool(c.checked_all or c.full_columns or c.dict_nodes)

    def decode(self, metadata: object, body: object = None) -> pa.RecordBatch | None:
        """Decode one message; ``body`` is bytes-like (or a ``pa.Buffer``) for batch messages.

        Streams of same-shaped batches repeat their metadata byte for byte: the parsed header and the
        prepared layout are cached per metadata, so such a batch costs little more than pointing the cached
        layout at its body (the body's contents are still checked every time). Decoded schemas, and with
        them those caches, are shared by the decoders of a process.
        """
        key = bytes(metadata) if isinstance(metadata, (bytes, memoryview)) else None
        if key is not None and self._info is None:
            known = _SCHEMAS.get(key)
            if known is not None:
                self._use_schema(*known)
                return None
        return self.decode_parsed(self._parse_cached(metadata, key), body, key)

    def _parse_cached(self, metadata: object, key: bytes | None) -> ParsedMessage:
        msg = self._parsed.get(key) if key is not None else None
        if msg is None:
            msg = parse(metadata)
            if key is not None and msg.header_type == HeaderType.RecordBatch:
                _remember(self._parsed, key, msg)
        return msg

    def has_body(self, metadata: object) -> bool:
        """Whether a message carries a body on the data stream (parsing through this decoder's cache)."""
        key = bytes(metadata) if isinstance(metadata, (bytes, memoryview)) else None
        return self._parse_cached(metadata, key).has_body

    def decode_parsed(
        self, msg: ParsedMessage, body: object = None, key: bytes | None = None
    ) -> pa.RecordBatch | None:
        info = msg.info
        if info.header_type == HeaderType.Schema:
            if self._info is not None:
                raise CodecError("a second Schema message arrived; a stream has exactly one")
            assert info.header is not None
            self.set_schema(decode_schema(info.header, info.version), info.version)
            if key is not None:
                assert self._info is not None and self._compiled is not None
                with _SCHEMAS_LOCK:
                    _remember(_SCHEMAS, key, (self._info, self._version, self._compiled))
            return None
        if self._info is None:
            raise CodecError(
                f"a {HeaderType(info.header_type).name} message arrived before the Schema message"
            )
        buf: Any = body if isinstance(body, ScatteredBody) else _as_buffer(body)
        if not isinstance(buf, ScatteredBody) and buf.size < info.body_length:
            raise CodecError(f"message body: expected {info.body_length} bytes, got {buf.size}")
        assert msg.batch is not None
        if info.header_type == HeaderType.DictionaryBatch:
            assert msg.dictionary_id is not None
            self._decode_dictionary(msg.dictionary_id, msg.is_delta, msg.batch, buf, info.body_length)
            return None
        assert self._compiled is not None
        return self._decode_batch(self._compiled, msg.batch, buf, info.body_length, key)

    def set_schema(self, info: SchemaInfo, version: int = 4) -> None:
        """Start decoding with a schema decoded elsewhere (e.g. from a file footer)."""
        self._use_schema(info, version, _Compiled(info.plans, info.schema, version < 4))

    def _use_schema(self, info: SchemaInfo, version: int, compiled: _Compiled) -> None:
        self._info = info
        self._version = version
        self._compiled = compiled
        self._prepared = compiled.prepared
        self._parsed = compiled.parsed

    # ------------------------------------------------------------------------------------------ dictionaries

    def _decode_dictionary(
        self, dict_id: int, is_delta: bool, header: RecordBatchHeader, body: Any, body_length: int
    ) -> None:
        assert self._info is not None
        dinfo = self._info.dictionaries.get(dict_id)
        if dinfo is None:
            known = sorted(self._info.dictionaries)
            raise CodecError(f"DictionaryBatch: id {dict_id} is not in the schema (known ids: {known})")
        compiled = self._dict_compiled.get(dict_id)
        if compiled is None:
            compiled = _Compiled([dinfo.value_plan], pa.schema([dinfo.value_plan.field]), self._version < 4)
            self._dict_compiled[dict_id] = compiled
        values = self._decode_batch(compiled, header, body, body_length).column(0)
        prev = self.dictionaries.get(dict_id)
        if is_delta:
            if prev is None:
                raise CodecError(f"DictionaryBatch: delta for id {dict_id} before any dictionary for it")
            try:
                values = _concat(prev, values)
            except pa.ArrowException as e:
                raise CodecError(f"DictionaryBatch: cannot apply delta to id {dict_id}: {e}") from None
        elif prev is not None and not self.allow_dictionary_replacement:
            raise CodecError(
                f"DictionaryBatch: replacement of dictionary id {dict_id} is not allowed in the file format"
            )
        log.debug("dictionary id=%#x delta=%s length=%d", dict_id, is_delta, len(values))
        self.dictionaries[dict_id] = values

    def dictionary_info(self, dict_id: int) -> DictionaryInfo | None:
        return None if self._info is None else self._info.dictionaries.get(dict_id)

    # ------------------------------------------------------------------------------------------ batches

    def _decode_batch(
        self, c: _Compiled, h: RecordBatchHeader, body: Any, body_length: int, key: bytes | None = None
    ) -> pa.RecordBatch:
        assert self._info is not None
        if isinstance(body, ScatteredBody):
            return self._decode_scattered(c, h, body, body_length, key)
        if h.compression is not None or self._info.big_endian:
            return self._decode_general(c, h, body, body_length)
        cache = self._prepared
        prep = cache.get(key) if key is not None else None
        if prep is None or prep.compiled is not c:
            prep = self._prepare(c, h, body_length)
            if key is not None:
                _remember(cache, key, prep)
        return self._instantiate(c, prep, body)

    def _layout(self, c: _Compiled, h: RecordBatchHeader, limit: int) -> npt.NDArray[np.int64]:
        """Check the header against the schema and a ``limit``-byte body; returns IPC buffers per node."""
        nodes = h.nodes
        if len(nodes) != c.n_nodes:
            raise CodecError(
                f"RecordBatch: the schema has {c.n_nodes} field nodes, the message lists {len(nodes)}"
            )
        nbuf = c.nbuf_ipc
        if c.view_nodes.size:
            vc = h.variadic_counts
            if vc is None or len(vc) != len(c.view_nodes):
                raise CodecError(
                    f"RecordBatch: {len(c.view_nodes)} view fields need as many variadicBufferCounts, "
                    f"got {0 if vc is None else len(vc)}"
                )
            if int(vc.max()) > 1 << 20:
                raise CodecError(f"RecordBatch: variadicBufferCounts {int(vc.max())} is implausibly large")
            nbuf = nbuf.copy()
            nbuf[c.view_nodes] += vc
        elif h.variadic_counts is not None and len(h.variadic_counts):
            raise CodecError(
                f"RecordBatch: variadicBufferCounts has {len(h.variadic_counts)} entries, the schema no views"
            )
        buffers = h.buffers
        total = int(nbuf.sum()) if c.view_nodes.size else c.total_buffers
        if len(buffers) != total:
            raise CodecError(
                f"RecordBatch: the schema needs {total} buffers, the message lists {len(buffers)}"
            )
        offs = buffers[:, 0]
        lens = buffers[:, 1]
        # Both columns are >= 0 (checked when parsed), so once neither exceeds the limit their sum cannot
        # overflow.
        if len(buffers) and (int(buffers.max()) > limit or int((offs + lens).max()) > limit):
            bad = int(np.flatnonzero((lens > limit) | (offs > limit - lens))[0])
            raise CodecError(
                f"RecordBatch: buffer {bad} (offset {int(offs[bad])}, length {int(lens[bad])}) lies outside "
                f"the {limit}-byte body"
            )
        return nbuf

    def _prepare(self, c: _Compiled, h: RecordBatchHeader, body_length: int) -> _Prepared:
        """Everything about an uncompressed batch that depends on its metadata alone (cached per metadata)."""
        nbuf = self._layout(c, h, body_length)
        self._check_sizes(c, h.nodes, nbuf, h.buffers[:, 1])
        return self._template(c, h, nbuf, h.buffers[:, 0].astype(np.uint64), h.buffers[:, 1], body_length)

    def _template(
        self,
        c: _Compiled,
        h: RecordBatchHeader,
        nbuf: npt.NDArray[np.int64],
        addresses: npt.NDArray[np.uint64],
        lens: npt.NDArray[np.int64],
        body_length: int | None,
    ) -> _Prepared:
        """The struct tree for a batch; ``addresses`` are body offsets, or absolute when ``body_length`` is
        None (buffers rewritten into memory of their own)."""
        nodes = h.nodes
        first = _exclusive_cumsum(nbuf)
        # Buffer pointers (relative to the body unless absolute); empty buffers point at shared zeros, and a
        # validity bitmap of a node without nulls is NULL.
        rel = addresses.copy()
        empty = lens == 0
        rel[empty] = cdata.ZERO_ADDRESS
        in_body = ~empty if body_length is not None else np.zeros(len(lens), bool)
        vnodes = np.flatnonzero(c.has_validity & (nodes[:, 1] == 0))
        if vnodes.size:
            vpos = first[vnodes] + c.drop_first[vnodes]
            rel[vpos] = 0
            in_body[vpos] = False
        extra: list[Any] = []
        n = c.n_nodes
        if c.simple:
            ptrs = np.concatenate([np.zeros(1, np.uint64), rel])
            ptr_in_body = np.concatenate([np.zeros(1, bool), in_body])
            cbuf_rel = c.buf_rel
            nbuf_c = None
        else:
            ptrs, ptr_in_body = _relative_pointers(c, nbuf, first, rel, in_body, lens, extra)
            nbuf_c = nbuf - c.drop_first + (c.layouts == Layout.VIEW)
            cbuf_rel = np.zeros(n + 1, np.uint64)
            cbuf_rel[1:] = (np.uint64(1) + _exclusive_cumsum(nbuf_c).astype(np.uint64)) * np.uint64(8)
        nptr = len(ptrs)
        nkid = len(c.child_idx)
        sbytes = 80 * (n + 1)
        words = np.zeros(10 * (n + 1) + nptr + nkid, np.uint64)
        structs = words[: 10 * (n + 1)].reshape(n + 1, 10)
        structs[:] = c.template
        structs[1:, 0:2] = nodes
        structs[0, 0] = h.length
        if c.null_nodes.size:
            structs[c.null_nodes + 1, 1] = nodes[c.null_nodes, 0]
        if nbuf_c is not None:
            structs[1:, 3] = nbuf_c
        structs[:, 5] = cbuf_rel + np.uint64(sbytes)
        words[10 * (n + 1) : 10 * (n + 1) + nptr] = ptrs
        mem_fields = [np.arange(n + 1) * 10 + 5]
        if nkid:
            words[10 * (n + 1) + nptr :] = c.child_idx80
            with_kids = np.flatnonzero(c.has_kids)
            structs[with_kids, 6] = c.child_rel[with_kids] + np.uint64(sbytes + 8 * nptr)
            mem_fields.append(with_kids * 10 + 6)
            mem_fields.append(np.arange(10 * (n + 1) + nptr, len(words)))
        return _Prepared(
            compiled=c,
            words=words,
            mem_index=np.concatenate(mem_fields).astype(np.intp),
            body_index=(np.flatnonzero(ptr_in_body) + 10 * (n + 1)).astype(np.intp),
            extra=extra,
            nodes=nodes,
            nbuf=nbuf,
            first=first,
            offsets=addresses,
            lengths=lens,
            body_length=body_length or 0,
            absolute=body_length is None,
        )

    def _instantiate(self, c: _Compiled, prep: _Prepared, body: pa.Buffer) -> pa.RecordBatch:
        """A batch from a prepared layout and a body: copy the template, point it at the body, import."""
        if body.size < prep.body_length:
            raise CodecError(f"message body: expected {prep.body_length} bytes, got {body.size}")
        for _, did in c.dict_nodes:
            if did not in self.dictionaries:
                raise CodecError(
                    f"RecordBatch: dictionary id {did} is used before any DictionaryBatch for it"
                )
        address = 0 if prep.absolute else body.address
        small = prep.nodes[0, 0] <= _SMALL_BATCH_ROWS if len(prep.nodes) else True
        checked = c.checked if small else c.checked_all
        if checked and self.validate:
            self._check(
                c, prep.nodes, prep.nbuf, prep.first, prep.offsets + np.uint64(address), prep.lengths, checked
            )
        if small and c.offset_bounds and self.validate:
            self._check_offset_bounds(c, prep, address)
        keep = cdata.Keepalive()
        mem = pa.allocate_buffer(8 * len(prep.words))
        keep.objects += (body, mem, *prep.extra)
        words = np.frombuffer(mem, np.uint64)
        words[:] = prep.words
        base = mem.address
        words[prep.mem_index] += np.uint64(base)
        words[prep.body_index] += np.uint64(address)
        structs = words[: 10 * (c.n_nodes + 1)].reshape(c.n_nodes + 1, 10)
        for i, did in c.dict_nodes:
            structs[i + 1, 7] = cdata.export_array(self.dictionaries[did], keep)
        try:
            batch = cdata.import_batch(structs, base, c.schema, keep)
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise CodecError(f"RecordBatch: invalid layout: {e}") from None
        self._validate(c, batch, small)
        return batch

    def decode_scattered(self, metadata: object, buffers: list[pa.Buffer | None]) -> pa.RecordBatch | None:
        """Decode a message whose body buffers lie apart (one per metadata buffer entry), without copying."""
        key = bytes(metadata) if isinstance(metadata, (bytes, memoryview)) else None
        return self.decode_parsed(self._parse_cached(metadata, key), ScatteredBody(buffers), key)

    def _decode_scattered(
        self, c: _Compiled, h: RecordBatchHeader, body: ScatteredBody, body_length: int, key: bytes | None
    ) -> pa.RecordBatch:
        assert self._info is not None
        if h.compression is not None or self._info.big_endian:
            raise CodecError("scattered bodies (address/length pairs) must be uncompressed and little-endian")
        buffers = body.buffers
        if len(buffers) != len(h.buffers):
            raise CodecError(f"the metadata lists {len(h.buffers)} buffers, the body has {len(buffers)}")
        lengths = np.array([0 if b is None else b.size for b in buffers], np.int64)
        if len(lengths) and bool((lengths != h.buffers[:, 1]).any()):
            k = int(np.flatnonzero(lengths != h.buffers[:, 1])[0])
            raise CodecError(
                f"body buffer {k} holds {int(lengths[k])} bytes, the metadata says {int(h.buffers[k, 1])}"
            )
        addresses = np.array([0 if b is None or b.size == 0 else b.address for b in buffers], np.uint64)
        extra = [b for b in buffers if b is not None]
        cached = c.scattered.get(key) if key is not None and c.simple else None
        if cached is None:
            nbuf = self._layout(c, h, body_length)
            self._check_sizes(c, h.nodes, nbuf, lengths)
            if key is None or not c.simple:
                prep = self._template(c, h, nbuf, addresses, lengths, None)
                prep.extra.extend(extra)
                return self._instantiate(c, prep, _EMPTY_BODY)
            # Same metadata, same layout: only the buffers' addresses change from batch to batch. Keep the
            # struct tree with the pointer words to fill in (non-empty buffers, except the validity bitmaps of
            # nodes without nulls, which stay NULL as _template makes them).
            template = self._template(c, h, nbuf, np.zeros(len(lengths), np.uint64), lengths, None)
            take = lengths > 0
            vnodes = np.flatnonzero(c.has_validity & (h.nodes[:, 1] == 0))
            if vnodes.size:
                take[_exclusive_cumsum(nbuf)[vnodes]] = False
            positions = (np.flatnonzero(take) + 10 * (c.n_nodes + 1) + 1).astype(np.intp)
            cached = (template, positions, take)
            _remember(c.scattered, key, cached)
        template, positions, take = cached
        words = template.words.copy()
        words[positions] = addresses[take]
        prep = dataclasses.replace(template, words=words, offsets=addresses, extra=extra)
        return self._instantiate(c, prep, _EMPTY_BODY)

    def _decode_general(
        self, c: _Compiled, h: RecordBatchHeader, body: pa.Buffer, body_length: int
    ) -> pa.RecordBatch:
        """Compressed or big-endian bodies: buffers are rewritten into new memory first."""
        nbuf = self._layout(c, h, min(body.size, body_length))
        keep = cdata.Keepalive()
        addresses = h.buffers[:, 0].astype(np.uint64) + np.uint64(body.address)
        addresses, lengths = self._transform_buffers(
            c, h, nbuf, _exclusive_cumsum(nbuf), body, addresses, keep
        )
        self._check_sizes(c, h.nodes, nbuf, lengths)
        prep = self._template(c, h, nbuf, addresses, lengths, None)
        prep.extra.extend(keep.objects)
        return self._instantiate(c, prep, body)

    def _validate(self, c: _Compiled, batch: pa.RecordBatch, small: bool) -> None:
        try:
            batch.validate()
            if self.validate and c.full_columns and small:
                (batch if c.all_full else batch.select(c.full_columns)).validate(full=True)
        except (pa.ArrowException, ValueError) as e:
            raise CodecError(f"RecordBatch: invalid data: {e}") from None

    @staticmethod
    def _check_offset_bounds(c: _Compiled, prep: _Prepared, address: int) -> None:
        """A binary node's offsets start at >= 0 and end within the data received (pyarrow's full validation,
        which follows, checks the offsets in between against those two)."""
        for i, width in c.offset_bounds:
            length = int(prep.nodes[i, 0])
            if length == 0:
                continue
            k = int(prep.first[i])
            at = int(prep.offsets[k + 1]) + address
            ctype = ctypes.c_int64 if width == 8 else ctypes.c_int32
            first = ctype.from_address(at).value
            last = ctype.from_address(at + length * width).value
            limit = int(prep.lengths[k + 2])
            if first < 0 or last > limit or last < first:
                raise CodecError(
                    f"field {c.flat[i].field.name!r}: offsets must rise from >= 0 to at most {limit}, got "
                    f"first {first}, last {last}"
                )

    def _check_sizes(
        self,
        c: _Compiled,
        nodes: npt.NDArray[np.int64],
        nbuf: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
    ) -> None:
        """Every buffer must hold what Arrow will read for its node's length (Arrow's importer trusts us)."""
        rules = c.size_rules if c.size_rules is not None else _size_rules(c.flat, nbuf, c.drop_first)
        req = _required_sizes(rules, nodes)
        if len(req) and bool((lengths < req).any()):
            k = int(np.flatnonzero(lengths < req)[0])
            i = int(rules[0][k])
            raise CodecError(
                f"RecordBatch: buffer {k} of field {c.flat[i].field.name!r} (length {int(nodes[i, 0])}) "
                f"holds "
                f"{int(lengths[k])} bytes, {int(req[k])} are needed"
            )

    def _check(
        self,
        c: _Compiled,
        nodes: npt.NDArray[np.int64],
        nbuf: npt.NDArray[np.int64],
        first: npt.NDArray[np.int64],
        addrs: npt.NDArray[np.uint64],
        lengths: npt.NDArray[np.int64],
        checked: list[int],
    ) -> None:
        for i in checked:
            p = c.flat[i]
            s = int(first[i] + c.drop_first[i])
            e = int(first[i] + nbuf[i])
            kids = c.child_nodes[i]
            length = int(nodes[i, 0])
            name = f"field {p.field.name!r}"
            if p.layout == Layout.RUN_END:
                r, v = kids
                k = int(first[r]) + 1
                check_run_ends(
                    name,
                    length,
                    int(addrs[k]),
                    int(lengths[k]),
                    int(nodes[r, 0]),
                    c.flat[r].width,
                    int(nodes[v, 0]),
                )
                continue
            dlen = len(self.dictionaries[p.dict_id]) if p.dict_id in self.dictionaries else 0
            check_node(
                p,
                name,
                length,
                int(nodes[i, 1]),
                addrs[s:e].tolist(),
                lengths[s:e].tolist(),
                [int(nodes[k, 0]) for k in kids],
                dlen,
            )

    def _transform_buffers(
        self,
        c: _Compiled,
        h: RecordBatchHeader,
        nbuf: npt.NDArray[np.int64],
        first: npt.NDArray[np.int64],
        body: pa.Buffer,
        addrs: npt.NDArray[np.uint64],
        keep: cdata.Keepalive,
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
        """Decompress and/or byte-swap buffers into new memory (the slow path)."""
        assert self._info is not None
        mv = memoryview(body)
        lens = h.buffers[:, 1].copy()
        nodes = h.nodes
        for i, p in enumerate(c.flat):
            length = int(nodes[i, 0])
            s = int(first[i])
            data_limit = self.max_buffer_bytes  # what this node's offsets or views justify for its data
            for j, role in enumerate(_roles(p, int(nbuf[i]), bool(c.drop_first[i]))):
                k = s + j
                off, n = int(h.buffers[k, 0]), int(h.buffers[k, 1])
                raw = mv[off : off + n]
                data: Any = raw
                if h.compression is not None:
                    limit = data_limit if role == _DATA else _bound(role, p, length, self.max_buffer_bytes)
                    data = decompress_buffer(h.compression, data, limit)
                if self._info.big_endian:
                    data = _swap(role, p, data)
                if role in (_OFF4, _OFF8) and p.layout in (Layout.BINARY, Layout.LARGE_BINARY):
                    data_limit = _last_offset(data, 4 if role == _OFF4 else 8, length)
                elif role == _VIEWS:
                    data_limit = _long_view_bytes(data, length)
                if data is not raw:
                    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
                    keep.objects.append(arr)
                    addrs[k] = arr.ctypes.data if arr.size else np.uint64(body.address)
                    lens[k] = arr.size
        return addrs, lens


# Buffer roles, used by the slow paths (decompression bounds and byte swapping).
_VALIDITY, _BITS, _FIXED, _OFF4, _OFF8, _DATA, _VIEWS, _TYPE_IDS, _SIZES4, _SIZES8, _SKIP = range(11)


def _roles(p: FieldPlan, nbuf: int, drop_first: bool) -> list[int]:
    lay = p.layout
    pre = [_SKIP] if drop_first else []
    if lay == Layout.NULL or lay == Layout.RUN_END:
        return pre
    if lay == Layout.BOOL:
        return [_VALIDITY, _BITS]
    if lay == Layout.FIXED:
        return [_VALIDITY, _FIXED]
    if lay == Layout.BINARY:
        return [_VALIDITY, _OFF4, _DATA]
    if lay == Layout.LARGE_BINARY:
        return [_VALIDITY, _OFF8, _DATA]
    if lay == Layout.VIEW:
        return [_VALIDITY, _VIEWS] + [_DATA] * (nbuf - 2)
    if lay == Layout.LIST:
        return [_VALIDITY, _OFF4]
    if lay == Layout.LARGE_LIST:
        return [_VALIDITY, _OFF8]
    if lay == Layout.LIST_VIEW:
        return [_VALIDITY, _SIZES4, _SIZES4]
    if lay == Layout.LARGE_LIST_VIEW:
        return [_VALIDITY, _SIZES8, _SIZES8]
    if lay in (Layout.FIXED_LIST, Layout.STRUCT):
        return [_VALIDITY]
    if lay == Layout.SPARSE_UNION:
        return [*pre, _TYPE_IDS]
    return [*pre, _TYPE_IDS, _SIZES4]


# Per role: (bytes per element, extra element when non-empty (offsets), bit-packed, validity)
_ROLE_SIZES = {
    _VALIDITY: (0, 0, True, True),
    _BITS: (0, 0, True, False),
    _OFF4: (4, 1, False, False),
    _OFF8: (8, 1, False, False),
    _SIZES4: (4, 0, False, False),
    _SIZES8: (8, 0, False, False),
    _VIEWS: (16, 0, False, False),
    _TYPE_IDS: (1, 0, False, False),
    _DATA: (0, 0, False, False),
    _SKIP: (0, 0, False, False),
}


def _size_rules(
    flat: list[FieldPlan], nbuf: npt.NDArray[np.int64], drop_first: npt.NDArray[np.bool_]
) -> tuple[npt.NDArray[Any], ...]:
    """Per IPC buffer: (owning node, bytes per element, extra element, bit-packed, validity) arrays."""
    node, mul, plus, bits, validity = [], [], [], [], []
    for i, p in enumerate(flat):
        for role in _roles(p, int(nbuf[i]), bool(drop_first[i])):
            m, extra, b, v = _ROLE_SIZES.get(role, (p.width, 0, False, False))
            node.append(i)
            mul.append(m)
            plus.append(extra)
            bits.append(b)
            validity.append(v)
    return (
        np.array(node, np.int64),
        np.array(mul, np.int64),
        np.array(plus, np.int64),
        np.array(bits, bool),
        np.array(validity, bool),
    )


def _required_sizes(
    rules: tuple[npt.NDArray[Any], ...], nodes: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """The bytes each buffer must hold for this batch's node lengths (what Arrow will read)."""
    node, mul, plus, bits, validity = rules
    # Lengths beyond any real buffer are clamped first, so that (length + 1) * width cannot wrap around int64
    # into a small requirement (a node of length 2**63 - 1 once passed as needing a negative size).
    length = np.minimum(nodes[node, 0], _MAX_NODE_LENGTH)
    req: npt.NDArray[np.int64] = np.where(bits, (length + 7) // 8, (length + (length > 0) * plus) * mul)
    req[validity & (nodes[node, 1] == 0)] = 0
    return req


def _last_offset(data: Any, width: int, length: int) -> int:
    """The last of ``length + 1`` (native) offsets: what the data buffer must hold; 0 when unreadable."""
    if length == 0 or len(data) < (length + 1) * width:
        return 0
    return max(int(np.frombuffer(data, "<i4" if width == 4 else "<i8", 1, length * width)[0]), 0)


def _long_view_bytes(data: Any, length: int) -> int:
    """Total length of the out-of-line (native) views: no variadic buffer needs more."""
    if length == 0 or len(data) < length * 16:
        return 0
    lens = np.frombuffer(data, "<i4", length * 4)[::4].astype(np.int64)
    return int(lens[lens > 12].sum())


def _bound(role: int, p: FieldPlan, length: int, limit: int) -> int:
    """The largest uncompressed size the metadata justifies for one buffer."""
    slack = 4096
    if role in (_VALIDITY, _BITS):
        need = (length + 7) // 8
    elif role == _FIXED:
        need = length * p.width
    elif role in (_OFF4, _SIZES4):
        need = (length + 1) * 4
    elif role in (_OFF8, _SIZES8):
        need = (length + 1) * 8
    elif role == _VIEWS:
        need = length * 16
    elif role == _TYPE_IDS:
        need = length
    else:
        return limit
    return min(limit, 2 * need + slack)


def _swap(role: int, p: FieldPlan, data: Any) -> Any:
    n = len(data)
    if n == 0:
        return data
    if role in (_OFF4, _SIZES4):
        return _swapped(data, 4)
    if role in (_OFF8, _SIZES8):
        return _swapped(data, 8)
    if role == _FIXED:
        w = p.swap_width
        if w in (2, 4, 8):
            return _swapped(data, w)
        if w == SWAP_REVERSE:
            width = p.width
            if n % width:
                raise CodecError(f"big-endian buffer of {n} bytes is not a multiple of width {width}")
            return np.frombuffer(data, np.uint8).reshape(-1, width)[:, ::-1].copy().reshape(-1)
        if w == SWAP_MONTH_DAY_NANO:
            if n % 16:
                raise CodecError(f"big-endian interval buffer of {n} bytes is not a multiple of 16")
            a = np.frombuffer(data, np.uint8).reshape(-1, 16).copy()
            a[:, 0:4] = a[:, 3::-1]
            a[:, 4:8] = a[:, 7:3:-1]
            a[:, 8:16] = a[:, 15:7:-1]
            return a.reshape(-1)
        return data
    if role == _VIEWS:
        if n % 16:
            raise CodecError(f"big-endian view buffer of {n} bytes is not a multiple of 16")
        a = np.frombuffer(data, np.uint8).reshape(-1, 16).copy()
        a[:, 0:4] = a[:, 3::-1]
        length = a[:, 0:4].copy().view("<i4").reshape(-1)
        long = length > 12
        a[long, 8:12] = a[long, 11:7:-1]
        a[long, 12:16] = a[long, 15:11:-1]
        return a.reshape(-1)
    return data


def _swapped(data: Any, width: int) -> npt.NDArray[np.uint8]:
    n = len(data)
    if n % width:
        raise CodecError(f"big-endian buffer of {n} bytes is not a multiple of its {width}-byte elements")
    return np.frombuffer(data, f">u{width}").astype(f"<u{width}").view(np.uint8)


def _as_buffer(body: object) -> pa.Buffer:
    if body is None:
        return pa.py_buffer(b"")
    if isinstance(body, pa.Buffer):
        return body
    try:
        return pa.py_buffer(body)
    except TypeError:
        raise CodecError(f"message body must be bytes-like, got {type(body).__name__}") from None
