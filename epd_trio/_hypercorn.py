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
from typing import Any, Final

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
from epd_trio._serving import CLOSES_AFTER_APP, ASGIApp, HTTPServerConfig, serve_asgi
from epd_trio._wire import PROBE_AFTER, after, reset_on_close, wait_reset, write_bounded
from epd_trio.errors import RequestError

__all__ = ["serve_hypercorn"]

log = logging.getLogger(__name__)

MAX_RECV: Final = 1 << 16
_CLOSE_TIMEOUT: Final = 5.0  # seconds a closing socket may take to flush (shielded)
_LINGER: Final = 2.0  # seconds a close reads (and drops) a body the client is still sending


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


class _Connection:
    """One client connection: Hypercorn's protocol fed by this task, written through ``write``."""

    def __init__(self, server: _Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.gone = False  # the client has reset or vanished: nothing more can reach it
        self.eof = False  # the client has finished sending (its FIN): it may still read
        self.broken = False  # a write was cut short: the stream cannot carry another answer
        self.cut = False  # an answer's start is on the wire, its end is not (yet)
        self.idle = True  # no request in progress (Hypercorn says so with ``Updated``)
        self._writing = trio.Lock()
        self._reading = trio.CancelScope(deadline=after(server.config.keep_alive_timeout))
        sock = stream.socket
        self.client = _address(sock.getpeername)
        self.protocol = _Protocol(server.app, server.hypercorn, server.context, None,
                                  ConnectionState(server.state.copy()), False, self.client,
                                  _address(sock.getsockname), self._on_event,
                                  max_header_bytes=server.config.max_header_bytes)

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
            await self._close()

    async def _read_loop(self) -> None:
        while True:
            data = await self._read()
            if self.gone:
                return
            await self.protocol.handle(RawData(data))  # b"": h11 learns the client finished sending
            if not data or self.protocol.connection.their_state is h11.MUST_CLOSE:
                break  # nothing more to read (h11 reads nothing after a request that closes)
        if self.idle:
            return
        if self.eof:
            await self._wait_gone()  # returns once the client has gone altogether
        else:
            await trio.sleep_forever()  # until the answer ends the connection (``Closed``)

    async def _wait_gone(self) -> None:
        """The client has sent its FIN: probe it once its answer is late; return once it is gone."""
        await trio.sleep(PROBE_AFTER)
        h11_connection = self.protocol.connection
        if h11_connection.their_http_version == b"1.1" and h11_connection.our_state is h11.SEND_RESPONSE:
            await self.write(h11_connection.send(h11.InformationalResponse(status_code=100, headers=[])))
        await wait_reset(self.stream.socket)
        self.gone = True

    async def _read(self) -> bytes:
        try:
            data = await self.stream.receive_some(MAX_RECV)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.gone = True
            data = b""
        self.eof = self.eof or not data
        return data

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
        """Bytes in order with any other task's; a client gone, or one that stops reading
        (``epd_trio._wire.write_bounded``), ends the connection."""
        if self.gone or self.broken:
            return
        await trio.lowlevel.checkpoint_if_cancelled()  # nothing more leaves once cancelled (shutdown)
        try:
            self._writing.acquire_nowait()  # no checkpoint when nothing else writes
        except trio.WouldBlock:
            await self._writing.acquire()
        try:
            if not await write_bounded(self.stream, data, self.server.config.write_timeout):
                log.info("HTTP client %s took too little of its answer within %g s: resetting",
                         self.client, self.server.config.write_timeout)
                self.broken = True
            self.cut = self.protocol.connection.our_state is h11.SEND_BODY  # h11 made ``data`` first
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.gone = True
        except BaseException:  # cancelled mid-write: part of an answer may be on the wire
            self.broken = True
            raise
        finally:
            self._writing.release()
        if self.gone or self.broken:
            self._reading.cancel()

    async def _close(self) -> None:
        if self.broken or self.cut:  # a reset, not a FIN: a cut answer must not look complete
            reset_on_close(self.stream)
            await self.stream.aclose()
            return
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT):
            try:
                await self.stream.send_eof()
                if not (self.eof or self.gone or self.server.closing) \
                        and self.protocol.connection.their_state in (h11.SEND_BODY, h11.ERROR):
                    with trio.move_on_after(_LINGER):  # an early answer (413) must not be reset away
                        while await self._read():
                            pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass
            await self.stream.aclose()

    def stop_if_idle(self) -> None:
        if self.idle:
            self._reading.cancel()


def _address(get: Callable[[], Any]) -> tuple[str, int] | None:
    """``(host, port)`` of a socket's end; None once the client has reset the connection."""
    try:
        raw = get()
    except OSError:
        return None
    return (raw[0], raw[1]) if isinstance(raw, tuple) and len(raw) >= 2 else None


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


class _Server:
    def __init__(self, app: ASGIApp, config: HTTPServerConfig) -> None:
        self.config = config
        self.state: dict[str, Any] = {}  # the lifespan state each connection copies
        self.app = ASGIWrapper(_served(app))
        self.hypercorn = Config()
        self.hypercorn.h11_max_incomplete_size = config.max_header_bytes
        self.hypercorn.keep_alive_timeout = config.keep_alive_timeout
        self.hypercorn.accesslog = None
        self.hypercorn.errorlog = logging.getLogger("hypercorn.error")
        self.context = WorkerContext(None)  # Hypercorn's: the shutdown flag its protocol reads
        self.closing = False
        self.connections: set[_Connection] = set()

    async def handle(self, stream: trio.SocketStream) -> None:
        if self.closing:
            await stream.aclose()
            return
        connection = _Connection(self, stream)
        self.connections.add(connection)
        try:
            await connection.run()
        finally:
            self.connections.discard(connection)

    async def begin_closing(self) -> None:
        """No new requests: idle connections close now, busy ones after their answer."""
        self.closing = True
        await self.context.terminated.set()
        for connection in list(self.connections):
            connection.stop_if_idle()


async def serve_hypercorn(app: ASGIApp, sockets: Sequence[Any], config: HTTPServerConfig, *,
                          shutdown_trigger: Callable[[], Awaitable[Any]],
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """``serve_http11``'s contract, with Hypercorn's HTTP/1.1 protocol serving each request."""
    server = _Server(app, config)
    await serve_asgi(server, app, server.state, sockets, shutdown_trigger=shutdown_trigger,
                     task_status=task_status)
