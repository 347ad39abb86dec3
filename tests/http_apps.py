"""Small ASGI apps and raw-socket helpers for the HTTP server tests: either server
(``epd_trio._listen``'s ``builtin`` or ``hypercorn``) on 127.0.0.1:0 for a block."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from epd_trio._http11 import serve_http11
from epd_trio._hypercorn import serve_hypercorn
from epd_trio._listen import bound_listener
from epd_trio._serving import HTTPServerConfig

App = Callable[..., Awaitable[None]]
SERVERS = {"builtin": serve_http11, "hypercorn": serve_hypercorn}


async def answer(send: Any, body: bytes, status: int = 200, headers: tuple = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        assert message["type"] == "http.request"
        chunks.append(message["body"])
        if not message["more_body"]:
            return b"".join(chunks)


def echo_app(seen: list[dict[str, Any]] | None = None) -> App:
    """Answers ``<method> <path>?<query> <body>``; records each request's scope."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if seen is not None:
            seen.append(scope)
        body = await read_body(receive)
        await answer(send, b"%s %s?%s %s" % (scope["method"].encode(), scope["path"].encode(),
                                              scope["query_string"], body))

    return app


async def lifespan(receive: Any, send: Any, on_startup: Callable[[], None] = lambda: None) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            on_startup()
            await send({"type": "lifespan.startup.complete"})
        else:
            await send({"type": "lifespan.shutdown.complete"})
            return


@asynccontextmanager
async def serving(app: App, server: str = "builtin", **config: Any) -> AsyncIterator[tuple[str, trio.Event]]:
    """``app`` served by ``server`` on 127.0.0.1:0 for the block → (base URL, the shutdown trigger)."""
    stop = trio.Event()
    async with bound_listener("127.0.0.1", 0) as listener, trio.open_nursery() as nursery:
        await nursery.start(functools.partial(SERVERS[server], app, [listener.sock],
                                              HTTPServerConfig(**config), shutdown_trigger=stop.wait))
        yield f"http://127.0.0.1:{listener.sock.getsockname()[1]}", stop
        stop.set()


async def connect(url: str) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))


async def read_until_closed(stream: trio.SocketStream, timeout: float = 10) -> bytes:
    data = b""
    with trio.fail_after(timeout):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


def split_answers(raw: bytes) -> list[tuple[bytes, bytes]]:
    """``[(head, body)]`` of Content-Length answers, in order (interim 1xx ones left out)."""
    answers = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 1"):
            raw = rest
            continue
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        answers.append((head, rest[:length]))
        raw = rest[length:]
    return answers
