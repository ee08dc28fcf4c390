"""The cluster helper itself: when it can run, that its hosts are apart, and that it leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from cluster import netns
from cluster.netns import Cluster


def test_without_root_or_tools_the_group_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.missing() == "network namespaces need root"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "nft" else f"/usr/sbin/{tool}")
    assert netns.missing() == "nft is not installed (package nftables; scripts/ensure-net-tools.sh)"


def test_a_bad_size_is_refused() -> None:
    with pytest.raises(ValueError, match="hosts: expected 1 to 200"):
        Cluster(0)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(netns.PREFIX)}


@pytest.mark.netns
def test_hosts_are_apart_and_everything_goes_even_on_failure() -> None:
    before = _namespaces()
    with pytest.raises(RuntimeError, match="the test failed here"), Cluster(2) as c:
        a, b = c.hosts
        assert (a.addr, b.addr) == ("10.213.0.1", "10.213.0.2")
        assert {a.ns, b.ns, c.switch} <= _namespaces()
        # each host has its own /dev/shm
        b.run(["sh", "-c", "echo x > /dev/shm/dissoc-netns-probe"])
        assert "dissoc-netns-probe" not in a.run(["ls", "/dev/shm"]).stdout
        # and reaches the other; not after a partition; again once healed
        reach = [sys.executable, "-c", f"import socket; socket.create_connection(('{b.addr}', 9), 1)"]
        assert (
            "ConnectionRefusedError" in a.run(reach, check=False).stderr
        )  # b answers: nothing listens there
        c.partition(a, b)
        assert "TimeoutError" in a.run(reach, check=False).stderr
        c.heal()
        assert "ConnectionRefusedError" in a.run(reach, check=False).stderr
        sleeper = b.popen(["sleep", "60"])
        raise RuntimeError("the test failed here")
    assert sleeper.poll() is not None  # killed with the cluster
    assert _namespaces() == before
