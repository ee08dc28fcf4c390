"""``dissoc serve`` options from flags, the environment (DISSOC_*) and a TOML file: one precedence
(flag > environment > file > default), every value checked as its flag's, and an unknown key or a bad value
refused at start naming the key and where it came from."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest
from helpers.e2e import PYTHON, REPO

from dissoc.cli import parse_args
from dissoc.config import Layered
from dissoc.server.options import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS_PER_PEER


def serve(
    *argv: str, env: dict[str, str] | None = None, file: str | None = None, tmp: Path | None = None
) -> tuple[argparse.Namespace, Layered]:
    args_list = ["serve", *argv]
    if file is not None:
        assert tmp is not None
        path = tmp / "dissoc.toml"
        path.write_text(file)
        args_list += ["--config", str(path)]
    args, layered = parse_args(args_list, environ=env or {})
    assert layered is not None
    return args, layered


def usage_error(
    capsys: pytest.CaptureFixture[str],
    *argv: str,
    env: dict[str, str] | None = None,
    file: str | None = None,
    tmp: Path | None = None,
) -> str:
    with pytest.raises(SystemExit) as e:
        serve(*argv, env=env, file=file, tmp=tmp)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: dissoc serve" in err
    return err


def test_defaults_when_nothing_is_given() -> None:
    args, layered = serve("x.arrow")
    assert args.paths == ["x.arrow"]
    assert args.max_connections_per_peer == DEFAULT_MAX_CONNECTIONS_PER_PEER
    assert args.idle_timeout == DEFAULT_IDLE_TIMEOUT
    assert args.split is False and args.resident is True
    assert args.log_format == "text" and args.transport == "tcp"
    assert layered.sources["paths"] == "flag"
    assert layered.sources["idle_timeout"] == "default"


def test_flag_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    file = 'max-connections-per-peer = 3\nidle_timeout = 7\nwant-data-timeout = 2.5\ntransport = "tcp"\n'
    env = {"DISSOC_MAX_CONNECTIONS_PER_PEER": "5", "DISSOC_IDLE_TIMEOUT": "9"}
    args, layered = serve("--idle-timeout", "11", "x.arrow", env=env, file=file, tmp=tmp_path)
    assert args.idle_timeout == 11.0 and layered.sources["idle_timeout"] == "flag"
    assert args.max_connections_per_peer == 5
    assert layered.sources["max_connections_per_peer"] == "env DISSOC_MAX_CONNECTIONS_PER_PEER"
    assert args.want_data_timeout == 2.5
    assert "configuration file" in layered.sources["want_data_timeout"]
    assert args.max_ticket_bytes == 64 << 10 and layered.sources["max_ticket_bytes"] == "default"


def test_switches_and_paths_from_environment_and_file(tmp_path: Path) -> None:
    env = {
        "DISSOC_SPLIT": "yes",
        "DISSOC_NO_RESIDENT": "on",
        "DISSOC_PATHS": os.pathsep.join(["a.arrow", "b.parquet"]),
    }
    args, _ = serve(env=env)
    assert args.split is True and args.resident is False
    assert args.paths == ["a.arrow", "b.parquet"]
    args, _ = serve(file='split = false\nno-resident = false\npaths = ["c.arrow"]\n', tmp=tmp_path)
    assert args.split is False and args.resident is True and args.paths == ["c.arrow"]
    # a switch given on the command line wins over a file saying false
    args, layered = serve("--split", file="split = false\npaths = ['d.arrow']\n", tmp=tmp_path)
    assert args.split is True and layered.sources["split"] == "flag"


def test_config_file_named_by_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('paths = ["e.arrow"]\nlog-format = "json"\n')
    args, _ = serve(env={"DISSOC_CONFIG": str(path)})
    assert args.paths == ["e.arrow"] and args.log_format == "json"


@pytest.mark.parametrize(
    ("env", "file", "expected"),
    [
        ({}, "bogus = 1\n", "key 'bogus' of configuration file"),
        ({}, "max-connections-per-peer = -3\n", "key 'max-connections-per-peer'"),
        ({}, 'transport = "pigeon"\n', "choose from tcp, ucx"),
        ({}, "split = 1\n", "expected true or false"),
        ({}, "log-format = 3\n", "choose from text, json"),
        ({}, "port = 70000\n", "out of range"),
        ({}, "idle-timeout = [1]\n", "expected a string or a number"),
        ({}, "max-connections = 1\nmax_connections = 2\n", "given twice"),
        ({}, "this is = not toml\n", "not valid TOML"),
        ({"DISSOC_PORT": "http"}, "", "environment variable DISSOC_PORT"),
        ({"DISSOC_SPLIT": "maybe"}, "", "environment variable DISSOC_SPLIT: expected 1/0"),
        ({"DISSOC_IDLE_TIMEOUT": "-1"}, "", "environment variable DISSOC_IDLE_TIMEOUT"),
        ({"DISSOC_CONFIG": "/nonexistent/dissoc.toml"}, None, "configuration file /nonexistent/dissoc.toml"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_keys_and_values_are_usage_errors_naming_key_and_source(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, env: dict[str, str], file: str | None, expected: str
) -> None:
    err = usage_error(capsys, "x.arrow", env=env, file=file, tmp=tmp_path)
    assert expected in err, err


def test_no_path_from_anywhere_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = usage_error(capsys)
    assert "no PATH to serve" in err
    err = usage_error(capsys, file='paths = "x.arrow"\n', tmp=tmp_path)
    assert "key 'paths'" in err and "expected a list of strings" in err


def test_unknown_environment_variables_are_reported_not_refused() -> None:
    env = {"DISSOC_MAX_CONECTIONS": "3", "DISSOC_TOKEN": "t", "DISSOC_DEVICE_BACKEND": "fake", "OTHER": "1"}
    env["DISSOC_SOMETHING_ELSE"] = "1"  # another tool's: not like any option
    _, layered = serve("x.arrow", env=env)
    assert layered.unknown_env == [("DISSOC_MAX_CONECTIONS", "DISSOC_MAX_CONNECTIONS")]


def test_the_command_warns_of_unknown_variables_and_fails_on_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("max-conections = 3\n")
    env = {**os.environ, "DISSOC_CONFIG": str(bad)}
    result = subprocess.run(
        [PYTHON, "-m", "dissoc.cli", "serve", "x.arrow"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "max-conections" in result.stderr and str(bad) in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    env = {**os.environ, "DISSOC_MAX_CONECTIONS": "3"}
    env.pop("DISSOC_CONFIG", None)
    result = subprocess.run(
        [PYTHON, "-m", "dissoc.cli", "serve", str(tmp_path / "missing.arrow")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1  # the missing file, after the warning
    assert "DISSOC_MAX_CONECTIONS names no 'dissoc serve' option (DISSOC_MAX_CONNECTIONS?)" in result.stderr
