"""Serving the encoder over HTTP with Hypercorn's trio worker.

``serve_encoder(config)`` is an ``async with`` block: the engine, the service
and the HTTP server live exactly as long as it. Leaving it shuts down in the
order that loses nothing: stop admitting (503) and let live requests finish
within ``drain_timeout`` while HTTP still answers, then stop Hypercorn, then
cancel what is left, then unload the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import hypercorn.config
import hypercorn.trio
import trio

from epd_trio.config import EncoderConfig
from epd_trio.encoder.app import create_app
from epd_trio.encoder.service import EncoderService, open_encoder_service
from epd_trio.engine import open_engine

__all__ = ["EncoderServer", "run_encoder", "serve_encoder"]

log = logging.getLogger(__name__)

# Requests have drained before Hypercorn is told to stop; what remains are idle
# keep-alive connections, which need no long grace.
_HTTP_GRACE = 2.0


@dataclass(frozen=True)
class EncoderServer:
    url: str
    service: EncoderService
    _stop: trio.Event = dataclasses.field(default_factory=trio.Event, repr=False)

    def shutdown(self) -> None:
        """Ask ``run_encoder`` for a graceful shutdown (drain, then stop)."""
        self._stop.set()


def hypercorn_config(config: EncoderConfig) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.graceful_timeout = _HTTP_GRACE
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


@asynccontextmanager
async def serve_encoder(config: EncoderConfig) -> AsyncIterator[EncoderServer]:
    """Run an encoder server for the duration of the block (``port=0`` works)."""
    async with open_engine(config.engine) as engine, \
            open_encoder_service(config, engine) as service, \
            trio.open_nursery() as nursery:
        stop = trio.Event()
        serve = functools.partial(hypercorn.trio.serve, create_app(service),
                                  hypercorn_config(config), shutdown_trigger=stop.wait)
        urls = await nursery.start(serve)
        server = EncoderServer(url=urls[0], service=service)
        log.info("encoder %s serving on %s", engine.model_info.model_type, server.url)
        try:
            yield server
        finally:
            with trio.CancelScope(shield=True):  # bounded by drain_timeout
                await service.drain()
            stop.set()


async def run_encoder(config: EncoderConfig, *,
                      task_status: trio.TaskStatus[EncoderServer] = trio.TASK_STATUS_IGNORED) -> None:
    """``await nursery.start(run_encoder, config)`` → the server.

    ``server.shutdown()`` drains gracefully; cancelling the task is a hard stop
    (live requests are cut off, but nothing hangs or leaks).
    """
    async with serve_encoder(config) as server:
        task_status.started(server)
        await server._stop.wait()
