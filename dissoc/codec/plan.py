"""Decoding plans: what a schema and a batch's metadata fix about decoding, computed once and cached.

A schema is compiled (:class:`Compiled`) into the index arrays the bulk import through the C Data Interface
needs, and into the content checks its columns get. A batch's metadata is prepared (:class:`Prepared`) into
a struct tree template with pointers relative to its allocation and to its body, so that a batch whose
metadata repeats costs little more than pointing the template at its body. Both are cached in bounded
caches that the decoders of a process share (see :data:`SCHEMAS`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from dissoc.codec import cdata
from dissoc.codec.message import ParsedMessage, RecordBatchHeader
from dissoc.codec.schema import FieldPlan, Layout, SchemaInfo
from dissoc.codec.sizes import IPC_BUFFERS, NO_VALIDITY, SizeRules, size_rules

__all__ = [
    "CACHE_SIZE",
    "SCHEMAS",
    "SCHEMAS_LOCK",
    "SMALL_BATCH_ROWS",
    "Compiled",
    "Prepared",
    "build_template",
    "exclusive_cumsum",
    "remember",
]

#: Layouts whose data buffer Arrow's C importer sizes from the offsets themselves.
_SIZED_BY_OFFSETS = {Layout.BINARY, Layout.LARGE_BINARY}


def fully_validatable(ty: pa.DataType) -> bool:
    """Whether pyarrow's full validation of this type checks memory safety only (no value semantics)."""
    t = pa.types
    if isinstance(ty, pa.BaseExtensionType):
        return fully_validatable(ty.storage_type)
    if t.is_dictionary(ty):
        return fully_validatable(ty.value_type)
    if t.is_decimal(ty) or t.is_date64(ty) or t.is_time(ty) or t.is_binary_view(ty) or t.is_string_view(ty):
        return False
    return all(fully_validatable(ty.field(i).type) for i in range(ty.num_fields))


class Compiled:
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
        self.prepared: dict[bytes, Prepared] = {}
        self.scattered: dict[bytes, tuple[Prepared, npt.NDArray[np.intp], npt.NDArray[np.bool_]]] = {}
        self.flat = flat
        n = len(flat)
        self.n_nodes = n
        layouts = np.array([p.layout for p in flat], np.int64)
        self.layouts = layouts
        self.nbuf_ipc = np.array([IPC_BUFFERS[Layout(x)] for x in layouts.tolist()], np.int64)
        self.has_validity = np.array([Layout(x) not in NO_VALIDITY for x in layouts.tolist()], bool)
        self.drop_first = np.zeros(n, bool)
        if v4_unions:
            self.drop_first = np.isin(layouts, [Layout.SPARSE_UNION, Layout.DENSE_UNION])
            self.nbuf_ipc = self.nbuf_ipc + self.drop_first
        self.view_nodes = np.flatnonzero(layouts == Layout.VIEW)
        self.null_nodes = np.flatnonzero(layouts == Layout.NULL)
        # Nodes that cannot hold nulls of their own: no validity bitmap (unions, run-end encoded), not the
        # null type, and not a V4 union (whose validity bitmap came first, as readers of that version knew)
        self.nullless_nodes = np.flatnonzero(~self.has_validity & (layouts != Layout.NULL) & ~self.drop_first)
        self.dict_nodes = [(i, p.dict_id) for i, p in enumerate(flat) if p.dict_id >= 0]
        # the structs (root first) of the nodes that own an exported dictionary
        self.dict_owners = np.array([i + 1 for i, _ in self.dict_nodes], np.intp)
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
        self.size_rules: SizeRules | None = (
            None if self.view_nodes.size else size_rules(flat, self.nbuf_ipc, self.drop_first)
        )
        self.has_kids = (self.n_children > 0).astype(np.uint64)
        self.child_rel = self.child_start * np.uint64(8)
        self.child_idx80 = self.child_idx * np.uint64(cdata.STRUCT_SIZE)
        rel = np.zeros(n + 1, np.uint64)
        rel[1:] = (np.uint64(1) + exclusive_cumsum(self.nbuf_ipc).astype(np.uint64)) * np.uint64(8)
        self.buf_rel = rel  # valid for simple plans: byte offset of each struct's buffer list
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
        # also rejects legal values) get the numpy checks of :mod:`dissoc.codec.checks`, node by node.
        starts = [k - 1 for k in children[0]] + [n]
        self.full_columns: list[int] = []
        self.checked: list[int] = []
        self.offset_bounds: list[tuple[int, int]] = []  # (binary node, offset width) of full columns
        for col, plan in enumerate(plans):
            nodes_of_col = range(starts[col], starts[col + 1])
            risky_nodes = [j for j in nodes_of_col if flat[j].layout in risky or flat[j].dict_id >= 0]
            if not risky_nodes:
                continue
            if fully_validatable(plan.field.type):
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
        # Only top-level fixed-width columns (no dictionaries, no children): pyarrow's cheap validation of
        # such a batch checks nothing that Prepared.shape_checked does not (see there).
        self.flat_fixed = bool(flat) and all(
            p.layout in (Layout.FIXED, Layout.BOOL) and p.dict_id < 0 and not p.children for p in flat
        )
        # Every column's full validation judges memory safety only: one full validation of the whole batch
        # then checks what validating the risky columns would, without selecting them first.
        self.whole_full = all(fully_validatable(p.field.type) for p in plans)
        # Batches pyarrow's IPC reader can build from our checked metadata (dissoc.codec.ipcread): not with
        # dictionaries (pyarrow would need them in its own memo) nor V4 unions (a validity buffer that the
        # reader of a V5 schema does not expect).
        self.ipc_ok = not self.dict_nodes and not bool(self.drop_first.any())
        # Top-level string columns among the fully validated ones, when their batch comes from pyarrow's IPC
        # reader: the batch is read a second time with binary types for them and validated that way, and
        # their data buffers are checked to be ASCII, which makes every value valid UTF-8 (any other byte, and
        # they get string validation): this accepts and refuses exactly what validating them as strings
        # does, for less than its per-value UTF-8 check where there are many string values (see
        # Prepared.as_binary).
        as_bytes = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}
        self.str_columns = [j for j in self.full_columns if plans[j].field.type in as_bytes]
        self.str_nodes = [starts[j] for j in self.str_columns]
        self.bin_schema = pa.schema(
            [f.with_type(as_bytes.get(f.type, f.type)) for f in schema], metadata=schema.metadata
        )
        # The risky columns on their own (strings as binary), for a second read of wide batches that costs
        # less than reading every column again (see Prepared.sub): their nodes and IPC buffers, in order.
        sub_nodes = [j for col in self.full_columns for j in range(starts[col], starts[col + 1])]
        self.sub_nodes = np.array(sub_nodes, np.int64)
        first_buffer = exclusive_cumsum(self.nbuf_ipc)
        self.sub_buffers = np.array(
            [k for j in sub_nodes for k in range(first_buffer[j], first_buffer[j] + self.nbuf_ipc[j])],
            np.int64,
        )
        self.sub_schema = pa.schema([self.bin_schema.field(col) for col in self.full_columns])
        # The other columns are single fixed-width or boolean nodes: with their lengths the batch's and their
        # null counts in range, pyarrow's cheap validation checks nothing more (Prepared.rest_checked).
        full = set(self.full_columns)
        rest = [col for col in range(len(plans)) if col not in full]
        self.rest_nodes = np.array([starts[col] for col in rest], np.int64)
        self.rest_flat = all(
            starts[col + 1] - starts[col] == 1
            and flat[starts[col]].layout in (Layout.FIXED, Layout.BOOL)
            and flat[starts[col]].dict_id < 0
            for col in rest
        )
        # The full columns as single top-level binary-like nodes (node, offsets' width, values UTF-8), when
        # that is all they are and the others are rest_flat: what the compiled check of dissoc.codec.jit
        # takes instead of a second read and pyarrow's full validation (Prepared.spans).
        binary = [
            (starts[col], 8 if flat[starts[col]].layout == Layout.LARGE_BINARY else 4, _is_utf8(plans[col]))
            for col in self.full_columns
            if starts[col + 1] - starts[col] == 1
            and flat[starts[col]].layout in (Layout.BINARY, Layout.LARGE_BINARY)
            and flat[starts[col]].dict_id < 0
        ]
        self.binary_nodes = (
            binary if self.full_columns and len(binary) == len(self.full_columns) and self.rest_flat else None
        )
        # Large batches check every risky node with numpy instead: pyarrow's full validation also checks
        # UTF-8, which costs more per byte than numpy's offset checks.
        self.checked_all = [i for i, p in enumerate(flat) if p.layout in risky or p.dict_id >= 0]


def _is_utf8(plan: FieldPlan) -> bool:
    ty = plan.field.type
    while isinstance(ty, pa.BaseExtensionType):
        ty = ty.storage_type
    return bool(pa.types.is_string(ty) or pa.types.is_large_string(ty))


def exclusive_cumsum(a: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    out = np.zeros(len(a), np.int64)
    if len(a) > 1:
        np.cumsum(a[:-1], out=out[1:])
    return out


CACHE_SIZE = 64
#: A wide batch's risky columns are read on their own for their checks (Prepared.sub) from this many other
#: nodes on: a read costs about a quarter of a microsecond per node, the extra message about 0.7 µs.
SUB_READ_MIN_NODES = 6
#: Batches of at most this many rows get pyarrow's full validation as (part of) their content checks; larger
#: ones get the numpy checks of :mod:`dissoc.codec.checks` only (see :attr:`Compiled.checked_all`).
SMALL_BATCH_ROWS = 8192
#: Schemas decoded in this process, by their Schema message bytes: (schema info, version, compiled plans).
#: A client opens one stream per request, each starting with the same Schema message; sharing the compiled
#: plans (and, through them, the parsed and prepared batch layouts) saves ~0.35 ms per stream. Everything
#: shared is read-only once built.
SCHEMAS: dict[bytes, tuple[SchemaInfo, int, Compiled]] = {}
SCHEMAS_LOCK = threading.Lock()


_V = TypeVar("_V")


def remember(cache: dict[bytes, _V], key: bytes, value: _V) -> None:
    """Insert into a bounded cache that other threads may use too (evicting the oldest entry)."""
    if len(cache) >= CACHE_SIZE:
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):
            cache.pop(next(iter(cache)))
    cache[key] = value


_NO_HEAD = memoryview(b"")


@dataclass(eq=False, slots=True)
class Prepared:
    """The metadata-only part of decoding one uncompressed batch layout: a struct template with pointers
    relative to the allocation (``mem_index``) and to the body (``body_index``)."""

    compiled: Compiled
    words: npt.NDArray[np.uint64]
    mem_index: npt.NDArray[np.intp]
    body_index: npt.NDArray[np.intp]
    extra: list[object]  # what the batch's memory needs kept alive besides the body
    nodes: npt.NDArray[np.int64]
    nbuf: npt.NDArray[np.int64]
    first: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.uint64]
    lengths: npt.NDArray[np.int64]
    body_length: int
    absolute: bool = False
    #: For pyarrow's IPC reader (:mod:`dissoc.codec.ipcread`): the framing pieces of this metadata, and the
    #: same joined; None where this layout stays on the C Data Interface import.
    frame: tuple[bytes, bytes] | None = None
    head: memoryview = _NO_HEAD
    #: Few enough rows for pyarrow's full validation to be the cheaper content check.
    small: bool = True
    #: Whether validating the top-level string columns as binary plus an ASCII check (Compiled.str_columns)
    #: costs less than their UTF-8 check: a second read costs about a quarter of a microsecond per node, the
    #: UTF-8 check about two nanoseconds per value, the ASCII check and the rest about a microsecond.
    as_binary: bool = False
    #: For a schema of fixed-width columns only (Compiled.flat_fixed): every column is as long as the batch
    #: and holds at most that many nulls. With the buffer sizes checked against the lengths, that is all
    #: pyarrow's cheap validation of such a batch checks, so batches of this layout skip it.
    shape_checked: bool = False
    #: Where the data buffers of the top-level string columns lie in the body: (start, end) byte offsets.
    str_spans: list[tuple[int, int]] | None = None
    #: For an ``as_binary`` layout with enough other columns (:data:`SUB_READ_MIN_NODES`): the framing
    #: pieces and joined head of a message of its risky columns only (Compiled.sub_schema), over the same
    #: body, padded to the length of the batch's own metadata, so that it fits the same room. Reading that
    #: instead of the whole batch a second time skips the other columns' arrays.
    sub: tuple[tuple[bytes, bytes], memoryview] | None = None
    #: The other columns are single fixed-width nodes as long as the batch with null counts in range
    #: (Compiled.rest_flat): nothing of them is left for pyarrow's cheap validation to check.
    rest_checked: bool = False
    #: Where every full column is a binary-like node in shape (Compiled.binary_nodes) and rest_checked: the
    #: span table (dissoc.codec.jit.SPAN_FIELDS) of its compiled check.
    spans: npt.NDArray[np.int64] | None = None


def relative_pointers(
    c: Compiled,
    nbuf: npt.NDArray[np.int64],
    first: npt.NDArray[np.int64],
    rel: npt.NDArray[np.uint64],
    in_body: npt.NDArray[np.bool_],
    lengths: npt.NDArray[np.int64],
    extra: list[object],
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.bool_]]:
    """The C buffer list (V4 union validity dropped, view sizes added) and which entries are body-relative."""
    ptrs: list[npt.NDArray[np.uint64]] = [np.zeros(1, np.uint64)]
    mask: list[npt.NDArray[np.bool_]] = [np.zeros(1, bool)]
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


def build_template(
    c: Compiled,
    h: RecordBatchHeader,
    nbuf: npt.NDArray[np.int64],
    addresses: npt.NDArray[np.uint64],
    lens: npt.NDArray[np.int64],
    body_length: int | None,
) -> Prepared:
    """The struct tree for a batch; ``addresses`` are body offsets, or absolute when ``body_length`` is
    None (buffers rewritten into memory of their own)."""
    nodes = h.nodes
    first = exclusive_cumsum(nbuf)
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
    extra: list[object] = []
    n = c.n_nodes
    if c.simple:
        ptrs = np.concatenate([np.zeros(1, np.uint64), rel])
        ptr_in_body = np.concatenate([np.zeros(1, bool), in_body])
        cbuf_rel = c.buf_rel
        nbuf_c = None
    else:
        ptrs, ptr_in_body = relative_pointers(c, nbuf, first, rel, in_body, lens, extra)
        nbuf_c = nbuf - c.drop_first + (c.layouts == Layout.VIEW)
        cbuf_rel = np.zeros(n + 1, np.uint64)
        cbuf_rel[1:] = (np.uint64(1) + exclusive_cumsum(nbuf_c).astype(np.uint64)) * np.uint64(8)
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
    # child structs that own no dictionary get cdata's release callback now (import_batch(owners=...))
    structs[1:, 8] = cdata.children_release()
    words[10 * (n + 1) : 10 * (n + 1) + nptr] = ptrs
    mem_fields = [np.arange(n + 1) * 10 + 5]
    if nkid:
        words[10 * (n + 1) + nptr :] = c.child_idx80
        with_kids = np.flatnonzero(c.has_kids)
        structs[with_kids, 6] = c.child_rel[with_kids] + np.uint64(sbytes + 8 * nptr)
        mem_fields.append(with_kids * 10 + 6)
        mem_fields.append(np.arange(10 * (n + 1) + nptr, len(words)))
    return Prepared(
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
        small=bool(nodes[0, 0] <= SMALL_BATCH_ROWS) if len(nodes) else True,
        shape_checked=c.flat_fixed
        and bool((nodes[:, 0] == h.length).all())
        and bool(((nodes[:, 1] >= 0) & (nodes[:, 1] <= nodes[:, 0])).all()),
        as_binary=bool(c.str_columns)
        and 2 * int(nodes[c.str_nodes, 0].sum()) > 250 * c.n_nodes + 1000,  # nanoseconds
    )
