"""Registration both ways with SGLang 0.5.23's own code, over real HTTP.

- Our encoder's ``Registration`` against SGLang's ``EncoderBootstrapServer``
  (which answers 200 with the text ``OK``) running in a driver subprocess.
- SGLang's encoder-side registration code (``--encoder-register-urls``: a
  ``requests`` POST of ``{"url": "http://host:port"}``, no token; DELETE on
  exit) against our registry.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import trio
import trio.testing

from epd_trio import BootstrapConfig, serve_bootstrap
from epd_trio.bootstrap.registration import open_registration
from sglang_harness import DriverProcess, SGLangEnv, sglang_env  # noqa: F401 (a fixture)

ME = "http://127.0.0.1:39001"


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


@pytest.fixture(scope="module")
def sglang_registration(sglang_env: SGLangEnv, tmp_path_factory: pytest.TempPathFactory
                        ) -> Iterator[DriverProcess]:
    """One ``registration-serve`` driver for both tests: importing SGLang's code is most of the cost."""
    driver = DriverProcess(sglang_env, "registration-serve",
                           tmp_path_factory.mktemp("sglang_registration") / "driver.log")
    try:
        yield driver
    finally:
        driver.close()


async def command(driver: DriverProcess, line: str, timeout: float = 60.0) -> list[str]:
    """A driver command from a worker thread: the trio loop meanwhile serves the registry it calls."""
    return await trio.to_thread.run_sync(driver.command, line, timeout)


async def test_our_registration_counts_sglangs_ok_as_success(sglang_registration: DriverProcess) -> None:
    word, port = await command(sglang_registration, "bootstrap")
    assert word == "PORT"
    sglang_url = f"http://127.0.0.1:{port}"
    observed = Observed()
    async with httpx.AsyncClient(transport=observed) as http, httpx.AsyncClient() as probe:
        async with open_registration([sglang_url], ME, heartbeat_interval=3600.0, http=http) as reg:
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
    assert await command(sglang_registration, "urls") == ["URLS", "[]"]


async def test_our_registry_accepts_sglang_encoders(sglang_registration: DriverProcess) -> None:
    # SGLang's encoder advertises NetworkAddress(host, port).to_url(): IPv6 hosts in brackets.
    encoders = [("127.0.0.1", "30001", "http://127.0.0.1:30001"),
                ("::1", "30002", "http://[::1]:30002")]
    pairs = " ".join(f"{host} {port}" for host, port, _ in encoders)
    config = BootstrapConfig(port=0, health_interval=3600.0)  # no probe of these fake encoders
    async with serve_bootstrap(config) as registry, \
            httpx.AsyncClient(base_url=registry.url) as http:
        assert await command(sglang_registration, f"register {registry.url} {pairs}") == ["REGISTERED", pairs]
        listed = (await http.get("/list_encoder_urls")).json()
        assert listed == {"encoder_urls": [url for _, _, url in encoders]}
        assert await command(sglang_registration, "unregister") == ["UNREGISTERED", pairs]
        assert (await http.get("/list_encoder_urls")).json() == {"encoder_urls": []}
        assert registry.statistics().registry.encoders == 0
