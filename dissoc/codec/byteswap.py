"""Byte swapping of big-endian bodies into native (little-endian) order, buffer by buffer.

Each buffer is swapped by its role (see :mod:`dissoc.codec.sizes`): offsets and sizes element by element,
fixed-width values by their plan's swap width (whole decimals reversed, month-day-nano intervals field by
field), views in their length and, for out-of-line views, buffer index and offset fields. Bitmaps, type ids
and data bytes need no swapping.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from dissoc.codec.schema import SWAP_MONTH_DAY_NANO, SWAP_REVERSE, FieldPlan
from dissoc.codec.sizes import FIXED, OFF4, OFF8, SIZES4, SIZES8, VIEWS
from dissoc.errors import CodecError

__all__ = ["swap"]


def swap(
    role: int, p: FieldPlan, data: memoryview | npt.NDArray[np.uint8]
) -> memoryview | npt.NDArray[np.uint8]:
    """``data``, a buffer of role ``role`` of a node of ``p``, in native byte order (``data`` itself when no
    swap is needed)."""
    n = len(data)
    if n == 0:
        return data
    if role in (OFF4, SIZES4):
        return _swapped(data, 4)
    if role in (OFF8, SIZES8):
        return _swapped(data, 8)
    if role == FIXED:
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
    if role == VIEWS:
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


def _swapped(data: memoryview | npt.NDArray[np.uint8], width: int) -> npt.NDArray[np.uint8]:
    n = len(data)
    if n % width:
        raise CodecError(f"big-endian buffer of {n} bytes is not a multiple of its {width}-byte elements")
    return np.frombuffer(data, f">u{width}").astype(f"<u{width}").view(np.uint8)
