"""The encoder side under ``autojump_clock``: retry schedule, heartbeats, goodbye.

``FakeRegistry`` is an httpx ``MockTransport`` handler that follows a script of
``(from_time, state)``: ``"up"``, ``"down"`` (connection refused), ``"hang"``
(never answers), ``"error"`` (HTTP 503), ``"restart"`` (up, having forgotten
everyone), ``"text"`` (up, answering like SGLang's ``EncoderBootstrapServer``:
200 with the text ``OK``) or ``"garbage"`` (503 with a non-JSON body). No sockets: virtual
time only moves when everything waits.
"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
import trio

from epd_trio.bootstrap.registration import UNREGISTER_TIMEOUT, Registration, open_registration

ME = "http://encoder:8000"


class FakeRegistry:
    def __init__(self, url: str, script: list[tuple[float, str]]) -> None:
        self.url = url
        self.script = sorted(script)
        self.urls: set[str] = set()
        self.calls: list[tuple[float, str, str]] = []  # (time, method, outcome)
        self.headers: list[str | None] = []
        self._restarted_at: set[float] = set()

    def state(self, now: float) -> str:
        current = "up"
        for start, state in self.script:
            if now >= start:
                current = state
                if state == "restart" and start not in self._restarted_at:
                    self._restarted_at.add(start)
                    self.urls.clear()
        return "up" if current == "restart" else current

    async def handle(self, request: httpx.Request) -> httpx.Response:
        now = trio.current_time()
        state = self.state(now)
        self.calls.append((now, request.method, state))
        self.headers.append(request.headers.get("authorization"))
        if state == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if state == "hang":
            await trio.sleep_forever()
        if state == "error":
            return httpx.Response(503, json={"error": {"type": "x", "message": "y"}, "req_id": None})
        if state == "garbage":
            return httpx.Response(503, text="<html>bad gateway</html>")
        url = json.loads(request.content)["url"]
        if state == "text":
            (self.urls.add if request.method == "POST" else self.urls.discard)(url)
            return httpx.Response(200, text="OK")
        if request.method == "POST":
            added = url not in self.urls
            self.urls.add(url)
            return httpx.Response(200, json={"url": url, "registered": added})
        removed = url in self.urls
        self.urls.discard(url)
        return httpx.Response(200, json={"url": url, "unregistered": removed})

    def times(self, method: str = "POST") -> list[float]:
        return [t for t, m, _ in self.calls if m == method]


def client_for(*registries: FakeRegistry) -> httpx.AsyncClient:
    by_host = {httpx.URL(r.url).host: r for r in registries}

    async def route(request: httpx.Request) -> httpx.Response:
        return await by_host[request.url.host].handle(request)

    return httpx.AsyncClient(transport=httpx.MockTransport(route))


async def announce(registries: list[FakeRegistry], until: float, **kw: float) -> Registration:
    async with client_for(*registries) as http:
        reg = Registration(http, [r.url for r in registries], ME, **kw)  # type: ignore[arg-type]
        with trio.move_on_after(until):
            await reg.run()
    return reg


async def test_retry_schedule_is_capped_exponential_until_it_succeeds(autojump_clock: trio.abc.Clock) -> None:
    registry = FakeRegistry("http://reg:8997", [(0, "down"), (10, "error"), (20, "up")])
    reg = await announce([registry], 90.0, heartbeat_interval=30.0, retry_initial=0.5, retry_max=4.0)
    # Retries after 0.5, 1, 2, 4, 4, 4, 4 s; the 8th attempt (23.5) succeeds; heartbeats every 30 s.
    assert registry.times() == [0.0, 0.5, 1.5, 3.5, 7.5, 11.5, 15.5, 19.5, 23.5, 53.5, 83.5]
    assert registry.urls == {ME}
    (link,) = reg.statistics().links
    assert (link.registered, link.attempts, link.failures, link.streak, link.last_ok) == (
        True, 11, 8, 0, 83.5)
    assert link.last_error is not None and link.last_error.startswith("HTTP 503: ")


async def test_a_2xx_with_a_text_body_is_a_success(autojump_clock: trio.abc.Clock) -> None:
    # SGLang's EncoderBootstrapServer answers 200 "OK": registered once, then only heartbeats.
    registry = FakeRegistry("http://reg:8997", [(0, "text")])
    async with client_for(registry) as http:
        async with open_registration([registry.url], ME, heartbeat_interval=30.0, http=http) as reg:
            await trio.sleep(65.0)
            assert registry.urls == {ME}
    assert registry.times() == [0.0, 30.0, 60.0] and registry.times("DELETE") == [65.0]
    (link,) = reg.statistics().links
    assert (link.attempts, link.failures, link.last_ok, link.last_error) == (3, 0, 60.0, None)
    assert registry.urls == set() and reg.statistics().unregistered == 1


async def test_a_non_2xx_with_a_text_body_is_a_failure(autojump_clock: trio.abc.Clock) -> None:
    registry = FakeRegistry("http://reg:8997", [(0, "garbage"), (1, "text")])
    reg = await announce([registry], 2.0, heartbeat_interval=30.0)
    assert registry.times() == [0.0, 0.5, 1.5]
    (link,) = reg.statistics().links
    assert (link.registered, link.failures, link.last_error) == (
        True, 2, "HTTP 503: <html>bad gateway</html>")


async def test_it_never_gives_up(autojump_clock: trio.abc.Clock) -> None:
    registry = FakeRegistry("http://reg:8997", [(0, "down"), (10_000, "up")])
    reg = await announce([registry], 10_031.0, heartbeat_interval=30.0)
    # Default backoff: 0.5 s doubling, capped at min(30 s, heartbeat) — 0.5 … 16 then every 30 s.
    times = registry.times()
    assert times[:7] == [0.0, 0.5, 1.5, 3.5, 7.5, 15.5, 31.5]
    assert all(b - a == 30.0 for a, b in itertools.pairwise(times[6:]))
    assert times[-1] == 10_021.5 and registry.urls == {ME}
    assert reg.statistics().links[0].failures == len(times) - 1


async def test_heartbeat_refills_a_restarted_registry(autojump_clock: trio.abc.Clock) -> None:
    registry = FakeRegistry("http://reg:8997", [(40, "down"), (45, "restart")])
    seen: list[tuple[float, bool]] = []
    async with client_for(registry) as http, trio.open_nursery() as nursery:
        reg = Registration(http, [registry.url], ME, heartbeat_interval=30.0)
        await nursery.start(reg.run)
        for t in (1.0, 46.0, 59.0, 61.0):
            await trio.sleep_until(t)
            registry.state(t)
            seen.append((t, ME in registry.urls))
        nursery.cancel_scope.cancel()
    assert registry.times() == [0.0, 30.0, 60.0]  # the registry was only down between heartbeats
    assert seen == [(1.0, True), (46.0, False), (59.0, False), (61.0, True)]


async def test_a_heartbeat_that_fails_falls_back_to_retrying(autojump_clock: trio.abc.Clock) -> None:
    registry = FakeRegistry("http://reg:8997", [(25, "down"), (33, "restart")])
    await announce([registry], 40.0, heartbeat_interval=30.0)
    assert registry.times() == [0.0, 30.0, 30.5, 31.5, 33.5]
    assert registry.urls == {ME}


async def test_registries_are_announced_to_independently(autojump_clock: trio.abc.Clock) -> None:
    up = FakeRegistry("http://up:8997", [])
    down = FakeRegistry("http://down:8997", [(0, "down"), (5, "up")])
    hung = FakeRegistry("http://hung:8997", [(0, "hang")])
    reg = await announce([up, down, hung], 31.0, heartbeat_interval=30.0)
    assert up.times() == [0.0, 30.0]
    assert down.times() == [0.0, 0.5, 1.5, 3.5, 7.5]
    assert hung.times() == [0.0, 5.5, 11.5, 18.5, 27.5]  # each try times out after 5 s
    assert [link.registered for link in reg.statistics().links] == [True, True, False]
    assert "2/3 registries" in repr(reg)


async def test_bearer_token_is_sent(autojump_clock: trio.abc.Clock) -> None:
    registry = FakeRegistry("http://reg:8997", [])
    await announce([registry], 1.0, heartbeat_interval=30.0, auth_token="s3cret")  # type: ignore[arg-type]
    assert registry.headers == ["Bearer s3cret"]


async def test_exit_stops_announcing_then_unregisters(autojump_clock: trio.abc.Clock) -> None:
    a, b = FakeRegistry("http://a:8997", []), FakeRegistry("http://b:8997", [(0, "down")])
    async with client_for(a, b) as http:
        async with open_registration([a.url, b.url], ME, heartbeat_interval=30.0, http=http) as reg:
            await trio.sleep(45.0)
            assert a.urls == {ME}
        left = trio.current_time()
    assert a.urls == set() and a.times("DELETE") == [45.0] and b.times("DELETE") == [45.0]
    assert left == 45.0 and reg.statistics().unregistered == 1
    assert max(t for t, m, _ in a.calls + b.calls if m == "POST") < 45.0  # nothing after goodbye


async def test_unregister_is_shielded_and_bounded(autojump_clock: trio.abc.Clock) -> None:
    registry = FakeRegistry("http://reg:8997", [(10, "hang")])
    async with client_for(registry) as http:
        with trio.move_on_after(12.0):  # the encoder is being cancelled: a hard stop
            async with open_registration([registry.url], ME, heartbeat_interval=30.0, http=http):
                await trio.sleep_forever()
        assert trio.current_time() == 12.0 + UNREGISTER_TIMEOUT  # tried, then gave up
    assert registry.times("DELETE") == [12.0]


async def test_no_registries_is_a_no_op(autojump_clock: trio.abc.Clock) -> None:
    async with open_registration([], ME, heartbeat_interval=30.0) as reg:
        await trio.sleep(100.0)
    assert reg.statistics().links == () and trio.current_time() == 100.0


def test_heartbeat_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="heartbeat_interval"):
        Registration(None, ["http://r:1"], ME, heartbeat_interval=0.0)
