"""The barrier exchange on every path: how a path is chosen per peer (no Spark needed), and each path run for
real between Spark tasks, in ``local[2]`` (two Python workers of one executor) and in
``local-cluster[2,1,1024]`` (two executor JVMs, each with its own Python workers).

Paths: TCP and UCX packed bodies, address/length pairs in shared memory read in place, and device batches
(on the fake device backend here: host shared memory posing as GPU memory, whose "CUDA IPC" pairs are read
in place as on a GPU) split on the device, sent as pairs or packed bodies and landing as DeviceBatches.
Every run checks that each row reached the task its key hashes to, exactly once, and that the report names
the path each peer's rows took.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dissoc.errors import DissocError
from dissoc.spark._exchange import _split
from dissoc.spark._paths import Capabilities, choose

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
]

HERE = Capabilities(node="boot:1:2", ucx=True, device=False)
THERE = Capabilities(node="boot2:1:2", ucx=True, device=False)
NO_UCX = Capabilities(node="boot2:1:2", ucx=False, device=False)
HERE_DEVICE = Capabilities(node="boot:1:2", ucx=True, device=True)
THERE_DEVICE = Capabilities(node="boot2:1:2", ucx=True, device=True)

# ------------------------------------------------------------------------------------------- path choice


def test_same_node_reads_shared_memory_in_place() -> None:
    path = choose(HERE, HERE)
    assert (path.transport, path.body, path.memory, path.landing) == ("tcp", "pairs", "shm", "host")
    assert path.zero_copy and path.name == "tcp+pairs-shm"


def test_other_nodes_take_ucx_when_both_have_it_else_tcp() -> None:
    assert choose(HERE, THERE).name == "ucx"
    assert choose(HERE, NO_UCX).name == "tcp"
    assert choose(NO_UCX, HERE).name == "tcp"
    assert not choose(HERE, THERE).zero_copy


def test_device_rows_use_cuda_ipc_on_one_node_and_ucx_across() -> None:
    same = choose(HERE_DEVICE, HERE_DEVICE)
    assert (same.body, same.memory, same.landing, same.zero_copy) == ("pairs", "cuda", "device", True)
    across = choose(HERE_DEVICE, THERE_DEVICE)
    assert (across.transport, across.body, across.landing) == ("ucx", "packed", "device")
    assert choose(HERE_DEVICE, Capabilities("x", ucx=False, device=True)).name == "tcp->device"


def test_landing_elsewhere_than_the_rows_are_sends_packed_bodies() -> None:
    assert choose(HERE_DEVICE, HERE_DEVICE, landing="host").name == "tcp"
    assert choose(HERE, HERE, landing="device").name == "tcp->device"


def test_explicit_choices_win() -> None:
    assert choose(HERE, HERE, transport="tcp", body="packed").name == "tcp"
    assert choose(HERE, HERE, transport="ucx").name == "ucx+pairs-shm"
    assert choose(HERE, THERE, body="pairs").name == "ucx+pairs-ucx"
    assert choose(HERE, HERE, memory="ucx").name == "ucx+pairs-ucx"


@pytest.mark.parametrize(
    ("sender", "receiver", "choice", "message"),
    [
        (HERE, NO_UCX, {"transport": "ucx"}, "needs ucxx on every executor"),
        (HERE, THERE, {"memory": "shm"}, "on the sender's node only"),
        (HERE, HERE, {"memory": "cuda"}, "must be DeviceBatches"),
        (HERE, HERE, {"memory": "ucx", "transport": "tcp"}, "need transport='ucx'"),
        (HERE, HERE, {"transport": "udp"}, "transport must be one of"),
        (HERE, HERE, {"landing": "gpu"}, "landing must be one of"),
        (HERE, HERE, {"body": "pair"}, "body must be one of"),
    ],
)
def test_impossible_choices_are_clear_errors(
    sender: Capabilities, receiver: Capabilities, choice: dict[str, str], message: str
) -> None:
    with pytest.raises(DissocError, match=message):
        choose(sender, receiver, **choice)


def test_capabilities_round_trip_and_refuse_garbage() -> None:
    here = Capabilities.here(device=False)
    assert Capabilities.from_json(json.loads(json.dumps(here.to_json()))) == here
    assert here.node  # this machine has /dev/shm
    assert not Capabilities.here(device=False, probe_ucx=False).ucx  # a stage on one host never loads ucxx
    with pytest.raises(DissocError, match="described itself"):
        Capabilities.from_json({"node": "x"})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.lists(st.integers(0, 299), max_size=300))
def test_split_keeps_every_row_once_in_order(n: int, raw: list[int]) -> None:
    dest = np.array([d % n for d in raw], dtype=np.int64)
    batch = pa.record_batch({"i": pa.array(np.arange(len(dest)), pa.int64())})
    parts = _split(batch, dest, n)
    assert len(parts) == n
    for j, part in enumerate(parts):
        assert part.column("i").to_pylist() == np.flatnonzero(dest == j).tolist()


@pytest.mark.parametrize("transport", ["tcp", pytest.param("ucx", marks=pytest.mark.ucx)], ids=["tcp", "ucx"])
def test_a_peer_says_done_on_the_connection_its_rows_came_on(transport: str) -> None:
    # one connection per peer, not two: for UCX each is a worker at both ends (tens of ms)
    from helpers.e2e import ServerThread

    from dissoc.metrics import server_metrics
    from dissoc.spark._exchange import _Done, _fetch
    from dissoc.spark._paths import Path

    def accepted() -> float:
        snap = server_metrics().get("dissoc_server_connections_total", {})
        return sum(v for labels, v in snap.items() if dict(labels).get("transport") == transport)

    arrived: list[int] = []
    table = pa.table({"k": pa.array(range(5000), pa.int64())})
    datasets = {"rows-1": table, "done-1": _Done("done-1", lambda: arrived.append(1))}
    with ServerThread(datasets, transport=transport) as server:
        before = accepted()
        path = Path(transport=transport, body="packed", memory=None, landing="host")
        where = {"uri": server.uri, "data_uri": server.data_uri}
        batches, report = _fetch(0, path, where, ["rows-1", "done-1"], 30)
        assert pa.Table.from_batches(batches).equals(table)
        assert report.rows == 5000 and arrived == [1]
        assert accepted() - before == 1


# -------------------------------------------------------------------------------------------- with Spark

N_ROWS = 3000  # per task


def _rows(index: int, device: bool) -> list[Any]:
    values = np.arange(index * N_ROWS, (index + 1) * N_ROWS)
    valid = values % 11 != 0
    batch = pa.record_batch(
        {
            "k": pa.array(values % 97, pa.int64()),
            "v": pa.array(values, pa.int64()),
            "f": pa.array(values / 7.0, pa.float64(), mask=~valid),
        }
    )
    halves = [batch.slice(0, N_ROWS // 2), batch.slice(N_ROWS // 2)]
    if not device:
        return halves
    from dissoc.device import DeviceBatch

    return [DeviceBatch.from_arrow(b) for b in halves]


def _task(choice: dict[str, Any], device: bool) -> Any:
    """What each task of the stage runs: exchange its rows, then report what it got and how."""

    def run(_: Iterator[Any]) -> Iterator[str]:
        import contextlib

        from pyspark import BarrierTaskContext

        import dissoc.spark
        from dissoc.memory.cuda import FakeDeviceBackend, use_backend

        me = BarrierTaskContext.get().partitionId()
        on_device = device or choice.get("landing") == "device"
        with use_backend(FakeDeviceBackend()) if on_device else contextlib.nullcontext():
            result = dissoc.spark.exchange(_rows(me, device), key="k", **choice)
            got = list(result)
            kinds = sorted({type(b).__name__ for b in got})
            host = [b.to_arrow() if not isinstance(b, pa.RecordBatch) else b for b in got]
        table = pa.Table.from_batches(host)
        yield json.dumps(
            {
                "me": me,
                "kinds": kinds,
                "v": table.column("v").to_pylist(),
                "k": table.column("k").to_pylist(),
                "f_nulls": table.column("f").null_count,
                "report": [r.as_dict() for r in result.report],
                "partitioned_on": result.partitioned_on,
                "rendezvous": result.rendezvous,
                "phases": sorted(result.seconds),
            }
        )

    return run


def _check(outputs: list[str], device_out: bool) -> list[dict[str, Any]]:
    from dissoc.spark import hash_partition

    results = sorted((json.loads(o) for o in outputs), key=lambda r: r["me"])
    assert [r["me"] for r in results] == [0, 1]
    everything = sorted(v for r in results for v in r["v"])
    assert everything == list(range(2 * N_ROWS))  # every row exactly once
    for r in results:
        assert r["kinds"] == (["DeviceBatch"] if device_out else ["RecordBatch"])
        keys = pa.record_batch({"k": pa.array(r["k"], pa.int64())})
        assert set(hash_partition(keys, "k", 2).tolist()) == {r["me"]}  # at the task its key hashes to
        assert r["f_nulls"] == sum(1 for v in r["v"] if v % 11 == 0)  # nulls travel
        (entry,) = r["report"]
        assert entry["peer"] == 1 - r["me"] and entry["rows"] == len(r["v"]) - entry_own(r)
    return results


def entry_own(r: dict[str, Any]) -> int:
    """Rows of a task's result that it kept from its own input (values in its own range)."""
    lo = r["me"] * N_ROWS
    return sum(1 for v in r["v"] if lo <= v < lo + N_ROWS)


def _session(master: str, app: str) -> Any:
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    import dissoc.spark

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config("spark.executorEnv.SPARK_LOCAL_IP", "127.0.0.1")
        .config("spark.driver.memory", "1g")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    dissoc.spark.register(session, check=True)
    return session


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One local[2] session for the module."""
    from pyspark import cloudpickle

    session = _session("local[2]", "dissoc-exchange-paths")
    try:
        yield session
    finally:
        session.stop()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _run(spark: Any, choice: dict[str, Any], device: bool) -> list[str]:
    rdd = spark.sparkContext.parallelize([0, 1], 2)
    return list(rdd.barrier().mapPartitions(_task(choice, device)).collect())


PATHS = [
    pytest.param({"transport": "tcp", "body": "packed"}, False, "tcp", id="tcp"),
    pytest.param({"body": "pairs", "memory": "shm"}, False, "tcp+pairs-shm", id="pairs-shm"),
    pytest.param({}, False, "tcp+pairs-shm", id="auto"),
    pytest.param({"transport": "ucx", "body": "packed"}, False, "ucx", id="ucx", marks=pytest.mark.ucx),
    pytest.param({}, True, "tcp+pairs-cuda->device", id="device-auto"),
    pytest.param({"body": "packed"}, True, "tcp->device", id="device-packed"),
    pytest.param(
        {"transport": "ucx", "body": "packed"}, True, "ucx->device", id="device-ucx", marks=pytest.mark.ucx
    ),
    pytest.param({"landing": "host"}, True, "tcp", id="device-to-host"),
    pytest.param({"landing": "device"}, False, "tcp->device", id="host-to-device"),
]


def _meeting_folders() -> set[str]:
    """The file rendezvous folders in /dev/shm now (other runs on this machine may have their own)."""
    return {p for p in os.listdir("/dev/shm") if p.startswith("dissoc-exchange-")}


@pytest.mark.spark
@pytest.mark.parametrize(("choice", "device", "path"), PATHS)
def test_exchange_path_in_local_mode(spark: Any, choice: dict[str, str], device: bool, path: str) -> None:
    device_out = choice.get("landing", "device" if device else "host") == "device"
    before = _meeting_folders()
    results = _check(_run(spark, choice, device), device_out)
    assert _meeting_folders() <= before
    for r in results:
        assert r["report"][0]["path"] == path
        assert r["partitioned_on"] == ("device" if device else "host")
        assert r["rendezvous"] == "files"  # local mode: one host
        assert set(r["phases"]) == {"partition", "serve", "swap", "fetch", "wait", "stop"}


@pytest.mark.spark
def test_exchange_through_spark_all_gather(spark: Any) -> None:
    before = _meeting_folders()
    results = _check(_run(spark, {"rendezvous": "allgather"}, False), False)
    assert {r["rendezvous"] for r in results} == {"allgather"}
    assert {r["report"][0]["path"] for r in results} == {"tcp+pairs-shm"}
    assert _meeting_folders() <= before


@pytest.mark.spark
def test_a_task_with_no_rows_and_no_schema_still_meets_its_peers(spark: Any) -> None:
    def run(_: Iterator[Any]) -> Iterator[str]:
        from pyspark import BarrierTaskContext

        import dissoc.spark

        me = BarrierTaskContext.get().partitionId()
        rows = _rows(me, False) if me == 0 else []
        result = dissoc.spark.exchange(rows, key="k")
        yield json.dumps({"me": me, "rows": sum(b.num_rows for b in result), "from": len(result.report)})

    before = _meeting_folders()
    rdd = spark.sparkContext.parallelize([0, 1], 2)
    got = sorted((json.loads(o) for o in rdd.barrier().mapPartitions(run).collect()), key=lambda r: r["me"])
    assert got[0]["rows"] + got[1]["rows"] == N_ROWS
    assert got[0]["from"] == 0 and got[1]["from"] == 1  # task 1 served nothing, task 0 did
    assert _meeting_folders() <= before  # both tasks removed their files, and the folder went


@pytest.mark.spark
def test_a_bad_choice_fails_the_stage_with_its_message(spark: Any) -> None:
    with pytest.raises(Exception, match="must be one of"):
        _run(spark, {"transport": "carrier-pigeon"}, False)


@pytest.mark.spark
def test_two_exchanges_in_one_stage_meet_apart(spark: Any) -> None:
    """Each call of a stage meets its own peers' call: the second does not read the first one's files."""

    def run(_: Iterator[Any]) -> Iterator[str]:
        from pyspark import BarrierTaskContext

        import dissoc.spark

        me = BarrierTaskContext.get().partitionId()
        first = sum(b.num_rows for b in dissoc.spark.exchange(_rows(me, False), key="k"))
        doubled = [b.append_column("w", pa.compute.multiply(b.column("v"), 2)) for b in _rows(me, False)]
        second = list(dissoc.spark.exchange(doubled, key="k"))
        yield json.dumps(
            {"first": first, "second": sum(b.num_rows for b in second), "cols": second[0].num_columns}
        )

    rdd = spark.sparkContext.parallelize([0, 1], 2)
    got = [json.loads(o) for o in rdd.barrier().mapPartitions(run).collect()]
    assert sum(r["first"] for r in got) == sum(r["second"] for r in got) == 2 * N_ROWS
    assert {r["cols"] for r in got} == {4}


@pytest.mark.spark
@pytest.mark.slow
def test_exchange_between_two_executor_processes(spark: Any) -> None:
    """local-cluster: two executor JVMs; the tasks' Python workers are children of different executors.

    Last in the module: it stops the module's local session (one SparkContext per process)."""
    spark.stop()  # one SparkContext per process
    cluster = _session("local-cluster[2,1,1024]", "dissoc-exchange-cluster")
    try:

        def where(_: Iterator[Any]) -> Iterator[str]:
            from pyspark import BarrierTaskContext

            context = BarrierTaskContext.get()
            yield json.dumps({"me": context.partitionId(), "pid": os.getppid()})

        rdd = cluster.sparkContext.parallelize([0, 1], 2)
        parents = {json.loads(o)["pid"] for o in rdd.barrier().mapPartitions(where).collect()}
        assert len(parents) == 2  # two executors' daemons, not one
        for device, path in ((False, "tcp+pairs-shm"), (True, "tcp+pairs-cuda->device")):
            results = _check(_run(cluster, {}, device), device)
            assert {r["report"][0]["path"] for r in results} == {path}
    finally:
        cluster.stop()
