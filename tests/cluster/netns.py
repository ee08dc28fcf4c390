"""A cluster of "hosts" on this machine: network namespaces joined by a bridge, each with its own /dev/shm.

:class:`Cluster` makes ``n`` hosts, each a network namespace with one address (``10.213.0.1``, ``.2``, ...)
on an ``eth0`` joined to a bridge in a switch namespace of its own, and a mount namespace with its own
``/dev/shm`` (so shared memory is not shared between hosts, as between machines). Commands run in a host
through ``nsenter``; everything the cluster made -- processes started in it, namespaces, links, rules -- is
removed when the ``with`` block ends, also when it fails. Nothing is added to this machine's own network:
the addresses exist only inside the namespaces.

Faults on the links: :meth:`Cluster.shape` (a bandwidth cap, ``tc tbf``, and random loss, ``nft numgen``),
:meth:`Cluster.partition` (every packet between two hosts dropped, both ways or one), :meth:`Cluster.reset`
(TCP resets for a port), :meth:`Cluster.vanish` (a host gone without a FIN: its link removed, then its
processes killed), and :meth:`Cluster.heal` to take the rules out again.

Needs root, ``ip`` (iproute2), ``nsenter``/``unshare`` (util-linux), ``tc`` and ``nft`` (nftables):
:func:`missing` says which is absent.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Cluster", "Host", "missing"]

SUBNET = "10.213.0"
PREFIX = "dscl"
_TOOLS = ("ip", "nsenter", "unshare", "tc", "nft")
_counter = itertools.count()


def missing() -> str | None:
    """Why clusters cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in _TOOLS:
        if shutil.which(tool) is None:
            package = {"nft": "nftables", "tc": "iproute2", "ip": "iproute2"}.get(tool, "util-linux")
            return f"{tool} is not installed (package {package}; scripts/ensure-net-tools.sh)"
    probe = f"{PREFIX}probe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot make a network namespace ({done.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str, ns: str | None = None, stdin: str | None = None) -> str:
    cmd = list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


@dataclass(eq=False)
class Host:
    """One host of a :class:`Cluster`: its namespace, address and the processes started in it."""

    index: int
    ns: str
    addr: str
    peer: str  # its link's end in the switch namespace
    holder: subprocess.Popen[bytes] | None = None  # holds the host's mount namespace (its /dev/shm)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"h{self.index}"

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run in this host (its network and mount namespaces)."""
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-m", "--", *cmd]

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in this host (killed when the cluster goes, if still running)."""
        proc = subprocess.Popen(self.argv(cmd), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str], *, timeout: float = 60, check: bool = True, **kwargs: Any) -> Any:
        """Run ``cmd`` in this host to its end (``subprocess.run``; output captured as text by default)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(cmd), timeout=timeout, check=check, **kwargs)

    def nft(self, script: str) -> None:
        """Apply an nft script in this host's network namespace."""
        _sh("nft", "-f", "-", ns=self.ns, stdin=script)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process started in this host (their whole process groups)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


class Cluster:
    """``hosts`` network namespaces on one bridge (see the module doc); a context manager."""

    def __init__(self, hosts: int) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts: expected 1 to 200, got {hosts}")
        self.id = f"{PREFIX}{os.getpid() % 100000}x{next(_counter)}"
        self.switch = f"{self.id}sw"
        self.hosts = [Host(i, f"{self.id}h{i}", f"{SUBNET}.{i + 1}", f"v{i}") for i in range(hosts)]
        self._made: list[str] = []
        self._tc: list[tuple[str, str]] = []  # (namespace, device) with a qdisc of ours

    # -- lifetime ---------------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            _sh("ip", "netns", "add", host.ns)
            self._made.append(host.ns)
            _sh(
                "ip", "link", "add", "eth0", "netns", host.ns, "type", "veth",
                "peer", "name", host.peer, "netns", self.switch,
            )  # fmt: skip
            _sh("ip", "-n", self.switch, "link", "set", host.peer, "master", "br0", "up")
            _sh("ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", host.ns, "link", "set", "lo", "up")
            # A process that keeps the host's own mount namespace, with a /dev/shm of its own.
            host.holder = subprocess.Popen(
                [
                    "ip", "netns", "exec", host.ns, "unshare", "-m", "--propagation", "private", "sh", "-c",
                    "mount -t tmpfs -o size=4g tmpfs /dev/shm && echo ready && exec sleep infinity",
                ],
                stdout=subprocess.PIPE,
                start_new_session=True,
            )  # fmt: skip
            assert host.holder.stdout is not None
            if host.holder.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"{host.name}: its mount namespace could not be made")

    def close(self) -> None:
        """Kill what runs in the hosts and remove every namespace, link and rule of the cluster."""
        for host in self.hosts:
            host.kill()
            if host.holder is not None and host.holder.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(host.holder.pid, signal.SIGKILL)
                host.holder.wait(timeout=10)
        for ns in reversed(self._made):  # the hosts', then the switch's (its links go with it)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    # -- faults -----------------------------------------------------------------------------------------

    def shape(self, rate: str | None = "1gbit", loss_percent: float = 0, hosts: Sequence[Host] = ()) -> None:
        """Cap each link at ``rate`` both ways (``tc tbf``; None: no cap) and drop ``loss_percent`` of the
        TCP and UDP packets each host sends (``nft``), on ``hosts`` (default: all)."""
        for host in hosts or self.hosts:
            if rate is not None:
                for ns, dev in ((host.ns, "eth0"), (self.switch, host.peer)):
                    _sh(
                        "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                        "burst", "256kb", "latency", "100ms", ns=ns,
                    )  # fmt: skip
                    self._tc.append((ns, dev))
            if loss_percent:
                per_mille = round(loss_percent * 10)
                host.nft(
                    "table inet dsc_loss {\n"
                    "  chain out { type filter hook output priority 0; policy accept;\n"
                    f"    meta l4proto {{ tcp, udp }} ip daddr {SUBNET}.0/24"
                    f" numgen random mod 1000 < {per_mille} drop\n"
                    "  }\n"
                    "}\n"
                )

    def partition(self, a: Host, b: Host, *, one_way: bool = False) -> None:
        """Drop every packet from ``a`` to ``b`` and, unless ``one_way``, from ``b`` to ``a`` (silently: no
        reset, no ICMP)."""
        pairs = [(a, b)] if one_way else [(a, b), (b, a)]
        for src, dst in pairs:
            src.nft(
                f"table inet dsc_part_{dst.index} {{\n"
                "  chain out { type filter hook output priority 0; policy accept;\n"
                f"    ip daddr {dst.addr} drop\n"
                "  }\n"
                "  chain in { type filter hook input priority 0; policy accept;\n"
                f"    ip saddr {dst.addr} drop\n"
                "  }\n"
                "}\n"
            )
            if one_way:  # only a's packets to b are lost: b still reaches a
                _sh("nft", "delete", "chain", "inet", f"dsc_part_{dst.index}", "in", ns=src.ns)

    def reset(self, host: Host, port: int | None = None) -> None:
        """Answer every TCP packet arriving at ``host``'s ``port`` (None: any port) with a reset."""
        match = "" if port is None else f" tcp dport {port}"
        host.nft(
            "table inet dsc_reset {\n"
            "  chain in { type filter hook input priority 0; policy accept;\n"
            f"    ip daddr {host.addr} meta l4proto tcp{match} reject with tcp reset\n"
            "  }\n"
            "}\n"
        )

    def heal(self) -> None:
        """Take every fault rule and bandwidth cap out again."""
        for host in self.hosts:
            tables = _sh("nft", "list", "tables", ns=host.ns).split()
            for name in tables:
                if name.startswith("dsc_"):
                    _sh("nft", "delete", "table", "inet", name, ns=host.ns)
        for ns, dev in self._tc:
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True
            )
        self._tc.clear()

    def vanish(self, host: Host) -> None:
        """``host`` disappears without a word: its link is removed (nothing it sends gets out, no FIN, no
        reset), then its processes are killed."""
        _sh("ip", "-n", self.switch, "link", "del", host.peer)
        host.kill()


@contextlib.contextmanager
def cluster(hosts: int) -> Iterator[Cluster]:
    with Cluster(hosts) as c:
        yield c
