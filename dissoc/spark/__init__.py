"""dissoc for Apache Spark 4: a Python Data Source (``format("dissoc")``) and a barrier-stage exchange.

Install with ``pip install 'dissoc[spark]'`` (PySpark 4 and Java 17). Importing this package never needs
pyspark; the functions that do raise a :class:`~dissoc.errors.DissocError` naming the extra when it is
missing.

**Registering.** ``dissoc.spark.register(spark)`` registers the data source with a session. Spark runs
data source code in separate Python worker processes, which must be able to ``import dissoc``: in local mode,
when neither ``PYSPARK_PYTHON`` nor ``spark.pyspark.python`` is set, ``register`` makes the workers use the
driver's own interpreter (``sys.executable``); elsewhere point ``PYSPARK_PYTHON`` (or
``spark.pyspark.python``) at an environment with ``dissoc[spark]`` installed on every executor.
``register(spark, check=True)`` runs a tiny job that proves the workers can import dissoc (and raises a
DissocError saying what to set if they cannot).

**Spark Connect.** With a ``SparkSession.builder.remote("sc://...")`` session everything below works the
same (the exchange in ``mapInArrow(..., barrier=True)``: Connect has no RDDs), but the workers are the
Connect server's: ``register`` leaves their Python to the server (start it with ``PYSPARK_PYTHON`` or
``spark.pyspark.python`` naming an interpreter with dissoc[spark]) and says so at INFO; the check probes them
through ``spark.range(...).mapInArrow``. Options (locations, TLS files) are read where the server runs;
:func:`written` and :func:`last_write` run in the client.

**Reading** — one Spark partition per dissoc stream; each task reads its stream with the dissoc client::

    dissoc.spark.register(spark)
    # through a Flight control plane (dissoc serve --flight PORT ...): one partition per FlightEndpoint
    df = spark.read.format("dissoc").option("location", "grpc://HOST:PORT").load("trips")
    # or listed streams, directly: one partition per entry (data_uri may be null: same as uri)
    df = spark.read.format("dissoc").option("endpoints", json.dumps([[uri, data_uri, "trips"], ...])).load()

The schema is fetched on the driver (GetFlightInfo, or the first stream's schema message) and converted with
:func:`spark_schema`; every batch is cast to exactly the Arrow schema PySpark expects (:func:`conform`):
``large_string``/``string_view`` -> string, large/fixed-size/view binaries -> binary, ``uint8/16/32`` ->
``short/int/long``, ``uint64`` -> ``decimal(20,0)``, dictionaries -> their values, timestamps with a zone ->
``timestamp`` (UTC, microseconds), without -> ``timestamp_ntz``, durations -> ``interval day to second``,
``date64`` -> date, float16 -> float, time32/time64 -> ``time`` (PySpark 4.1 or later), every list kind ->
array, maps, structs, null -> void (nullability as in Arrow).
Nanoseconds are truncated to microseconds. Unions, month-day-nano intervals and decimals wider than 38
digits are refused with a :class:`SparkTypeError`. Options: ``timeout`` (seconds of silence tolerated,
default 30), ``validate`` (``false`` skips the decoder's content checks, for trusted servers), ``token`` (a
signed ticket, :mod:`dissoc.tokens`, for servers started with a secret: the control plane's bearer token,
and in place of listed endpoints' names; writing needs one of scope ``write``), ``tls_ca`` / ``tls_cert`` /
``tls_key`` (PEM files on every executor, for ``tls://`` servers and ``grpc+tls://`` control planes: the CA
bundle, and the client certificate for servers that require one; :class:`Access` holds the same for
:func:`written` and :func:`last_write`).

**Writing** — each task publishes its partition to a running ``dissoc serve --flight`` through Flight DoPut::

    df.write.format("dissoc").option("location", "grpc://HOST:PORT").mode("append").save("trips")
    parts = dissoc.spark.last_write("grpc://HOST:PORT", "trips")      # [WrittenPart(uri, ticket, ...)]
    table = dissoc.fetch(parts[0].uri, parts[0].ticket, data_uri=parts[0].data_uri)
    df2 = spark.read.format("dissoc").option("location", "grpc://HOST:PORT").load("trips")   # reads it back

Use ``mode("append")`` or ``mode("overwrite")`` (Spark refuses its default ``errorifexists`` for Python
data sources). Partition ``P``'s attempt ``A`` of write job ``J`` (a random id made on the driver) is served
as ``trips/J/PPPPP.A``. On commit the driver publishes ``trips`` itself as a *manifest*: a small table, one
row per committed partition (``job, partition, attempt, uri, data_uri, ticket, rows``), holding every job
appended under that name (``mode("overwrite")`` replaces the earlier jobs' rows and removes their
partitions); then it removes every other dataset of the job (failed or speculative attempts). An attempt
that publishes after its job committed finds the job in the manifest and removes its own dataset. A task
that fails removes what it published; an aborted job removes everything it published, and again after
``cleanupGrace`` seconds (option, default 3: Spark kills a task's Python worker within
``spark.python.task.killTimeout``). :func:`written` returns every row of the manifest, :func:`last_write`
the last job's; any dissoc client can fetch the manifest and then the parts, and
``spark.read.format("dissoc")`` given the name reads the listed parts. Writing ``trips`` fails early when
``trips`` is served as a plain dataset, or, in append mode, when its data have another schema. A partition
is gathered in the task before it is sent (a task failing upstream publishes nothing), and the server keeps
every published dataset in memory. Two jobs committing under one name at the same moment may lose one's
manifest rows (its parts stay served): give concurrent writers different names.

**Structured Streaming** — both ends of a live stream (:mod:`dissoc.datasets.live`, served with ``dissoc
serve --flight PORT --live NAME`` or ``server.publish(NAME)``)::

    q = (spark.readStream.format("dissoc").option("location", "grpc://HOST:PORT").load("events")
         .writeStream.format("dissoc").option("location", "grpc://HOST:PORT")
         .option("checkpointLocation", "/ckpt/events-out").start("events_out"))

The source's offsets are the stream's batch offsets (``{"offset": N}``): ``startingOffsets`` (``earliest``,
the default, ``latest`` or a number) for a new query, the checkpoint's after a restart;
``maxBatchesPerTrigger`` caps a micro-batch, ``maxPartitions`` (1) splits it into contiguous ranges, one task
each, and ``trigger(availableNow=True)`` stops at the head it found. Offsets the server no longer holds fail
the query with ``fell_behind``, naming the first offset held. The sink is exactly once: each task stages its
partition as ``NAME/_stream/QUERY/BATCH/...``; the driver's commit appends the micro-batch's staged data to
the stream in one upload, at most once per (``spark:QUERY``, batch id), and removes what was staged. See
:mod:`dissoc.spark._streaming` and the Spark guide.

**Exchanging between executors** — :func:`exchange` inside a barrier stage::

    rdd.barrier().mapPartitions(lambda it: dissoc.spark.exchange(it, key="k"))  # RDD of pyarrow batches
    df.mapInArrow(lambda it: dissoc.spark.exchange(it, key="k"), df.schema, barrier=True)  # needs pandas

Each task starts dissoc servers serving one bucket of its rows per peer (one per path its peers may take:
pairs in shared memory on one node, UCX or TCP elsewhere), swaps URIs with the others (files in
``/dev/shm`` on one host, ``BarrierTaskContext.allGather`` otherwise), fetches its buckets from every peer,
tells each it is done, shuts its servers down once every peer has told it the same, and returns its rows.
``key`` hash-partitions by column(s) (equal keys meet in one task); ``partitioner(batch, n)`` gives
destinations explicitly; neither sends every row to every task. Servers bind to ``host`` if given, else
``$DISSOC_SPARK_HOST``, else 127.0.0.1 when all tasks share one host (local mode), else the executor's host
as Spark reports it.

**Spark's constraints.** Python workers exit after about a minute idle and Spark decides where and when
they run, so dissoc never leaves a server inside a worker: the reader and writer are clients (the data lives
in a long-running ``dissoc serve``), and an exchange server lives no longer than its barrier stage.
Barrier stages need as many free task slots as tasks (for ``local[N]``, at most N partitions).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from dissoc.errors import DissocError
from dissoc.spark._errors import SparkTypeError
from dissoc.spark._manifest import Access, WrittenPart, last_write, written

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from pyspark.sql import SparkSession
    from pyspark.sql.types import DataType, StructType

    from dissoc.spark._exchange import ExchangeResult, Partitioner

__all__ = [
    "SparkTypeError",
    "WrittenPart",
    "check_workers",
    "conform",
    "exchange",
    "hash_partition",
    "Access",
    "last_write",
    "register",
    "spark_schema",
    "spark_type",
    "written",
]

log = logging.getLogger(__name__)

MIN_PYSPARK = (4, 0)


def require_pyspark() -> None:
    """Raise a DissocError naming the ``spark`` extra unless PySpark 4 or later is importable."""
    try:
        import pyspark
    except ImportError as e:
        raise DissocError(
            f"dissoc.spark needs PySpark 4 and Java 17: pip install 'dissoc[spark]' ({e})"
        ) from None
    version = tuple(int(p) for p in pyspark.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_PYSPARK:
        raise DissocError(
            f"dissoc.spark needs PySpark >= 4.0 (the Python Data Source API), found {pyspark.__version__}: "
            "pip install 'dissoc[spark]'"
        )


def _configured_python(spark: SparkSession) -> str | None:
    """The Python the user asked workers to run, if any (environment or Spark configuration)."""
    value = spark.sparkContext.getConf().get("spark.pyspark.python")
    return str(value) if value else os.environ.get("PYSPARK_PYTHON") or None


def _set_worker_python(spark: SparkSession) -> None:
    """Make sure the workers run a Python that can import dissoc (see the module docstring)."""
    sc = spark.sparkContext
    configured = _configured_python(spark)
    current = getattr(sc, "pythonExec", None)
    if configured:
        if current != configured:
            log.info("Python workers: using %s (configured), not %s", configured, current)
            sc.pythonExec = configured
        return
    if str(sc.master).startswith("local"):
        if current != sys.executable:
            log.info("Python workers (local mode): using the driver's interpreter %s", sys.executable)
            sc.pythonExec = sys.executable
        return
    log.warning(
        "Python workers will run %r from each executor's PATH; it must have dissoc[spark] installed. Set "
        "PYSPARK_PYTHON or spark.pyspark.python to choose the interpreter (dissoc.spark.check_workers(spark) "
        "checks).",
        current,
    )


def _is_connect(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect session (told by its class: imports nothing Connect-only)."""
    return type(spark).__module__.startswith("pyspark.sql.connect.")


def register(spark: SparkSession, *, check: bool = False) -> None:
    """Register the ``dissoc`` data source with ``spark`` (and choose the workers' Python, see above).

    With ``check=True`` also run :func:`check_workers`.
    """
    require_pyspark()
    from dissoc.spark._source import DissocDataSource

    if _is_connect(spark):
        log.info(
            "Spark Connect session: the Python workers are the Connect server's, which chooses their "
            "interpreter (PYSPARK_PYTHON or spark.pyspark.python where the server starts); it must have "
            "dissoc[spark] installed (dissoc.spark.check_workers(spark) checks)"
        )
    else:
        _set_worker_python(spark)
    spark.dataSource.register(DissocDataSource)
    log.info("registered the dissoc data source")
    if check:
        check_workers(spark)


def _probe(_: object) -> tuple[str, str]:
    import dissoc

    return sys.executable, dissoc.__version__


def _probe_batches(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """:func:`_probe` as a ``mapInArrow`` function: one row per partition."""
    for _ in batches:
        pass
    python, version = _probe(None)
    yield pa.record_batch({"python": [python], "version": [version]})


#: Rows of the Connect probe's ``spark.range``, which Spark splits into its default parallelism.
_CONNECT_PROBE_ROWS = 1024
_PROBE_SCHEMA = "python string, version string"


def _probe_workers(spark: SparkSession) -> list[tuple[str, str]]:
    """Run :func:`_probe` on every default task slot: through the RDD API in a classic session, through a
    ``mapInArrow`` DataFrame over Spark Connect (which has no RDDs)."""
    if _is_connect(spark):
        probed = spark.range(0, _CONNECT_PROBE_ROWS).mapInArrow(_probe_batches, _PROBE_SCHEMA)
        return sorted({(str(r.python), str(r.version)) for r in probed.collect()})
    sc = spark.sparkContext
    slots = max(1, int(sc.defaultParallelism))
    return sorted(set(sc.parallelize(range(slots), slots).map(_probe).collect()))


def check_workers(spark: SparkSession) -> list[tuple[str, str]]:
    """Run a tiny job proving the Python workers can import dissoc; returns ``(python, dissoc version)``s.

    Works with classic and Spark Connect sessions. Raises DissocError, saying what to configure, when they
    cannot.
    """
    require_pyspark()
    try:
        found = _probe_workers(spark)
    except Exception as e:
        text = str(e)
        if "No module named 'dissoc'" in text or "ModuleNotFoundError" in text:
            if _is_connect(spark):
                missing = re.search(r"No module named '[^']+'", text)
                raise DissocError(
                    "the Spark Connect server's Python workers cannot import dissoc"
                    f"{f' ({missing[0]})' if missing else ''}: start the server with PYSPARK_PYTHON "
                    "(or --conf spark.pyspark.python) naming an interpreter with dissoc[spark] installed on "
                    "every executor"
                ) from None
            raise DissocError(
                f"Spark's Python workers ({spark.sparkContext.pythonExec!r}) cannot import dissoc: set "
                "PYSPARK_PYTHON or spark.pyspark.python to an interpreter with dissoc[spark] installed on "
                "every executor"
            ) from None
        raise DissocError(
            f"checking Spark's Python workers failed: {text.splitlines()[0] if text else e}"
        ) from None
    log.info("Spark Python workers: %s", found)
    return found


def spark_type(t: pa.DataType) -> DataType:
    """The Spark type for Arrow type ``t`` (see the module docstring for the mapping)."""
    require_pyspark()
    from dissoc.spark._types import spark_type as convert

    return convert(t)


def spark_schema(schema: pa.Schema) -> StructType:
    """The Spark schema for an Arrow schema (same names and nullability)."""
    require_pyspark()
    from dissoc.spark._types import spark_schema as convert

    return convert(schema)


def conform(batch: pa.RecordBatch, target: pa.Schema | StructType) -> pa.RecordBatch:
    """``batch`` cast to exactly the Arrow schema PySpark expects for ``target`` (or to Arrow ``target``)."""
    require_pyspark()
    from dissoc.spark._types import conform as convert

    return convert(batch, target)


def hash_partition(batch: pa.RecordBatch, key: str | Sequence[str], n: int) -> npt.NDArray[np.int64]:
    """The destination (``0..n-1``) of each row: a process-independent hash of the ``key`` column(s)."""
    from dissoc.spark._exchange import hash_partition as partition

    return partition(batch, key, n)


def exchange(
    data: Iterable[Any] | pa.Table | pa.RecordBatch | Any,
    *,
    key: str | Sequence[str] | None = None,
    partitioner: Partitioner | None = None,
    schema: pa.Schema | None = None,
    host: str | None = None,
    port: int = 0,
    timeout: float = 60.0,
    transport: str = "auto",
    body: str = "auto",
    memory: str = "auto",
    landing: str = "auto",
    rendezvous: str | None = None,
) -> ExchangeResult:
    """Swap rows between the tasks of a barrier stage over dissoc; returns this task's rows.

    ``data``: this task's rows (pyarrow batches or tables). ``key``: hash-partition by these column(s);
    ``partitioner(batch, n)``: destination per row; neither: every task receives every row. ``schema``:
    the rows' schema, needed only when a task may have no rows at all (else it serves nothing). ``host``,
    ``port``: where this task's first server listens (see the module docstring). ``timeout``: seconds to
    start the servers, to meet the peers, of silence tolerated while fetching, and to wait for the peers'
    done. The rows a task receives come grouped by sending task (in task order), in the order they were
    sent. Everything a task sends and receives is held in memory until its peers are done.

    ``data`` may also hold :class:`~dissoc.device.DeviceBatch` objects (rows in GPU memory): they are split
    on the device when the key and every column are fixed-width (else through the host), sent from device
    memory, and land as DeviceBatches. ``transport`` (``tcp``, ``ucx``), ``body`` (``packed``, ``pairs``),
    ``memory`` (``shm``, ``ucx``, ``cuda``: where pairs point) and ``landing`` (``host``, ``device``) fix
    the path for every peer; ``"auto"`` (each one's default) picks per peer the fastest both share: pairs
    read in place (shared memory, or CUDA IPC for device rows) on one node, UCX between nodes when ucxx
    loads on both, TCP otherwise. The result iterates the received batches; its ``report`` says, per peer,
    the path taken, rows, bytes and seconds; its ``seconds`` the time of each phase.

    ``rendezvous``: how the tasks swap their servers' URIs: ``"allgather"`` (Spark's, which costs about a
    second: Spark waits for barrier calls in one-second steps), ``"files"`` (a private folder of
    ``/dev/shm``, for stages whose tasks all run on one host sharing it) or ``"auto"`` (files when Spark's
    task addresses all name one host). None: ``$DISSOC_SPARK_RENDEZVOUS``, else ``"auto"``. Executors on
    one host with separate ``/dev/shm`` (containers) need ``"allgather"``.
    """
    require_pyspark()
    from dissoc.spark._exchange import exchange as run

    return run(
        data,
        key=key,
        partitioner=partitioner,
        schema=schema,
        host=host,
        port=port,
        timeout=timeout,
        transport=transport,
        body=body,
        memory=memory,
        landing=landing,
        rendezvous=rendezvous,
    )
