"""The data path's routes, served as bare ASGI in front of a face's Quart app.

Why: Quart's per-request machinery (request and response objects, the request
context, routing, hooks, signals) costs the trio thread about as much as
Hypercorn's own HTTP/1.1 work — measured ~0.8–1.0 ms per request on a 2-core VM,
where a whole small ``/encode`` cost ~5 ms.
The routes every request passes through (``/encode``, ``/send``, SGLang's
rendezvous) are served here, each by a handler that takes the raw body and
gives a ``Reply``; every other path, and lifespan, goes to the Quart app.

The routes keep the face's rules: the head-size limit (checked here for every
route, Quart's too) and the bearer token are checked before the body is read; the body is bounded by ``max_body_bytes``
(413) and by ``body_timeout`` (408). A reply given before the whole body was
read closes the connection, whose unread bytes could be taken for another
request. A handler is given ``until_gone``, which returns once its client has
left: ``/encode`` waits for its answer or that, in its own task (the service
then aborts the request's scope); the other routes are wrapped by
``cancelled_when_gone``, a watcher task that cancels them. Another method is
a 405, a bug a logged 500, and every error the face's JSON shape.

Under a server that closes a ``Connection: close`` socket inside a ``send``
(Hypercorn's own worker) every ``send``, the Quart app's too, is
``_http.shielded_send``: cancelling one could leave the socket open. Both of
``epd_trio._listen``'s servers close only after the app returns, and say so
(``_http.guarded_app``). A reply has no timeout of its own: both servers bound
each write (``HTTPServerConfig.write_timeout``, ``epd_trio._wire``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import trio
from werkzeug.exceptions import MethodNotAllowed

from epd_trio._http import BearerAuth, Reply, face_error_reply, guarded_app, read_body, send_reply
from epd_trio._serving import ASGIApp
from epd_trio.errors import EPDError

__all__ = ["ASGIApp", "BareRoutes", "ErrorReply", "Handler", "RouteLimits", "UntilGone",
           "cancelled_when_gone"]

log = logging.getLogger(__name__)

UntilGone = Callable[[], Awaitable[None]]
"""Returns once the request's client has left (its body read, nothing else can come)."""
Handler = Callable[[bytes, UntilGone], Awaitable[Reply | None]]
"""A POST route: the whole request body in, the answer out (errors as ``Reply`` too; None
when the client left first)."""
ErrorReply = Callable[[BaseException], Reply]
"""A face's error shape, for what the route refuses itself (ours, or werkzeug's 405)."""


@dataclass(frozen=True)
class RouteLimits:
    max_body_bytes: int
    max_header_bytes: int
    body_timeout: float  # seconds for the whole body to arrive


class BareRoutes:
    """An ASGI app: ``routes`` (exact paths, POST) served here, the rest by ``fallback``."""

    def __init__(self, fallback: ASGIApp, routes: Mapping[str, Handler], *, limits: RouteLimits,
                 auth: BearerAuth | None = None, error_reply: ErrorReply = face_error_reply) -> None:
        self.fallback = fallback
        self._routes = dict(routes)
        self._limits = limits
        self._auth = auth  # None: the routes are open
        self._error_reply = error_reply
        # Every send shielded and every head bounded, the Quart app's too: one place for both.
        self._guarded = guarded_app(self._dispatch, max_header_bytes=limits.max_header_bytes,
                                    error_reply=error_reply)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self._guarded(scope, receive, send)

    async def _dispatch(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)  # lifespan
            return
        handler = self._routes.get(scope["path"])
        if handler is None:
            await self.fallback(scope, receive, send)
            return
        client = _Client(receive)
        reply = await self._answer(handler, scope, client)
        if reply is not None and not client.gone:
            await send_reply(send, reply)

    async def _answer(self, handler: Handler, scope: dict[str, Any], client: _Client) -> Reply | None:
        """The reply, or None when the client left before it."""
        # A reply given before the whole body was read closes the connection.
        if scope["method"] != "POST":
            return self._error_reply(MethodNotAllowed(["POST"])).closing()  # with Allow: POST
        try:
            try:
                self._check_token(scope)
                body = await self._read_body(scope, client.receive)
            except EPDError as exc:
                return self._error_reply(exc).closing()
            if body is None:
                return None
            return await handler(body, client.until_gone)
        except EPDError as exc:
            return self._error_reply(exc)
        except Exception as exc:  # a bug: answer 500, keep serving
            log.exception("unhandled error in %s", scope["path"])
            return self._error_reply(exc)

    def _check_token(self, scope: dict[str, Any]) -> None:
        if self._auth is not None:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            self._auth.check(None if given is None else given.decode("latin-1"), scope["path"])

    async def _read_body(self, scope: dict[str, Any], receive: Any) -> bytes | None:
        return await read_body(scope, receive, max_bytes=self._limits.max_body_bytes,
                               timeout=self._limits.body_timeout)


class _Client:
    """A request's client, as its route sees it: ``receive``, and whether it has left."""

    def __init__(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self.receive = receive
        self.gone = False

    async def until_gone(self) -> None:
        """Once the body is read, the next message can only be the client leaving."""
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone = True


def cancelled_when_gone(handler: Callable[[bytes], Awaitable[Reply]]) -> Handler:
    """``handler``, cancelled if its client leaves before the answer (a watcher task beside it).

    For routes whose waits are not the service's: ``/encode`` watches in its own task
    (``EncoderService.encode``'s ``until_gone``), without the task and nursery this costs.
    """

    async def watched(body: bytes, until_gone: UntilGone) -> Reply | None:
        reply: Reply | None = None
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_when_gone, until_gone, nursery.cancel_scope)
            try:
                reply = await handler(body)
            except Exception as exc:  # noqa: BLE001 - raised out here, not in the nursery's exception group
                failure = exc
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return reply  # None: the client left, and the watcher cancelled the handler

    return watched


async def _cancel_when_gone(until_gone: UntilGone, cancel_scope: trio.CancelScope) -> None:
    await until_gone()
    cancel_scope.cancel()
