"""Host shared memory: a POSIX shared-memory arena (server side) and a read-only view of one (client side).

Server side, :class:`ShmArena` creates a segment named ``dissoc-<pid>-<random>`` with mode 0600, maps it
read-write, and hands out 64-byte aligned ranges from it with the first-fit free-list allocator that coalesces
neighbours on release (:class:`~dissoc.memory.arena.FreeListArena`, shared with the device arena).
:meth:`ShmArena.place` copies a batch's buffers in (one allocation per non-empty buffer, so every pair-list
entry is its own allocation, keyed by its offset: a free_data message names exactly the offsets to
:meth:`ShmArena.release`). When the arena is full, :meth:`ShmArena.allocate_wait` and
:meth:`ShmArena.place_wait` wait for releases instead of failing or growing: that is the server's
backpressure. The URI's ``remote_handle`` is :attr:`ShmArena.handle`, the segment's POSIX name.

Client side, :class:`ShmView` maps the named segment read-only (``PROT_READ``) and slices it into zero-copy
``pyarrow.Buffer`` objects, bounds-checked, so a hostile pair list raises instead of crashing.

Crash recovery: segments carry the creating pid in their name; :func:`cleanup_stale` (called at server start)
unlinks the ones whose creator is gone. Python's ``multiprocessing.resource_tracker`` is not involved: the
segments are opened with ``shm_open`` directly, so nothing is registered, nothing warns and nothing is
unlinked twice.

Not thread-safe in general, except that :meth:`ShmArena.release` may be called from any thread (the allocator
state is behind a lock and waiters are woken in their own event loop).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import mmap
import os
import re
import secrets
import stat
import sys
import weakref
from collections.abc import Iterable, Sequence
from types import ModuleType, TracebackType
from typing import Any, Final, Self

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from dissoc.buffers import ALIGNMENT, align_up, byte_view
from dissoc.errors import ProtocolError, ResourceError
from dissoc.memory.arena import FreeListArena

__all__ = [
    "ALIGNMENT",
    "NAME_PREFIX",
    "SHM_DIR",
    "ShmArena",
    "ShmView",
    "cleanup_stale",
]

NAME_PREFIX: Final = "dissoc-"
SHM_DIR: Final = "/dev/shm"
"""Where Linux shows POSIX shared memory objects."""

_NAME_MAX: Final = 255
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._-]+")
_MODE: Final = 0o600


# -- POSIX shared memory primitives -------------------------------------------------------------------------


def _posixshmem() -> ModuleType:
    try:
        return importlib.import_module("_posixshmem")
    except ImportError:  # pragma: no cover - non-POSIX CPython builds
        raise ResourceError(
            f"POSIX shared memory is not available on this platform ({sys.platform})"
        ) from None


def _check_name(name: str) -> str:
    """A bare POSIX shm name (no leading '/'): portable characters only, so it can never name a path."""
    if (
        not isinstance(name, str)
        or not 0 < len(name) <= _NAME_MAX
        or name in (".", "..")
        or _NAME_RE.fullmatch(name) is None
    ):
        raise ValueError(
            f"shared memory name: expected 1-{_NAME_MAX} characters of [A-Za-z0-9._-], got {name!r}"
        )
    return name


def _name_from_handle(handle: bytes | bytearray | memoryview | str) -> str:
    """The bare name a ``remote_handle`` carries (a leading '/' is accepted), or ProtocolError."""
    try:
        text = handle if isinstance(handle, str) else bytes(handle).decode("ascii")
    except (UnicodeDecodeError, TypeError):
        raise ProtocolError(
            f"remote_handle: expected an ASCII POSIX shared memory name, got {handle!r}"
        ) from None
    if text.startswith("/"):
        text = text[1:]
    try:
        return _check_name(text)
    except ValueError:
        raise ProtocolError(
            f"remote_handle: expected a POSIX shared memory name ('/'? then 1-{_NAME_MAX} characters of "
            f"[A-Za-z0-9._-]), got {handle!r}"
        ) from None


def _shm_open(name: str, flags: int, mode: int = _MODE) -> int:
    fd: int = _posixshmem().shm_open("/" + name, flags, mode=mode)
    return fd


def _shm_unlink(name: str) -> bool:
    """Unlink a segment; False if it was already gone."""
    try:
        _posixshmem().shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def _unlink_if_creator(name: str, creator_pid: int) -> None:
    """Finalizer: unlink a segment this process created and never closed (not from a forked child)."""
    if os.getpid() == creator_pid:
        with contextlib.suppress(OSError):
            _shm_unlink(name)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we can judge: leave the segment alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError as e:  # pragma: no cover - e.g. EINVAL on odd platforms
        return e.errno != errno.ESRCH
    return True


def cleanup_stale(prefix: str = NAME_PREFIX, *, directory: str = SHM_DIR) -> list[str]:
    """Unlink segments named ``<prefix><pid>-...`` whose creating process is no longer alive.

    Only segments owned by the current user are considered. Returns the names removed. Where ``directory``
    does not exist (not Linux), there is nothing to list and this returns ``[]``. A segment whose pid has been
    reused by an unrelated live process is kept (the conservative mistake).
    """
    try:
        entries = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    pattern = re.compile(re.escape(prefix) + r"(\d{1,10})-.+")
    uid = os.getuid()
    removed: list[str] = []
    for entry in sorted(entries):
        match = pattern.fullmatch(entry)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        path = os.path.join(directory, entry)
        try:
            st = os.lstat(path)
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue  # someone else cleaned it first
        except PermissionError:
            continue
        removed.append(entry)
    return removed


# -- the arena ----------------------------------------------------------------------------------------------


class ShmArena(FreeListArena):
    """A POSIX shared-memory segment this process created, with an allocator over it.

    Create with :meth:`create`; close with :meth:`close` (or use it as a context manager), which unmaps and
    unlinks the segment. Offsets are relative to the start of the segment, multiples of :data:`ALIGNMENT`;
    sizes are rounded up to :data:`ALIGNMENT`, so :attr:`used_bytes` counts the rounded sizes. The allocator,
    batch placement and waiting for room are :class:`~dissoc.memory.arena.FreeListArena`'s.
    """

    def __init__(self, name: str, mm: mmap.mmap, capacity: int) -> None:
        """Use :meth:`create`."""
        super().__init__(capacity)
        self._name = name
        self._mmap: mmap.mmap | None = mm
        self._view: memoryview | None = memoryview(mm)
        self._finalizer = weakref.finalize(self, _unlink_if_creator, name, os.getpid())

    @classmethod
    def create(cls, capacity: int, *, name: str | None = None) -> ShmArena:
        """Create and map a new segment of at least ``capacity`` bytes (rounded up to 64), mode 0600.

        ``name`` defaults to ``dissoc-<pid>-<random hex>``; a given name must not exist yet. Raises
        :class:`ValueError` for a bad capacity or name, :class:`FileExistsError` if the name is taken, and
        :class:`~dissoc.errors.ResourceError` if the system cannot provide the memory.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        capacity = align_up(capacity, ALIGNMENT)
        name = _check_name(name) if name is not None else f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, _MODE)
        try:
            with contextlib.suppress(OSError):  # shm_open's mode is filtered by the umask: make it exact
                os.fchmod(fd, _MODE)
            try:
                os.ftruncate(fd, capacity)
                mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                raise ResourceError(
                    f"shared memory: expected to map {capacity} bytes for {name!r}, "
                    f"got {type(e).__name__}: {e}"
                ) from e
        except BaseException:
            with contextlib.suppress(OSError):
                _shm_unlink(name)
            raise
        finally:
            os.close(fd)
        return cls(name, mm, capacity)

    # -- properties ---------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The segment's POSIX name without the leading '/' (as under /dev/shm on Linux)."""
        return self._name

    @property
    def handle(self) -> bytes:
        """What goes into the URI's ``remote_handle``: the POSIX name as ASCII bytes (no leading '/')."""
        return self._name.encode("ascii")

    @property
    def buffer(self) -> memoryview:
        """A writable byte view of the whole segment (a new view each time)."""
        self._live_view()
        assert self._mmap is not None
        return memoryview(self._mmap)

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """A writable numpy uint8 view of the whole segment."""
        return np.frombuffer(self.buffer, dtype=np.uint8)

    # -- what the allocator needs -------------------------------------------------------------------------

    @property
    def _label(self) -> str:
        return f"shared memory arena {self._name!r}"

    def _live_view(self) -> memoryview:
        if self._view is None:
            raise ResourceError(f"{self._label}: expected an open arena, got a closed one")
        return self._view

    def _check_open(self) -> None:
        self._live_view()

    def _measure(self, buffers: Sequence[Any]) -> tuple[list[Any], list[int]]:
        views = [byte_view(b) for b in buffers]
        return views, [mv.nbytes for mv in views]

    def _fill(self, sources: list[Any], sizes: list[int], offsets: list[int]) -> None:
        dest = self._live_view()
        it = iter(offsets)
        for mv, n in zip(sources, sizes, strict=True):
            if n:
                offset = next(it)
                dest[offset : offset + n] = mv

    # -- lifetime -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Unlink the segment and unmap it; idempotent. Tasks waiting for space get ResourceError.

        If views of :attr:`buffer` are still alive, the mapping itself goes away when the last one does.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        with contextlib.suppress(OSError):
            _shm_unlink(self._name)
        view, self._view = self._view, None
        if view is not None:
            view.release()  # only this class holds it, so it has no exports
        mm, self._mmap = self._mmap, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # exported views keep it mapped until they die
                mm.close()
        self._wake()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"used={self._used}"
        return f"ShmArena(name={self._name!r}, capacity={self._capacity}, {state})"

    # Convenience: the crash-recovery sweep, next to the class that creates the segments.
    cleanup_stale = staticmethod(cleanup_stale)


class ShmView:
    """A client's mapping of a server's segment, read-only by default.

    :meth:`slice` returns zero-copy ``pyarrow.Buffer`` objects over the mapping; they keep it mapped even
    after :meth:`close`, so data already handed out stays valid.
    """

    def __init__(self, name: str, mm: mmap.mmap, readonly: bool) -> None:
        """Use :meth:`attach`."""
        self._name = name
        self._mmap: mmap.mmap | None = mm
        self._size = len(mm)
        self._readonly = readonly
        self._buf: Any = pa.py_buffer(mm)

    @classmethod
    def attach(cls, handle: bytes | bytearray | memoryview | str, *, readonly: bool = True) -> ShmView:
        """Map the segment named by ``handle`` (a URI's ``remote_handle``: the POSIX name, '/' optional).

        Read-only maps with ``PROT_READ`` on a descriptor opened ``O_RDONLY``. Raises
        :class:`~dissoc.errors.ProtocolError` for a handle that is not a plain POSIX name, and
        :class:`~dissoc.errors.ResourceError` if the segment does not exist, cannot be opened, or is empty.
        """
        name = _name_from_handle(handle)
        flags = os.O_RDONLY if readonly else os.O_RDWR
        try:
            fd = _shm_open(name, flags, 0)
        except OSError as e:
            raise ResourceError(
                f"shared memory: expected to open segment {name!r}, got {type(e).__name__}: {e.strerror or e}"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise ResourceError(f"shared memory: expected a non-empty segment {name!r}, got {size} bytes")
            access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
            try:
                mm = mmap.mmap(fd, size, access=access)
            except OSError as e:
                raise ResourceError(
                    f"shared memory: expected to map {size} bytes of {name!r}, got {type(e).__name__}: {e}"
                ) from None
        finally:
            os.close(fd)
        return cls(name, mm, readonly)

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        """Size of the mapping in bytes (the segment's size when attached)."""
        return self._size

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def _whole(self) -> Any:
        if self._buf is None:
            raise ResourceError(f"shared memory view {self._name!r}: expected an open view, got a closed one")
        return self._buf

    def slice(self, offset: int, length: int) -> pa.Buffer:
        """A zero-copy buffer over ``[offset, offset + length)``.

        Raises :class:`~dissoc.errors.ProtocolError` if the range is not inside the segment (a bad pair from
        the server), :class:`~dissoc.errors.ResourceError` if the view is closed.
        """
        whole = self._whole()
        if (
            isinstance(offset, bool)
            or isinstance(length, bool)
            or not isinstance(offset, int | np.integer)
            or not isinstance(length, int | np.integer)
        ):
            raise ProtocolError(
                f"shared memory: expected integer (offset, length), got ({offset!r}, {length!r})"
            )
        offset, length = int(offset), int(length)
        if offset < 0 or length < 0 or offset + length > self._size:
            raise ProtocolError(
                f"shared memory: expected a range inside segment {self._name!r} of {self._size} bytes, "
                f"got offset {offset} length {length}"
            )
        if self._readonly:
            return whole.slice(offset, length)
        # pyarrow's Buffer.slice drops mutability; a memoryview slice keeps the mapping writable
        assert self._mmap is not None
        return pa.py_buffer(memoryview(self._mmap)[offset : offset + length])

    def buffers(self, pairs: Iterable[tuple[int, int]] | Any) -> list[pa.Buffer]:
        """Zero-copy buffers for a pair list (a sequence of pairs, an ``(n, 2)`` array, or a PairList).

        ``(offset, 0)`` entries -- the ``(0, 0)`` of empty buffers -- give empty buffers.
        """
        rows = pairs.to_list() if hasattr(pairs, "to_list") else pairs
        if isinstance(rows, np.ndarray):
            rows = rows.tolist()
        whole = self._whole()
        out: list[pa.Buffer] = []
        for offset, length in rows:
            out.append(whole.slice(0, 0) if length == 0 else self.slice(offset, length))
        return out

    def numpy(self) -> npt.NDArray[np.uint8]:
        """The whole mapping as a numpy uint8 array (not writeable when read-only)."""
        arr: npt.NDArray[np.uint8] = np.frombuffer(self._whole(), dtype=np.uint8)
        return arr

    def close(self) -> None:
        """Drop this view's mapping; idempotent. Buffers already sliced keep it mapped until they die."""
        self._buf = None
        mm, self._mmap = self._mmap, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # exported slices keep it alive; unmapped when they go
                mm.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "ro" if self._readonly else "rw"
        state = "closed" if self.closed else "open"
        return f"ShmView(name={self._name!r}, size={self._size}, {mode}, {state})"
