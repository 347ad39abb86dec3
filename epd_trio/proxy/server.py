"""Serving the EPD proxy: ``async with serve_proxy(config) as server:``.

The block owns everything the proxy uses: the listening socket (bound first,
so a port in use is said at once), the encoder client (its discovery task
among them), the HTTP client to the language servers with their health loop,
and the HTTP server (``--http-server``: the built-in one by default). Leaving
the block stops accepting, gives open requests ``_HTTP_GRACE`` seconds (a stream
may run long: what is still open then is cancelled), then closes the clients,
which closes every call still open.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final

import httpx
import trio

from epd_trio._listen import bound_listener, start_http_server
from epd_trio.bootstrap.health import HealthLoop, http_probe
from epd_trio.client import open_encoder_client
from epd_trio.config import ProxyConfig
from epd_trio.proxy.app import MAX_HEADER_BYTES, ProxyApp
from epd_trio.proxy.service import EPDProxy
from epd_trio.proxy.upstream import LanguageServers

__all__ = ["ProxyServer", "serve_proxy"]

log = logging.getLogger(__name__)

# Seconds open requests get to finish once the proxy is told to stop.
_HTTP_GRACE: Final = 5.0


@dataclass(frozen=True)
class ProxyServer:
    url: str  # where the proxy listens
    proxy: EPDProxy
    health: HealthLoop  # the language servers' probes


@asynccontextmanager
async def serve_proxy(config: ProxyConfig) -> AsyncIterator[ProxyServer]:
    """Run the proxy for the duration of the block (``port=0`` works)."""
    servers = LanguageServers(config.prefill_decode_urls, max_failures=config.max_failures)
    # Our own deadlines bound every wait (trio cancel scopes); httpx bounds only connecting.
    timeout = httpx.Timeout(None, connect=config.connect_timeout)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with bound_listener(config.host, config.port) as listener, \
            open_encoder_client(config.client_config()) as client, \
            httpx.AsyncClient(timeout=timeout, limits=limits) as http, \
            httpx.AsyncClient(timeout=config.health_timeout + 1.0) as probes, \
            trio.open_nursery() as background:
        health = HealthLoop(servers.registry, http_probe(probes), interval=config.health_interval,
                            timeout=config.health_timeout, what="language server")
        await background.start(health.run)
        proxy = EPDProxy(config, client, servers, http)
        try:
            async with trio.open_nursery() as serving:
                stop = trio.Event()
                url = await start_http_server(serving, ProxyApp(proxy), listener,
                                              server=config.http_server, graceful_timeout=_HTTP_GRACE,
                                              shutdown_trigger=stop.wait,
                                              max_header_bytes=MAX_HEADER_BYTES)
                log.info("EPD proxy serving on %s: encoders %s%s; language servers %s", url,
                         ", ".join(client.encoders) or "none yet",
                         f" and the registry {config.bootstrap_url}" if config.bootstrap_url else "",
                         ", ".join(config.prefill_decode_urls))
                try:
                    yield ProxyServer(url, proxy, health)
                finally:
                    stop.set()  # stop accepting; open requests get _HTTP_GRACE, then are cancelled
        finally:
            background.cancel_scope.cancel()
