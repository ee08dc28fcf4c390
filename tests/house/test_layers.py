"""The package's layout is its architecture (ARCHITECTURE.md): every import, eager, lazy or for typing only,
points down a floor or stays in its own room; no two modules import each other, directly or around a
circle; the codec and the protocol core stay pure. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dissoc"

#: Rooms (a folder, or a top-level module) by floor, lowest first. A room may import rooms of lower floors
#: only; rooms on one floor do not import each other.
FLOORS: list[set[str]] = [
    {"errors"},
    {"buffers", "uri", "logs", "tokens", "metrics", "config", "hashing"},
    {"codec", "protocol"},
    {"transport"},
    {"memory"},
    {"device"},
    {"datasets"},
    {"server"},
    {"metadata_server", "data_server"},  # the spec's two servers' public names, over the server room
    {"flight"},
    {"session"},
    {"client"},
    {"health"},
    {"cli", "demo", "__init__"},  # the package's front door: its lazy names (Server, fetch, ...) are typed
    {"spark"},  # its worker probe imports the package itself
]
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}

#: What a pure layer must never import (no I/O, no event loop, nothing above it).
IMPURE = ("asyncio", "socket", "selectors", "ssl", "ucxx", "cupy")
PURE_ROOMS = ("codec", "protocol")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The package module ``name`` refers to (a module, or the package a name is taken from)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, int]]:
    """Every ``dissoc`` module ``module`` imports, wherever the import stands (with its line)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    is_package = MODULES[module].name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                if not is_package:
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from P import m`` imports the module P.m when there is one, else a name of P
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
            ]
        for name in names:
            if name == "dissoc" or name.startswith("dissoc."):
                target = _resolve(name)
                if target is not None and target != module:
                    found.append((target, node.lineno))
    return sorted(set(found))


def _room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_every_room_has_a_floor() -> None:
    rooms = {_room(m) for m in MODULES}
    assert rooms - FLOOR.keys() == set(), "add new rooms to FLOORS (and ARCHITECTURE.md)"
    assert FLOOR.keys() - rooms == set(), "FLOORS names rooms that no longer exist"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    room = _room(module)
    wrong = [
        f"{module}:{line} imports {target} (floor {FLOOR[_room(target)]}, this is floor {FLOOR[room]})"
        for target, line in _imports(module)
        if _room(target) != room and FLOOR[_room(target)] >= FLOOR[room]
    ]
    assert wrong == []


def test_no_import_circles() -> None:
    graph = {m: {t for t, _ in _imports(m)} for m in MODULES}
    # A package's __init__ re-exports its own modules: an edge into it from one of them is the usual shape
    # of a package, not a circle, as long as that module does not need the names the __init__ gathers.
    for module, targets in graph.items():
        targets.discard(module.rpartition(".")[0])
    circles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert circles == []


@pytest.mark.parametrize("room", PURE_ROOMS)
def test_pure_layers_do_no_io(room: str) -> None:
    wrong = []
    for module, path in MODULES.items():
        if _room(module) != room:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            wrong += [f"{module}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in IMPURE]
    assert wrong == []
