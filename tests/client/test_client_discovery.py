"""The client follows a bootstrap registry's list, in the background."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
import trio.testing

from epd_trio.client import open_encoder_client
from epd_trio.config import ClientConfig
from epd_trio.errors import PeerUnavailable


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
