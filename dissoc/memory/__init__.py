"""Where pair-list addresses point.

* :mod:`~dissoc.memory.shm` -- host POSIX shared memory: :class:`ShmArena` (the server's arena, with a
  first-fit allocator and backpressure) and :class:`ShmView` (a client's read-only mapping), plus
  :func:`cleanup_stale` for segments left behind by crashed servers.

* :mod:`~dissoc.memory.arena` -- :class:`FreeListArena`, the allocator, batch placement and backpressure that
  the host and device arenas share.
* :mod:`~dissoc.memory.cuda` / :mod:`~dissoc.memory.cuda_arena` -- device memory behind a backend (CuPy,
  or a fake for CPU tests) and :class:`DeviceArena`, the server's arena for ``memory=cuda``.

UCX-registered and CUDA arenas live in their own modules and import their optional dependencies lazily.
"""

from __future__ import annotations

from dissoc.memory.shm import ALIGNMENT, NAME_PREFIX, SHM_DIR, ShmArena, ShmView, cleanup_stale

__all__ = ["ALIGNMENT", "NAME_PREFIX", "SHM_DIR", "ShmArena", "ShmView", "cleanup_stale"]
