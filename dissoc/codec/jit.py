"""Compiled kernels for the codec's per-message work, where numba is installed (the ``jit`` extra; RAPIDS
environments have it): a content check of narrow string batches, and the walk of a wide batch's C Data export.

A narrow batch with string columns is checked, on pyarrow's IPC reader path, by a second read under binary
types, pyarrow's full validation and an ASCII check of the data (see ``MessageDecoder._validate_ipc``): about
2.3 µs of pyarrow calls for a 1,024-row string column, more than pyarrow's own read of the batch. One
compiled pass over the same bytes costs about 0.3 µs. :func:`binary_check` gives that pass once numba has
compiled it, and ``None`` until then (or without numba): callers keep the pyarrow route for those batches.

The check is for top-level binary-like columns whose buffer sizes the metadata checks settled: per column,
as many nulls in the validity bitmap as the metadata says, offsets that start at 0 or above, never decrease
and end within the data buffer, and, for strings, values made of ASCII bytes only (which are valid UTF-8):
what pyarrow's full validation of the column checks, with UTF-8 narrowed to ASCII. A column that fails any
of this is not judged here: the caller takes the pyarrow route, which accepts valid non-ASCII UTF-8 and words
the error for what it refuses.

:func:`flatten_walk` is ``dissoc.codec.bulk``'s numpy walk of an exported wide batch (some 40 numpy calls,
about 30 µs for 100 columns) as two loops (about 2 µs), giving the same numbers.

Each is compiled once per process, on a thread of its own, started by the first call that asks for it
(nothing is compiled, and numba is not imported, until a decoder or encoder needs it): about a second each,
during which batches take the numpy and pyarrow routes. ``DISSOC_JIT=0`` in the environment turns both off.
Nothing is written to disk (no numba cache).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "SPAN_FIELDS",
    "BinaryCheck",
    "FlattenWalk",
    "binary_check",
    "compile_now",
    "flatten_walk",
    "state",
]

log = logging.getLogger(__name__)

#: Columns of the span table :func:`binary_check`'s function takes, one row per binary-like column: the
#: offsets buffer's start (bytes, from the body's start), the number of values, the data buffer's start and
#: length, the offsets' width (4 or 8), 1 where the values must be UTF-8, the validity bitmap's start and the
#: null count the metadata gives (the bitmap is read only where that is above 0, as readers do).
SPAN_FIELDS = ("offsets_at", "values", "data_at", "data_length", "width", "utf8", "validity_at", "nulls")

#: ``check(body_bytes, at, spans) -> bool``: True when every column of ``spans`` (see SPAN_FIELDS) passes, the
#: body's buffers lying in ``body_bytes`` from byte ``at`` on.
BinaryCheck = Callable[[npt.NDArray[np.uint8], int, npt.NDArray[np.int64]], bool]

#: ``walk(memory64, memory32, root, plan)``: what ``dissoc.codec.bulk._flatten`` returns for the batch
#: exported at ``root`` (nodes, spans, buffer pointers and sizes, body length), or None where it is not a
#: common case.
FlattenWalk = Callable[[Any, Any, int, Any], Any]


class _Kernel:
    """One compiled function, made once per process on a thread of its own when first asked for."""

    def __init__(self, what: str, build: Callable[[Any, Any], Any]) -> None:
        self.what = what
        self.build = build
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.value: Any = None
        self.state = "idle"  # idle, compiling, ready, unavailable

    def get(self) -> Any:
        value = self.value
        if value is None and self.state == "idle":
            self.start(wait=False)
        return value

    def start(self, *, wait: bool) -> None:
        with self.lock:
            if self.state != "idle":
                return
            if os.environ.get("DISSOC_JIT", "").strip() == "0":
                self.state = "unavailable"
                self.done.set()
                return
            self.state = "compiling"
        if wait:
            self.compile()
        else:
            threading.Thread(target=self.compile, name="dissoc-jit", daemon=True).start()

    def compile(self) -> None:
        try:
            import numba
            from numba import types

            if getattr(numba.config, "DISABLE_JIT", False):
                raise ImportError("numba's JIT is disabled (NUMBA_DISABLE_JIT)")
            self.value = self.build(numba, types)
            self.state = "ready"
            log.debug("compiled %s ready (numba %s)", self.what, numba.__version__)
        except Exception as exc:  # no numba (ImportError), or one that cannot compile here
            self.state = "unavailable"
            log.debug("no compiled %s: %s", self.what, exc)
        finally:
            self.done.set()


def _build_check(numba: Any, types: Any) -> BinaryCheck:
    global _popcount
    spans = types.Array(types.int64, 2, "C", readonly=True)
    signatures = [
        types.boolean(types.Array(types.uint8, 1, "C", readonly=readonly), types.int64, spans)
        for readonly in (True, False)
    ]
    # (the pass calls it as a global: compiled first, it is what the pass's compilation finds)
    _popcount = numba.njit(nogil=True, cache=False)(_popcount)
    return _checked_call(numba.njit(signatures, nogil=True, cache=False, boundscheck=False)(_spans_pass))


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


_CHECK = _Kernel("check of binary columns", _build_check)
_WALK = _Kernel("walk of wide batches", _build_walk)


def state() -> str:
    """The check's: ``idle`` (not asked for yet), ``compiling``, ``ready`` or ``unavailable`` (no numba, or
    turned off)."""
    return _CHECK.state


def binary_check() -> BinaryCheck | None:
    """The compiled check, or None while it is not ready (the first call starts compiling it)."""
    check: BinaryCheck | None = _CHECK.get()
    return check


def flatten_walk() -> FlattenWalk | None:
    """The compiled walk of a wide batch's C Data export (see ``dissoc.codec.bulk``), or None while it is not
    ready (the first call starts compiling it)."""
    walk: FlattenWalk | None = _WALK.get()
    return walk


def compile_now(timeout: float = 120.0) -> BinaryCheck | None:
    """Compile the check and the walk if they are not yet, waiting for them (tests and benchmarks); returns
    the check (None without numba)."""
    for kernel in (_CHECK, _WALK):
        kernel.start(wait=True)
        kernel.done.wait(timeout)
    return binary_check()


def _checked_call(compiled: Any) -> BinaryCheck:
    def check(body: npt.NDArray[np.uint8], at: int, spans: npt.NDArray[np.int64]) -> bool:
        try:
            return bool(compiled(body, at, spans))
        except TypeError:  # arguments of types not compiled for (not expected): the pyarrow route judges
            return False

    return check


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


#: The exported struct's fields, in int64 words: length, null count, offset, buffers, children.
_LENGTH, _NULLS, _OFFSET, _BUFFERS, _CHILDREN = 0, 1, 2, 5, 6
#: Addresses are read as word (or half-word) indices of memory views that start at this address.
_BASE = 4096


def _walk_pass(  # pragma: no cover (compiled by numba)
    memory64: Any, memory32: Any, root: int, nodes: Any, bufs: Any, scaled: Any, listed: Any
) -> Any:
    """``dissoc.codec.bulk._flatten`` as one loop over the nodes (parents come before their children), then
    one over the IPC buffers; status 1 where the batch is not a common case (sliced, unknown null counts,
    unaligned offsets, children not covering their parents)."""
    word = _BASE >> 3
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


def _popcount(x: Any) -> Any:  # pragma: no cover (compiled by numba)
    """Set bits of a uint64 (the SWAR count: numba has no intrinsic for it)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


def _spans_pass(body: Any, at: int, spans: Any) -> bool:  # pragma: no cover (compiled by numba)
    """The check itself, in the subset of Python numba compiles (see :data:`SPAN_FIELDS`). The loops
    accumulate without branching so that LLVM vectorises them."""
    size = body.shape[0]
    for r in range(spans.shape[0]):
        n = spans[r, 1]
        if n == 0:
            continue
        width = spans[r, 4]
        start = at + spans[r, 0]
        data = at + spans[r, 2]
        data_length = spans[r, 3]
        if start < 0 or start + width * (n + 1) > size or data < 0 or data + data_length > size:
            return False
        if width == 4:
            offsets32 = body[start : start + 4 * (n + 1)].view(np.int32)
            first = np.int64(offsets32[0])
            last = np.int64(offsets32[n])
            steps = np.int64(0)  # the sign bit ends up set where any step goes down
            for i in range(n):
                steps |= np.int64(offsets32[i + 1]) - np.int64(offsets32[i])
        else:
            offsets64 = body[start : start + 8 * (n + 1)].view(np.int64)
            first = offsets64[0]
            last = offsets64[n]
            steps = offsets64[0]
            for i in range(n):
                # the values' own sign bits too: with every value >= 0 no difference overflows
                steps |= (offsets64[i + 1] - offsets64[i]) | offsets64[i + 1]
        if steps < 0 or first < 0 or last > data_length:
            return False
        nulls = spans[r, 7]
        if nulls > 0:
            bits = at + spans[r, 6]
            if bits < 0 or bits + (n + 7) // 8 > size:
                return False
            words = n // 64
            ones = np.uint64(0)
            for word in body[bits : bits + 8 * words].view(np.uint64):
                ones += _popcount(word)
            for i in range(8 * words, n // 8):
                ones += _popcount(np.uint64(body[bits + i]))
            if n % 8:
                ones += _popcount(np.uint64(body[bits + n // 8]) & np.uint64((1 << (n % 8)) - 1))
            if np.int64(ones) != n - nulls:
                return False
        if spans[r, 5]:
            # eight bytes at a time (x86 and arm64 load them from any address), then the tail
            low = data + first
            words = (last - first) // 8
            high = np.uint64(0)
            for word in body[low : low + 8 * words].view(np.uint64):
                high |= word
            for i in range(low + 8 * words, data + last):
                high |= np.uint64(body[i])
            if high & np.uint64(0x8080808080808080):
                return False
    return True
