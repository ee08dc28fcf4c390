#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install dissoc with the given extras.
# Usage: scripts/setup-venv.sh [EXTRAS]   e.g. scripts/setup-venv.sh test
# Nothing is installed when .venv already holds this checkout's dissoc (editable, this version) and every
# requirement of those extras; DISSOC_REINSTALL=1 installs anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
current() {
    .venv/bin/python -I - "$extras" <<'PY'
import json
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

root = Path.cwd().resolve()
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
dist = metadata.distribution(project["name"])
direct = json.loads(dist.read_text("direct_url.json") or "{}")
assert dist.version == project["version"], "another version"
assert direct.get("dir_info", {}).get("editable"), "not editable"
assert direct.get("url") == root.as_uri(), "installed from elsewhere"
wanted = list(project["dependencies"])
pending, seen = [e for e in sys.argv[1].split(",") if e], set()
while pending:
    extra = pending.pop()
    if extra in seen:
        continue
    seen.add(extra)
    for text in project["optional-dependencies"][extra]:
        req = Requirement(text)
        if canonicalize_name(req.name) == canonicalize_name(project["name"]):
            pending.extend(req.extras)
        else:
            wanted.append(text)
for text in wanted:
    req = Requirement(text)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        assert req.specifier.contains(metadata.version(req.name), prereleases=True), text
# The C modules are built in place by the editable install: built again when a source changed since.
import shutil
import sysconfig
if shutil.which("cc") or shutil.which("gcc"):
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for source in (root / "dissoc").rglob("*.c"):
        built = source.with_name(source.stem + suffix)
        assert built.exists() and built.stat().st_mtime >= source.stat().st_mtime, f"{source} changed"
PY
}
if [ "${DISSOC_REINSTALL:-0}" != 1 ] && current >/dev/null 2>&1; then
    exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if [ -n "$extras" ]; then
    .venv/bin/python -m pip install -q -e ".[${extras}]"
else
    .venv/bin/python -m pip install -q -e .
fi
