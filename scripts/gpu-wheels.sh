#!/usr/bin/env bash
# Download the wheels that a GPU machine without network access lacks to run scripts/gpu-check.sh (the gpu
# test group and benchmarks/gpu.py). Run it where the package index answers, then carry the folder over with
# the checkout.
#
#   scripts/gpu-wheels.sh [DIR]     download into DIR (default .whl/, git-ignored); prints each wheel's size
#                                   and the total, and fails when the folder is over 60 MiB
#   scripts/gpu-wheels.sh --list    print the pinned requirements, one a line, and download nothing
#
# The target: Python 3.12 on x86-64 Linux (manylinux), a CUDA 13 driver, with numpy, pyarrow, cupy-cuda13x,
# pytest, pytest-timeout, hypothesis, flatbuffers, pandas and prometheus-client installed. dissoc itself comes
# from the checkout (PYTHONPATH), so it is not among the wheels. Each wheel is downloaded on its own
# (--no-deps), at a pinned version, for that interpreter and platform, whatever this machine runs.
#
# ucxx-cu13 requires more than it imports. Left out, because neither ucxx's transport nor dissoc imports
# them (ucxx's benchmarks do), and with them the folder would be about 72 MiB:
#   rmm-cu13 and its cuda-bindings (about 9 MiB), cuda-core (6.3 MiB) and its cuda-pathfinder.
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT_MIB=60
PY_VERSION=3.12
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

# name==version  # why it is needed
WHEELS=(
    "ucxx-cu13==0.52.0"          # the UCX transport (the ucx-packed path, the gpu tests over UCX)
    "libucxx-cu13==0.52.0"       # ucxx's C++ library
    "libucx-cu13==1.21.0"        # UCX itself (libucxx-cu13 0.52 requires libucx-cu13 < 1.22)
    "librmm-cu13==26.10.0"       # libucxx's loader imports librmm before it loads UCX
    "rapids-logger==0.3.0"       # librmm's loader imports it
    "nvidia-ml-py==13.615.71"    # pynvml: ucxx sizes UCX's CUDA registrations from it
    "lz4==4.4.5"                 # dissoc's requirements the machine lacks
    "zstandard==0.25.0"
    "pytest-asyncio==1.5.0"      # the test extra's
    "typing-extensions==4.16.0"  # pytest-asyncio's, on Python < 3.13
)

if [ "${1:-}" = --list ]; then
    printf '%s\n' "${WHEELS[@]}"
    exit 0
fi
case "${1:-}" in -*) echo "usage: scripts/gpu-wheels.sh [--list | DIR]" >&2; exit 2 ;; esac
dir="${1:-.whl}"

if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi

# Into a fresh folder beside DIR first: DIR ends up holding exactly these wheels, none left from another pin.
mkdir -p "$dir"
staging="$(mktemp -d "$dir/.download.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
platform_args=()
for p in "${PLATFORMS[@]}"; do
    platform_args+=(--platform "$p")
done
for req in "${WHEELS[@]}"; do
    echo "downloading $req" >&2
    "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$PY_VERSION" --implementation cp "${platform_args[@]}" \
        --dest "$staging" "$req"
done
find "$dir" -maxdepth 1 -type f -name '*.whl' -delete
mv "$staging"/*.whl "$dir"/

total=0
for w in "$dir"/*.whl; do
    size=$(stat -c %s "$w")
    total=$((total + size))
    awk -v s="$size" -v n="$(basename "$w")" 'BEGIN { printf "%8.1f MiB  %s\n", s / 1048576, n }'
done
awk -v s="$total" -v d="$dir" 'BEGIN { printf "%8.1f MiB  in all, in %s\n", s / 1048576, d }'
if [ "$total" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "over the ${LIMIT_MIB} MiB that can be carried to the GPU machine" >&2
    exit 1
fi
