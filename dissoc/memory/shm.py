"""Host shared memory: a POSIX shared-memory arena (server side) and a read-only view of one (client side).

Server side, :class:`ShmArena` creates a segment named ``dissoc-<pid>-<random>`` with mode 0600, reserves
its memory (``posix_fallocate``: a ``/dev/shm`` too small for the arena fails at creation, with
:class:`~dissoc.errors.ResourceError`, instead of killing the server with SIGBUS on the first page past its
end), maps it read-write, drops the mode to 0400 (the server keeps its mapping; later opens for writing by
non-root processes, the same user's included, are refused), and hands out 64-byte aligned ranges from it
with the first-fit free-list allocator that coalesces neighbours on release
(:class:`~dissoc.memory.arena.FreeListArena`, shared with the device arena).
:meth:`ShmArena.place` copies a batch's buffers in (one allocation per non-empty buffer, so every pair-list
entry is its own allocation, keyed by its offset: a free_data message names exactly the offsets to
:meth:`ShmArena.release`). When the arena is full, :meth:`ShmArena.allocate_wait` and
:meth:`ShmArena.place_wait` wait for releases instead of failing or growing: that is the server's
backpressure. The URI's ``remote_handle`` is :attr:`ShmArena.handle`, the segment's POSIX name.

Client side, :class:`ShmView` maps the named segment read-only (``PROT_READ``) and slices it into zero-copy
``pyarrow.Buffer`` objects, bounds-checked, so a hostile pair list raises instead of crashing. It keeps the
segment's descriptor and, before handing out a batch's ranges, compares them with the segment's current size
(one ``fstat``): a segment truncated under the client raises :class:`~dissoc.errors.TransportError` instead of
SIGBUS.

Crash recovery: segments carry the creating pid in their name; :func:`cleanup_stale` (called at server start)
unlinks the ones whose creator is gone, and :func:`remove_stale_segments` does the same and says what it
removed (names and bytes). Python's ``multiprocessing.resource_tracker`` is not involved: the
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
from typing import Any, Final, NamedTuple, Self

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from dissoc.buffers import ALIGNMENT, align_up, byte_view
from dissoc.errors import ProtocolError, ResourceError, TransportError
from dissoc.memory.arena import FreeListArena

__all__ = [
    "ALIGNMENT",
    "NAME_PREFIX",
    "SHM_DIR",
    "ShmArena",
    "ShmView",
    "StaleSegment",
    "cleanup_stale",
    "remove_stale_segments",
    "reserve",
]

NAME_PREFIX: Final = "dissoc-"
SHM_DIR: Final = "/dev/shm"
"""Where Linux shows POSIX shared memory objects."""

_NAME_MAX: Final = 255
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._-]+")
_MODE: Final = 0o600
_MODE_MAPPED: Final = 0o400
"""The mode once the creator has mapped the segment read-write: opening it for writing is refused from then on
(except to root, and to an owner who changes the mode back first)."""
_FAKE_DEVICE_PREFIX: Final = NAME_PREFIX + "fakedev-"
"""The fake device backend's segments (:mod:`dissoc.memory.cuda`), named ``dissoc-fakedev-<pid>-<random>``."""


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


class StaleSegment(NamedTuple):
    """A segment :func:`remove_stale_segments` removed."""

    name: str
    """Its name under ``/dev/shm``."""
    size: int
    """Its size in bytes."""
    allocated: int
    """The memory it held, in bytes (less than ``size`` where it was sparse)."""


def _remove_stale(prefixes: Sequence[str], directory: str) -> list[StaleSegment]:
    try:
        entries = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    patterns = [re.compile(re.escape(prefix) + r"(\d{1,10})-.+") for prefix in prefixes]
    uid = os.getuid()
    removed: list[StaleSegment] = []
    for entry in sorted(entries):
        match = next((m for p in patterns if (m := p.fullmatch(entry)) is not None), None)
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
        removed.append(StaleSegment(entry, st.st_size, st.st_blocks * 512))
    return removed


def cleanup_stale(prefix: str = NAME_PREFIX, *, directory: str = SHM_DIR) -> list[str]:
    """Unlink segments named ``<prefix><pid>-...`` whose creating process is no longer alive.

    Only segments owned by the current user are considered. Returns the names removed. Where ``directory``
    does not exist (not Linux), there is nothing to list and this returns ``[]``. A segment whose pid has been
    reused by an unrelated live process is kept (the conservative mistake).
    """
    return [segment.name for segment in _remove_stale([prefix], directory)]


def remove_stale_segments(*, directory: str = SHM_DIR) -> list[StaleSegment]:
    """Unlink the segments that dead dissoc processes left behind; returns what was removed, by name.

    That is the arenas of pairs servers (``dissoc-<pid>-...``) and the fake device backend's allocations
    (``dissoc-fakedev-<pid>-...``) whose creating process is gone, owned by the current user (a server
    killed with SIGKILL leaves its arena-sized segment until then). Segments of live processes are kept, and
    so is one whose pid has been reused by an unrelated live process (the conservative mistake). Where
    ``directory`` does not exist (not Linux), this returns ``[]``.
    """
    return _remove_stale([NAME_PREFIX, _FAKE_DEVICE_PREFIX], directory)


def _amount(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes} bytes"


def reserve(fd: int, nbytes: int, what: str) -> None:
    """Reserve the memory behind the first ``nbytes`` of shared-memory file ``fd`` now (``posix_fallocate``).

    Without it the file is sparse: where ``/dev/shm`` is smaller than the file (Docker's default is 64 MiB),
    the first touch of a page past what it can hold kills the process with SIGBUS, which Python cannot catch.
    Raises :class:`~dissoc.errors.ResourceError` with a one-line message naming the remedies (a smaller arena,
    more shared memory for the container); the caller removes the file. Where the platform has no
    ``posix_fallocate`` this does nothing.
    """
    if nbytes <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        try:
            vfs = os.fstatvfs(fd)
            room = f"{_amount(vfs.f_bavail * vfs.f_frsize)} free of {_amount(vfs.f_blocks * vfs.f_frsize)}"
        except OSError:
            room = "free space unknown"
        raise ResourceError(
            f"{what}: cannot reserve {_amount(nbytes)} of shared memory in {SHM_DIR} ({e.strerror or e}; "
            f"{room}): use a smaller arena (--arena-mib) or give the container more shared memory "
            f"(Docker: --shm-size)"
        ) from None


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
        """Create and map a new segment of at least ``capacity`` bytes (rounded up to 64).

        The segment is made with mode 0600, its memory reserved (:func:`reserve`), mapped read-write, and its
        mode then dropped to 0400, so that only this mapping can write to it. ``name`` defaults to
        ``dissoc-<pid>-<random hex>``; a given name must not exist yet. Raises :class:`ValueError` for a bad
        capacity or name, :class:`FileExistsError` if the name is taken, and
        :class:`~dissoc.errors.ResourceError` if the system cannot provide the memory (a ``/dev/shm`` too
        small for it included: the message names the remedies); the segment is removed then.
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
            except OSError as e:
                raise ResourceError(
                    f"shared memory: expected to size {name!r} to {capacity} bytes, "
                    f"got {type(e).__name__}: {e}"
                ) from e
            reserve(fd, capacity, "shared memory arena")
            try:
                mm = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                raise ResourceError(
                    f"shared memory: expected to map {capacity} bytes for {name!r}, "
                    f"got {type(e).__name__}: {e}"
                ) from e
            # Mapped read-write: from now on nobody needs to open it for writing. Clients open it read-only;
            # a non-root process (the same user's included) that tries to open it for writing is refused.
            os.fchmod(fd, _MODE_MAPPED)
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

    The view keeps the segment's descriptor open. :meth:`slice` and :meth:`buffers` compare the ranges asked
    for with the segment's *current* size first (one ``fstat`` per call): touching a page past the end of a
    segment that was truncated after it was mapped (by its server or by anyone who could open it) kills the
    process with SIGBUS, which Python cannot recover from, so a range that now lies past the end raises
    :class:`~dissoc.errors.TransportError` instead. Not covered: a truncation that lands between that check
    and the reads of the range (by the caller's copy, or later through a zero-copy buffer already handed
    out).
    """

    def __init__(self, name: str, mm: mmap.mmap, readonly: bool, fd: int | None = None) -> None:
        """Use :meth:`attach`. ``fd``: the segment's descriptor, owned by the view from now on (closed with
        it); without one, ranges are checked against the mapping's size only."""
        self._name = name
        self._mmap: mmap.mmap | None = mm
        self._size = len(mm)
        self._readonly = readonly
        self._buf: Any = pa.py_buffer(mm)
        self._fd = fd
        self._fd_closer = None if fd is None else weakref.finalize(self, os.close, fd)

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
        except BaseException:
            os.close(fd)
            raise
        return cls(name, mm, readonly, fd)

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

    def check_extent(self, end: int) -> None:
        """Raise :class:`~dissoc.errors.TransportError` if the segment is now shorter than ``end`` bytes.

        One ``fstat`` of the descriptor kept open. A truncation between this check and the reads that follow
        it is not covered (the reads would still meet SIGBUS); this catches a segment that shrank before.
        """
        fd = self._fd
        if fd is None or end <= 0:
            return
        try:
            now = os.fstat(fd).st_size
        except OSError as e:  # pragma: no cover - the descriptor is ours and open
            raise TransportError(f"shared memory: cannot stat segment {self._name!r}: {e}") from None
        if now < end:
            raise TransportError(
                f"shared memory: segment {self._name!r} shrank to {now} bytes (mapped {self._size}) under "
                f"this client, expected at least {end}: truncated by its server or another process"
            )

    def slice(self, offset: int, length: int) -> pa.Buffer:
        """A zero-copy buffer over ``[offset, offset + length)``.

        Raises :class:`~dissoc.errors.ProtocolError` if the range is not inside the mapping (a bad pair from
        the server), :class:`~dissoc.errors.TransportError` if the segment has since shrunk so that the range
        lies past its end (:meth:`check_extent`), :class:`~dissoc.errors.ResourceError` if the view is closed.
        """
        buf = self._slice(offset, length)
        self.check_extent(offset + length)
        return buf

    def _slice(self, offset: int, length: int) -> pa.Buffer:
        """:meth:`slice` without the check of the segment's current size."""
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

        ``(offset, 0)`` entries -- the ``(0, 0)`` of empty buffers -- give empty buffers. Raises what
        :meth:`slice` raises; the segment's current size is checked once, against the furthest range.
        """
        rows = pairs.to_list() if hasattr(pairs, "to_list") else pairs
        if isinstance(rows, np.ndarray):
            rows = rows.tolist()
        whole = self._whole()
        out: list[pa.Buffer] = []
        end = 0
        for offset, length in rows:
            if length == 0:
                out.append(whole.slice(0, 0))
            else:
                out.append(self._slice(offset, length))
                end = max(end, int(offset) + int(length))
        self.check_extent(end)  # one fstat per batch
        return out

    def numpy(self) -> npt.NDArray[np.uint8]:
        """The whole mapping as a numpy uint8 array (not writeable when read-only; unlike :meth:`slice`, not
        checked against the segment's current size)."""
        arr: npt.NDArray[np.uint8] = np.frombuffer(self._whole(), dtype=np.uint8)
        return arr

    def close(self) -> None:
        """Drop this view's mapping; idempotent. Buffers already sliced keep it mapped until they die."""
        if self._fd_closer is not None:
            self._fd_closer()  # closes the descriptor once
        self._fd = None
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
