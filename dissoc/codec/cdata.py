"""Build ``pyarrow`` arrays over existing memory through the Arrow C Data Interface.

Decoding a batch fills one ``ArrowArray`` struct per field node (plus a root struct) with numpy, in bulk, and
hands the whole tree to pyarrow in a single import: this is what makes per-message decoding cheap for wide
batches, and it never copies a buffer.

Lifetime without Python callbacks: a release callback written in Python can be invoked by pyarrow while an
exception is propagating, and then fails, which makes Arrow abort the process. So the structs get Arrow's own
C++ release function instead. Its private data comes from exporting a throwaway struct array (one exported
struct per node we need): the throwaway's root holds, as buffers, everything our structs point at (the body,
decompressed buffers, the struct and pointer arrays themselves), so that memory lives exactly until pyarrow
releases the imported batch, and all of it is freed in C++.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from functools import lru_cache

import numpy as np
import numpy.typing as npt
import pyarrow as pa

__all__ = [
    "STRUCT_SIZE",
    "Keepalive",
    "children_release",
    "export_array",
    "give_release",
    "import_batch",
    "native_function",
    "view_as",
]

STRUCT_SIZE = 80  # sizeof(struct ArrowArray): 5 int64 + 5 pointers
_RELEASE = 8  # uint64 column of the release callback
_PRIVATE = 9  # uint64 column of private_data
_CHILDREN = 6

_RELEASE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Keepalive:
    """Objects that must outlive an imported batch (buffers, numpy arrays, exported dictionary structs)."""

    __slots__ = ("objects",)

    def __init__(self) -> None:
        self.objects: list[object] = []


@lru_cache(maxsize=256)
def _dummy_type(m: int) -> pa.DataType:
    return pa.struct([pa.field(f"n{i}", pa.null()) for i in range(m)])


_HOLDER_TARGET = pa.allocate_buffer(8)
# Where empty buffers point: Arrow computes sizes from lengths and may read one offset of an empty array.
_ZERO = pa.py_buffer(bytes(64))
ZERO_ADDRESS: int = _ZERO.address
_HOLDER_ADDRESS = _HOLDER_TARGET.address


_NULL0 = pa.nulls(0)


def _release_now(addr: int) -> None:
    """Release an exported struct from Python (a direct call into C, never a callback)."""
    fn = ctypes.c_uint64.from_address(addr + 8 * _RELEASE).value
    if fn:
        _RELEASE_FN(fn)(addr)


def view_as(obj: pa.Array | pa.RecordBatch, target: pa.DataType | pa.Schema) -> pa.Array | pa.RecordBatch:
    """The same memory under another type (an array) or schema (a batch) of identical layout, no copy."""
    struct = pa.allocate_buffer(STRUCT_SIZE)
    obj._export_to_c(struct.address)
    cls = pa.RecordBatch if isinstance(obj, pa.RecordBatch) else pa.Array
    return cls._import_from_c(struct.address, target)


def export_array(array: pa.Array, keep: Keepalive) -> int:
    """Export ``array`` into a fresh ArrowArray struct kept alive by ``keep``; returns the struct's address.

    The struct pointing at it (as its dictionary) releases it.
    """
    struct = pa.allocate_buffer(STRUCT_SIZE)
    addr: int = struct.address
    array._export_to_c(addr)
    keep.objects.append(struct)
    return addr


class _PrivateDataPool:
    """Spare ``private_data`` pointers of Arrow's exporter, one per child struct we release.

    Each comes from a child of a large throwaway export whose child struct is then marked released, so that
    releasing the throwaway's root does not free it: it is freed when the struct we give it to is released.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = np.zeros(0, np.uint64)
        self._pos = 0

    def take(self, k: int) -> npt.NDArray[np.uint64]:
        with self._lock:
            if self._pos + k > len(self._pool):
                self._refill(max(4096, k))
            out = self._pool[self._pos : self._pos + k]
            self._pos += k
            return out

    def _refill(self, m: int) -> None:
        dummy = pa.StructArray.from_buffers(_dummy_type(m), 0, [None], children=[_NULL0] * m)
        root_buf = pa.allocate_buffer(STRUCT_SIZE)
        dummy._export_to_c(root_buf.address)
        root = np.frombuffer(root_buf, np.uint64)
        ptrs = np.frombuffer(ctypes.string_at(int(root[_CHILDREN]), 8 * m), np.uint64)
        first = int(ptrs[0])
        if bool((np.diff(ptrs) == STRUCT_SIZE).all()):
            children = np.ctypeslib.as_array((ctypes.c_uint64 * (10 * m)).from_address(first)).reshape(m, 10)
            private = children[:, _PRIVATE].copy()
            children[:, _RELEASE] = 0
        else:
            private = np.empty(m, np.uint64)
            for i, addr in enumerate(ptrs.tolist()):
                child = np.ctypeslib.as_array((ctypes.c_uint64 * 10).from_address(addr))
                private[i] = child[_PRIVATE]
                child[_RELEASE] = 0
        _release_now(root_buf.address)
        self._pool = np.concatenate([self._pool[self._pos :], private])
        self._pos = 0


_pool = _PrivateDataPool()


def native_function(*, x86_64: str, aarch64: list[int]) -> int:
    """The address of a machine-code function of this machine's architecture (``x86_64`` as hex bytes,
    ``aarch64`` as 32-bit instruction words), in an executable page kept for the process's life; 0 on other
    architectures or where no executable page can be had."""
    import platform

    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        code = bytes.fromhex(x86_64)
    elif machine in ("aarch64", "arm64"):
        code = b"".join(word.to_bytes(4, "little") for word in aarch64)
    else:
        return 0
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError):
        return 0
    page.write(code)
    # Never unmapped: batches may be released during interpreter shutdown, after this module's globals are
    # gone, and their release must still find the code. One extra reference keeps the mapping for good.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(page))
    _keep_page.append(page)
    addr: int = ctypes.addressof(ctypes.c_char.from_buffer(page))
    return addr


def _mark_released_function() -> int:
    """Address of a native ``void f(struct ArrowArray* a) { a->release = NULL; }``, or 0 if unavailable.

    Child structs own nothing (their parent's release frees everything), so all their release needs to do is
    mark them released; Arrow checks that it did. Writing it as two machine instructions avoids both a
    Python callback (unsafe, see the module docstring) and one exported private data per node.
    """
    addr = native_function(
        x86_64="48c7474000000000c3",  # mov qword [rdi+64], 0 ; ret
        aarch64=[0xF900201F, 0xD65F03C0],  # str xzr,[x0,#64]; ret
    )
    if not addr:
        return 0
    # Prove it works on a scratch struct before trusting it.
    scratch = (ctypes.c_uint64 * 10)(*range(1, 11))
    _RELEASE_FN(addr)(ctypes.addressof(scratch))
    if scratch[_RELEASE] != 0 or scratch[_PRIVATE] != 10:
        return 0
    return addr


_keep_page: list[mmap.mmap] = []
_MARK_RELEASED = _mark_released_function()
_ROOT_TYPE = pa.struct([])


def children_release() -> int:
    """What :func:`import_batch` writes as the release callback of child structs that own no dictionary
    (0 where it gives each its own private data instead): a template may hold it already."""
    return _MARK_RELEASED


def import_batch(
    structs: npt.NDArray[np.uint64],
    address: int,
    schema: pa.Schema,
    keep: Keepalive,
    owners: npt.NDArray[np.intp] | None = None,
) -> pa.RecordBatch:
    """Import the tree whose root is ``structs[0]`` (an (n, 10) uint64 array at ``address``) as a batch.

    Fills in the release callbacks and private data of every struct, then imports; on failure pyarrow has
    released the tree (and with it everything in ``keep``). ``structs`` must be memory owned by ``keep``.
    ``owners``, when given, are the structs that point at an exported dictionary, and the other child
    structs already hold :func:`children_release` as their release callback (a template filled it in).
    """
    give_release(structs, keep, owners)
    return pa.RecordBatch._import_from_c(address, schema)


def give_release(
    structs: npt.NDArray[np.uint64], keep: Keepalive, owners: npt.NDArray[np.intp] | None = None
) -> None:
    """Fill in the release callbacks and private data of a tree of ArrowArray structs (``structs[0]`` its
    root, an (n, 10) uint64 array), so that releasing the root frees everything in ``keep``, in C++ (see the
    module docstring). ``owners`` as for :func:`import_batch`."""
    n = len(structs)
    # The root's private data owns one zero-length buffer whose base is the list of everything to keep.
    holder = pa.foreign_buffer(_HOLDER_ADDRESS, 0, keep.objects)
    dummy = pa.StructArray.from_buffers(_ROOT_TYPE, 0, [holder], children=[])
    root_buf = pa.allocate_buffer(STRUCT_SIZE)
    dummy._export_to_c(root_buf.address)
    root = np.frombuffer(root_buf, np.uint64)
    structs[0, _RELEASE] = root[_RELEASE]
    structs[0, _PRIVATE] = root[_PRIVATE]
    if n > 1:
        if _MARK_RELEASED:
            if owners is None:
                structs[1:, _RELEASE] = _MARK_RELEASED
                owners = np.flatnonzero(structs[1:, 7]) + 1
            # A node with a dictionary must release that dictionary's export: give it Arrow's release.
            if owners.size:
                structs[owners, _RELEASE] = root[_RELEASE]
                structs[owners, _PRIVATE] = _pool.take(len(owners))
        else:
            structs[1:, _RELEASE] = root[_RELEASE]
            structs[1:, _PRIVATE] = _pool.take(n - 1)
