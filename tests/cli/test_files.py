"""``dissoc serve`` of what users keep on disk, end to end: a CSV file, an NDJSON file and a hive-partitioned
directory served by one ``dissoc serve --per-file --flight 0`` process, fetched equal to pyarrow's own read
(over dissoc, and through the Flight plane that lists the directory's files as its endpoints); and
``dissoc get -o`` writing each format its suffix names, read back by pyarrow equal."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from helpers.e2e import PYTHON, REPO, cli_server

import dissoc
from dissoc import cli
from dissoc.errors import DissocError

flight = pytest.importorskip("pyarrow.flight")

pytestmark = pytest.mark.timeout(60)

#: The sales directory's files, in the order they are served.
SALES = ["year=2023/region=eu/a.parquet", "year=2024/region=eu/a.parquet", "year=2024/region=us/b.parquet"]


def _dissoc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "dissoc.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=30
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files served: a CSV file, an NDJSON file and a directory of Parquet files in hive folders."""
    root = tmp_path_factory.mktemp("files")
    (root / "trips.csv").write_text(
        "trip,driver,fare,at\n" + "".join(f"{i},d{i % 3},{i * 1.5},2024-01-0{1 + i % 9}\n" for i in range(40))
    )
    (root / "events.ndjson").write_text(
        "".join(f'{{"id": {i}, "kind": "k{i % 2}", "tags": ["t{i}"], "extra": null}}\n' for i in range(30))
    )
    for i, name in enumerate(SALES):
        path = root / "sales" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = range(i * 100, i * 100 + 25 * (i + 1))
        pq.write_table(pa.table({"id": list(rows), "amount": [r / 4 for r in rows]}), path, row_group_size=20)
    return root


@pytest.fixture(scope="module")
def data(root: Path) -> dict[str, pa.Table]:
    """Each served file's table as pyarrow itself reads it, by ticket."""
    return {
        "trips": pads.dataset(str(root / "trips.csv"), format="csv").to_table(),
        "events": pads.dataset(str(root / "events.ndjson"), format="json").to_table(),
        "sales": pads.dataset(str(root / "sales"), format="parquet", partitioning="hive").to_table(),
    }


@pytest.fixture(scope="module")
def served(root: Path) -> Iterator[dict[str, dict[str, Any]]]:
    """One ``dissoc serve --per-file --flight 0`` for the module: its ready lines by ticket."""
    paths = [str(root / "trips.csv"), str(root / "events.ndjson"), str(root / "sales")]
    with cli_server(*paths, "--per-file", "--flight", "0", count=3) as (proc, lines):
        yield {line["ticket"]: line for line in lines}
        assert proc.poll() is None, "the server exited while serving"


def test_the_ready_lines_name_the_directorys_parts(served: dict[str, dict[str, Any]]) -> None:
    assert list(served) == ["trips", "events", "sales"]
    assert served["sales"]["parts"] == [f"sales/{name}" for name in SALES]
    assert "parts" not in served["trips"] and "parts" not in served["events"]


@pytest.mark.parametrize("ticket", ["trips", "events", "sales"])
def test_fetched_equal_to_pyarrows_own_read(
    served: dict[str, dict[str, Any]], data: dict[str, pa.Table], ticket: str
) -> None:
    got = dissoc.fetch(served[ticket]["uri"], ticket)
    assert got.schema.equals(data[ticket].schema), (got.schema, data[ticket].schema)
    assert got.equals(data[ticket])


def test_flight_lists_one_endpoint_per_file_read_in_order(
    served: dict[str, dict[str, Any]], data: dict[str, pa.Table], tmp_path: Path
) -> None:
    location = served["sales"]["flight"]
    info = flight.FlightClient(location).get_flight_info(flight.FlightDescriptor.for_path("sales"))
    tickets = [e.ticket.ticket.decode() for e in info.endpoints]
    assert tickets == [f"sales/{name}" for name in SALES]
    part = dissoc.fetch(served["sales"]["uri"], tickets[2])  # each endpoint is a dataset of its own
    assert part.column("region").to_pylist() == ["us"] * 75 and part.schema.equals(data["sales"].schema)
    assert dissoc.fetch(location, "sales").equals(data["sales"])
    out = tmp_path / "sales.parquet"
    result = _dissoc("get", location, "sales", "-o", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["rows"] == data["sales"].num_rows and len(summary["paths"]) == len(SALES)
    assert pq.read_table(out).equals(data["sales"])


@pytest.mark.parametrize(
    "suffix", [".arrow", ".feather", ".ipc", ".arrows", ".stream", ".parquet", ".parq", ".csv"]
)
def test_get_writes_the_format_its_suffix_names(
    served: dict[str, dict[str, Any]], data: dict[str, pa.Table], tmp_path: Path, suffix: str
) -> None:
    out = tmp_path / f"sales{suffix}"
    args, _ = cli.parse_args(["get", served["sales"]["uri"], "sales", "-o", str(out), "--no-progress"])
    assert asyncio.run(cli._get(args)) == 0
    want = data["sales"]
    if suffix in (".arrow", ".feather", ".ipc"):
        got = pa.ipc.open_file(str(out)).read_all()
    elif suffix in (".arrows", ".stream"):
        got = pa.ipc.open_stream(str(out)).read_all()
    elif suffix in (".parquet", ".parq"):
        got = pq.read_table(out)
        assert pq.ParquetFile(out).metadata.num_row_groups > 1  # written batch by batch
    else:
        types = dict(zip(want.schema.names, want.schema.types, strict=True))
        got = pacsv.read_csv(out, convert_options=pacsv.ConvertOptions(column_types=types))
    assert got.equals(want), f"{suffix}: {got.schema} {got.num_rows} rows"


def test_get_refuses_an_unknown_suffix_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["get", "tcp://127.0.0.1:1?want_data=1", "trips", "-o", "trips.xlsx"]) == 2
    err = capsys.readouterr().err
    assert "usage: dissoc get" in err and "trips.xlsx" in err
    assert all(suffix in err for suffix in (".arrow", ".arrows", ".parquet", ".csv"))


def test_get_of_nested_columns_as_csv_is_a_clear_error(
    served: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    out = tmp_path / "events.csv"
    args, _ = cli.parse_args(["get", served["events"]["uri"], "events", "-o", str(out), "--no-progress"])
    with pytest.raises(DissocError, match=r"cannot write '.*events\.csv' as CSV: .*[Uu]nsupported"):
        asyncio.run(cli._get(args))
