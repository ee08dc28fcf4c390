#!/usr/bin/env bash
# Set up .venv with the test extras and run the test suite (extra arguments go to pytest).
#
#   scripts/test.sh                  the whole suite, as CI runs it (.ci/run), on two workers (pytest-xdist,
#                                    a module's tests on one of them; -n 0 runs it in this process)
#   scripts/test.sh --fast [ARGS]    the fast loop: the suite less the slow, spark, docker, ucx, netns and heavy
#                                    groups (tests/conftest.py says what is heavy, by path), in under three
#                                    minutes on two cores; ARGS go to pytest too (a -m of yours replaces it)
set -euo pipefail
cd "$(dirname "$0")/.."
# ucx: the UCX transport and RMA tests run wherever ucxx installs (it needs no GPU).
# spark: a real local Spark session (PySpark 4 needs Java 17+, which scripts/ensure-java.sh checks).
# dev: ruff and mypy, which tests/house/test_house.py runs.
# metrics: prometheus-client, for dissoc serve --metrics (tests/base/test_metrics.py).
# jit: numba, for the codec's compiled kernels (tests/codec/test_jit.py, test_encode_paths.py).
scripts/setup-venv.sh test,dev,ucx,spark,metrics,jit
if [ "${1:-}" = --fast ]; then
    shift
    # The spark group is left out, so Java is not needed.
    exec .venv/bin/python -m pytest -q -m "not (slow or spark or docker or ucx or netns or heavy)" "$@"
fi
scripts/ensure-java.sh || echo "no Java 17+: the spark tests will be skipped" >&2
scripts/ensure-net-tools.sh || echo "no ip/nft/nsenter: the netns (cluster) tests will be skipped" >&2
exec .venv/bin/python -m pytest -q -n 2 --dist loadscope "$@"
