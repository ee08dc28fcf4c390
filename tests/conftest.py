"""Test groups that default to what is installed.

Hypothesis runs derandomized when ``CI`` is set (profile ``ci``). Markers: ``ucx`` (needs ucxx), ``gpu``
(needs cupy and a CUDA device), ``spark`` (needs pyspark and Java),
``slow``. A marked test whose dependency is missing is skipped with a reason that names it; ``slow`` tests run
by default (deselect with ``-m "not slow"``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from functools import cache

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
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker in ("ucx", "gpu", "spark"):
            if item.get_closest_marker(marker) is not None:
                reason = _missing(marker)
                if reason is not None:
                    item.add_marker(pytest.mark.skip(reason=reason))
