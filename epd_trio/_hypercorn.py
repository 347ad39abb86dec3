"""``--http-server hypercorn``: Hypercorn's HTTP/1.1 protocol and ASGI streams, on epd_trio's
connections.

Hypercorn 0.18's trio worker let one request end the whole process, or its shutdown
(``docs/http-edge.md`` has each with a reproduction):

* its ``TCPServer`` closes a socket (``send_eof``) outside the lock its writes take: a
  write racing a close raised ``trio.BusyResourceError``, and any exception of a
  connection's protocol code escapes into the server's nursery, ending the server;
* its websocket stream answers twice when a request follows an upgrade (h11 raises);
* an ``h2c`` upgrade switches to HTTP/2, whose stream buffer waits forever once its
  connection has closed; and its writes are shielded with no deadline, so a client that
  reads nothing held a shutdown forever;
* a request pipelined after one that closes the connection is answered 400 instead of the
  first one being answered.

So Hypercorn's ``H11Protocol`` (h11, the HTTP stream that runs the app in its own task:
what embedding an ASGI app in Hypercorn means) is driven here by a connection of ours:
each connection's failure ends that connection only, writes and the close take one lock
and are bounded like the built-in server's (``epd_trio._wire``), upgrades are declined
(answered over HTTP/1.1), ``epd_trio._refusals`` applies, nothing is read after a request
that closes, and a client's FIN is a half-close as under the built-in server. Lifespan,
accepting and graceful shutdown are ``epd_trio._serving``'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import Event as StreamEvent, Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from epd_trio._refusals import error_answer, framing_error, refusal
from epd_trio._serving import CLOSES_AFTER_APP, ASGIApp, ConnectionServer, HTTPServerConfig, serve_asgi
from epd_trio._wire import Wire, after
from epd_trio.errors import RequestError

__all__ = ["serve_hypercorn"]

log = logging.getLogger(__name__)

class _Refused(Exception):
    """A request ``epd_trio._refusals`` refuses: answered before any stream (app) exists."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class _H11(h11.Connection):
    """h11 that reads nothing after a request that closes the connection (RFC 9112 9.6: no
    further request is processed). Plain h11 raises on such bytes, and Hypercorn then answered
    400 in place of the request's own answer."""

    def next_event(self) -> Any:
        if self.their_state is h11.MUST_CLOSE:
            return h11.NEED_DATA
        return super().next_event()


class _Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol with our refusals, our JSON errors, and no protocol switch."""

    def __init__(self, *args: Any, max_header_bytes: int) -> None:
        super().__init__(*args)
        self.connection = _H11(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self._max_header_bytes = max_header_bytes

    async def handle(self, event: Event) -> None:
        try:
            await super().handle(event)
        except _Refused as refused:
            await self._answer(refused.error)
            await self.send(Closed())

    async def _check_protocol(self, event: h11.Request) -> None:
        """Instead of Hypercorn's (which switches to HTTP/2 on ``Upgrade: h2c`` or ``PRI *``)."""
        error = refusal(event.method, event.http_version, event.headers)
        if error is not None:
            raise _Refused(error)

    async def _create_stream(self, request: h11.Request) -> None:
        """An ``Upgrade`` (websocket) is declined: the request is served as a plain one (h11 still
        knows of the offer, and an answer that is not 101 declines it)."""
        if any(name == b"upgrade" for name, _ in request.headers):
            request = h11.Request(method=request.method, target=request.target, http_version=request.http_version,
                                  headers=[(n, v) for n, v in request.headers if n != b"upgrade"])
        await super()._create_stream(request)

    async def stream_send(self, event: StreamEvent) -> None:
        """An answer given while the request's body is unread, or during shutdown, says that it
        closes the connection (it does)."""
        if isinstance(event, Response) and event.status_code >= 200 \
                and (self.connection.their_state is h11.SEND_BODY or self.context.terminated.is_set()):
            headers = [(n, v) for n, v in event.headers if n.lower() != b"connection"]
            event = Response(stream_id=event.stream_id, status_code=event.status_code,
                             headers=[*headers, (b"connection", b"close")])
        await super().stream_send(event)

    async def _send_error_response(self, status_code: int) -> None:
        """h11's refusal (Hypercorn sends it with no body), in the protocol's JSON shape."""
        body = self.stream is not None  # the head was read: it is the body that broke
        hint = h11.RemoteProtocolError("not valid HTTP/1.1", error_status_hint=status_code)
        await self._answer(framing_error(hint, self._max_header_bytes, body=body))

    async def _answer(self, error: RequestError) -> None:
        """One write, made whole before any await: an app's answer racing it cannot interleave."""
        status, headers, content = error_answer(error)
        try:
            data = self.connection.send(h11.Response(status_code=status,
                                                     headers=[*headers, *self.config.response_headers("h11")]))
            data += self.connection.send(h11.Data(data=content)) + self.connection.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # the app's answer has begun: it stands, and the close follows
            return
        await self.send(RawData(data=data))


class _Connection(Wire):
    """One client connection: Hypercorn's protocol fed by this task, written through ``write``."""

    def __init__(self, server: _Server, stream: trio.SocketStream) -> None:
        super().__init__(stream, server.config.write_timeout)
        self.server = server
        self.cut = False  # an answer's start is on the wire, its end is not (yet)
        self.idle = True  # no request in progress (Hypercorn says so with ``Updated``)
        self._reading = trio.CancelScope(deadline=after(server.config.keep_alive_timeout))
        self.protocol = _Protocol(server.app, server.hypercorn, server.context, None,
                                  ConnectionState(server.state.copy()), False, self.client, self.local,
                                  self._on_event, max_header_bytes=server.config.max_header_bytes)

    async def run(self) -> None:
        try:
            async with TaskGroup() as tasks:  # the apps' tasks
                self.protocol.task_group = tasks
                with self._reading:
                    await self._read_loop()
                await self.protocol.handle(Closed())  # a stream still open hears the client leave
        except* Exception as failure:  # Hypercorn's protocol code (or ours): this connection only
            log.error("HTTP connection from %s failed", self.client, exc_info=failure)
            self.broken = True
        finally:
            self.broken = self.broken or self.cut
            await self.close(unread_body=not self.server.closing
                             and self.protocol.connection.their_state in (h11.SEND_BODY, h11.ERROR))

    async def _read_loop(self) -> None:
        while True:
            data = await self.read()
            if self.gone:
                return
            await self.protocol.handle(RawData(data))  # b"": h11 learns the client finished sending
            if not data or self.protocol.connection.their_state is h11.MUST_CLOSE:
                break  # nothing more to read (h11 reads nothing after a request that closes)
        if self.idle:
            return
        if self.eof:
            await self.wait_gone(self._interim)  # returns once the client has gone altogether
        else:
            await trio.sleep_forever()  # until the answer ends the connection (``Closed``)

    def _interim(self) -> bytes | None:
        """The half-close probe: none to HTTP/1.0, none once the answer has begun."""
        connection = self.protocol.connection
        if not isinstance(connection, h11.Connection):  # a WebSocket one: no interim answer
            return None
        if connection.their_http_version == b"1.1" and connection.our_state is h11.SEND_RESPONSE:
            return connection.send(h11.InformationalResponse(status_code=100, headers=[]))
        return None

    async def _on_event(self, event: Event) -> None:
        """The protocol's ``send``: bytes to write, the connection to close, or idleness."""
        if isinstance(event, RawData):
            await self.write(event.data)
        elif isinstance(event, Closed):
            self._reading.cancel()  # the socket closes once the apps have returned
        elif isinstance(event, Updated):
            self.idle = event.idle
            self._reading.deadline = after(self.server.config.keep_alive_timeout) if event.idle else math.inf

    async def write(self, data: bytes) -> None:
        """Nothing leaves a cancelled task: a request cancelled at the end of a shutdown's grace
        gets no 500 from Hypercorn's stream (as under its own worker, whose lock is a checkpoint)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        await super().write(data)
        if self.gone or self.broken:
            self._reading.cancel()  # the apps hear the client leave
        else:
            self.cut = self.protocol.connection.our_state is h11.SEND_BODY  # h11 made ``data`` first

    def close_if_idle(self) -> None:
        if self.idle:
            self._reading.cancel()


def _served(app: ASGIApp) -> ASGIApp:
    """``app``, told (``CLOSES_AFTER_APP``) that no ``send`` here closes the connection, its
    failure logged, and its lack of an answer a 500 in the protocol's JSON shape (as the
    built-in server's; Hypercorn's own 500 has no body)."""

    async def served(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        scope["extensions"] = {**scope.get("extensions", {}), CLOSES_AFTER_APP: {}}
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, tracked)
        except Exception:
            log.exception("the ASGI app failed on %s %s", scope["method"], scope["path"])
        if not started:
            status, headers, body = error_answer(RuntimeError("the app gave no answer"))  # a bug: 500
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    return served


class _Server(ConnectionServer):
    def __init__(self, app: ASGIApp, config: HTTPServerConfig) -> None:
        super().__init__(config)
        self.app = ASGIWrapper(_served(app))
        self.hypercorn = Config()
        self.hypercorn.h11_max_incomplete_size = config.max_header_bytes
        self.hypercorn.keep_alive_timeout = config.keep_alive_timeout
        self.hypercorn.accesslog = None
        self.hypercorn.errorlog = logging.getLogger("hypercorn.error")
        self.context = WorkerContext(None)  # Hypercorn's: the shutdown flag its protocol reads

    def connect(self, stream: trio.SocketStream) -> _Connection:
        return _Connection(self, stream)

    async def begin_closing(self) -> None:
        await self.context.terminated.set()  # busy connections close after their answer
        await super().begin_closing()


async def serve_hypercorn(app: ASGIApp, sockets: Sequence[Any], config: HTTPServerConfig, *,
                          shutdown_trigger: Callable[[], Awaitable[Any]],
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """``serve_http11``'s contract, with Hypercorn's HTTP/1.1 protocol serving each request."""
    await serve_asgi(_Server(app, config), app, sockets, shutdown_trigger=shutdown_trigger, task_status=task_status)
