"""A PySpark driver in a cluster host, against a Spark standalone master, driven by JSON lines on stdin.

    python tests/cluster/spark_driver.py MASTER_URL DRIVER_ADDRESS

Prints ``{"ready": true, "executors": N}`` once the session has its executors, then answers each command:

- ``{"op": "read", "location": L, "name": N}``: ``spark.read.format("dissoc")`` of a dataset of a Flight
  plane: ``{"rows", "sum", "partitions"}``;
- ``{"op": "write", "location": L, "name": N, "rows": R}``: write ``R`` rows there, read them back:
  ``{"rows", "sum"}``;
- ``{"op": "exchange", "rows": R, "pause": S}``: a barrier stage of 2 tasks, each exchanging ``R`` rows by
  key with ``dissoc.spark.exchange`` (``pause`` seconds before it, printing ``{"event": "exchanging"}`` when
  the stage starts, so that a test can kill a worker meanwhile): every task's rows, paths, rendezvous and
  host, and how many attempts the stage took.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def exchange_task(rows: int, pause: float) -> Any:
    def run(_: Iterator[Any]) -> Iterator[str]:
        import numpy as np
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        import dissoc.spark

        context = BarrierTaskContext.get()
        me = context.partitionId()
        values = np.arange(me * rows, (me + 1) * rows, dtype=np.int64)
        batch = pa.record_batch({"k": pa.array(values % 101), "v": pa.array(values)})
        time.sleep(pause)
        result = dissoc.spark.exchange([batch], key="k")
        got = pa.Table.from_batches(list(result), schema=batch.schema) if result.report else None
        v = got.column("v").to_pylist() if got is not None else []
        keys = pa.record_batch({"k": pa.array([x % 101 for x in v], pa.int64())})
        mine = set(dissoc.spark.hash_partition(keys, "k", 2).tolist()) if v else {me}
        yield json.dumps(
            {
                "me": me,
                "attempt": context.taskAttemptId(),
                "v": v,
                "mine": sorted(mine) == [me],
                "paths": sorted({r.as_dict()["path"] for r in result.report}),
                "rendezvous": result.rendezvous,
                "host": os.environ.get("SPARK_LOCAL_IP"),
            }
        )

    return run


def main() -> None:
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    import dissoc.spark

    master, address = sys.argv[1], sys.argv[2]
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    python = sys.executable
    spark = (
        SparkSession.builder.master(master)
        .appName("dissoc-cluster")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", address)
        .config("spark.driver.bindAddress", address)
        .config("spark.driver.memory", "512m")
        .config("spark.executor.memory", "512m")
        .config("spark.executor.cores", "2")
        .config("spark.cores.max", "4")
        .config("spark.pyspark.python", python)
        .config("spark.executorEnv.PYTHONPATH", str(REPO))
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.task.maxFailures", "2")
        .config("spark.network.timeout", "20s")
        .config("spark.network.timeoutInterval", "10s")
        .config("spark.executor.heartbeatInterval", "2s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    dissoc.spark.register(spark, check=True)
    sc = spark.sparkContext
    deadline = time.monotonic() + 90
    while sc._jsc.sc().getExecutorMemoryStatus().size() < 3 and time.monotonic() < deadline:  # 2 + the driver
        time.sleep(0.2)
    say({"ready": True, "executors": sc._jsc.sc().getExecutorMemoryStatus().size() - 1})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "stop":
            break
        try:
            if op == "read":
                df = spark.read.format("dissoc").option("location", cmd["location"]).load(cmd["name"])
                row = df.selectExpr("count(*) as n", "sum(id) as s").collect()[0]
                say({"rows": row["n"], "sum": row["s"], "partitions": df.rdd.getNumPartitions()})
            elif op == "write":
                df = spark.range(cmd["rows"], numPartitions=2).selectExpr("id", "id * 2 as twice")
                df.write.format("dissoc").option("location", cmd["location"]).mode("append").save(cmd["name"])
                back = spark.read.format("dissoc").option("location", cmd["location"]).load(cmd["name"])
                row = back.selectExpr("count(*) as n", "sum(id) as s").collect()[0]
                say({"rows": row["n"], "sum": row["s"]})
            elif op == "exchange":
                rdd = sc.parallelize([0, 1], 2)
                say({"event": "exchanging"})
                # A shuffle after the barrier stage makes it a map stage, which Spark retries whole when a
                # task fails (a failed barrier result stage is not retried).
                stage = rdd.barrier().mapPartitions(exchange_task(cmd["rows"], cmd.get("pause", 0)))
                out = stage.repartition(1).collect()
                say({"tasks": [json.loads(o) for o in out]})
        except Exception as e:
            text = str(e)
            say({"error": type(e).__name__, "message": text[:1500] + " ... " + text[-500:]})
    spark.stop()


if __name__ == "__main__":
    main()
