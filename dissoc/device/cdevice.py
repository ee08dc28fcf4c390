"""The Arrow C Device Data Interface for device batches: :class:`~dissoc.device.DeviceBatch` out as an
``ArrowDeviceArray`` (``__arrow_c_device_array__``), and any producer of one in (``from_arrow_device``).

**Export** hands out the batch's own device memory, no copy: one ``ArrowArray`` per node whose buffers point
into the message bodies, ``device_type``/``device_id`` of the backend (``ARROW_DEVICE_CUDA`` and the CUDA
device with CuPy; ``ARROW_DEVICE_CPU``, -1 for the fake device, whose memory is host memory), and a
``sync_event``: a ``cudaEvent_t`` recorded on the current stream, which the consumer waits on before reading
(NULL where nothing is pending). The structs are released as :mod:`dissoc.codec.cdata` releases imported
ones, in C++ with no Python callback; the release lets go of the batch. The capsule is pyarrow's own (its
destructor releases an array the consumer did not take); dissoc only fills it in.

**Import** lays the producer's buffers out as IPC messages (what a :class:`DeviceBatch` is, and what a server
sends): one device-to-device copy per buffer into one new body per message, after waiting on the producer's
event; then it synchronises and releases the producer's array. A producer on another device type than the
backend's is refused, except host memory (``ARROW_DEVICE_CPU``), which pyarrow imports and dissoc uploads.

Not supported, refused with :class:`~dissoc.device.DeviceInterfaceError`: view types (``string_view``,
``binary_view``: their variadic buffer sizes live beside the buffers), a field whose dictionary was replaced
or extended by deltas within the batch's stream (export), and sliced arrays (a node with a non-zero
``offset``; import).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa

from dissoc.codec.cdata import STRUCT_SIZE, ZERO_ADDRESS, Keepalive, give_release
from dissoc.codec.decoder import parse
from dissoc.codec.encoder import MessageEncoder
from dissoc.codec.message import encode_dictionary_batch, encode_record_batch
from dissoc.codec.schema import FieldPlan, Layout, SchemaInfo, decode_schema
from dissoc.errors import DissocError
from dissoc.memory.cuda import (
    ARROW_DEVICE_CPU,
    ARROW_DEVICE_CUDA,
    ARROW_DEVICE_CUDA_HOST,
    ARROW_DEVICE_CUDA_MANAGED,
    DeviceBackend,
)

__all__ = [
    "DEVICE_ARRAY_SIZE",
    "DeviceInterfaceError",
    "Imported",
    "empty_array_capsule",
    "export_device_array",
    "import_device_array",
]


class DeviceInterfaceError(DissocError, TypeError):
    """A column cannot be handed out as a typed device array (not fixed-width, or not device memory), or a
    batch cannot cross the Arrow C Device Data Interface."""


#: What an import gives: host data to upload, or ``(schema message, [(metadata, device body, dictionary id or
#: None)])``, the messages of a device batch.
Imported: TypeAlias = "pa.RecordBatch | tuple[bytes, list[tuple[bytes, Any, int | None]]]"

#: sizeof(struct ArrowDeviceArray): the ArrowArray, device_id, device_type (padded), sync_event, reserved[3].
DEVICE_ARRAY_SIZE = 128
_DEVICE_ID, _DEVICE_TYPE, _SYNC_EVENT = 80, 88, 96
ARRAY_CAPSULE = b"arrow_device_array"

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

#: What each layout has in a C ArrowArray: its buffer count, and whether the first is a validity bitmap.
_C_BUFFERS: dict[Layout, tuple[int, bool]] = {
    Layout.NULL: (0, False),
    Layout.BOOL: (2, True),
    Layout.FIXED: (2, True),
    Layout.BINARY: (3, True),
    Layout.LARGE_BINARY: (3, True),
    Layout.LIST: (2, True),
    Layout.LARGE_LIST: (2, True),
    Layout.LIST_VIEW: (3, True),
    Layout.LARGE_LIST_VIEW: (3, True),
    Layout.FIXED_LIST: (1, True),
    Layout.STRUCT: (1, True),
    Layout.SPARSE_UNION: (1, False),
    Layout.DENSE_UNION: (2, False),
    Layout.RUN_END: (0, False),
}


def _interface_error(message: str) -> Exception:
    return DeviceInterfaceError(message)


class _Unsupported(DeviceInterfaceError):
    """What the walk over an imported array does not take (sliced nodes, views); host memory then goes
    through pyarrow instead."""


def empty_array_capsule() -> tuple[object, object]:
    """A pyarrow ``arrow_device_array`` capsule (with its destructor), its own content released."""
    schema_capsule, array_capsule = pa.RecordBatch.from_arrays([], names=[]).__arrow_c_device_array__()
    address = _capsule_address(array_capsule)
    _release(address)
    return schema_capsule, array_capsule


def _capsule_address(capsule: object) -> int:
    address = _get_pointer(capsule, ARRAY_CAPSULE)
    if not address:
        raise _interface_error("not an arrow_device_array capsule")
    return int(address)


_RELEASE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _release(address: int) -> None:
    """Release the ArrowArray at ``address`` if it is not released yet (a call into C, not a callback)."""
    fn = ctypes.c_uint64.from_address(address + 64).value
    if fn:
        _RELEASE_FN(fn)(address)


# ---------------------------------------------------------------------------------------------------- export


@dataclass(slots=True)
class _Node:
    length: int
    null_count: int
    buffers: list[int]
    children: list[int] = field(default_factory=list)
    dictionary: int = -1


class _Tree:
    """Nodes in pre-order; node 0 is the root struct."""

    def __init__(self, cpu: bool) -> None:
        self.nodes: list[_Node] = []
        self.cpu = cpu

    def add(self, node: _Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def column(self, col: Any, backend: DeviceBackend) -> int:
        """Add a :class:`~dissoc.device.DeviceColumn` (and its children and dictionary) as nodes."""
        fl = col.layout
        if fl.layout == Layout.VIEW:
            raise _interface_error(
                f"column {col.name!r} of type {col.type}: view types are not exported through the C Device "
                "Data Interface"
            )
        _, has_validity = _C_BUFFERS[fl.layout]
        base = backend.pointer(col._body) if col.spans else 0
        buffers = []
        for k, (off, n) in enumerate(col.spans):
            if n:
                buffers.append(base + off)
            elif k == 0 and has_validity:
                buffers.append(0)  # no nulls: no bitmap
            else:  # an empty buffer: somewhere valid (a consumer may read the one offset of an empty array)
                buffers.append(ZERO_ADDRESS if self.cpu else base + off)
        index = self.add(_Node(col.length, col.null_count, buffers))
        node = self.nodes[index]
        if fl.dictionary_id >= 0:
            if len(col.dictionary_chunks) != 1:
                raise _interface_error(
                    f"column {col.name!r}: its dictionary was extended by delta batches; the C Device Data "
                    "Interface takes one dictionary array (download it with to_arrow instead)"
                )
            node.dictionary = self.column(col.dictionary_chunks[0], backend)
        node.children = [self.column(c, backend) for c in col.children]
        return index


def export_device_array(
    backend: DeviceBackend, schema: pa.Schema, num_rows: int, columns: list[Any], owner: object
) -> tuple[object, object]:
    """``(schema capsule, arrow_device_array capsule)`` of a device batch's ``columns``
    (:class:`~dissoc.device.DeviceColumn`), over their own device memory; ``owner`` (the batch) is kept
    alive until the consumer releases the array."""
    device_type, device_id = backend.arrow_device()
    tree = _Tree(cpu=device_type == ARROW_DEVICE_CPU)
    root = tree.add(_Node(num_rows, 0, [0]))
    tree.nodes[root].children = [tree.column(c, backend) for c in columns]
    nodes = tree.nodes
    n = len(nodes)
    structs = np.zeros((n, 10), np.uint64)
    flat_buffers = np.zeros(max(1, sum(len(x.buffers) for x in nodes)), np.uint64)
    flat_children = np.zeros(max(1, sum(len(x.children) for x in nodes)), np.uint64)
    s_base, b_base, c_base = structs.ctypes.data, flat_buffers.ctypes.data, flat_children.ctypes.data
    b_pos = c_pos = 0
    for i, x in enumerate(nodes):
        row = structs[i]
        row[0] = x.length
        row[1] = x.null_count
        row[3] = len(x.buffers)
        row[4] = len(x.children)
        if x.buffers:
            flat_buffers[b_pos : b_pos + len(x.buffers)] = x.buffers
            row[5] = b_base + 8 * b_pos
            b_pos += len(x.buffers)
        if x.children:
            flat_children[c_pos : c_pos + len(x.children)] = [s_base + STRUCT_SIZE * c for c in x.children]
            row[6] = c_base + 8 * c_pos
            c_pos += len(x.children)
        if x.dictionary >= 0:
            row[7] = s_base + STRUCT_SIZE * x.dictionary
    keep = Keepalive()
    event_keep, event = backend.record_event()
    keep.objects += [owner, structs, flat_buffers, flat_children, event_keep]
    give_release(structs, keep)
    schema_capsule = schema.__arrow_c_schema__()
    _, array_capsule = empty_array_capsule()
    address = _capsule_address(array_capsule)
    ctypes.memmove(address, s_base, STRUCT_SIZE)  # moved: the capsule's struct is the root from now on
    structs[0, 8] = 0
    ctypes.c_int64.from_address(address + _DEVICE_ID).value = device_id
    ctypes.c_int64.from_address(address + _DEVICE_TYPE).value = device_type  # int32, and 4 bytes of padding
    ctypes.c_uint64.from_address(address + _SYNC_EVENT).value = event
    ctypes.memset(address + _SYNC_EVENT + 8, 0, DEVICE_ARRAY_SIZE - _SYNC_EVENT - 8)
    return schema_capsule, array_capsule


# ---------------------------------------------------------------------------------------------------- import


class _Schema:
    __slots__ = ("capsule",)

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __arrow_c_schema__(self) -> object:
        return self.capsule


@dataclass(slots=True)
class _Message:
    """One IPC message being laid out: field nodes, buffer spans, and the copies that fill its body."""

    nodes: list[tuple[int, int]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (body offset, source address, bytes)
    size: int = 0

    def buffer(self, address: int, nbytes: int) -> None:
        self.spans.append((self.size, nbytes))
        if nbytes:
            self.copies.append((self.size, address, nbytes))
        self.size += (nbytes + 7) & ~7


class _Importer:
    def __init__(self, backend: DeviceBackend, info: SchemaInfo) -> None:
        self.backend = backend
        self.info = info
        self.dictionaries: list[tuple[int, int, _Message]] = []  # (id, length, message), in stream order

    def _read(self, address: int, nbytes: int) -> bytes:
        """``nbytes`` of device memory at ``address``, downloaded."""
        return bytes(self.backend.download(self.backend.wrap(address, nbytes, None)))

    def node(self, address: int, plan: FieldPlan, msg: _Message) -> None:
        raw = _words(address, 10, signed=True)
        length, null_count, offset, n_buffers, n_children = (int(v) for v in raw[:5])
        name = plan.field.name
        if length < 0 or n_buffers < 0 or n_children < 0:
            raise _interface_error(f"field {name!r}: a negative length or count in its ArrowArray")
        if offset != 0:
            raise _Unsupported(
                f"field {name!r}: its ArrowArray is sliced (offset {offset}); only unsliced device arrays "
                "are imported"
            )
        if plan.layout == Layout.VIEW:
            raise _Unsupported(f"field {name!r} of type {plan.field.type}: view types are not imported")
        want, has_validity = _C_BUFFERS[plan.layout]
        if n_buffers != want or n_children != len(plan.children):
            raise _interface_error(
                f"field {name!r} of type {plan.field.type}: expected {want} buffers and {len(plan.children)} "
                f"children, the ArrowArray has {n_buffers} and {n_children}"
            )
        buffers = _words(raw[5], want)
        if plan.layout == Layout.NULL:
            null_count = length
        elif has_validity:
            if buffers[0] == 0:
                null_count = 0
            elif null_count < 0:
                bits = np.unpackbits(
                    np.frombuffer(self._read(buffers[0], (length + 7) // 8), np.uint8), bitorder="little"
                )[:length]
                null_count = length - int(bits.sum())
        else:
            null_count = 0
        msg.nodes.append((length, null_count))
        if has_validity:
            msg.buffer(buffers[0], (length + 7) // 8 if buffers[0] and null_count else 0)
        layout = plan.layout
        if layout == Layout.BOOL:
            msg.buffer(buffers[1], (length + 7) // 8)
        elif layout == Layout.FIXED:
            msg.buffer(buffers[1], length * plan.width)
        elif layout in (Layout.BINARY, Layout.LARGE_BINARY):
            width = 4 if layout == Layout.BINARY else 8
            msg.buffer(buffers[1], (length + 1) * width if length else 0)
            end = (
                int.from_bytes(self._read(buffers[1] + length * width, width), "little", signed=True)
                if length
                else 0
            )
            if end < 0:
                raise _interface_error(f"field {name!r}: a negative last offset ({end})")
            msg.buffer(buffers[2], end)
        elif layout in (Layout.LIST, Layout.LARGE_LIST):
            width = 4 if layout == Layout.LIST else 8
            msg.buffer(buffers[1], (length + 1) * width if length else 0)
        elif layout in (Layout.LIST_VIEW, Layout.LARGE_LIST_VIEW):
            width = 4 if layout == Layout.LIST_VIEW else 8
            msg.buffer(buffers[1], length * width)
            msg.buffer(buffers[2], length * width)
        elif layout == Layout.SPARSE_UNION:
            msg.buffer(buffers[0], length)
        elif layout == Layout.DENSE_UNION:
            msg.buffer(buffers[0], length)
            msg.buffer(buffers[1], length * 4)
        for child, child_plan in zip(_words(raw[6], n_children), plan.children, strict=True):
            self.node(child, child_plan, msg)
        if plan.dict_id >= 0:
            dictionary = int(raw[7])
            if not dictionary:
                raise _interface_error(f"field {name!r} is dictionary-encoded but its ArrowArray has none")
            values = _Message()
            self.node(dictionary, self.info.dictionaries[plan.dict_id].value_plan, values)
            self.dictionaries.append((plan.dict_id, values.nodes[0][0], values))

    def land(self, msg: _Message, owner: object) -> Any:
        body = self.backend.empty(msg.size)
        xp_body = self.backend.as_xp(body) if msg.size else None
        for off, address, nbytes in msg.copies:
            self.backend.copy(body[off : off + nbytes], self.backend.wrap(address, nbytes, owner))
        # the padding after each buffer: zeros, as the encoder writes
        for off, nbytes in msg.spans:
            padded = (nbytes + 7) & ~7
            if padded > nbytes and xp_body is not None:
                xp_body[off + nbytes : off + padded] = 0
        return body


def import_device_array(obj: Any, backend: DeviceBackend) -> Imported:
    """What ``obj`` exports, copied into ``backend``'s memory as a device batch's messages (or, for host
    memory the walk does not take, as a host batch to upload)."""
    if not hasattr(obj, "__arrow_c_device_array__"):
        if hasattr(obj, "__arrow_c_array__"):
            return pa.record_batch(obj)
        raise _interface_error(
            f"a {type(obj).__name__} exports no Arrow device array (__arrow_c_device_array__) or array "
            "(__arrow_c_array__)"
        )
    schema_capsule, array_capsule = obj.__arrow_c_device_array__()
    address = _capsule_address(array_capsule)
    device_type = ctypes.c_int32.from_address(address + _DEVICE_TYPE).value
    own_type, _ = backend.arrow_device()
    cuda = own_type == ARROW_DEVICE_CUDA and device_type in (
        ARROW_DEVICE_CUDA,
        ARROW_DEVICE_CUDA_HOST,
        ARROW_DEVICE_CUDA_MANAGED,
    )
    if device_type != own_type and not cuda:
        if device_type == ARROW_DEVICE_CPU:
            return pa.RecordBatch._import_from_c_device_capsule(schema_capsule, array_capsule)
        raise _interface_error(
            f"the array is on Arrow device type {device_type}; the {backend.name!r} device backend takes "
            f"{own_type}" + (" or host memory" if own_type != ARROW_DEVICE_CPU else "")
        )
    try:
        schema = pa.schema(_Schema(schema_capsule))  # (takes the capsule's ArrowSchema)
        return _import(schema, address, backend, array_capsule)
    except _Unsupported:
        if device_type != ARROW_DEVICE_CPU:
            raise
        # Host memory the walk does not take (sliced, views): pyarrow takes it all, then one upload.
        return pa.RecordBatch._import_from_c_device_capsule(schema.__arrow_c_schema__(), array_capsule)
    finally:
        _release(address)


def _import(schema: pa.Schema, address: int, backend: DeviceBackend, owner: object) -> Imported:
    schema_metadata = MessageEncoder(schema).schema_message().metadata
    header = parse(schema_metadata).info.header
    assert header is not None  # (the encoder's own Schema message)
    info = decode_schema(header)
    root = _words(address, 10, signed=True)
    if int(root[2]) != 0:
        raise _Unsupported(
            f"the ArrowArray is sliced (offset {int(root[2])}); only unsliced ones are imported"
        )
    if int(root[4]) != len(info.plans):
        raise _interface_error(
            f"the ArrowArray has {int(root[4])} children, its schema {len(info.plans)} fields"
        )
    event = ctypes.c_uint64.from_address(address + _SYNC_EVENT).value
    if event:
        backend.wait_event(event)
    importer = _Importer(backend, info)
    msg = _Message()
    for child, plan in zip(_words(root[6], len(info.plans)), info.plans, strict=True):
        importer.node(int(child), plan, msg)
    messages: list[tuple[bytes, Any, int | None]] = []
    for dict_id, length, values in importer.dictionaries:
        metadata = encode_dictionary_batch(
            dict_id, False, length, _pairs(values.nodes), _pairs(values.spans), values.size
        )
        messages.append((metadata, importer.land(values, owner), dict_id))
    metadata = encode_record_batch(int(root[0]), _pairs(msg.nodes), _pairs(msg.spans), msg.size)
    messages.append((metadata, importer.land(msg, owner), None))
    backend.synchronize()  # the copies are done before the producer may free its memory
    return schema_metadata, messages


def _words(address: int, count: int, *, signed: bool = False) -> list[int]:
    """``count`` 64-bit words at host ``address`` (a struct, or its arrays of pointers)."""
    kind = ctypes.c_int64 if signed else ctypes.c_uint64
    return list((kind * count).from_address(address)) if count else []


def _pairs(rows: list[tuple[int, int]]) -> Any:
    return np.asarray(rows, np.int64).reshape(-1, 2)
