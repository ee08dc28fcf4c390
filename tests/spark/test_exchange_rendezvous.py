"""The exchange's file rendezvous (tasks of one host meeting in a folder of /dev/shm, no Spark needed):
every task gets every message in task order, files of processes that are gone are ignored, the folder goes
with the last task, and a task that never comes is a clear error after the timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from dissoc.errors import DissocError
from dissoc.spark._rendezvous import FileRendezvous, rendezvous_kind


def _stage() -> str:
    return f"test-{uuid.uuid4()}"


def test_auto_uses_files_only_when_every_task_is_on_one_host() -> None:
    assert rendezvous_kind("auto", ["127.0.0.1", "127.0.0.1"]) == "files"
    assert rendezvous_kind("auto", ["10.0.0.1", "10.0.0.2"]) == "allgather"
    assert rendezvous_kind("allgather", ["h", "h"]) == "allgather"
    assert rendezvous_kind("files", ["a", "b"]) == "files"
    with pytest.raises(DissocError, match="rendezvous must be one of"):
        rendezvous_kind("carrier-pigeon", ["h"])


def test_tasks_meet_and_the_last_one_out_removes_the_folder(tmp_path: Path) -> None:
    stage, n = _stage(), 4
    out: dict[int, list[str]] = {}
    everyone_read = threading.Barrier(n)  # the exchange knows it from its peers' done-J requests

    def task(me: int) -> None:
        meeting = FileRendezvous(stage, n, me, root=str(tmp_path))
        out[me] = meeting.gather(json.dumps({"me": me}), timeout=20)
        everyone_read.wait(20)
        meeting.finish()

    threads = [threading.Thread(target=task, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = [json.dumps({"me": i}) for i in range(n)]
    assert out == {i: expected for i in range(n)}
    assert list(tmp_path.iterdir()) == []


def test_the_folder_is_private(tmp_path: Path) -> None:
    meeting = FileRendezvous(_stage(), 1, 0, root=str(tmp_path))
    assert meeting.gather("hello", timeout=5) == ["hello"]
    assert os.stat(meeting.folder).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(meeting.folder, "0.json")).st_mode & 0o777 == 0o600
    meeting.finish()
    assert not os.path.exists(meeting.folder)


def test_a_file_left_by_a_process_that_is_gone_is_ignored(tmp_path: Path) -> None:
    stage = _stage()
    # A task of an earlier attempt of the stage wrote its file, then died (here: a process that exits).
    script = (
        "import sys; from dissoc.spark._rendezvous import FileRendezvous as F; "
        "m = F(sys.argv[1], 2, 1, root=sys.argv[2]); "
        "m.gather('stale', timeout=0.05, poll=lambda s: None)"
    )
    dead = subprocess.run(
        [sys.executable, "-c", script, stage, str(tmp_path)], capture_output=True, text=True
    )
    assert "did not reach the rendezvous" in dead.stderr  # it waited for task 0, which never came
    me = FileRendezvous(stage, 2, 0, root=str(tmp_path))
    with pytest.raises(DissocError, match=r"tasks \[1\] did not reach the rendezvous"):
        me.gather("fresh", timeout=0.3)  # the stale file of task 1 is not taken for task 1's
    peer = FileRendezvous(stage, 2, 1, root=str(tmp_path))
    assert peer.gather("live", timeout=5) == ["fresh", "live"]
    assert me.gather("fresh", timeout=5) == ["fresh", "live"]


def test_a_file_that_is_not_a_rendezvous_message_is_an_error(tmp_path: Path) -> None:
    meeting = FileRendezvous(_stage(), 2, 0, root=str(tmp_path))
    os.makedirs(meeting.folder, mode=0o700)
    Path(meeting.folder, "1.json").write_text("{not json")
    with pytest.raises(DissocError, match="not one of dissoc's"):
        meeting.gather("x", timeout=5)
