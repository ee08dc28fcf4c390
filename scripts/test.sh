#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
# ucx: the UCX transport and RMA tests run wherever ucxx installs (it needs no GPU).
# spark: a real local Spark session (PySpark 4 needs Java 17+, which scripts/ensure-java.sh checks).
# dev: ruff and mypy, which tests/test_house.py runs.
# metrics: prometheus-client, for dissoc serve --metrics (tests/test_metrics.py).
# jit: numba, for the codec's compiled kernels (tests/codec/test_jit.py, test_encode_paths.py).
scripts/setup-venv.sh test,dev,ucx,spark,metrics,jit
scripts/ensure-java.sh || echo "no Java 17+: the spark tests will be skipped" >&2
exec .venv/bin/python -m pytest -q "$@"
