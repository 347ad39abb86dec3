"""The registry over real HTTP (its HTTP server on port 0), with real probes and real encoders."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from epd_trio import BootstrapConfig, run_bootstrap, serve_bootstrap
from epd_trio.bootstrap import registration
from epd_trio.bootstrap.server import BootstrapServer
from epd_trio.client.discovery import fetch_encoder_urls
from epd_trio.errors import PeerUnavailable, ProtocolError, TransferTimeout

QUIET = BootstrapConfig(port=0, health_interval=60.0)  # no probe round within a test


@asynccontextmanager
async def registry(config: BootstrapConfig = QUIET, **kw: Any
                   ) -> AsyncIterator[tuple[BootstrapServer, httpx.AsyncClient]]:
    async with serve_bootstrap(config, **kw) as reg, \
            httpx.AsyncClient(base_url=reg.url, timeout=10) as http:
        yield reg, http


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> float:
    """Poll ``predicate``; → seconds it took."""
    start = trio.current_time()
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)
    return trio.current_time() - start


async def test_register_list_inspect_unregister() -> None:
    async with registry() as (reg, http):
        r = await http.post("/register_encoder_url", json={"url": "HTTP://Enc-1:8001/"})
        assert r.status_code == 200 and r.json() == {"url": "http://enc-1:8001", "registered": True}
        r = await http.post("/register_encoder_url", json={"url": "http://enc-1:8001"})
        assert r.json() == {"url": "http://enc-1:8001", "registered": False}  # duplicate ignored
        await http.post("/register_encoder_url", json={"url": "http://[::1]:8002"})
        assert (await http.get("/list_encoder_urls")).json() == {
            "encoder_urls": ["http://enc-1:8001", "http://[::1]:8002"]}
        (first, _) = (await http.get("/encoders")).json()["encoders"]
        assert {k: first[k] for k in ("url", "healthy", "failures", "last_ok", "evicted_at")} == {
            "url": "http://enc-1:8001", "healthy": True, "failures": 0, "last_ok": None,
            "evicted_at": None}
        r = await http.request("DELETE", "/unregister_encoder_url", json={"url": "http://enc-1:8001/"})
        assert r.json() == {"url": "http://enc-1:8001", "unregistered": True}
        r = await http.post("/unregister_encoder_url", json={"url": "http://[::1]:8002"})  # POST too
        assert r.json()["unregistered"] is True
        r = await http.post("/unregister_encoder_url", json={"url": "http://[::1]:8002"})
        assert r.status_code == 200 and r.json()["unregistered"] is False  # idempotent
        assert (await http.get("/list_encoder_urls")).json() == {"encoder_urls": []}
        health = (await http.get("/health")).json()
        assert (health["status"], health["encoders"], health["health_loop"]) == ("ok", 0, "running")
        s = reg.statistics().registry
        assert (s.registrations, s.unregistrations, s.encoders) == (2, 2, 0)


MALFORMED = [
    (b"{not json", "not valid JSON"),
    (b"[\"http://a:1\"]", "must be a JSON object"),
    (b"{}", "body must be"),
    (b'{"url": 8000}', "non-empty string"),
    (b'{"url": ""}', "non-empty string"),
    (b'{"url": "ftp://enc:21"}', "http:// or https://"),
    (b'{"url": "enc:8000"}', "http:// or https://"),
    (b'{"url": "http://enc"}', "must name a port"),
    (b'{"url": "http://enc:70000"}', "invalid port"),
    (b'{"url": "http://:8000"}', "must name a host"),
    (b'{"url": "http://u:p@enc:8000"}', "credentials"),
    (b'{"url": "http://enc:8000/?x=1"}', "query or fragment"),
    (b'{"url": "http://e nc:8000"}', "whitespace"),
]


@pytest.mark.parametrize("http_server", ["builtin", "hypercorn"])
async def test_connection_close_is_honoured(http_server: str) -> None:
    """A client that asks for ``Connection: close`` and reads until the close gets it
    (quart-trio's disconnect watcher had cancelled Hypercorn's close: the socket stayed open)."""
    async with registry(dataclasses.replace(QUIET, http_server=http_server)) as (reg, _):
        parts = urlsplit(reg.url)
        stream = await trio.open_tcp_stream(parts.hostname, parts.port)
        async with stream:
            await stream.send_all(b"GET /list_encoder_urls HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"encoder_urls": []}


async def test_a_head_over_16_kib_is_431_and_closes() -> None:
    """Sent in one write, h11 sees the whole head at once: only the app's check bounds it."""
    async with registry() as (reg, http):
        parts = urlsplit(reg.url)
        for size, expected in ((15_000, b"HTTP/1.1 200"), (17_000, b"HTTP/1.1 431")):
            stream = await trio.open_tcp_stream(parts.hostname, parts.port)
            async with stream:
                await stream.send_all(b"GET /list_encoder_urls HTTP/1.1\r\nHost: x\r\nX-Big: " +
                                      b"x" * size + b"\r\nConnection: close\r\n\r\n")
                answer = b""
                with trio.fail_after(10):
                    while chunk := await stream.receive_some(65536):
                        answer += chunk
            assert answer.startswith(expected), answer[:200]
            if expected.endswith(b"431"):
                assert b"HeadersTooLargeError" in answer and b"16384" in answer, answer
        assert (await http.get("/list_encoder_urls")).status_code == 200


async def test_malformed_urls_and_bodies_are_400() -> None:
    async with registry() as (reg, http):
        for body, message in MALFORMED:
            for method, path in (("POST", "/register_encoder_url"), ("DELETE", "/unregister_encoder_url")):
                r = await http.request(method, path, content=body,
                                       headers={"content-type": "application/json"})
                assert r.status_code == 400, (body, r.text)
                error = r.json()
                assert error["error"]["type"] == "RequestError" and error["req_id"] is None
                assert message in error["error"]["message"], (body, error)
        assert reg.registry.urls() == []
        r = await http.get("/register_encoder_url")
        assert r.status_code == 405 and "error" in r.json()
        assert "POST" in r.headers["allow"] and r.headers["content-type"] == "application/json"
        r = await http.post("/register_encoder_url", content=b"x" * 100_000)
        assert r.status_code == 413 and "error" in r.json()


async def test_token_guards_register_and_unregister(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    token = "s3cret-t0ken"
    async with registry(dataclasses.replace(QUIET, auth_token=token)) as (reg, http):
        body = {"url": "http://enc:8001"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token},
                        {"Authorization": f"Basic {token}"}, {"Authorization": f"Bearer {token}x"}):
            r = await http.post("/register_encoder_url", json=body, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "UnauthorizedError"
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert token not in r.text
        assert reg.registry.urls() == []
        good = {"Authorization": f"Bearer {token}"}
        assert (await http.post("/register_encoder_url", json=body, headers=good)).status_code == 200
        assert (await http.get("/list_encoder_urls")).json()["encoder_urls"] == ["http://enc:8001"]
        r = await http.request("DELETE", "/unregister_encoder_url", json=body)
        assert r.status_code == 401 and reg.registry.urls() == ["http://enc:8001"]
        r = await http.request("DELETE", "/unregister_encoder_url", json=body, headers=good)
        assert r.status_code == 200 and reg.registry.urls() == []
    assert caplog.text and token not in caplog.text
    assert token not in repr(dataclasses.replace(QUIET, auth_token=token))


async def test_a_real_probe_evicts_a_dead_server_and_revives_it() -> None:
    """The 'encoder' is another registry: anything answering GET /health with 200 will do."""
    config = BootstrapConfig(port=0, health_interval=0.1, health_timeout=0.5, max_failures=3)
    bound = (config.max_failures + 1) * config.health_interval + config.health_timeout
    crash = trio.CancelScope()

    async def target_task(task_status: trio.TaskStatus[BootstrapServer]) -> None:
        with crash:
            await run_bootstrap(QUIET, task_status=task_status)

    async with registry(config) as (reg, http), trio.open_nursery() as nursery:
        target = await nursery.start(target_task)
        await http.post("/register_encoder_url", json={"url": target.url})
        await wait_until(lambda: reg.registry.get(target.url).last_ok is not None)  # type: ignore[union-attr]
        crash.cancel()  # gone at once: sockets closed, no goodbye
        took = await wait_until(lambda: reg.registry.healthy_urls() == [], timeout=5)
        assert took <= bound, f"evicted after {took:.2f} s, bound {bound:.2f} s"
        entry = reg.registry.get(target.url)
        assert entry is not None and entry.failures >= config.max_failures  # evicted, still probed
        port = urlsplit(target.url).port
        await nursery.start(run_bootstrap, dataclasses.replace(QUIET, port=port))  # it comes back
        await wait_until(lambda: reg.registry.healthy_urls() == [target.url], timeout=5)
        s = reg.statistics().registry
        assert (s.evictions, s.revivals) == (1, 1)
        nursery.cancel_scope.cancel()


async def test_health_loop_crash_leaves_the_registry_serving() -> None:
    async def buggy_probe(url: str) -> bool:
        raise RuntimeError("probe bug")

    config = BootstrapConfig(port=0, health_interval=0.05)
    async with registry(config, probe=buggy_probe) as (reg, http):
        await http.post("/register_encoder_url", json={"url": "http://enc:8001"})
        await wait_until(lambda: reg.health.statistics().crashes >= 1)
        health = (await http.get("/health")).json()
        assert health["status"] == "ok" and health["health_loop"] == "restarting"
        r = await http.post("/register_encoder_url", json={"url": "http://enc:8002"})
        assert r.status_code == 200
        assert (await http.get("/list_encoder_urls")).json()["encoder_urls"] == [
            "http://enc:8001", "http://enc:8002"]
        stats = (await http.get("/stats")).json()
        assert stats["health_loop"]["last_crash"] == "RuntimeError: probe bug"


async def test_fetch_encoder_urls() -> None:
    async with registry() as (reg, http):
        for url in ("http://b:2", "http://a:1"):
            await http.post("/register_encoder_url", json={"url": url})
        assert await fetch_encoder_urls(http, reg.url + "/", 5.0) == ["http://b:2", "http://a:1"]
        dead = reg.url
    async with httpx.AsyncClient() as http:
        with pytest.raises(PeerUnavailable, match="unreachable"):
            await fetch_encoder_urls(http, dead, 5.0)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")  # accepts, never answers
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(TransferTimeout):
            await fetch_encoder_urls(http, f"http://127.0.0.1:{port}", 0.2)
        await listeners[0].aclose()


@pytest.mark.parametrize(("status", "body", "error"), [
    (503, b"{}", PeerUnavailable),
    (200, b"not json", ProtocolError),
    (200, b'{"urls": []}', ProtocolError),
    (200, b'{"encoder_urls": ["ftp://x:1"]}', ProtocolError),
])
async def test_fetch_encoder_urls_refuses_bad_answers(status: int, body: bytes, error: type) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    async with httpx.AsyncClient(transport=transport) as http:
        with pytest.raises(error):
            await fetch_encoder_urls(http, "http://reg:8997", 1.0)


async def test_encoder_registers_is_probed_and_unregisters_before_draining(
        encoder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The 2 s production bound once ran out under heavy parallel load; this test is
    # about the order (goodbye before draining), not the bound.
    monkeypatch.setattr(registration, "UNREGISTER_TIMEOUT", 30.0)
    config = BootstrapConfig(port=0, health_interval=0.1, health_timeout=5.0)
    async with registry(config) as (reg, _):
        seen: list[tuple[str, bool, bool]] = []
        unregister = reg.registry.unregister
        async with encoder(register_url=(reg.url,), heartbeat_interval=0.2) as (server, _):
            assert server.advertise_url == server.url  # derived from the bound port-0 URL

            def spy(url: str) -> bool:
                seen.append((url, server.service.admitting, server.service.draining))
                return unregister(url)

            reg.registry.unregister = spy  # type: ignore[method-assign]
            await wait_until(lambda: reg.registry.healthy_urls() == [server.advertise_url])
            # The real health probe reaches the real encoder's /health.
            await wait_until(lambda: reg.registry.get(server.url).last_ok is not None)  # type: ignore[union-attr]
            (link,) = server.registration.statistics().links  # type: ignore[union-attr]
            assert link.registered and link.registry_url == reg.url
        # Unregistered while still admitting, health already saying "draining" (readiness fails).
        assert seen == [(server.advertise_url, True, True)]
        assert reg.registry.urls() == []


async def test_restarted_registry_is_refilled_by_heartbeats(encoder: Any) -> None:
    heartbeat = 0.2
    async with trio.open_nursery() as nursery:
        first_done = trio.Event()

        async def first_registry(task_status: trio.TaskStatus[BootstrapServer]) -> None:
            try:
                await run_bootstrap(QUIET, task_status=task_status)
            finally:
                first_done.set()

        first = await nursery.start(first_registry)
        async with encoder(register_url=(first.url,), heartbeat_interval=heartbeat) as (server, _):
            await wait_until(lambda: first.registry.healthy_urls() == [server.advertise_url])
            first.shutdown()
            await first_done.wait()
            port = urlsplit(first.url).port
            second = await nursery.start(run_bootstrap, dataclasses.replace(QUIET, port=port))
            assert second.url == first.url and second.registry.urls() == []
            took = await wait_until(lambda: second.registry.healthy_urls() == [server.advertise_url])
            assert took <= heartbeat + 1.0
        nursery.cancel_scope.cancel()


async def test_a_full_registry_answers_503_in_json() -> None:
    async with registry(dataclasses.replace(QUIET, max_encoders=1)) as (reg, http):
        assert (await http.post("/register_encoder_url", json={"url": "http://e1:8000"})).status_code == 200
        full = await http.post("/register_encoder_url", json={"url": "http://e2:8000"})
        assert full.status_code == 503 and full.json()["error"]["type"] == "OverloadedError"
        assert "--max-encoders" in full.json()["error"]["message"]
        assert reg.registry.urls() == ["http://e1:8000"]
