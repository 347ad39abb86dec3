"""``--http-server hypercorn`` (``epd_trio._hypercorn``): what our connections do around
Hypercorn's HTTP/1.1 protocol that its own trio worker did not. The promises both servers
share are checked under both in ``test_http11.py`` and ``test_http_clients.py``."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from epd_trio import _hypercorn
from epd_trio._serving import CLOSES_AFTER_APP
from http_apps import answer, connect, echo_app, lifespan, read_until_closed, serving, split_answers


async def test_a_failure_in_the_protocol_code_ends_its_connection_only(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Hypercorn's own worker let any exception of a connection's protocol code escape into the
    server's nursery: one request ended the process."""
    async def broken(self: Any, event: Any) -> None:
        if event.target == b"/bug":
            raise RuntimeError("a bug in the protocol code")

    monkeypatch.setattr(_hypercorn._Protocol, "_check_protocol", broken)
    async with serving(echo_app(), "hypercorn") as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET /bug HTTP/1.1\r\nHost: x\r\n\r\n")
            with pytest.raises(trio.BrokenResourceError):  # reset: nothing was answered
                assert await read_until_closed(stream) == b""
        async with await connect(url) as stream:
            await stream.send_all(b"GET /after HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert split_answers(await read_until_closed(stream))[0][1] == b"GET /after? "
    assert "a bug in the protocol code" in caplog.text


async def test_nothing_after_a_request_that_closes_reaches_the_app() -> None:
    seen: list[dict[str, Any]] = []
    async with serving(echo_app(seen), "hypercorn") as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET /1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                  b"GET /2 HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = await read_until_closed(stream)
    assert [body for _, body in split_answers(raw)] == [b"GET /1? "]  # not Hypercorn's 400
    assert [scope["path"] for scope in seen] == ["/1"]


async def test_the_app_is_told_that_no_send_closes_the_connection() -> None:
    """So ``_http.guarded_app`` shields nothing: a send cannot cut a close short here."""
    seen: list[dict[str, Any]] = []
    async with serving(echo_app(seen), "hypercorn") as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await read_until_closed(stream)
    assert CLOSES_AFTER_APP in seen[0]["extensions"]


async def test_an_app_that_leaves_mid_answer_resets_the_connection_after_the_app_returns() -> None:
    returned = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
        finally:
            returned.set()

    async with serving(app, "hypercorn") as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"GET / HTTP/1.0\r\n\r\n")
            raw = b""
            with pytest.raises(trio.BrokenResourceError), trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    raw += chunk
    assert returned.is_set() and raw.endswith(b"part")


async def test_an_answer_to_an_unread_body_says_it_closes() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        await answer(send, b"early", status=413)

    async with serving(app, "hypercorn") as (url, _):
        async with await connect(url) as stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nstart")
            raw = await read_until_closed(stream)
    assert raw.startswith(b"HTTP/1.1 413 ") and b"connection: close" in raw.lower() and raw.endswith(b"early")
