"""Hash partitioning of device batches on the device: destinations, and one device batch per destination.

For the Spark barrier exchange with GPU data: :func:`device_destinations` hashes a batch's key columns where
they lie (the row hash of :mod:`dissoc.hashing`, so a host task and a device task of one stage send equal keys
to the same task), and :func:`partition_device_batch` gathers the rows of each destination into a new
:class:`~dissoc.device.DeviceBatch` whose body is one device allocation. The arithmetic runs in the
backend's array module (:attr:`~dissoc.memory.cuda.DeviceBackend.array_module`: CuPy on a GPU, numpy on the
fake device); only numbers of rows and of nulls per destination come to the host, where the RecordBatch
metadata is built (:func:`~dissoc.codec.message.encode_record_batch`).

What runs on the device: key columns that hash by value (integers, floats, booleans, dates, times,
timestamps, durations; nulls allowed), and gathering batches whose columns are all flat and fixed-width
(those, plus decimals, fixed-size binaries, intervals, the null type, and extension types stored as one of
them; validity bitmaps and boolean values are gathered bit by bit). Everything else -- strings and other
variable-width or nested columns, dictionary-encoded columns, extension-typed keys -- raises
:class:`~dissoc.device.DeviceInterfaceError`: partition those on the host. :func:`can_partition_on_device`
tells beforehand.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa

from dissoc.codec.encoder import BODY_PADDING
from dissoc.codec.layout import FieldLayout, schema_info
from dissoc.codec.message import encode_record_batch
from dissoc.codec.schema import FieldPlan, Layout, SchemaInfo
from dissoc.device.batch import DeviceBatch, DeviceColumn, DeviceInterfaceError, DeviceMessage
from dissoc.errors import DissocError
from dissoc.hashing import destination_order, hashes_by_value, row_hash, unpack_bits, value_hash, with_nulls
from dissoc.hashing import destinations as bucket_of
from dissoc.memory.cuda import DeviceBackend

__all__ = [
    "can_partition_on_device",
    "concat_device_batches",
    "device_destinations",
    "partition_device_batch",
]

log = logging.getLogger(__name__)

_GATHERED = (Layout.FIXED, Layout.BOOL, Layout.NULL)
_HOST_HINT = "partition it on the host instead (DeviceBatch.to_arrow, then dissoc.spark's hash_partition)"


def _key_names(key: str | Sequence[str], names: Sequence[str], n: int, what: str) -> list[str]:
    """The key column names, checked: ``n`` positive, at least one key, each naming exactly one column."""
    if n <= 0:
        raise DissocError(f"{what}: the number of tasks must be positive, got {n}")
    keys = [key] if isinstance(key, str) else list(key)
    if not keys:
        raise DissocError(f"{what}: expected at least one key column")
    for name in keys:
        found = list(names).count(name)
        if found != 1:
            problem = "no column" if found == 0 else f"{found} columns named"
            raise DissocError(f"{what}: {problem} {name!r} (columns: {', '.join(names)})")
    return keys


def _hashable_on_device(ty: pa.DataType, dictionary_id: int) -> bool:
    return dictionary_id < 0 and hashes_by_value(ty)


def _gathered_on_device(layout: Layout, dictionary_id: int, has_children: bool, width: int) -> bool:
    if dictionary_id >= 0 or has_children or layout not in _GATHERED:
        return False
    return layout != Layout.FIXED or width > 0


def can_partition_on_device(schema: pa.Schema | SchemaInfo, key: str | Sequence[str] | None) -> bool:
    """Whether :func:`partition_device_batch` can partition batches of ``schema`` by ``key`` on the device:
    every key column hashes by value and every column is flat and fixed-width (see the module docstring).
    ``key=None`` asks about gathering only (destinations given by the caller). A missing or ambiguous key
    column gives False (partitioning raises, naming the columns)."""
    info = schema if isinstance(schema, SchemaInfo) else schema_info(schema)
    plans: list[FieldPlan] = info.plans
    if not all(_gathered_on_device(p.layout, p.dict_id, bool(p.children), p.width) for p in plans):
        return False
    if key is None:
        return True
    names = [p.field.name for p in plans]
    keys = [key] if isinstance(key, str) else list(key)
    if not keys or any(names.count(name) != 1 for name in keys):
        return False
    by_name = {p.field.name: p for p in plans}
    return all(_hashable_on_device(by_name[name].field.type, by_name[name].dict_id) for name in keys)


def _bits(backend: DeviceBackend, buffer: Any, length: int, xp: ModuleType) -> Any:
    """A device bitmap's first ``length`` bits as 0/1 uint8 (an absent buffer holds no bits)."""
    if length == 0 or buffer is None:
        return xp.zeros(length, xp.uint8)
    return unpack_bits(backend.as_xp(buffer), 0, length, xp)


def _validity(backend: DeviceBackend, column: DeviceColumn | FieldLayout, body: Any, xp: ModuleType) -> Any:
    """The column's validity as 0/1 uint8 on the device, or None when it has no nulls."""
    layout = column.layout if isinstance(column, DeviceColumn) else column
    if layout.null_count == 0:
        return None
    off, size = layout.buffers[0]
    return _bits(backend, body[off : off + size] if size else None, layout.length, xp)


def _column_hash(backend: DeviceBackend, column: DeviceColumn, body: Any, xp: ModuleType) -> Any:
    """The value hash of one key column, computed on the device."""
    if not _hashable_on_device(column.type, column.dictionary_id):
        kind = "dictionary-encoded " if column.dictionary_id >= 0 else ""
        raise DeviceInterfaceError(
            f"key column {column.name!r} ({kind}{column.type}) cannot be hashed on the device: only integer, "
            f"floating-point, boolean and integer-backed temporal keys can; {_HOST_HINT}"
        )
    if column.layout.layout == Layout.BOOL:
        values = _bits(backend, column.buffers[1], column.length, xp)
    else:
        values = backend.as_xp(column.data)
    return with_nulls(value_hash(values, xp), _validity(backend, column, body, xp), xp)


def device_destinations(batch: DeviceBatch, key: str | Sequence[str], n: int) -> Any:
    """The destination task of every row of ``batch``: the row hash of its ``key`` column(s) modulo ``n``,
    computed on the device; an int64 array of the backend's array module (``cupy`` on a GPU).

    Equal to ``dissoc.spark``'s ``hash_partition`` of the same rows on the host. Raises
    :class:`~dissoc.errors.DissocError` for ``n <= 0`` or a key that names no single column, and
    :class:`~dissoc.device.DeviceInterfaceError` for a key column that hashes on the host only (strings,
    dictionary-encoded, ...; see :func:`can_partition_on_device`).
    """
    keys = _key_names(key, batch.schema.names, n, "device_destinations")
    backend = batch.backend
    xp = backend.array_module
    body = batch.messages[-1].body
    hashes = (_column_hash(backend, batch.column(name), body, xp) for name in keys)
    return bucket_of(row_hash(hashes, batch.num_rows, xp), n, xp)


# ----------------------------------------------------------------------------------------------------------
# Gathering


@dataclass(slots=True)
class _Gather:
    """One column being gathered: its layout, its validity and (boolean) values in destination order."""

    layout: FieldLayout
    valid: Any = None  # 0/1 uint8 in destination order, or None (no nulls)
    bits: Any = None  # BOOL: values as 0/1 uint8 in destination order
    values: Any = None  # FIXED: the values, one element (or row of ``width`` bytes) per row, input order
    pieces: list[Any] | None = None  # FIXED, instead of values: consecutive pieces of them, taken whole


def _padded(n: int) -> int:
    return -(-n // BODY_PADDING) * BODY_PADDING


def _fixed_values(backend: DeviceBackend, layout: FieldLayout, body: Any, rows: int) -> Any:
    """A FIXED column's values as a device array with one element (or one row of bytes) per row."""
    off, _ = layout.buffers[1]
    width = layout.width
    raw = backend.as_xp(body[off : off + rows * width])
    if width in (1, 2, 4, 8) and off % width == 0:
        return raw.view(f"<u{width}")
    return raw.reshape(rows, width)


def _check_gatherable(batch: DeviceBatch) -> None:
    refused = [
        f"{f.field.name!r} ({'dictionary-encoded ' if f.dictionary_id >= 0 else ''}{f.type})"
        for f in batch.layout.fields
        if not _gathered_on_device(f.layout, f.dictionary_id, bool(f.children), f.width)
    ]
    if refused:
        raise DeviceInterfaceError(
            f"cannot gather column(s) {', '.join(refused)} on the device: only flat fixed-width columns "
            f"(numbers, booleans, temporal, decimals, fixed-size binary) can be; {_HOST_HINT}"
        )


def _as_destinations(backend: DeviceBackend, destinations: Any, rows: int, xp: ModuleType) -> Any:
    """The caller's destinations as an int64 array of ``xp`` (host arrays are uploaded: one index a row)."""
    if backend.is_device_array(destinations):
        dest = backend.as_xp(destinations)
    elif isinstance(destinations, xp.ndarray):
        dest = destinations
    else:
        dest = xp.asarray(np.asarray(destinations))
    if dest.shape != (rows,):
        raise DissocError(f"partition_device_batch: {dest.shape} destinations for {rows} rows")
    if rows and dest.dtype.kind not in "iu":
        raise DissocError(f"partition_device_batch: destinations must be integers, got {dest.dtype}")
    return dest.astype(xp.int64, copy=False)


def _to_host(backend: DeviceBackend, counts: Any, xp: ModuleType) -> Any:
    """A small int64 device array copied to the host in one transfer."""
    flat = xp.ascontiguousarray(counts, dtype=xp.int64)
    raw = backend.download(backend.from_xp(flat.reshape(-1).view(xp.uint8)))
    return raw.view(np.int64).reshape(flat.shape)


def partition_device_batch(
    batch: DeviceBatch,
    key: str | Sequence[str] | None,
    n: int,
    *,
    destinations: Any = None,
) -> list[DeviceBatch]:
    """Split ``batch`` into ``n`` device batches, one per destination task, on the device.

    The destinations are :func:`device_destinations` of ``key``, or the caller's ``destinations`` (with
    ``key=None``: one integer in ``[0, n)`` per row, as an array of the backend's array module, a device
    array, or a host array, which is uploaded). Returns exactly ``n`` batches, the ``j``-th holding the rows
    for task ``j`` in their original order; a destination no row goes to gets a zero-row batch. Each batch
    has ``batch``'s schema and one RecordBatch message whose body is a new device array; the input is not
    changed. Raises :class:`~dissoc.device.DeviceInterfaceError` when a column cannot be gathered on the
    device or a key column cannot be hashed there (see :func:`can_partition_on_device`), and
    :class:`~dissoc.errors.DissocError` for bad arguments (``n <= 0``, no such key column, both or neither
    of ``key`` and ``destinations``, destinations of the wrong shape or outside ``[0, n)``).
    """
    what = "partition_device_batch"
    if n <= 0:
        raise DissocError(f"{what}: the number of tasks must be positive, got {n}")
    if (key is None) == (destinations is None):
        raise DissocError(f"{what}: give key or destinations, one of them")
    backend = batch.backend
    xp = backend.array_module
    rows = batch.num_rows
    if key is not None:
        _key_names(key, batch.schema.names, n, what)  # a wrong key is named before any column refused
    _check_gatherable(batch)
    if key is not None:
        dest = device_destinations(batch, key, n)
    else:
        dest = _as_destinations(backend, destinations, rows, xp)
    body = batch.messages[-1].body

    columns = [_Gather(fl) for fl in batch.layout.fields]
    nullable: list[int] = []
    order = xp.zeros(0, xp.int64)
    host = np.zeros((1, n + 2), np.int64)
    if rows:
        # Destinations outside [0, n) count in bin n; the valid rows of a nullable column in bin n + 1.
        binned = xp.where((dest < 0) | (dest >= n), n, dest)
        tallies = [xp.bincount(binned, minlength=n + 2)]
        order = destination_order(binned, n + 2, xp)
        for k, g in enumerate(columns):
            fl = g.layout
            if fl.layout == Layout.NULL:
                continue
            valid = _validity(backend, fl, body, xp)
            if valid is not None:
                tallies.append(xp.bincount(xp.where(valid.astype(xp.bool_), n + 1, binned), minlength=n + 2))
                nullable.append(k)
                g.valid = valid[order]
            if fl.layout == Layout.BOOL:
                off, size = fl.buffers[1]
                g.bits = _bits(backend, body[off : off + size], rows, xp)[order]
            else:
                g.values = _fixed_values(backend, fl, body, rows)
        host = _to_host(backend, xp.stack(tallies), xp)
    if host[0, n]:
        raise DissocError(f"{what}: {int(host[0, n])} destinations lie outside [0, {n})")
    counts = host[0, :n].tolist()
    nulls = {k: host[1 + i, :n].tolist() for i, k in enumerate(nullable)}

    out: list[DeviceBatch] = []
    start = 0
    for j, count in enumerate(counts):
        rows_j = order[start : start + count]
        out.append(
            _bucket(batch, backend, xp, columns, {k: v[j] for k, v in nulls.items()}, rows_j, start, count)
        )
        start += count
    log.debug("partitioned %d device rows into %d batches: %s", rows, n, counts)
    return out


def _bucket(
    batch: DeviceBatch,
    backend: DeviceBackend,
    xp: ModuleType,
    columns: list[_Gather],
    nulls: dict[int, int],
    rows: Any,
    start: int,
    count: int,
) -> DeviceBatch:
    """One destination's batch of ``count`` rows gathered into a new device body: ``rows`` (input row
    indices, in order) of each column's values, or its ``pieces`` whole (``rows`` None).

    ``start`` is where these rows begin in destination order (for the already sorted bits)."""
    nodes: list[tuple[int, int]] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for k, g in enumerate(columns):
        if g.layout.layout == Layout.NULL:
            nodes.append((count, count))
            continue
        null_count = nulls.get(k, 0)
        nodes.append((count, null_count))
        size = (count + 7) // 8 if null_count else 0
        spans.append((pos, size))
        pos += _padded(size)
        size = (count + 7) // 8 if g.layout.layout == Layout.BOOL else count * g.layout.width
        spans.append((pos, size))
        pos += _padded(size)
    out = backend.empty(pos)
    target = backend.as_xp(out)
    spans_of = iter(spans)
    for g in columns:
        if g.layout.layout == Layout.NULL:
            continue
        (voff, vsize), (doff, dsize) = next(spans_of), next(spans_of)
        if vsize:
            target[voff : voff + vsize] = xp.packbits(g.valid[start : start + count], bitorder="little")
        if not dsize:
            continue
        if g.layout.layout == Layout.BOOL:
            target[doff : doff + dsize] = xp.packbits(g.bits[start : start + count], bitorder="little")
            continue
        like = g.values if g.pieces is None else g.pieces[0]
        dst = target[doff : doff + dsize]
        dst = dst.view(like.dtype) if like.ndim == 1 else dst.reshape(count, g.layout.width)
        if g.pieces is None:
            xp.take(g.values, rows, axis=0, out=dst)
        else:
            xp.concatenate(g.pieces, axis=0, out=dst)
    for off, size in spans:  # the padding after each buffer: zeros, as the encoder writes
        if _padded(size) > size:
            target[off + size : off + _padded(size)] = 0
    metadata = encode_record_batch(
        count, np.asarray(nodes, np.int64).reshape(-1, 2), np.asarray(spans, np.int64).reshape(-1, 2), pos
    )
    return DeviceBatch(
        batch.schema_metadata,
        [DeviceMessage(metadata, out)],
        backend=backend,
        schema_info=batch.schema_info,
    )


def concat_device_batches(batches: Sequence[DeviceBatch]) -> DeviceBatch:
    """One device batch holding ``batches``' rows in order, gathered on the device into one new body.

    The batches share one schema whose columns can all be gathered on the device (see
    :func:`can_partition_on_device`); a single batch is returned as it is. Raises
    :class:`~dissoc.device.DeviceInterfaceError` for a column that cannot be gathered, and
    :class:`~dissoc.errors.DissocError` for no batches or batches of different schemas.
    """
    what = "concat_device_batches"
    if not batches:
        raise DissocError(f"{what}: expected at least one batch")
    first = batches[0]
    if len(batches) == 1:
        return first
    for b in batches:
        if not b.schema.equals(first.schema, check_metadata=False):
            raise DissocError(f"{what}: batches of different schemas: {first.schema} and {b.schema}")
        _check_gatherable(b)
    backend = first.backend
    xp = backend.array_module
    total = sum(int(b.num_rows) for b in batches)
    columns = [_Gather(fl) for fl in first.layout.fields]
    nulls: dict[int, int] = {}
    for k, g in enumerate(columns):
        if g.layout.layout == Layout.NULL:
            continue
        valids, parts = [], []
        null_count = 0
        for b in batches:
            fl, body, rows = b.layout.fields[k], b.messages[-1].body, int(b.num_rows)
            null_count += fl.null_count
            valid = _validity(backend, fl, body, xp)
            valids.append(valid if valid is not None else xp.ones(rows, xp.uint8))
            if fl.layout == Layout.BOOL:
                off, size = fl.buffers[1]
                parts.append(_bits(backend, body[off : off + size], rows, xp))
            else:
                parts.append(_fixed_values(backend, fl, body, rows))
        if null_count:
            g.valid = xp.concatenate(valids)
            nulls[k] = null_count
        if g.layout.layout == Layout.BOOL:
            g.bits = xp.concatenate(parts)
        else:
            g.pieces = parts  # copied once, straight into the new body
    return _bucket(first, backend, xp, columns, nulls, None, 0, total)
