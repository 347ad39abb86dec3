"""Deliveries: how an embedding leaves the encoder, one transport per module.

``FACTORIES`` is the registration table: a request's ``deliver.backend``
names the factory that builds its delivery. Adding a delivery is one module
(a class with ``sized``/``deliver``/``fail``/``aclose`` and a ``for_request``
factory) and one line here; the request lifecycle never names a backend.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import Final

import trio

from epd_trio.config import EncoderConfig
from epd_trio.delivery.base import (
    Answer,
    Delivery,
    DeliveryContext,
    DeliveryFactory,
    PulledDelivery,
    map_exceptions,
)
from epd_trio.delivery.inline import InlineDelivery
from epd_trio.delivery.mooncake import MooncakeDelivery
from epd_trio.delivery.sglang_mooncake import SGLangMooncakeDelivery
from epd_trio.delivery.sglang_rendezvous import Rendezvous
from epd_trio.delivery.sglang_zmq import SGLangZmqDelivery
from epd_trio.delivery.vllm_mooncake import EcControl, VllmMooncakeDelivery
from epd_trio.delivery.vllm_storage import VllmStorageDelivery
from epd_trio.delivery.zmq import ZmqDelivery
from epd_trio.errors import RequestError
from epd_trio.protocol.requests import EncodeRequest
from epd_trio.transport.mooncake import MooncakeTransport, open_mooncake
from epd_trio.transport.zmq import PushSocketCache
from epd_trio.transport.zmq_request import RequestSockets

__all__ = [
    "Answer",
    "Delivery",
    "DeliveryContext",
    "DeliveryFactory",
    "FACTORIES",
    "InlineDelivery",
    "MooncakeDelivery",
    "PulledDelivery",
    "Rendezvous",
    "SGLangMooncakeDelivery",
    "SGLangZmqDelivery",
    "VllmMooncakeDelivery",
    "VllmStorageDelivery",
    "ZmqDelivery",
    "build_delivery",
    "map_exceptions",
    "open_deliveries",
]

# Threads that build large inline answers off the event loop (each holds one body).
DELIVERY_THREADS: Final = 2

FACTORIES: Mapping[str, DeliveryFactory] = MappingProxyType({
    "inline": InlineDelivery.for_request,
    "zmq": ZmqDelivery.for_request,
    "mooncake": MooncakeDelivery.for_request,
    "sglang_zmq": SGLangZmqDelivery.for_request,
    "sglang_mooncake": SGLangMooncakeDelivery.for_request,
    "vllm_storage": VllmStorageDelivery.for_request,
    "vllm_mooncake": VllmMooncakeDelivery.for_request,
})


def build_delivery(request: EncodeRequest, context: DeliveryContext) -> Delivery:
    """The delivery ``request`` asks for; a backend this encoder lacks is a 400."""
    factory = FACTORIES.get(request.deliver.backend)
    if factory is None:
        raise RequestError(f"this encoder has no {request.deliver.backend!r} delivery",
                           req_id=request.req_id)
    return factory(request, context)


@asynccontextmanager
async def open_deliveries(config: EncoderConfig) -> AsyncIterator[DeliveryContext]:
    """The transports this encoder's deliveries borrow, open for the block."""
    async with PushSocketCache(max_sockets=config.zmq_max_sockets, idle_close=config.zmq_idle_close,
                               sndhwm=config.zmq_sndhwm) as zmq, \
            _maybe_mooncake(config) as mooncake, _maybe_vllm_control(config) as vllm_control:
        yield DeliveryContext(zmq, mooncake, config.send_timeout, trio.CapacityLimiter(DELIVERY_THREADS),
                              Rendezvous(max_early=config.sglang_max_early_calls),
                              vllm_storage=config.vllm_storage_path, vllm_control=vllm_control)


@asynccontextmanager
async def _maybe_mooncake(config: EncoderConfig) -> AsyncIterator[MooncakeTransport | None]:
    if not config.uses_mooncake:
        yield None
        return
    host = config.mooncake_host or ("127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host)
    async with open_mooncake(host, config.effective_mooncake_protocol, config.mooncake_device) as mooncake:
        yield mooncake


@asynccontextmanager
async def _maybe_vllm_control(config: EncoderConfig) -> AsyncIterator[EcControl | None]:
    ec = config.vllm_ec
    if ec is None or ec.control_timeout is None:
        yield None
        return
    async with RequestSockets() as sockets:
        yield EcControl(sockets, ec.control_timeout)
