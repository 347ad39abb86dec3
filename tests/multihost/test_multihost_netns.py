"""The hosts the multi-host tests stand on: made, separate, and gone afterwards whatever happens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import multihost_netns
from multihost_netns import NETNS_ETC, open_network

PROBE = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)"


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def connects(host: multihost_netns.Host, address: str, port: int, log: Path) -> bool:
    return host.popen([sys.executable, "-c", PROBE, address, str(port)], log=log).wait(10) == 0


def test_hosts_reach_each_other_not_the_machine_and_leave_nothing_behind(tmp_path: Path) -> None:
    before = namespaces()
    with pytest.raises(RuntimeError, match="the test failed"), open_network(["a", "b"]) as net:
        a, b = net["a"], net["b"]
        assert a.address.startswith(("198.18.", "198.19.")) and a.address != b.address
        server = a.popen([sys.executable, "-m", "http.server", "--bind", a.address, "8080"],
                         log=tmp_path / "server.log")
        for _ in range(50):  # bounded: the server needs a moment to listen
            if connects(b, a.address, 8080, tmp_path / "probe.log"):
                break
        else:
            raise AssertionError((tmp_path / "server.log").read_text())
        b.cut()
        assert not connects(b, a.address, 8080, tmp_path / "probe.log")  # the cable is out
        b.restore()
        assert connects(b, a.address, 8080, tmp_path / "probe.log")
        b.use_nameserver(a.address)
        assert (NETNS_ETC / b.netns / "resolv.conf").read_text().startswith(f"nameserver {a.address}")
        made = {h.netns for h in net.hosts.values()} | {net.switch}
        assert made <= namespaces()
        raise RuntimeError("the test failed")  # teardown must happen all the same
    assert server.poll() is not None  # killed
    assert namespaces() == before  # every namespace gone (their interfaces with them)
    assert not any((NETNS_ETC / name).exists() for name in made)


def test_missing_namespaces_skip_unless_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multihost_netns.shutil, "which", lambda name: None)
    assert multihost_netns.netns_problem() == "the `ip` command (iproute2) is missing"
    monkeypatch.delenv("EPD_REQUIRE_NETNS", raising=False)
    with pytest.raises(pytest.skip.Exception):
        multihost_netns.require_netns()
    monkeypatch.setenv("EPD_REQUIRE_NETNS", "1")
    with pytest.raises(pytest.fail.Exception, match="need network namespaces"):
        multihost_netns.require_netns()
