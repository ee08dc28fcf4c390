#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh test
exec .venv/bin/python -m pytest -q "$@"
