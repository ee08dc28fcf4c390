"""Test groups that default to what is installed, and the fast loop's selection.

Hypothesis runs derandomized when ``CI`` is set (profile ``ci``). Markers: ``ucx`` (needs ucxx), ``gpu``
(needs cupy and a CUDA device), ``spark`` (needs pyspark and Java), ``docker`` (builds and runs the images of
docker/: needs a docker daemon that answers and, until its base image is built, debootstrap run as root),
``netns`` (a cluster of network namespaces, :mod:`cluster.netns`: needs root, iproute2 and nftables),
``slow``. A marked test whose dependency is missing is skipped with a reason that names it; ``slow`` tests run
by default (deselect with ``-m "not slow"``), and so do ``docker`` tests where a daemon answers (about two
minutes of image builds; deselect with ``-m "not docker"`` or ``DISSOC_DOCKER_TESTS=0``).

``heavy`` is given here, by path (:data:`HEAVY`), to the end-to-end folders, to the modules elsewhere whose
tests mostly run servers in child processes, and to the codec's long property sweeps. The fast loop,
``scripts/test.sh --fast``, is the suite less ``-m "slow or spark or docker or ucx or heavy"``: every room's
own tests, mostly in this process, in under three minutes on two cores.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same examples every run (a landing must not depend on luck); elsewhere hypothesis explores
# new random examples each run, which is how it keeps finding edge cases.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@cache
def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@cache
def _cuda_device() -> str | None:
    """None when a CUDA device is usable, else why not."""
    if not _has_module("cupy"):
        return "cupy is not installed (pip install 'dissoc[gpu]')"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # any failure to reach a device means: no device
        return f"no usable CUDA device ({type(e).__name__}: {e})"
    return None


def _missing(marker: str) -> str | None:
    if marker == "ucx":
        return None if _has_module("ucxx") else "ucxx is not installed (pip install 'dissoc[ucx]')"
    if marker == "gpu":
        return _cuda_device()
    if marker == "spark":
        if not _has_module("pyspark"):
            return "pyspark is not installed (pip install 'dissoc[spark]')"
        if shutil.which("java") is None:
            return "Java is not installed (PySpark needs Java 17)"
    if marker == "netns":
        return _netns_missing()
    return None


@cache
def _netns_missing() -> str | None:
    from cluster.netns import missing

    return missing()


@cache
def _docker_missing() -> str | None:
    """None when the docker group can run here, else why not."""
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    try:
        done = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        return "no docker daemon answers ('docker version' timed out)"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["docker version failed"])[-1]
        return f"no docker daemon answers ({said})"
    base = os.environ.get("DISSOC_DOCKER_BASE", "dissoc-base:bookworm")
    has_base = (
        subprocess.run(["docker", "image", "inspect", base], capture_output=True, timeout=60).returncode == 0
    )
    if not has_base:
        if shutil.which("debootstrap") is None:
            return f"debootstrap is not installed (it builds the base image {base}; or build it elsewhere)"
        if os.geteuid() != 0:
            return f"debootstrap needs root to build the base image {base} (docker/base-from-debian.sh)"
    return None


_DOCKER_MISSING: list[str | None] = []


def _docker_missing_cached() -> str | None:
    """:func:`_docker_missing`, asked once per session (it runs ``docker version``)."""
    if not _DOCKER_MISSING:
        _DOCKER_MISSING.append(_docker_missing())
    return _DOCKER_MISSING[0]


def _docker_opted_out() -> bool:
    return os.environ.get("DISSOC_DOCKER_TESTS") == "0"


#: Left out of the fast loop (marker ``heavy``), relative to ``tests/``: a folder (ending in ``/``), a module,
#: or one test function of a module (``module.py::test``).
HEAVY = (
    # The folders of end-to-end tests: real servers and clients, ``dissoc`` subprocesses, Spark, images and
    # benchmark runs.
    "bench/",
    "cli/",
    "client/",
    "cluster/",
    "docker/",
    "docs/",  # every example of the README and docs/, each in an interpreter of its own
    "reliability/",
    "spark/",
    # Modules in the other folders whose tests mostly run servers in child processes.
    "base/test_tokens.py",
    "device/test_e2e.py",
    "flight/test_security.py",
    "memory/test_private.py",
    "transport/test_tls.py",
    "transport/test_ucx_asyncio.py",
    "transport/test_ucx_conformance.py",
    "transport/test_ucx_reference.py",
    # The codec's long property sweeps (hypothesis over generated and damaged batches).
    "codec/test_body_corruption.py",
    "codec/test_encode_paths.py::test_generated_bulk_batches",
    "codec/test_encode_paths.py::test_generated_wide_batches",
)
_TESTS = Path(__file__).resolve().parent


def _heavy(item: pytest.Item) -> bool:
    path = item.path.resolve()
    if not path.is_relative_to(_TESTS):
        return False
    where = path.relative_to(_TESTS).as_posix()
    test = f"{where}::{item.name.partition('[')[0]}"
    return any(h in (where, test) or (h.endswith("/") and where.startswith(h)) for h in HEAVY)


# tryfirst: the marks must be on the items before ``-m`` deselects by them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _heavy(item):
            item.add_marker(pytest.mark.heavy)
        for marker in ("ucx", "gpu", "spark", "netns"):
            if item.get_closest_marker(marker) is not None:
                reason = _missing(marker)
                if reason is not None:
                    item.add_marker(pytest.mark.skip(reason=reason))
        if item.get_closest_marker("docker") is not None:
            if _docker_opted_out():
                off: str | None = "DISSOC_DOCKER_TESTS=0 turns the docker group off"
            else:
                off = _docker_missing_cached()
            if off is not None:
                item.add_marker(pytest.mark.skip(reason=off))
