"""The Arrow C device stream (dissoc.device.cstream) on the fake device: exported from batches and read back,
every batch equal; errors reach the consumer with the producer's message; the producer learns whether the
consumer read from it when the stream is released, by the consumer or by a capsule nobody took; the
release is native code that lets the Python side go at once."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from dissoc.device import DeviceBatch, DeviceInterfaceError, cstream
from dissoc.memory.cuda import FakeDeviceBackend, use_backend

FAKE = FakeDeviceBackend()


@pytest.fixture(autouse=True, scope="module")
def _fake_backend() -> Iterator[None]:
    with use_backend(FAKE):
        yield


def _batches(n: int) -> list[pa.RecordBatch]:
    return [
        pa.record_batch({"i": pa.array(range(k * 10, k * 10 + 10)), "s": [f"v{j}" for j in range(10)]})
        for k in range(n)
    ]


class Producer:
    """A stream of device batches through export_device_stream, recording how it ended."""

    def __init__(self, batches: list[pa.RecordBatch], fail_at: int | None = None) -> None:
        self.batches = [DeviceBatch.from_arrow(b) for b in batches]
        self.schema = batches[0].schema
        self.fail_at = fail_at
        self.pulled = 0
        self.finished: list[bool] = []

    def pull(self) -> DeviceBatch | None:
        if self.pulled == self.fail_at:
            raise RuntimeError("the source broke")
        if self.pulled == len(self.batches):
            return None
        self.pulled += 1
        return self.batches[self.pulled - 1]

    def __arrow_c_device_stream__(self, requested_schema: Any = None, **kwargs: Any) -> object:
        return cstream.export_device_stream(
            self.schema, 1, self.pull, lambda b: b.__arrow_c_device_array__(), self.finished.append
        )


def test_a_device_stream_round_trips() -> None:
    source = _batches(4)
    producer = Producer(source)
    got = [b.to_arrow() for b in DeviceBatch.from_arrow_device_stream(producer)]
    assert pa.Table.from_batches(got).equals(pa.Table.from_batches(source))
    assert producer.finished == [True]  # at once: reference counting, no collection needed


def test_stopping_early_releases_the_stream() -> None:
    producer = Producer(_batches(4))
    stream = DeviceBatch.from_arrow_device_stream(producer)
    assert next(stream).num_rows == 10
    assert producer.finished == []
    stream.close()  # type: ignore[attr-defined]
    assert producer.finished == [True] and producer.pulled == 1


def test_an_error_reaches_the_consumer_with_its_message() -> None:
    producer = Producer(_batches(3), fail_at=1)
    with pytest.raises(DeviceInterfaceError, match=r"get_next failed \(5\): RuntimeError: the source broke"):
        list(DeviceBatch.from_arrow_device_stream(producer))
    assert producer.finished == [True]


def test_a_capsule_nobody_took_releases_without_reading() -> None:
    producer = Producer(_batches(2))
    capsule = producer.__arrow_c_device_stream__()
    del capsule
    gc.collect()
    assert producer.finished == [False] and producer.pulled == 0


def test_the_native_release_lets_the_python_side_go() -> None:
    """Released through the struct's own release pointer (as a C consumer does), the exported state is gone
    at once: no cycle, no Python callback."""
    producer = Producer(_batches(1))
    capsule = producer.__arrow_c_device_stream__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    address = get(capsule, b"arrow_device_array_stream")
    holder = ctypes.c_uint64.from_address(address + 40).value
    release = ctypes.c_uint64.from_address(address + 32).value
    assert release and holder
    if cstream._FORWARD_RELEASE:
        assert release == cstream._FORWARD_RELEASE
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(release)(address)
    assert ctypes.c_uint64.from_address(address + 32).value == 0  # marked released
    assert ctypes.c_uint64.from_address(holder + 64).value == 0  # the holder too
    assert producer.finished == [False]  # at once, without a collection
    del capsule


def test_refusals() -> None:
    with pytest.raises(DeviceInterfaceError, match="exports no Arrow device stream"):
        list(DeviceBatch.from_arrow_device_stream(object()))
