"""Content checks that keep decoded arrays from reading out of bounds.

pyarrow's cheap ``validate()`` checks buffer sizes but trusts the values inside offsets, views, union type ids
and offsets, dictionary indices and run ends; its full validation also rejects semantically odd but legal data
(decimals beyond their precision, date64 values that are not whole days). These checks cover exactly what
memory safety needs, vectorised with numpy, before the batch is handed to pyarrow.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from dissoc.codec.schema import FieldPlan, Layout
from dissoc.errors import CodecError

__all__ = ["check_node", "check_run_ends"]


def _at(addr: int, count: int, dtype: str) -> npt.NDArray[Any]:
    """``count`` elements of ``dtype`` at ``addr`` (no copy)."""
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.zeros(0, dtype)
    raw = (ctypes.c_char * nbytes).from_address(addr)
    out: npt.NDArray[Any] = np.frombuffer(memoryview(raw).cast("B"), dtype)
    return out


def _need(what: str, have: int, need: int) -> None:
    if have < need:
        raise CodecError(f"{what}: buffer holds {have} bytes, {need} are needed")


def _valid_mask(addr: int, size: int, length: int, null_count: int) -> npt.NDArray[np.bool_] | None:
    if null_count == 0 or addr == 0:
        return None
    _need("validity bitmap", size, (length + 7) // 8)
    bits = np.unpackbits(_at(addr, (length + 7) // 8, "u1").astype(np.uint8), bitorder="little")[:length]
    mask: npt.NDArray[np.bool_] = bits.astype(bool)
    return mask


def check_node(
    plan: FieldPlan,
    name: str,
    length: int,
    null_count: int,
    addrs: Sequence[int],
    sizes: Sequence[int],
    child_lengths: Sequence[int],
    dictionary_length: int,
) -> None:
    """Check one node's offsets, views, type ids or indices against what they index into."""
    lay = plan.layout
    if length == 0:
        return
    if lay in (Layout.BINARY, Layout.LARGE_BINARY, Layout.LIST, Layout.LARGE_LIST):
        dtype = "<i8" if lay in (Layout.LARGE_BINARY, Layout.LARGE_LIST) else "<i4"
        w = 8 if dtype == "<i8" else 4
        if sizes[1] < (length + 1) * w:
            _need(f"{name}: offsets", sizes[1], (length + 1) * w)
        offs = _at(addrs[1], length + 1, dtype)
        limit = sizes[2] if lay in (Layout.BINARY, Layout.LARGE_BINARY) else child_lengths[0]
        # (a comparison of the shifted views: half the time of np.diff's subtraction and sign test)
        if offs[0] < 0 or offs[-1] > limit or bool((offs[1:] < offs[:-1]).any()):
            raise CodecError(
                f"{name}: offsets must rise monotonically from >= 0 to at most {limit}, got first "
                f"{int(offs[0])}, last {int(offs[-1])}"
            )
    elif lay in (Layout.LIST_VIEW, Layout.LARGE_LIST_VIEW):
        dtype = "<i8" if lay == Layout.LARGE_LIST_VIEW else "<i4"
        w = np.dtype(dtype).itemsize
        _need(f"{name}: offsets", sizes[1], length * w)
        _need(f"{name}: sizes", sizes[2], length * w)
        offs = _at(addrs[1], length, dtype).astype(np.int64)
        lens = _at(addrs[2], length, dtype).astype(np.int64)
        child = child_lengths[0]
        bad = (lens < 0) | ((lens > 0) & ((offs < 0) | (offs + lens > child)))
        # A valid slot's offset lies in the child even when the view is empty (Arrow's validation requires
        # it, and its kernels read it); a null slot's may be anything.
        outside = (offs < 0) | (offs > child)
        valid = _valid_mask(addrs[0], sizes[0], length, null_count)
        bad |= outside if valid is None else outside & valid
        if bool(bad.any()):
            i = int(np.flatnonzero(bad)[0])
            raise CodecError(
                f"{name}: list view {i} (offset {int(offs[i])}, size {int(lens[i])}) lies outside its "
                f"{child_lengths[0]}-element child"
            )
    elif lay == Layout.VIEW:
        _need(f"{name}: views", sizes[1], length * 16)
        views = _at(addrs[1], length * 4, "<i4").reshape(length, 4)
        vlen = views[:, 0].astype(np.int64)
        if bool((vlen < 0).any()):
            raise CodecError(f"{name}: a view has a negative length")
        long = vlen > 12
        if bool(long.any()):
            idx = views[long, 2].astype(np.int64)
            off = views[long, 3].astype(np.int64)
            nvar = len(addrs) - 2
            if bool(((idx < 0) | (idx >= nvar)).any()):
                raise CodecError(f"{name}: a view names a data buffer outside the {nvar} it has")
            bufsize = np.asarray(sizes[2:], np.int64)[idx]
            if bool(((off < 0) | (off + vlen[long] > bufsize)).any()):
                raise CodecError(f"{name}: a view points past the end of its data buffer")
    elif lay in (Layout.SPARSE_UNION, Layout.DENSE_UNION):
        codes = plan.field.type.type_codes if plan.dict_id < 0 else []
        _need(f"{name}: type ids", sizes[0], length)
        tids = _at(addrs[0], length, "i1")
        lut = np.full(256, -1, np.int64)
        lut[np.asarray(codes, np.int64)] = np.arange(len(codes))
        child = lut[tids.astype(np.int64) & 0xFF]
        if bool((child < 0).any()):
            raise CodecError(
                f"{name}: type id {int(tids[np.flatnonzero(child < 0)[0]])} is not one of {codes}"
            )
        if lay == Layout.DENSE_UNION:
            _need(f"{name}: offsets", sizes[1], length * 4)
            offs = _at(addrs[1], length, "<i4").astype(np.int64)
            clen = np.asarray(child_lengths, np.int64)[child]
            if bool(((offs < 0) | (offs >= clen)).any()):
                raise CodecError(f"{name}: a dense union offset points outside its child")
            for k in range(len(codes)):
                mine = offs[child == k]
                if mine.size > 1 and bool((np.diff(mine) < 0).any()):
                    raise CodecError(f"{name}: dense union offsets into child {k} must not decrease")
    elif lay == Layout.RUN_END:
        pass  # checked on the run ends child, which knows the parent's length through child_lengths
    if plan.dict_id >= 0:
        dtype = {1: "i1", 2: "<i2", 4: "<i4", 8: "<i8"}[plan.width]
        if pa.types.is_unsigned_integer(plan.field.type.index_type):
            dtype = dtype.replace("i", "u")
        _need(f"{name}: indices", sizes[1], length * plan.width)
        idx = _at(addrs[1], length, dtype).astype(np.int64)
        mask = _valid_mask(addrs[0], sizes[0], length, null_count)
        if mask is not None:
            idx = idx[mask]
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= dictionary_length):
            raise CodecError(
                f"{name}: dictionary indices must lie in [0, {dictionary_length}), got "
                f"{int(idx.min())}..{int(idx.max())}"
            )


def check_run_ends(
    name: str, length: int, run_ends_addr: int, run_ends_size: int, n_runs: int, width: int, n_values: int
) -> None:
    """Run ends must be positive, strictly increasing, and cover the parent's length."""
    if length == 0:
        return
    if n_runs == 0 or n_values < n_runs:
        raise CodecError(f"{name}: {length} values need at least one run and as many values as runs")
    _need(f"{name}: run ends", run_ends_size, n_runs * width)
    ends = _at(run_ends_addr, n_runs, {2: "<i2", 4: "<i4", 8: "<i8"}[width]).astype(np.int64)
    if ends[0] <= 0 or bool((np.diff(ends) <= 0).any()) or ends[-1] < length:
        raise CodecError(f"{name}: run ends must rise strictly from > 0 to at least {length}")
