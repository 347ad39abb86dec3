"""A language server's answer, relayed to the proxy's caller as it arrives.

The answer's status and headers (less the hop-by-hop ones) go out as soon as
they arrive, then each chunk of its body as it is read: a stream's events
reach the caller one by one, and nothing holds a whole answer in memory.

An answer can fail after its head is out (the server died, the proxy's
deadline passed): the status can no longer change. A server-sent-event stream
then ends with an error event in OpenAI's shape and ``data: [DONE]``, as vLLM
ends a stream that fails; any other answer is left cut short, which the HTTP
server turns into a reset connection, so that it cannot pass for a whole one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import httpx
import msgspec
import trio

from epd_trio.errors import EPDError
from epd_trio.protocol.vllm_requests import openai_error
from epd_trio.proxy.upstream import Upstream, relayed_headers

__all__ = ["Relay"]

log = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
_EVENT_STREAM: Final = b"text/event-stream"
_FINISH_TIMEOUT: Final = 5.0  # seconds closing an answer may take (shielded)


class Relay:
    """One answer's way to the caller; ``started`` once its head is out."""

    def __init__(self, send: Send, request_id: str, first_byte: Callable[[], None]) -> None:
        self.send = send
        self._request_id = request_id.encode()
        self._first_byte = first_byte
        self.started = False  # the head is out: the status can no longer change
        self.complete = False  # the last byte is out
        self.failed = False  # it broke off after its head was out (``cut``)
        self.status = 0
        self.event_stream = False

    async def answer(self, upstream: Upstream) -> None:
        """The head, then the body chunk by chunk; an ``httpx.HTTPError`` mid-body escapes."""
        response = upstream.response
        headers = relayed_headers(response.headers.raw)
        if not any(k.lower() == b"x-request-id" for k, _ in headers):
            headers.append((b"x-request-id", self._request_id))
        self.event_stream = response.headers.get("content-type", "").encode().startswith(_EVENT_STREAM)
        self.status = response.status_code
        await self.send({"type": "http.response.start", "status": response.status_code,
                         "headers": headers})
        # The head goes out now, as it came (an HTTP server may hold it for the first chunk).
        await self.send({"type": "http.response.body", "body": b"", "more_body": True})
        self.started = True
        first = True
        chunks = response.aiter_raw()
        try:
            async for chunk in chunks:
                if first:
                    self._first_byte()
                    first = False
                await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await _finish(response, chunks)
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        self.complete = True

    async def cut(self, failure: EPDError) -> None:
        """The answer failed after its head was out: end a stream with an error event; leave
        anything else cut short (the connection is reset)."""
        self.failed = True
        log.warning("request %s: the answer failed after it began: %s", self._request_id.decode(),
                    failure.message)
        if not self.event_stream:
            return
        body, _ = openai_error(failure)
        event = b"data: " + msgspec.json.encode(body) + b"\n\ndata: [DONE]\n\n"
        await self.send({"type": "http.response.body", "body": event, "more_body": False})


async def _finish(response: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
    """End ``chunks`` even when it was left at a ``yield`` (the caller left, a deadline).

    httpx's body iterator is several nested async generators; closing the outer one
    leaves the inner ones suspended, for the garbage collector to finalize (trio warns
    of each). Closing the response first, then running the iterator on, ends every
    layer with the closed connection's error instead.
    """
    with trio.CancelScope(shield=True), trio.move_on_after(_FINISH_TIMEOUT):
        await response.aclose()
        try:
            async for _ in chunks:
                pass
        except httpx.HTTPError:
            pass  # the connection we closed
