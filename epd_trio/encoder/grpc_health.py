"""``grpc.health.v1.Health``: the gRPC face of ``/health``.

``SERVING`` exactly when ``/health`` would answer ok (the same check: a real
tiny encode unless batches completed lately), for ``""`` and for each service
this server has; ``NOT_SERVING`` while draining or when the check fails; an
unknown service name is ``NOT_FOUND`` for ``Check`` and ``SERVICE_UNKNOWN`` for
``Watch``, as the health protocol says. ``Watch`` re-checks every
``WATCH_INTERVAL`` seconds and sends a message only when the status changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from typing import Final

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd_trio.encoder.grpc_bridge import TrioBridge
from epd_trio.encoder.service import EncoderService

__all__ = ["HealthServicer", "WATCH_INTERVAL"]

WATCH_INTERVAL: Final = 1.0  # seconds between a Watch stream's checks
Status = health_pb2.HealthCheckResponse


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Answers from the service's own health check, through the bridge."""

    def __init__(self, service: EncoderService, bridge: TrioBridge, services: Collection[str]) -> None:
        self._service = service
        self._bridge = bridge
        self._known = frozenset({"", *services})
        self._timeout = service.config.health_timeout + 5.0  # the check bounds itself; this is a backstop

    async def _status(self) -> int:
        async def check() -> int:
            report = await self._service.check_health()
            return Status.SERVING if report.healthy else Status.NOT_SERVING
        return await self._bridge.run(check, self._timeout)

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 (grpc's name)
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        if request.service not in self._known:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return Status(status=await self._status())

    async def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if request.service not in self._known:
            yield Status(status=Status.SERVICE_UNKNOWN)
            await asyncio.Event().wait()  # the protocol keeps the stream open; the client ends it
        last = None
        while True:
            status = await self._status()
            if status != last:
                yield Status(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL)
