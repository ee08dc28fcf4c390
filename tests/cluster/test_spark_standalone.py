"""Spark standalone across hosts: a master and two workers started from the pip PySpark's own classes, each in
a host of its own (network namespaces with their own /dev/shm), a driver in a fourth, and a dissoc server
with a Flight plane beside the master.

The data source reads a dataset, the writer publishes one and reads it back, and the barrier exchange runs
between executors on two hosts: ``auto`` picks a cross-host path and Spark's ``allGather`` rendezvous, and
the report says so. A worker killed in the middle of an exchange: Spark retries the barrier stage on the
worker that is left, every row arrives exactly once, and nothing of the exchange (servers, shared-memory
segments) stays behind on the survivor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.conftest import REPO
from cluster.netns import Cluster, Host

pytestmark = [pytest.mark.netns, pytest.mark.spark, pytest.mark.timeout(300)]

DRIVER = str(Path(__file__).resolve().parent / "spark_driver.py")
ROWS = 20_000  # per exchange task


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


class Standalone:
    """The running cluster: master and dissoc server on h0, workers on h1 and h2, the driver on h3."""

    def __init__(self, cluster: Cluster, work: Path) -> None:
        self.cluster = cluster
        self.master_host, self.w1, self.w2, self.driver_host = cluster.hosts
        self.work = work
        home = _spark_home()
        self.spark_class = str(home / "bin" / "spark-class")
        self.master = f"spark://{self.master_host.addr}:7077"
        self.env = dict(
            os.environ,
            SPARK_HOME=str(home),
            PYTHONPATH=str(REPO),
            PYSPARK_PYTHON=sys.executable,
            SPARK_DAEMON_MEMORY="256m",
            SPARK_NO_DAEMONIZE="1",
        )
        self.procs: list[subprocess.Popen[Any]] = []
        self.driver: subprocess.Popen[str] | None = None
        self.flight = ""

    def _env(self, host: Host) -> dict[str, str]:
        return {**self.env, "SPARK_LOCAL_IP": host.addr, "SPARK_LOCAL_HOSTNAME": host.addr}

    def start(self) -> None:
        log = open(self.work / "spark.log", "ab")  # noqa: SIM115 (closed with the cluster's processes)
        m = self.master_host
        self.procs.append(
            m.popen(
                [self.spark_class, "org.apache.spark.deploy.master.Master",
                 "--host", m.addr, "--port", "7077", "--webui-port", "8080"],
                env=self._env(m), stdout=log, stderr=log,
            )
        )  # fmt: skip
        for w in (self.w1, self.w2):
            workdir = self.work / f"work-{w.name}"
            workdir.mkdir()
            self.procs.append(
                w.popen(
                    [self.spark_class, "org.apache.spark.deploy.worker.Worker", "--host", w.addr,
                     "--cores", "2", "--memory", "1g", "--webui-port", "8081", "--work-dir", str(workdir),
                     self.master],
                    env=self._env(w), stdout=log, stderr=log,
                )
            )  # fmt: skip
        # the dissoc server with its Flight plane, on the master's host
        table = self.work / "ids.arrow"
        import pyarrow as pa

        ids = pa.table({"id": pa.array(range(100_000), pa.int64())})
        with pa.OSFile(str(table), "wb") as sink, pa.ipc.new_file(sink, ids.schema) as writer:
            writer.write_table(ids, max_chunksize=10_000)
        server = m.popen(
            [sys.executable, "-m", "dissoc.cli", "serve", "--host", m.addr, "--flight", "0", str(table)],
            env=self._env(m), stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip
        assert server.stdout is not None
        self.flight = json.loads(server.stdout.readline())["flight"]
        self.procs.append(server)
        d = self.driver_host
        self.driver = d.popen(
            [sys.executable, DRIVER, self.master, d.addr],
            env=self._env(d), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip
        ready = self.read(150)
        assert ready == {"ready": True, "executors": 2}, f"{ready} (see {self.work / 'spark.log'})"

    def read(self, timeout: float) -> dict[str, Any]:
        import select

        assert self.driver is not None and self.driver.stdout is not None
        ready, _, _ = select.select([self.driver.stdout], [], [], timeout)
        assert ready, f"the driver said nothing within {timeout} s (see {self.work / 'spark.log'})"
        line = self.driver.stdout.readline()
        assert line, f"the driver exited ({self.driver.wait()}; see {self.work / 'spark.log'})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, cmd: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
        assert self.driver is not None and self.driver.stdin is not None
        self.driver.stdin.write(json.dumps(cmd) + "\n")
        self.driver.stdin.flush()
        while True:
            answer = self.read(timeout)
            if "event" not in answer:
                return answer


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    if shutil.which("java") is None:
        pytest.skip("Java is not installed (PySpark needs Java 17)")
    work = tmp_path_factory.mktemp("standalone")
    with Cluster(4) as cluster:
        s = Standalone(cluster, work)
        s.start()
        yield s
        if s.driver is not None and s.driver.poll() is None:
            with __import__("contextlib").suppress(Exception):
                s.ask({"op": "stop"}, timeout=5)


#: Lists the listening TCP sockets of a network namespace with the process that holds each: its pid, its
#: parent's, and whether the parent is a JVM (read from /proc by a process inside the namespace).
_LISTENING = """
import glob, json, os
def stat(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
def cmd(pid):
    return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
owner = {}
for fd in glob.glob("/proc/[0-9]*/fd/*"):
    try:
        link = os.readlink(fd)
        if link.startswith("socket:["):
            pid = fd.split("/")[2]
            ppid = stat(pid)[1]
            owner[link[8:-1]] = {"pid": pid, "cmd": cmd(pid)[:100], "parent": cmd(ppid)[:100]}
    except OSError:
        pass
out = {}
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A":
            out[int(f[1].rsplit(":", 1)[1], 16)] = owner.get(f[9], {})
print(json.dumps(out))
"""


def _listening(host: Host) -> dict[int, dict[str, str]]:
    """The TCP ports listening in ``host`` (its own network namespace), each with the process holding it."""
    out = json.loads(host.run([sys.executable, "-c", _LISTENING]).stdout)
    return {int(port): owner for port, owner in out.items()}


def _in_python_workers(listening: dict[int, dict[str, str]]) -> dict[int, dict[str, str]]:
    """The ports held by Spark's Python workers, where exchange servers run: not by a JVM (Spark's own
    servers), nor by the Python daemon the executor starts (its parent is the JVM)."""
    return {
        port: o
        for port, o in listening.items()
        if o and "java" not in o["cmd"].split(" ")[0] and "java" not in o["parent"].split(" ")[0]
    }


def _segments(host: Host) -> list[str]:
    """dissoc's shared-memory segments and rendezvous folders in ``host``'s own /dev/shm."""
    names = host.run(["ls", "/dev/shm"]).stdout.split()
    return [n for n in names if n.startswith("dissoc")]


def test_the_data_source_and_the_writer_across_hosts(standalone: Standalone) -> None:
    got = standalone.ask({"op": "read", "location": standalone.flight, "name": "ids"})
    assert got == {"rows": 100_000, "sum": sum(range(100_000)), "partitions": 1}, got
    written = standalone.ask({"op": "write", "location": standalone.flight, "name": "out", "rows": 5_000})
    assert written == {"rows": 5_000, "sum": sum(range(5_000))}, written


def test_the_barrier_exchange_takes_a_cross_host_path_and_spark_all_gather(standalone: Standalone) -> None:
    got = standalone.ask({"op": "exchange", "rows": ROWS})
    assert "tasks" in got, got
    tasks = sorted(got["tasks"], key=lambda t: t["me"])
    assert sorted(v for t in tasks for v in t["v"]) == list(range(2 * ROWS))  # every row exactly once
    assert all(t["mine"] for t in tasks)  # each at the task its key hashes to
    assert {t["host"] for t in tasks} == {standalone.w1.addr, standalone.w2.addr}  # one task per host
    ucx = __import__("importlib").util.find_spec("ucxx") is not None
    for t in tasks:
        assert t["rendezvous"] == "allgather"  # not files: the tasks are on two hosts
        assert t["paths"] == (["ucx"] if ucx else ["tcp"]), t["paths"]


def test_a_worker_killed_mid_exchange_the_stage_is_retried_and_every_row_arrives_once(
    standalone: Standalone,
) -> None:
    survivor = standalone.w1
    driver = standalone.driver
    assert driver is not None and driver.stdin is not None
    driver.stdin.write(json.dumps({"op": "exchange", "rows": ROWS, "pause": 4}) + "\n")
    driver.stdin.flush()
    assert standalone.read(60) == {"event": "exchanging"}
    time.sleep(2)  # the tasks are in their pause, before the exchange: the stage is under way
    standalone.w2.kill()  # the worker, its executor and their Python workers, at once
    got = standalone.read(180)
    assert "tasks" in got, got
    tasks = sorted(got["tasks"], key=lambda t: t["me"])
    assert sorted(v for t in tasks for v in t["v"]) == list(range(2 * ROWS))  # exactly once
    assert all(t["mine"] for t in tasks)
    # the attempt that succeeded ran both tasks on the worker that is left: the stage was retried there
    assert {t["host"] for t in tasks} == {survivor.addr}
    # nothing of the exchange stays behind on the survivor: no server listening, no segment, no folder
    deadline = time.monotonic() + 10
    while (_in_python_workers(_listening(survivor)) or _segments(survivor)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _in_python_workers(_listening(survivor)) == {}
    assert _segments(survivor) == []
