"""Record batches whose bodies live in GPU memory (:class:`DeviceBatch`), and the client's device landing.

- :mod:`dissoc.device.batch`: :class:`DeviceBatch` / :class:`DeviceColumn` (a batch as its IPC messages with
  device bodies; typed column views with ``__cuda_array_interface__`` and DLPack) and the streaming
  :class:`DeviceDecoder` / :class:`DeviceEncoder`;
- :mod:`dissoc.device.landing`: how a client lands received bodies (packed or pairs) in device memory.

Device memory itself (CuPy, or the fake backend for tests) is behind :mod:`dissoc.memory.cuda`.
"""

from __future__ import annotations

from dissoc.device.batch import (
    DeviceBatch,
    DeviceColumn,
    DeviceDecoder,
    DeviceEncoder,
    DeviceInterfaceError,
    DeviceMessage,
    typed_dtype,
)

__all__ = [
    "DeviceBatch",
    "DeviceColumn",
    "DeviceDecoder",
    "DeviceEncoder",
    "DeviceInterfaceError",
    "DeviceMessage",
    "typed_dtype",
]
