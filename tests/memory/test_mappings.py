"""Another process's device allocations, kept mapped between streams (dissoc.memory.mappings), on the fake
device backend: a real shared-memory segment stands for the allocation, and each mapping is a real mmap."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from dissoc.memory.cuda import DeviceAllocation, FakeDeviceBackend
from dissoc.memory.mappings import MappedRegions


class _Counting(FakeDeviceBackend):
    def __init__(self) -> None:
        super().__init__()
        self.opened = 0

    def open_ipc(self, handle: bytes, nbytes: int) -> DeviceAllocation:
        self.opened += 1
        return super().open_ipc(handle, nbytes)


@pytest.fixture
def backend() -> _Counting:
    return _Counting()


@pytest.fixture
def handles(backend: _Counting) -> Iterator[list[bytes]]:
    owned = [backend.allocate(4096) for _ in range(3)]
    yield [backend.ipc_handle(a) for a in owned]
    for a in owned:
        a.close()


def _wait(predicate: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_handle_is_mapped_once_while_used_and_kept_for_the_next_stream(
    backend: _Counting, handles: list[bytes]
) -> None:
    regions = MappedRegions(idle_s=60)
    first = regions.acquire(backend, handles[0], 4096)
    second = regions.acquire(backend, handles[0], 4096)
    assert first is second and backend.opened == 1
    regions.release(backend, handles[0], 4096)
    regions.release(backend, handles[0], 4096)
    assert len(regions) == 1  # idle, still mapped
    again = regions.acquire(backend, handles[0], 4096)
    assert again is first and backend.opened == 1 and regions.opened == 1
    regions.release(backend, handles[0], 4096)
    regions.clear()
    assert len(regions) == 0
    assert regions.acquire(backend, handles[0], 4096) is not first and backend.opened == 2
    regions.release(backend, handles[0], 4096, forget=True)
    assert len(regions) == 0


def test_idle_mappings_go_after_their_time_and_beyond_the_bound(
    backend: _Counting, handles: list[bytes]
) -> None:
    regions = MappedRegions(idle_s=0.2, max_idle=2)
    for h in handles:
        regions.acquire(backend, h, 4096)
    used = regions.acquire(backend, handles[0], 4096)  # (twice: still in use after one release)
    for h in handles:
        regions.release(backend, h, 4096)
    # the oldest idle one beyond max_idle went at once; the one still in use is not idle
    assert len(regions) == 3
    regions.release(backend, handles[0], 4096)
    assert len(regions) == 2
    assert _wait(lambda: len(regions) == 0, 5), "idle mappings outlived their time"
    assert used is not None


def test_a_closed_allocation_is_not_handed_out_again(backend: _Counting, handles: list[bytes]) -> None:
    regions = MappedRegions(idle_s=60)
    allocation = regions.acquire(backend, handles[1], 1024)
    regions.release(backend, handles[1], 1024)
    regions.clear()
    fresh = regions.acquire(backend, handles[1], 1024)
    assert fresh is not allocation and fresh.nbytes == 1024
    regions.release(backend, handles[1], 1024, forget=True)
