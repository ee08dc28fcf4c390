"""Where each field's buffers lie in a message body: the RecordBatch header walked along the schema.

A RecordBatch (or DictionaryBatch) header lists field nodes (length, null count) and buffers (offset, length
in the body) flat, in depth-first schema order. :func:`message_layout` puts them back into a tree of
:class:`FieldLayout` -- per field its node, its own buffers in IPC order, and its children -- so that code
holding the body somewhere the decoder cannot read it (device memory) can still find every buffer. It is pure:
metadata in, offsets out; the body itself is never read. Buffer sizes are checked against the rules the
decoder uses too (:mod:`dissoc.codec.sizes`).

Every layout the codec supports is covered: primitives and bool, (large) binary and string, binary and string
views (with their variadic data buffers), fixed-size binary and decimals, (large) lists and list views,
fixed-size lists, structs, maps, sparse and dense unions (no validity buffer since V5; a V4 message's union
validity buffer is kept, as listed), dictionary-encoded fields (the index buffers here, the values in the
dictionary's own message), run-end encoded (children only), the null type (no buffers) and extension types
(their storage layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from dissoc.codec.message import HeaderType, ParsedMessage, parse, parse_message
from dissoc.codec.schema import FieldPlan, Layout, SchemaInfo, decode_schema
from dissoc.codec.sizes import IPC_BUFFERS, UNIONS, node_required_sizes
from dissoc.errors import CodecError

__all__ = ["FieldLayout", "MessageLayout", "field_layout", "message_layout", "schema_info"]


@dataclass(frozen=True, slots=True, eq=False)
class FieldLayout:
    """One field node of a message: its node values, its own buffers and its children.

    ``buffers`` are ``(offset, length)`` spans in the message body, exactly as the metadata lists them for
    this field (validity first where the layout has one; a length of 0 means an absent buffer). A
    dictionary-encoded field (``dictionary_id >= 0``) has its index buffers here and no children: its values
    are in the DictionaryBatch of that id. ``width`` is the byte width of fixed-width values (of the indices
    for dictionary-encoded fields), else 0.
    """

    field: pa.Field
    layout: Layout
    length: int
    null_count: int
    buffers: tuple[tuple[int, int], ...]
    children: tuple[FieldLayout, ...] = ()
    dictionary_id: int = -1
    width: int = 0

    @property
    def type(self) -> pa.DataType:
        return self.field.type


@dataclass(frozen=True, slots=True, eq=False)
class MessageLayout:
    """A RecordBatch or DictionaryBatch message: its header values and the layout of its fields (for a
    DictionaryBatch, one field: the dictionary's values)."""

    header_type: int
    length: int
    body_length: int
    fields: tuple[FieldLayout, ...]
    dictionary_id: int | None = None
    is_delta: bool = False
    compression: int | None = None
    version: int = 4

    @property
    def is_dictionary(self) -> bool:
        return self.header_type == HeaderType.DictionaryBatch


def schema_info(schema: pa.Schema) -> SchemaInfo:
    """The codec's compiled view of ``schema``, with the dictionary ids :class:`~dissoc.codec.MessageEncoder`
    assigns (depth first, from 0)."""
    from dissoc.codec.encoder import MessageEncoder

    info = parse_message(MessageEncoder(schema).schema_message().metadata)
    assert info.header is not None
    return decode_schema(info.header, info.version)


def field_layout(schema: pa.Schema | SchemaInfo, metadata: object) -> list[FieldLayout]:
    """The :class:`FieldLayout` of every top-level field of a RecordBatch message (of the values, for a
    DictionaryBatch message); see :func:`message_layout`."""
    return list(message_layout(schema, metadata).fields)


def message_layout(
    schema: pa.Schema | SchemaInfo,
    metadata: object,
    *,
    body_size: int | None = None,
    parsed: ParsedMessage | None = None,
) -> MessageLayout:
    """Walk a RecordBatch or DictionaryBatch message's nodes and buffers along ``schema``.

    ``schema`` is the stream's schema: a :class:`SchemaInfo` (as decoded from the stream's Schema message,
    whose dictionary ids the message uses) or a ``pa.Schema`` (dictionary ids as the encoder assigns them).
    Raises :class:`CodecError` when the message does not fit the schema (node, buffer or variadic counts),
    when a span lies outside the ``bodyLength``-byte body, when an uncompressed buffer is smaller than its
    node's length needs, or when ``body_size`` (the bytes actually at hand) is less than ``bodyLength``.
    """
    info = schema if isinstance(schema, SchemaInfo) else schema_info(schema)
    msg = parsed if parsed is not None else parse(metadata)
    if msg.header_type not in (HeaderType.RecordBatch, HeaderType.DictionaryBatch) or msg.batch is None:
        raise CodecError(
            f"message layout: expected a RecordBatch or DictionaryBatch message, got "
            f"{HeaderType(msg.header_type).name}"
        )
    body_length = msg.body_length
    if body_size is not None and body_size < body_length:
        raise CodecError(f"message body: expected {body_length} bytes (bodyLength), got {body_size}")
    if msg.header_type == HeaderType.DictionaryBatch:
        assert msg.dictionary_id is not None
        dinfo = info.dictionaries.get(msg.dictionary_id)
        if dinfo is None:
            raise CodecError(
                f"DictionaryBatch: id {msg.dictionary_id} is not in the schema "
                f"(known ids: {sorted(info.dictionaries)})"
            )
        plans = [dinfo.value_plan]
    else:
        plans = info.plans
    h = msg.batch
    walker = _Walker(
        h.nodes.tolist(),
        h.buffers.tolist(),
        [] if h.variadic_counts is None else h.variadic_counts.tolist(),
        msg.info.version < 4,
        h.compression is None,
        body_length,
    )
    walker.check_counts(plans)
    fields = tuple(walker.walk(p) for p in plans)
    return MessageLayout(
        header_type=msg.header_type,
        length=h.length,
        body_length=body_length,
        fields=fields,
        dictionary_id=msg.dictionary_id if msg.header_type == HeaderType.DictionaryBatch else None,
        is_delta=msg.is_delta,
        compression=h.compression,
        version=msg.info.version,
    )


class _Walker:
    """A cursor over the flat node, buffer and variadic-count lists of one header."""

    def __init__(
        self,
        nodes: list[list[int]],
        buffers: list[list[int]],
        variadic: list[int],
        v4_unions: bool,
        check_sizes: bool,
        body_length: int,
    ) -> None:
        self.nodes = nodes
        self.buffers = buffers
        self.variadic = variadic
        self.v4_unions = v4_unions
        self.check_sizes = check_sizes
        self.body_length = body_length
        self.ni = self.bi = self.vi = 0

    def _fixed_buffers(self, p: FieldPlan) -> int:
        return IPC_BUFFERS[p.layout] + (1 if self.v4_unions and p.layout in UNIONS else 0)

    def check_counts(self, plans: list[FieldPlan]) -> None:
        """Node, view and (fixed) buffer counts of the schema against the header's, before walking."""
        n_nodes = n_views = n_fixed = 0
        stack = list(plans)
        while stack:
            p = stack.pop()
            n_nodes += 1
            n_fixed += self._fixed_buffers(p)
            if p.layout == Layout.VIEW:
                n_views += 1
            if p.dict_id < 0:
                stack.extend(p.children)
        if n_nodes != len(self.nodes):
            raise CodecError(
                f"RecordBatch: the schema has {n_nodes} field nodes, the message lists {len(self.nodes)}"
            )
        if n_views != len(self.variadic) and (n_views or self.variadic):
            raise CodecError(
                f"RecordBatch: {n_views} view fields need as many variadicBufferCounts, "
                f"got {len(self.variadic)}"
            )
        if max(self.variadic, default=0) > 1 << 20:
            raise CodecError(f"RecordBatch: variadicBufferCounts {max(self.variadic)} is implausibly large")
        total = n_fixed + sum(self.variadic)
        if total != len(self.buffers):
            raise CodecError(
                f"RecordBatch: the schema needs {total} buffers, the message lists {len(self.buffers)}"
            )

    def walk(self, p: FieldPlan) -> FieldLayout:
        length, null_count = self.nodes[self.ni]
        self.ni += 1
        nbuf = self._fixed_buffers(p)
        if p.layout == Layout.VIEW:
            nbuf += self.variadic[self.vi]
            self.vi += 1
        first = self.bi
        spans = tuple((int(o), int(n)) for o, n in self.buffers[first : first + nbuf])
        self.bi += nbuf
        name = p.field.name
        for k, (off, n) in enumerate(spans):
            if off > self.body_length or n > self.body_length - off:
                raise CodecError(
                    f"RecordBatch: buffer {first + k} (offset {off}, length {n}) of field {name!r} lies "
                    f"outside the {self.body_length}-byte body"
                )
        if self.check_sizes:
            self._check_sizes(p, int(length), int(null_count), spans, first)
        children = () if p.dict_id >= 0 else tuple(self.walk(c) for c in p.children)
        return FieldLayout(
            p.field, p.layout, int(length), int(null_count), spans, children, p.dict_id, p.width
        )

    def _check_sizes(
        self, p: FieldPlan, length: int, null_count: int, spans: tuple[tuple[int, int], ...], first: int
    ) -> None:
        need = node_required_sizes(p, length, null_count, len(spans), self.v4_unions and p.layout in UNIONS)
        for k, (have, want) in enumerate(zip((n for _, n in spans), need, strict=False)):
            if have < want:
                raise CodecError(
                    f"RecordBatch: buffer {first + k} of field {p.field.name!r} (length {length}) holds "
                    f"{have} bytes, {want} are needed"
                )
