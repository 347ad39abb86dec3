"""A lean HTTP/1.1 server for ASGI apps on trio, built on h11: what serves the encoder and the
registry by default (``--http-server hypercorn``: ``epd_trio._hypercorn``).

Why not Hypercorn's own worker: the trio thread runs every request's scope, and Hypercorn's
generic machinery cost it ~0.8 ms of CPU per small request on a 2-core VM before the app ran
at all — a task and a memory channel per request, an idle-timeout task restarted after every
response, a lock, a shield and a ``send_all`` per h11 event (three per answer). Here a
connection is one task that parses with h11, runs the app in that same task, sends an
answer's head and body in one write, and bounds idle keep-alive with a cancel scope instead
of a task.

What it serves is exactly what the faces need: HTTP/1.1 and 1.0 over TCP, keep-alive,
pipelined requests (one at a time), ``Expect: 100-continue``, ``Content-Length`` and chunked
bodies both ways, the ASGI ``http`` and ``lifespan`` scopes. No TLS, no HTTP/2, no
websockets: an ``Upgrade`` is declined by answering the request over HTTP/1.1.

The ASGI contract, as the apps rely on it:

* ``receive()`` gives the body's chunks, then blocks until the client leaves
  (``http.disconnect``) or the answer is complete (``http.disconnect`` too), so an
  app's disconnect watcher costs no read of its own. Bytes a client pipelines
  meanwhile are kept for its next request (at most one head's worth is read). A
  client's FIN alone is no leaving (``epd_trio._wire``: it is probed).
* A body of many small chunks is handed over joined (at most ``_JOIN_EVENTS`` chunks or
  ``_JOIN_BYTES`` a message), with a checkpoint per such message taken from bytes already
  read: one client's tiny chunks cannot hold the event loop.
* ``send()`` to a client that has gone returns quietly; the connection closes.
* A request the app leaves unanswered is a 500; a head h11 refuses, a body that breaks
  its framing (found while reading it, or while reading ahead to answer) and what
  ``epd_trio._refusals`` refuses are their 400 or 431, closing; a head that does not
  arrive within ``keep_alive_timeout`` closes the connection.
* An answer given while the body is unread closes the connection (and says so); one cut
  short (an app's bug, a client that stops reading: ``epd_trio._wire``) resets it, so that
  it cannot pass for a whole one.

Graceful shutdown is ``epd_trio._serving``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from email.utils import formatdate
from typing import Any, Final
from urllib.parse import unquote

import h11
import trio

from epd_trio._refusals import error_answer, framing_error, refusal
from epd_trio._serving import (
    ASGI,
    CLOSES_AFTER_APP,
    ASGIApp,
    ConnectionServer,
    HTTPServerConfig,
    LifespanFailure,
    serve_asgi,
)
from epd_trio._wire import Wire

__all__ = ["CLOSES_AFTER_APP", "HTTPServerConfig", "LifespanFailure", "serve_http11"]

log = logging.getLogger(__name__)

_JOIN_EVENTS: Final = 64  # body chunks joined into one message at most; then a checkpoint
_JOIN_BYTES: Final = 1 << 16  # bytes joined into one message at most


class _Date:
    """The ``Date`` header, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def header(self) -> tuple[bytes, bytes]:
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._value = formatdate(usegmt=True).encode()
        return (b"date", self._value)


class _Cycle:
    """One request and its answer on a connection: the ASGI ``receive`` and ``send``."""

    def __init__(self, conn: _Connection, request: h11.Request) -> None:
        self._conn = conn
        self._h11 = conn.h11
        self.head_only = request.method == b"HEAD"
        self.http11 = request.http_version == b"1.1"  # a 1xx may go to it (never to HTTP/1.0)
        self.body_done = False
        self.started = False  # http.response.start seen
        self.head_sent = False
        self.complete = False  # the whole answer is written (or can no longer be)
        self.replaced = False  # the server answered instead of the app (its body broke the framing)
        self._start: dict[str, Any] | None = None
        self._waiter: trio.CancelScope | None = None
        self._pending: Any = None  # an h11 event read ahead while joining the body
        self.malformed: h11.RemoteProtocolError | None = None  # the body broke its framing

    # ---- receive ----------------------------------------------------------
    async def receive(self) -> dict[str, Any]:
        if not self.body_done and self._live():
            message = await self._body_message()
            if message is not None:
                return message
        if self._live():
            await self._wait_gone_or_complete()
        return {"type": "http.disconnect"}

    def _live(self) -> bool:
        return not self.complete and not self._conn.gone and self.malformed is None

    async def _body_message(self) -> dict[str, Any] | None:
        """The next ``http.request`` message: what the buffer holds of the body, joined."""
        if self._h11.they_are_waiting_for_100_continue and not self.started:
            await self._conn.write(self._h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks: list[Any] = []
        size = 0
        try:
            event = self._pending if self._pending is not None else await self._conn.next_event()
            self._pending = None
            while isinstance(event, h11.Data):
                chunks.append(event.data)
                size += len(event.data)
                joinable = len(chunks) < _JOIN_EVENTS and size < _JOIN_BYTES
                event = self._conn.event_in_buffer() if joinable else None
        except h11.RemoteProtocolError as exc:  # a broken chunked body: nothing more can be read
            self.malformed = exc  # the app hears a disconnect; the server answers the 4xx
            return None
        await self._conn.yield_after(len(chunks))
        if isinstance(event, h11.EndOfMessage):
            self.body_done = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        self._pending = event  # None (nothing more buffered), or the client's leaving
        if chunks:
            return {"type": "http.request", "body": b"".join(chunks), "more_body": True}
        return None  # the client left mid-body

    async def _wait_gone_or_complete(self) -> None:
        """Block until the client is gone or the answer completes (``send`` cancels this)."""
        with trio.CancelScope() as waiter:
            self._waiter = waiter
            try:
                await self._conn.watch_for_close(self)
            finally:
                self._waiter = None

    # ---- send -------------------------------------------------------------
    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self._start = message
        elif kind == "http.response.body":
            if self._conn.gone or self.replaced:
                return
            if not self.started or self.complete:
                raise RuntimeError(f"unexpected {kind}")
            await self._send_body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    async def _send_body(self, body: bytes, more: bool) -> None:
        head = None
        if not self.head_sent:
            read_whole = self._body_read()  # what is buffered of the body: it may break the framing
            if self.malformed is not None:  # its 4xx goes out instead of the app's answer
                self.replaced = True
                await self.send_error(self._conn.framing_error(self.malformed))
                return
            head = self._response(read_whole)
        await self._write(head, body, more)

    async def _write(self, head: h11.Response | None, body: bytes, more: bool) -> None:
        out = []
        if head is not None:
            out.append(self._h11.send(head))
            self.head_sent = True
        if body and not self.head_only:
            out.append(self._h11.send(h11.Data(data=body)))
        if not more:
            out.append(self._h11.send(h11.EndOfMessage()))
        try:
            await self._conn.write(b"".join(out))
        finally:
            if not more:
                self.finish()

    def _response(self, read_whole: bool) -> h11.Response:
        assert self._start is not None
        headers = [(bytes(k), bytes(v)) for k, v in self._start.get("headers", ())]
        headers.append(self._conn.server.date.header())
        if self._conn.server.closing or not read_whole:  # an unread body ends it too
            headers = [h for h in headers if h[0].lower() != b"connection"]
            headers.append((b"connection", b"close"))
        return h11.Response(status_code=int(self._start["status"]), headers=headers)

    def _body_read(self) -> bool:
        """Whether the request's body has been read whole, taking what is already buffered
        (a body-less request's end, a body the app did not want) without waiting for more."""
        while not self.body_done and self.malformed is None:
            try:
                event = self._pending if self._pending is not None else self._conn.event_in_buffer()
            except h11.RemoteProtocolError as exc:
                self.malformed = exc
                return False
            self._pending = None
            if event is None or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return False
            self.body_done = isinstance(event, h11.EndOfMessage)
        return self.body_done

    def finish(self) -> None:
        """The answer is over: a disconnect watcher's ``receive()`` returns."""
        self.complete = True
        if self._waiter is not None:
            self._waiter.cancel()

    async def send_error(self, exc: BaseException) -> None:
        """An answer of the server's own (the app gave none, or the request broke a rule), closing."""
        status, headers, body = error_answer(exc)
        self._start = {"status": status, "headers": headers}
        self.started = True
        headers.append(self._conn.server.date.header())
        await self._write(h11.Response(status_code=status, headers=headers), body, False)


class _Connection(Wire):
    """One client connection: requests one after the other, each app run in this task."""

    def __init__(self, server: _Server, stream: trio.SocketStream) -> None:
        super().__init__(stream, server.config.write_timeout)
        self.server = server
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=server.config.max_header_bytes)
        self.idle: trio.CancelScope | None = None  # set only while waiting for a head
        self._unyielded = 0  # body chunks handed out from the buffer since the last read

    async def run(self) -> None:
        try:
            while not self.server.closing:
                request = await self._next_request()
                if request is None:
                    break
                await self._serve(request)
                if self.gone or self.broken or self.h11.our_state is not h11.DONE \
                        or self.h11.their_state is not h11.DONE:
                    break
                self.h11.start_next_cycle()
        finally:
            await self.close(unread_body=not self.server.closing
                             and self.h11.their_state in (h11.SEND_BODY, h11.ERROR))

    def close_if_idle(self) -> None:
        if self.idle is not None:
            self.idle.cancel()

    async def _next_request(self) -> h11.Request | None:
        """The next request's head within the keep-alive timeout; None: close the connection."""
        event = None
        with trio.move_on_after(self.server.config.keep_alive_timeout) as idle:
            self.idle = idle
            try:
                event = await self.next_event()
            except h11.RemoteProtocolError as exc:
                await self._refuse(exc)
                return None
            finally:
                self.idle = None
        return event if isinstance(event, h11.Request) else None

    async def _serve(self, request: h11.Request) -> None:
        cycle = _Cycle(self, request)
        refused = refusal(request.method, request.http_version, request.headers)
        if refused is not None:
            await cycle.send_error(refused)
            return
        try:
            await self.server.app(self._scope(request), cycle.receive, cycle.send)
        except Exception:
            log.exception("the ASGI app failed on %s %s", request.method.decode(), request.target.decode("latin-1"))
        if cycle.malformed is not None and not cycle.head_sent:
            await cycle.send_error(self.framing_error(cycle.malformed))
        elif not cycle.started and not self.gone:
            await cycle.send_error(RuntimeError("the app gave no answer"))  # a bug: 500
        elif not cycle.complete:  # left mid-answer: the stream cannot carry another
            self.broken = True
            cycle.finish()

    def _scope(self, request: h11.Request) -> dict[str, Any]:
        path, _, query = request.target.partition(b"?")
        return {
            "type": "http", "asgi": ASGI, "http_version": request.http_version.decode(),
            "method": request.method.decode("ascii"), "scheme": "http",
            "path": unquote(path.decode("ascii", "replace")), "raw_path": path, "query_string": query,
            "root_path": "", "headers": list(request.headers), "client": self.client,
            "server": self.local, "state": self.server.state.copy(),
            "extensions": {CLOSES_AFTER_APP: {}},
        }

    def framing_error(self, exc: h11.RemoteProtocolError) -> Exception:
        return framing_error(exc, self.server.config.max_header_bytes, body=True)

    async def _refuse(self, exc: h11.RemoteProtocolError) -> None:
        """h11's own refusal of a head (400, or 431 for one over the size limit), closing."""
        if self.h11.our_state not in {h11.IDLE, h11.SEND_RESPONSE}:
            self.gone = True
            return
        error = framing_error(exc, self.server.config.max_header_bytes, body=False)
        status, headers, body = error_answer(error)
        try:
            data = self.h11.send(h11.Response(status_code=status,
                                              headers=[*headers, self.server.date.header()]))
            data += self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            data = b""
        if data:
            await self.write(data)
        self.gone = True

    # ---- reading -------------------------------------------------------------
    async def next_event(self) -> Any:
        """h11's next event, reading as needed (after the client's FIN h11 knows there is no more)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.read())

    def event_in_buffer(self) -> Any:
        """The next event if the bytes already read make one (never reads); None if they do not."""
        event = self.h11.next_event()
        return None if event is h11.NEED_DATA else event

    async def yield_after(self, chunks: int) -> None:
        """A checkpoint once ``_JOIN_EVENTS`` chunks have come from the buffer since the last read
        (a read is a checkpoint): h11 parses each chunk on the trio thread."""
        self._unyielded += chunks
        if self._unyielded >= _JOIN_EVENTS:
            self._unyielded = 0
            await trio.lowlevel.checkpoint()

    async def watch_for_close(self, cycle: _Cycle) -> None:
        """Read until the client is gone; bytes it pipelines meanwhile wait for its next request.
        After its FIN, look for it having gone altogether (``epd_trio._wire``)."""
        while not self.gone:
            if self.eof:
                await self._wait_gone(cycle)
                return
            if len(self.h11.trailing_data[0]) >= self.server.config.max_header_bytes:
                await trio.sleep_forever()  # enough read ahead: wait for the answer to complete
            self.h11.receive_data(await self.read())

    async def _wait_gone(self, cycle: _Cycle) -> None:
        def interim() -> bytes | None:  # none to HTTP/1.0, none once the answer has begun
            if cycle.http11 and self.h11.our_state is h11.SEND_RESPONSE:
                return self.h11.send(h11.InformationalResponse(status_code=100, headers=[]))
            return None

        await self.wait_gone(interim)

    async def read(self) -> bytes:
        data = await super().read()
        self._unyielded = 0  # a read is a checkpoint
        return data


class _Server(ConnectionServer):
    def __init__(self, app: ASGIApp, config: HTTPServerConfig) -> None:
        super().__init__(config)
        self.app = app
        self.date = _Date()

    def connect(self, stream: trio.SocketStream) -> _Connection:
        return _Connection(self, stream)


async def serve_http11(app: ASGIApp, sockets: Sequence[Any], config: HTTPServerConfig, *,
                       shutdown_trigger: Callable[[], Awaitable[Any]],
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on the bound, listening-ready stdlib ``sockets`` until ``shutdown_trigger``
    returns; ``task_status.started()`` once the app's startup is done and connections are taken."""
    await serve_asgi(_Server(app, config), app, sockets, shutdown_trigger=shutdown_trigger, task_status=task_status)

