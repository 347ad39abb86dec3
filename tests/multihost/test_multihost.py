"""The multi-host recipe on four real hosts (network namespaces): registry, two encoders, a client.

Hosts ``r`` (the registry, and a DNS server), ``e1`` and ``e2`` (an encoder each,
started with ``docs/deployment.md``'s own commands) and ``c`` (the language
server: ``multihost_agent.py`` runs the client there, configured as the page says, with no
address settings). The processes are shared by the module's tests, which run in
file order: the ones that stop, cut or kill a host come last and say what they leave.

Each test's bounds are far below the client's 60 s timeout, so "fails fast" is a
measured claim, not a hope.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
from PIL import Image

from multihost_cluster import (
    AgentProcess,
    DnsServer,
    recipe,
    run_recipe,
    stop,
    wait_until,
)
from multihost_netns import Network, open_network

pytestmark = pytest.mark.slow

TOKEN = "multihost-token"
ENCODER_START = 240.0  # seconds: torch and the model, on a busy 2-core machine
DNS_NAME = "encoders.epd.test"
NO_ROUTE_V6 = "2001:db8::7"  # the documentation range; the hosts have no IPv6 route at all


@dataclass
class Cluster:
    net: Network
    agent: AgentProcess
    dns: DnsServer
    logs: Path
    env: dict[str, str]
    encoders: dict[str, subprocess.Popen[bytes]]
    images: list[str]  # paths
    reference: torch.Tensor  # the images' embedding, from one local engine

    @property
    def registry(self) -> str:
        return f"http://{self.net['r'].address}:8997"

    def http(self, label: str, port: int = 8000) -> str:
        return f"http://{self.net[label].address}:{port}"

    def start_encoder(self, label: str) -> subprocess.Popen[bytes]:
        proc = run_recipe(self.net[label], "encoder", self.env, self.logs / f"encoder-{label}.log")
        self.encoders[label] = proc
        return proc

    def wait_healthy(self, label: str) -> None:
        answer = self.agent.call("wait_http", url=self.http(label) + "/health", timeout=ENCODER_START)
        assert "error" not in answer, (answer, self.log_tail(f"encoder-{label}.log"))

    def listed(self) -> list[str]:
        answer = self.agent.call("http", url=self.registry + "/list_encoder_urls", timeout=10)
        return sorted(answer["body"]["encoder_urls"]) if answer.get("status") == 200 else []

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.logs / name
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def open_client(self, name: str, **config: Any) -> dict[str, Any]:
        answer = self.agent.call("open", name=name, config=config, timeout=60)
        assert "error" not in answer, answer
        return answer

    def encode(self, name: str, **fields: Any) -> dict[str, Any]:
        return self.agent.call("encode", name=name, images=self.images, **fields)


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def local_reference(model_path: str, images: list[bytes]) -> torch.Tensor:
    from epd_trio.config import EngineConfig
    from epd_trio.engine import open_engine

    async def encode() -> torch.Tensor:
        async with open_engine(EngineConfig(model_path=model_path)) as engine:
            return (await engine.encode(images, "image")).embedding.clone()
    return trio.run(encode)


@pytest.fixture(scope="module")
def cluster(qwen25_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("multihost")
    with open_network(["r", "e1", "e2", "c"]) as net:
        env = {"TOKEN": TOKEN, "MODEL": qwen25_path, "DEVICE": "cpu",
               "REGISTRY": net["r"].address, "EPD_LOG_LEVEL": "INFO",
               "EPD_DRAIN_TIMEOUT": "8"}  # the rolling update's held request: 8 s, not 30
        # The registry's health loop, quick enough to watch an eviction (the recipe's command);
        # a probe may take its time on a loaded machine (a healthy e1 evicted would empty the
        # list while e2 is down in the rolling update).
        registry_env = {**env, "EPD_HEALTH_INTERVAL": "0.5", "EPD_HEALTH_TIMEOUT": "5"}
        run_recipe(net["r"], "registry", registry_env, logs / "registry.log")
        encoders = {label: run_recipe(net[label], "encoder", env, logs / f"encoder-{label}.log")
                    for label in ("e1", "e2")}
        dns = DnsServer(net["r"], logs / "zone.json", logs / "dns.log")
        net["c"].use_nameserver(net["r"].address)
        agent = AgentProcess(net["c"], logs / "agent.log")
        try:
            image_bytes = [png(56, 56, seed) for seed in range(4)]
            paths = []
            for i, data in enumerate(image_bytes):
                paths.append(str(logs / f"image{i}.png"))
                Path(paths[-1]).write_bytes(data)
            cluster = Cluster(net, agent, dns, logs, env, encoders, paths,
                              local_reference(qwen25_path, image_bytes))
            for label in ("e1", "e2"):
                cluster.wait_healthy(label)
            want = sorted([cluster.http("e1"), cluster.http("e2")])
            wait_until(lambda: cluster.listed() == want, 60, "both encoders registered")
            yield cluster
        finally:
            agent.close()


def assert_split_and_equal(cluster: Cluster, answer: dict[str, Any], out: Path) -> None:
    from safetensors.torch import load_file

    assert answer.get("ok"), answer
    assert sorted(set(answer["parts"])) == [cluster.http("e1"), cluster.http("e2")]
    got = load_file(out)["image"]
    assert got.shape == cluster.reference.shape
    torch.testing.assert_close(got, cluster.reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["zmq", "mooncake", "inline"])
def test_the_recipe_works_across_hosts(cluster: Cluster, backend: str) -> None:
    """Each delivery, as documented: only ``bootstrap_url`` (and the backend) configured."""
    cluster.open_client(backend, bootstrap_url=cluster.registry, transfer_backend=backend)
    out = cluster.logs / f"{backend}.safetensors"
    answer = cluster.encode(backend, out=str(out), timeout=30)
    assert_split_and_equal(cluster, answer, out)
    client = cluster.net["c"].address
    if backend == "zmq":  # bound on the client's own network address, told to both encoders
        (endpoint,) = answer["endpoints"]
        assert endpoint.startswith(f"tcp://{client}:")
    if backend == "mooncake":
        assert answer["mooncake_session"].startswith(f"{client}:")
    cluster.agent.call("close", name=backend)


def test_the_documented_client_script_runs_as_written(cluster: Cluster) -> None:
    script = cluster.logs / "client.py"
    script.write_text(recipe("client"))
    out = cluster.logs / "client-script.out"
    with out.open("wb") as sink:
        proc = cluster.net["c"].popen([sys.executable, str(script), *cluster.images],
                                      env={**os.environ, **cluster.env}, log=cluster.logs / "client-script.log",
                                      stdout=sink)
        assert proc.wait(timeout=120) == 0, cluster.log_tail("client-script.log")
    printed = out.read_text()
    assert str(tuple(cluster.reference.shape)) in printed
    assert cluster.http("e1") in printed and cluster.http("e2") in printed


@pytest.mark.parametrize("backend", ["zmq", "mooncake"])
def test_grpc_encoders_across_hosts(cluster: Cluster, backend: str) -> None:
    urls = [f"grpc://{cluster.net[label].address}:50051" for label in ("e1", "e2")]
    cluster.open_client("grpc-" + backend, encoder_urls=urls, transfer_backend=backend)
    out = cluster.logs / f"grpc-{backend}.safetensors"
    answer = cluster.encode("grpc-" + backend, out=str(out), timeout=30)
    assert answer.get("ok"), answer
    assert sorted(set(answer["parts"])) == urls
    from safetensors.torch import load_file

    torch.testing.assert_close(load_file(out)["image"], cluster.reference, rtol=1e-5, atol=1e-5)
    cluster.agent.call("close", name="grpc-" + backend)


@pytest.mark.parametrize(("config", "setting"), [
    ({"zmq_bind": "tcp://127.0.0.1:0"}, "ClientConfig.zmq_bind"),  # the old default
    ({"transfer_backend": "mooncake", "mooncake_host": "127.0.0.1"}, "ClientConfig.mooncake_host"),
])
def test_loopback_told_to_encoders_on_other_hosts_fails_at_once(
        cluster: Cluster, config: dict[str, str], setting: str) -> None:
    name = "loopback-" + setting
    cluster.open_client(name, bootstrap_url=cluster.registry, **config)
    answer = cluster.encode(name, timeout=60)
    assert answer["ok"] is False and answer["type"] == "PeerUnavailable", answer
    assert setting in answer["message"] and "on another host" in answer["message"]
    assert answer["took"] < 5  # at once, not after the 60 s timeout
    cluster.agent.call("close", name=name)


def test_an_encoder_on_loopback_with_a_registry_elsewhere_does_not_start(cluster: Cluster) -> None:
    log = cluster.logs / "encoder-loopback.log"
    proc = cluster.net["e1"].popen(
        [sys.executable, "-m", "epd_trio.cli", "encoder", "--port", "8001",
         "--model-path", cluster.env["MODEL"], "--register-url", cluster.registry], log=log)
    assert proc.wait(timeout=120) == 2, log.read_text()[-3000:]
    said = log.read_text()
    assert "is on another host" in said and "(--host)" in said, said[-3000:]


def test_dns_discovery_follows_the_names_records(cluster: Cluster) -> None:
    e1, e2 = cluster.net["e1"].address, cluster.net["e2"].address
    # An AAAA record too: an address these hosts have no route to (IPv4 only), so its part
    # moves at once, and nothing is sent there.
    cluster.dns.set({DNS_NAME: [e1, e2, NO_ROUTE_V6]})
    opened = cluster.open_client("dns", discovery_dns=f"http://{DNS_NAME}:8000", refresh_interval=0.5)
    assert sorted(opened["encoders"]) == sorted([cluster.http("e1"), cluster.http("e2"),
                                                 f"http://[{NO_ROUTE_V6}]:8000"])
    out = cluster.logs / "dns.safetensors"
    answer = cluster.encode("dns", out=str(out), timeout=30)
    assert_split_and_equal(cluster, answer, out)
    assert answer["retries"] == 1  # the IPv6 one's part, moved

    def encoders() -> list[str]:
        return sorted(cluster.agent.call("encoders", name="dns", timeout=10)["encoders"])

    cluster.dns.set({DNS_NAME: [e2]})  # one pod gone
    wait_until(lambda: encoders() == [cluster.http("e2")], 20, "the name's new records followed")
    answer = cluster.encode("dns", timeout=30)
    assert answer["ok"] and set(answer["parts"]) == {cluster.http("e2")}, answer
    cluster.dns.set({})  # the name is gone: NXDOMAIN, no encoder
    wait_until(lambda: encoders() == [], 20, "an NXDOMAIN empties the list")
    answer = cluster.encode("dns", timeout=30)
    assert answer["ok"] is False and "no encoder is available" in answer["message"], answer
    state = cluster.agent.call("encoders", name="dns", timeout=10)["discovery"]
    assert state["dns_refreshes"] >= 3 and state["dns_failures"] == 0, state
    cluster.agent.call("close", name="dns")


def test_a_rolling_update_loses_no_request(cluster: Cluster) -> None:
    """SIGTERM e2's encoder while requests run, start a new one there; every request succeeds.

    A long request holds e2's drain open (its delivery waits for a receiver that never
    reads, up to the drain timeout, 8 s here), so requests keep reaching e2 while it drains,
    until the client's next refresh: they are refused there and must move to e1.
    """
    e2 = cluster.http("e2")
    client = cluster.net["c"].address
    cluster.open_client("held", encoder_urls=[e2], zmq_bind="tcp://0.0.0.0:0",
                        zmq_advertise=f"tcp://{client}:9")  # nothing reads there: the send waits
    held = cluster.agent.send("encode", name="held", images=cluster.images[:1], timeout=50)
    cluster.open_client("rolling", bootstrap_url=cluster.registry, refresh_interval=1.0)
    flag = cluster.logs / "rolling.stop"
    load = cluster.agent.send("load", name="rolling", images=cluster.images[:2], concurrency=2,
                              until=str(flag), pause=0.02, timeout=280)
    try:
        time.sleep(1.0)  # requests running on both encoders
        assert stop(cluster.encoders["e2"], timeout=90) == 0, cluster.log_tail("encoder-e2.log")
        assert cluster.listed() == [cluster.http("e1")]  # unregistered on the way out
        cluster.start_encoder("e2")
        cluster.wait_healthy("e2")
        want = sorted([cluster.http("e1"), e2])
        wait_until(lambda: cluster.listed() == want, 60, "the new e2 registered")
        wait_until(lambda: sorted(cluster.agent.call("encoders", name="rolling", timeout=10)["encoders"])
                   == want, 30, "the client sees the new e2")
        time.sleep(2.0)  # a few requests on the new e2
    finally:
        flag.write_text("stop")
    result = cluster.agent.wait(load, 320)
    assert result.get("failures") == [], result
    assert result["retries"] > 0  # parts moved off e2 (refused while it drained, or after)
    done = result["done"]
    assert e2 in {url for parts in done[-5:] for url in parts}  # the new e2 serves
    assert cluster.agent.wait(held, 60)["ok"] is False  # cut off by the end of the drain
    for name in ("held", "rolling"):
        cluster.agent.call("close", name=name)


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_a_link_cut_mid_request_fails_fast(cluster: Cluster, scheme: str) -> None:
    """e2's cable is pulled while requests run: none waits out its timeout (60 s). Over HTTP
    TCP keepalive notices, over gRPC the channel's keepalive pings."""
    urls = ([cluster.http("e1"), cluster.http("e2")] if scheme == "http" else
            [f"grpc://{cluster.net[label].address}:50051" for label in ("e1", "e2")])
    name = f"cut-{scheme}"
    cluster.open_client(name, encoder_urls=urls)
    assert cluster.encode(name, timeout=30)["ok"]
    flag = cluster.logs / f"{name}.stop"
    load = cluster.agent.send("load", name=name, images=cluster.images, concurrency=2,
                              until=str(flag), pause=0.0, timeout=200)
    try:
        time.sleep(1.0)  # requests in flight on both encoders
        cluster.net["e2"].cut()
        time.sleep(25.0)  # every request in flight at the cut has ended by now, or never will
    finally:
        flag.write_text("stop")
    result = cluster.agent.wait(load, 120)
    longest = max(result["took"])
    assert longest < 30, result  # failed over or failed fast, never the 60 s timeout
    assert not any("EncodeTimeout" in f for f in result["failures"]), result
    assert len(result["done"]) > len(result["failures"])  # e1 kept serving
    cluster.net["e2"].restore()
    cluster.agent.call("close", name=name)


def test_an_encoder_host_killed_is_evicted_and_parts_move(cluster: Cluster) -> None:
    """The last test: e2's host goes (every process killed, its cable pulled)."""
    cluster.open_client("killed", bootstrap_url=cluster.registry, refresh_interval=0.5)
    cluster.net["e2"].kill_all()
    cluster.net["e2"].cut()
    wait_until(lambda: cluster.listed() == [cluster.http("e1")], 30, "e2 evicted by the registry")
    answer = cluster.encode("killed", timeout=30)
    assert answer["ok"] and set(answer["parts"]) == {cluster.http("e1")}, answer
    cluster.agent.call("close", name="killed")
