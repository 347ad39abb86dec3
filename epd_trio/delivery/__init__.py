"""Deliveries: how an embedding leaves the encoder, one transport per module.

``FACTORIES`` is the registration table: a request's ``deliver.backend``
names the factory that builds its delivery. Adding a delivery is one module
(a class with ``sized``/``deliver``/``fail``/``aclose`` and a ``for_request``
factory) and one line here; the request lifecycle never names a backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

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
from epd_trio.delivery.zmq import ZmqDelivery
from epd_trio.errors import RequestError
from epd_trio.protocol.requests import EncodeRequest

__all__ = [
    "Answer",
    "Delivery",
    "DeliveryContext",
    "DeliveryFactory",
    "FACTORIES",
    "InlineDelivery",
    "MooncakeDelivery",
    "PulledDelivery",
    "ZmqDelivery",
    "build_delivery",
    "map_exceptions",
]

FACTORIES: Mapping[str, DeliveryFactory] = MappingProxyType({
    "inline": InlineDelivery.for_request,
    "zmq": ZmqDelivery.for_request,
    "mooncake": MooncakeDelivery.for_request,
})


def build_delivery(request: EncodeRequest, context: DeliveryContext) -> Delivery:
    """The delivery ``request`` asks for; a backend this encoder lacks is a 400."""
    factory = FACTORIES.get(request.deliver.backend)
    if factory is None:
        raise RequestError(f"this encoder has no {request.deliver.backend!r} delivery",
                           req_id=request.req_id)
    return factory(request, context)
