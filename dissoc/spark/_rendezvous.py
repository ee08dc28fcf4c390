"""How the tasks of an exchange learn each other's servers: Spark's ``allGather``, or files on one host.

``BarrierTaskContext.allGather`` works everywhere, but Spark's side of every barrier call waits in steps of
one second (measured here: 1.00 s per call on every task, whatever the payload), which is most of what a
small exchange costs. When every task of the stage runs on one host (as Spark's task addresses say), the
tasks can meet in a private folder of ``/dev/shm`` instead: each writes its message to a file of its own
(atomically, mode 0600, in a folder of mode 0700 named after the stage attempt and its executors) and
waits for the others' files, polling every few milliseconds. A task removes its file once every peer has
told it that it is done (so has read it), and the last one out removes the folder. A file left by a task
that was killed (a failed stage attempt, retried under the same name) is recognised by its writer: the
file names the process (pid, start time and PID namespace) and is ignored when that process is gone.

The choice must be the same in every task, so it is made from what every task sees alike: the stage's task
addresses and the ``rendezvous`` argument (``"auto"``: files when all addresses name one host).
Executors on one host that do not share ``/dev/shm`` (containers with separate IPC namespaces) must use
``rendezvous="allgather"``: with files they would wait for each other until the timeout, then fail saying so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable

from dissoc.errors import DissocError

__all__ = ["RENDEZVOUS", "FileRendezvous", "rendezvous_kind"]

log = logging.getLogger(__name__)

RENDEZVOUS = ("auto", "allgather", "files")
_ROOT = "/dev/shm"
_PREFIX = "dissoc-exchange-"


def rendezvous_kind(choice: str, hosts: list[str]) -> str:
    """``"allgather"`` or ``"files"``: ``choice``, or for ``"auto"`` files when ``hosts`` are all one."""
    if choice not in RENDEZVOUS:
        raise DissocError(f"exchange: rendezvous must be one of {', '.join(RENDEZVOUS)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "files" if len(set(hosts)) <= 1 and os.path.isdir(_ROOT) else "allgather"


class FileRendezvous:
    """One task's side of a rendezvous through files (see the module docstring).

    ``stage`` names the stage attempt (its id, attempt number and the executors' addresses, so that two
    applications on one host never share a folder); ``n`` tasks, this one ``me``.
    """

    def __init__(self, stage: str, n: int, me: int, *, root: str = _ROOT) -> None:
        digest = hashlib.sha256(stage.encode()).hexdigest()[:24]
        self.folder = os.path.join(root, f"{_PREFIX}{digest}")
        self.n = n
        self.me = me

    def gather(
        self, message: str, timeout: float, *, poll: Callable[[float], None] = time.sleep
    ) -> list[str]:
        """Publish ``message`` and return every task's, in task order (as ``allGather`` does)."""
        envelope = json.dumps({"writer": _me(), "message": message})
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.folder, 0o700)
        if os.stat(self.folder).st_uid != os.getuid():
            raise DissocError(f"exchange: {self.folder} belongs to another user; use rendezvous='allgather'")
        mine = os.path.join(self.folder, f"{self.me}.json")
        scratch = f"{mine}.{os.getpid()}.part"
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(envelope)
        os.replace(scratch, mine)  # readers see the whole message or nothing
        deadline = time.monotonic() + timeout
        found: dict[int, str] = {}
        pause = 0.0005
        while True:
            for i in range(self.n):
                if i not in found:
                    got = _read(os.path.join(self.folder, f"{i}.json"))
                    if got is not None:
                        found[i] = got
            if len(found) == self.n:
                return [found[i] for i in range(self.n)]
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.n)) - set(found))
                raise DissocError(
                    f"exchange: tasks {missing} did not reach the rendezvous in {self.folder} within "
                    f"{timeout} s (executors on one host with separate /dev/shm, such as containers "
                    "without a shared IPC namespace, need rendezvous='allgather')"
                )
            poll(pause)
            pause = min(pause * 2, 0.005)

    def finish(self) -> None:
        """Remove this task's file, and the folder once it is empty. Call it only once every peer has read
        the file (the exchange knows from their done-J requests)."""
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.folder, f"{self.me}.json"))
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)  # fails while another task's file is still there: it removes it then


def _me() -> dict[str, object]:
    return {"pid": os.getpid(), "start": _start_time(os.getpid()), "ns": _pid_namespace()}


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of ``/proc/PID/stat``): with the pid, it
    names one process for the life of the machine."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _pid_namespace() -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return None


def _read(path: str) -> str | None:
    """The message in ``path``, or None when there is none yet or it was left by a process that is gone."""
    try:
        with open(path, encoding="utf-8") as f:
            envelope = json.loads(f.read())
        writer, message = envelope["writer"], envelope["message"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DissocError(f"exchange: the rendezvous file {path} is not one of dissoc's ({e})") from None
    if not isinstance(message, str) or not isinstance(writer, dict):
        raise DissocError(f"exchange: the rendezvous file {path} is not one of dissoc's")
    pid = writer.get("pid")
    same_namespace = writer.get("ns") is not None and writer.get("ns") == _pid_namespace()
    if same_namespace and isinstance(pid, int) and _start_time(pid) != writer.get("start"):
        log.debug("exchange rendezvous: ignoring %s, left by process %d, which is gone", path, pid)
        return None
    return message
