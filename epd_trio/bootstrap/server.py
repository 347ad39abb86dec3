"""Serving the bootstrap registry over HTTP (``epd_trio._listen``: the built-in server, or Hypercorn's protocol).

``serve_bootstrap(config)`` is an ``async with`` block, embeddable in any trio
program (a language server can host its own registry): the registry, its
supervised health loop and the HTTP server live exactly as long as the block.
Leaving it stops the HTTP server (registrations stop), then cancels the health loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import trio

from epd_trio._http import guarded_app
from epd_trio._listen import bound_listener, start_http_server
from epd_trio.bootstrap.app import MAX_HEADER_BYTES, create_app
from epd_trio.bootstrap.health import HealthLoop, HealthLoopStatistics, Probe, http_probe
from epd_trio.bootstrap.registry import Registry, RegistryStatistics
from epd_trio.config import BootstrapConfig

__all__ = ["BootstrapServer", "BootstrapStatistics", "run_bootstrap", "serve_bootstrap"]

log = logging.getLogger(__name__)

# Registry requests are tiny and answered at once; what the HTTP server waits for on
# shutdown is mostly idle keep-alive connections (encoders' heartbeats), which
# it would otherwise hold open for the whole grace period.
_HTTP_GRACE = 0.5


@dataclass(frozen=True)
class BootstrapStatistics:
    registry: RegistryStatistics
    health_loop: HealthLoopStatistics


@dataclass(frozen=True)
class BootstrapServer:
    url: str
    registry: Registry
    health: HealthLoop
    _stop: trio.Event = dataclasses.field(default_factory=trio.Event, repr=False)

    def statistics(self) -> BootstrapStatistics:
        return BootstrapStatistics(self.registry.statistics(), self.health.statistics())

    def shutdown(self) -> None:
        """Ask ``run_bootstrap`` to stop."""
        self._stop.set()


@asynccontextmanager
async def serve_bootstrap(config: BootstrapConfig, *, probe: Probe | None = None
                          ) -> AsyncIterator[BootstrapServer]:
    """Run a registry for the duration of the block (``port=0`` works).

    ``probe`` replaces the default ``GET {url}/health`` check (tests inject
    scripted or crashing ones).
    """
    registry = Registry(max_failures=config.max_failures, evicted_ttl=config.evicted_ttl,
                        max_encoders=config.max_encoders)
    # One keep-alive connection per encoder; move_on_after(health_timeout) is the
    # real deadline, httpx's own timeout only a backstop.
    async with bound_listener(config.host, config.port) as listener, \
            httpx.AsyncClient(timeout=config.health_timeout + 1.0,
                              limits=httpx.Limits(max_connections=None)) as http, \
            trio.open_nursery() as nursery:
        health = HealthLoop(registry, probe or http_probe(http),
                            interval=config.health_interval, timeout=config.health_timeout)
        stop = trio.Event()
        app = guarded_app(create_app(registry, health, auth_token=config.auth_token),
                          max_header_bytes=MAX_HEADER_BYTES)
        url = await start_http_server(nursery, app, listener, server=config.http_server,
                                      graceful_timeout=_HTTP_GRACE, shutdown_trigger=stop.wait,
                                      max_header_bytes=MAX_HEADER_BYTES)
        try:
            async with trio.open_nursery() as loops:
                await loops.start(health.run)
                server = BootstrapServer(url=url, registry=registry, health=health)
                log.info("bootstrap registry serving on %s (probes every %g s, %g s timeout, "
                         "evicts after %d misses; register %s)", server.url, config.health_interval,
                         config.health_timeout, config.max_failures,
                         "needs a token" if config.auth_token else "is open")
                try:
                    yield server
                finally:
                    loops.cancel_scope.cancel()
        finally:
            stop.set()  # the HTTP server closes its listeners, then idle connections


async def run_bootstrap(config: BootstrapConfig, *, probe: Probe | None = None,
                        task_status: trio.TaskStatus[BootstrapServer] = trio.TASK_STATUS_IGNORED) -> None:
    """``await nursery.start(run_bootstrap, config)`` → the server; ``server.shutdown()`` stops it."""
    async with serve_bootstrap(config, probe=probe) as server:
        task_status.started(server)
        await server._stop.wait()
