"""The proxy's HTTP face: a bare ASGI app (no framework), served by ``_listen``.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (the
request's media stored by encoders, then the request forwarded, its answer
relayed as it arrives: ``service``), ``GET /v1/models`` (passed through),
``GET /health`` (200 while a language server is in rotation and an encoder is
known, else 503; the body says which), ``GET /metrics`` (Prometheus text).

Bare, because a forwarded answer is a stream: its chunks go out as they come,
and the caller leaving must cancel the work behind it. After a POST's body is
read, a watcher task waits for the caller to leave (the server's ``receive``
says ``http.disconnect``) and cancels the request, closing every call it has
open. Every error is OpenAI's error object with its status; a head over
``MAX_HEADER_BYTES`` is a 431, a body over ``--max-body-bytes`` a 413, one
slower than ``--body-timeout`` a 408 (each closing the connection: its unread
bytes cannot be taken for another request), another method a 405.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import MethodNotAllowed, NotFound

from epd_trio._http import (
    Reply,
    guarded_app,
    json_reply,
    read_body,
    send_reply,
    with_allow,
)
from epd_trio.client import RemoteEncodeError
from epd_trio.errors import EPDError
from epd_trio.protocol.proxy_requests import proxy_request_id
from epd_trio.protocol.vllm_requests import openai_error
from epd_trio.proxy.relay import Relay
from epd_trio.proxy.service import CHAT_ROUTE, COMPLETIONS_ROUTE, EPDProxy

__all__ = ["MAX_HEADER_BYTES", "ProxyApp", "proxy_error"]

log = logging.getLogger(__name__)

MAX_HEADER_BYTES: Final = 64 * 1024  # an OpenAI client's head (tokens, tracing) fits well within
_GET_ROUTES: Final = ("/v1/models", "/health", "/metrics")
_CLIENT_GONE: Final = 499


def proxy_error(exc: BaseException) -> Reply:
    """Any error as OpenAI's error object: an encoder's keeps its own type and message."""
    if isinstance(exc, MethodNotAllowed | NotFound):
        body = {"error": {"message": exc.description, "type": exc.name.replace(" ", ""),
                          "param": None, "code": exc.code}}
        reply = json_reply(body, exc.code or 500)
        return with_allow(reply, exc) if isinstance(exc, MethodNotAllowed) else reply
    body, status = openai_error(exc)
    if isinstance(exc, RemoteEncodeError):
        body["error"].update(message=f"encoder: {exc.detail}", type=exc.error_type)
    return json_reply(body, status)


class ProxyApp:
    """``proxy``'s routes as an ASGI app; each request's errors are answered here."""

    def __init__(self, proxy: EPDProxy) -> None:
        self.proxy = proxy
        self._guarded = guarded_app(self._dispatch, max_header_bytes=MAX_HEADER_BYTES,
                                    error_reply=proxy_error)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self._guarded(scope, receive, send)

    async def _dispatch(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path in (CHAT_ROUTE, COMPLETIONS_ROUTE):
            if method != "POST":
                await send_reply(send, proxy_error(MethodNotAllowed(["POST"])).closing())
                return
            await self._post(scope, receive, send, path)
        elif path in _GET_ROUTES:
            if method not in ("GET", "HEAD"):
                await send_reply(send, proxy_error(MethodNotAllowed(["GET", "HEAD"])).closing())
                return
            await self._get(path, send)
        else:
            await send_reply(send, proxy_error(NotFound(f"no route {path}")))

    async def _get(self, path: str, send: Any) -> None:
        try:
            if path == "/v1/models":
                await self.proxy.models(send)
            elif path == "/health":
                await send_reply(send, self._health())
            else:
                text = b"".join(generate_latest(r) for r in (self.proxy.metrics.registry,
                                                              self.proxy.client.metrics_registry))
                await send_reply(send, Reply(200, text, CONTENT_TYPE_LATEST))
        except EPDError as exc:
            await send_reply(send, proxy_error(exc))

    def _health(self) -> Reply:
        servers = self.proxy.servers.statistics()
        encoders = self.proxy.client.encoders
        ok = self.proxy.servers.any_healthy and bool(encoders)
        body = {"status": "ok" if ok else "unavailable", "encoders": list(encoders),
                "prefill_decode": [{"url": s.url, "healthy": s.healthy, "failures": s.failures,
                                    "in_flight": s.in_flight} for s in servers]}
        return json_reply(body, 200 if ok else 503)

    async def _post(self, scope: dict[str, Any], receive: Any, send: Any, route: str) -> None:
        """One forwarded request, cancelled if its caller leaves (see the module docstring)."""
        started = trio.current_time()
        proxy = self.proxy
        try:
            proxy.admit()
        except EPDError as exc:
            await send_reply(send, proxy_error(exc).closing())  # its body is left unread
            proxy.metrics.answered(route, exc.status_code, 0.0)
            return
        relay: Relay | None = None
        status, request_id = _CLIENT_GONE, "-"
        try:
            try:
                request_id = proxy_request_id(_header(scope, b"x-request-id"))
                raw = await read_body(scope, receive, max_bytes=proxy.config.max_body_bytes,
                                      timeout=proxy.config.body_timeout)
            except EPDError as exc:
                status = await _refuse(send, exc, closing=True)
                return
            if raw is None:
                return  # the caller left while sending
            relay = Relay(send, request_id,
                          lambda: proxy.metrics.first_byte(route, trio.current_time() - started))
            status = await self._run(scope, receive, route, raw, request_id, relay)
        finally:
            proxy.leave(relay is not None and relay.started)
            proxy.metrics.answered(route, status, trio.current_time() - started)
            log.info("request %s: %s → %d in %.3f s", request_id, route, status,
                     trio.current_time() - started)

    async def _run(self, scope: dict[str, Any], receive: Any, route: str, raw: bytes,
                   request_id: str, relay: Relay) -> int:
        """Store the media, forward, relay → the status the caller got (499: it left first)."""
        proxy = self.proxy
        refused = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_when_gone, receive, nursery.cancel_scope)
            try:
                request = await proxy.parse(raw, route)
                if request.media:
                    await proxy.store_media(request, request_id)
                await proxy.forward(route, raw, scope["headers"], request_id, relay)
            except EPDError as exc:
                refused = await _refuse(relay.send, exc, request_id=request_id)
            except Exception as exc:  # a bug: the caller gets a 500 (if nothing was sent yet)
                log.exception("request %s: unhandled error in the proxy", request_id)
                if relay.started:
                    raise
                refused = await _refuse(relay.send, exc, request_id=request_id)
            nursery.cancel_scope.cancel()
        if refused:
            return refused
        return relay.status if relay.complete or (relay.started and relay.failed) else _CLIENT_GONE


async def _refuse(send: Any, exc: Exception, *, closing: bool = False,
                  request_id: str | None = None) -> int:
    reply = proxy_error(exc)
    if request_id is not None:
        reply = Reply(reply.status, reply.body, reply.content_type,
                      (*reply.headers, ("x-request-id", request_id)))
    await send_reply(send, reply.closing() if closing else reply)
    return reply.status


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    value = next((v for k, v in scope["headers"] if k.lower() == name), None)
    return None if value is None else value.decode("latin-1")


async def _cancel_when_gone(receive: Any, scope: trio.CancelScope) -> None:
    """Once the body is read, the next message can only be the caller leaving (or, with
    the built-in server, the answer being complete: either way nothing is left to do)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _lifespan(receive: Any, send: Any) -> None:
    """Nothing to start or stop here: ``server.serve_proxy`` owns every resource."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
