"""A lean HTTP/1.1 server for ASGI apps on trio, built on h11: what serves the encoder and the registry.

Why not Hypercorn (which still can serve them: ``--http-server hypercorn``): the trio thread runs every request's scope, and
Hypercorn's generic machinery cost it ~0.8 ms of CPU per small request on the
project's 2-core VM before the app ran at all — a task and a memory channel per
request, an idle-timeout task restarted after every response, a lock, a shield
and a ``send_all`` per h11 event (three per answer). Here a connection is one
task that parses with h11, runs the app in that same task, sends an answer's
head and body in one write (up to 1 MiB), and bounds idle keep-alive with a cancel scope
instead of a task.

What it serves is exactly what the faces need: HTTP/1.1 and 1.0 over TCP,
keep-alive, pipelined requests (one at a time), ``Expect: 100-continue``,
``Content-Length`` and chunked bodies both ways, the ASGI ``http`` and
``lifespan`` scopes. No TLS, no HTTP/2, no websockets (nothing here uses them).

The ASGI contract, as the apps rely on it:

* ``receive()`` gives the body's chunks, then blocks until the client leaves
  (``http.disconnect``) or the answer is complete (``http.disconnect`` too), so an
  app's disconnect watcher costs no read of its own. Bytes a client pipelines
  meanwhile are kept for its next request (at most one head's worth is read).
* ``send()`` to a client that has gone returns quietly; the connection closes.
* A request the app leaves unanswered is a 500; a head h11 refuses (malformed,
  over ``max_header_bytes``), a broken chunked body and ``Content-Length`` with
  ``Transfer-Encoding`` are its 400 or 431, closing; a head that does not arrive
  within ``keep_alive_timeout`` closes the connection.
* An answer given while the body is unread closes the connection (and says so);
  one cut short (an app's bug, a client reading no MiB of it in ``write_timeout``)
  resets it, so that it cannot pass for a whole one.

Graceful shutdown, as Hypercorn's: stop accepting, close idle connections at
once, let busy ones finish their answer (each then closes) within
``graceful_timeout``, cancel what is left, then the app's lifespan shutdown.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, Final
from urllib.parse import unquote

import h11
import trio

from epd_trio.errors import HeadersTooLargeError, RequestError, error_body, http_status

__all__ = ["CLOSES_AFTER_APP", "HTTPServerConfig", "LifespanFailure", "serve_http11"]

log = logging.getLogger(__name__)

MAX_RECV: Final = 1 << 16
_ASGI: Final = {"version": "3.0", "spec_version": "2.3"}
# The scope extension that says this server closes a connection after its app has returned,
# never inside a ``send``: an app need not shield its sends (``_http.guarded_app`` reads it).
CLOSES_AFTER_APP: Final = "epd_trio.closes_after_app"
_CLOSE_TIMEOUT: Final = 5.0  # seconds a closing socket may take to flush (shielded)
_LINGER: Final = 2.0  # seconds a close reads (and drops) a body the client is still sending
_WRITE_SLICE: Final = 1 << 20  # a large answer is written in slices, each under write_timeout
_RESET: Final = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection

ASGIApp = Callable[..., Awaitable[None]]


class LifespanFailure(RuntimeError):
    """The app's lifespan startup (or shutdown) failed or did not finish in time."""


@dataclass(frozen=True)
class HTTPServerConfig:
    max_header_bytes: int = 16 * 1024  # a head longer than this, arriving in pieces: 431
    keep_alive_timeout: float = 5.0  # seconds for a (next) request's head to arrive
    write_timeout: float = 60.0  # seconds a write may wait for the client to read (per MiB slice)
    graceful_timeout: float = 5.0  # seconds busy connections get after the shutdown trigger
    lifespan_timeout: float = 60.0  # seconds for the app's startup and its shutdown each


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
        self.body_done = False
        self.started = False  # http.response.start seen
        self.head_sent = False
        self.complete = False  # the whole answer is written (or can no longer be)
        self._start: dict[str, Any] | None = None
        self._waiter: trio.CancelScope | None = None
        self._pending: Any = None  # an h11 event read ahead while joining the body
        self.malformed: h11.RemoteProtocolError | None = None  # the body broke its framing

    # ---- receive ----------------------------------------------------------
    async def receive(self) -> dict[str, Any]:
        if not self.body_done and not self.complete and not self._conn.gone and self.malformed is None:
            message = await self._body_message()
            if message is not None:
                return message
        if not self.complete and not self._conn.gone and self.malformed is None:
            await self._wait_gone_or_complete()
        return {"type": "http.disconnect"}

    async def _body_message(self) -> dict[str, Any] | None:
        if self._h11.they_are_waiting_for_100_continue and not self.started:
            await self._conn.write(self._h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        try:
            event = self._pending if self._pending is not None else await self._conn.next_event()
        except h11.RemoteProtocolError as exc:  # a broken chunked body: nothing more can be read
            self.malformed = exc  # the app hears a disconnect; the server answers 400
            return None
        self._pending = None
        if isinstance(event, h11.Data):
            ahead = self._conn.event_in_buffer()  # a small body's end is usually read with it
            if isinstance(ahead, h11.EndOfMessage):
                self.body_done = True
                return {"type": "http.request", "body": bytes(event.data), "more_body": False}
            self._pending = ahead
            return {"type": "http.request", "body": bytes(event.data), "more_body": True}
        if isinstance(event, h11.EndOfMessage):
            self.body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return None  # the client left (or broke the framing) mid-body

    async def _wait_gone_or_complete(self) -> None:
        """Block until the client closes or the answer completes (``send`` cancels this)."""
        with trio.CancelScope() as waiter:
            self._waiter = waiter
            try:
                await self._conn.watch_for_close()
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
            if not self.started or self.complete and not self._conn.gone:
                raise RuntimeError(f"unexpected {kind}")
            if self._conn.gone:
                return
            await self._send_body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    async def _send_body(self, body: bytes, more: bool) -> None:
        out = []
        if not self.head_sent:
            out.append(self._h11.send(self._response()))
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

    def _response(self) -> h11.Response:
        assert self._start is not None
        headers = [(bytes(k), bytes(v)) for k, v in self._start.get("headers", ())]
        headers.append(self._conn.server.date.header())
        if self._conn.server.closing or not self._body_read():  # an unread body ends it too
            headers = [h for h in headers if h[0].lower() != b"connection"]
            headers.append((b"connection", b"close"))
        return h11.Response(status_code=int(self._start["status"]), headers=headers)

    def _body_read(self) -> bool:
        """Whether the request's body has been read whole, taking what is already buffered
        (a body-less request's end, a body the app did not want) without waiting for more."""
        while not self.body_done and self.malformed is None:
            event = self._pending if self._pending is not None else self._conn.event_in_buffer()
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
        """An answer of the server's own (the app gave none), closing the connection."""
        status, headers, body = _error(exc)
        self._start = {"status": status, "headers": headers}
        self.started = True
        await self._send_body(body, False)


def _error(exc: BaseException) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``(status, headers, body)`` of the protocol's JSON error for ``exc``, closing the
    connection (``epd_trio.errors``: the one status mapping)."""
    body = json.dumps(error_body(exc)).encode()
    return http_status(exc), [(b"content-type", b"application/json"),
                              (b"content-length", str(len(body)).encode()), (b"connection", b"close")], body


class _Connection:
    """One client connection: requests one after the other, each app run in this task."""

    def __init__(self, server: _Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=server.config.max_header_bytes)
        self.gone = False  # the client closed, reset, or the framing broke: no more requests
        self.eof = False  # the client closed (or reset) its side
        self.broken = False  # a write was cut short: the stream cannot carry another answer
        self.idle: trio.CancelScope | None = None  # set only while waiting for a head
        self.client = _address(stream.socket.getpeername)
        self.local = _address(stream.socket.getsockname)
        self._fd = stream.socket.fileno()
        self._writing = trio.Lock()  # quart-trio sends a 100 Continue from a second task

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
            await self._close()

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
        names = {name for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:  # RFC 9112 6.1: smuggling
            await cycle.send_error(RequestError("a request may not have both Content-Length and "
                                                "Transfer-Encoding"))
            return
        try:
            await self.server.app(self._scope(request), cycle.receive, cycle.send)
        except Exception:
            log.exception("the ASGI app failed on %s %s", request.method.decode(), request.target.decode("latin-1"))
        if not cycle.started and cycle.malformed is not None:
            await cycle.send_error(RequestError(f"malformed HTTP request body: {cycle.malformed}"))
        elif not cycle.started and not self.gone:
            await cycle.send_error(RuntimeError("the app gave no answer"))  # a bug: 500
        elif not cycle.complete:  # left mid-answer: the stream cannot carry another
            self.broken = True
            cycle.finish()

    def _scope(self, request: h11.Request) -> dict[str, Any]:
        path, _, query = request.target.partition(b"?")
        return {
            "type": "http", "asgi": _ASGI, "http_version": request.http_version.decode(),
            "method": request.method.decode("ascii").upper(), "scheme": "http",
            "path": unquote(path.decode("ascii", "replace")), "raw_path": path, "query_string": query,
            "root_path": "", "headers": list(request.headers), "client": self.client,
            "server": self.local, "state": self.server.state.copy(),
            "extensions": {CLOSES_AFTER_APP: {}},
        }

    async def _refuse(self, exc: h11.RemoteProtocolError) -> None:
        """h11's own refusal of a head (400, or 431 for one over the size limit), closing."""
        if self.h11.our_state not in {h11.IDLE, h11.SEND_RESPONSE}:
            self.gone = True
            return
        limit = self.server.config.max_header_bytes
        status, headers, body = _error(HeadersTooLargeError(f"request head is over {limit} bytes")
                                       if exc.error_status_hint == 431
                                       else RequestError(f"malformed HTTP request: {exc}"))
        try:
            data = self.h11.send(h11.Response(status_code=status,
                                              headers=[*headers, self.server.date.header()]))
            data += self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            data = b""
        if data:
            await self.write(data)
        self.gone = True

    # ---- I/O ----------------------------------------------------------------
    async def next_event(self) -> Any:
        """h11's next event, reading as needed; ``ConnectionClosed`` once the client is gone."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                    self.gone = self.gone or isinstance(event, h11.ConnectionClosed)
                return event
            data = await self._read()
            self.h11.receive_data(data)
            if not data:
                self.gone = True

    def event_in_buffer(self) -> Any:
        """The next event if the bytes already read make one (never reads)."""
        try:
            event = self.h11.next_event()
        except h11.RemoteProtocolError:
            self.gone = True
            return h11.ConnectionClosed()
        return None if event is h11.NEED_DATA else event

    async def watch_for_close(self) -> None:
        """Read until the client closes; bytes it pipelines meanwhile wait for its next request."""
        while not self.gone:
            if len(self.h11.trailing_data[0]) >= self.server.config.max_header_bytes:
                await trio.sleep_forever()  # enough read ahead: wait for the answer to complete
            data = await self._read()
            if not data:
                self.gone = True
                return
            self.h11.receive_data(data)

    async def _read(self) -> bytes:
        try:
            data = await self.stream.receive_some(MAX_RECV)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        self.eof = not data
        return data

    async def write(self, data: bytes) -> None:
        """Send ``data`` in order with any other task's (h11 made the bytes in order); a client
        gone, or reading no MiB of it within ``write_timeout``, ends the connection."""
        if self.gone or self.broken:
            return
        try:
            self._writing.acquire_nowait()  # no checkpoint when nothing else writes
        except trio.WouldBlock:
            await self._writing.acquire()
        try:
            view = memoryview(data)
            sent = self._write_now(view)
            if sent < len(view):
                await self._write_slices(view[sent:])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.gone = True
        except BaseException:  # cancelled mid-write: part of an answer may be on the wire
            self.broken = True
            raise
        finally:
            self._writing.release()

    def _write_now(self, data: memoryview) -> int:
        """As much of ``data`` (up to a slice) as the socket takes without waiting. The usual
        small answer leaves here whole: trio's ``send_all`` would add a timer's cancel scope and
        a turn of the scheduler even when nothing waits (the socket is non-blocking)."""
        try:
            return os.write(self._fd, data[:_WRITE_SLICE])
        except BlockingIOError:
            return 0
        except OSError as exc:  # reset, closed: the client is gone
            raise trio.BrokenResourceError(str(exc)) from exc

    async def _write_slices(self, data: memoryview) -> None:
        timeout = self.server.config.write_timeout
        for start in range(0, max(len(data), 1), _WRITE_SLICE):
            with trio.move_on_after(timeout) as timer:
                await self.stream.send_all(data[start:start + _WRITE_SLICE])
            if timer.cancelled_caught:
                log.info("HTTP client %s read nothing of its answer within %g s: closing",
                         self.client, timeout)
                self.broken = True
                return

    async def _close(self) -> None:
        if self.broken:  # a reset, not a FIN: a cut answer must not look complete (HTTP/1.0)
            try:
                self.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            except OSError:
                pass
            await self.stream.aclose()
            return
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT):
            try:
                await self.stream.send_eof()
                if not self.eof and self.h11.their_state in (h11.SEND_BODY, h11.ERROR):
                    await self._linger()
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass
            await self.stream.aclose()

    async def _linger(self) -> None:
        """Drop what the client still sends, for up to ``_LINGER`` seconds. An answer given
        before its request was read whole (413, 431) is followed by this close, and closing a
        socket with unread bytes resets the connection, which can destroy that answer before
        the client reads it."""
        with trio.move_on_after(_LINGER):
            while await self._read():
                pass


def _address(get: Callable[[], Any]) -> tuple[str, int] | None:
    """``(host, port)`` of a socket's end; None once the client has reset the connection."""
    try:
        raw = get()
    except OSError:
        return None
    return (raw[0], raw[1]) if isinstance(raw, tuple) and len(raw) >= 2 else None


class _Server:
    def __init__(self, app: ASGIApp, config: HTTPServerConfig) -> None:
        self.app = app
        self.config = config
        self.state: dict[str, Any] = {}  # the lifespan state each request's scope copies
        self.date = _Date()
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
        except Exception:  # a bug of ours on one connection must not end the server
            log.exception("HTTP connection from %s failed", connection.client)
            with trio.CancelScope(shield=True):
                await stream.aclose()
        finally:
            self.connections.discard(connection)

    def begin_closing(self) -> None:
        """No new requests: idle connections close now, busy ones after their answer."""
        self.closing = True
        for connection in list(self.connections):
            if connection.idle is not None:
                connection.idle.cancel()


class _Lifespan:
    """The app's ``lifespan`` scope; an app that does not support it is served without."""

    def __init__(self, app: ASGIApp, state: dict[str, Any], timeout: float) -> None:
        self._app = app
        self._state = state
        self._timeout = timeout
        self._inbox_send, self._inbox = trio.open_memory_channel[dict[str, Any]](1)  # one event at a time
        self._started = trio.Event()
        self._stopped = trio.Event()
        self._failure: str | None = None
        self.supported = True

    async def run(self) -> None:
        scope = {"type": "lifespan", "asgi": _ASGI, "state": self._state}
        try:
            await self._app(scope, self._inbox.receive, self._send)
        except Exception as exc:
            if not self._started.is_set():
                log.warning("the ASGI app has no lifespan support (%s); serving without", exc)
                self.supported = False
            else:
                log.exception("the ASGI app's lifespan failed")
        finally:
            self._started.set()
            self._stopped.set()

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind.endswith(".failed"):
            self._failure = f"{kind}: {message.get('message', '')}"
        if kind.startswith("lifespan.startup."):
            self._started.set()
        elif kind.startswith("lifespan.shutdown."):
            self._stopped.set()

    async def startup(self) -> LifespanFailure | None:
        return await self._step({"type": "lifespan.startup"}, self._started, "startup")

    async def shutdown(self) -> LifespanFailure | None:
        return await self._step({"type": "lifespan.shutdown"}, self._stopped, "shutdown")

    async def _step(self, message: dict[str, Any], done: trio.Event, what: str) -> LifespanFailure | None:
        """Send ``message``, wait for its answer → the failure, if it failed (raised outside the
        lifespan's nursery, so the caller sees it bare)."""
        if not self.supported or done.is_set():
            return None
        with trio.move_on_after(self._timeout) as timer:
            await self._inbox_send.send(message)
            await done.wait()
        if timer.cancelled_caught:
            return LifespanFailure(f"the app's lifespan {what} did not finish within {self._timeout:g} s")
        if self._failure is not None:
            return LifespanFailure(f"the app's lifespan {what} failed ({self._failure})")
        return None


async def serve_http11(app: ASGIApp, sockets: Sequence[Any], config: HTTPServerConfig, *,
                       shutdown_trigger: Callable[[], Awaitable[Any]],
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on the bound, listening-ready stdlib ``sockets`` until ``shutdown_trigger``
    returns; ``task_status.started()`` once the app's startup is done and connections are taken."""
    server = _Server(app, config)
    lifespan = _Lifespan(app, server.state, config.lifespan_timeout)
    async with trio.open_nursery() as lifespan_nursery:
        lifespan_nursery.start_soon(lifespan.run)
        failure = await lifespan.startup()
        if failure is None:
            await _serve(server, sockets, shutdown_trigger, task_status)
            failure = await lifespan.shutdown()
        lifespan_nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


async def _serve(server: _Server, sockets: Sequence[Any], shutdown_trigger: Callable[[], Awaitable[Any]],
                 task_status: trio.TaskStatus[None]) -> None:
    """Accept until the trigger, then close gracefully (idle now, busy within the grace)."""
    async with trio.open_nursery() as connections:
        listeners = []
        for sock in sockets:
            sock.listen(socket.SOMAXCONN)
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        async with trio.open_nursery() as accepting:
            accepting.start_soon(functools.partial(trio.serve_listeners, server.handle, listeners,
                                                   handler_nursery=connections))
            task_status.started()
            await shutdown_trigger()
            accepting.cancel_scope.cancel()
        server.begin_closing()
        connections.cancel_scope.deadline = trio.current_time() + server.config.graceful_timeout
