"""The device check (``scripts/gpu-check.sh``) runs on a GPU machine without network access, from wheels that
``scripts/gpu-wheels.sh`` downloads beforehand, so both are kept from rotting here: the check's ``--fake``
mode runs every step on the CPU (the gpu tests skip, the benchmark uses the fake device backend) and must
write its summary, and the wheel list must pin the CUDA 13 UCX stack and dissoc's requirements the GPU
machine lacks, at versions dissoc accepts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def _needs(*tools: str) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (the scripts need it)")


@pytest.mark.ucx  # the benchmark's ucx-packed path
@pytest.mark.timeout(150)
def test_gpu_check_fake_runs_every_step_and_writes_its_summary(tmp_path: Path) -> None:
    _needs("bash", "timeout", "tee")
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    r = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--fake", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert set(summary) == {
        "fake",
        "passed",
        "problems",
        "seconds",
        "steps",
        "env",
        "tests",
        "bench",
        "bench_reuse",
        "streams",
    }
    assert summary["fake"] is True and summary["passed"] is True and summary["problems"] == []
    steps = {s["name"]: s["status"] for s in summary["steps"]}
    assert steps == {
        "install": "skipped",
        "native": "skipped",
        "env": "passed",
        "tests": "passed",
        "bench": "passed",
        "bench-reuse": "passed",
        "streams": "passed",
    }
    packages = summary["env"]["packages"]
    assert Path(packages["dissoc"]["from"]) == REPO / "dissoc", "dissoc must come from the checkout"
    assert {"python", "nvidia_smi", "gpus", "ucx_calls"} <= set(summary["env"])
    tests = summary["tests"]
    assert tests["tests"] > 0 and tests["failures"] == tests["errors"] == 0
    assert {e["path"] for e in summary["bench"]["results"]} == {
        "cupy-d2d-copy",
        "ucx-packed",
        "cuda-ipc-pairs-zc",
        "cuda-ipc-pairs-copy",
        "partition-2way",
    }
    assert {e["path"] for e in summary["bench_reuse"]["results"]} == {
        "cupy-d2d-copy",
        "ucx-packed",
        "cuda-ipc-pairs-copy",
    }
    for entry in summary["bench"]["results"]:
        assert "error" not in entry, entry
        assert entry["batches"] == 4 and entry["median_gbps"] > 0
    streams = {(e["what"], e["path"]): e for e in summary["streams"]["streams"]}
    assert set(streams) == {
        ("stream", "ucx-packed"),
        ("stream", "cuda-ipc-pairs-copy"),
        ("stream", "cuda-ipc-pairs-zc"),
        ("stream", "ucx-packed-host"),
        ("batch", "cuda-ipc-pairs-copy"),
        ("batch", "cuda-ipc-pairs-zc"),
    }
    for entry in streams.values():
        assert "error" not in entry, entry
        assert entry.get("ms", entry.get("us", 0)) > 0
    files = ("gpu-check.log", "env.json", "pytest-gpu.xml", "bench.json", "bench-reuse.json", "streams.json")
    for name in files:
        assert (tmp_path / name).is_file(), name
    assert "gpu-check: passed" in (tmp_path / "gpu-check.log").read_text()


@pytest.mark.timeout(30)
def test_gpu_wheels_list_pins_the_cuda13_ucx_stack_and_what_dissoc_needs() -> None:
    _needs("bash")
    r = subprocess.run(
        ["bash", "scripts/gpu-wheels.sh", "--list"], cwd=REPO, capture_output=True, text=True, timeout=20
    )
    assert r.returncode == 0, r.stderr
    pins = [Requirement(line) for line in r.stdout.split()]
    assert pins and all(str(p.specifier).startswith("==") for p in pins), r.stdout
    pinned = {canonicalize_name(p.name): next(iter(p.specifier)).version for p in pins}
    assert {"ucxx-cu13", "libucxx-cu13", "libucx-cu13", "lz4", "zstandard", "pytest-asyncio"} <= set(pinned)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for line in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in pinned:
            assert req.specifier.contains(pinned[name]), f"{name}=={pinned[name]} does not meet {line}"
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert ".whl/" in ignored and "gpu-check-out/" in ignored
