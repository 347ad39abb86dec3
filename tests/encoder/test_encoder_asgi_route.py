"""``POST /encode`` served as bare ASGI in front of Quart: the face's rules still hold.

Real Hypercorn on port 0; a raw socket where the client must misbehave (a body that
never ends, a body larger than it said).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio

from conftest import image_uri
from epd_trio.protocol.codec import decode_safetensors

ENCODE = {"req_id": "a", "modality": "image", "mm_items": [image_uri()]}


def error_of(r: Any) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error", "req_id"} and set(body["error"]) == {"type", "message"}, body
    return body["error"]


async def raw_exchange(url: str, head: bytes, body_parts: list[bytes], *, pause: float = 0.0) -> bytes:
    """Send ``head`` and the parts (``pause`` s after the first), then read one whole answer."""
    parts = urlsplit(url)
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        await stream.send_all(head)
        for i, part in enumerate(body_parts):
            await stream.send_all(part)
            if i == 0 and pause:
                await trio.sleep(pause)
        answer = b""
        with trio.fail_after(30):
            while not _complete(answer) and (chunk := await stream.receive_some(65536)):
                answer += chunk
        return answer


def _complete(answer: bytes) -> bool:
    head, found, body = answer.partition(b"\r\n\r\n")
    if not found:
        return False
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return len(body) >= length


def status_and_json(answer: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


async def test_encode_answers_as_before_and_other_routes_stay_on_quart(encoder: Any) -> None:
    async with encoder() as (_, http):
        r = await http.post("/encode", json=ENCODE)
        assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.safetensors"
        tensor, meta = decode_safetensors(r.content)
        assert meta["req_id"] == "a" and tensor.shape[0] == sum(meta["token_counts"])
        assert int(r.headers["content-length"]) == len(r.content)
        assert (await http.get("/model_info")).status_code == 200
        assert error_of(await http.get("/nowhere"))["type"] == "NotFound"
        bad = await http.post("/encode", content=b"{nope", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "not valid JSON" in error_of(bad)["message"]


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_other_methods_are_405_with_allow(encoder: Any, method: str) -> None:
    async with encoder() as (_, http):
        r = await http.request(method, "/encode")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert error_of(r)["type"] == "MethodNotAllowed"


async def test_quart_routes_405_with_allow_too(encoder: Any) -> None:
    async with encoder() as (_, http):
        for method, path, allowed in [("POST", "/health", "GET"), ("GET", "/abort", "POST")]:
            r = await http.request(method, path)
            assert r.status_code == 405 and allowed in r.headers["allow"].split(", "), (path, r.headers)
            assert r.headers["content-type"] == "application/json"
            assert error_of(r)["type"] == "MethodNotAllowed"


async def test_declared_oversized_body_is_413_unread_and_the_connection_closes(encoder: Any) -> None:
    limit = len(json.dumps(ENCODE)) + 100
    async with encoder(max_body_bytes=limit) as (server, http):
        head = (b"POST /encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (limit + 1))
        status, headers, body = status_and_json(await raw_exchange(server.url, head, []))
        assert status == 413 and headers["connection"] == "close"
        assert body["error"]["type"] == "PayloadTooLargeError"
        assert (await http.post("/encode", json=ENCODE)).status_code == 200  # still serving


async def test_streamed_body_over_the_limit_is_413(encoder: Any) -> None:
    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked, as it comes
        for _ in range(10):
            yield b" " * 400

    async with encoder(max_body_bytes=3000) as (_server, http):
        r = await http.post("/encode", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.headers["connection"] == "close"
        assert (await http.get("/stats")).json()["live_requests"] == 0


@pytest.mark.parametrize("sent", [[b'{"req_id"'], []], ids=["never-ends", "never-starts"])
async def test_a_body_that_never_ends_is_408_within_the_request_timeout(encoder: Any, sent: list[bytes]) -> None:
    async with encoder(request_timeout=1.0) as (server, http):
        head = (b"POST /encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n")
        started = trio.current_time()
        status, headers, body = status_and_json(await raw_exchange(server.url, head, sent))
        assert status == 408 and headers["connection"] == "close"
        assert body["error"]["type"] == "BodyTimeoutError" and "1 s" in body["error"]["message"]
        assert 0.9 <= trio.current_time() - started < 10
        assert (await http.get("/stats")).json()["live_requests"] == 0


async def test_a_slow_but_complete_body_is_served(encoder: Any) -> None:
    async with encoder(request_timeout=30.0) as (server, _):
        raw = json.dumps(ENCODE).encode()
        head = (b"POST /encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(raw))
        answer = await raw_exchange(server.url, head, [raw[:10], raw[10:]], pause=0.2)
        assert answer.startswith(b"HTTP/1.1 200")


async def test_token_is_checked_before_the_body(encoder: Any) -> None:
    async with encoder(auth_token="tok-en", require_auth_for_encode=True) as (server, http):
        head = (b"POST /encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n")  # the body never comes: only the head is judged
        status, headers, body = status_and_json(await raw_exchange(server.url, head, []))
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert "tok-en" not in json.dumps(body)
        ok = await http.post("/encode", json=ENCODE, headers={"Authorization": "Bearer tok-en"})
        assert ok.status_code == 200


async def test_a_bug_in_the_handler_is_a_logged_500(encoder: Any, caplog: pytest.LogCaptureFixture) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    caplog.set_level(logging.ERROR)
    async with encoder() as (server, http):
        server.service.encode = broken  # type: ignore[method-assign]
        r = await http.post("/encode", json=ENCODE)
        assert r.status_code == 500 and error_of(r)["type"] == "InternalError"
        assert "boom" not in r.text
    assert "unhandled error in /encode" in caplog.text


async def test_send_is_bare_too(encoder: Any) -> None:
    async with encoder() as (_, http):
        assert (await http.get("/send")).headers["allow"] == "POST"
        r = await http.post("/send", json={"req_id": "gone", "part_idx": 0, "session": "127.0.0.1:17777",
                                           "buffer_address": 4096, "buffer_length": 16})
        assert r.status_code == 404 and error_of(r)["type"] == "UnknownRequestError"


@pytest.mark.parametrize("server", ["builtin", "hypercorn"])
async def test_a_client_that_leaves_cancels_its_waiting_send(encoder: Any, server: str) -> None:
    """``/send`` waits in the service (``cancelled_when_gone``): a client that leaves cancels it."""
    import httpx

    cancelled = trio.Event()

    async def waits(*args: Any, **kwargs: Any) -> int:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with encoder(http_server=server) as (service_server, http):
        service_server.service.send = waits  # type: ignore[method-assign]
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/send", json={"req_id": "r", "part_idx": 0, "session": "127.0.0.1:17777",
                                           "buffer_address": 4096, "buffer_length": 16}, timeout=0.5)
        with trio.fail_after(5):
            await cancelled.wait()


async def test_sglang_face_serves_its_data_routes_bare_in_its_error_shape(encoder: Any) -> None:
    paths = ("/encode", "/send", "/scheduler_receive_url", "/scheduler_receive_meta_data")
    async with encoder(api="sglang") as (_, http):
        for path in paths:
            r = await http.get(path)
            assert r.status_code == 405 and r.headers["allow"] == "POST", path
            assert r.json()["status"] == "error", path
            bad = await http.post(path, content=b"{bad", headers={"content-type": "application/json"})
            assert bad.status_code == 400 and bad.json()["status"] == "error", (path, bad.text)
        assert (await http.get("/health_generate")).status_code == 200  # still Quart's
        quart = await http.delete("/start_profile")  # Quart's 405, in SGLang's shape, with Allow
        assert quart.status_code == 405 and quart.json()["status"] == "error"
        assert {"GET", "POST"} <= set(quart.headers["allow"].split(", "))


async def read_to_close(url: str, request: bytes) -> bytes:
    """Send ``request`` and read until the server closes (bounded: a server that keeps the
    socket open fails the test instead of hanging it)."""
    parts = urlsplit(url)
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    async with stream:
        await stream.send_all(request)
        answer = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                answer += chunk
        return answer


async def test_connection_close_is_honoured_on_bare_and_quart_routes(encoder: Any) -> None:
    """Hypercorn closes such a connection inside the last send; a cancelled send (a disconnect
    watcher's) had left the socket open, and this client waiting for the close hung."""
    raw = json.dumps(ENCODE).encode()
    async with encoder() as (server, _):
        for request in (b"GET /model_info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                        b"POST /encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)):
            answer = await read_to_close(server.url, request)
            assert answer.startswith(b"HTTP/1.1 200") and _complete(answer), answer[:200]


@pytest.mark.parametrize("api", ["native", "sglang"])
async def test_a_head_over_the_limit_is_431_on_every_route(encoder: Any, api: str) -> None:
    """One check in front of Quart: the data path's routes and Quart's alike, in the face's shape."""
    big = b"X-Big: " + b"x" * 3000 + b"\r\n"  # one send: h11 sees the whole head at once
    async with encoder(api=api, max_header_bytes=2048) as (server, http):
        for line in (b"GET /model_info HTTP/1.1", b"POST /encode HTTP/1.1"):
            answer = await raw_exchange(server.url, line + b"\r\nHost: x\r\n" + big +
                                        b"Content-Length: 2\r\n\r\n{}", [])
            status, headers, body = status_and_json(answer)
            assert status == 431 and headers["connection"] == "close", (api, line)
            assert ("HeadersTooLargeError" in json.dumps(body)) == (api == "native"), body
            assert "2048" in json.dumps(body), body
        assert (await http.get("/model_info")).status_code == 200
