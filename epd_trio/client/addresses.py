"""Where encoders deliver to: an address of this client that each of them can reach.

A client tells every encoder where its embeddings go (a ZMQ endpoint in the
``/encode`` body, a Mooncake session in ``/send``); the receivers that tell them
(``receiving``) ask this module which address. Loopback told to an encoder on
another host sends the bytes to that host's own loopback, where nothing waits:
the request would wait out its whole timeout. So the address is chosen per
encoder, from the route to it (``epd_trio._routes``), and a setting that cannot
work is refused at once, naming it.

- **ZMQ, ``zmq_bind`` unset** (the default): the PULL socket is bound, on first
  need, to this host's address on the route to each encoder (one bind per
  address, a free port each), and each encoder hears its own. A local encoder
  hears loopback, a remote one this host's address on its network, and nothing
  listens on an interface no encoder routes through.
- **ZMQ, ``zmq_bind`` set**: bound there once. A wildcard host (``0.0.0.0``,
  ``[::]``) is told per encoder as above, on that one port; any other endpoint,
  or ``zmq_advertise``, is told to every encoder as it is.
- **Mooncake**: the transfer engine has one host name for its life, so it is
  chosen when the client opens (``mooncake_host``, else the route to the first
  peer the client knows: its ``encoder_urls``, then ``bootstrap_url``, then
  ``discovery_dns``; loopback when it knows none).

An endpoint or Mooncake host on loopback (or ``ipc://``) told to an encoder on
another host fails the part at once with ``PeerUnavailable`` naming the setting. An encoder
whose host does not resolve, or has no route, is unreachable: the part moves to
another encoder, as after a refused connection.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from epd_trio._routes import (
    IPAddress,
    Route,
    Routes,
    is_loopback_host,
    is_wildcard,
    url_host,
)
from epd_trio.client.answers import EncoderUnreachable
from epd_trio.config import ClientConfig
from epd_trio.errors import PeerUnavailable
from epd_trio.transport.zmq import PullReceiver, validate_endpoint

__all__ = [
    "AddressStatistics",
    "PullEndpoints",
    "advertised_endpoint",
    "check_session",
    "choose_mooncake_host",
    "endpoint_host",
]

log = logging.getLogger(__name__)


def advertised_endpoint(bound: str, advertise: str | None) -> str:
    """The endpoint encoders push to: ``advertise`` (port 0 = the bound port) or ``bound``."""
    if not advertise:
        return bound
    if advertise.startswith("tcp://") and advertise.endswith(":0") and bound.startswith("tcp://"):
        advertise = advertise[:-1] + bound.rsplit(":", 1)[1]
    return validate_endpoint(advertise)


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://`` endpoint (brackets off); None for ``ipc://``."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def _refuse_loopback(told: str, route: Route, encoder_url: str, setting: str) -> None:
    raise PeerUnavailable(
        f"{encoder_url} is on another host ({route.peer}) but would be told to deliver to "
        f"{told}, which only this host reaches: set {setting} to an address of this host that "
        f"it can reach (this host reaches it from {route.source}), or leave it unset to have "
        f"one chosen per encoder")


async def choose_mooncake_host(config: ClientConfig, routes: Routes) -> str:
    """``mooncake_host``, else this host's address on the route to the first peer it knows
    that is not on this host (see the module docstring; such an address reaches local
    encoders too); loopback when every known peer is local, or none is known or routable."""
    if config.mooncake_host:
        return config.mooncake_host
    peers = [*config.encoder_urls, *filter(None, (config.bootstrap_url, config.discovery_dns))]
    for url in peers:
        try:
            route = await routes.to(url_host(url))
        except PeerUnavailable as exc:
            log.info("mooncake host: %s is no guide (%s)", url, exc.message)
            continue
        if not route.source.is_loopback:
            log.info("mooncake host: %s, this host's address on the route to %s", route.source, url)
            return str(route.source)
    return "127.0.0.1"


@dataclass(frozen=True)
class AddressStatistics:
    endpoints: tuple[str, ...]  # where the PULL socket listens
    told: str  # the one endpoint every encoder is told, or "" when each is told its own
    route_lookups: int  # routes found afresh (cached ones not counted)


async def check_session(routes: Routes, host: str, encoder_url: str) -> None:
    """Refuse (``PeerUnavailable``) a transfer engine named ``host`` on loopback for an
    encoder on another host; a host whose route cannot be found is trusted."""
    if not is_loopback_host(host):
        return
    try:
        route = await routes.to(url_host(encoder_url))
    except PeerUnavailable:
        return  # the connection to the encoder will tell
    if not route.local:
        _refuse_loopback(f"the Mooncake session {host}", route, encoder_url,
                         "ClientConfig.mooncake_host")


class PullEndpoints:
    """Per encoder, the endpoint of the client's PULL socket it is told (checked and
    bound on first need)."""

    def __init__(self, config: ClientConfig, routes: Routes, pull: PullReceiver) -> None:
        self._config = config
        self._routes = routes
        self._pull = pull
        self._fixed: str | None = None  # one endpoint for every encoder
        self._port: str | None = None  # a wildcard bind's port, told with each route's source
        self._bound: dict[IPAddress, str] = {}  # automatic binds: source address → endpoint
        if config.zmq_bind is not None:
            bound = pull.bind(config.zmq_bind)
            host = endpoint_host(bound)
            if config.zmq_advertise or host is None or not is_wildcard(host):
                self._fixed = advertised_endpoint(bound, config.zmq_advertise)
            else:
                self._port = bound.rsplit(":", 1)[1]

    @property
    def endpoint(self) -> str:
        """The one endpoint every encoder is told, when the configuration names one; else ""."""
        return self._fixed or ""

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every endpoint the PULL socket listens on."""
        return tuple(self._pull.endpoints)

    async def endpoint_for(self, encoder_url: str) -> str:
        """The endpoint a part going to ``encoder_url`` is told.

        Raises ``EncoderUnreachable`` (the part may move) when the encoder's host does not
        resolve or has no route, ``PeerUnavailable`` when the configured address cannot
        reach it.
        """
        if self._fixed is not None:
            if is_loopback_host(endpoint_host(self._fixed)):
                route = await self._route_if_known(encoder_url)
                if route is not None and not route.local:
                    setting = "zmq_advertise" if self._config.zmq_advertise else "zmq_bind"
                    _refuse_loopback(self._fixed, route, encoder_url, f"ClientConfig.{setting}")
            return self._fixed
        route = await self._route(encoder_url)
        if self._port is not None:
            return f"tcp://{route.source_host}:{self._port}"
        return self._bind_for(route)

    async def _route(self, encoder_url: str) -> Route:
        try:
            return await self._routes.to(url_host(encoder_url))
        except PeerUnavailable as exc:
            raise EncoderUnreachable(f"{encoder_url}: {exc.message}") from None

    async def _route_if_known(self, encoder_url: str) -> Route | None:
        """The route, or None when it cannot be found: a fixed address is then trusted
        (the connection to the encoder will tell)."""
        try:
            return await self._routes.to(url_host(encoder_url))
        except PeerUnavailable:
            return None

    def _bind_for(self, route: Route) -> str:
        """The endpoint bound on ``route.source``, bound now if it is the first."""
        endpoint = self._bound.get(route.source)
        if endpoint is None:
            endpoint = self._bound[route.source] = self._pull.bind(f"tcp://{route.source_host}:0")
            log.info("receiving ZMQ deliveries on %s (the route to %s)", endpoint, route.host)
        return endpoint

    def statistics(self) -> AddressStatistics:
        return AddressStatistics(self.endpoints, self.endpoint, self._routes.lookups)

    def __repr__(self) -> str:
        told = self._fixed or (f"each route's source, port {self._port}" if self._port else
                               f"{len(self._bound)} automatic binds")
        return f"<PullEndpoints {told}>"
