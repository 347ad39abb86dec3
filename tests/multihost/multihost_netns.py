"""Separate hosts on one machine: network namespaces joined by a bridge.

``open_network(["r", "e1", ...])`` makes one namespace per host, each with an
``eth0`` on its own address from the benchmarking range 198.18.0.0/15 (RFC
2544) and loopback, and a switch: a bridge in a namespace of its own, so the
machine's own namespace gains nothing and sees nothing. ``Host.popen`` runs a
process on a host (``ip netns exec``); ``Host.cut`` and ``restore`` take its
cable out and put it back; ``Host.use_nameserver`` gives it a resolver (``ip
netns exec`` mounts ``/etc/netns/NAME/resolv.conf`` over ``/etc/resolv.conf``).

Every name carries a random tag, so parallel runs never meet. Leaving the
block kills every process still in a namespace (those are this run's own),
then deletes the namespaces, whose interfaces go with them, and the resolver
files, even when the test failed. Where namespaces cannot be made the tests
skip, unless ``EPD_REQUIRE_NETNS=1`` (CI), where they fail.

Test traffic goes only to loopback and to these namespaces' addresses.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

NETNS_ETC = Path("/etc/netns")
COMMAND_TIMEOUT = 30.0  # seconds one `ip` command may take
KILL_GRACE = 5.0  # seconds a process gets after SIGTERM at teardown before SIGKILL


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                          check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _is_up(netns: str, interface: str) -> bool:
    shown = _ip("-n", netns, "-o", "link", "show", interface, check=False).stdout
    return "state UP" in shown


def netns_problem() -> str | None:
    """Why namespaces cannot be made here (None when they can): tried, not guessed."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"epd-probe-{secrets.token_hex(4)}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {exc}"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def require_netns() -> None:
    """Skip (or with ``EPD_REQUIRE_NETNS=1`` fail) where namespaces cannot be made."""
    problem = netns_problem()
    if problem is None:
        return
    if os.environ.get("EPD_REQUIRE_NETNS") == "1":
        pytest.fail(f"multi-host tests need network namespaces: {problem}")
    pytest.skip(f"multi-host tests need network namespaces (root and iproute2): {problem}")


@dataclass
class Host:
    """One host: a namespace with ``eth0`` at ``address``, cabled to the switch by ``cable``."""

    label: str
    netns: str
    address: str
    cable: str  # the veth end on the switch
    switch: str  # the switch's namespace
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              log: Path | None = None, stdin: int | None = subprocess.DEVNULL,
              stdout: int | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
        """``argv`` on this host, in a session of its own (so ``kill`` reaches its children);
        stderr (and stdout unless given) into ``log``."""
        with ExitStack() as files:
            out = files.enter_context(log.open("ab")) if log is not None else subprocess.DEVNULL
            proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv],
                                    env=dict(os.environ if env is None else env), stdin=stdin,
                                    stdout=out if stdout is None else stdout, stderr=out,
                                    start_new_session=True)
        self.processes.append(proc)
        return proc

    def cut(self) -> None:
        """Take the cable out: the host is still up, nothing reaches it or leaves it."""
        _ip("-n", self.switch, "link", "set", self.cable, "down")

    def restore(self) -> None:
        """Put the cable back, and return once it carries traffic: both ends up, and no
        neighbour entry the cut left failed (a connect would wait on it or be refused)."""
        _ip("-n", self.switch, "link", "set", self.cable, "up")
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not (_is_up(self.switch, self.cable) and _is_up(self.netns, "eth0")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label}'s cable stays down after it was put back")
            time.sleep(0.05)
        _ip("-n", self.netns, "neigh", "flush", "all")

    def use_nameserver(self, address: str) -> None:
        """Resolve names through ``address`` (for processes started after this)."""
        folder = NETNS_ETC / self.netns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "resolv.conf").write_text(f"nameserver {address}\noptions timeout:1 attempts:2\n")

    def kill_all(self) -> None:
        """Kill every process on this host (all of them this run's own), SIGTERM first."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + KILL_GRACE
            while pids and time.monotonic() < deadline:
                time.sleep(0.05)
                pids = self.pids()
            if not pids:
                break
        for proc in self.processes:
            try:
                proc.wait(timeout=KILL_GRACE)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def pids(self) -> list[int]:
        listed = _ip("netns", "pids", self.netns, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]


@dataclass
class Network:
    tag: str
    switch: str
    subnet: str  # the first three octets
    hosts: dict[str, Host] = field(default_factory=dict)

    def __getitem__(self, label: str) -> Host:
        return self.hosts[label]

    def add(self, label: str) -> Host:
        index = len(self.hosts) + 1
        netns = f"epd-{self.tag}-{label}"
        cable = f"e{self.tag}{index}"  # at most 15 characters: an interface name's limit
        host = Host(label, netns, f"{self.subnet}.{index}", cable, self.switch)
        self.hosts[label] = host  # registered first: a half-made host is torn down too
        _ip("netns", "add", netns)
        # Made inside the two namespaces: nothing appears in the machine's own, even for a moment.
        _ip("link", "add", cable, "netns", self.switch, "type", "veth", "peer", "name", "eth0",
            "netns", netns)
        _ip("-n", self.switch, "link", "set", cable, "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return host

    def close(self) -> None:
        errors = []
        for host in self.hosts.values():
            host.kill_all()
        for name in [h.netns for h in self.hosts.values()] + [self.switch]:
            done = _ip("netns", "del", name, check=False)
            if done.returncode != 0 and "No such file" not in done.stderr:
                errors.append(f"{name}: {done.stderr.strip()}")
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        if errors:
            raise RuntimeError(f"network namespaces left behind: {errors}")


@contextmanager
def open_network(labels: Sequence[str]) -> Iterator[Network]:
    """Hosts ``labels`` on one switch, torn down on the way out whatever happened."""
    require_netns()
    tag = secrets.token_hex(3)
    # 198.18.0.0/15 is 198.18.0.0-198.19.255.255: a random /24 of it, for readable logs only
    # (each run's switch is its own, so two runs may even share one).
    subnet = f"198.{18 + secrets.randbelow(2)}.{secrets.randbelow(256)}"
    network = Network(tag, f"epd-{tag}-switch", subnet)
    try:
        _ip("netns", "add", network.switch)
        _ip("-n", network.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", network.switch, "link", "set", "br0", "up")
        for label in labels:
            network.add(label)
        yield network
    finally:
        network.close()
