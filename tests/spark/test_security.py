"""dissoc.spark against servers with a secret, in a real local Spark 4 session (local[2], one per module).

The data source passes ``.option("token", ...)`` through: reading listed endpoints (combined and split) and
through a Flight control plane (``dissoc serve --secret-file --flight``), writing with a write token and
reading the write back; without the token both are refused. The barrier exchange's servers serve only the
tickets their own task hands out (checked without Spark too, on the exchange's server itself).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq
import pytest
from helpers.e2e import ServerThread, cli_server, ordered_table

from dissoc.errors import RemoteError
from dissoc.tokens import Secret

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning"),
]
spark_only = pytest.mark.spark

KEY = b"spark-tests-secret-0123456789abc"
SECRET = Secret(KEY)


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One local[2] session for the module; stopped at the end."""
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    import dissoc.spark

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    session = (
        SparkSession.builder.master("local[2]")
        .appName("dissoc-security-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.driver.memory", "1g")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    dissoc.spark.register(session, check=True)
    try:
        yield session
    finally:
        session.stop()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def secured_flight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, pa.Table]]:
    """``dissoc serve --secret-file F --flight 0`` serving ``ordered.parquet``: (location, table)."""
    pytest.importorskip("pyarrow.flight")
    root = tmp_path_factory.mktemp("spark-secured")
    secret_file = root / "secret"
    secret_file.write_bytes(KEY)
    secret_file.chmod(0o600)
    table = ordered_table(4, 250)
    path = root / "ordered.parquet"
    pq.write_table(table, path, row_group_size=250)
    with cli_server(str(path), "--flight", "0", "--secret-file", str(secret_file), count=1) as (_p, lines):
        yield lines[0]["flight"], pq.read_table(path)


# --------------------------------------------------------------------------------------------------- reading


@spark_only
@pytest.mark.parametrize("split", [False, True], ids=["combined", "split"])
def test_read_listed_endpoints_with_signed_tickets(spark: Any, split: bool) -> None:
    table = ordered_table(3, 100)
    with ServerThread({"a": table}, split=split, secret=SECRET) as server:
        signed = json.dumps([[server.uri, server.data_uri, SECRET.mint("a")]])
        df = spark.read.format("dissoc").option("endpoints", signed).load()
        assert sorted(r.id for r in df.collect()) == list(range(300))
        # the name in the endpoints and the token as an option
        named = json.dumps([[server.uri, server.data_uri, "a"]])
        df = spark.read.format("dissoc").option("endpoints", named).option("token", SECRET.mint("a")).load()
        assert df.count() == 300
        # the name alone is refused (already on the driver, reading the schema)
        with pytest.raises(Exception, match="unauthorized"):
            spark.read.format("dissoc").option("endpoints", named).load().count()


@spark_only
def test_read_through_a_secured_flight_location(spark: Any, secured_flight: tuple[str, pa.Table]) -> None:
    location, table = secured_flight
    token = SECRET.mint("ordered")
    df = spark.read.format("dissoc").option("location", location).option("token", token).load("ordered")
    got = df.toArrow()
    assert got.sort_by("id").column("id").to_pylist() == table.column("id").to_pylist()
    with pytest.raises(Exception, match="unauthenticated"):
        spark.read.format("dissoc").option("location", location).load("ordered").count()
    # a token for another dataset does not open this one
    with pytest.raises(Exception, match="unauthorized"):
        spark.read.format("dissoc").option("location", location).option("token", SECRET.mint("x")).load(
            "ordered"
        ).count()


@pytest.fixture(scope="module")
def tls_flight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, pa.Table, Any]]:
    """``dissoc serve --secret-file F --flight 0`` with mutual TLS (server, data ports and the control plane):
    (``grpc+tls://`` location, table, the certificates)."""
    pytest.importorskip("pyarrow.flight")
    pytest.importorskip("cryptography")
    from helpers.tls import make_certs

    root = tmp_path_factory.mktemp("spark-tls")
    certs = make_certs(tmp_path_factory.mktemp("spark-tls-certs"))
    secret_file = root / "secret"
    secret_file.write_bytes(KEY)
    secret_file.chmod(0o600)
    table = ordered_table(2, 200)
    path = root / "ordered.parquet"
    pq.write_table(table, path, row_group_size=200)
    tls = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    tls += ["--tls-client-ca", str(certs.ca)]
    with cli_server(str(path), "--flight", "0", "--secret-file", str(secret_file), *tls, count=1) as (
        _p,
        lines,
    ):
        assert lines[0]["flight"].startswith("grpc+tls://") and lines[0]["uri"].startswith("tls://")
        yield lines[0]["flight"], pq.read_table(path), certs


@spark_only
def test_read_through_tls_with_a_token_and_a_client_certificate(
    spark: Any, tls_flight: tuple[str, pa.Table, Any]
) -> None:
    """The ``tls_ca`` / ``tls_cert`` / ``tls_key`` options reach the control plane and every executor's
    stream (both over mutual TLS); without the client certificate the plane refuses."""
    location, table, certs = tls_flight
    token = SECRET.mint("ordered")

    def reader(with_cert: bool) -> Any:
        r = spark.read.format("dissoc").option("location", location).option("token", token)
        r = r.option("tls_ca", str(certs.ca))
        if with_cert:
            r = r.option("tls_cert", str(certs.client_cert)).option("tls_key", str(certs.client_key))
        return r

    got = reader(True).load("ordered").toArrow()
    assert got.sort_by("id").column("id").to_pylist() == table.column("id").to_pylist()
    with pytest.raises(Exception):  # noqa: B017 - gRPC's TLS failure is not one dissoc error type
        reader(False).load("ordered").count()


# --------------------------------------------------------------------------------------------------- writing


@spark_only
def test_write_with_a_write_token_and_read_it_back(spark: Any, secured_flight: tuple[str, pa.Table]) -> None:
    import dissoc
    import dissoc.spark

    location, _ = secured_flight
    df = spark.range(0, 600, numPartitions=3).selectExpr("id", "cast(id as string) as s")
    # a read token cannot write
    with pytest.raises(Exception, match="unauthorized"):
        df.write.format("dissoc").option("location", location).option("token", SECRET.mint("out")).mode(
            "append"
        ).save("out")
    write = SECRET.mint("out", scope="write")
    df.write.format("dissoc").option("location", location).option("token", write).mode("append").save("out")

    read = SECRET.mint("out")  # grants "out" and its partitions "out/JOB/P.A"
    parts = dissoc.spark.last_write(location, "out", access=dissoc.spark.Access(token=read))
    assert [p.partition for p in parts] == [0, 1, 2] and sum(p.rows for p in parts) == 600
    # the manifest holds names; over dissoc each part needs a signed ticket, which the plane makes
    with pytest.raises(RemoteError, match="unauthorized"):
        dissoc.fetch(parts[0].uri, parts[0].ticket, data_uri=parts[0].data_uri)
    (uri, data_uri, ticket), *_ = dissoc.flight.resolve(location, parts[0].ticket, token=read)
    assert dissoc.fetch(uri, ticket, data_uri=data_uri).num_rows == parts[0].rows

    back = spark.read.format("dissoc").option("location", location).option("token", read).load("out")
    assert back.rdd.getNumPartitions() == 3
    assert sorted(r.id for r in back.collect()) == list(range(600))


# -------------------------------------------------------------------------------------------------- exchange


def test_an_exchange_server_serves_only_the_tickets_its_task_minted() -> None:
    """No Spark needed: the exchange's own server thread, with the stage secret of its task."""
    import dissoc
    from dissoc.spark._exchange import _ServerThread

    secret = Secret.generate()
    table = ordered_table(1, 10)
    server = _ServerThread({"to-1": table}, "127.0.0.1", 0, secret)
    server.start(10)
    try:
        assert dissoc.fetch(server.uri, secret.mint("to-1"), data_uri=server.data_uri).equals(table)
        for outsider in (
            "to-1",
            Secret.generate().mint("to-1"),
            secret.mint("to-1", expires=int(time.time()) - 1),
        ):
            with pytest.raises(RemoteError) as refused:
                dissoc.fetch(server.uri, outsider, data_uri=server.data_uri)
            assert refused.value.code == "unauthorized"
    finally:
        server.stop(10)


@spark_only
def test_barrier_exchange_with_stage_secrets(spark: Any) -> None:
    """The exchange, now over servers with secrets: every row still reaches the task its key hashes to."""
    import dissoc.spark

    def make(index: int, _: Iterator[Any]) -> Iterator[pa.RecordBatch]:
        values = pa.array(range(index * 200, index * 200 + 200), pa.int64())
        yield pa.record_batch({"k": pa.compute.bit_wise_and(values, 7), "v": values})

    def route(batches: Iterator[pa.RecordBatch]) -> Iterator[list[int]]:
        yield [v for b in dissoc.spark.exchange(batches, key="k") for v in b.column("v").to_pylist()]

    rdd = spark.sparkContext.parallelize([0, 1], 2).mapPartitionsWithIndex(make)
    received = rdd.barrier().mapPartitions(route).collect()
    assert len(received) == 2 and sorted(received[0] + received[1]) == list(range(400))
    assert received[0] and received[1]  # both tasks got rows
