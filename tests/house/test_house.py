"""The house rules that tools check: ``ruff`` and ``mypy --strict`` (configured in pyproject.toml, over the
package and the tests) report nothing. Both come with the ``dev`` extra, which the test script installs;
without them these tests are skipped, naming what is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    """The tool installed next to this interpreter (the project's venv), else on PATH."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install 'dissoc[dev]')")
    return found


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "dissoc", "tests", "benchmarks"]], ids=["check", "format"]
)
def test_ruff(args: list[str]) -> None:
    got = subprocess.run([_tool("ruff"), *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr


@pytest.mark.timeout(600)
def test_mypy_strict() -> None:
    got = subprocess.run([_tool("mypy")], cwd=REPO, capture_output=True, text=True, timeout=590)
    assert got.returncode == 0, got.stdout + got.stderr
