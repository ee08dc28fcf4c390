"""The documentation's examples run, its commands exist and its links lead somewhere.

Every ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` runs as a script in a fresh interpreter
(the repository first on its path, a temporary directory as its working directory; two at a time) and must
exit 0 within its timeout; a failure names the file, the line of the block and what it printed. Identical
blocks run once.

A block that needs an optional extra or a device says so in an HTML comment on the line before its fence::

    <!-- example: needs spark -->

(or ``needs ucx, gpu``; the needs may also follow the fence's language: ```` ```python spark ````). It is
skipped where that is missing, naming it: ``spark`` (pyspark and Java), ``ucx`` (ucxx), ``gpu`` (CuPy and a
CUDA device), or the name of any module that must import (``cryptography``). Such blocks also carry the
suite's marker of the same name (``-m "not spark"`` leaves them out; Spark blocks are ``slow`` too). A
fragment that is not meant to run is fenced as ```` ```text ````; shell blocks are not run.

Besides: every ``dissoc`` command in those files, in shell and text blocks and in inline code, uses only
flags that its subcommand's ``--help`` lists, and every relative link of the repository's Markdown pages
points at a file that exists and, when it names an anchor, at a heading of that file.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Where the runnable examples are.
EXAMPLE_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
#: Pages whose relative links are checked (the examples' pages and the other Markdown pages of the tree).
LINKED_FILES = sorted(
    {
        *EXAMPLE_FILES,
        *(p for p in (ROOT / name for name in ("ARCHITECTURE.md", "CHANGELOG.md")) if p.exists()),
        *(ROOT / "benchmarks").glob("*.md"),
        *(ROOT / "docker").glob("*.md"),
    }
)

#: Seconds one example may run; Spark starts a JVM and a session first.
TIMEOUT = 120.0
SPARK_TIMEOUT = 240.0
#: Needs that are groups of the test suite (conftest.py skips their tests where they are missing).
MARKED_NEEDS = ("spark", "ucx", "gpu")
#: Languages of fenced blocks that are run, and of those whose ``dissoc`` commands are checked.
PYTHON = {"python", "py", "python3"}
COMMANDS = {"bash", "sh", "shell", "console", "text", ""}
SUBCOMMANDS = ("serve", "get", "health", "token", "cleanup")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARK = re.compile(r"^\s*<!--\s*example:\s*(?P<what>.*?)\s*-->\s*$")
_COMMAND = re.compile(r"\bdissoc(?:\.cli)?\s+(" + "|".join(SUBCOMMANDS) + r")\b")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(?P<target>\S+)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(?P<text>.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a Markdown file."""

    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    needs: tuple[str, ...] = ()
    also_at: list[str] = field(default_factory=list, compare=False)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> Iterator[Block]:
    """The fenced blocks of ``path``, with the needs its marker comment or info string names."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        words = opening["info"].strip().split()
        language = words[0].lower() if words else ""
        needs = [w.strip(",") for w in words[1:]]
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(before)
        if mark is not None:
            what = mark["what"]
            if what.startswith("needs"):
                needs += [n.strip() for n in what[len("needs") :].split(",") if n.strip()]
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        yield Block(path, i + 1, language, "\n".join(body) + "\n", tuple(needs))
        i = j + 1


def _block_lines(path: Path) -> set[int]:
    """The line numbers of ``path`` inside fenced blocks, fences included."""
    lines: set[int] = set()
    for block in _blocks(path):
        lines.update(range(block.line, block.line + len(block.code.splitlines()) + 2))
    return lines


def _python_blocks() -> list[Block]:
    """Every python block once (the first place it appears; the others in ``also_at``)."""
    seen: dict[str, Block] = {}
    for path in EXAMPLE_FILES:
        for block in _blocks(path):
            if block.language not in PYTHON:
                continue
            if block.code in seen:
                seen[block.code].also_at.append(block.where)
            else:
                seen[block.code] = block
    return list(seen.values())


@functools.cache
def _missing(need: str) -> str | None:
    """None when ``need`` is here, else why not."""
    if need == "spark":
        if importlib.util.find_spec("pyspark") is None:
            return "pyspark is not installed (pip install 'dissoc[spark]')"
        if shutil.which("java") is None:
            return "Java is not installed (PySpark needs Java 17)"
        return None
    if need == "ucx":
        found_ucx = importlib.util.find_spec("ucxx") is not None
        return None if found_ucx else "ucxx is not installed (pip install 'dissoc[ucx]')"
    if need == "gpu":
        if importlib.util.find_spec("cupy") is None:
            return "cupy is not installed (pip install 'dissoc[gpu]')"
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                return "no CUDA device"
        except Exception as e:  # any failure to reach a device means: no device
            return f"no usable CUDA device ({type(e).__name__}: {e})"
        return None
    try:
        found = importlib.util.find_spec(need) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"the module {need!r} is not installed"


def _params() -> list[object]:
    params: list[object] = []
    for block in _python_blocks():
        marks = [getattr(pytest.mark, need) for need in block.needs if need in MARKED_NEEDS]
        if "spark" in block.needs:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(block, id=block.where, marks=marks))
    return params


def _numbered(code: str) -> str:
    return "\n".join(f"{n:4} | {line}" for n, line in enumerate(code.splitlines(), 1))


#: Examples run at once (each is a process of its own, mostly waiting on a server or a JVM).
PARALLEL = 2


def _run(block: Block) -> tuple[int | None, str]:
    """Run ``block`` as a script in a temporary directory: (exit status, or None past its timeout; output)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "example.py"
        script.write_text(block.code, encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        timeout = SPARK_TIMEOUT if "spark" in block.needs else TIMEOUT
        try:
            done = subprocess.run(
                [sys.executable, str(script)],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            said = e.output if isinstance(e.output, str) else (e.output or b"").decode(errors="replace")
            return None, said
        return done.returncode, done.stdout


@pytest.fixture(scope="session")
def example_runs(request: pytest.FixtureRequest) -> Iterator[dict[Block, Future[tuple[int | None, str]]]]:
    """Every selected example that can run here, started :data:`PARALLEL` at a time in the order the tests
    take them; each test waits for its own."""
    blocks: list[Block] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        block = callspec.params.get("block") if callspec is not None else None
        if isinstance(block, Block) and all(_missing(need) is None for need in block.needs):
            blocks.append(block)
    with ThreadPoolExecutor(PARALLEL) as pool:
        runs = {block: pool.submit(_run, block) for block in blocks}
        try:
            yield runs
        finally:
            for run in runs.values():
                run.cancel()


@pytest.mark.parametrize("block", _params())
def test_example_runs(block: Block, example_runs: dict[Block, Future[tuple[int | None, str]]]) -> None:
    for need in block.needs:
        why = _missing(need)
        if why is not None:
            pytest.skip(f"{block.where} needs {need}: {why}")
    timeout = SPARK_TIMEOUT if "spark" in block.needs else TIMEOUT
    run = example_runs.get(block)
    status, said = run.result() if run is not None else _run(block)
    where = block.where + (f" (also at {', '.join(block.also_at)})" if block.also_at else "")
    if status is None:
        pytest.fail(
            f"{where}: the example did not finish within {timeout:g} s\n--- the block ---\n"
            f"{_numbered(block.code)}\n--- its output so far ---\n{said[-4000:]}",
            pytrace=False,
        )
    if status != 0:
        pytest.fail(
            f"{where}: the example failed (exit status {status})\n--- the block ---\n"
            f"{_numbered(block.code)}\n--- its output ---\n{said[-4000:]}",
            pytrace=False,
        )


def test_examples_are_found() -> None:
    """The extraction itself works: the README's examples are there, and the marked ones carry their needs."""
    blocks = _python_blocks()
    readme = [b for b in blocks if b.path.name == "README.md" and b.path.parent == ROOT]
    assert len(readme) >= 5, [b.where for b in readme]
    assert any("spark" in b.needs for b in blocks)
    for block in blocks:
        unknown = [n for n in block.needs if not re.fullmatch(r"[A-Za-z_][\w.]*", n)]
        assert not unknown, f"{block.where}: cannot read the needs {unknown}"


# ------------------------------------------------------------------------------------------- commands


@functools.cache
def _flags(subcommand: str) -> frozenset[str]:
    """The long flags ``dissoc SUBCOMMAND --help`` lists."""
    from dissoc.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            status: object = main([subcommand, "--help"])
        except SystemExit as e:  # argparse's own exit, where main lets it through
            status = e.code
    assert status in (0, None), f"dissoc {subcommand} --help exited with {status}"
    return frozenset(_FLAG.findall(out.getvalue()))


def _commands(path: Path) -> Iterator[tuple[int, str, str]]:
    """``(line, subcommand, text)`` for every ``dissoc`` command in ``path``: in shell and text blocks (with
    their continuation lines) and in inline code spans."""
    lines = path.read_text(encoding="utf-8").splitlines()
    in_blocks = _block_lines(path)
    for block in _blocks(path):
        if block.language not in COMMANDS:
            continue
        body = block.code.splitlines()
        k = 0
        while k < len(body):
            text = body[k]
            start = k
            while text.rstrip().endswith("\\") and k + 1 < len(body):
                k += 1
                text = text.rstrip()[:-1] + " " + body[k]
            # a synopsis goes on over indented lines
            while block.language == "text" and k + 1 < len(body) and body[k + 1][:1] in (" ", "\t"):
                k += 1
                text += " " + body[k]
            for found in _COMMAND.finditer(text):
                rest = re.split(r"\s#\s|\s&&\s|\s\|\s|;", text[found.end() :], maxsplit=1)[0]
                yield block.line + 1 + start, found[1], rest
            k += 1
    for number, line in enumerate(lines, 1):
        if number in in_blocks:
            continue
        for span in _INLINE_CODE.finditer(line):
            for found in _COMMAND.finditer(span[2]):
                yield number, found[1], span[2][found.end() :]


def test_commands_use_existing_flags() -> None:
    wrong: list[str] = []
    checked = 0
    for path in EXAMPLE_FILES:
        for line, subcommand, text in _commands(path):
            for flag in _FLAG.findall(text):
                checked += 1
                if flag not in _flags(subcommand):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: dissoc {subcommand} has no {flag}")
    assert checked > 50, f"only {checked} flags found: is the extraction broken?"
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------------------------------- links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    in_blocks = _block_lines(path)
    seen: dict[str, int] = {}
    anchors = set()
    for number, line in enumerate(lines, 1):
        heading = _HEADING.match(line)
        if heading is None or number in in_blocks:
            continue
        slug = _slug(heading["text"])
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(anchors)


def _links(path: Path) -> Iterator[tuple[int, str]]:
    in_blocks = _block_lines(path)
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if number in in_blocks:
            continue
        reference = _REFERENCE.match(line)
        if reference is not None:
            yield number, reference["target"]
            continue
        for link in _LINK.finditer(_INLINE_CODE.sub("", line)):
            yield number, link["target"]


@pytest.mark.parametrize("path", LINKED_FILES, ids=[str(p.relative_to(ROOT)) for p in LINKED_FILES])
def test_relative_links_resolve(path: Path) -> None:
    broken: list[str] = []
    for line, target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        goal = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{line}: {target}"
        if not goal.exists():
            broken.append(f"{where}: no such file")
        elif anchor and goal.suffix == ".md" and anchor not in _anchors(goal):
            broken.append(f"{where}: no heading with that anchor in {goal.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_readme_stays_short() -> None:
    """The README is the first page a user reads: reference material belongs in docs/."""
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= 450, f"README.md has {lines} lines (at most 450: move reference material to docs/)"
