"""The client follows a bootstrap registry's list and a DNS name's addresses, in the background."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
import trio.testing

from epd_trio.client import open_encoder_client
from epd_trio.client.discovery import Discovery, fetch_encoder_urls, resolve_encoder_urls
from epd_trio.config import ClientConfig
from epd_trio.errors import PeerUnavailable, TransferTimeout


class FakeRegistry:
    """GET /list_encoder_urls answers whatever ``urls`` holds now; can go down."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.down, self.calls = urls, False, []
        self.body: bytes | None = None  # answered as it is, when set

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(trio.current_time())
        if self.down:
            raise httpx.ConnectError("registry down")
        assert request.url.path == "/list_encoder_urls"
        return httpx.Response(200, content=self.body or json.dumps({"encoder_urls": self.urls}).encode())


async def test_list_is_merged_refreshed_and_kept_through_outages(autojump_clock: trio.testing.MockClock) -> None:
    reg = FakeRegistry(["http://e1:1", "http://static:9"])
    async with open_encoder_client(encoder_urls=["http://static:9"], bootstrap_url="http://reg:8997",
                                   refresh_interval=5.0, http_transport=httpx.MockTransport(reg.handler)) as client:
        t0 = reg.calls[0]
        assert client.encoders == ("http://static:9", "http://e1:1")  # merged, deduplicated
        reg.urls = ["http://e2:2"]
        await trio.sleep(5.5)
        assert client.encoders == ("http://static:9", "http://e2:2")
        reg.down = True
        await trio.sleep(5.0)
        assert client.encoders == ("http://static:9", "http://e2:2")  # kept the last list
        assert client.statistics().refresh_failures == 1
        reg.down, reg.urls = False, []
        await trio.sleep(5.0)
        assert client.encoders == ("http://static:9",)
    assert [t - t0 for t in reg.calls] == [0.0, 5.0, 10.0, 15.0]  # no drift


async def test_the_clients_own_urls_are_normalized_so_they_merge_with_the_registrys(
        autojump_clock: trio.testing.MockClock) -> None:
    reg = FakeRegistry(["http://static:9", "http://e1:1"])
    async with open_encoder_client(encoder_urls=["HTTP://Static:9/", "http://static:9", "http://plain"],
                                   bootstrap_url="http://reg:8997",
                                   http_transport=httpx.MockTransport(reg.handler)) as client:
        assert client.config.encoder_urls == ("http://static:9", "http://plain")
        assert client.encoders == ("http://static:9", "http://plain", "http://e1:1")  # one entry each
    with pytest.raises(ValueError, match="credentials"):
        ClientConfig(encoder_urls=("http://user:pw@e:1",))


async def test_every_encoder_gone_fails_fast(autojump_clock: trio.testing.MockClock) -> None:
    reg = FakeRegistry([])
    async with open_encoder_client(bootstrap_url="http://reg:8997",
                                   http_transport=httpx.MockTransport(reg.handler)) as client:
        t0 = trio.current_time()
        with pytest.raises(PeerUnavailable, match="no encoder is available"):
            await client.encode({"image": [b"x"]})
        assert trio.current_time() == t0


async def test_an_answer_nested_past_the_parser_keeps_the_last_list(
        autojump_clock: trio.testing.MockClock) -> None:
    reg = FakeRegistry(["http://e1:1"])
    async with open_encoder_client(bootstrap_url="http://reg:8997", refresh_interval=5.0,
                                   http_transport=httpx.MockTransport(reg.handler)) as client:
        reg.body = b"[" * 200_000 + b"]" * 200_000
        await trio.sleep(5.5)  # one refresh: a failure, not the end of the client
        assert client.encoders == ("http://e1:1",) and client.statistics().refresh_failures == 1


class FakeName:
    """A DNS name's answers over time: a list of addresses, or an error to raise."""

    def __init__(self, answer: list[str] | Exception) -> None:
        self.answer, self.calls = answer, []

    async def resolve(self, url: str, timeout: float) -> list[str]:
        self.calls.append((trio.current_time(), url, timeout))
        if isinstance(self.answer, Exception):
            raise self.answer
        return [f"http://{address}:8000" for address in self.answer]


async def test_a_dns_name_is_followed_in_the_background_and_kept_through_failures(
        autojump_clock: trio.testing.MockClock) -> None:
    name = FakeName(["10.0.0.1", "10.0.0.2"])
    lists: list[tuple[float, tuple[str, ...]]] = []
    discovery = Discovery(["http://static:9"], None, interval=5.0, timeout=2.0, dns="http://enc.svc:8000",
                          resolve=name.resolve, on_list=lambda urls: lists.append((trio.current_time(), urls)))
    async with httpx.AsyncClient() as http, trio.open_nursery() as nursery:
        await nursery.start(discovery.run, http)
        name.answer = ["10.0.0.2", "10.0.0.3"]  # a pod replaced
        await trio.sleep(5.5)
        name.answer = PeerUnavailable("the resolver is down")
        await trio.sleep(5.0)
        name.answer = []  # the name is gone (NXDOMAIN): no encoder
        await trio.sleep(5.0)
        nursery.cancel_scope.cancel()
    assert lists == [
        (0.0, ("http://static:9", "http://10.0.0.1:8000", "http://10.0.0.2:8000")),
        (5.0, ("http://static:9", "http://10.0.0.2:8000", "http://10.0.0.3:8000")),
        (10.0, ("http://static:9", "http://10.0.0.2:8000", "http://10.0.0.3:8000")),  # kept
        (15.0, ("http://static:9",)),
    ]
    assert [(t, url, timeout) for t, url, timeout in name.calls] == \
        [(t, "http://enc.svc:8000", 2.0) for t in (0.0, 5.0, 10.0, 15.0)]  # no drift
    s = discovery.statistics()
    assert (s.bootstrap_url, s.dns, s.dns_refreshes, s.dns_failures, s.dns_found) == \
        (None, "http://enc.svc:8000", 3, 1, 0)
    assert repr(discovery) == "<Discovery http://enc.svc:8000: 0 found, 3 refreshes, 1 failed>"


async def test_the_registry_and_a_dns_name_merge_and_fail_apart(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    name = FakeName(["10.0.0.1", "10.0.0.2"])
    monkeypatch.setattr("epd_trio.client.discovery.resolve_encoder_urls", name.resolve)
    reg = FakeRegistry(["http://10.0.0.2:8000", "http://e1:1"])  # one encoder found both ways
    async with open_encoder_client(encoder_urls=["http://static:9"], bootstrap_url="http://reg:8997",
                                   discovery_dns="http://enc.svc:8000", refresh_interval=5.0,
                                   http_transport=httpx.MockTransport(reg.handler)) as client:
        assert client.encoders == ("http://static:9", "http://10.0.0.2:8000", "http://e1:1",
                                   "http://10.0.0.1:8000")
        reg.down = True
        name.answer = ["10.0.0.9"]
        await trio.sleep(5.5)
        assert client.encoders == ("http://static:9", "http://10.0.0.2:8000", "http://e1:1",
                                   "http://10.0.0.9:8000")  # the registry's last list, the new name
        name.answer = TransferTimeout("no answer")
        await trio.sleep(5.0)
        assert client.statistics().refresh_failures == 3  # two registry queries, one resolution
    assert "enc.svc:8000: 1 found, 2 refreshes, 1 failed" in repr(client.discovery)


async def test_resolving_a_name_gives_one_url_per_address() -> None:
    assert await resolve_encoder_urls("http://localhost:8000", 5.0) == ["http://127.0.0.1:8000"]
    assert await resolve_encoder_urls("grpc://[::1]:50051", 5.0) == ["grpc://[::1]:50051"]


async def test_an_unreachable_registry_is_named_even_when_its_error_has_no_words() -> None:
    """A registry that takes the connection and never answers: httpx's ReadTimeout says nothing."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    held: list[trio.SocketStream] = []

    async def hold() -> None:
        while True:
            held.append(await listener.accept())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold)
        async with httpx.AsyncClient(timeout=0.2) as http:
            with pytest.raises(PeerUnavailable, match=r"registry http://127\.0\.0\.1:\d+ is unreachable: ReadTimeout$"):
                await fetch_encoder_urls(http, f"http://127.0.0.1:{port}", 10)
        nursery.cancel_scope.cancel()
    for stream in held:
        await stream.aclose()
    await listener.aclose()
