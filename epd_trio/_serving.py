"""What both HTTP servers share: their limits, the app's lifespan, accepting, shutting down.

A server here is its connection handling (``_http11``: epd_trio's own h11 connections;
``_hypercorn``: Hypercorn's HTTP/1.1 protocol on epd_trio's connections) behind a small
contract, ``ConnectionServer``; ``serve_asgi`` runs one: the app's lifespan startup, then
connections until the shutdown trigger, then a graceful stop (as Hypercorn's own: stop
accepting, close idle connections at once, let busy ones finish their answer within
``graceful_timeout``, cancel what is left), then the lifespan shutdown.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import trio

__all__ = ["ASGI", "CLOSES_AFTER_APP", "ASGIApp", "Connection", "ConnectionServer", "HTTPServerConfig",
           "Lifespan", "LifespanFailure", "serve_asgi"]

log = logging.getLogger(__name__)

ASGI: Final = {"version": "3.0", "spec_version": "2.3"}
ASGIApp = Callable[..., Awaitable[None]]
# The scope extension that says a server closes a connection after its app has returned, never
# inside a ``send``: an app need not shield its sends (``_http.guarded_app`` reads it).
CLOSES_AFTER_APP: Final = "epd_trio.closes_after_app"


@dataclass(frozen=True)
class HTTPServerConfig:
    """The HTTP edge's limits, the same under either server (docs: *The HTTP edge*)."""

    max_header_bytes: int = 16 * 1024  # a longer request head, or chunk header: 431
    keep_alive_timeout: float = 5.0  # seconds for a (next) request's head to arrive
    write_timeout: float = 60.0  # seconds the client may take to read each 64 KiB of an answer
    graceful_timeout: float = 5.0  # seconds busy connections get after the shutdown trigger
    lifespan_timeout: float = 60.0  # seconds for the app's startup and its shutdown each


class LifespanFailure(RuntimeError):
    """The app's lifespan startup (or shutdown) failed or did not finish in time."""


class Connection(Protocol):
    """One client connection, as ``ConnectionServer`` keeps it."""

    client: tuple[str, int] | None

    async def run(self) -> None:
        """Serve the connection's requests until it closes."""

    def close_if_idle(self) -> None:
        """Close now if no request is in progress (the server is shutting down)."""


class ConnectionServer:
    """One server's connection handling, as ``serve_asgi`` drives it; a server makes its
    connections (``connect``)."""

    def __init__(self, config: HTTPServerConfig) -> None:
        self.config = config
        self.state: dict[str, Any] = {}  # the lifespan state each request's scope copies
        self.closing = False
        self.connections: set[Connection] = set()

    def connect(self, stream: trio.SocketStream) -> Connection:
        raise NotImplementedError

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one accepted connection until it closes."""
        if self.closing:
            await stream.aclose()
            return
        connection = self.connect(stream)
        self.connections.add(connection)
        try:
            await connection.run()
        except Exception:  # a bug of ours on one connection must not end the server
            log.exception("HTTP connection from %s failed", connection.client)
            with trio.CancelScope(shield=True):
                await stream.aclose()
        finally:
            self.connections.discard(connection)

    async def begin_closing(self) -> None:
        """No new requests: idle connections close now, busy ones after their answer."""
        self.closing = True
        for connection in list(self.connections):
            connection.close_if_idle()


class Lifespan:
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
        scope = {"type": "lifespan", "asgi": ASGI, "state": self._state}
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


async def serve_asgi(server: ConnectionServer, app: ASGIApp, sockets: Sequence[Any], *,
                     shutdown_trigger: Callable[[], Awaitable[Any]],
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve on the bound, listening-ready stdlib ``sockets`` until ``shutdown_trigger`` returns;
    ``task_status.started()`` once the app's startup is done and connections are taken."""
    lifespan = Lifespan(app, server.state, server.config.lifespan_timeout)
    async with trio.open_nursery() as lifespan_nursery:
        lifespan_nursery.start_soon(lifespan.run)
        failure = await lifespan.startup()
        if failure is None:
            await _serve(server, sockets, shutdown_trigger, task_status)
            failure = await lifespan.shutdown()
        lifespan_nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


async def _serve(server: ConnectionServer, sockets: Sequence[Any], shutdown_trigger: Callable[[], Awaitable[Any]],
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
        await server.begin_closing()
        connections.cancel_scope.deadline = trio.current_time() + server.config.graceful_timeout
