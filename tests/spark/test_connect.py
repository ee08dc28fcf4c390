"""dissoc.spark from a Spark Connect client, against a real Spark Connect server started once for the module.

The server is PySpark's own (``spark-submit --class ...SparkConnectServer``, ``local[2]``, every port on
127.0.0.1) run as a child of this process, with ``PYSPARK_PYTHON`` set to this interpreter and this checkout
first on ``PYTHONPATH`` so that its Python workers import the dissoc under test; it is stopped, with its
workers, when the module ends. Through a ``SparkSession.builder.remote`` session: ``register`` leaves the
workers' Python to the server, ``check_workers`` runs over the DataFrame API (and says what to set when the
workers miss a module), the data source reads a dataset of a ``dissoc serve --flight`` subprocess and the
writer publishes partitions and a manifest that the client and the reader can use.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.e2e import REPO, cli_server

from dissoc.errors import DissocError

pytestmark = [
    pytest.mark.spark,
    pytest.mark.timeout(240),
    # PySpark's own notice when pandas 3 is installed (the Connect client needs pandas)
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
]

#: Seconds the server may take to start (about 10 on two busy cores) and to stop before it is killed.
START_TIMEOUT = 120.0
STOP_TIMEOUT = 20.0

# Spark's own logging, quieted: warnings and the line saying where the server listens (read below).
LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n%ex
logger.connect.name = org.apache.spark.sql.connect.service.SparkConnectServer
logger.connect.level = info
"""
_STARTED = re.compile(r"Spark Connect server started at: \S*:(\d+)")


# ------------------------------------------------------------------------------------------ the server


def _pyspark_home() -> Path:
    """The pip PySpark's folder (its bin/spark-submit and jars/), after checking it has Connect's server."""
    import pyspark

    home = Path(pyspark.__file__).parent
    if not list((home / "jars").glob("spark-connect_*.jar")):
        pytest.skip(
            f"PySpark {pyspark.__version__} here has no Spark Connect server (jars/spark-connect_*.jar)"
        )
    return home


def _descendants(pid: int) -> list[tuple[int, bytes]]:
    """The processes below ``pid`` (pid, command line), read from /proc; empty where there is none."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            found.append((child, Path(f"/proc/{child}/cmdline").read_bytes()))
        except OSError:
            continue
        todo += children.get(child, [])
    return found


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server (SIGTERM: Spark stops its context and Python workers), killing its process group if it
    lingers, then any worker still running under the command line it had."""
    workers = _descendants(proc.pid)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    for pid, cmdline in workers:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # already gone


def _wait_started(proc: subprocess.Popen[bytes], log: Path) -> int:
    """The port the server says it listens on, once it does."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        found = _STARTED.search(text)
        if found:
            return int(found[1])
        if proc.poll() is not None:
            pytest.fail(f"the Spark Connect server exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"the Spark Connect server did not start in {START_TIMEOUT:.0f} s:\n{text[-4000:]}")


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``sc://127.0.0.1:PORT`` of a Spark Connect server whose workers import this checkout's dissoc."""
    try:
        import pyspark.sql.connect.session  # noqa: F401  (checks the client's packages)
    except ImportError as e:
        pytest.skip(f"the Spark Connect client is missing a package ({e}): pip install 'pyspark[connect]'")
    home = _pyspark_home()
    root = tmp_path_factory.mktemp("spark-connect")
    (root / "log4j2.properties").write_text(LOG4J2)
    log = root / "server.log"
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    command = [
        str(home / "bin" / "spark-submit"),
        "--class",
        "org.apache.spark.sql.connect.service.SparkConnectServer",
        "--name",
        "dissoc-connect-tests",
        "--master",
        "local[2]",
        "--driver-memory",
        "1g",
        "--driver-java-options",
        f"-Dlog4j2.configurationFile=file:{root / 'log4j2.properties'}",
        *("--conf", "spark.connect.grpc.binding.address=127.0.0.1"),
        *("--conf", "spark.connect.grpc.binding.port=0"),
        *("--conf", "spark.driver.host=127.0.0.1"),
        *("--conf", "spark.driver.bindAddress=127.0.0.1"),
        *("--conf", "spark.ui.enabled=false"),
        *("--conf", "spark.sql.session.timeZone=UTC"),
        *("--conf", "spark.sql.shuffle.partitions=2"),
        *("--conf", "spark.default.parallelism=2"),
    ]
    with log.open("wb") as err:
        proc = subprocess.Popen(
            command,
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            start_new_session=True,
        )
    try:
        yield f"sc://127.0.0.1:{_wait_started(proc, log)}"
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def spark(connect_url: str) -> Iterator[Any]:
    """A Spark Connect session with the data source registered; stopped at the end. Creating a remote session
    marks the whole process as Spark Connect (``SPARK_CONNECT_MODE_ENABLED``, which stopping it leaves set):
    the mark is taken back so that later modules get classic sessions."""
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    import dissoc.spark

    # Functions defined here run in the server's Python workers, which cannot import this test module.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SPARK_CONNECT_MODE_ENABLED", "1")  # what getOrCreate sets; undone on leaving
        session = SparkSession.builder.remote(connect_url).getOrCreate()
        try:
            assert dissoc.spark._is_connect(session)
            dissoc.spark.register(session)
            yield session
        finally:
            session.stop()
            cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def flight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, pa.Table]]:
    """``dissoc serve --flight 0`` serving ``people.parquet`` (ticket ``people``): (location, table)."""
    pytest.importorskip("pyarrow.flight")
    root = tmp_path_factory.mktemp("connect-flight")
    n = 600
    table = pa.table(
        {
            "id": pa.array(range(n), pa.int64()),
            "name": pa.array([f"n{i}" if i % 7 else None for i in range(n)], pa.string()),
            "score": pa.array([i / 4 for i in range(n)], pa.float64()),
        }
    )
    path = root / "people.parquet"
    pq.write_table(table, path, row_group_size=200)
    with cli_server(str(path), "--flight", "0", count=1) as (_proc, lines):
        yield lines[0]["flight"], pq.read_table(path)


# ------------------------------------------------------------------------------------ registering, checking


def test_register_leaves_the_workers_python_to_the_server(
    spark: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import dissoc.spark

    with caplog.at_level(logging.INFO, logger="dissoc.spark"):
        dissoc.spark.register(spark)  # a Connect session has no sparkContext: this must not touch it
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "Spark Connect session" in said and "PYSPARK_PYTHON" in said
    assert "registered the dissoc data source" in said


def test_check_workers_returns_the_servers_interpreter(spark: Any) -> None:
    import dissoc.spark

    assert dissoc.spark.check_workers(spark) == [(sys.executable, dissoc.__version__)]


def test_check_workers_says_what_to_set_when_the_workers_miss_a_module(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe, swapped for one from a module only this process can import, fails in the server's workers as
    a probe of dissoc fails where dissoc is not installed."""
    import dissoc.spark

    name = f"dissoc_client_only_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text("def probe(batches):\n    yield from batches\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    # the function Connect's probe runs, pickled by reference: the worker imports its module
    monkeypatch.setattr(dissoc.spark, "_probe_batches", module.probe)
    with pytest.raises(DissocError, match="Spark Connect server's Python workers") as raised:
        dissoc.spark.check_workers(spark)
    assert f"No module named '{name}'" in str(raised.value)
    assert "PYSPARK_PYTHON" in str(raised.value) and "spark.pyspark.python" in str(raised.value)


# ------------------------------------------------------------------------------------ reading and writing


def test_read_through_a_flight_location(spark: Any, flight_server: tuple[str, pa.Table]) -> None:
    location, table = flight_server
    df = spark.read.format("dissoc").option("location", location).load("people")
    assert df.schema.simpleString() == "struct<id:bigint,name:string,score:double>"
    got = df.toArrow().sort_by("id")
    assert got.to_pydict() == table.to_pydict()
    assert got.schema.equals(table.schema)


def test_write_publishes_a_manifest_the_client_and_the_reader_use(
    spark: Any, flight_server: tuple[str, pa.Table]
) -> None:
    import dissoc.spark

    location, _ = flight_server
    df = spark.range(0, 500, numPartitions=2).selectExpr("id", "cast(id * 3 as string) as s")
    df.write.format("dissoc").option("location", location).mode("append").save("out")

    parts = dissoc.spark.last_write(location, "out")  # asked from this client, not through Spark
    assert [p.partition for p in parts] == [0, 1]
    assert sum(p.rows for p in parts) == 500
    fetched = pa.concat_tables([dissoc.fetch(p.uri, p.ticket, data_uri=p.data_uri) for p in parts])
    expected = {"id": list(range(500)), "s": [str(i * 3) for i in range(500)]}
    assert fetched.sort_by("id").to_pydict() == expected

    back = spark.read.format("dissoc").option("location", location).load("out")
    assert back.schema == df.schema
    assert back.toArrow().sort_by("id").to_pydict() == expected


# ------------------------------------------------------------------------------------------------ exchange


def _route(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Exchange by key, then tag each received row with the task that received it."""
    from pyspark import TaskContext

    import dissoc.spark

    context = TaskContext.get()
    assert context is not None
    me = context.partitionId()
    for batch in dissoc.spark.exchange(batches, key="k"):
        yield batch.append_column("task", pa.array([me] * batch.num_rows, pa.int32()))


def test_barrier_exchange_in_map_in_arrow(spark: Any) -> None:
    """Connect has no RDDs, but ``mapInArrow(..., barrier=True)`` runs the exchange as in classic Spark."""
    import dissoc.spark

    df = spark.range(0, 4000, numPartitions=2).selectExpr("id % 97 as k", "id as v")
    out = df.mapInArrow(_route, "k long, v long, task int", barrier=True).toArrow()
    assert sorted(out.column("v").to_pylist()) == list(range(4000))  # every row exactly once
    combined = out.combine_chunks().to_batches()[0]
    expected = dissoc.spark.hash_partition(combined, "k", 2)
    assert combined.column("task").to_pylist() == expected.tolist()  # each row at its key's task
    assert set(expected.tolist()) == {0, 1}
