"""Which way a barrier exchange moves one bucket from one task to another (see :func:`dissoc.spark.exchange`).

Every task describes what it can do (:class:`Capabilities`: its node, whether ucxx loads, whether its rows are
on a device) and the tasks swap these descriptions through ``allGather`` before any server starts. Each task
then works out the same :class:`Path` for every (sender, receiver) pair with :func:`choose`, so that a sender
starts the server a receiver expects without another round trip. ``"auto"`` picks the fastest path the two
share:

* same node (one kernel and one ``/dev/shm``): address/length pairs in shared memory, read without a copy
  (``body="pairs", memory="shm"``), or CUDA IPC (``memory="cuda"``) when the rows are on a device;
* otherwise UCX packed bodies when both sides load ucxx (from device memory when the rows are there);
* otherwise TCP packed bodies.

An explicit ``transport``, ``body``, ``memory`` or ``landing`` wins over the choice for every peer.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import asdict, dataclass
from typing import Any

from dissoc.errors import DissocError

__all__ = [
    "BODIES",
    "LANDINGS",
    "MEMORIES",
    "TRANSPORTS",
    "Capabilities",
    "Path",
    "PeerReport",
    "check_choice",
    "choose",
]

TRANSPORTS = ("auto", "tcp", "ucx")
BODIES = ("auto", "packed", "pairs")
MEMORIES = ("auto", "shm", "ucx", "cuda")
LANDINGS = ("auto", "host", "device")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one task of the stage can do, as swapped through ``allGather`` (JSON)."""

    #: The kernel boot and the ``/dev/shm`` it sees: tasks with the same value share memory segments.
    node: str
    #: ucxx imports in this task's interpreter.
    ucx: bool
    #: This task's rows are device batches (and so is what it sends).
    device: bool

    @classmethod
    def here(cls, *, device: bool, probe_ucx: bool = True) -> Capabilities:
        """This process's capabilities. ``probe_ucx=False`` says no UCX without loading ucxx (0.7 s the
        first time in a process here): for stages where no path could take it."""
        return cls(node=_node_key(), ucx=probe_ucx and _ucx_available(), device=device)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Capabilities:
        try:
            return cls(node=str(data["node"]), ucx=bool(data["ucx"]), device=bool(data["device"]))
        except (KeyError, TypeError) as e:
            raise DissocError(f"exchange: a peer described itself as {data!r} ({e})") from None


@dataclass(frozen=True, slots=True)
class Path:
    """How one bucket travels from its sender's server to its receiver."""

    transport: str
    body: str
    memory: str | None
    landing: str

    @property
    def zero_copy(self) -> bool:
        """The receiver reads the sender's memory in place (shared memory, or CUDA IPC onto a device)."""
        return self.body == "pairs" and (
            (self.memory == "shm" and self.landing == "host")
            or (self.memory == "cuda" and self.landing == "device")
        )

    @property
    def server_key(self) -> str:
        """What a server must be started with to serve this path (one server per distinct key), as
        ``transport/body/memory``."""
        return f"{self.transport}/{self.body}/{self.memory or '-'}"

    @property
    def name(self) -> str:
        """A short label: ``tcp``, ``ucx``, ``tcp+pairs-shm``, ... with ``->device`` when landing there."""
        label = self.transport if self.body == "packed" else f"{self.transport}+pairs-{self.memory}"
        return f"{label}->device" if self.landing == "device" else label


@dataclass(slots=True)
class PeerReport:
    """What one peer sent this task, and how (an entry of :attr:`ExchangeResult.report`)."""

    peer: int
    path: str
    transport: str
    body: str
    memory: str | None
    landing: str
    zero_copy: bool
    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_choice(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise DissocError(f"exchange: {what} must be one of {', '.join(allowed)}, got {value!r}")


def choose(
    sender: Capabilities,
    receiver: Capabilities,
    *,
    transport: str = "auto",
    body: str = "auto",
    memory: str = "auto",
    landing: str = "auto",
) -> Path:
    """The path from ``sender`` to ``receiver``: the fastest both share, with explicit choices kept."""
    check_choice("transport", transport, TRANSPORTS)
    check_choice("body", body, BODIES)
    check_choice("memory", memory, MEMORIES)
    check_choice("landing", landing, LANDINGS)
    device = sender.device
    land = landing if landing != "auto" else ("device" if device else "host")
    same_node = bool(sender.node) and sender.node == receiver.node
    if body == "auto":
        # Pairs only pay where the receiver reads the memory in place: same node, same kind of memory.
        if memory in ("shm", "cuda", "ucx") or (same_node and (land == "device") == device):
            body = "pairs"
        else:
            body = "packed"
    mem: str | None = None
    if body == "pairs":
        if memory != "auto":
            mem = memory
        elif same_node:
            mem = "cuda" if device else "shm"
        else:
            mem = "ucx"  # RMA reads across hosts
    if transport == "auto":
        if mem == "ucx" or (body == "packed" and not same_node and sender.ucx and receiver.ucx):
            transport = "ucx"
        else:
            transport = "tcp"  # pair lists are small: TCP carries them as well as anything
    if transport == "ucx" and not (sender.ucx and receiver.ucx):
        raise DissocError(
            "exchange: transport='ucx' needs ucxx on every executor (pip install 'dissoc[ucx]'); "
            f"sender has it: {sender.ucx}, receiver: {receiver.ucx}"
        )
    if mem == "ucx" and transport != "ucx":
        raise DissocError("exchange: memory='ucx' pairs are read with UCX RMA: they need transport='ucx'")
    if mem in ("shm", "cuda") and not same_node:
        raise DissocError(
            f"exchange: memory={mem!r} pairs are read in place, on the sender's node only; this peer is on "
            "another node (leave memory='auto', or use body='packed')"
        )
    if mem == "cuda" and not device:
        raise DissocError("exchange: memory='cuda' serves device batches: the rows must be DeviceBatches")
    return Path(transport=transport, body=body, memory=mem, landing=land)


@functools.cache
def _ucx_available() -> bool:
    if importlib.util.find_spec("ucxx") is None:
        return False
    try:
        from dissoc.transport.ucx.library import ucxx_lib

        ucxx_lib()
    except Exception:  # a broken install (no libucx, wrong CUDA): not a path to offer
        return False
    return True


@functools.cache
def _node_key() -> str:
    """The kernel boot id and the identity of ``/dev/shm``: equal exactly where segments are shared."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        boot = f.read().strip()
    try:
        st = os.stat("/dev/shm")
    except OSError:
        return ""  # no shared memory here: never the same node as anyone
    return f"{boot}:{st.st_dev}:{st.st_ino}"
