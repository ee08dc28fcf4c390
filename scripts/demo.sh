#!/usr/bin/env bash
# Set up .venv and run the main job: the dissoc demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh
exec .venv/bin/python -m dissoc.demo "$@"
