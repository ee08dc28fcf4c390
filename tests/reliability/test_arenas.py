"""The arenas pair lists point into, against a hostile or unlucky host (``dissoc/memory/``).

- a ``/dev/shm`` smaller than the arena (Docker's default of 64 MiB): the server fails at start with one line
  naming the remedies and leaves no segment (shm, the fake device arena, the UCX arena), instead of dying
  with SIGBUS mid-fetch; an arena that fits serves a 200 MiB file;
- a client whose segment is truncated under it gets ``TransportError``, not SIGBUS (copy and zero-copy);
- the segment is read-only (0400) once its server has mapped it; a same-user non-root process cannot open it
  for writing; clients map it read-only;
- the segments of a SIGKILLed server are removed, and reported, by ``remove_stale_segments``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import stat
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pytest
from helpers.e2e import PYTHON, REPO, cli_server

from dissoc.client import ClientOptions, fetch, stream_batches
from dissoc.errors import TransportError
from dissoc.memory.cuda import FakeDeviceArray, FakeDeviceBackend
from dissoc.memory.shm import SHM_DIR, ShmArena, ShmView, remove_stale_segments
from dissoc.uri import DissocURI

pytestmark = pytest.mark.slow

MiB = 1 << 20


def _write_ipc(path: Path, nbytes: int, batches: int) -> pa.Table:
    """An Arrow IPC file of ``batches`` int64 batches, ``nbytes`` of data in all."""
    n = nbytes // 8 // batches
    table = pa.Table.from_batches(
        [
            pa.record_batch({"x": pa.array(np.arange(i * n, (i + 1) * n, dtype=np.int64))})
            for i in range(batches)
        ]
    )
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    return table


# -- a /dev/shm smaller than the arena --------------------------------------------------------------------


def _in_small_shm(script: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run a shell ``script`` in a private mount namespace whose /dev/shm is a fresh 64 MiB tmpfs."""
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=64m tmpfs {SHM_DIR} || exit 99\n{script}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def small_shm() -> None:
    try:
        probe = _in_small_shm("true", timeout=20)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"needs unshare(1) to make a private mount namespace: {e}")
    if probe.returncode != 0:
        pytest.skip(
            "needs a private mount namespace (unshare --mount) and permission to mount a tmpfs on "
            f"{SHM_DIR} (root or CAP_SYS_ADMIN): {probe.stderr.strip() or probe.returncode}"
        )


def _serve_too_big(kind: str) -> str:
    memory = {"shm": "--memory shm", "cuda": "--memory cuda", "ucx": "--transport ucx --memory ucx"}[kind]
    env = "DISSOC_DEVICE_BACKEND=fake " if kind == "cuda" else ""
    return (
        f"{env}{PYTHON} -m dissoc.cli serve --body pairs {memory} --arena-mib 256 $FILE 2>$ERR\n"
        f'echo "rc=$?"; echo "left=$(ls -A {SHM_DIR} | tr "\\n" " ")"'
    )


def test_arena_bigger_than_dev_shm_fails_at_start_and_leaves_nothing(small_shm: None, tmp_path: Path) -> None:
    path = tmp_path / "t.arrow"
    _write_ipc(path, 1 * MiB, 2)
    kinds = ["shm", "cuda"] + (["ucx"] if importlib.util.find_spec("ucxx") is not None else [])
    for kind in kinds:
        err = tmp_path / f"{kind}.err"
        done = _in_small_shm(f"FILE={path}; ERR={err}\n{_serve_too_big(kind)}")
        assert done.returncode == 0, (kind, done.stderr)
        out = dict(line.split("=", 1) for line in done.stdout.splitlines())
        stderr = err.read_text()
        assert out["rc"] == "1", (kind, out, stderr)  # not 135 (SIGBUS), and not a traceback
        assert out["left"].strip() == "", (kind, out)  # the half-made segment is gone
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, (kind, stderr)
        assert lines[0].startswith("dissoc: error: ") and "cannot reserve 256 MiB" in lines[0], (kind, stderr)
        assert "--arena-mib" in lines[0] and "--shm-size" in lines[0], (kind, stderr)


def test_arena_that_fits_dev_shm_serves_200_mib(small_shm: None, tmp_path: Path) -> None:
    path, got = tmp_path / "big.arrow", tmp_path / "got.arrow"
    table = _write_ipc(path, 200 * MiB, 8)  # batches of 25 MiB through a 48 MiB arena in a 64 MiB /dev/shm
    script = textwrap.dedent(
        f"""\
        {PYTHON} -m dissoc.cli serve --body pairs --memory shm --arena-mib 48 {path} > {tmp_path}/serve.out &
        pid=$!
        i=0; while [ ! -s {tmp_path}/serve.out ] && kill -0 $pid 2>/dev/null && [ $i -lt 200 ]; do
            sleep 0.1; i=$((i+1)); done
        uri=$({PYTHON} -c "import json,sys; print(json.loads(open(sys.argv[1]).readline())['uri'])" \\
            {tmp_path}/serve.out)
        timeout 60 {PYTHON} -m dissoc.cli get --no-progress "$uri" big -o {got}; echo "get=$?"
        kill -TERM $pid; wait $pid; echo "serve=$?"
        echo "left=$(ls -A {SHM_DIR} | tr "\\n" " ")"
        """
    )
    done = _in_small_shm(script)
    out = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line and "{" not in line)
    assert (out.get("get"), out.get("serve")) == ("0", "0"), (done.stdout, done.stderr)
    assert out["left"].strip() == ""
    with pa.memory_map(str(got)) as source:
        assert pa.ipc.open_file(source).read_all().equals(table)


# -- a segment truncated under its client -----------------------------------------------------------------


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A pairs server of 32 batches of 1 MiB in a subprocess. Yields (URI, the segment's path)."""
    path = tmp_path / "t.arrow"
    _write_ipc(path, 32 * MiB, 32)
    with cli_server("--body", "pairs", "--memory", "shm", "--arena-mib", "64", str(path), count=1) as (
        proc,
        lines,
    ):
        uri = lines[0]["uri"]
        handle = DissocURI.parse(uri).remote_handle
        assert handle is not None
        yield uri, os.path.join(SHM_DIR, handle.decode())
        proc.send_signal(signal.SIGTERM)  # unlinks its segment (SIGKILL, on the way out, would not)
        proc.wait(10)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_client_of_a_truncated_segment_gets_transport_error(served: tuple[str, str], zero_copy: bool) -> None:
    uri, segment = served
    # Every batch placed (resident) first: the stream below lists them, and the server writes nothing more
    # into its arena (it would meet SIGBUS itself past the new end).
    assert fetch(uri, "t").num_rows == 32 * MiB // 8
    # The async API decodes only while this test pulls the next batch, so no read of the segment runs while
    # it is truncated below (with the synchronous API a background read could race with the truncation: the
    # one window the check does not cover). Batches already decoded are not touched afterwards (zero-copy
    # ones lie over the truncated pages).

    async def run() -> int:
        seen = 0
        # max_in_flight_bytes=1: reading pauses after each pair list until the consumer has decoded it, so
        # batches after the first are still to be read from the segment when it is truncated (otherwise a
        # fast server's whole stream may be decoded, i.e. copied out, in the first burst).
        options = ClientOptions(zero_copy=zero_copy, max_in_flight_bytes=1)
        async for batch in stream_batches(uri, "t", options=options):
            seen += 1
            assert batch.num_rows == MiB // 8
            if seen == 1:
                os.chmod(segment, 0o600)  # its owner may (0400 refuses writing, not chmod); root need not
                os.truncate(segment, 4096)
        return seen

    with pytest.raises(TransportError, match="shrank to 4096 bytes"):
        asyncio.run(run())


def test_view_checks_the_current_size_once_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    with ShmArena.create(1 * MiB) as arena:
        pairs = arena.place([b"a" * 100, b"", b"b" * 200, b"c" * 300])
        with ShmView.attach(arena.handle) as view:
            calls: list[int] = []
            real = os.fstat

            def counting(fd: int) -> os.stat_result:
                calls.append(fd)
                return real(fd)

            monkeypatch.setattr(os, "fstat", counting)
            assert [b.size for b in view.buffers(pairs)] == [100, 0, 200, 300]
            assert len(calls) == 1
            monkeypatch.undo()
            os.chmod(os.path.join(SHM_DIR, arena.name), 0o600)
            os.truncate(
                os.path.join(SHM_DIR, arena.name), pairs[2][0]
            )  # the third range now lies past the end
            assert [b.size for b in view.buffers(pairs[:1])] == [100]
            with pytest.raises(TransportError, match="shrank"):
                view.buffers(pairs)
            with pytest.raises(TransportError, match="shrank"):
                view.slice(*pairs[3])


# -- read-only once mapped -----------------------------------------------------------------------------------


def test_segments_are_read_only_once_mapped() -> None:
    with ShmArena.create(4096) as arena:
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, arena.name)).st_mode) == 0o400
        arena.place([b"still writable through the server's own mapping"])
        with ShmView.attach(arena.handle) as view:
            assert view.readonly
            with pytest.raises(ValueError, match="read-only"):
                view.numpy()[0] = 1
    fake = FakeDeviceBackend()
    allocation = fake.allocate(4096)
    try:
        name: str = cast(Any, allocation).name
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == 0o400
        opened = fake.open_ipc(fake.ipc_handle(allocation), 4096)  # what a client does
        assert isinstance(opened.array, FakeDeviceArray)
        with pytest.raises(ValueError, match="read-only"):
            opened.array.host[0] = 1
        opened.close()
    finally:
        allocation.close()


def test_same_user_cannot_open_the_segment_for_writing() -> None:
    """As an unprivileged user (root bypasses modes): that user's own segment refuses O_RDWR and O_WRONLY,
    and truncating it, once its server has mapped it; read-only attaching still works."""
    code = textwrap.dedent(
        """\
        import _posixshmem, os
        from dissoc.memory.shm import ShmArena, ShmView
        os.setgid(65534); os.setuid(65534)
        refused = []
        with ShmArena.create(4096) as arena:
            path = "/dev/shm/" + arena.name
            for flags in (os.O_RDWR, os.O_WRONLY):
                try:
                    os.close(os.open(path, flags))
                except PermissionError:
                    refused.append(flags)
            try:
                os.truncate(path, 0)
            except PermissionError:
                refused.append("truncate")
            with ShmView.attach(arena.handle) as view:
                print(len(refused), view.size)
        """
    )
    done = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip(f"needs to drop to uid 65534 (setuid): {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "4096"]


# -- segments of a killed server -----------------------------------------------------------------------------


def test_remove_stale_segments_of_a_killed_server(tmp_path: Path) -> None:
    path = tmp_path / "t.arrow"
    _write_ipc(path, 1 * MiB, 2)
    with ShmArena.create(4096) as ours:  # a live process's segment stays
        with cli_server("--body", "pairs", "--memory", "shm", "--arena-mib", "8", str(path), count=1) as (
            proc,
            lines,
        ):
            handle = DissocURI.parse(lines[0]["uri"]).remote_handle
            assert handle is not None
            name = handle.decode()
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        assert os.path.exists(os.path.join(SHM_DIR, name))  # what SIGKILL leaves
        # a fake device arena of a killed process too
        child = subprocess.run(
            [
                PYTHON,
                "-c",
                "import os; from dissoc.memory.cuda import FakeDeviceBackend; "
                "a = FakeDeviceBackend().allocate(65536); print(getattr(a, 'name'), flush=True); os._exit(0)",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        fake_name = child.stdout.strip()
        assert re.fullmatch(r"dissoc-fakedev-\d+-[0-9a-f]{16}", fake_name), fake_name
        removed = {s.name: s for s in remove_stale_segments()}
        assert name in removed and fake_name in removed
        assert removed[name].size == 8 * MiB and removed[name].allocated >= 8 * MiB  # reserved: not sparse
        assert removed[fake_name].size == 65536
        assert not os.path.exists(os.path.join(SHM_DIR, name))
        assert not os.path.exists(os.path.join(SHM_DIR, fake_name))
        assert ours.name not in removed and os.path.exists(os.path.join(SHM_DIR, ours.name))
        assert name not in {s.name for s in remove_stale_segments()}  # gone: nothing twice
