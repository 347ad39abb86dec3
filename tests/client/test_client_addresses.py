"""Which address each encoder is told to deliver to (``client.addresses``, ``_routes``,
and the receivers that tell it).

The decisions are driven here by a table of routes (host → the kernel's answer), as
the kernel would give them on a multi-homed host; ``tests/multihost`` runs the same
code against real routes between separate network namespaces.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator

import pytest
import trio

from client_fakes import Behaviour, FakeEncoders, item_bytes
from epd_trio._routes import (
    Route,
    Routes,
    find_route,
    is_loopback_host,
    is_wildcard,
    url_host,
)
from epd_trio.client import open_encoder_client
from epd_trio.client.addresses import (
    PullEndpoints,
    check_session,
    choose_mooncake_host,
    endpoint_host,
)
from epd_trio.client.answers import EncoderUnreachable
from epd_trio.client.pool import EmbeddingPool
from epd_trio.client.receiving import InlineReceiver, ZmqReceiver
from epd_trio.config import ClientConfig
from epd_trio.errors import PeerUnavailable
from epd_trio.transport import PushSocketCache
from epd_trio.transport.zmq import PullReceiver

LOCAL = "http://127.0.0.1:8000"
LOCAL_2 = "http://127.0.0.2:8000"  # loopback too, reached from its own address
REMOTE = "http://198.18.0.2:8000"
UNKNOWN = "http://unknown-host:8000"


def route(host: str, peer: str, source: str) -> Route:
    return Route(host, ipaddress.ip_address(peer), ipaddress.ip_address(source))


TABLE = {
    "127.0.0.1": route("127.0.0.1", "127.0.0.1", "127.0.0.1"),
    "127.0.0.2": route("127.0.0.2", "127.0.0.2", "127.0.0.2"),
    "198.18.0.2": route("198.18.0.2", "198.18.0.2", "198.18.0.1"),  # another host
    "198.18.0.1": route("198.18.0.1", "198.18.0.1", "198.18.0.1"),  # this host's own address
}


class TableRoutes:
    """``Routes`` answered from ``TABLE``; a host missing from it does not resolve."""

    def __init__(self, table: dict[str, Route] = TABLE) -> None:
        self.table, self.asked = table, []
        self.lookups = 0

    async def to(self, host: str) -> Route:
        self.asked.append(host)
        if host not in self.table:
            raise PeerUnavailable(f"{host} does not resolve")
        return self.table[host]


def test_a_route_is_local_when_its_peer_is_loopback_or_this_hosts_own() -> None:
    assert TABLE["127.0.0.1"].local and TABLE["127.0.0.2"].local and TABLE["198.18.0.1"].local
    assert not TABLE["198.18.0.2"].local
    v6 = route("fe80::1%lo", "fe80::1%lo", "fe80::2%lo")
    assert v6.source_host == "[fe80::2%lo]" and not v6.local


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost", True), (None, True), ("198.18.0.1", False), ("fe80::1%eth0", False),
    ("encoder-0.ns.svc", False),  # a name may resolve elsewhere to another address than here
])
def test_loopback_hosts(host: str | None, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_wildcards_endpoint_hosts_and_url_hosts() -> None:
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "[::]", "*", ""))
    assert not is_wildcard("127.0.0.1")
    assert endpoint_host("tcp://[fe80::1%eth0]:5") == "fe80::1%eth0"
    assert endpoint_host("tcp://10.0.0.1:5") == "10.0.0.1" and endpoint_host("ipc:///x") is None
    assert url_host("http://[fe80::1%eth0]:80") == "fe80::1%eth0"
    assert url_host("grpc://[fe80::1%25Eth0]:80") == "fe80::1%Eth0"  # grpc's %25, case kept
    assert url_host("HTTP://Enc-0:1") == "enc-0"


async def test_the_kernel_routes_loopback_from_loopback() -> None:
    for host in ("127.0.0.1", "localhost", "::1"):
        found = await find_route(host, timeout=5)
        assert found.local and found.source.is_loopback, found


async def test_routes_are_cached_for_their_ttl(autojump_clock: object) -> None:
    routes = Routes(timeout=5, ttl=30)
    for _ in range(3):
        assert (await routes.to("127.0.0.1")).local
    assert routes.lookups == 1
    await trio.sleep(30)
    await routes.to("127.0.0.1")
    assert routes.lookups == 2 and repr(routes) == "<Routes 1 hosts cached, 2 lookups>"


async def open_addresses(routes: TableRoutes, **config: object) -> tuple[PullReceiver, PullEndpoints]:
    pull = PullReceiver(None)
    await pull.__aenter__()
    return pull, PullEndpoints(ClientConfig(**config), routes, pull)  # type: ignore[arg-type]


async def test_by_default_each_encoder_is_told_the_address_on_its_route() -> None:
    pull, addresses = await open_addresses(TableRoutes())
    try:
        assert pull.endpoints == []  # nothing listens before an encoder needs it
        first = await addresses.endpoint_for(LOCAL)
        second = await addresses.endpoint_for(LOCAL_2)
        assert first.startswith("tcp://127.0.0.1:") and second.startswith("tcp://127.0.0.2:")
        assert await addresses.endpoint_for(LOCAL) == first  # bound once per address
        assert pull.endpoints == [first, second] and addresses.endpoint == ""
        s = addresses.statistics()
        assert (s.endpoints, s.told) == ((first, second), "")
        with pytest.raises(EncoderUnreachable, match="unknown-host does not resolve"):
            await addresses.endpoint_for(UNKNOWN)  # the part may move to another encoder
    finally:
        await pull.aclose()


async def test_a_wildcard_bind_tells_each_encoder_its_routes_source() -> None:
    pull, addresses = await open_addresses(TableRoutes(), zmq_bind="tcp://0.0.0.0:0")
    try:
        (bound,) = pull.endpoints
        port = bound.rsplit(":", 1)[1]
        assert await addresses.endpoint_for(LOCAL) == f"tcp://127.0.0.1:{port}"
        assert await addresses.endpoint_for(REMOTE) == f"tcp://198.18.0.1:{port}"
    finally:
        await pull.aclose()


@pytest.mark.parametrize(("config", "setting"), [
    ({"zmq_bind": "tcp://127.0.0.1:0"}, "ClientConfig.zmq_bind"),  # the old default, as such
    ({"zmq_bind": "ipc:///tmp/epd-test-addresses.sock"}, "ClientConfig.zmq_bind"),
    ({"zmq_bind": "tcp://0.0.0.0:0", "zmq_advertise": "tcp://127.0.0.1:0"}, "ClientConfig.zmq_advertise"),
])
async def test_loopback_told_to_an_encoder_on_another_host_fails_at_once(
        config: dict[str, str], setting: str) -> None:
    pull, addresses = await open_addresses(TableRoutes(), **config)
    try:
        with pytest.raises(PeerUnavailable, match=f"on another host.*set {setting}") as caught:
            await addresses.endpoint_for(REMOTE)
        assert "198.18.0.1" in caught.value.message  # the address that would reach it
        # local encoders, and ones whose route is unknown (the connection will tell), are fine
        for url in (LOCAL, "http://198.18.0.1:8000", UNKNOWN):
            assert await addresses.endpoint_for(url) == addresses.endpoint
    finally:
        await pull.aclose()


async def test_a_configured_address_that_is_no_loopback_is_told_to_everyone() -> None:
    pull, addresses = await open_addresses(TableRoutes(), zmq_bind="tcp://127.0.0.1:0",
                                           zmq_advertise="tcp://node-7.example:0")
    try:
        port = pull.endpoints[0].rsplit(":", 1)[1]
        assert addresses.endpoint == f"tcp://node-7.example:{port}"
        assert await addresses.endpoint_for(REMOTE) == addresses.endpoint
    finally:
        await pull.aclose()


async def test_mooncake_on_loopback_is_refused_for_an_encoder_on_another_host() -> None:
    routes = TableRoutes()
    await check_session(routes, "127.0.0.1", LOCAL)  # type: ignore[arg-type]
    with pytest.raises(PeerUnavailable, match=r"set ClientConfig.mooncake_host"):
        await check_session(routes, "127.0.0.1", REMOTE)  # type: ignore[arg-type]
    await check_session(routes, "198.18.0.1", REMOTE)  # type: ignore[arg-type]
    inline = InlineReceiver(ClientConfig(transfer_backend="inline"), EmbeddingPool(1024), lambda _: None)
    inline.routes = routes  # type: ignore[assignment]
    assert await inline.deliver_for(REMOTE) == {"backend": "inline"}
    assert routes.asked == ["127.0.0.1", "198.18.0.2"]  # the loopback one's checks; inline asks nothing


@pytest.mark.parametrize(("config", "host"), [
    ({"mooncake_host": "10.1.2.3", "encoder_urls": (REMOTE,)}, "10.1.2.3"),
    ({"encoder_urls": (LOCAL, UNKNOWN, REMOTE)}, "198.18.0.1"),  # the first peer on another host
    ({"bootstrap_url": "http://198.18.0.2:8997"}, "198.18.0.1"),
    ({"discovery_dns": "http://198.18.0.2:8000"}, "198.18.0.1"),
    ({"encoder_urls": (LOCAL, LOCAL_2)}, "127.0.0.1"),  # every peer here: loopback
    ({}, "127.0.0.1"),
])
async def test_the_mooncake_host_comes_from_the_route_to_a_peer_on_another_host(
        config: dict[str, object], host: str) -> None:
    assert await choose_mooncake_host(ClientConfig(**config), TableRoutes()) == host  # type: ignore[arg-type]


@pytest.fixture
async def push() -> AsyncIterator[PushSocketCache]:
    async with PushSocketCache() as cache:
        yield cache


async def test_a_part_whose_encoder_has_no_route_moves_and_is_told_its_new_encoders_address(
        push: PushSocketCache) -> None:
    behaviours = {UNKNOWN: Behaviour(), LOCAL: Behaviour()}
    fakes = FakeEncoders(push, behaviours)
    client = open_encoder_client(encoder_urls=list(behaviours), http_transport=fakes.transport(),
                                 pool_bytes=1 << 16)
    client.receiver.routes = TableRoutes()  # type: ignore[assignment]
    async with client:
        async with await client.encode({"image": [item_bytes(0), item_bytes(1)]}) as result:
            assert [r.encoder_url for r in result.parts] == [LOCAL, LOCAL]
        assert [url for url, _ in fakes.encode_calls] == [LOCAL, LOCAL]  # UNKNOWN never called
        assert isinstance(client.receiver, ZmqReceiver) and client.receiver.addresses is not None
        assert {b["deliver"]["endpoint"] for _, b in fakes.encode_calls} == \
            set(client.receiver.addresses.endpoints)
        assert client.statistics().retries == 1


def test_zmq_advertise_needs_zmq_bind_and_discovery_dns_is_checked() -> None:
    with pytest.raises(ValueError, match="zmq_advertise needs zmq_bind"):
        ClientConfig(zmq_advertise="tcp://10.0.0.1:5000")
    assert ClientConfig(discovery_dns="HTTP://Encoders.NS.svc:8000/").discovery_dns == \
        "http://encoders.ns.svc:8000"
    for bad, why in (("https://e.svc:1", "http:// or grpc://"), ("http://e.svc", "port"),
                     ("http://e.svc:1/x", "no path")):
        with pytest.raises(ValueError, match=why):
            ClientConfig(discovery_dns=bad)
