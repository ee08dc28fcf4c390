"""The raw-UCX anchor of the throughput benchmarks: ucxx tagged sends between two processes, no dissoc.

A minimal sender/receiver pair over ucxx's low-level API (``ucxx._lib.libucxx``), the way spec/FACTS.md
section 5 says UCX is fastest on one host:

- each side has one context (tag matching; wake-up too when blocking) and one worker, progressed by
  **polling** (``worker.progress()`` in a loop, no progress thread, no event loop; ``--progress blocking``
  waits on the worker's epoll descriptor instead, as dissoc does);
- the two workers are joined by **worker address** (no listener, so no TCP-only restriction) with peer-failure
  handling **off**, so that UCX may use its shared-memory transports (posix/sysv, CMA);
- the sender is a subprocess that memory-maps the benchmark's Arrow IPC file and sends ``count`` messages of
  ``batch_bytes`` each, cut from that mapping (the same bytes, in the same message sizes, as the batch bodies
  the dissoc servers send; ``--source anon`` sends them from a copy in anonymous memory instead); it touches
  every page of the mapping once before it is ready, so no timed transfer pays for mapping them;
- the receiver posts one tagged receive per message into a ring of preallocated buffers (reused, as dissoc's
  pooled allocator reuses released buffers) and polls until it completes.

``window`` (default 1) is how many sends / receives each side keeps outstanding: 1 is the plain serial loop,
like the dissoc server that awaits each body before the next.

Wire protocol (tags in a range no dissoc message uses): the receiver sends ``HELLO`` (its worker address),
then per transfer ``GO`` (u64 count, u64 size); the sender answers with ``count`` messages tagged
``DATA + i``. ``GO`` with count 0 tells the sender to stop.

Sender entry point (started by :func:`ucxx_raw`)::

    python benchmarks/_ucx_anchor.py serve PATH [--window N] [--source file|anon] [--progress poll|blocking]
    # prints {"ticket", "worker"} (its worker address, base64), then serves until GO 0 or SIGTERM
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__:  # imported as benchmarks._ucx_anchor: use the same _anchors module as the importer
    from benchmarks import _anchors as anchors
else:  # imported by a script in benchmarks/ (sys.path[0]), or run as one
    import _anchors as anchors  # type: ignore[no-redef, import-not-found]

HELLO_TAG = 0x5241570000000001  # "RAW" ... 1
GO_TAG = 0x5241570000000002
DATA_TAG = 0x5241580000000000  # + message number (< 2**32)
META_TAG = 0x5241590000000000  # + message number: the first of a batch's two messages (``messages=2``)
#: Bytes of the first message of a batch with ``messages=2``: about a small batch's IPC metadata.
META_BYTES = 256
HELLO_BYTES = 8192  # fixed-size hello: u32 length, the worker address, zero padding
#: Outstanding sends/receives per side (see the module docstring); ``--ucxx-window`` in throughput.py.
WINDOW = 1
#: ``"poll"``: spin on ``worker.progress()`` (the anchor's definition: fastest on an idle machine);
#: ``"blocking"``: wait on the worker's epoll descriptor between progress calls, as dissoc does (it degrades
#: less when other processes compete for the CPUs); ``--ucxx-progress`` in throughput.py.
PROGRESS = "poll"
#: Milliseconds a blocking wait lasts at most before progressing again (a guard against a missed wake-up).
BLOCKING_WAIT_MS = 20


#: What importing ucxx put into ``os.environ`` (taken out again, see :func:`_lib`), without the ``UCX_``.
_UCXX_SETTINGS: dict[str, str] = {}


def _lib() -> Any:
    """ucxx's library. Importing ucxx sets UCX variables in ``os.environ`` (its defaults, e.g.
    ``UCX_RNDV_THRESH=8192``); they are taken out again and given to the anchor's own contexts instead, so
    that the dissoc rows of the same run (this process and the servers it starts) see the environment a
    user's would, not settings that look as if the user had chosen them."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    before = dict(os.environ)
    try:
        import ucxx._lib.libucxx as lib
    except ImportError as exc:
        raise anchors.Unavailable(f"ucxx: {exc}") from None
    finally:
        for key in [k for k in os.environ if k not in before]:
            value = os.environ.pop(key)
            if key.startswith("UCX_"):
                _UCXX_SETTINGS[key[4:]] = value
    return lib


def _array(obj: Any) -> Any:
    from ucxx._lib.arr import Array

    return Array(obj)


def _wait(request: Any, progress: Callable[[], Any]) -> None:
    """Call ``progress`` until ``request`` completes, then raise its error if it failed."""
    while not request.completed:
        progress()
    request.check_error()


class _Endpoint:
    """One side's context, worker and endpoint (worker-address connection, no peer-failure handling)."""

    def __init__(self, mode: str) -> None:
        lib = self.lib = _lib()
        features = (lib.Feature.TAG,) if mode == "poll" else (lib.Feature.TAG, lib.Feature.WAKEUP)
        self.context = lib.UCXContext(dict(_UCXX_SETTINGS), features)
        self.worker = lib.UCXWorker(self.context)
        self.endpoint: Any = None
        self.progress: Callable[[], Any] = self.worker.progress
        if mode == "blocking":
            self.worker.init_blocking_progress_mode()
            worker = self.worker
            self.progress = lambda: worker.progress_worker_event(BLOCKING_WAIT_MS)
        elif mode != "poll":
            raise ValueError(f"progress mode: expected 'poll' or 'blocking', got {mode!r}")

    def wait(self, request: Any) -> None:
        _wait(request, self.progress)

    @property
    def address(self) -> bytes:
        return bytes(self.worker.address.tobytes())

    def connect(self, address: bytes) -> None:
        peer = self.lib.UCXAddress.create_from_buffer(address)
        self.endpoint = self.worker.create_endpoint_from_worker_address(peer, False)

    def send(self, tag: int, data: Any) -> Any:
        return self.endpoint.tag_send(_array(data), self.lib.UCXXTag(tag))

    def recv(self, tag: int, buffer: Any) -> Any:
        return self.worker.tag_recv(_array(buffer), self.lib.UCXXTag(tag))

    def close(self, linger: float = 0.2) -> None:
        """Close the endpoint, progressing a little while the peer (still polling) takes part."""
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is None:
            return
        with contextlib.suppress(Exception):
            endpoint.close()
        deadline = time.monotonic() + linger
        while time.monotonic() < deadline:
            self.worker.progress()
            time.sleep(0.001)
        del endpoint


# ----------------------------------------------------------------------------------------------------------
# Receiver (the benchmark process): the path


def ucxx_raw(
    dataset: anchors.Dataset,
    stack: contextlib.ExitStack,
    source: str = "file",
    progress: str | None = None,
    connect: str = "address",
    messages: int = 1,
) -> anchors.Transfer:
    """Raw ucxx tagged messages of ``batch.nbytes`` each from a sender subprocess (see the module docstring).

    ``source``: ``"file"`` sends from the memory-mapped IPC file (as the dissoc servers do), ``"anon"`` from
    anonymous memory (a numpy array, which numpy backs with transparent huge pages where it can).
    ``progress``: ``"poll"`` or ``"blocking"`` (default: :data:`PROGRESS`). ``connect``: ``"address"`` joins
    the workers by address (shared memory on one host); ``"listener"`` connects an endpoint to the sender's
    listener (``host:port``, peer-failure handling on), as the reference mapping's clients do: the anchor for
    dissoc's listener path, which UCX runs over TCP. ``messages=2``: each batch is two messages, a
    :data:`META_BYTES` one and then the body, as the Dissociated IPC mapping sends a batch (its metadata, then
    its body): the same message count as dissoc, which one message per batch does not have.
    """
    _lib()
    window, mode = max(1, WINDOW), progress or PROGRESS
    argv = [sys.executable, str(Path(__file__).resolve()), "serve", str(dataset.path)]
    argv += ["--window", str(window), "--source", source, "--progress", mode, "--connect", connect]
    argv += ["--messages", str(messages)]
    (info,) = anchors.start_server(stack, argv)
    side = _Endpoint(mode)
    if connect == "listener":
        side.endpoint = side.lib.UCXEndpoint.create(side.worker, "127.0.0.1", int(info["port"]), True)
    else:
        side.connect(base64.b64decode(info["worker"]))
        address = side.address
        hello = np.zeros(HELLO_BYTES, dtype=np.uint8)
        hello[:4] = np.frombuffer(len(address).to_bytes(4, "little"), dtype=np.uint8)
        hello[4 : 4 + len(address)] = np.frombuffer(address, dtype=np.uint8)
        side.wait(side.send(HELLO_TAG, hello))

    def stop() -> None:
        with contextlib.suppress(Exception):
            request = side.send(GO_TAG, np.zeros(2, dtype=np.uint64))
            deadline = time.monotonic() + 5
            while not request.completed and time.monotonic() < deadline:
                side.worker.progress()
        side.close()

    stack.callback(stop)

    count, size = dataset.num_batches, dataset.payload_bytes // dataset.num_batches
    slots = max(2, window)
    ring = [np.ones(size, dtype=np.uint8) for _ in range(slots)]  # touched: no page faults when timed
    meta_ring = [np.ones(META_BYTES, dtype=np.uint8) for _ in range(slots)]
    consumed = anchors.Consumed(dataset.num_batches, dataset.num_rows)
    step = side.progress

    def transfer() -> anchors.Consumed:
        go = np.array([count, size], dtype=np.uint64)
        go_request = side.send(GO_TAG, go)
        posted: list[Any] = []
        next_post = 0
        for i in range(count):
            while next_post < count and next_post - i < window:
                if messages == 2:
                    posted.append(side.recv(META_TAG + next_post, meta_ring[next_post % slots]))
                posted.append(side.recv(DATA_TAG + next_post, ring[next_post % slots]))
                next_post += 1
            for _ in range(messages):
                request = posted[0]
                while not request.completed:
                    step()
                request.check_error()
                posted.pop(0)
        side.wait(go_request)
        del go
        return consumed

    return transfer


# ----------------------------------------------------------------------------------------------------------
# Sender (subprocess)


def serve(
    path: Path,
    window: int,
    source_kind: str = "file",
    mode: str = "poll",
    connect: str = "address",
    messages: int = 1,
) -> None:
    """Send messages cut from the memory-mapped file (or a copy of it in anonymous memory, ``"anon"``) for
    each GO until GO with count 0 (or SIGTERM); ``connect="listener"``: to the one client that connects to
    this side's listener (its port is printed instead of the worker address)."""
    import pyarrow as pa

    mapped = pa.memory_map(str(path))
    source = np.frombuffer(mapped.read_buffer(), dtype=np.uint8)
    if source_kind == "anon":
        source = source.copy()
    else:  # map every page into this process now, so that no timed transfer waits for it
        int(source[::4096].sum())
    side = _Endpoint(mode)
    progress = side.progress
    if connect == "listener":
        requests: list[Any] = []
        listener = side.lib.UCXListener.create(
            side.worker, 0, lambda conn_request, *args: requests.append(conn_request), (), None, False
        )
        sys.stdout.write(json.dumps({"ticket": path.stem, "port": int(listener.port)}) + "\n")
        sys.stdout.flush()
        while not requests:
            progress()
        side.endpoint = listener.create_endpoint_from_conn_request(requests[0], True)
    else:
        sys.stdout.write(
            json.dumps({"ticket": path.stem, "worker": base64.b64encode(side.address).decode()}) + "\n"
        )
        sys.stdout.flush()
        hello = np.zeros(HELLO_BYTES, dtype=np.uint8)
        side.wait(side.recv(HELLO_TAG, hello))
        length = int.from_bytes(hello[:4].tobytes(), "little")
        side.connect(hello[4 : 4 + length].tobytes())
    while True:
        go = np.zeros(2, dtype=np.uint64)
        side.wait(side.recv(GO_TAG, go))
        count, size = int(go[0]), int(go[1])
        if count == 0:
            break
        if size > source.nbytes:
            raise SystemExit(f"message size {size} > file size {source.nbytes}")
        pieces = max(1, source.nbytes // size)
        posted: list[Any] = []
        meta = source[:META_BYTES]
        for i in range(count):
            start = (i % pieces) * size
            if messages == 2:
                posted.append(side.send(META_TAG + i, meta))
            posted.append(side.send(DATA_TAG + i, source[start : start + size]))
            while len(posted) >= window * messages:
                if posted[0].completed:
                    posted.pop(0).check_error()
                else:
                    progress()
        for request in posted:
            side.wait(request)
    side.close(linger=1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="raw ucxx sender of the throughput benchmarks")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--source", choices=["file", "anon"], default="file")
    parser.add_argument("--progress", choices=["poll", "blocking"], default=PROGRESS)
    parser.add_argument("--connect", choices=["address", "listener"], default="address")
    parser.add_argument("--messages", type=int, choices=[1, 2], default=1)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        serve(args.path, max(1, args.window), args.source, args.progress, args.connect, args.messages)


if __name__ == "__main__":
    main()
