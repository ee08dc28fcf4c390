"""Flattening wide record batches in bulk, through the Arrow C Data Interface.

Walking a batch column by column costs a pyarrow wrapper object per column (about a microsecond each) before
any work is done. For wide batches this module instead exports the whole batch once (``_export_to_c``: one
call into C++ fills an ``ArrowArray`` struct per node) and reads every node's length, null count, offset and
buffer addresses with a few numpy gathers, level by level. The body buffers are then ``pa.foreign_buffer``
views of the batch's own memory (the batch is their base, so it lives as long as they do), cut to exactly the
bytes the message needs.

It takes only the common case: types whose layouts are plain (fixed width, boolean, binary and string, lists,
structs, fixed-size lists, null), every array unsliced (offset 0; offsets that start above 0 are sent as they
are, with the data from the buffer's start), and children covering exactly their parent's values. Anything
else returns ``None`` and the caller walks the batch column by column
(:meth:`dissoc.codec.encoder._Flattener.walk`), which handles every case. Its fixed cost (some 50 numpy calls)
only pays off for wide batches.

Reading pointers: the exported structs, their pointer arrays and the offsets buffers sit anywhere in the
process's memory, so they are read through :data:`_MEMORY`, a numpy view of the whole user address space,
only ever indexed at addresses that pyarrow just handed out (never iterated, printed or copied whole).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from dissoc.codec import cdata
from dissoc.codec.jit import Kernel

__all__ = ["BulkPlan", "Flat", "flatten", "flatten_walk", "make_plan"]

_BASE = 4096  # no object lives in the first page
_SPAN = (1 << 57) - _BASE  # beyond any user-space address of x86-64 (5-level paging) and aarch64
_MEMORY: npt.NDArray[np.uint8] = np.frombuffer(pa.foreign_buffer(_BASE, _SPAN), np.uint8)
_MEMORY64: npt.NDArray[np.int64] = _MEMORY[: _SPAN - _SPAN % 8].view(np.int64)
_WORD = _BASE >> 3  # _MEMORY64[address // 8 - _WORD] is the int64 at an 8-byte-aligned address

# ArrowArray fields (int64 each): length, null_count, offset, n_buffers, n_children, buffers, children, ...
_LENGTH, _NULLS, _OFFSET, _BUFFERS, _CHILDREN = 0, 1, 2, 5, 6
_FIELDS = np.array([_LENGTH, _NULLS, _OFFSET, _BUFFERS], np.int64)


@dataclass(frozen=True, slots=True)
class BulkPlan:
    """What is fixed per schema: the nodes (IPC order), where each node's struct is found, the checks that
    the batch is a common case, and per IPC buffer the numbers that give its size from its node's."""

    n_nodes: int
    top_slots: npt.NDArray[np.int64]  # column index - _WORD: where each column's struct pointer is
    top: npt.NDArray[np.int64]  # node index of each column
    # Per level below the columns: (child node indices, parent node indices, child slots - _WORD).
    levels: tuple[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]], ...]
    null_nodes: npt.NDArray[np.int64]  # nodes of the null type: their null count is their length
    # Nodes with offsets (binary and list kinds), by offset width: (width, node indices).
    offset_nodes: tuple[tuple[int, npt.NDArray[np.int64]], ...]
    # Children whose length is their parent's times a scale (struct: 1, fixed-size list: the list size).
    scaled: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]
    # Children of lists: their length is the parent's last offset.
    listed: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
    # Per IPC buffer: node, 8 * C buffer slot, and size = mul * n + plus * (n > 0) + bits * ceil(n / 8)
    # + data * (last offset) for a node of length n.
    buf_node: npt.NDArray[np.int64]
    mul: npt.NDArray[np.int64]
    plus: npt.NDArray[np.int64]
    bits: npt.NDArray[np.int64]
    data: npt.NDArray[np.int64]
    # Validity buffers (empty without nulls): buffer indices and their nodes.
    validity: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
    buf_slot: npt.NDArray[np.int64]  # per IPC buffer: its C buffer slot - _WORD
    #: The same, as the tables of the compiled walk (:func:`flatten_walk`): per node
    #: (parent or -1, slot among its siblings, 1 for the null type, offsets' width or 0), per IPC buffer
    #: (node, C buffer slot, mul, plus, bits, data, 1 for a validity bitmap), scaled and listed children.
    node_table: npt.NDArray[np.int64]
    buf_table: npt.NDArray[np.int64]
    scaled_table: npt.NDArray[np.int64]
    listed_table: npt.NDArray[np.int64]


def _ints(values: list[int]) -> npt.NDArray[np.int64]:
    return np.array(values, np.int64)


def make_plan(columns: list[tuple[int, int, Any, tuple[Any, ...]]], kinds: dict[str, int]) -> BulkPlan | None:
    """The :class:`BulkPlan` of columns given as the encoder's (kind, width, path, children) trees, with
    ``kinds`` naming its kind numbers; ``None`` when a kind is not one this module takes."""
    null, fixed, fixed_bytes, boolean = kinds["null"], kinds["fixed"], kinds["fixed_bytes"], kinds["bool"]
    binary, large_binary = kinds["binary"], kinds["large_binary"]
    lst, large_list = kinds["list"], kinds["large_list"]
    struct, fixed_list = kinds["struct"], kinds["fixed_list"]
    depth: list[int] = []
    parent: list[int] = []
    slot: list[int] = []
    nulls: list[int] = []
    offsets: dict[int, list[int]] = {4: [], 8: []}
    scaled: list[tuple[int, int, int]] = []
    listed: list[tuple[int, int]] = []
    # node, C slot, mul, plus, bits, data
    bufs: list[tuple[int, int, int, int, int, int]] = []
    validity: list[tuple[int, int]] = []

    def add(plan: tuple[int, int, Any, tuple[Any, ...]], up: int, j: int, d: int) -> bool:
        kind, width, _, children = plan
        i = len(depth)
        depth.append(d)
        parent.append(up)
        slot.append(j)
        if kind == null:
            nulls.append(i)
            return True
        validity.append((len(bufs), i))
        bufs.append((i, 0, 0, 0, 1, 0))
        if kind in (fixed, fixed_bytes):
            bufs.append((i, 1, width, 0, 0, 0))
        elif kind == boolean:
            bufs.append((i, 1, 0, 0, 1, 0))
        elif kind in (binary, large_binary):
            offsets[width].append(i)
            bufs.append((i, 1, width, width, 0, 0))
            bufs.append((i, 2, 0, 0, 0, 1))
        elif kind in (lst, large_list):
            offsets[width].append(i)
            bufs.append((i, 1, width, width, 0, 0))
            listed.append((len(depth), i))
            return add(children[0], i, 0, d + 1)
        elif kind == fixed_list:
            scaled.append((len(depth), i, width))
            return add(children[0], i, 0, d + 1)
        elif kind == struct:
            ok = True
            for k, c in enumerate(children):
                scaled.append((len(depth), i, 1))
                ok = ok and add(c, i, k, d + 1)
            return ok
        else:
            return False
        return True

    for j, col in enumerate(columns):
        if not add(col, -1, j, 0):
            return None
    depth_arr, parent_arr, slot_arr = _ints(depth), _ints(parent), _ints(slot)
    levels: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]] = []
    for d in range(1, int(depth_arr.max(initial=0)) + 1):
        at = np.flatnonzero(depth_arr == d)
        levels.append((at, parent_arr[at], slot_arr[at] - _WORD))
    buf = _ints([x for b in bufs for x in b]).reshape(-1, 6)
    sc = _ints([x for t in scaled for x in t]).reshape(-1, 3)
    li = _ints([x for t in listed for x in t]).reshape(-1, 2)
    va = _ints([x for t in validity for x in t]).reshape(-1, 2)
    return BulkPlan(
        n_nodes=len(depth),
        top_slots=np.arange(len(columns), dtype=np.int64) - _WORD,
        top=np.flatnonzero(depth_arr == 0),
        levels=tuple(levels),
        null_nodes=_ints(nulls),
        offset_nodes=tuple((w, _ints(on)) for w, on in offsets.items() if on),
        scaled=(sc[:, 0].copy(), sc[:, 1].copy(), sc[:, 2].copy()),
        listed=(li[:, 0].copy(), li[:, 1].copy()),
        buf_node=buf[:, 0].copy(),
        mul=buf[:, 2].copy(),
        plus=buf[:, 3].copy(),
        bits=buf[:, 4].copy(),
        data=buf[:, 5].copy(),
        validity=(va[:, 0].copy(), va[:, 1].copy()),
        buf_slot=buf[:, 1] - _WORD,
        node_table=_readonly(
            np.stack(
                [parent_arr, slot_arr, np.isin(np.arange(len(depth)), nulls), _widths(len(depth), offsets)], 1
            )
        ),
        buf_table=_readonly(
            np.concatenate([buf, np.isin(np.arange(len(buf)), va[:, 0]).astype(np.int64)[:, None]], 1)
        ),
        scaled_table=_readonly(sc),
        listed_table=_readonly(li),
    )


def _widths(n: int, offsets: dict[int, list[int]]) -> npt.NDArray[np.int64]:
    out = np.zeros(n, np.int64)
    for width, nodes in offsets.items():
        out[nodes] = width
    return out


def _readonly(a: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    out = np.ascontiguousarray(a, np.int64)
    out.flags.writeable = False
    return out


_MEMORY32: npt.NDArray[np.int32] = _MEMORY[: _SPAN - _SPAN % 4].view(np.int32)
_PAD_OBJECTS = np.empty(8, object)
_PAD_OBJECTS[:] = [bytes(k) for k in range(8)]
_ZEROS = np.zeros(8, np.int64)
_ZERO_ADDRESS: int = _ZEROS.ctypes.data


@dataclass(slots=True)
class Flat:
    """A flattened batch, ready for its Message: field nodes (length, null count), body buffers (padded to
    8 bytes), the (offset, length) of each IPC buffer, and the body's length."""

    nodes: npt.NDArray[np.int64]
    body: list[Any]
    spans: npt.NDArray[np.int64]
    body_length: int


def flatten(batch: pa.RecordBatch, plan: BulkPlan) -> Flat | None:
    """The nodes and body buffers of ``batch`` (whose schema ``plan`` was made for), or ``None`` where the
    batch needs the column-by-column walk (sliced arrays, offsets to rebase, unknown null counts)."""
    root = pa.allocate_buffer(cdata.STRUCT_SIZE)
    address = root.address
    walk = flatten_walk()
    batch._export_to_c(address)
    try:
        numbers = _flatten(plan, address) if walk is None else walk(_MEMORY64, _MEMORY32, address, plan)
    except IndexError:  # an address outside _MEMORY (not seen on any platform): take the column walk
        return None
    finally:
        cdata._release_now(address)  # the numbers are read: the export can go before the body is made
    if numbers is None:
        return None
    nodes, spans, pointers, sizes, body_length = numbers
    # Views of the batch's own memory (it is their base): with every offset 0, each buffer starts where the
    # array's does, and holds exactly the bytes the message needs.
    views = map(pa.foreign_buffer, pointers.tolist(), sizes.tolist(), repeat(batch, len(sizes)))
    pad = (-sizes) & 7
    padded_at = pad.nonzero()[0]
    if len(padded_at) == 0:
        body: list[Any] = list(views)
    else:
        # Interleave the zero padding after the buffers that need it: the j-th padded buffer's padding goes
        # to position (its index + j + 1).
        count = len(sizes) + len(padded_at)
        pad_at = padded_at + np.arange(1, len(padded_at) + 1)
        is_buffer = np.ones(count, bool)
        is_buffer[pad_at] = False
        entries = np.empty(count, object)
        entries[is_buffer] = np.fromiter(views, object, len(sizes))
        entries[pad_at] = _PAD_OBJECTS[pad[padded_at]]
        body = entries.tolist()
    return Flat(nodes, body, spans, body_length)


# nodes, spans, addresses and sizes of the body's buffers, body length
_Numbers = tuple[
    npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], int
]


def _flatten(plan: BulkPlan, root: int) -> _Numbers | None:
    """From the export at ``root``: nodes, spans, and the address and size of each buffer the body holds."""
    # Exported structs and pointer arrays are 8-byte aligned: they are found by their addresses // 8
    # ("words"), with the _WORD that _MEMORY64's indices are off by folded into the constants added to them.
    memory = _MEMORY64
    words = np.empty(plan.n_nodes, np.int64)
    children = int(memory[(root >> 3) - _WORD + _CHILDREN])
    words[plan.top] = memory[(children >> 3) + plan.top_slots] >> 3
    for at, up, slot in plan.levels:
        pointers = memory[words[up] + (_CHILDREN - _WORD)]
        words[at] = memory[(pointers >> 3) + slot] >> 3
    fields = memory[words[:, None] + (_FIELDS - _WORD)]
    # Only arrays that start at their buffers' starts (sliced ones take the column walk), with null counts.
    if np.count_nonzero(fields[:, 2] | (fields[:, 1] >> 63)):
        return None
    length, nulls = fields[:, 0], fields[:, 1]
    buffers = fields[:, 3] >> 3  # the words of each node's array of buffer pointers
    if len(plan.null_nodes):
        nulls[plan.null_nodes] = length[plan.null_nodes]
    last = np.zeros(plan.n_nodes, np.int64)
    for width, on in plan.offset_nodes:
        # The data (or child values) a node needs run from its buffer's start to its last offset: a first
        # offset above 0 leaves unused bytes in front, which readers skip as the offsets say.
        n = length[on]
        start = memory[buffers[on] + (1 - _WORD)]  # C buffer 1: the offsets
        if int(np.bitwise_or.reduce(start)) & (width - 1):
            return None  # unaligned offsets
        shift = 2 if width == 4 else 3
        at = (start >> shift) + n - (_BASE >> shift)
        if not n.all():  # an empty array may have no offsets at all: read zeros instead
            at = np.where(n > 0, at, (_ZERO_ADDRESS - _BASE) >> shift)
        last[on] = _MEMORY32[at] if width == 4 else memory[at]
    # Children must cover exactly what their parents hold (else their null counts are not the exported ones).
    child, up, scale = plan.scaled
    if len(child) and (length[child] != length[up] * scale).any():
        return None
    child, up = plan.listed
    if len(child) and (length[child] != last[up]).any():
        return None
    node = plan.buf_node
    n = length[node]
    size = plan.mul * n + plan.plus * (n > 0) + plan.bits * ((n + 7) >> 3) + plan.data * last[node]
    vb, vn = plan.validity
    size[vb] *= nulls[vn] > 0
    padded = (size + 7) & -8
    ends = np.cumsum(padded)
    spans = np.empty((len(size), 2), np.int64)
    spans[:, 0] = ends - padded
    spans[:, 1] = size
    present = size.nonzero()[0]
    pointers = memory[buffers[node[present]] + plan.buf_slot[present]]
    return fields[:, :2], spans, pointers, size[present], int(ends[-1]) if len(ends) else 0


# ----------------------------------------------------------------------------------- the walk, compiled

#: ``walk(memory64, memory32, root, plan)``: what :func:`_flatten` returns for the batch
#: exported at ``root`` (nodes, spans, buffer pointers and sizes, body length), or None where it is not a
#: common case.
FlattenWalk = Callable[[Any, Any, int, Any], Any]


def flatten_walk() -> FlattenWalk | None:
    """:func:`_flatten` compiled by numba (the ``jit`` extra): one loop over the nodes and one over the
    buffers, about 2 µs for 100 columns against the numpy walk's 30; None without numba, and while it
    compiles (the first call starts that, on a thread of its own: see :mod:`dissoc.codec.jit`)."""
    walk: FlattenWalk | None = _WALK.get()
    return walk


def _build_walk(numba: Any, types: Any) -> FlattenWalk:
    table = types.Array(types.int64, 2, "C", readonly=True)
    result = types.Tuple(
        (types.int64, types.int64, types.int64)
        + (types.Array(types.int64, 2, "C"),) * 2
        + (types.Array(types.int64, 1, "C"),) * 2
    )
    memory = (
        types.Array(types.int64, 1, "C", readonly=True),
        types.Array(types.int32, 1, "C", readonly=True),
    )
    signature = result(*memory, types.int64, table, table, table, table)
    return _walk_call(numba.njit([signature], nogil=True, cache=False, boundscheck=False)(_walk_pass))


def _walk_call(walk: Any) -> FlattenWalk:
    def call(memory64: Any, memory32: Any, root: int, plan: Any) -> Any:
        try:
            status, body_length, count, fields, spans, pointers, sizes = walk(
                memory64,
                memory32,
                root,
                plan.node_table,
                plan.buf_table,
                plan.scaled_table,
                plan.listed_table,
            )
        except TypeError:  # arguments of types not compiled for (not expected): the column walk takes it
            return None
        if status:
            return None
        return fields, spans, pointers[:count], sizes[:count], body_length

    return call


def _walk_pass(  # pragma: no cover (compiled by numba)
    memory64: Any, memory32: Any, root: int, nodes: Any, bufs: Any, scaled: Any, listed: Any
) -> Any:
    """:func:`_flatten` as one loop over the nodes (parents come before their children), then
    one over the IPC buffers; status 1 where the batch is not a common case (sliced, unknown null counts,
    unaligned offsets, children not covering their parents)."""
    word = _WORD
    n = nodes.shape[0]
    nb = bufs.shape[0]
    fields = np.empty((n, 2), np.int64)
    spans = np.empty((nb, 2), np.int64)
    pointers = np.empty(nb, np.int64)
    sizes = np.empty(nb, np.int64)
    words = np.empty(n, np.int64)
    buffers = np.empty(n, np.int64)
    last = np.zeros(n, np.int64)
    top = memory64[(root >> 3) - word + _CHILDREN]
    for i in range(n):
        parent = nodes[i, 0]
        array = top if parent < 0 else memory64[words[parent] - word + _CHILDREN]
        at = memory64[(array >> 3) - word + nodes[i, 1]] >> 3
        words[i] = at
        length = memory64[at - word + _LENGTH]
        nulls = memory64[at - word + _NULLS]
        if memory64[at - word + _OFFSET] != 0 or nulls < 0:
            return 1, 0, 0, fields, spans, pointers, sizes
        if nodes[i, 2]:
            nulls = length
        fields[i, 0] = length
        fields[i, 1] = nulls
        buffers[i] = memory64[at - word + _BUFFERS] >> 3
        width = nodes[i, 3]
        if width:
            start = memory64[buffers[i] - word + 1]  # C buffer 1: the offsets
            if start & (width - 1):
                return 1, 0, 0, fields, spans, pointers, sizes
            if length > 0:
                if width == 4:
                    last[i] = memory32[(start >> 2) + length - (_BASE >> 2)]
                else:
                    last[i] = memory64[(start >> 3) + length - word]
    for k in range(scaled.shape[0]):
        if fields[scaled[k, 0], 0] != fields[scaled[k, 1], 0] * scaled[k, 2]:
            return 1, 0, 0, fields, spans, pointers, sizes
    for k in range(listed.shape[0]):
        if fields[listed[k, 0], 0] != last[listed[k, 1]]:
            return 1, 0, 0, fields, spans, pointers, sizes
    end = 0
    count = 0
    for b in range(nb):
        node = bufs[b, 0]
        length = fields[node, 0]
        size = bufs[b, 2] * length + bufs[b, 4] * ((length + 7) >> 3) + bufs[b, 5] * last[node]
        if length > 0:
            size += bufs[b, 3]
        if bufs[b, 6] and fields[node, 1] == 0:
            size = 0
        padded = (size + 7) & -8
        spans[b, 0] = end
        spans[b, 1] = size
        end += padded
        if size:
            pointers[count] = memory64[buffers[node] - word + bufs[b, 1]]
            sizes[count] = size
            count += 1
    return 0, end, count, fields, spans, pointers, sizes


_WALK = Kernel("walk of wide batches", _build_walk)
