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

``dissoc.codec.bulk.flatten_walk`` is that module's numpy walk of an exported wide batch (some 40 numpy calls,
about 30 µs for 100 columns) as two loops (about 2 µs), giving the same numbers.

Each is compiled once per process, on a thread of its own, started by the first call that asks for it
(nothing is compiled, and numba is not imported, until a decoder or encoder needs it): about a second each,
during which batches take the numpy and pyarrow routes. ``DISSOC_JIT=0`` in the environment turns both off.
Nothing is written to disk (no numba cache).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["KERNELS", "SPAN_FIELDS", "BinaryCheck", "Kernel", "binary_check", "compile_now", "state"]

log = logging.getLogger(__name__)

#: Columns of the span table :func:`binary_check`'s function takes, one row per binary-like column: the
#: offsets buffer's start (bytes, from the body's start), the number of values, the data buffer's start and
#: length, the offsets' width (4 or 8), 1 where the values must be UTF-8, the validity bitmap's start and the
#: null count the metadata gives (the bitmap is read only where that is above 0, as readers do).
SPAN_FIELDS = ("offsets_at", "values", "data_at", "data_length", "width", "utf8", "validity_at", "nulls")

#: ``check(body_bytes, at, spans) -> bool``: True when every column of ``spans`` (see SPAN_FIELDS) passes, the
#: body's buffers lying in ``body_bytes`` from byte ``at`` on.
BinaryCheck = Callable[[npt.NDArray[np.uint8], int, npt.NDArray[np.int64]], bool]

#: Every :class:`Kernel` made (the check here, the walk of ``dissoc.codec.bulk``).
KERNELS: list[Kernel] = []


class Kernel:
    """One compiled function, made once per process on a thread of its own when first asked for (``get``:
    None until then); ``build(numba, numba.types)`` makes it. Every kernel is listed in :data:`KERNELS`."""

    def __init__(self, what: str, build: Callable[[Any, Any], Any]) -> None:
        self.what = what
        self.build = build
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.value: Any = None
        self.state = "idle"  # idle, compiling, ready, unavailable
        KERNELS.append(self)

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
            # By name: the jit extra is optional, so nothing imports numba where mypy may not find it.
            numba = importlib.import_module("numba")
            if getattr(numba.config, "DISABLE_JIT", False):
                raise ImportError("numba's JIT is disabled (NUMBA_DISABLE_JIT)")
            self.value = self.build(numba, numba.types)
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


_CHECK = Kernel("check of binary columns", _build_check)


def state() -> str:
    """The check's: ``idle`` (not asked for yet), ``compiling``, ``ready`` or ``unavailable`` (no numba, or
    turned off)."""
    return _CHECK.state


def binary_check() -> BinaryCheck | None:
    """The compiled check, or None while it is not ready (the first call starts compiling it)."""
    check: BinaryCheck | None = _CHECK.get()
    return check


def compile_now(timeout: float = 120.0) -> BinaryCheck | None:
    """Compile every kernel not compiled yet, waiting for them (tests and benchmarks); returns the check (None
    without numba)."""
    for kernel in KERNELS:
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
