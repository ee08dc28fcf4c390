"""Record batches whose bodies live in GPU memory (:class:`DeviceBatch`), and the client's device landing.

- :mod:`dissoc.device.batch`: :class:`DeviceBatch` / :class:`DeviceColumn` (a batch as its IPC messages with
  device bodies; typed column views with ``__cuda_array_interface__`` and DLPack) and the streaming
  :class:`DeviceDecoder` / :class:`DeviceEncoder`;
- :mod:`dissoc.device.landing`: how a client lands received bodies (packed or pairs) in device memory;
- :mod:`dissoc.device.partition`: hash partitioning on the device (:func:`partition_device_batch`: one device
  batch per destination task, for the Spark barrier exchange).

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
from dissoc.device.partition import (
    can_partition_on_device,
    concat_device_batches,
    device_destinations,
    partition_device_batch,
)

__all__ = [
    "DeviceBatch",
    "DeviceColumn",
    "DeviceDecoder",
    "DeviceEncoder",
    "DeviceInterfaceError",
    "DeviceMessage",
    "can_partition_on_device",
    "concat_device_batches",
    "device_destinations",
    "partition_device_batch",
    "typed_dtype",
]
