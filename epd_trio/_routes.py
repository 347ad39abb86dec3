"""This host's address on the route to a peer, found without sending anything.

Whoever hands a peer an address to call back on (a client's ZMQ endpoint or
Mooncake session, an encoder's advertised URL) must hand one that this peer can
reach: never loopback to another host. The kernel already knows which address
that is: a UDP socket ``connect()``-ed to the peer is given the source address
of the route to it (``getsockname``), and a UDP ``connect`` sends no datagram.

``find_route`` answers for one host; ``Routes`` caches the answers (a name is
resolved again after ``ttl`` seconds, so a moved peer is followed).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import trio

from epd_trio.errors import PeerUnavailable

__all__ = ["IPAddress", "Route", "Routes", "find_route", "is_loopback_host", "is_wildcard", "url_host"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

ROUTE_TTL: Final = 30.0  # seconds a name's route is trusted before it is resolved again
MAX_ROUTES: Final = 4096  # cached hosts; a fleet that churns past it starts the cache afresh
_WILDCARDS: Final = frozenset({"", "*", "0.0.0.0", "::"})


@dataclass(frozen=True)
class Route:
    """How this host reaches ``host``: its address ``peer``, from this host's ``source``."""

    host: str
    peer: IPAddress
    source: IPAddress

    @property
    def local(self) -> bool:
        """The peer is this host: a loopback address, or one of this host's own (the kernel
        routes to those from themselves), so a loopback address reaches it too."""
        return self.peer.is_loopback or self.peer == self.source

    @property
    def source_host(self) -> str:
        """``source`` as a URL or endpoint host (an IPv6 one bracketed, its zone kept)."""
        text = str(self.source)
        return f"[{text}]" if ":" in text else text


def is_wildcard(host: str) -> bool:
    """``0.0.0.0``, ``::``, ``*`` or empty: every interface, which no peer can dial."""
    return host.strip("[]") in _WILDCARDS


def is_loopback_host(host: str | None) -> bool:
    """A loopback address, ``localhost``, or None (an ``ipc://`` endpoint): reachable from this
    host only. Any other name is taken as reachable: it may resolve elsewhere to another
    address than here (``/etc/hosts`` often maps a machine's own name to 127.0.1.1)."""
    if host is None or host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").partition("%")[0]).is_loopback
    except ValueError:
        return False


def url_host(url: str) -> str:
    """The host of ``url`` as ``getaddrinfo`` takes it (no brackets; a zone as ``%eth0``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if "%" not in parts.netloc:
        return host
    # urlsplit lower-cases the zone (an interface name is case-sensitive): take it as written.
    written = parts.netloc.partition("[")[2].partition("]")[0]
    address, _, zone = written.partition("%")
    return f"{address}%{unquote(zone[2:]) if zone.startswith('25') else zone}"  # grpc: %25, bare otherwise


async def find_route(host: str, *, timeout: float) -> Route:
    """The route to ``host`` (a name is resolved, every address tried in the resolver's order).

    Raises ``PeerUnavailable`` when ``host`` does not resolve within ``timeout`` seconds or
    no address of it has a route from here.
    """
    try:
        with trio.fail_after(timeout):  # the resolver's thread is abandoned on cancel
            found = await trio.socket.getaddrinfo(host.strip("[]"), 9, 0, socket.SOCK_DGRAM)
    except trio.TooSlowError:
        raise PeerUnavailable(f"{host} was not resolved within {timeout:g} s") from None
    except (socket.gaierror, UnicodeError) as exc:
        raise PeerUnavailable(f"{host} does not resolve: {exc}") from None
    errors = []
    for family, _, _, _, sockaddr in found:
        try:
            return Route(host, _address(sockaddr), _source(family, sockaddr))
        except OSError as exc:
            errors.append(f"{sockaddr[0]}: {exc.strerror or exc}")
    raise PeerUnavailable(f"no route from this host to {host} ({'; '.join(errors) or 'no address'})")


def _source(family: int, sockaddr: Any) -> IPAddress:
    """This host's address on the route to ``sockaddr``: a UDP connect, no datagram sent."""
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return _address(probe.getsockname())


def _address(sockaddr: Any) -> IPAddress:
    """A socket address as an ``ipaddress`` object, an IPv6 zone kept (``fe80::1%eth0``)."""
    text = sockaddr[0]
    if len(sockaddr) == 4 and sockaddr[3] and "%" not in text:
        text = f"{text}%{socket.if_indextoname(sockaddr[3])}"
    return ipaddress.ip_address(text)


class Routes:
    """Routes by host, cached: a route is asked for per request, a lookup is a syscall or
    (for a name) a resolver call, and neither changes often."""

    def __init__(self, *, timeout: float, ttl: float = ROUTE_TTL) -> None:
        self._timeout = timeout
        self._ttl = ttl
        self._cache: dict[str, tuple[float, Route]] = {}
        self.lookups = 0  # routes found afresh (a cached one is not counted)

    async def to(self, host: str) -> Route:
        """The route to ``host``; ``PeerUnavailable`` as ``find_route`` raises it (not cached)."""
        now = trio.current_time()
        cached = self._cache.get(host)
        if cached is not None and now < cached[0]:
            return cached[1]
        route = await find_route(host, timeout=self._timeout)
        if len(self._cache) >= MAX_ROUTES:
            self._cache.clear()
        self._cache[host] = (now + self._ttl, route)
        self.lookups += 1
        return route

    def __repr__(self) -> str:
        return f"<Routes {len(self._cache)} hosts cached, {self.lookups} lookups>"
