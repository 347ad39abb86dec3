"""``grpc.health.v1.Health``: the gRPC face of ``/health``.

``SERVING`` exactly when ``/health`` would answer ok (the same check: a real
tiny encode unless batches completed lately), for ``""`` and for each service
this server has; ``NOT_SERVING`` while draining or when the check fails (or
cannot run: the encoder is stopping); an unknown service name is
``NOT_FOUND`` for ``Check`` and ``SERVICE_UNKNOWN`` for ``Watch``, as the
health protocol says (that stream stays open until the client or the server
ends it).

``Watch`` sends the status at once, then a message only when it changes. All
streams share one check per ``WATCH_INTERVAL`` (a hundred watchers never
cause a hundred probes, even while the probe fails and nothing is fresh),
and the start of a drain wakes them at once (``wake``, called by the server
when the service starts draining). At server stop, ``close`` ends every
stream, so they do not hold the stop for its whole grace period.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Collection
from typing import Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd_trio.encoder.grpc_bridge import TrioBridge
from epd_trio.encoder.service import EncoderService
from epd_trio.errors import EPDError

__all__ = ["HealthServicer", "WATCH_INTERVAL"]

WATCH_INTERVAL: Final = 1.0  # seconds between the Watch streams' (shared) checks
Status = health_pb2.HealthCheckResponse


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Answers from the service's own health check, through the bridge.

    Built anywhere; every method but the constructor runs on the gRPC loop.
    """

    def __init__(self, service: EncoderService, bridge: TrioBridge, services: Collection[str]) -> None:
        self._service = service
        self._bridge = bridge
        self._known = frozenset({"", *services})
        self._timeout = service.config.health_timeout + 5.0  # the check bounds itself; this is a backstop
        self._shared: asyncio.Task[int] | None = None  # the Watch streams' check, in flight or recent
        self._shared_at = -math.inf  # loop time it finished
        self._changed: asyncio.Event | None = None  # replaced by each wake: set = "look again now"
        self._closed = False

    # ---- the status -------------------------------------------------------------------
    async def _status(self) -> int:
        if self._service.draining:  # a bool, read across threads: no trio call needed
            return Status.NOT_SERVING

        async def check() -> int:
            report = await self._service.check_health()
            return Status.SERVING if report.healthy else Status.NOT_SERVING
        try:
            return await self._bridge.run(check, self._timeout)
        except EPDError:  # the encoder is stopping, or the check overran its backstop
            return Status.NOT_SERVING

    async def _watched_status(self) -> int:
        """One check for every Watch stream per ``WATCH_INTERVAL``."""
        if self._service.draining:
            return Status.NOT_SERVING
        loop = asyncio.get_running_loop()
        shared = self._shared
        if shared is None or (shared.done() and loop.time() - self._shared_at >= WATCH_INTERVAL):
            shared = self._shared = loop.create_task(self._status())
            shared.add_done_callback(lambda _: setattr(self, "_shared_at", loop.time()))
        return await asyncio.shield(shared)  # a stream that leaves does not cancel the others' check

    # ---- the server's hooks (on the loop) ------------------------------------------------
    def wake(self) -> None:
        """Make every Watch stream look again now (the service has started draining)."""
        self._shared = None
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        """End every Watch stream: the server is stopping."""
        self._closed = True
        self.wake()

    def _event(self) -> asyncio.Event:
        """The event the next ``wake`` sets: taken *before* looking at the status, so a
        wake while the look is under way is not missed."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    @staticmethod
    async def _wait(changed: asyncio.Event, timeout: float | None) -> None:
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            pass

    # ---- the RPCs ------------------------------------------------------------------
    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 (grpc's name)
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        if request.service not in self._known:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return Status(status=await self._status())

    async def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if request.service not in self._known:
            yield Status(status=Status.SERVICE_UNKNOWN)
            while not self._closed:  # the protocol keeps the stream open; the client ends it
                await self._wait(self._event(), None)
            return
        last = None
        while not self._closed:
            changed = self._event()
            status = await self._watched_status()
            if status != last:
                yield Status(status=status)
                last = status
            await self._wait(changed, WATCH_INTERVAL)
