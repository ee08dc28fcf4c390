"""UCX RMA (one-sided GET) binding: struct layouts against libucp's headers, GETs within and across processes.

Everything that loads libucp is marked ``ucx`` (skipped without ucxx, which brings the libucx wheel); the
pure layout checks against the values the x86-64 headers imply run everywhere.
"""

from __future__ import annotations

import ctypes
import importlib.util
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dissoc.errors import TransportError
from dissoc.memory import ucx_rma as rma
from dissoc.transport.ucx import libucp

# Quiet UCX about the UCX_* variables that importing ucxx (elsewhere in the suite) sets.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

# name -> (sizeof, {field: offsetof}) as gcc computes them from the libucx 1.21 wheel's headers on x86-64
# (ucp.h / ucp_def.h); the header-compiling test below recomputes them from the installed headers.
EXPECTED_LAYOUT: dict[str, tuple[type[ctypes.Structure], int, dict[str, int]]] = {
    "ucp_params_t": (libucp.UcpParams, 88, {"field_mask": 0, "features": 8, "name": 72}),
    "ucp_am_handler_param_t": (
        libucp.UcpAmHandlerParam,
        32,
        {"field_mask": 0, "id": 8, "flags": 12, "cb": 16, "arg": 24},
    ),
    "ucp_am_recv_param_t": (libucp.UcpAmRecvParam, 16, {"recv_attr": 0, "reply_ep": 8}),
    "ucp_worker_params_t": (libucp.UcpWorkerParams, 200, {"field_mask": 0, "thread_mode": 8}),
    "ucp_ep_params_t": (
        libucp.UcpEpParams,
        104,
        {
            "field_mask": 0,
            "address": 8,
            "err_mode": 16,
            "err_handler": 24,
            "user_data": 40,
            "flags": 48,
            "sockaddr": 56,
            "conn_request": 72,
            "name": 80,
            "local_sockaddr": 88,
        },
    ),
    "ucp_mem_map_params_t": (
        libucp.UcpMemMapParams,
        48,
        {
            "field_mask": 0,
            "address": 8,
            "length": 16,
            "flags": 24,
            "prot": 28,
            "memory_type": 32,
            "exported_memh_buffer": 40,
        },
    ),
    "ucp_tag_recv_info_t": (libucp.UcpTagRecvInfo, 16, {"sender_tag": 0, "length": 8}),
    "ucp_transport_entry_t": (libucp.UcpTransportEntry, 16, {"transport_name": 0, "device_name": 8}),
    "ucp_transports_t": (libucp.UcpTransports, 24, {"entries": 0, "num_entries": 8, "entry_size": 16}),
    "ucp_ep_attr_t": (
        libucp.UcpEpAttr,
        328,
        {
            "field_mask": 0,
            "name": 8,
            "local_sockaddr": 40,
            "remote_sockaddr": 168,
            "transports": 296,
            "user_data": 320,
        },
    ),
    "ucp_request_param_t": (
        libucp.UcpRequestParam,
        72,
        {
            "op_attr_mask": 0,
            "flags": 4,
            "request": 8,
            "cb": 16,
            "datatype": 24,
            "user_data": 32,
            "reply_buffer": 40,
            "memory_type": 48,
            "recv_info": 56,
            "memh": 64,
        },
    ),
}

# constant in ucx_rma -> its C name (header enum / macro)
CONSTANTS = {
    "UCS_OK": "UCS_OK",
    "UCS_INPROGRESS": "UCS_INPROGRESS",
    "UCS_ERR_CANCELED": "UCS_ERR_CANCELED",
    "UCS_ERR_TIMED_OUT": "UCS_ERR_TIMED_OUT",
    "UCS_ERR_LAST": "UCS_ERR_LAST",
    "UCP_PARAM_FIELD_FEATURES": "UCP_PARAM_FIELD_FEATURES",
    "UCP_FEATURE_RMA": "UCP_FEATURE_RMA",
    "UCP_WORKER_PARAM_FIELD_THREAD_MODE": "UCP_WORKER_PARAM_FIELD_THREAD_MODE",
    "UCS_THREAD_MODE_SINGLE": "UCS_THREAD_MODE_SINGLE",
    "UCS_THREAD_MODE_SERIALIZED": "UCS_THREAD_MODE_SERIALIZED",
    "UCP_EP_PARAM_FIELD_REMOTE_ADDRESS": "UCP_EP_PARAM_FIELD_REMOTE_ADDRESS",
    "UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE": "UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE",
    "UCP_ERR_HANDLING_MODE_NONE": "UCP_ERR_HANDLING_MODE_NONE",
    "UCP_EP_CLOSE_FLAG_FORCE": "UCP_EP_CLOSE_FLAG_FORCE",
    "UCP_MEM_MAP_PARAM_FIELD_ADDRESS": "UCP_MEM_MAP_PARAM_FIELD_ADDRESS",
    "UCP_MEM_MAP_PARAM_FIELD_LENGTH": "UCP_MEM_MAP_PARAM_FIELD_LENGTH",
    "UCP_MEM_MAP_PARAM_FIELD_FLAGS": "UCP_MEM_MAP_PARAM_FIELD_FLAGS",
    "UCP_MEM_MAP_PARAM_FIELD_PROT": "UCP_MEM_MAP_PARAM_FIELD_PROT",
    "UCP_MEM_MAP_PROT_LOCAL_READ": "UCP_MEM_MAP_PROT_LOCAL_READ",
    "UCP_MEM_MAP_PROT_LOCAL_WRITE": "UCP_MEM_MAP_PROT_LOCAL_WRITE",
    "UCP_MEM_MAP_PROT_REMOTE_READ": "UCP_MEM_MAP_PROT_REMOTE_READ",
    "UCP_MEM_MAP_PROT_REMOTE_WRITE": "UCP_MEM_MAP_PROT_REMOTE_WRITE",
    "UCP_OP_ATTR_FIELD_REQUEST": "UCP_OP_ATTR_FIELD_REQUEST",
    "UCP_OP_ATTR_FIELD_CALLBACK": "UCP_OP_ATTR_FIELD_CALLBACK",
    "UCP_OP_ATTR_FIELD_USER_DATA": "UCP_OP_ATTR_FIELD_USER_DATA",
    "UCP_OP_ATTR_FIELD_FLAGS": "UCP_OP_ATTR_FIELD_FLAGS",
    "UCP_STREAM_RECV_FLAG_WAITALL": "UCP_STREAM_RECV_FLAG_WAITALL",
    "UCS_CPU_SETSIZE": "UCS_CPU_SETSIZE",
    "UCS_ERR_NO_MEMORY": "UCS_ERR_NO_MEMORY",
    "UCP_AM_HANDLER_PARAM_FIELD_ID": "UCP_AM_HANDLER_PARAM_FIELD_ID",
    "UCP_AM_HANDLER_PARAM_FIELD_FLAGS": "UCP_AM_HANDLER_PARAM_FIELD_FLAGS",
    "UCP_AM_HANDLER_PARAM_FIELD_CB": "UCP_AM_HANDLER_PARAM_FIELD_CB",
    "UCP_AM_HANDLER_PARAM_FIELD_ARG": "UCP_AM_HANDLER_PARAM_FIELD_ARG",
    "UCP_AM_FLAG_WHOLE_MSG": "UCP_AM_FLAG_WHOLE_MSG",
    "UCP_AM_RECV_ATTR_FIELD_REPLY_EP": "UCP_AM_RECV_ATTR_FIELD_REPLY_EP",
    "UCP_AM_RECV_ATTR_FLAG_DATA": "UCP_AM_RECV_ATTR_FLAG_DATA",
    "UCP_AM_RECV_ATTR_FLAG_RNDV": "UCP_AM_RECV_ATTR_FLAG_RNDV",
    "UCP_EP_ATTR_FIELD_TRANSPORTS": "UCP_EP_ATTR_FIELD_TRANSPORTS",
    "UCP_ENTITY_NAME_MAX": "UCP_ENTITY_NAME_MAX",
    "UCP_API_MAJOR": "UCP_API_MAJOR",
    "UCP_API_MINOR": "UCP_API_MINOR",
}


def _include_dir() -> Path | None:
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        include = Path(location) / "include"
        if (include / "ucp" / "api" / "ucp.h").exists():
            return include
    return None


# ---------------------------------------------------------------------------------------------------------
# Layout checks (no libucp needed)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="layouts recorded for LP64")
@pytest.mark.parametrize("c_name", sorted(EXPECTED_LAYOUT))
def test_struct_layout_matches_header_values(c_name: str) -> None:
    struct, size, offsets = EXPECTED_LAYOUT[c_name]
    assert ctypes.sizeof(struct) == size
    for field, offset in offsets.items():
        assert getattr(struct, field).offset == offset, field


def test_status_pointer_helpers() -> None:
    # UCS_PTR_IS_ERR / UCS_PTR_IS_PTR / UCS_PTR_STATUS on NULL, errors and a real pointer
    assert (
        not libucp.ptr_is_err(None)
        and not libucp.ptr_is_ptr(None)
        and libucp.ptr_status(None) == libucp.UCS_OK
    )
    for status in (-1, -16, -20, -100):
        ptr = status % (1 << 64)
        assert libucp.ptr_is_err(ptr) and not libucp.ptr_is_ptr(ptr)
        assert libucp.ptr_status(ptr) == status
    ptr = 0x7F00_1234_5678
    assert (
        libucp.ptr_is_ptr(ptr)
        and not libucp.ptr_is_err(ptr)
        and libucp.ptr_status(ptr) == libucp.UCS_INPROGRESS
    )
    # -101 is not an error value: it is treated as a pointer (as in C)
    assert not libucp.ptr_is_err((-101) % (1 << 64))


def test_import_does_not_load_libucp() -> None:
    code = (
        "import sys, dissoc.memory.ucx_rma\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libucp' not in maps, 'libucp loaded at import'\n"
        "assert 'ucxx' not in sys.modules and 'libucx' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------------------
# Checks against the installed headers
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.ucx
def test_constants_match_header_enums() -> None:
    include = _include_dir()
    if include is None:
        pytest.skip("libucx headers not found")
    text = "".join(
        p.read_text()
        for p in (
            include / "ucs/type/status.h",
            include / "ucs/type/thread_mode.h",
            include / "ucs/type/cpu_set.h",
            include / "ucp/api/ucp_def.h",
            include / "ucp/api/ucp.h",
            include / "ucp/api/ucp_version.h",
        )
    )
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    values: dict[str, int] = {}
    for name, value in re.findall(r"\b(UC[PS]_[A-Z0-9_]+)\s*=\s*(UCS_BIT\(\d+\)|-?\s*\d+)", text):
        bit = re.fullmatch(r"UCS_BIT\((\d+)\)", value)
        values[name] = 1 << int(bit.group(1)) if bit else int(value.replace(" ", ""))
    for name, value in re.findall(r"#define\s+(UC[PS]_[A-Z0-9_]+)\s+(\d+)\s*$", text, flags=re.M):
        values[name] = int(value)
    # implicit enum values (first member 0, no initializer)
    values.setdefault("UCS_THREAD_MODE_SINGLE", 0)
    values.setdefault("UCP_ERR_HANDLING_MODE_NONE", 0)
    assert re.search(r"UCS_THREAD_MODE_SINGLE,\s*UCS_THREAD_MODE_SERIALIZED,", text)
    values.setdefault("UCS_THREAD_MODE_SERIALIZED", 1)
    assert re.search(r"\{\s*UCP_ERR_HANDLING_MODE_NONE,", text)
    for ours, theirs in CONSTANTS.items():
        assert theirs in values, theirs
        assert getattr(libucp, ours) == values[theirs], ours
    # ucs_status_t is a packed enum: one byte, which is why functions returning it use c_int8
    assert re.search(r"\}\s*UCS_S_PACKED\s+ucs_status_t\s*;", text)


@pytest.mark.ucx
def test_struct_layout_matches_compiled_header(tmp_path: Path) -> None:
    include = _include_dir()
    cc = shutil.which("cc") or shutil.which("gcc")
    if include is None or cc is None:
        pytest.skip("needs the libucx headers and a C compiler")
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <ucp/api/ucp.h>", "int main(void) {"]
    lines.append('printf("ucs_status_t %zu\\n", sizeof(ucs_status_t));')
    for c_name, (_, _, offsets) in EXPECTED_LAYOUT.items():
        lines.append(f'printf("{c_name} %zu\\n", sizeof({c_name}));')
        for field in offsets:
            lines.append(f'printf("{c_name}.{field} %zu\\n", offsetof({c_name}, {field}));')
    lines += ["return 0;", "}"]
    src = tmp_path / "probe.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "probe"
    subprocess.run([cc, f"-I{include}", str(src), "-o", str(exe)], check=True, timeout=60)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout
    measured = dict(line.rsplit(" ", 1) for line in out.splitlines())
    assert int(measured["ucs_status_t"]) == ctypes.sizeof(ctypes.c_int8)
    for c_name, (struct, _, offsets) in EXPECTED_LAYOUT.items():
        assert ctypes.sizeof(struct) == int(measured[c_name]), c_name
        for field in offsets:
            assert getattr(struct, field).offset == int(measured[f"{c_name}.{field}"]), f"{c_name}.{field}"
    # every field we declare, not only the ones listed, keeps its size consistent with the next offset
    for _, (struct, size, _) in EXPECTED_LAYOUT.items():
        assert ctypes.sizeof(struct) == size


# ---------------------------------------------------------------------------------------------------------
# GETs within one process
# ---------------------------------------------------------------------------------------------------------

ARENA = 8 << 20


@pytest.fixture
def pair() -> Iterator[tuple[rma.RmaContext, rma.RmaContext]]:
    with rma.RmaContext() as server, rma.RmaContext() as client:
        yield server, client


def _arena(n: int = ARENA, seed: int = 7) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.ucx
def test_library_found() -> None:
    path = libucp.libucp_path()
    assert path is not None and "libucp" in path
    assert libucp.status_string(libucp.UCS_OK) == "Success"
    assert libucp.status_string(libucp.UCS_ERR_CANCELED)  # some message


@pytest.mark.ucx
def test_one_libucp_alongside_ucxx() -> None:
    """The wheel ships copies (not links) of libucp.so/.so.0; both ucxx and this module must map the same."""
    code = (
        "import os; os.environ['UCX_WARN_UNUSED_ENV_VARS'] = 'n'\n"
        "import dissoc.memory.ucx_rma as r\n"
        "r.RmaContext().close()\n"
        "import ucxx._lib.libucxx as l\n"
        "w = l.UCXWorker(l.UCXContext())\n"
        "names = {x.split()[-1].rsplit('/', 1)[-1] for x in open('/proc/self/maps') if '/libuc' in x}\n"
        "assert len([n for n in names if n.startswith('libucp.')]) == 1, names\n"
        "assert len([n for n in names if n.startswith('libucs.')]) == 1, names\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_get_ranges(pair: tuple[rma.RmaContext, rma.RmaContext]) -> None:
    server, client = pair
    arena = _arena()
    reg = server.register(arena)
    assert reg.address == arena.ctypes.data and reg.length == ARENA and reg.rkey
    ep = client.connect(server.worker_address())
    key = ep.unpack(reg.rkey, reg.address, reg.length)
    for offset, n in [
        (0, 1),
        (0, 4096),
        (1, 4095),
        (12345, 100_000),
        (ARENA - 7, 7),
        (0, ARENA),
        (ARENA // 2, 3),
    ]:
        dest = np.zeros(n, np.uint8)
        key.get(reg.address + offset, dest)
        assert np.array_equal(dest, arena[offset : offset + n]), (offset, n)
    # into a bytearray and a 2-D array (any C-contiguous writable buffer); zero bytes is a no-op
    out = bytearray(1000)
    key.get(reg.address + 77, out)
    assert bytes(out) == arena[77:1077].tobytes()
    grid = np.zeros((16, 64), np.uint8)
    key.get(reg.address + 4096, grid)
    assert grid.tobytes() == arena[4096 : 4096 + 1024].tobytes()
    key.get(reg.address, bytearray())


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_get_nb_overlapping(pair: tuple[rma.RmaContext, rma.RmaContext]) -> None:
    server, client = pair
    arena = _arena()
    reg = server.register(arena)
    ep = client.connect(server.worker_address())
    key = ep.unpack(reg.rkey, reg.address, reg.length)
    chunk = 1 << 20
    dests = [np.zeros(chunk, np.uint8) for _ in range(ARENA // chunk)]
    requests = [key.get_nb(reg.address + i * chunk, d) for i, d in enumerate(dests)]
    half = len(requests) // 2
    while not all([r.done() for r in requests[:half]]):  # polling: each done() progresses once
        pass
    rma.wait_all(requests[half:])
    assert all(r.done() for r in requests)
    assert np.array_equal(np.concatenate(dests), arena)
    # GETs dropped without waiting stay referenced by the context (buffers alive) and are finished on close
    dests = [np.zeros(chunk, np.uint8) for _ in range(4)]
    for i, d in enumerate(dests):
        key.get_nb(reg.address + i * chunk, d)
    client.close()
    assert not client._inflight
    assert np.array_equal(np.concatenate(dests), arena[: 4 * chunk])


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_register_read_only_and_multiple(pair: tuple[rma.RmaContext, rma.RmaContext]) -> None:
    server, client = pair
    blob = bytes(range(256)) * 64
    arena = _arena(1 << 16, seed=1)
    reg_ro = server.register(blob)
    reg_np = server.register(arena)
    ep = client.connect(server.worker_address())
    k1 = ep.unpack(reg_ro.rkey, reg_ro.address, reg_ro.length)
    k2 = ep.unpack(reg_np.rkey, reg_np.address, reg_np.length)
    d = bytearray(300)
    k1.get(reg_ro.address + 10, d)
    assert bytes(d) == blob[10:310]
    k2.get(reg_np.address + 10, d)
    assert bytes(d) == arena[10:310].tobytes()


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_out_of_range_and_bad_buffers(pair: tuple[rma.RmaContext, rma.RmaContext]) -> None:
    """UCX itself does not range-check GETs (cma reads any mapped address of the target, and an unmapped one
    aborts the process with error handling off), so RemoteKey checks against the published region."""
    server, client = pair
    arena = _arena(1 << 16)
    reg = server.register(arena)
    ep = client.connect(server.worker_address())
    key = ep.unpack(reg.rkey, reg.address, reg.length)
    d = np.zeros(16, np.uint8)
    for where in (
        reg.address - 1,
        reg.address + reg.length - 15,
        reg.address + reg.length,
        reg.address + (1 << 40),
    ):
        with pytest.raises(TransportError, match="outside the registered region"):
            key.get(where, d)
    with pytest.raises(TransportError, match="negative"):
        key.get(-1, d)
    key.get(reg.address + reg.length - 16, d)  # the last 16 bytes are fine
    assert np.array_equal(d, arena[-16:])
    with pytest.raises(ValueError, match="writable"):
        key.get(reg.address, b"\0" * 16)
    with pytest.raises(ValueError, match="contiguous"):
        key.get(reg.address, np.zeros(32, np.uint8)[::2])
    with pytest.raises(ValueError, match="empty"):
        server.register(b"")
    with pytest.raises(ValueError, match="both"):
        ep.unpack(reg.rkey, reg.address)
    with pytest.raises(TransportError):
        ep.unpack(b"")
    with pytest.raises(TransportError):
        client.connect(b"")


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_close_order_and_closed_errors() -> None:
    arena = _arena(1 << 16)
    server = rma.RmaContext()
    client = rma.RmaContext()
    reg = server.register(arena)
    ep = client.connect(server.worker_address())
    key = ep.unpack(reg.rkey, reg.address, reg.length)
    key.get(reg.address, bytearray(10))
    # closing the client context closes its endpoint and the endpoint's keys
    client.close()
    assert client.closed and ep.closed and key.closed
    with pytest.raises(TransportError, match="closed"):
        key.get(reg.address, bytearray(10))
    with pytest.raises(TransportError, match="closed"):
        client.connect(server.worker_address())
    with pytest.raises(TransportError, match="closed"):
        ep.unpack(reg.rkey)
    client.close()
    ep.close()
    key.close()  # idempotent
    # the registration's view pins the buffer until it is unmapped
    buf = bytearray(4096)
    reg2 = server.register(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")
    reg2.close()
    buf.extend(b"x")
    reg2.close()
    server.close()
    assert reg.closed and server.closed
    with pytest.raises(TransportError, match="closed"):
        server.worker_address()


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_many_contexts_no_leak() -> None:
    """Open/close cycles keep the process's mappings and descriptors bounded."""

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def cycle() -> None:
        with rma.RmaContext() as s, rma.RmaContext() as c:
            arena = _arena(1 << 16)
            reg = s.register(arena)
            with c.connect(s.worker_address()) as ep, ep.unpack(reg.rkey, reg.address, reg.length) as key:
                key.get(reg.address, bytearray(64))

    cycle()
    before = fds()
    for _ in range(10):
        cycle()
    assert fds() <= before + 2


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_emulated_get_with_target_progress_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TCP (no zero-copy GET), UCX emulates GET in software: the target must progress its worker."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    with rma.RmaContext() as server, rma.RmaContext() as client:
        server.start_progress_thread()
        arena = _arena(1 << 20)
        reg = server.register(arena)
        ep = client.connect(server.worker_address())
        key = ep.unpack(reg.rkey, reg.address, reg.length)
        dest = np.zeros(300_000, np.uint8)
        key.get(reg.address + 1000, dest, timeout=20)
        assert np.array_equal(dest, arena[1000:301_000])


# ---------------------------------------------------------------------------------------------------------
# Across processes, and throughput
# ---------------------------------------------------------------------------------------------------------


def _serve(conn: Connection, size: int, seed: int) -> None:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    with rma.RmaContext() as ctx:
        arena = _arena(size, seed)
        reg = ctx.register(arena)
        conn.send((ctx.worker_address(), reg.rkey, reg.address, reg.length))
        conn.recv()  # the client is done
        reg.close()
    conn.send("closed")


def _measure(key: rma.RemoteKey, base: int, length: int, size: int, rounds: int) -> float:
    dest = np.ones(size, np.uint8)  # pages faulted in before timing
    key.get(base, dest)
    start = time.perf_counter()
    for i in range(rounds):
        key.get(base + (i % (length // size)) * size, dest)  # page-aligned ranges
    return rounds * size / (time.perf_counter() - start) / 1e9


@pytest.mark.ucx
@pytest.mark.timeout(90)
def test_cross_process_get_and_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    size = 128 << 20
    ctx_mp = mp.get_context("spawn")
    parent, child = ctx_mp.Pipe()
    proc = ctx_mp.Process(target=_serve, args=(child, size, 3), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "server did not start"
        address, rkey, base, length = parent.recv()
        expected = _arena(size, 3)
        results = {}
        with rma.RmaContext() as client, client.connect(address) as ep:
            key = ep.unpack(rkey, base, length)
            for offset, n in [(0, 1), (5, 4093), (size - 100, 100), (size // 3, 1 << 20)]:
                dest = np.zeros(n, np.uint8)
                key.get(base + offset, dest)
                assert np.array_equal(dest, expected[offset : offset + n])
            for mib in (16, 64):
                results[mib] = _measure(key, base, length, mib << 20, rounds=8 if mib == 16 else 4)
        parent.send("done")
        assert parent.poll(30) and parent.recv() == "closed"
        proc.join(30)
        assert proc.exitcode == 0
        with capsys.disabled():
            print(" ".join(f"[cross-process GET {m} MiB: {gbs:.2f} GB/s]" for m, gbs in results.items()))
        assert all(gbs > 0 for gbs in results.values())
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_in_process_throughput(
    pair: tuple[rma.RmaContext, rma.RmaContext], capsys: pytest.CaptureFixture[str]
) -> None:
    server, client = pair
    arena = _arena(128 << 20)
    reg = server.register(arena)
    ep = client.connect(server.worker_address())
    key = ep.unpack(reg.rkey, reg.address, reg.length)
    results = {mib: _measure(key, reg.address, reg.length, mib << 20, rounds=4) for mib in (16, 64)}
    with capsys.disabled():
        print(" ".join(f"[in-process GET {m} MiB: {gbs:.2f} GB/s]" for m, gbs in results.items()))


@pytest.mark.ucx
@pytest.mark.timeout(60)
def test_get_timeout_cancels_and_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    """An emulated GET (TCP) cannot finish while the target does not progress: it times out, the request is
    parked with its buffer (UCX does not cancel it promptly), then reaped once the target progresses."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    with rma.RmaContext() as server, rma.RmaContext() as client:
        arena = _arena(1 << 16)
        reg = server.register(arena)
        ep = client.connect(server.worker_address())
        key = ep.unpack(reg.rkey, reg.address, reg.length)
        dest = np.zeros(1000, np.uint8)
        with pytest.raises(TransportError, match="timed out"):
            key.get(reg.address, dest, timeout=0.3)
        server.start_progress_thread()
        dest2 = np.zeros(1000, np.uint8)
        key.get(reg.address + 5, dest2, timeout=20)
        assert np.array_equal(dest2, arena[5:1005])
        deadline = time.monotonic() + 10
        while any(entry[0] is client for entry in rma._ABANDONED) and time.monotonic() < deadline:
            client.progress()
        assert not any(entry[0] is client for entry in rma._ABANDONED)  # completed and freed


@pytest.mark.ucx
def test_the_client_keeps_a_bounded_set_of_rma_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client reads pairs over RMA through one endpoint per server worker, kept for the next stream; past
    MAX_RMA_PEERS the least recently used is closed."""
    from dissoc.memory import pairs

    monkeypatch.setattr(pairs, "MAX_RMA_PEERS", 2)
    servers = [rma.RmaContext() for _ in range(3)]
    try:
        addresses = [s.worker_address() for s in servers]
        first = pairs._rma_endpoint(addresses[0])
        assert pairs._rma_endpoint(addresses[0]) is first  # kept
        second = pairs._rma_endpoint(addresses[1])
        assert pairs._rma_endpoint(addresses[0]) is first  # (now the most recently used)
        pairs._rma_endpoint(addresses[2])
        assert second.closed and not first.closed
        assert list(pairs._endpoints) == [addresses[0], addresses[2]]
    finally:
        for address in list(pairs._endpoints):
            pairs._endpoints.pop(address).close()
        for s in servers:
            s.close()
