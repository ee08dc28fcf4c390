#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
# ucx: the UCX transport and RMA tests run wherever ucxx installs (it needs no GPU).
scripts/setup-venv.sh test,ucx
exec .venv/bin/python -m pytest -q "$@"
