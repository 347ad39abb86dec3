"""The EPD proxy over real HTTP: real epd_trio encoders (``--api vllm``), a stand-in
language server (``proxy_fakes``; a real vLLM behind the proxy is ``tests/vllm``)."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from conftest import data_uri, first_event_then_leave, png_bytes, running
from epd_trio import ProxyConfig, ProxyServer, serve_proxy
from proxy_fakes import FakeEncoder, FakeLanguageServer, serving

CHAT = "/v1/chat/completions"


@asynccontextmanager
async def proxied(encoders: list[str], servers: list[str], **overrides: Any
                  ) -> AsyncIterator[tuple[ProxyServer, httpx.AsyncClient]]:
    config = ProxyConfig(port=0, encoder_urls=tuple(encoders), prefill_decode_urls=tuple(servers),
                         **overrides)
    async with serve_proxy(config) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        yield server, http


@asynccontextmanager
async def vllm_encoders(model: str, storage: Path, count: int) -> AsyncIterator[list[str]]:
    ec = json.dumps({"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                     "ec_connector_extra_config": {"shared_storage_path": str(storage)}})
    async with AsyncExitStack() as stack:
        urls = []
        for _ in range(count):
            server, _ = await stack.enter_async_context(running(
                model, api="vllm", ec_transfer_config=ec, served_model_name="tiny"))
            urls.append(server.url)
        yield urls


def _chat(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": "what is it?"}]}], **extra}


def _image(seed: int, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_uri(png_bytes(56, 42, seed))}, **extra}


def _events(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


async def test_media_is_stored_first_then_the_request_goes_on_unchanged(
        qwen25_path: str, tmp_path: Path) -> None:
    language = FakeLanguageServer(storage=tmp_path)
    raw = json.dumps(_chat(_image(1), _image(2, uuid="item-2"), _image(3))).encode()
    async with vllm_encoders(qwen25_path, tmp_path, 2) as encoders, serving(language) as lm, \
            proxied(encoders, [lm]) as (server, http):
        answer = await http.post(CHAT, content=raw, headers={"x-request-id": "req-7",
                                                              "content-type": "application/json"})
        stats = server.proxy.client.statistics()
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == "req-7"
    [seen] = language.seen
    assert seen.raw == raw and seen.headers["x-request-id"] == "req-7"
    assert len(seen.stored) == 3 and "item-2" in seen.stored  # every item was stored before
    assert all((tmp_path / name / "encoder_cache.safetensors").is_file() for name in seen.stored)
    assert stats.requests_done == 1 and set(stats.outstanding) == set(encoders)


async def test_completions_and_text_only_chats_go_straight_to_the_language_server() -> None:
    language, encoder = FakeLanguageServer(), FakeEncoder(status=200)
    async with serving(encoder) as e, serving(language) as lm, proxied([e], [lm]) as (_, http):
        chat = await http.post(CHAT, json=_chat(), headers={"authorization": "Bearer key-1",
                                                            "expect": "100-continue"})
        completion = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        models = await http.get("/v1/models")
    assert chat.status_code == completion.status_code == models.status_code == 200
    assert [s.path for s in language.seen] == [CHAT, "/v1/completions"]
    assert language.seen[0].headers["authorization"] == "Bearer key-1"  # vLLM's --api-key
    assert "expect" not in language.seen[0].headers  # about the caller's own connection
    assert models.json()["data"] == [{"id": "tiny"}]
    assert encoder.calls == 0


@pytest.mark.parametrize("http_server", ["builtin", "hypercorn"])
async def test_a_stream_is_relayed_event_by_event(http_server: str) -> None:
    language = FakeLanguageServer(events=3)
    async with serving(language) as lm, \
            proxied(["http://127.0.0.1:9"], [lm], http_server=http_server) as (server, http):
        async with http.stream("POST", CHAT, json=_chat(stream=True)) as answer:
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            lines = answer.aiter_lines()
            language.release()
            with trio.fail_after(10):  # the first event comes while the others are held back
                first = await anext(lines)
                while not first:
                    first = await anext(lines)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] == "t0"
            language.release(2)
            rest = [line async for line in lines]
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in _events(rest)[:-1]] == ["t1", "t2"]
    assert _events(rest)[-1] == "[DONE]"
    assert server.proxy.statistics().requests_done == 1


@pytest.mark.parametrize("http_server", ["builtin", "hypercorn"])
async def test_the_caller_leaving_cancels_the_forwarded_request(http_server: str) -> None:
    """Events come every 20 ms, as tokens would: the proxy finds the caller gone when it writes
    the next one, closes the forwarded request, and the language server finds that out when it
    writes its next one (a FIN alone may be a half-close, for either side)."""
    events = 500
    language = FakeLanguageServer(events=events)

    async def tokens() -> None:
        for _ in range(events):
            language.release()
            await trio.sleep(0.02)

    async with serving(language) as lm, \
            proxied(["http://127.0.0.1:9"], [lm], http_server=http_server) as (server, http), \
            trio.open_nursery() as nursery:
        nursery.start_soon(tokens)
        with trio.fail_after(10):
            received = await first_event_then_leave(server.url, CHAT, _chat(stream=True))
            await language.gone.wait()  # the language server saw its request end
            while server.proxy.statistics().requests_live:
                await trio.sleep(0.01)
        metrics = (await http.get("/metrics")).text
        nursery.cancel_scope.cancel()
    assert received.startswith(b"HTTP/1.1 200") and language.sent < events
    assert 'epd_proxy_requests_total{route="/v1/chat/completions",status="499"} 1.0' in metrics
    assert all(s.in_flight == 0 for s in server.proxy.servers.statistics())


async def test_a_caller_leaving_while_encoders_work_closes_their_calls() -> None:
    stuck, language = FakeEncoder(hang=True), FakeLanguageServer()
    async with serving(stuck) as e, serving(language) as lm, proxied([e], [lm]) as (server, _):
        with trio.fail_after(10):
            await first_event_then_leave(server.url, CHAT, _chat(_image(1)), wait=False)
            await stuck.gone.wait()  # the part's call was closed: an encoder drops the work
            while server.proxy.statistics().requests_live:
                await trio.sleep(0.01)
        assert server.proxy.client.statistics().requests_live == 0
    assert language.seen == []


async def test_requests_go_to_healthy_language_servers_only() -> None:
    sick, well = FakeLanguageServer(healthy=False), FakeLanguageServer()
    async with serving(sick) as a, serving(well) as b, \
            proxied(["http://127.0.0.1:9"], [a, b], health_interval=0.05, max_failures=1) as (server, http):
        with trio.fail_after(10):
            while server.proxy.servers.pick() != b:
                await trio.sleep(0.01)
        for _ in range(3):
            assert (await http.post(CHAT, json=_chat())).status_code == 200
        health = await http.get("/health")
        assert health.status_code == 200
        assert [s["healthy"] for s in health.json()["prefill_decode"]] == [False, True]
        well.healthy = False
        with trio.fail_after(10):
            while server.proxy.servers.any_healthy:
                await trio.sleep(0.01)
        refused = await http.post(CHAT, json=_chat())
        assert (await http.get("/health")).status_code == 503
        sick.healthy = True
        with trio.fail_after(10):
            while not server.proxy.servers.any_healthy:
                await trio.sleep(0.01)
        assert (await http.post(CHAT, json=_chat())).status_code == 200
    assert len(well.seen) == 3 and len(sick.seen) == 1
    assert refused.status_code == 503
    assert "no healthy prefill/decode server" in refused.json()["error"]["message"]


async def test_an_unreachable_language_server_is_skipped() -> None:
    well = FakeLanguageServer()
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    async with serving(well) as b, \
            proxied(["http://127.0.0.1:9"], [dead, b], health_interval=60) as (server, http):
        answer = await http.post(CHAT, json=_chat())
        states = {s.url: s for s in server.proxy.servers.statistics()}
    assert answer.status_code == 200 and len(well.seen) == 1
    assert states[dead].failures >= 1 and states[b].forwarded == 1


async def test_an_encoders_4xx_reaches_the_caller_and_nothing_is_forwarded(
        qwen25_path: str, tmp_path: Path) -> None:
    language = FakeLanguageServer()
    bad = {"type": "image_url", "image_url": {"url": data_uri(b"not an image at all")}}
    async with vllm_encoders(qwen25_path, tmp_path, 1) as encoders, serving(language) as lm, \
            proxied(encoders, [lm]) as (_, http):
        with trio.fail_after(30):
            answer = await http.post(CHAT, json=_chat(_image(1), bad), headers={"x-request-id": "r-bad"})
    assert answer.status_code == 400 and answer.headers["x-request-id"] == "r-bad"
    error = answer.json()["error"]
    assert error["code"] == 400 and error["message"].startswith("encoder: ") and "item" in error["message"]
    assert language.seen == []


async def test_a_failing_encoder_fails_over_and_a_lone_one_gives_its_status(
        qwen25_path: str, tmp_path: Path) -> None:
    language, failing = FakeLanguageServer(storage=tmp_path), FakeEncoder(status=503)
    async with vllm_encoders(qwen25_path, tmp_path, 1) as [good], serving(failing) as bad, \
            serving(language) as lm:
        async with proxied([bad, good], [lm]) as (_, http):
            moved = await http.post(CHAT, json=_chat(_image(1), _image(2)))
        async with proxied([bad], [lm]) as (_, http):
            alone = await http.post(CHAT, json=_chat(_image(3)))
    assert moved.status_code == 200 and failing.calls == 2 and len(language.seen[0].stored) == 2
    assert alone.status_code == 503 and alone.json()["error"]["message"] == "encoder: fake failure 503"
    assert alone.json()["error"]["type"] == "FakeError" and len(language.seen) == 1


async def test_deadlines_on_the_encoders_and_on_the_language_server() -> None:
    stuck, language = FakeEncoder(hang=True), FakeLanguageServer(events=2)
    async with serving(stuck) as e, serving(language) as lm, \
            proxied([e], [lm], encode_timeout=0.3, upstream_timeout=0.5) as (_, http):
        with trio.fail_after(10):
            encode = await http.post(CHAT, json=_chat(_image(1)))
            await stuck.gone.wait()
            language.release()  # one event, then silence: the stream ends with an error event
            streamed = await http.post(CHAT, json=_chat(stream=True))
            language.stall = True
            silent = await http.post(CHAT, json=_chat())
    assert encode.status_code == 504 and "not encoded within 0.3 s" in encode.json()["error"]["message"]
    events = _events(streamed.text.splitlines())
    assert streamed.status_code == 200 and len(events) == 3 and events[-1] == "[DONE]"
    assert json.loads(events[1])["error"]["code"] == 504
    assert silent.status_code == 504 and "--upstream-timeout" in silent.json()["error"]["message"]


async def test_over_max_requests_is_a_503_at_once() -> None:
    language = FakeLanguageServer(stall=True)
    async with serving(language) as lm, \
            proxied(["http://127.0.0.1:9"], [lm], max_requests=1) as (_server, http), \
            trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(http.post, CHAT, json=_chat()))
        with trio.fail_after(10):
            while not language.seen:
                await trio.sleep(0.01)
            refused = await http.post(CHAT, json=_chat())
        nursery.cancel_scope.cancel()
    assert refused.status_code == 503 and "--max-requests 1" in refused.json()["error"]["message"]


async def test_routes_errors_and_metrics() -> None:
    language = FakeLanguageServer()
    async with serving(language) as lm, proxied(["http://127.0.0.1:9"], [lm]) as (_, http):
        await http.post(CHAT, json=_chat())
        missing = await http.get("/v1/nothing")
        wrong = await http.get(CHAT)
        not_json = await http.post(CHAT, content=b"{nope")
        not_bool = await http.post(CHAT, json=_chat(stream="yes"))
        bad_id = await http.post(CHAT, json=_chat(), headers={"x-request-id": "x" * 300})
        metrics = await http.get("/metrics")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert not_json.status_code == not_bool.status_code == bad_id.status_code == 400
    assert "not valid JSON" in not_json.json()["error"]["message"]
    assert "x-request-id" in bad_id.json()["error"]["message"]
    assert 'epd_proxy_requests_total{route="/v1/chat/completions",status="200"} 1.0' in metrics.text
    assert 'epd_proxy_requests_total{route="/v1/chat/completions",status="400"} 3.0' in metrics.text
    assert "epd_client_requests_total" in metrics.text and len(language.seen) == 1


@pytest.mark.parametrize("fields", [{"prefill_decode_urls": ()}, {"encoder_urls": ()},
                                    {"encoder_urls": ("grpc://e:1",)}, {"max_requests": 0}])
def test_config_refusals(fields: dict[str, Any]) -> None:
    base: dict[str, Any] = {"encoder_urls": ("http://e:1",), "prefill_decode_urls": ("http://l:2",)}
    with pytest.raises(ValueError):
        ProxyConfig(**{**base, **fields})


async def test_a_bug_is_a_500_and_the_proxy_keeps_serving() -> None:
    language = FakeLanguageServer()
    async with serving(language) as lm, proxied(["http://127.0.0.1:9"], [lm]) as (server, http):
        parse = server.proxy.parse

        async def broken(raw: bytes, route: str) -> Any:
            raise KeyError("a bug")

        server.proxy.parse = broken  # type: ignore[method-assign]
        failed = await http.post(CHAT, json=_chat())
        server.proxy.parse = parse  # type: ignore[method-assign]
        fine = await http.post(CHAT, json=_chat())
    assert failed.status_code == 500 and failed.json()["error"]["code"] == 500
    assert "a bug" not in failed.text  # no internals leak to the caller
    assert fine.status_code == 200
