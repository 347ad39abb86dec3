"""Serving the encoder over HTTP (``epd_trio._listen``: the built-in server, or Hypercorn's protocol).

``serve_encoder(config)`` is an ``async with`` block: the engine, the service
and the HTTP server live exactly as long as it. Once the port is bound (so the
advertised URL is real, and checked against the registries before the model
loads) the encoder registers with each ``register_url`` registry and keeps
re-announcing itself. With ``grpc_port`` a gRPC server
(``encoder.grpc_server``) serves the same service beside HTTP. Leaving the block shuts down in the
order that loses nothing: health checks say "draining" (a readiness probe takes the
encoder out of rotation), unregister (so registries stop routing new work
here), stop admitting (503) and let live requests finish within
``drain_timeout`` while HTTP (and gRPC) still answers, then stop HTTP and gRPC, then cancel
what is left, then unload the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final
from urllib.parse import urlsplit

import trio

from epd_trio._listen import Listener, bound_listener, check_bindable, start_http_server
from epd_trio._routes import Route, find_route, is_loopback_host, is_wildcard, url_host
from epd_trio.bootstrap.registration import Registration, open_registration
from epd_trio.config import EncoderConfig
from epd_trio.encoder.app import create_app
from epd_trio.encoder.asgi_route import ASGIApp
from epd_trio.encoder.grpc_server import GrpcServer, open_grpc_server
from epd_trio.encoder.service import EncoderService, open_encoder_service
from epd_trio.encoder.sglang_app import create_sglang_app
from epd_trio.encoder.vllm_app import create_vllm_app
from epd_trio.engine import Engine, open_engine
from epd_trio.errors import PeerUnavailable, RequestError
from epd_trio.protocol.urls import normalize_url

__all__ = ["EncoderServer", "run_encoder", "serve_encoder"]

log = logging.getLogger(__name__)

# ``--api`` → the face that speaks it; a face is one module and one line here.
FACES: Final[Mapping[str, Callable[[EncoderService], ASGIApp]]] = MappingProxyType({
    "native": create_app,
    "sglang": create_sglang_app,
    "vllm": create_vllm_app,
})

# Requests have drained before the HTTP server is told to stop; what remains are idle
# keep-alive connections, which need no long grace.
_HTTP_GRACE = 2.0
_ROUTE_TIMEOUT = 10.0  # seconds a registry's name may take to resolve, at start


@dataclass(frozen=True)
class EncoderServer:
    url: str  # where the HTTP server is bound
    service: EncoderService
    advertise_url: str  # what registries are told (``--advertise-url``, or derived from ``url``)
    registration: Registration | None = None  # None without ``register_url``
    grpc: GrpcServer | None = None  # None without ``grpc_port``
    _stop: trio.Event = dataclasses.field(default_factory=trio.Event, repr=False)

    def shutdown(self) -> None:
        """Ask ``run_encoder`` for a graceful shutdown (drain, then stop)."""
        self._stop.set()


@asynccontextmanager
async def serve_encoder(config: EncoderConfig) -> AsyncIterator[EncoderServer]:
    """Run an encoder server for the duration of the block (``port=0`` works)."""
    if config.grpc_port:  # grpcio binds after the model loads; a port in use is said now
        await check_bindable(config.host, config.grpc_port, "--host, --grpc-port")
    async with bound_listener(config.host, config.port) as listener:
        # Before the model loads: an address no registry could reach is said at once.
        advertise = await advertised_url(config, listener.url)
        config = _with_mooncake_host(config, advertise)
        async with open_engine(config.engine) as engine, \
                open_encoder_service(config, engine) as service, \
                trio.open_nursery() as nursery:
            async with _serving(config, listener, advertise, engine, service, nursery) as server:
                yield server


@asynccontextmanager
async def _serving(config: EncoderConfig, listener: Listener, advertise: str, engine: Engine,
                   service: EncoderService, nursery: trio.Nursery) -> AsyncIterator[EncoderServer]:
    """HTTP (and gRPC) up, then registered; on the way out: health says draining (readiness
    fails at once), unregistered, drained, stopped."""
    stop = trio.Event()
    url = await start_http_server(nursery, FACES[config.api](service), listener,
                                  server=config.http_server, graceful_timeout=_HTTP_GRACE,
                                  shutdown_trigger=stop.wait, max_header_bytes=config.max_header_bytes)
    log.info("encoder %s serving on %s (registries are told %s)", engine.model_info.model_type,
             url, advertise)
    async with _maybe_grpc(config, service) as grpc_server:
        try:
            async with open_registration(config.register_url, advertise,
                                         heartbeat_interval=config.heartbeat_interval,
                                         auth_token=config.registry_auth_token) as registration:
                try:
                    yield EncoderServer(url=url, service=service, advertise_url=advertise,
                                        registration=registration if config.register_url else None,
                                        grpc=grpc_server)
                finally:
                    service.begin_shutdown()
            # Leaving that block unregistered us (shielded, bounded) before the drain.
        finally:
            with trio.CancelScope(shield=True):  # bounded by drain_timeout
                await service.drain()  # gRPC health says NOT_SERVING meanwhile
            stop.set()
        # Leaving _maybe_grpc stops the gRPC server once the requests have drained.


@asynccontextmanager
async def _maybe_grpc(config: EncoderConfig, service: EncoderService) -> AsyncIterator[GrpcServer | None]:
    if config.grpc_port is None:
        yield None
        return
    async with open_grpc_server(service, config.host, config.grpc_port, grace=_HTTP_GRACE) as server:
        yield server


async def advertised_url(config: EncoderConfig, bound_url: str) -> str:
    """What registries are told: ``--advertise-url``, else the bound URL with a wildcard host
    (which no peer can dial) replaced by this host's address on the route to the first
    registry on another host, else by this machine's hostname.

    Raises ``ValueError`` naming the flags when a registry on another host would be told a
    loopback address (it would probe, and hand clients, its own loopback).
    """
    registries = [(url, await _route_or_none(url)) for url in config.register_url]
    url = config.advertise_url or _bound_for_peers(bound_url, registries)
    host = urlsplit(url).hostname
    for registry, route in registries:
        if route is not None and not route.local and is_loopback_host(host):
            flag = "--advertise-url" if config.advertise_url else "--host"
            raise ValueError(
                f"registry {registry} is on another host, which cannot reach this encoder at "
                f"{url} ({flag}): listen on an address it can reach (--host 0.0.0.0 picks "
                f"this host's address on the route to it, {route.source}) or pass --advertise-url")
    return url


def _bound_for_peers(bound_url: str, registries: list[tuple[str, Route | None]]) -> str:
    parts = urlsplit(bound_url)
    host = parts.hostname or ""
    if not is_wildcard(host):
        return bound_url
    remote = [route for _, route in registries if route is not None and not route.local]
    found = remote[0].source_host if remote else socket.gethostname()
    netloc = f"[{found.strip('[]')}]:{parts.port}" if ":" in found else f"{found}:{parts.port}"
    try:
        return normalize_url(f"{parts.scheme}://{netloc}", "advertise_url")
    except RequestError as exc:
        if registries:
            raise ValueError(f"{exc.message}; pass --advertise-url") from None
        return bound_url


async def _route_or_none(registry_url: str) -> Route | None:
    """The route to a registry, or None when it is not known yet (it may come up later)."""
    try:
        return await find_route(url_host(registry_url), timeout=_ROUTE_TIMEOUT)
    except PeerUnavailable as exc:
        log.warning("cannot tell how registry %s reaches this encoder: %s", registry_url, exc.message)
        return None


def _with_mooncake_host(config: EncoderConfig, advertise: str) -> EncoderConfig:
    """The Mooncake engine's name: ``--mooncake-host``, else ``--host``, else (a wildcard) the
    advertised URL's host, which peers reach this machine at."""
    if not config.uses_mooncake or config.mooncake_host:
        return config
    host = config.host if not is_wildcard(config.host) else urlsplit(advertise).hostname
    return dataclasses.replace(config, mooncake_host=host)


async def run_encoder(config: EncoderConfig, *,
                      task_status: trio.TaskStatus[EncoderServer] = trio.TASK_STATUS_IGNORED) -> None:
    """``await nursery.start(run_encoder, config)`` → the server.

    ``server.shutdown()`` drains gracefully; cancelling the task is a hard stop
    (live requests are cut off, but nothing hangs or leaks).
    """
    async with serve_encoder(config) as server:
        task_status.started(server)
        await server._stop.wait()
