#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install dissoc with the given extras.
# Usage: scripts/setup-venv.sh [EXTRAS]   e.g. scripts/setup-venv.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if [ -n "$extras" ]; then
    .venv/bin/python -m pip install -q -e ".[${extras}]"
else
    .venv/bin/python -m pip install -q -e .
fi
