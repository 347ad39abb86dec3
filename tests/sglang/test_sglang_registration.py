"""Registration both ways with SGLang 0.5.23's own code, over real HTTP.

- Our encoder's ``Registration`` against SGLang's ``EncoderBootstrapServer``
  (which answers 200 with the text ``OK``) running in a driver subprocess.
- SGLang's encoder-side registration code (``--encoder-register-urls``: a
  ``requests`` POST of ``{"url": "http://host:port"}``, no token; DELETE on
  exit) against our registry.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import trio
import trio.testing
from sglang_harness import DriverLines, SGLangEnv, sglang_env  # noqa: F401 (a fixture)

from epd_trio import BootstrapConfig, serve_bootstrap
from epd_trio.bootstrap.registration import open_registration

ME = "http://127.0.0.1:39001"
DRIVER_START = 300.0  # seconds for the driver to import SGLang and answer, on a busy machine


class Observed(httpx.AsyncBaseTransport):
    """The real transport, telling the test each time a whole answer came back (no polling).

    The body is read here, before the test hears of it: otherwise the caller could still
    be waiting on the socket for it when the test's ``wait_all_tasks_blocked`` returns.
    """

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.send, self.answers = trio.open_memory_channel[tuple[str, int]](16)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        await response.aread()
        await self.send.send((request.method, response.status_code))
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


@asynccontextmanager
async def driver(env: SGLangEnv, *args: str) -> AsyncIterator[tuple[trio.Process, DriverLines]]:
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(functools.partial(
            trio.run_process, env.command(*args), env=env.environ(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, check=False))
        try:
            yield process, DriverLines(process)
        finally:
            assert process.stdin is not None
            await process.stdin.aclose()  # the driver's cue to finish


async def test_our_registration_counts_sglangs_ok_as_success(sglang_env: SGLangEnv) -> None:
    async with driver(sglang_env, "bootstrap") as (process, lines):
        with trio.fail_after(DRIVER_START):
            word, port = await lines.next()
        assert word == "PORT"
        sglang_url = f"http://127.0.0.1:{port}"
        observed = Observed()
        async with httpx.AsyncClient(transport=observed) as http, httpx.AsyncClient() as probe:
            async with open_registration([sglang_url], ME, heartbeat_interval=3600.0,
                                         http=http) as reg:
                with trio.fail_after(60):
                    assert await observed.answers.receive() == ("POST", 200)
                await trio.testing.wait_all_tasks_blocked()  # the answer has been handled
                (link,) = reg.statistics().links
                assert (link.registered, link.attempts, link.failures) == (True, 1, 0)
                listed = (await probe.get(sglang_url + "/list_encoder_urls")).json()
                assert listed == {"encoder_urls": [ME]}
            assert await observed.answers.receive() == ("DELETE", 200)
            assert reg.statistics().unregistered == 1
            listed = (await probe.get(sglang_url + "/list_encoder_urls")).json()
            assert listed == {"encoder_urls": []}
        assert process.stdin is not None
        await process.stdin.aclose()
        assert await lines.next() == ["URLS", "[]"]


async def test_our_registry_accepts_sglang_encoders(sglang_env: SGLangEnv) -> None:
    # SGLang's encoder advertises NetworkAddress(host, port).to_url(): IPv6 hosts in brackets.
    encoders = [("127.0.0.1", "30001", "http://127.0.0.1:30001"),
                ("::1", "30002", "http://[::1]:30002")]
    config = BootstrapConfig(port=0, health_interval=3600.0)  # no probe of these fake encoders
    async with serve_bootstrap(config) as registry, \
            httpx.AsyncClient(base_url=registry.url) as http:
        args = [a for host, port, _ in encoders for a in (host, port)]
        async with driver(sglang_env, "register", registry.url, *args) as (process, lines):
            for host, port, _ in encoders:
                with trio.fail_after(DRIVER_START):
                    assert await lines.next() == ["REGISTERED", host, port]
            listed = (await http.get("/list_encoder_urls")).json()
            assert listed == {"encoder_urls": [url for _, _, url in encoders]}
            assert process.stdin is not None
            await process.stdin.send_all(b"unregister\n")
            for host, port, _ in encoders:
                with trio.fail_after(60):
                    assert await lines.next() == ["UNREGISTERED", host, port]
        assert (await http.get("/list_encoder_urls")).json() == {"encoder_urls": []}
        assert registry.statistics().registry.encoders == 0
