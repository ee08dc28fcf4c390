#!/usr/bin/env bash
# The device check, for a GPU machine without network access: install the wheels of .whl/ (downloaded by
# scripts/gpu-wheels.sh where the package index answers, and carried over with the checkout) beside the
# machine's own packages, print the environment, run the gpu test group and benchmarks/gpu.py, and write a log
# and a JSON summary.
#
#   bash scripts/gpu-check.sh [--fake] [OUT_DIR]
#
# OUT_DIR: the argument, else $OUT when it is set, else gpu-check-out/ (git-ignored). It receives
#   gpu-check.log     everything printed
#   gpu-check.json    the summary: each step's status and time, the environment, the test counts and both
#                     benchmark reports
#   env.json, pytest-gpu.xml (JUnit), bench.json, bench-reuse.json, streams.json   what the steps wrote
#
# The steps, each with its own time limit (under 8 minutes in all); one that fails or runs out of time is
# recorded and the next one runs:
#   install      pip install --no-index --no-deps --target <a temporary folder> .whl/*.whl, put on PYTHONPATH
#                (the machine's packages are left as they are; dissoc itself comes from this checkout)
#   env          nvidia-smi's driver and CUDA version, the GPU, and the versions of Python, CuPy, ucxx,
#                pyarrow and numpy; fails when CuPy sees no device or ucxx does not import
#   native       the UCX transport's C module (dissoc/transport/ucx/_fast.c) compiled in place for this Python,
#                where a C compiler and Python's headers are at hand (skipped otherwise: the transport then
#                goes through ctypes, slower per small message); env says which the run used
#   tests        python -m pytest -m gpu tests/device (every gpu-marked test is there)
#   bench        benchmarks/gpu.py --sizes 16,256 --total-mib 1024 --repeat 5
#   bench-reuse  the same with --reuse-connections, for the paths it changes (ucx-packed, cuda-ipc-pairs-copy)
#   streams      benchmarks/gpu.py --streams: a warm client's time per device stream, and the control per
#                batch of CUDA IPC pairs
# The exit status is 0 when every step passed (or was skipped) and, on a GPU, a gpu test ran; else 1.
#
# --fake: for a machine without CUDA, to exercise this script: nothing is installed (the environment is the
# machine's own), the gpu tests skip, and the benchmark runs on its fake device backend at small sizes (it
# still needs ucxx for its ucx-packed path). Not a measurement.
#
# Environment: PYTHON (default .venv/bin/python where it exists, else python3); WHEELS (default .whl).
set -uo pipefail
caller="$PWD"
script="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$script")/.."

fake=0
out=""
for arg in "$@"; do
    case "$arg" in
        --fake) fake=1 ;;
        -h | --help) sed -n '2,/^set -uo/p' "$script" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "usage: bash scripts/gpu-check.sh [--fake] [OUT_DIR]" >&2; exit 2 ;;
        *) out="$arg" ;;
    esac
done
# OUT_DIR and WHEELS are taken from where the script was started; the defaults are in the checkout.
out="${out:-${OUT:-}}"
if [ -n "$out" ]; then
    case "$out" in /*) ;; *) out="$caller/$out" ;; esac
else
    out=gpu-check-out
fi
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
wheels="${WHEELS:-.whl}"
if [ -n "${WHEELS:-}" ]; then
    case "$wheels" in /*) ;; *) wheels="$caller/$wheels" ;; esac
fi
if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ -x .venv/bin/python ]; then
    py="$PWD/.venv/bin/python"
else
    py=python3
fi

# Time limits in seconds: 40 + 30 + 20 + 140 + 110 + 60 + 40, plus 5 s of grace each, is 475 s (the H200 run of
# the whole check took 112 s).
LIMIT_INSTALL=40
LIMIT_ENV=30
LIMIT_NATIVE=20
LIMIT_TESTS=140
LIMIT_BENCH=110
LIMIT_BENCH_REUSE=60
LIMIT_STREAMS=40

# step NAME LIMIT COMMAND...: runs COMMAND under LIMIT seconds and records NAME's status in steps.tsv.
step() {
    local name="$1" limit="$2" start=$SECONDS rc=0 status
    shift 2
    echo "== $name (limit ${limit}s): $*" >&2
    timeout -k 5 "$limit" "$@" || rc=$?
    case "$rc" in
        0) status=passed ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    echo "== $name: $status (exit $rc) in $((SECONDS - start))s" >&2
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - start))" >>"$out/steps.tsv"
}

skip() {  # skip NAME WHY
    echo "== $1: skipped ($2)" >&2
    printf '%s\tskipped\t\t0\t%s\n' "$1" "$2" >>"$out/steps.tsv"
}

main() {
    local started=$SECONDS
    rm -f "$out/steps.tsv" "$out/env.json" "$out/pytest-gpu.xml" "$out/bench.json" "$out/bench-reuse.json" "$out/streams.json" \
        "$out/gpu-check.json"
    echo "gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ), fake=$fake, python=$py, out=$out" >&2

    # --- install
    site=""
    if [ "$fake" = 1 ]; then
        skip install "--fake: this machine's own packages"
    elif ! compgen -G "$wheels/*.whl" >/dev/null; then
        skip install "no wheels in $wheels (scripts/gpu-wheels.sh downloads them)"
    else
        site="$(mktemp -d "${TMPDIR:-/tmp}/dissoc-gpu-check.XXXXXX")"
        if "$py" -m pip --version >/dev/null 2>&1; then
            step install "$LIMIT_INSTALL" "$py" -m pip install --no-index --no-deps --no-compile \
                --disable-pip-version-check --quiet --target "$site" "$wheels"/*.whl
        else  # no pip: a wheel is a zip of what goes into site-packages
            step install "$LIMIT_INSTALL" "$py" -c \
                'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
                "$site" "$wheels"/*.whl
        fi
    fi
    export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"

    # --- native
    if [ "$fake" = 1 ]; then
        skip native "--fake: this checkout's own build"
    elif ! command -v cc >/dev/null 2>&1; then
        skip native "no C compiler: the UCX transport goes through ctypes"
    else
        step native "$LIMIT_NATIVE" "$py" - <<'PY'
import os
import subprocess
import sys
import sysconfig

source = "dissoc/transport/ucx/_fast.c"
target = os.path.join(os.path.dirname(source), "_fast" + sysconfig.get_config_var("EXT_SUFFIX"))
include = sysconfig.get_paths()["include"]
if not os.path.exists(os.path.join(include, "Python.h")):
    print(f"no Python.h in {include}: the UCX transport goes through ctypes")
    sys.exit(1)
argv = ["cc", "-O2", "-shared", "-fPIC", f"-I{include}", source, "-o", target]
print(" ".join(argv))
sys.exit(subprocess.run(argv).returncode)
PY
    fi

    # --- env
    step env "$LIMIT_ENV" "$py" - "$out/env.json" "$fake" <<'PY'
import importlib
import json
import os
import platform
import subprocess
import sys

path, fake = sys.argv[1], sys.argv[2] == "1"
env: dict = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform()}


def smi(*args):
    try:
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


head = smi()
cuda_lines = [line.strip(" |") for line in (head or "").splitlines() if "CUDA Version" in line]
env["nvidia_smi"] = cuda_lines[0] if cuda_lines else None
env["gpus"] = (smi("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader") or "").split("\n")
env["gpus"] = [g.strip() for g in env["gpus"] if g.strip()]
print(f"python {env['python']} ({sys.executable}), {env['platform']}")
print(f"nvidia-smi: {env['nvidia_smi'] or 'not found'}")
for gpu in env["gpus"]:
    print(f"gpu: {gpu}")

packages: dict = {}
try:
    from dissoc.transport.ucx.calls import native_module

    env["ucx_calls"] = "C module" if native_module() is not None else "ctypes"
except Exception as exc:
    env["ucx_calls"] = f"unknown ({type(exc).__name__}: {exc})"
print(f"UCX per-message calls: {env['ucx_calls']}")
for name in ("dissoc", "numpy", "pyarrow", "cupy", "ucxx", "lz4", "zstandard", "pytest", "pytest_asyncio"):
    try:
        module = importlib.import_module(name)
        info = {"version": str(getattr(module, "__version__", "?")), "from": os.path.dirname(module.__file__)}
        if name == "cupy":
            rt = module.cuda.runtime
            info["cuda_runtime"] = rt.runtimeGetVersion()
            info["cuda_driver"] = rt.driverGetVersion()
            info["devices"] = rt.getDeviceCount()
            if info["devices"]:
                device_name = rt.getDeviceProperties(0)["name"]
                info["device"] = device_name.decode() if isinstance(device_name, bytes) else str(device_name)
        if name == "ucxx":
            info["ucx"] = ".".join(map(str, module.get_ucx_version()))
    except Exception as exc:  # reported, and judged below
        info = {"error": f"{type(exc).__name__}: {exc}"}
    packages[name] = info
    extra = {k: v for k, v in info.items() if k not in ("version", "from", "error")}
    said = info.get("error") or f"{info['version']} {extra if extra else ''}".strip()
    print(f"{name}: {said}" + (f"  ({info['from']})" if "from" in info else ""))
env["packages"] = packages
with open(path, "w") as f:
    json.dump(env, f, indent=2)

needed = ["dissoc", "numpy", "pyarrow", "pytest_asyncio"]
if not fake:
    needed += ["cupy", "ucxx", "lz4", "zstandard"]
missing = [n for n in needed if "error" in packages[n]]
if not fake and not missing and not packages["cupy"].get("devices"):
    missing.append("cupy sees no CUDA device")
if missing:
    print(f"missing: {', '.join(missing)}")
    sys.exit(1)
PY

    # --- tests
    step tests "$LIMIT_TESTS" "$py" -m pytest -m gpu -v -rs --timeout 60 -p no:cacheprovider \
        --junitxml "$out/pytest-gpu.xml" tests/device

    # --- benchmarks
    local sizes=(--sizes 16,256 --total-mib 1024 --repeat 5)
    if [ "$fake" = 1 ]; then
        sizes=(--fake --sizes 2 --total-mib 8 --repeat 1)
    fi
    step bench "$LIMIT_BENCH" "$py" benchmarks/gpu.py "${sizes[@]}" --json >"$out/bench.json"
    step bench-reuse "$LIMIT_BENCH_REUSE" "$py" benchmarks/gpu.py "${sizes[@]}" --reuse-connections \
        --only ucx-packed,cuda-ipc-pairs-copy --json >"$out/bench-reuse.json"
    local counts=(--repeat 9 --batches 4000)
    if [ "$fake" = 1 ]; then
        counts=(--fake --repeat 3 --batches 300)
    fi
    step streams "$LIMIT_STREAMS" "$py" benchmarks/gpu.py --streams "${counts[@]}" --json >"$out/streams.json"

    # --- summary
    "$py" - "$out" "$fake" "$((SECONDS - started))" <<'PY'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, fake, seconds = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])


def read_json(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, rc, secs, *why = line.split("\t")
    entry = {"name": name, "status": status, "rc": int(rc) if rc else None, "seconds": int(secs)}
    if why:
        entry["why"] = why[0]
    steps.append(entry)
tests = None
try:
    suite = ET.parse(out / "pytest-gpu.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    tests = counts
except (OSError, ET.ParseError, AttributeError):
    pass
problems = [f"{s['name']}: {s['status']}" for s in steps if s["status"] not in ("passed", "skipped")]
if not fake and tests is not None and tests["passed"] == 0:
    problems.append("tests: no gpu test ran (every one was skipped)")
summary = {
    "fake": fake,
    "passed": not problems,
    "problems": problems,
    "seconds": seconds,
    "steps": steps,
    "env": read_json("env.json"),
    "tests": tests,
    "bench": read_json("bench.json"),
    "bench_reuse": read_json("bench-reuse.json"),
    "streams": read_json("streams.json"),
}
(out / "gpu-check.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"\ngpu-check: {'passed' if summary['passed'] else 'FAILED'} in {seconds}s")
for s in steps:
    why = f"  ({s['why']})" if "why" in s else ""
    print(f"  {s['name']:<12} {s['status']:<8} {s['seconds']:>4}s{why}")
if tests:
    print(f"  tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
          f"{tests['skipped']} skipped")
for problem in problems:
    print(f"  problem: {problem}")
print(f"  {out / 'gpu-check.json'}")
sys.exit(0 if summary["passed"] else 1)
PY
    local rc=$?
    if [ -n "$site" ]; then
        rm -rf "$site"
    fi
    return $rc
}

main 2>&1 | tee "$out/gpu-check.log"
exit "${PIPESTATUS[0]}"
