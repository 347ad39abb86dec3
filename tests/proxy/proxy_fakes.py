"""Stand-ins for the proxy's peers, on real HTTP (the built-in server, port 0).

``FakeLanguageServer`` plays vLLM's OpenAI server (a real one is ``tests/vllm``:
it costs 30 s and 4 GB to start, too much for every rule checked here). It
records each request (path, headers, body, and the item directories the
shared storage held when it arrived), answers ``/health`` with ``healthy``,
lists one model, and answers completions whole or as an event stream whose
events wait, one by one, for the test to ``release`` them. It notes when a
caller leaves mid-answer (``gone``): as any HTTP server can, once it writes to a
caller that has closed its connection (a FIN alone may be a half-close).

``FakeEncoder`` plays an encoder instance: it records each chat request (body
and headers) and answers it with ``status`` (200: ``ec_transfer_params`` naming
the part's items; else an OpenAI error), or never answers (``hang``: it notes
the caller leaving). Encoders that really store items are real ones.
``closing_peer`` is one that reads a request and drops the connection unanswered
(an encoder dying mid-call).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from epd_trio._http import json_reply, send_reply
from epd_trio._listen import bound_listener, start_http_server

__all__ = ["FakeEncoder", "FakeLanguageServer", "Seen", "closing_peer", "serving"]


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` on 127.0.0.1 (a free port) for the block → its URL."""
    async with bound_listener("127.0.0.1", 0) as listener, trio.open_nursery() as nursery:
        stop = trio.Event()
        url = await start_http_server(nursery, app, listener, server="builtin", graceful_timeout=1.0,
                                      shutdown_trigger=stop.wait)
        try:
            yield url
        finally:
            stop.set()
            nursery.cancel_scope.cancel()


async def _body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _until_gone(receive: Any, gone: trio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    raw: bytes
    stored: list[str]  # the shared storage's item directories when the request arrived

    @property
    def body(self) -> dict[str, Any]:
        return json.loads(self.raw)


@dataclass(eq=False)
class FakeLanguageServer:
    storage: Path | None = None
    healthy: bool = True
    events: int = 3  # events of a streamed answer, before [DONE]
    status: int = 200  # what completions answer (an OpenAI error when not 200)
    stall: bool = False  # completions never answer (until the caller leaves)
    seen: list[Seen] = field(default_factory=list)
    gone: trio.Event = field(default_factory=trio.Event)  # a caller left mid-answer
    health_probes: int = 0
    sent: int = 0  # events of streamed answers written

    def __post_init__(self) -> None:
        self._gate_send, self._gate = trio.open_memory_channel[None](1000)

    def release(self, events: int = 1) -> None:
        """Let ``events`` more events of a streamed answer go."""
        for _ in range(events):
            self._gate_send.send_nowait(None)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            self.health_probes += 1
            await send_reply(send, json_reply({}, 200 if self.healthy else 503))
        elif path == "/v1/models":
            await send_reply(send, json_reply({"object": "list", "data": [{"id": "tiny"}]}))
        else:
            await self._complete(scope, receive, send, path)

    async def _complete(self, scope: dict[str, Any], receive: Any, send: Any, path: str) -> None:
        raw = await _body(receive)
        stored = sorted(p.name for p in self.storage.iterdir()) if self.storage else []
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append(Seen(path, headers, raw, stored))
        own_id = [(b"x-request-id", headers.get("x-request-id", "none").encode())]
        if self.stall:
            await _until_gone(receive, self.gone)
            return
        if self.status != 200:
            error = {"error": {"message": "bad", "type": "BadRequestError", "param": None,
                               "code": self.status}}
            await send_reply(send, json_reply(error, self.status))
            return
        if not json.loads(raw).get("stream"):
            await send_reply(send, json_reply({"object": "chat.completion", "echo": json.loads(raw)}))
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_gone, receive, self.gone)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), *own_id]})
            await send({"type": "http.response.body", "body": b"", "more_body": True})  # the head
            for k in range(self.events):
                await self._gate.receive()
                event = {"choices": [{"index": 0, "delta": {"content": f"t{k}"}}]}
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + json.dumps(event).encode() + b"\n\n"})
                self.sent += 1
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            nursery.cancel_scope.cancel()


@dataclass(eq=False)
class FakeEncoder:
    status: int = 503
    hang: bool = False
    seen: list[Seen] = field(default_factory=list)
    gone: trio.Event = field(default_factory=trio.Event)

    @property
    def calls(self) -> int:
        return len(self.seen)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = await _body(receive)
        self.seen.append(Seen(scope["path"], {k.decode(): v.decode() for k, v in scope["headers"]},
                              raw, []))
        if self.hang:
            await _until_gone(receive, self.gone)
            return
        if self.status == 200:
            parts = json.loads(raw)["messages"][0]["content"]
            name = self.seen[-1].headers.get("x-request-id", str(self.calls))
            params = {f"{name}/{k}": {"item_indices": [k]} for k in range(len(parts))}
            await send_reply(send, json_reply({"object": "chat.completion",
                                               "ec_transfer_params": params}))
            return
        error = {"error": {"message": f"fake failure {self.status}", "type": "FakeError",
                           "param": None, "code": self.status}}
        await send_reply(send, json_reply(error, self.status))


@asynccontextmanager
async def closing_peer() -> AsyncIterator[tuple[str, list[int]]]:
    """A peer that reads each request's first bytes and closes the connection unanswered
    → its URL and a list that counts the connections it dropped."""
    dropped: list[int] = []

    async def handler(stream: trio.SocketStream) -> None:
        await stream.receive_some(65536)
        dropped.append(1)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}", dropped
        finally:
            nursery.cancel_scope.cancel()
