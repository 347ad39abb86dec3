"""HTTP plumbing shared by the encoder and the registry (quart-trio apps, ``epd_trio._listen``'s servers).

One JSON response helper, one set of error handlers (every error leaves in the
protocol's JSON shape with its status from ``epd_trio.errors.http_status``;
never a traceback, never HTML). Binding and starting the HTTP server is ``epd_trio._listen``.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import trio
from quart import Response
from quart_trio import QuartTrio
from quart_trio.wrappers.request import TrioBody, TrioRequest
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from epd_trio._serving import CLOSES_AFTER_APP
from epd_trio.errors import (
    BodyTimeoutError,
    EPDError,
    HeadersTooLargeError,
    PayloadTooLargeError,
    UnauthorizedError,
    error_body,
    http_status,
)
from epd_trio.protocol.requests import parse_json_body

__all__ = [
    "OFFLOAD_BODY_BYTES",
    "SHIELDED_SEND_LIMIT",
    "BearerAuth",
    "JoinedBody",
    "JoinedBodyRequest",
    "Reply",
    "as_response",
    "check_head_size",
    "error_reply",
    "face_error_reply",
    "guarded_app",
    "http_exception_reply",
    "install_error_handlers",
    "json_error",
    "json_reply",
    "json_response",
    "parse_json_off_loop",
    "read_body",
    "send_reply",
    "shielded_send",
    "with_allow",
]

log = logging.getLogger(__name__)


class BearerAuth:
    """``Authorization: Bearer <token>`` checked in constant time; no token → open.

    The token is never logged, echoed or put in an error message.
    """

    def __init__(self, token: str | None) -> None:
        self._expected = f"Bearer {token}".encode() if token else None

    def check(self, header: str | None, what: str) -> None:
        if self._expected is None:
            return
        given = (header or "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self._expected):
            raise UnauthorizedError(f"{what} needs 'Authorization: Bearer <token>'")


# From this size a JSON body is parsed in a worker thread: a 1024 px PNG as a data URI is
# ~3 MB of JSON, whose parse would hold the event loop (every other request) for milliseconds.
OFFLOAD_BODY_BYTES: Final = 1 << 20


async def parse_json_off_loop(raw: bytes, threads: trio.CapacityLimiter,
                              parse: Callable[[bytes], dict[str, Any]] = parse_json_body) -> dict[str, Any]:
    """``parse(raw)``, on a worker thread under ``threads`` when ``raw`` is large."""
    if len(raw) < OFFLOAD_BODY_BYTES:
        return parse(raw)
    return await trio.to_thread.run_sync(parse, raw, limiter=threads)


class JoinedBody(TrioBody):
    """quart-trio's request body, with its chunks kept apart and joined once, when awaited.

    Quart grows one ``bytearray`` chunk by chunk (Hypercorn hands over 64 KiB at a
    time), re-copying a body of a few MB many times over on the event loop; a list
    joined once copies it once. Limits, iteration and errors are Quart's.
    """

    def __init__(self, expected_content_length: int | None, max_content_length: int | None) -> None:
        super().__init__(expected_content_length, max_content_length)
        self._chunks: list[bytes] = []
        self._size = 0

    def append(self, data: bytes) -> None:
        if not data or self._must_raise is not None:
            return
        self._chunks.append(data if type(data) is bytes else bytes(data))
        self._size += len(data)
        self._has_data.set()
        if self._max_content_length is not None and self._size > self._max_content_length:
            self._must_raise = RequestEntityTooLarge()
            self.set_complete()

    def _joined(self) -> bytes:
        data = b"".join(self._chunks)
        self._chunks = [data] if data else []
        return data

    async def __anext__(self) -> bytes:
        if self._must_raise is not None:
            raise self._must_raise
        if not self._complete.is_set():
            await self._has_data.wait()
        if self._complete.is_set() and not self._chunks:
            raise StopAsyncIteration()
        data = self._joined()
        self.clear()
        self._has_data.clear()
        return data

    def __await__(self) -> Any:
        if self._must_raise is not None:
            raise self._must_raise
        yield from self._complete.wait().__await__()
        if self._must_raise is not None:
            raise self._must_raise
        return self._joined()

    def clear(self) -> None:
        self._chunks = []
        self._size = 0


class JoinedBodyRequest(TrioRequest):
    """The request class of a face whose large bodies reach Quart (the vLLM face's chat
    route; the other faces serve their data path in front of Quart): ``JoinedBody`` bodies."""

    body_class = JoinedBody


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer's status, body and headers, before any framework shapes it: the Quart
    routes turn it into a ``Response`` (``as_response``), a bare ASGI route sends it as is."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    def closing(self) -> Reply:
        """The same answer, closing the connection (its unread body cannot be taken for a request)."""
        return Reply(self.status, self.body, self.content_type, (*self.headers, ("Connection", "close")))


def json_reply(body: Any, status: int = 200) -> Reply:
    return Reply(status, msgspec.json.encode(body))  # C, ~10 x json.dumps on a small answer


def error_reply(exc: BaseException, req_id: str | None = None) -> Reply:
    """The protocol's JSON error shape with the status from ``http_status``."""
    reply = json_reply(error_body(exc, req_id), http_status(exc))
    if isinstance(exc, UnauthorizedError):
        return Reply(reply.status, reply.body, headers=(("WWW-Authenticate", 'Bearer realm="epd-trio"'),))
    return reply


def http_exception_reply(exc: HTTPException) -> Reply:
    """A framework's HTTP error (404, 405, 413, ...) in the same JSON shape."""
    if exc.code == 413:
        return error_reply(PayloadTooLargeError("request body is over the size limit")).closing()
    body = {"error": {"type": exc.name.replace(" ", ""), "message": exc.description or exc.name},
            "req_id": None}
    return with_allow(json_reply(body, exc.code or 500), exc)


def with_allow(reply: Reply, exc: HTTPException) -> Reply:
    """``reply`` with the ``Allow`` header a 405 must carry (RFC 9110 15.5.6).

    The framework's other headers (its HTML ``Content-Type``) are not ours.
    """
    allow = tuple((name, value) for name, value in exc.get_headers() if name.lower() == "allow")
    return Reply(reply.status, reply.body, reply.content_type, (*reply.headers, *allow))


def face_error_reply(exc: BaseException) -> Reply:
    """Any error in the native faces' shape: a framework's HTTP error or ours (or a bug's 500)."""
    return http_exception_reply(exc) if isinstance(exc, HTTPException) else error_reply(exc)


def as_response(reply: Reply) -> Response:
    response = Response(reply.body, status=reply.status, content_type=reply.content_type)
    for name, value in reply.headers:
        response.headers[name] = value
    return response


def json_response(body: Any, status: int = 200) -> Response:
    return as_response(json_reply(body, status))


def json_error(exc: BaseException, req_id: str | None = None) -> Response:
    return as_response(error_reply(exc, req_id))


def install_error_handlers(app: QuartTrio, what: str,
                           respond: Callable[[BaseException], Response] | None = None) -> None:
    """Ours, Quart's (404, 405, 413) and bugs, all as JSON errors: the native shape, or the
    face's own (``respond``)."""

    @app.errorhandler(EPDError)
    async def epd_error(exc: EPDError) -> Response:
        return respond(exc) if respond is not None else json_error(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        # A 413 body was refused unread: http_exception_reply closes the connection.
        return respond(exc) if respond is not None else as_response(http_exception_reply(exc))

    @app.errorhandler(Exception)
    async def bug(exc: Exception) -> Response:
        log.error("unhandled error in a %s handler", what, exc_info=exc)
        return respond(exc) if respond is not None else json_error(exc)


# Seconds a shielded send may take. One that waits longer waits for something that may never
# come: Hypercorn's HTTP/2 stream buffer, once its connection has closed, waits forever, and
# with no limit here such a send held a process's shutdown (SIGTERM) forever.
SHIELDED_SEND_LIMIT: Final = 10.0


def shielded_send(send: Callable[[dict[str, Any]], Awaitable[None]]) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """``send``, run to its end even when its caller is cancelled (for ``SHIELDED_SEND_LIMIT``).

    Hypercorn's own worker closes a ``Connection: close`` connection inside the app's
    last ``send``; quart-trio (and our bare routes) cancel the handler as soon as the
    disconnect that close causes arrives, which cut the close short: the socket
    stayed open, and a client waiting for it hung. Hypercorn shields its own
    socket writes, so a shield here adds no wait that was not there.
    """

    async def shielded(message: dict[str, Any]) -> None:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + SHIELDED_SEND_LIMIT):
            await send(message)

    return shielded


def guarded_app(app: Any, *, max_header_bytes: int,
                error_reply: Callable[[BaseException], Reply] = face_error_reply) -> Callable[..., Awaitable[None]]:
    """An ASGI ``app`` whose every ``send`` is ``shielded_send`` and whose requests with a head
    over ``max_header_bytes`` are refused (431, closing) before ``app`` sees them.

    Under a server that closes connections only after the app has returned (both of
    ``epd_trio._listen``'s say so in the scope's extensions) no send can cut a close short:
    no shield, which saves two cancel scopes per answer on the trio thread."""

    async def guarded(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if CLOSES_AFTER_APP not in scope.get("extensions", ()):  # e.g. Hypercorn's own worker
            send = shielded_send(send)
        if scope["type"] == "http":
            try:
                check_head_size(scope, max_header_bytes)
            except HeadersTooLargeError as exc:
                await send_reply(send, error_reply(exc).closing())
                return
        await app(scope, receive, send)

    return guarded


def check_head_size(scope: dict[str, Any], limit: int) -> None:
    """Refuse a request head over ``limit`` bytes. h11 bounds a head that arrives in pieces
    (``h11_max_incomplete_size``); one that arrives in a single read is bounded only here."""
    head = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
    head += len(scope.get("raw_path") or scope["path"]) + 1 + len(scope["query_string"])
    if head > limit:
        raise HeadersTooLargeError(f"request head is over {limit} bytes")


async def send_reply(send: Callable[[dict[str, Any]], Awaitable[None]], reply: Reply) -> None:
    """``reply`` as an ASGI response."""
    headers = [(b"content-type", reply.content_type.encode()),
               (b"content-length", str(len(reply.body)).encode()),
               *((name.lower().encode(), value.encode()) for name, value in reply.headers)]
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})



async def read_body(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]], *,
                    max_bytes: int, timeout: float) -> bytes | None:
    """A bare ASGI route's whole request body; None when the client left first.

    ``PayloadTooLargeError`` past ``max_bytes`` (a declared length is refused unread),
    ``BodyTimeoutError`` when it has not all arrived within ``timeout`` seconds.
    """
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
    if declared is not None and int(declared) > max_bytes:  # the server has checked it is a number
        raise PayloadTooLargeError("request body is over the size limit")
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLargeError("request body is over the size limit")
                chunks.append(bytes(chunk))
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    raise BodyTimeoutError(f"the request body did not arrive within {timeout:g} s")
