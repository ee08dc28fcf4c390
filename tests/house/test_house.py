"""The house rules that tools check: ``ruff`` and ``mypy --strict`` (configured in pyproject.toml, over the
package and the tests) report nothing, and mypy reports nothing either where none of the optional extras is
installed. Both tools come with the ``dev`` extra, which the test script installs; without them these tests
are skipped, naming what is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # (pytest's own requirement)
from packaging.utils import canonicalize_name

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


#: The extras there wherever mypy runs (the test script installs ``dev``); every other one is optional.
ALWAYS_THERE = ("test", "dev")


def _base_distributions() -> list[metadata.Distribution]:
    """The installed distributions a checkout has without the optional extras: dissoc's requirements and its
    test and dev extras', and theirs in turn (their markers as this interpreter meets them). Checks that none
    of them is an optional extra's requirement (the environment would not be without the extras)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    optional = {
        canonicalize_name(Requirement(r).name) for k, v in extras.items() if k not in ALWAYS_THERE for r in v
    }
    todo = [
        (r, frozenset[str]())
        for r in [*project["dependencies"], *(r for k in ALWAYS_THERE for r in extras[k])]
    ]
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        line, wanted = todo.pop()
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in wanted or {""}):
            continue
        if name == "dissoc" or (name, frozenset(req.extras)) in seen:
            continue  # (dissoc's own extras are listed above already)
        seen.add((name, frozenset(req.extras)))
        try:
            dist = found.setdefault(name, metadata.distribution(name))
        except metadata.PackageNotFoundError:
            continue  # not installed here: mypy goes without it in both runs
        todo += [(r, frozenset(req.extras)) for r in dist.requires or ()]
    assert not found.keys() & optional, (
        f"an optional extra's requirement is a base one: {found.keys() & optional}"
    )
    return list(found.values())


def _without_extras(root: Path) -> Path:
    """A virtual environment at ``root`` (made afresh) whose site-packages links to this interpreter's
    packages of :func:`_base_distributions` and nothing else; its python."""
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    where = [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    site = Path(subprocess.run(where, capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    for dist in _base_distributions():
        # What a distribution installed inside site-packages, by top-level name (a package, a module, its
        # .dist-info); what it installed elsewhere ("../../bin/...": scripts) is not needed.
        tops = {Path(f).parts[0] for f in dist.files or () if Path(f).parts and Path(f).parts[0] != ".."}
        for top in sorted(tops):
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
    return python


def _mypy(extras: bool) -> list[str]:
    mypy = [_tool("mypy")]
    if not extras:
        home = REPO / ".mypy_cache" / "without-extras"
        python = _without_extras(home / "venv")
        mypy += ["--python-executable", str(python), "--cache-dir", str(home / "cache")]
    return mypy


@pytest.fixture(scope="module")
def mypy_runs(request: pytest.FixtureRequest) -> dict[bool, tuple[int, str]]:
    """The selected mypy runs, started together (each is one process; two cores halve the wait): exit
    status and output by ``extras``."""
    wanted = [
        item.callspec.params["extras"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_mypy_strict" and hasattr(item, "callspec")
    ]
    procs = {
        extras: subprocess.Popen(
            _mypy(extras), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for extras in dict.fromkeys(wanted)
    }
    out: dict[bool, tuple[int, str]] = {}
    try:
        for extras, proc in procs.items():
            said, _ = proc.communicate(timeout=590)
            out[extras] = (proc.returncode, said)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("extras", [True, False], ids=["with-extras", "without-extras"])
def test_mypy_strict(extras: bool, mypy_runs: dict[bool, tuple[int, str]]) -> None:
    """As configured, for the interpreter running the tests (the project's venv: every extra installed); and
    for a throwaway environment holding only the base, test and dev distributions, where every import of an
    optional extra must still type-check (a lazy import of an extra that ships types is one mypy cannot find
    there). That run keeps its environment and cache beside the usual cache, at stable paths (warm runs take
    seconds). Both run at once."""
    status, said = mypy_runs[extras]
    assert status == 0, said
