"""Binding a server's port, and starting the HTTP server that serves it.

The server is epd_trio's own HTTP/1.1 server (``epd_trio._http11``, the default) or
Hypercorn's HTTP/1.1 protocol on epd_trio's connections (``--http-server hypercorn``:
``epd_trio._hypercorn``); both serve the same ASGI app under the same limits
(``HTTPServerConfig``).

The listening socket is bound here, not by the server, for three reasons:

- a port in use (or an address this host lacks) is a ``ValueError`` naming it, which
  the CLI prints in one line (Hypercorn's own worker raised the ``OSError`` from inside
  two nurseries, after its lifespan start-up);
- the socket is owned by an ``async with`` block and closed when it ends, on every path,
  and a server binds it before its slow start-up (the model), so a port in use is said at once;
- the address is resolved by ``getaddrinfo``, which reads an IPv6 zone id
  (``fe80::1%eth0``) into the scope id that Linux needs to bind a link-local address;
  Hypercorn binds ``(host, port)``, scope 0.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from epd_trio._http11 import serve_http11
from epd_trio._hypercorn import serve_hypercorn
from epd_trio._serving import HTTPServerConfig
from epd_trio.config import HTTP_SERVERS

__all__ = ["Listener", "bound_listener", "check_bindable", "start_http_server"]

RESOLVE_TIMEOUT = 30.0  # seconds --host may take to resolve


_SERVERS = {"builtin": serve_http11, "hypercorn": serve_hypercorn}  # HTTP_SERVERS, each one line


@dataclass(frozen=True)
class Listener:
    """A bound TCP socket, owned by its ``bound_listener`` block; the HTTP server listens on it."""

    host: str  # as configured: its zone id, if any, goes into the URL
    sock: socket.socket

    @property
    def url(self) -> str:
        """``http://address:port`` as bound (a wildcard host stays one: see ``advertised_url``)."""
        bound, bound_port = self.sock.getsockname()[:2]
        zone = self.host.partition("%")[2]  # getsockname gives the scope as a number
        return f"http://{_netloc(bound + '%' + zone if zone else bound, bound_port)}"


@asynccontextmanager
async def bound_listener(host: str, port: int) -> AsyncIterator[Listener]:
    """``host:port`` bound for the block (0 picks a free port). A server binds first, so that a
    port in use is said before its model loads (minutes for a large one), not after."""
    sock = await _bound_socket(host, port, "--host, --port")
    with sock:
        yield Listener(host, sock)


async def check_bindable(host: str, port: int, flags: str) -> None:
    """Raise the ``ValueError`` that binding ``host:port`` would, naming ``flags``.

    For a port another library binds later (grpcio's, after the model loads): a port in use
    is said before the load. One taken during the load is still that library's error.
    """
    sock = await _bound_socket(host, port, flags)
    sock.close()


async def start_http_server(nursery: trio.Nursery, app: Any, listener: Listener, *, server: str,
                            graceful_timeout: float, shutdown_trigger: Callable[[], Awaitable[None]],
                            max_header_bytes: int = 16 * 1024) -> str:
    """Serve ``app`` on ``listener`` in ``nursery`` with ``server`` (``HTTP_SERVERS``) → its URL.

    Serving stops when ``shutdown_trigger`` returns (graceful: open requests get
    ``graceful_timeout`` seconds) or when the nursery is cancelled.
    """
    serve = _SERVERS.get(server)
    if serve is None:
        raise ValueError(f"http_server must be one of {', '.join(HTTP_SERVERS)}, got {server!r}")
    config = HTTPServerConfig(max_header_bytes=max_header_bytes, graceful_timeout=graceful_timeout)
    await nursery.start(functools.partial(serve, app, [listener.sock], config, shutdown_trigger=shutdown_trigger))
    return listener.url


async def _bound_socket(host: str, port: int, flags: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (a name without ``:`` is IPv4, as Hypercorn reads it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shown = _netloc(host, port)
    try:
        with trio.fail_after(RESOLVE_TIMEOUT):  # a name's resolver may hang; the thread is abandoned
            found = await trio.socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0,
                                                  socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {shown} ({flags}): {exc.strerror}") from None
    except trio.TooSlowError:
        raise ValueError(f"cannot listen on {shown} ({flags}): not resolved within "
                         f"{RESOLVE_TIMEOUT:g} s") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(found[0][4])
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {shown} ({flags}): {exc}") from None
    return sock


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
